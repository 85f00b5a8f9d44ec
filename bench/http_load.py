"""Closed-loop HTTP load from wrk (a C load generator, Debian's `wrk`), for bench/run.sh's JSON rows:
the servers' cost without a Python client's own (32 Python threads on one interpreter bound the
http_json_raw row near the servers' rates). The same queries as python_clients.py (batch 1, E=512
float32, drawn lengths, the `demo` model), each body made once as JSON tensors the way Python
clients write them (json.dumps of the values as Python floats), sent in turn on N kept-alive
connections by one wrk thread. Appends one JSON line in attnserve-bench's format; tokens/s is
requests/s times the bodies' mean length (wrk sends them in turn).

usage: http_load.py --target HOST:PORT --callers N --lengths fixed:L|uniform:A:B --duration S
                    --warmup S --label LABEL --json FILE
Run with tools/oip-env.sh's python (numpy).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

E = 512
HERE = os.path.dirname(os.path.abspath(__file__))


def wrk(target, callers, seconds, listing):
    out = subprocess.run(["wrk", "-t1", f"-c{callers}", f"-d{seconds}s", "--timeout", "60s",
                          "-s", os.path.join(HERE, "wrk", "oip_infer.lua"), f"http://{target}",
                          "--", listing, "demo", "application/json"],
                         check=True, capture_output=True, text=True).stdout
    m = re.search(r"^WRK_RESULT (.*)$", out, re.M)
    if not m:
        raise RuntimeError(f"wrk printed no result: {out[-500:]}")
    return json.loads(m.group(1))


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("--target", "127.0.0.1:8000"), ("--callers", 32), ("--lengths", "uniform:8:64"),
                          ("--duration", 5.0), ("--warmup", 2.0), ("--label", ""), ("--json", "")):
        ap.add_argument(name, default=default, type=type(default))
    a = ap.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("http_load.py: needs wrk (apt-get install wrk; tools/install-deps.sh --bench)")
    kind, *bounds = a.lengths.split(":")
    rng = np.random.default_rng(7)  # The same pool as python_clients.py's.
    lengths = [int(bounds[0])] * 64 if kind == "fixed" else rng.integers(int(bounds[0]), int(bounds[1]) + 1, 64)
    pool = [rng.standard_normal((1, int(n), E)).astype(np.float32) for n in lengths]
    with tempfile.TemporaryDirectory(prefix="attnserve-wrk-") as tmp:
        paths = []
        for i, q in enumerate(pool):
            paths.append(os.path.join(tmp, f"{i}.json"))
            with open(paths[-1], "w") as f:
                json.dump({"inputs": [{"name": "query", "datatype": "FP32", "shape": list(q.shape),
                                       "data": q.ravel().tolist()}]}, f)
        listing = os.path.join(tmp, "bodies")
        with open(listing, "w") as f:
            f.write("\n".join(paths) + "\n")
        if a.warmup > 0:
            wrk(a.target, a.callers, max(1, round(a.warmup)), listing)
        r = wrk(a.target, a.callers, max(1, round(a.duration)), listing)
    seconds = r["duration_us"] / 1e6
    errors = {k: r[k] for k in ("connect", "read", "write", "status", "timeout") if r[k]}
    rps = r["requests"] / seconds
    row = {"label": a.label, "target": a.target, "client": "wrk", "mode": "closed", "callers": a.callers,
           "lengths": a.lengths, "cross": 0.0, "rate": 0.0, "duration_s": seconds, "ok": r["requests"],
           "errors": errors, "requests_per_s": rps, "tokens_per_s": rps * float(np.mean(lengths)),
           "latency_ms": {"p50": r["p50_us"] / 1e3, "p90": r["p90_us"] / 1e3, "p99": r["p99_us"] / 1e3,
                          "max": r["max_us"] / 1e3}}
    print(f"{a.label}: {rps:.1f} req/s, {row['tokens_per_s']:.0f} tok/s, p50 {row['latency_ms']['p50']:.2f} ms, "
          f"p99 {row['latency_ms']['p99']:.2f} ms, errors {errors}")
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
