"""Closed-loop load from Python clients, for bench/run.sh's client rows: the same workloads as
attnserve-bench (batch 1, E=512 float32 queries of drawn lengths, self-attention on the `demo` model) sent
through tritonclient's ModelInfer over gRPC ("oip") or over HTTP with binary tensor data ("oip_http", the
target then an HTTP port) or the attnserve package's Client.attend ("pypkg"), one thread and
one client per caller. Appends one JSON line in attnserve-bench's format.

usage: python_clients.py --client oip|oip_http|oip_http_json|http_json_raw|pypkg --target HOST:PORT --callers N --lengths fixed:L|uniform:A:B
                         --duration S --warmup S --label LABEL --json FILE
Run oip and oip_http with tools/oip-env.sh's python, pypkg with tools/python-env.sh newest's.
"""
import argparse
import json
import threading
import time

import numpy as np

E = 512


def caller_fn(kind, target):
    """A function sending one query and returning once answered (raises on an error)."""
    if kind == "http_json_raw":
        # JSON tensors without a client's own JSON work: each query's body made once, sent on a
        # kept-alive connection, the answer read whole and not parsed (what the servers cost).
        import http.client
        import json as _json
        host, port = target.rsplit(":", 1)
        conn = [http.client.HTTPConnection(host, int(port), timeout=120)]
        bodies = {}

        def call(q):
            key = id(q)
            if key not in bodies:
                bodies[key] = _json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": list(q.shape),
                                                       "data": q.ravel().tolist()}]})
            conn[0].request("POST", "/v2/models/demo/infer", body=bodies[key],
                            headers={"Content-Type": "application/json"})
            r = conn[0].getresponse()
            data = r.read()
            if r.status != 200:
                raise RuntimeError(f"{r.status} {data[:200]!r}")
        return call
    if kind in ("oip_http", "oip_http_json"):
        # The Open Inference Protocol over HTTP: binary tensor data both ways, or JSON tensors (what
        # a server without the binary extension, MLServer's, takes).
        import tritonclient.http as th
        client = th.InferenceServerClient(target, connection_timeout=120, network_timeout=120)
        binary = kind == "oip_http"

        def call(q):
            t = th.InferInput("query", list(q.shape), "FP32")
            t.set_data_from_numpy(q, binary_data=binary)
            client.infer("demo", [t], outputs=[th.InferRequestedOutput("attn_output", binary_data=binary)]) \
                .as_numpy("attn_output")
        return call
    if kind == "oip":
        import tritonclient.grpc as tc
        client = tc.InferenceServerClient(target)

        def call(q):
            t = tc.InferInput("query", list(q.shape), "FP32")
            t.set_data_from_numpy(q)
            client.infer("demo", [t]).as_numpy("attn_output")
        return call
    import attnserve
    client = attnserve.Client(target)
    return lambda q: client.attend(q, model="demo").output


def query_pool(spec):
    """The 64 queries a client row sends in turn (batch 1, E=512 float32), their lengths drawn by `spec`
    ("fixed:L" or "uniform:A:B") with a fixed seed: the same for every client of bench/run.sh."""
    kind, *bounds = spec.split(":")
    rng = np.random.default_rng(7)
    lengths = [int(bounds[0])] * 64 if kind == "fixed" else rng.integers(int(bounds[0]), int(bounds[1]) + 1, 64)
    return [rng.standard_normal((1, int(n), E)).astype(np.float32) for n in lengths]


def report(a, client, duration, ok, errors, tokens_per_s, latency_ms):
    """One row in attnserve-bench's format: printed, and appended to `a.json` when given."""
    row = {"label": a.label, "target": a.target, "client": client, "mode": "closed", "callers": a.callers,
           "lengths": a.lengths, "cross": 0.0, "rate": 0.0, "duration_s": duration, "ok": ok, "errors": errors,
           "requests_per_s": ok / duration, "tokens_per_s": tokens_per_s, "latency_ms": latency_ms}
    print(f"{a.label}: {row['requests_per_s']:.1f} req/s, {tokens_per_s:.0f} tok/s, p50 {latency_ms['p50']:.2f} ms, "
          f"p99 {latency_ms['p99']:.2f} ms, errors {errors}")
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("--client", "pypkg"), ("--target", "127.0.0.1:50071"), ("--callers", 1),
                          ("--lengths", "fixed:128"), ("--duration", 5.0), ("--warmup", 2.0), ("--label", ""),
                          ("--json", "")):
        ap.add_argument(name, default=default, type=type(default))
    a = ap.parse_args()
    pool = query_pool(a.lengths)

    start = time.monotonic()
    measure_from, stop_at = start + a.warmup, start + a.warmup + a.duration
    samples, errors, lock = [], {}, threading.Lock()

    def run(i):
        call = caller_fn(a.client, a.target)
        k = i
        while True:
            q = pool[k % len(pool)]
            k += a.callers
            sent = time.monotonic()
            if sent >= stop_at:
                return
            try:
                call(q)
                code = None
            except Exception as e:  # noqa: BLE001 -- counted by kind, like attnserve-bench's codes
                code = type(e).__name__
            done = time.monotonic()
            if sent >= measure_from and done <= stop_at:
                with lock:
                    if code is None:
                        samples.append(((done - sent) * 1e3, q.shape[1]))
                    else:
                        errors[code] = errors.get(code, 0) + 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(a.callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = np.array([s[0] for s in samples]) if samples else np.zeros(1)
    report(a, a.client, a.duration, len(samples), errors, sum(s[1] for s in samples) / a.duration,
           {q: float(np.percentile(lat, v)) for q, v in (("p50", 50), ("p90", 90), ("p99", 99))} |
           {"max": float(lat.max())})


if __name__ == "__main__":
    main()
