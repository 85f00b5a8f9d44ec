#!/usr/bin/python3
"""Peak server memory for concurrent large answers: starts attnserve, sends N concurrent requests whose
answers are 8 MiB each (query [1, 4096, 512] float32), and prints the server's resident memory before,
its peak (VmHWM) and after.

usage: tests/integration/memory_check.py PATH/TO/attnserve [--concurrent 6] [--rounds 3] [--max-peak-mib N]
                             [-- server flags...]
With --max-peak-mib it is a test: exit 1 when the peak exceeds N MiB or a request fails.

With --kv-memories N it creates N memories of --length tokens one after another instead (4 MiB each
at 1,024 tokens), under the server's --kv-budget-bytes (pass it after --), and --max-growth-mib
bounds the peak's growth over the memory before: what the budget promises holds for the process.
"""
import argparse
import os
import sys
import threading

import grpc
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("binary")
    p.add_argument("--concurrent", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--max-peak-mib", type=float)
    p.add_argument("--kv-memories", type=int, default=0)
    p.add_argument("--max-growth-mib", type=float)
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.server_args = server_args
    pb, stubs = lib.load_stubs()
    server = lib.Server(a.binary, *a.server_args)
    pid = server.proc.pid
    channel = grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                            ("grpc.max_send_message_length", 64 << 20)])
    stub = stubs.AttentionServiceStub(channel)
    q = np.random.default_rng(1).standard_normal((1, a.length, 512)).astype(np.float32)
    req = pb.AttendRequest(model="demo", query=lib.to_wire(pb, q))
    stub.Attend(pb.AttendRequest(model="demo", query=lib.to_wire(pb, q[:, :8])), timeout=60)  # warm-up
    before = lib.status_kb(pid, "VmRSS")
    codes = []
    if a.kv_memories:
        k = lib.to_wire(pb, q)
        for _ in range(a.kv_memories):
            try:
                stub.CreateMemory(pb.CreateMemoryRequest(model="demo", key=k, value=k), timeout=60)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
        peak = lib.status_kb(pid, "VmHWM")
        held = sum(float(l.split()[1]) for l in lib.metrics_lines(server, "attnserve_kv_bytes"))
        server.stop()
        growth = (peak - before) / 1024
        print(f"{a.kv_memories} memories of {a.length} tokens created: RSS before {before / 1024:.0f} MiB, peak "
              f"{peak / 1024:.0f} MiB (+{growth:.0f} MiB), {held / 2**20:.0f} MiB held at the end; outcomes "
              f"{sorted(set(codes))} x{len(codes)}")
        if a.max_growth_mib is not None:
            ok = growth <= a.max_growth_mib and set(codes) == {"OK"}
            print(f"{1 if ok else 0} passed, {0 if ok else 1} failed (growth <= {a.max_growth_mib:.0f} MiB, "
                  "every memory created)")
            return 0 if ok else 1
        return 0
    for _ in range(a.rounds):
        def call():
            try:
                stub.Attend(req, timeout=300)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
        threads = [threading.Thread(target=call) for _ in range(a.concurrent)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    peak = lib.status_kb(pid, "VmHWM")
    after = lib.status_kb(pid, "VmRSS")
    server.stop()
    print(f"{a.concurrent} concurrent x {a.rounds} rounds, answers {a.length * 512 * 4 / 2**20:.0f} MiB: "
          f"RSS before {before / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB, after {after / 1024:.0f} MiB; "
          f"outcomes {sorted(set(codes))} x{len(codes)}")
    if a.max_peak_mib is not None:
        ok = peak / 1024 <= a.max_peak_mib and set(codes) == {"OK"}
        print(f"{1 if ok else 0} passed, {0 if ok else 1} failed (peak <= {a.max_peak_mib:.0f} MiB, every request OK)")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
