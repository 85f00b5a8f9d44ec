#!/usr/bin/python3
"""Keys and values kept on the server, against torch.nn.MultiheadAttention itself.

Decoding sessions: T steps (the first a whole prompt) through OpenSession + Attend(session=...) must
equal the module's causal self-attention over the concatenated steps, row for row (and their
attention weights). Memories: Attend(memory=...) must equal the module's cross-attention with the
memory's key, value and key padding. Several sessions step at once from threads, so steps of
different sessions and memory requests share the server's batches. Plus the statuses: NOT_FOUND
saying why (unknown, deleted, closed), ABORTED for a step at the wrong session_length. TruncateSession
(speculative decoding): steps after a truncation = causal MHA over the tokens kept plus the new ones.
ForkSession (beam search): every branch = causal MHA over its own sequence.
Fresh fixed-seed inputs; tolerance max|out - ref| / max|ref| <= 1e-5 (float32), weights 1e-5 absolute.
Called through the attnserve Python package (client/python; lib.load_package).

usage: kv_conformance.py PATH/TO/attnserve [--server-args "--device cuda"] [--tolerance 1e-5]
(bench/gpu_check.sh runs it on CUDA, bfloat16 at --tolerance 3e-2: on the CPU bfloat16 gives up to 2.0e-2)
"""
import argparse
import os
import shlex
import sys
import threading

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import attnserve_py as lib  # noqa: E402
import export_model  # noqa: E402

E, H = 64, 4
MODELS = {  # name: nn.MultiheadAttention arguments
    "plain": dict(bias=True),
    "bias_kv": dict(bias=True, add_bias_kv=True),
    "zero_attn": dict(bias=False, add_zero_attn=True),
    "both": dict(bias=True, add_bias_kv=True, add_zero_attn=True),
    "cross_dims": dict(bias=True, kdim=48, vdim=40),
}
TOL, WTOL = 1e-5, 1e-5


def rel_err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def reference(m, q, k, v, kpm=None, mask=None, weights="none", seq_first=False):
    """The module's forward on batch-first numpy inputs; output (and weights) as numpy."""
    t = lambda a: None if a is None else torch.from_numpy(a)
    with torch.no_grad():
        qq, kk, vv = t(q), t(k), t(v)
        if seq_first:
            qq, kk, vv = qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1)
        out, w = m(qq, kk, vv, key_padding_mask=t(kpm), attn_mask=t(mask), need_weights=weights != "none",
                   average_attn_weights=weights == "avg")
        if seq_first:
            out = out.transpose(0, 1)
    return out.numpy(), None if w is None else w.numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--server-args", default="", help="extra attnserve flags, e.g. --device cuda")
    ap.add_argument("--tolerance", type=float, default=TOL, help="outputs (relative) and weights (absolute)")
    args = ap.parse_args()
    checks = lib.Checks()
    run(args, checks)
    return checks.summary("kv_conformance")


def run(args, checks):
    """Every check, through `checks`; args: binary, server_args, tolerance."""
    global TOL, WTOL
    TOL = WTOL = args.tolerance
    attnserve = lib.load_package()
    Error = attnserve.AttnserveError
    tmp = lib.temp_dir("attnserve-kv-")
    modules = {}
    for i, (name, kw) in enumerate(MODELS.items()):
        torch.manual_seed(300 + i)
        m = torch.nn.MultiheadAttention(E, H, batch_first=True, **kw).eval()
        for p in m.parameters():  # Non-trivial biases too.
            torch.nn.init.normal_(p, std=0.2)
        modules[name] = m
        export_model.export(m, os.path.join(tmp, name))
    server = lib.Server(args.binary, "--models", tmp, *shlex.split(args.server_args))
    client = attnserve.Client(server.target)
    weights_name = {"none": "none", "avg": "averaged", "head": "per_head"}

    def run_session(name, b, steps, seed, weights="none", kpm=False, seq_first=False, results=None):
        """Steps one session; returns (max output error, max weights error) over its steps."""
        m = modules[name]
        rng = np.random.default_rng(seed)
        length = sum(steps)
        x = rng.standard_normal((b, length, E)).astype(np.float32)
        pad = np.zeros((b, length), dtype=bool)
        if kpm:
            pad[0, [2, 5, length - 1]] = True  # Key 0 stays visible: no row is fully masked.
        causal = np.triu(np.ones((length, length), dtype=bool), 1)
        want, want_w = reference(m, x, x, x, pad if kpm else None, causal, weights)
        err = werr = 0.0
        t0 = 0
        with client.session(name, b) as s:  # Each step sends the session_length it expects.
            for t in steps:
                q = x[:, t0:t0 + t]
                r = s.step(q.transpose(1, 0, 2) if seq_first else q, attn_weights=weights_name[weights],
                           layout="sequence_first" if seq_first else "batch_first",
                           key_padding_mask=pad[:, t0:t0 + t] if kpm else None)
                got = r.output.transpose(1, 0, 2) if seq_first else r.output
                err = max(err, float(np.abs(got - want[:, t0:t0 + t]).max() / np.abs(want).max()))
                if weights != "none":
                    extra = r.attn_weights.shape[-1] - (t0 + t)  # bias_k / zero key columns come last
                    ref = want_w[..., t0:t0 + t, :]
                    ref = np.concatenate([ref[..., :t0 + t], ref[..., length:]], axis=-1)
                    assert ref.shape[-1] == t0 + t + extra
                    werr = max(werr, float(np.abs(r.attn_weights - ref).max()))
                if r.session_length != t0 + t:
                    err = float("inf")
                t0 += t
        if results is not None:
            results.append((err, werr))
        return err, werr

    try:
        steps = [6, 1, 1, 4, 1, 3, 1]
        for name in ("plain", "bias_kv", "zero_attn", "both"):
            for weights, kpm, seq_first, b in (("none", False, False, 2), ("head", True, False, 3),
                                               ("avg", False, True, 1)):
                err, werr = run_session(name, b, steps, 11, weights, kpm, seq_first)
                label = f"session {name} B={b} weights={weights}{' kpm' if kpm else ''}{' seq-first' if seq_first else ''}"
                checks(f"{label}: steps = causal MHA over the concatenation (rel {err:.1e})", err <= TOL)
                if weights != "none":
                    checks(f"{label}: attention weights (abs {werr:.1e})", werr <= WTOL)

        # Memories: cross-attention against kept keys and values, with key padding and masks.
        for name in ("plain", "both", "cross_dims"):
            m = modules[name]
            rng = np.random.default_rng(21)
            b, lk = 2, 24
            k = rng.standard_normal((b, lk, m.kdim)).astype(np.float32)
            v = rng.standard_normal((b, lk, m.vdim)).astype(np.float32)
            pad = np.zeros((b, lk), dtype=bool)
            pad[1, [0, 7]] = True
            with client.memory(k, v, model=name, key_padding_mask=pad) as memory:
                info = memory.info
                checks(f"memory {name}: handle, length and bytes", len(info.handle) == 32 and info.length == lk
                       and info.batch == b and info.bytes > 0, info)
                for lq, weights, masked in ((1, "none", False), (9, "head", True), (30, "avg", False)):
                    q = rng.standard_normal((b, lq, E)).astype(np.float32)
                    mask = rng.standard_normal((lq, lk)).astype(np.float32) if masked else None
                    want, want_w = reference(m, q, k, v, pad, mask, weights)
                    r = memory.attend(q, attn_weights=weights_name[weights], attn_mask=mask)
                    err = rel_err(r.output, want)
                    ok = err <= TOL and r.model == name
                    if want_w is not None:
                        ok = ok and float(np.abs(r.attn_weights - want_w).max()) <= WTOL
                    checks(f"memory {name} Lq={lq} weights={weights}{' mask' if masked else ''}: = cross MHA "
                           f"(rel {err:.1e})", ok)
            try:  # Deleted on leaving `with`.
                client.attend(q, memory=info.handle)
                checks(f"memory {name}: deleted handle refused", False)
            except Error as e:
                checks(f"memory {name}: deleted handle NOT_FOUND saying so",
                       e.code == grpc.StatusCode.NOT_FOUND and "deleted" in e.message, e.message)

        # Several sessions at once (their steps share batches), plus memory requests meanwhile.
        results = []
        threads = [threading.Thread(target=run_session, args=("plain", 2, [8, 1, 1, 1, 2, 1, 1, 1], 100 + i),
                                    kwargs=dict(results=results)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        worst = max(r[0] for r in results) if len(results) == 6 else float("inf")
        checks(f"6 concurrent sessions: every step = its causal MHA (worst rel {worst:.1e})", worst <= TOL)

        # Truncation (speculative decoding): step, take back a draft's tail, go on from there; and back
        # to nothing. Each answer = causal MHA over the sequence the session holds then.
        for name in ("plain", "both"):
            m = modules[name]
            rng = np.random.default_rng(31)
            x = rng.standard_normal((2, 11, E)).astype(np.float32)
            y = rng.standard_normal((2, 4, E)).astype(np.float32)
            z = rng.standard_normal((2, 3, E)).astype(np.float32)
            causal = lambda n: np.triu(np.ones((n, n), dtype=bool), 1)
            with client.session(name, 2) as s:
                for a, b in ((0, 6), (6, 9), (9, 11)):
                    s.step(x[:, a:b])
                kept = s.truncate(7)
                r = s.step(y)
                seq = np.concatenate([x[:, :7], y], axis=1)
                err = rel_err(r.output, reference(m, seq, seq, seq, None, causal(11))[0][:, 7:])
                zero = s.truncate(0)
                r0 = s.step(z)
                err0 = rel_err(r0.output, reference(m, z, z, z, None, causal(3))[0])
            checks(f"truncate {name}: 11 tokens back to 7, then 4 new = causal MHA over the 11 held (rel {err:.1e}); "
                   f"back to 0 then 3 = causal MHA over those 3 (rel {err0:.1e})",
                   kept == 7 and r.session_length == 11 and err <= TOL and zero == 0 and r0.session_length == 3 and
                   err0 <= TOL)

        # Forks (beam search): a prompt, three branches from it stepping different tokens, the parent
        # going on too; each = causal MHA over its own sequence (bias_kv + zero key model as well).
        for name in ("plain", "both"):
            m = modules[name]
            rng = np.random.default_rng(41)
            prompt = rng.standard_normal((2, 5, E)).astype(np.float32)
            tails = [rng.standard_normal((2, 3, E)).astype(np.float32) for _ in range(4)]
            causal = lambda n: np.triu(np.ones((n, n), dtype=bool), 1)
            worst, lengths = 0.0, []
            with client.session(name, 2) as parent:
                parent.step(prompt[:, :4])
                parent.step(prompt[:, 4:])
                branches = [parent.fork() for _ in range(3)]
                for s, tail in zip([parent] + branches, tails):
                    outs = [s.step(tail[:, :1]).output, s.step(tail[:, 1:]).output]
                    seq = np.concatenate([prompt, tail], axis=1)
                    want = reference(m, seq, seq, seq, None, causal(8))[0][:, 5:]
                    worst = max(worst, rel_err(np.concatenate(outs, axis=1), want))
                    lengths.append(s.length)
                for b in branches:
                    b.close()
            checks(f"fork {name}: three branches and the parent, each = causal MHA over its own sequence "
                   f"(worst rel {worst:.1e})", worst <= TOL and lengths == [8, 8, 8, 8], str(lengths))

        # Statuses.
        q = np.zeros((1, 1, E), dtype=np.float32)
        with client.session("plain", 1) as s:
            here = s.handle[:8]  # This replica's ID begins each of its handles.
        other = "0" * 8 if here != "0" * 8 else "1" * 8
        for field in ("memory", "session"):
            try:
                client.attend(q, **{field: here + "0" * 24})
                checks(f"unknown {field}: refused", False)
            except Error as e:
                checks(f"unknown {field}: NOT_FOUND saying unknown",
                       e.code == grpc.StatusCode.NOT_FOUND and "unknown" in e.message, e.message)
            try:
                client.attend(q, **{field: other + "0" * 24})
                checks(f"{field} of another replica: refused", False)
            except Error as e:
                checks(f"{field} of another replica: NOT_FOUND naming both replicas",
                       e.code == grpc.StatusCode.NOT_FOUND and f"made by replica {other}" in e.message
                       and f"this is replica {here}" in e.message, e.message)
        with client.session("plain", 1) as s:
            s.step(q)
            try:
                client.attend(q, session=s.handle, session_length=0)
                checks("a step at the wrong session_length: refused", False)
            except Error as e:
                checks("a step at the wrong session_length: ABORTED naming the length",
                       e.code == grpc.StatusCode.ABORTED and "holds 1 tokens" in e.message, e.message)
            try:
                s.step(np.zeros((2, 1, E), np.float32))
                checks("a step with another batch: refused", False)
            except Error as e:
                checks("a step with another batch: INVALID_ARGUMENT", e.code == grpc.StatusCode.INVALID_ARGUMENT,
                       e.message)
        try:  # Closed on leaving `with`.
            client.attend(q, session=s.handle)
            checks("closed session refused", False)
        except Error as e:
            checks("closed session: NOT_FOUND saying closed",
                   e.code == grpc.StatusCode.NOT_FOUND and "closed" in e.message, e.message)
        with client.session("plain", 1) as s:
            s.step(np.zeros((1, 3, E), np.float32))
            try:
                s.truncate(4)
                checks("truncating past the length: refused", False)
            except Error as e:
                checks("truncating past the length: INVALID_ARGUMENT naming what it holds",
                       e.code == grpc.StatusCode.INVALID_ARGUMENT and "allowed: 0 to 3" in e.message, e.message)
        try:
            client.session("cross_dims", 1)
            checks("session on a kdim != embed_dim model refused", False)
        except Error as e:
            checks("session on a kdim != embed_dim model: INVALID_ARGUMENT",
                   e.code == grpc.StatusCode.INVALID_ARGUMENT, e.message)
    finally:
        client.close()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
