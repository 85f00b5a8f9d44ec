"""attnserve over HTTP against attnserve over OIP gRPC, side by side in one run, through the clients
people use (tritonclient.http and tritonclient.grpc from tools/oip-env.sh): one caller, a [B, L, E]
float32 self-attention request on the demo model (E=512), rounds alternating between the three ways
(gRPC; HTTP with binary tensor data; HTTP with JSON tensors), p50 and p90 of each and the ratios.

usage: $(tools/oip-env.sh)/bin/python bench/oip_http.py [--build build] [--rounds 200] [--shape 1,128,512]
"""
import argparse
import os
import platform
import re
import subprocess
import sys
import time

import numpy as np
import tritonclient.grpc as tg
import tritonclient.http as th

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "lib"))
import attnserve_py as lib  # noqa: E402


def cpu_class():
    flags = open("/proc/cpuinfo").read()
    name = re.search(r"model name\s*:\s*(.*)", flags)
    cls = "AMX" if " amx_tile" in flags else "AVX512-BF16" if " avx512_bf16" in flags else \
        "AVX-512" if " avx512f" in flags else "AVX2"
    return f"{name.group(1) if name else platform.processor()} ({cls}, {os.cpu_count()} cores)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--shape", default="1,128,512")
    a = ap.parse_args()
    shape = [int(x) for x in a.shape.split(",")]
    server = lib.Server(os.path.join(a.build, "attnserve"))
    g = tg.InferenceServerClient(server.target)
    h = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)

    def grpc_call():
        t = tg.InferInput("query", shape, "FP32")
        t.set_data_from_numpy(x)
        return g.infer("demo", [t]).as_numpy("attn_output")

    def http_call(binary):
        t = th.InferInput("query", shape, "FP32")
        t.set_data_from_numpy(x, binary_data=binary)
        return h.infer("demo", [t], outputs=[th.InferRequestedOutput("attn_output", binary_data=binary)]) \
            .as_numpy("attn_output")

    # The same two requests with their bodies made once, sent and read whole by http.client: the
    # server's and the wire's part, without tritonclient's own JSON work on either side.
    import http.client
    import json
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port)
    json_body = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": shape,
                                        "data": [float(v) for v in x.ravel()]}],
                            "outputs": [{"name": "attn_output", "parameters": {"binary_data": False}}]})
    head = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": shape,
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "attn_output", "parameters": {"binary_data": True}}]}).encode()
    binary_body = head + x.tobytes()

    def raw_call(body, headers):
        conn.request("POST", "/v2/models/demo/infer", body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        assert r.status == 200, data[:200]
        return data

    ways = {"grpc": grpc_call, "http binary": lambda: http_call(True), "http json": lambda: http_call(False),
            "raw binary": lambda: raw_call(binary_body, {"Inference-Header-Content-Length": str(len(head))}),
            "raw json": lambda: raw_call(json_body, {"Content-Type": "application/json"})}
    first = {k: f() for k, f in list(ways.items())[:3]}
    assert all(np.array_equal(first["grpc"], v) for v in first.values()), "the ways disagree"
    times = {k: [] for k in ways}
    for _ in range(5):
        for f in ways.values():
            f()
    for _ in range(a.rounds):
        for k, f in ways.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    server.stop()
    print(f"cpu: {cpu_class()}; shape {shape} float32, one caller, {a.rounds} rounds each, alternating")
    p = {k: (np.percentile(v, 50), np.percentile(v, 90)) for k, v in times.items()}
    for k, (p50, p90) in p.items():
        print(f"{k:12s} p50 {p50:8.3f} ms  p90 {p90:8.3f} ms  ({1e3 / p50:7.1f} calls/s)")
    print(f"http binary / grpc throughput (p50 ratio grpc/http): {p['grpc'][0] / p['http binary'][0]:.3f} (goal >= 0.8)")
    print(f"http json p50 / http binary p50, through tritonclient: {p['http json'][0] / p['http binary'][0]:.2f}"
          f"; bodies made once (http.client): {p['raw json'][0] / p['raw binary'][0]:.2f} (goal <= 3)")


if __name__ == "__main__":
    main()
