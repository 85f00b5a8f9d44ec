#!/usr/bin/python3
"""PyTorch conformance: attnserve's answers against torch.nn.MultiheadAttention itself.

For each configuration: build the module with fixed-seed random weights (biases too), export it with
tools/export_model.py, start one real attnserve serving every model, send fresh fixed-seed inputs
through Python gRPC stubs generated from the .proto, and compare output and attention weights with the
module's own forward in float32. Tolerance: max|out - ref| / max|ref| <= 1e-5 for float32 on the wire,
<= 1e-3 for float16 on the wire (the answer is rounded to float16); weights: max abs error <= 1e-5.

usage: conformance.py PATH/TO/attnserve [--server-args "--device cuda --dtype float16"]
                      [--reference float64] [--tolerance 1e-2] [--weights-tolerance 1e-2]
                      [--random N --seed S]
--random N adds N randomized configurations (seeded): random models (bias, bias_kv, add_zero_attn,
kdim/vdim, layout) and requests with bool or float masks of large magnitudes (up to 1e4, -inf
entries), bool or float key-padding masks, causal masks, per-head and averaged weights, and query
rows masked for every key. Where the reference has no answer (PyTorch gives NaN for a row masked
everywhere), the server's row must be finite and is not compared.
On a GPU (bench/gpu_check.sh) the server computes on CUDA at each dtype and the reference is the module
in float64 on the CPU; the tolerance is then the one given for that dtype.
"""
import argparse
import inspect
import shlex
import math
import os
import sys

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import attnserve_py as lib  # noqa: E402
import export_model  # noqa: E402


class Seed000(torch.nn.Module):
    """The seed-000/002 formulation: W_q/W_k/W_v/W_o, batch-first, no bias."""

    def __init__(self, d_model, num_heads, bias=False):
        super().__init__()
        self.num_heads, self.d_k = num_heads, d_model // num_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (torch.nn.Linear(d_model, d_model, bias=bias)
                                                  for _ in range(4))

    def forward(self, q, k, v):
        b = q.shape[0]
        split = lambda x: x.view(b, -1, self.num_heads, self.d_k).transpose(1, 2)
        qh, kh, vh = split(self.W_q(q)), split(self.W_k(k)), split(self.W_v(v))
        p = torch.softmax(qh @ kh.transpose(-2, -1) / math.sqrt(self.d_k), dim=-1)
        return self.W_o((p @ vh).transpose(1, 2).reshape(b, -1, self.num_heads * self.d_k))


class Seed003(torch.nn.Module):
    """The seed-003 formulation: query/key/value.linear + output, sequence-first; the value
    projection always has a bias, query/key only with bias=True."""

    def __init__(self, heads, d_model, bias=True):
        super().__init__()
        self.heads, self.d_k = heads, d_model // heads
        self.query = torch.nn.Module()
        self.query.linear = torch.nn.Linear(d_model, d_model, bias=bias)
        self.key = torch.nn.Module()
        self.key.linear = torch.nn.Linear(d_model, d_model, bias=bias)
        self.value = torch.nn.Module()
        self.value.linear = torch.nn.Linear(d_model, d_model, bias=True)
        self.output = torch.nn.Linear(d_model, d_model)

    def forward(self, q, k, v):
        prep = lambda m, x: m.linear(x).view(*x.shape[:-1], self.heads, self.d_k)
        qh, kh, vh = prep(self.query, q), prep(self.key, k), prep(self.value, v)
        scores = torch.einsum("ibhd,jbhd->ijbh", qh, kh) / math.sqrt(self.d_k)
        attn = torch.softmax(scores, dim=1)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, vh)
        return self.output(x.reshape(q.shape[0], q.shape[1], -1))


# name, constructor args, request shape and options.
CONFIGS = [
    dict(name="self_bias_avgweights", E=64, H=4, B=3, Lq=7, weights="avg"),
    dict(name="self_nobias", E=64, H=8, B=2, Lq=9, bias=False),
    dict(name="cross_lq_ne_lk", E=64, H=4, B=2, Lq=5, Lk=11),
    dict(name="cross_kdim_vdim", E=48, H=6, B=2, Lq=6, Lk=4, kdim=32, vdim=40, weights="head"),
    dict(name="bias_kv_zero_attn", E=32, H=4, B=2, Lq=5, Lk=6, bias_kv=True, zero_attn=True,
         weights="avg", kpm="bool"),
    dict(name="key_padding_bool", E=64, H=4, B=4, Lq=8, kpm="bool", weights="head"),
    dict(name="attn_mask_bool_2d", E=64, H=4, B=2, Lq=6, Lk=6, mask="bool2d", weights="avg"),
    dict(name="attn_mask_float_3d", E=32, H=2, B=3, Lq=5, Lk=7, mask="float3d", weights="head"),
    dict(name="attn_mask_bool_3d_kpm", E=32, H=4, B=2, Lq=5, mask="bool3d", kpm="bool"),
    dict(name="causal_self", E=64, H=4, B=2, Lq=10, causal=True),
    dict(name="causal_cross_weights", E=64, H=4, B=2, Lq=6, Lk=9, causal=True, weights="head"),
    dict(name="causal_with_kpm", E=32, H=4, B=3, Lq=6, causal=True, kpm="bool", weights="avg"),
    dict(name="seq_first", E=64, H=4, B=3, Lq=5, Lk=8, layout="sf", weights="avg"),
    dict(name="unbatched", E=64, H=4, Lq=6, Lk=5, unbatched=True, weights="head", kpm="bool"),
    dict(name="torch_save_format", E=64, H=4, B=2, Lq=6, fmt="pt", bias_kv=True, weights="avg"),
    dict(name="float16_wire", E=64, H=4, B=2, Lq=8, dtype="float16"),
    dict(name="seed000_pt", E=64, H=8, B=2, Lq=7, Lk=5, seed="000", fmt="pt"),
    dict(name="seed003_nobias", E=64, H=4, B=2, Lq=6, Lk=6, seed="003", bias=False, layout="sf"),
]


def random_configs(n, seed):
    """n random configurations (see the module doc), reproducible from seed."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h = int(rng.choice([1, 2, 4, 8]))
        e = h * int(rng.choice([4, 8, 16, 32]))
        cross = bool(rng.random() < 0.5)
        c = dict(name=f"random{i:03d}", E=e, H=h, B=int(rng.integers(1, 5)),
                 Lq=int(rng.integers(1, 17)), bias=bool(rng.random() < 0.8),
                 bias_kv=bool(rng.random() < 0.3), zero_attn=bool(rng.random() < 0.3),
                 layout="sf" if rng.random() < 0.3 else "bf",
                 weights=str(rng.choice(["none", "avg", "head"])), random=True)
        if cross:
            c["Lk"] = int(rng.integers(1, 21))
            if rng.random() < 0.3:
                c["kdim"], c["vdim"] = int(rng.integers(4, 65)), int(rng.integers(4, 65))
        c["causal"] = bool(rng.random() < 0.2)
        c["mask"] = str(rng.choice(["none", "bool2d", "bool3d", "float2d", "float3d"]))
        c["mask_scale"] = float(rng.choice([1.0, 10.0, 100.0, 1e4]))
        c["kpm"] = str(rng.choice(["none", "bool", "float"]))
        c["dead_rows"] = bool(rng.random() < 0.3)  # some query rows masked for every key
        if rng.random() < 0.15:
            c["unbatched"], c["B"] = True, 1
        out.append(c)
    return out


def random_masks(c, rng, b, lq, lk):
    """The key-padding and attention masks of a random configuration."""
    h, scale = c["H"], c["mask_scale"]
    kpm = mask = None
    if c["kpm"] == "bool":
        kpm = rng.random((b, lk)) < 0.3
    elif c["kpm"] == "float":
        kpm = (rng.standard_normal((b, lk)) * scale).astype(np.float32)
        kpm[rng.random((b, lk)) < 0.2] = -np.inf
    if c.get("unbatched") and kpm is not None:
        kpm = kpm[0]
    kind = c["mask"]
    if kind != "none":
        shape = (lq, lk) if kind.endswith("2d") else (b * h, lq, lk)
        if kind.startswith("bool"):
            mask = rng.random(shape) < 0.4
        else:
            mask = (rng.standard_normal(shape) * scale).astype(np.float32)
            mask[rng.random(shape) < 0.2] = -np.inf
        if c["dead_rows"]:
            rows = rng.random(lq) < 0.3
            mask[..., rows, :] = True if kind.startswith("bool") else -np.inf
    return kpm, mask


def dead_queries(c, kpm, mask):
    """[B, Lq] bool ([Lq] unbatched): queries masked
    for every key in every head, with no bias_kv or zero key to fall back on. attnserve answers a
    zero row there (README); PyTorch NaN (1.13) or the output bias (2.x): not compared."""
    b, h, lq = c.get("B", 1), c["H"], c["Lq"]
    lk = c.get("Lk") or lq
    masked = np.zeros((b, h, lq, lk), dtype=bool)
    if mask is not None:
        m = np.isneginf(mask) if mask.dtype != np.bool_ else mask
        masked |= m.reshape(b, h, lq, lk) if m.ndim == 3 else m.reshape(1, 1, lq, lk)
    if kpm is not None:
        m = np.isneginf(kpm) if kpm.dtype != np.bool_ else kpm
        masked |= m.reshape(b, 1, 1, lk)
    if c.get("causal"):
        masked |= np.triu(np.ones((lq, lk), dtype=bool), 1)[None, None]
    dead = masked.all(-1).all(1)  # [B, Lq]
    if c.get("bias_kv") or c.get("zero_attn"):
        dead[:] = False
    return dead[0] if c.get("unbatched") else dead


def build_module(c, seed):
    torch.manual_seed(seed)
    e = c["E"]
    if c.get("seed") == "000":
        m = Seed000(e, c["H"], bias=c.get("bias", False))
    elif c.get("seed") == "003":
        m = Seed003(c["H"], e, bias=c.get("bias", True))
    else:
        m = torch.nn.MultiheadAttention(e, c["H"], bias=c.get("bias", True),
                                        add_bias_kv=c.get("bias_kv", False),
                                        add_zero_attn=c.get("zero_attn", False),
                                        kdim=c.get("kdim"), vdim=c.get("vdim"),
                                        batch_first=c.get("layout", "bf") == "bf")
    with torch.no_grad():  # nn.MultiheadAttention starts its biases at 0: make them count.
        for name, p in m.named_parameters():
            if "bias" in name:
                p.uniform_(-0.5, 0.5)
    # dropout is 0, so train() computes the same as eval(); it keeps PyTorch 1.13 off its
    # _native_multi_head_attention fast path, which crashes on bias=False (qkv_bias None).
    return m.train()


def make_inputs(c, rng):
    e, b, lq = c["E"], c.get("B", 1), c["Lq"]
    lk = c.get("Lk")
    cross = lk is not None
    lk = lk or lq
    sf = c.get("layout", "bf") == "sf"
    shape = lambda length, dim: (length, dim) if c.get("unbatched") else (
        (length, b, dim) if sf else (b, length, dim))
    q = rng.standard_normal(shape(lq, e)).astype(np.float32)
    k = rng.standard_normal(shape(lk, c.get("kdim") or e)).astype(np.float32) if cross else None
    v = rng.standard_normal(shape(lk, c.get("vdim") or e)).astype(np.float32) if cross else None
    if c.get("dtype") == "float16":  # The reference sees exactly what the server receives.
        q = q.astype(np.float16).astype(np.float32)
    kpm = mask = None
    if c.get("random"):
        kpm, mask = random_masks(c, rng, b, lq, lk)
        return q, k, v, kpm, mask
    if c.get("kpm") == "bool":
        valid = rng.integers(1, lk + 1, size=b)  # Every row keeps >= 1 key: no NaN in PyTorch.
        kpm = np.arange(lk)[None, :] >= valid[:, None]
        if c.get("unbatched"):
            kpm = kpm[0]
    h = c["H"]
    if c.get("mask") == "bool2d":
        mask = rng.random((lq, lk)) < 0.4
        mask[:, 0] = False
    elif c.get("mask") == "bool3d":
        mask = rng.random((b * h, lq, lk)) < 0.4
        mask[:, :, 0] = False
    elif c.get("mask") == "float3d":
        mask = rng.standard_normal((b * h, lq, lk)).astype(np.float32)
    return q, k, v, kpm, mask


def reference(c, m, q, k, v, kpm, mask, dtype=torch.float32):
    def t(a):
        if a is None:
            return None
        x = torch.from_numpy(np.ascontiguousarray(a))
        return x.to(dtype) if x.is_floating_point() else x
    qt, kt, vt = t(q), t(k), t(v)
    if kt is None:
        kt = vt = qt
    with torch.no_grad():
        if c.get("seed"):
            return m(qt, kt, vt).numpy().astype(np.float64), None
        am = t(mask)
        kp = t(kpm)
        if c.get("random"):
            # Both masks as one additive float mask (bool: -inf where True), as PyTorch 2.x reads a
            # float key_padding_mask; 1.13 would treat its non-zeros as True.
            additive = lambda x: torch.zeros(x.shape, dtype=dtype).masked_fill(x, float("-inf")) \
                if x.dtype == torch.bool else x
            b, h, lq = c.get("B", 1), c["H"], c["Lq"]
            lk = c.get("Lk") or lq
            full = torch.zeros(b, h, lq, lk, dtype=dtype)
            if am is not None:
                full = full + additive(am).reshape(-1, lq, lk).reshape(-1 if am.dim() == 3 else 1, h if am.dim() == 3 else 1, lq, lk)
            if kp is not None:
                full = full + additive(kp).reshape(b, 1, 1, lk)
            am = None if (mask is None and kpm is None) else full.reshape(b * h, lq, lk)
            if am is not None and c.get("unbatched"):
                am = am.reshape(h, lq, lk)
            kp = None
        native = {}
        if c.get("causal"):
            # The mask spelled out; PyTorch 2.x's module also takes the is_causal hint (which lets it
            # use its fused causal path), valid when the mask is exactly the causal one. 1.13's has no
            # is_causal.
            lq, lk = c["Lq"], c.get("Lk") or c["Lq"]
            causal = torch.ones(lq, lk, dtype=torch.bool).triu(1)
            if am is None and "is_causal" in inspect.signature(m.forward).parameters:
                native = {"is_causal": True}
            am = causal if am is None else (am | causal if am.dtype == torch.bool else
                                            am.masked_fill(causal, float("-inf")))
        w = c.get("weights", "none")
        out, weights = m(qt, kt, vt, key_padding_mask=kp, attn_mask=am,
                         need_weights=w != "none", average_attn_weights=w == "avg", **native)
    return out.numpy().astype(np.float64), None if weights is None else weights.numpy().astype(np.float64)


class Served:
    """Every configuration's model exported to one repository and one attnserve serving them all."""

    def __init__(self, binary, configs, server_args=""):
        self.pb, rpc = lib.load_stubs()
        tmp = lib.temp_dir("attnserve-conformance-")
        self.modules = {}
        for i, c in enumerate(configs):
            m = build_module(c, seed=1000 + i)
            self.modules[c["name"]] = m
            export_model.export(m, os.path.join(tmp, c["name"]), fmt=c.get("fmt", "safetensors"))
        self.server = lib.Server(binary, "--models", tmp, *shlex.split(server_args))
        self.stub = rpc.AttentionServiceStub(grpc.insecure_channel(self.server.target))

    def stop(self):
        self.server.stop()


WIRE_ROUNDING = {"float16": 1e-3, "bfloat16": 1e-2}


def check_config(served, i, c, ref_dtype, tolerance=None, weights_tolerance=None):
    """Configuration i's request through the server against the module's own forward: (ok, output
    relative error, weights absolute error or NaN, tolerance)."""
    pb = served.pb
    rng = np.random.default_rng(2000 + i)
    q, k, v, kpm, mask = make_inputs(c, rng)
    module = served.modules[c["name"]].to(ref_dtype)
    want, want_w = reference(c, module, q, k, v, kpm, mask, ref_dtype)
    dtype = c.get("dtype", "float32")
    req = pb.AttendRequest(
        model=c["name"], query=lib.to_wire(pb, q, dtype), is_causal=c.get("causal", False),
        attn_weights={"none": 0, "avg": 1, "head": 2}[c.get("weights", "none")],
        layout=2 if c.get("layout") == "sf" else 1, request_id=i)
    if k is not None:
        req.key.CopyFrom(lib.to_wire(pb, k, dtype))
        req.value.CopyFrom(lib.to_wire(pb, v, dtype))
    if kpm is not None:
        req.key_padding_mask.CopyFrom(lib.to_wire(pb, kpm))
    if mask is not None:
        req.attn_mask.CopyFrom(lib.to_wire(pb, mask))
    resp = served.stub.Attend(req, timeout=30)
    got = lib.from_wire(pb, resp.output)
    # An answer on a 16-bit wire is rounded to it: never held to less than that rounding, whatever
    # tolerance the compute dtype was given.
    tol = max(tolerance or (1e-5 if dtype == "float32" else 1e-3), WIRE_ROUNDING.get(dtype, 0))
    wtol = weights_tolerance or max(tol, 1e-5)
    if got.shape != want.shape:
        return False, float("inf"), float("nan"), tol
    # PyTorch answers NaN for a query masked for every key: the server's row must be finite (zero
    # where masked in every head, docs/api.md), and is compared where the reference has one.
    dead = dead_queries(c, kpm, mask)  # [B, Lq] or [Lq]
    dead_rows = dead.T if c.get("layout", "bf") == "sf" and not c.get("unbatched") else dead
    ok_dead = bool((got[dead_rows] == 0).all())  # the documented zero rows
    known = np.isfinite(want) & ~dead_rows[..., None]
    err = float(np.abs(got - want)[known].max(initial=0) / max(np.abs(want[known]).max(initial=0), 1e-30))
    werr = float("nan")
    ok = err <= tol and resp.request_id == i and bool(np.isfinite(got).all()) and ok_dead
    if want_w is not None:
        gw = lib.from_wire(pb, resp.attn_weights)
        ok = ok and gw.shape == want_w.shape
        # weights [B, (H,) Lq, S] ([(H,) Lq, S] unbatched): dead queries' rows not compared
        per_head = want_w.ndim == dead.ndim + 2
        wdead = (dead[:, None, :, None] if dead.ndim == 2 else dead[None, :, None]) if per_head \
            else dead[..., None]
        wknown = np.isfinite(want_w) & ~np.broadcast_to(wdead, want_w.shape)
        werr = float(np.abs(gw - want_w)[wknown].max(initial=0)) if gw.shape == want_w.shape else float("inf")
        ok = ok and werr <= wtol and bool(np.isfinite(gw).all())
    return ok, err, werr, tol


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--server-args", default="", help="extra attnserve flags, e.g. --device cuda")
    ap.add_argument("--reference", choices=["float32", "float64"], default="float32")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="max |out-ref|/max|ref| (default 1e-5; 1e-3 for float16 on the wire)")
    ap.add_argument("--weights-tolerance", type=float, default=None,
                    help="max |weights-ref| (default: the output tolerance, at least 1e-5)")
    ap.add_argument("--random", type=int, default=0, help="add N randomized configurations")
    ap.add_argument("--seed", type=int, default=1, help="seed of the randomized configurations")
    args = ap.parse_args()
    configs = CONFIGS + random_configs(args.random, args.seed)
    ref_dtype = torch.float64 if args.reference == "float64" else torch.float32
    served = Served(args.binary, configs, args.server_args)
    print(f"server: {served.server.banner.strip()}")
    print(f"reference: PyTorch {torch.__version__} nn.MultiheadAttention in {args.reference} on the CPU")
    failures = 0
    print(f"{'configuration':28s} {'output rel err':>14s} {'weights abs err':>15s} {'tolerance':>9s}")
    try:
        worst = [0.0, 0.0]
        for i, c in enumerate(configs):
            ok, err, werr, tol = check_config(served, i, c, ref_dtype, args.tolerance, args.weights_tolerance)
            worst[0] = max(worst[0], err)
            if not math.isnan(werr):
                worst[1] = max(worst[1], werr)
            failures += not ok
            wtext = "-" if math.isnan(werr) else f"{werr:.2e}"
            if not c.get("random") or not ok:
                print(f"{c['name']:28s} {err:14.2e} {wtext:>15s} {tol:9.0e} {'ok' if ok else 'FAIL'}"
                      + (f"  {c}" if c.get("random") else ""))
    finally:
        served.stop()
    print(f"worst output rel err {worst[0]:.2e}, worst weights abs err {worst[1]:.2e}")
    print(f"conformance: {len(configs) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
