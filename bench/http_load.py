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

from python_clients import query_pool, report

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
        raise SystemExit("http_load.py: needs wrk (apt-get install wrk; bench/run.sh installs it)")
    pool = query_pool(a.lengths)  # python_clients.py's queries.
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
    mean_length = float(np.mean([q.shape[1] for q in pool]))
    report(a, "wrk", seconds, r["requests"], errors, r["requests"] / seconds * mean_length,
           {q: r[f"{q}_us"] / 1e3 for q in ("p50", "p90", "p99", "max")})


if __name__ == "__main__":
    main()
