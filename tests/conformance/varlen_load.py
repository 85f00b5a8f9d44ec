#!/usr/bin/python3
"""Ragged small requests from many callers at once: the batches the server packs and, with
--varlen-attention, attends in one varlen launch per group. Every answer is checked against
torch.nn.MultiheadAttention in float64 on the CPU, and /metrics must show the expected attention
backend ran (e.g. varlen_emulated on the CPU, flash_varlen or efficient_varlen on CUDA).

Requests: one model (E=256, 4 heads: head_dim 64, what flash attention takes), batch-first,
batch 1-2, query lengths 1-48, self-attention and cross-attention (key lengths 1-64), causal or not,
sent in waves of --callers concurrent calls. Fixed seeds.

usage: varlen_load.py PATH/TO/attnserve [--server-args "--varlen-attention emulate"]
         [--requests 1200] [--callers 16] [--tolerance 1e-5] [--expect-backend varlen_emulated]
Tolerance: max|out - ref| / max|ref| per request (1e-5 for float32 compute; 1e-2 for bf16/f16).
"""
import argparse
import os
import re
import shlex
import sys
import urllib.request

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import attnserve_py as lib  # noqa: E402
import export_model  # noqa: E402

E, H = 256, 4


def make_request(i):
    rng = np.random.default_rng(5000 + i)
    b = int(rng.integers(1, 3))
    lq = int(rng.integers(1, 49))
    cross = bool(rng.integers(0, 2))
    lk = int(rng.integers(1, 65)) if cross else lq
    causal = bool(rng.integers(0, 2))
    q = rng.standard_normal((b, lq, E)).astype(np.float32)
    k = rng.standard_normal((b, lk, E)).astype(np.float32) if cross else None
    v = rng.standard_normal((b, lk, E)).astype(np.float32) if cross else None
    return q, k, v, causal


def reference(module, q, k, v, causal):
    qt = torch.from_numpy(q).double()
    kt = qt if k is None else torch.from_numpy(k).double()
    vt = qt if v is None else torch.from_numpy(v).double()
    mask = None
    if causal:  # Query i sees keys 0..i (nn.MultiheadAttention's causal mask, top-left).
        mask = torch.ones(q.shape[1], kt.shape[1], dtype=torch.bool).triu(1)
    with torch.no_grad():
        out, _ = module(qt, kt, vt, attn_mask=mask, need_weights=False)
    return out.numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--server-args", default="--varlen-attention emulate")
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--callers", type=int, default=16)
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--expect-backend", default="varlen_emulated",
                    help="a backend /metrics must count at least once (regex)")
    args = ap.parse_args()
    checks = lib.Checks()
    run(args, checks)
    return checks.summary("varlen_load")


def run(args, checks):
    """Every check, through `checks`; args: binary, server_args, requests, callers, tolerance,
    expect_backend."""
    pb, rpc = lib.load_stubs()
    torch.manual_seed(77)
    module = torch.nn.MultiheadAttention(E, H, batch_first=True)
    tmp = lib.temp_dir("attnserve-varlen-")
    export_model.export(module, os.path.join(tmp, "ragged"))
    module = module.double().eval()
    server = lib.Server(args.binary, "--models", tmp, *shlex.split(args.server_args))
    print(f"server: {server.banner.strip()}")
    stub = rpc.AttentionServiceStub(grpc.insecure_channel(server.target))

    requests = [make_request(i) for i in range(args.requests)]
    messages = []
    for i, (q, k, v, causal) in enumerate(requests):
        req = pb.AttendRequest(model="ragged", query=lib.to_wire(pb, q), is_causal=causal, request_id=i)
        if k is not None:
            req.key.CopyFrom(lib.to_wire(pb, k))
            req.value.CopyFrom(lib.to_wire(pb, v))
        messages.append(req)
    responses = []
    try:
        # Waves of --callers requests in flight at once (gRPC futures: no Python thread per call,
        # so they reach the server together), answers checked after the load.
        for start in range(0, len(messages), args.callers):
            wave = [stub.Attend.future(m, timeout=60) for m in messages[start:start + args.callers]]
            responses.extend(f.result() for f in wave)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    finally:
        server.stop()
    results = []
    for i, ((q, k, v, causal), resp) in enumerate(zip(requests, responses)):
        got = lib.from_wire(pb, resp.output)
        want = reference(module, q, k, v, causal)
        err = float(np.abs(got - want).max() / np.abs(want).max()) if got.shape == want.shape else float("inf")
        results.append((i, err, resp.request_id, resp.timing.batch_size))
    errs = [e for _, e, _, _ in results]
    wrong = [i for i, e, rid, _ in results if not e <= args.tolerance or rid != i]
    batched = sum(1 for *_, bs in results if bs > 1)
    backends = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'attnserve_attention_backend_total\{[^}]*backend="([^"]+)"[^}]*\} (\S+)', metrics)}
    print(f"{args.requests} requests from {args.callers} callers: max rel err {max(errs):.2e} "
          f"(tolerance {args.tolerance:.0e}), {batched} answered in batches of 2+, backends {backends}")
    checks("every answer matches nn.MultiheadAttention in float64, and is its own", not wrong,
           f"wrong: {wrong[:10]}")
    checks("the server batched requests together", batched > args.requests // 10, f"only {batched}")
    checks(f"/metrics counts backend {args.expect_backend}",
           any(re.fullmatch(args.expect_backend, b) and n > 0 for b, n in backends.items()), str(backends))


if __name__ == "__main__":
    sys.exit(main())
