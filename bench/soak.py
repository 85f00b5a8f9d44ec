#!/usr/bin/python3
"""Soak: at least 100,000 mixed requests against the real attnserve binary (default flags, except a 4 MiB
message limit so that oversize answers are cheap to provoke): unary calls, streams, client cancels,
tight deadlines, bad shapes, undecodable bytes and oversize answers, from several threads at once.
Checks, and prints: the server's RSS over time (flat after warm-up), the in-flight gauges back to 0,
every outcome among the expected ones, and a clean exit 0 on SIGTERM.

usage: bench/soak.py PATH/TO/attnserve [--requests 100000] [--threads 8]
"""
import argparse
import collections
import faulthandler
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "lib"))
import attnserve_py as lib  # noqa: E402


def rss_mib(pid):
    return lib.status_kb(pid, "VmRSS") / 1024


def main():
    p = argparse.ArgumentParser()
    p.add_argument("binary")
    p.add_argument("--requests", type=int, default=100000)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--stall-seconds", type=float, default=90,
                   help="no request finishing for this long counts as a stall: both sides' stacks are dumped")
    a = p.parse_args()
    pb, stubs = lib.load_stubs()
    server = lib.Server(a.binary, "--max-message-bytes", str(4 << 20))
    pid = server.proc.pid
    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    channel = grpc.insecure_channel(server.target, options=opts)
    stub = stubs.AttentionServiceStub(channel)
    raw_attend = channel.unary_unary("/attnserve.v1.AttentionService/Attend")
    rng = np.random.default_rng(9)

    def request(b, lq, lk=0, weights=0, rid=0):
        r = pb.AttendRequest(model="demo", query=lib.to_wire(pb, rng.standard_normal((b, lq, 512))),
                             attn_weights=weights, request_id=rid)
        if lk:
            r.key.CopyFrom(lib.to_wire(pb, rng.standard_normal((b, lk, 512))))
            r.value.CopyFrom(lib.to_wire(pb, rng.standard_normal((b, lk, 512))))
        return r

    small = [request(1 + i % 3, 4 + 5 * i, 0 if i % 2 else 7 + i) for i in range(8)]
    big = request(4, 256)
    bad_shape = pb.AttendRequest(model="demo", query=pb.Tensor(dtype=1, shape=[1, 4, 511], data=b"\0" * 4 * 4 * 511))
    oversize = request(1, 512, weights=pb.ATTN_WEIGHTS_PER_HEAD)  # 8 MiB of weights > 4 MiB limit
    undecodable = b"\x0a\x02\xff\xfe"

    outcomes = collections.Counter()
    lock = threading.Lock()
    sent = [0]

    finished = [0, time.time()]  # requests finished, time of the latest

    def count(kind, code):
        with lock:
            outcomes[(kind, code)] += 1
            finished[0] += 1
            finished[1] = time.time()

    def take(n):
        with lock:
            if sent[0] >= a.requests:
                return 0
            n = min(n, a.requests - sent[0])
            sent[0] += n
            return n

    def worker(seed):
        r = np.random.default_rng(seed)
        while True:
            kind = r.choice(["unary", "unary", "unary", "stream", "cancel", "deadline", "bad", "undecodable",
                             "oversize", "big"], p=[0.3, 0.1, 0.1, 0.2, 0.06, 0.06, 0.06, 0.04, 0.04, 0.04])
            n = take(40 if kind == "stream" else 1)
            if n == 0:
                return
            try:
                if kind == "stream":
                    reqs = [small[int(r.integers(len(small)))] for _ in range(n)]
                    answers = 0
                    for resp in stub.AttendStream(iter(reqs), timeout=60):
                        answers += 1
                        count("stream-item", "error" if resp.HasField("error") else "OK")
                    count("stream", "OK" if answers == n else f"short {answers}/{n}")
                elif kind == "cancel":
                    f = stub.Attend.future(big, timeout=60)
                    time.sleep(float(r.random()) * 0.01)
                    f.cancel()
                    try:
                        f.result()
                        count(kind, "OK")
                    except grpc.FutureCancelledError:
                        count(kind, "CANCELLED")
                elif kind == "undecodable":
                    raw_attend(undecodable, timeout=30)
                    count(kind, "OK")
                else:
                    req = {"bad": bad_shape, "oversize": oversize, "big": big}.get(kind) or small[int(r.integers(len(small)))]
                    stub.Attend(req, timeout=0.002 if kind == "deadline" else 60)
                    count(kind, "OK")
            except grpc.RpcError as e:
                count(kind, e.code().name)

    samples = []
    done = threading.Event()

    stalled = []

    def sampler():
        start = time.time()
        while not done.is_set():
            samples.append((time.time() - start, rss_mib(pid), sent[0]))
            if not stalled and time.time() - finished[1] > a.stall_seconds:
                stalled.append(finished[0])
                diagnose_stall()
            done.wait(2.0)

    def diagnose_stall():
        print(f"STALL: no request finished for {a.stall_seconds:.0f} s after {finished[0]} finished; "
              f"outcomes so far: {dict(outcomes)}", flush=True)
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
        print("\n".join(l for l in body.splitlines() if "in_flight" in l or "rejected" in l), flush=True)
        print("client threads:", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        path = os.path.abspath("soak-stall-server-stacks.txt")
        with open(path, "w") as f:
            subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                           stdout=f, stderr=subprocess.STDOUT, timeout=120)
        print(f"server threads: {path}", flush=True)
        server.proc.kill()
        print("soak: 0 passed, 1 failed (stall)", flush=True)
        os._exit(1)

    start = time.time()
    threading.Thread(target=sampler, daemon=True).start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(a.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    elapsed = time.time() - start
    time.sleep(0.5)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    in_flight = {m.group(1): float(m.group(2)) for m in
                 re.finditer(r'^attnserve_requests_in_flight\{method="(\w+)"\} (\S+)$', metrics, re.M)}
    rss_end = rss_mib(pid)
    t0 = time.time()
    out = server.stop()  # SIGTERM; raises unless exit 0
    stop_s = time.time() - t0

    print(f"{sent[0]} requests in {elapsed:.0f} s ({sent[0] / elapsed:.0f}/s), {a.threads} threads")
    for (kind, code), n in sorted(outcomes.items()):
        print(f"  {kind:12s} {code:20s} {n}")
    warm = [s for s in samples if s[2] >= a.requests * 0.2]
    print("RSS MiB over time (s, MiB, requests sent): " +
          ", ".join(f"({t:.0f}, {m:.0f}, {n})" for t, m, n in samples[:: max(1, len(samples) // 12)]))
    if warm:
        lo, hi = min(s[1] for s in warm), max(s[1] for s in warm)
        print(f"after warm-up (20% of requests): RSS {lo:.0f}..{hi:.0f} MiB, first {warm[0][1]:.0f}, "
              f"last {rss_end:.0f}")
    print(f"in-flight gauges at the end: {in_flight}; SIGTERM: exit 0 in {stop_s:.1f} s")
    expected = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "error"}
    unexpected = {k: n for k, n in outcomes.items() if k[1] not in expected}
    ok = not unexpected and not stalled and all(v == 0 for v in in_flight.values())
    if unexpected:
        print("unexpected outcomes:", unexpected)
    print(f"soak: {1 if ok else 0} passed, {0 if ok else 1} failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
