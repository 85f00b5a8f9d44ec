#!/usr/bin/env python3
"""Decoder layers against transformers' own attention modules (LlamaAttention, MistralAttention,
Qwen2Attention, Qwen3Attention; transformers pinned in tools/torch2-env.sh, random weights from a
config, no download).

For each configuration (seeded: grouped and multi-query heads, head_dim apart from hidden/heads,
biases, Llama 3's RoPE scaling, partial rotary dims... what each family has): build the module,
export it with tools/export_model.py's export_decoder (config.json as save_pretrained writes it,
so each family's defaults are read back), serve every layer from one attnserve, then compare
- prefill: Attend with is_causal over a whole sequence starting at query_position p0, against the
  module with its causal (or sliding-window) mask from transformers.masking_utils, and against
  PyTorch's scaled_dot_product_attention(enable_gqa=True) over the module's rotated projections;
- decoding: OpenSession, a prompt, then one token a step, against the module decoding the same tokens
  with a DynamicCache; then TruncateSession to a shorter length, ForkSession there, and two steps on
  each branch with tokens of its own, against the module fed the kept prefix.
Fresh fixed-seed inputs; tolerance max|out - ref| / max|ref| <= 1e-4 (float32: transformers
computes the rotary angles in float32, ~7e-5 relative near position 4,000: ../shared/MODERN_ATTENTION.md).

usage: decoder_conformance.py PATH/TO/attnserve [--server-args "--device cuda"] [--tolerance 1e-4]
       [--random N --seed S] [--only NAME,...]
Needs `transformers` (tools/torch2-env.sh's environment; bench/gpu_quick.sh runs it on the GPU).
"""
import argparse
import os
import random
import shlex
import sys

import grpc
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
import attnserve_py as lib  # noqa: E402
import export_model  # noqa: E402

TOL = 1e-4

# name: (family, config keys). Each family's defaults that bite are left out on purpose where the
# configuration relies on them (Qwen3's head_dim 128, Mistral's 8 key/value heads).
FIXED = {
    "llama_gqa": ("llama", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                num_hidden_layers=2)),
    "llama_mqa_bias": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                     attention_bias=True, num_hidden_layers=1)),
    "llama3_rope": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=1, max_position_embeddings=256,
                                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                                       factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=64))),
    "llama_head_dim": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=24, num_hidden_layers=1)),
    "mistral_window": ("mistral", dict(hidden_size=128, num_attention_heads=16, sliding_window=6,
                                       num_hidden_layers=1)),
    "qwen2_biases": ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
                                   max_window_layers=2)),
    "qwen3_norms": ("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=1)),
    # Eight query heads a key/value head, as bench/decoders.sh's grouped layer: a step's eight rows
    # take the AVX2 scores in pairs of dims once the session holds 64 keys (the prompts below do).
    "llama_group8": ("llama", dict(hidden_size=128, num_attention_heads=16, num_key_value_heads=2,
                                   num_hidden_layers=1)),
}


def family_classes(family):
    import importlib
    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    m = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    c = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    n = names[family]
    return getattr(c, n + "Config"), getattr(m, n + "Attention"), getattr(m, n + "RotaryEmbedding")


def random_configs(n, seed):
    rnd = random.Random(seed)
    out = {}
    for i in range(n):
        family = rnd.choice(["llama", "mistral", "qwen2", "qwen3"])
        kv = rnd.choice([1, 2, 4])
        heads = kv * rnd.choice([1, 2, 4])
        head_dim = rnd.choice([8, 16])
        keys = dict(hidden_size=heads * head_dim * rnd.choice([1, 2]) // 2 * 2, num_attention_heads=heads,
                    num_key_value_heads=kv, head_dim=head_dim, num_hidden_layers=2,
                    rope_parameters=dict(rope_type="default", rope_theta=rnd.choice([10000.0, 1e6])))
        if family in ("llama", "qwen3"):
            keys["attention_bias"] = rnd.random() < 0.5
        if family == "mistral":
            keys["sliding_window"] = rnd.choice([None, 3, 8])
        if family == "qwen2":
            keys.pop("head_dim")
            keys["hidden_size"] = heads * head_dim
            keys["use_sliding_window"] = rnd.random() < 0.5
            keys["sliding_window"] = rnd.choice([3, 8])
            keys["max_window_layers"] = rnd.choice([0, 1])
        out[f"random{i}_{family}"] = (family, keys)
    return out


def build(family, keys, seed):
    Config, Attention, Rotary = family_classes(family)
    config = Config(**keys)
    config._attn_implementation = "eager"  # None would drop the causal mask (MODERN_ATTENTION.md).
    torch.manual_seed(seed)
    layers = {}
    for i in range(config.num_hidden_layers):
        attn = Attention(config, layer_idx=i).eval()
        with torch.no_grad():  # Random weights everywhere, biases and norms included.
            for p in attn.parameters():
                p.normal_(0.0, 0.3 if p.dim() == 1 else 1.0 / np.sqrt(p.shape[-1]))
            if hasattr(attn, "q_norm"):
                attn.q_norm.weight.add_(1.0)
                attn.k_norm.weight.add_(1.0)
        layers[i] = attn

    class Whole(torch.nn.Module):  # What export_decoder reads: .config and .layers[i].self_attn
        pass

    whole = Whole()
    whole.config = config
    whole.layers = torch.nn.ModuleList()
    for i in range(config.num_hidden_layers):
        holder = torch.nn.Module()
        holder.self_attn = layers[i]
        whole.layers.append(holder)
    return config, layers, Rotary(config), whole


def window_of(config, attn):
    """The layer's sliding window (a falsy value: none): Qwen2's per layer, Mistral's per model."""
    return getattr(attn, "sliding_window", None) or (
        config.model_type == "mistral" and getattr(config, "sliding_window", None))


def reference(config, attn, rotary, x, positions, cache=None):
    """The module's forward over x [B, T, E] at positions [B, T] (appending to `cache`)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    layer = attn.layer_idx
    make = create_sliding_window_causal_mask if window_of(config, attn) else create_causal_mask
    with torch.no_grad():
        mask = make(config=config, inputs_embeds=x, attention_mask=None, past_key_values=cache,
                    position_ids=positions, layer_idx=layer)
        cos, sin = rotary(x, positions)
        out, _ = attn(x, position_embeddings=(cos, sin), attention_mask=mask, past_key_values=cache)
    return out.numpy().astype(np.float64)


def reference_sdpa(config, attn, rotary, x, positions):
    """The same prefill (causal, the layer's window) from the module's projections, norms and
    rotation, attended by PyTorch's scaled_dot_product_attention(enable_gqa=True): a second
    reference, whose grouped heads are PyTorch's rather than transformers' repeat_kv."""
    family = sys.modules[type(attn).__module__]
    window = window_of(config, attn)
    b, t, _ = x.shape
    with torch.no_grad():
        q, k, v = (proj(x).view(b, t, -1, attn.head_dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        cos, sin = rotary(x, positions)
        q, k = family.apply_rotary_pos_emb(q, k, cos, sin)
        i = torch.arange(t)
        allowed = i[None, :] <= i[:, None]
        if window:
            allowed &= i[None, :] > i[:, None] - window
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=attn.scaling, enable_gqa=True)
        out = attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    return out.numpy().astype(np.float64)


def rel_err(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def run(args, checks):
    pb, pb_grpc = lib.load_stubs()
    from transformers import DynamicCache
    configs = dict(FIXED)
    configs.update(random_configs(args.random, args.seed))
    if getattr(args, "only", None):  # A quick run (bench/gpu_quick.sh's rehearsal): these only.
        configs = {n: c for n, c in configs.items() if n in args.only.split(",")}
        if not configs:
            raise SystemExit(f"decoder_conformance: --only {args.only}: no such configuration; "
                             f"the fixed ones: {', '.join(FIXED)}")
    tmp = lib.temp_dir("attnserve-decoders-")
    models = os.path.join(tmp, "models")
    built = {}
    for n, (name, (family, keys)) in enumerate(configs.items()):
        config, layers, rotary, whole = build(family, keys, 1000 + n)
        ckpt = os.path.join(tmp, "checkpoints", name)
        export_model.export_decoder(whole, ckpt, {i: os.path.join(models, f"{name}_l{i}") for i in layers})
        built[name] = (config, layers, rotary)
    server = lib.Server(args.binary, "--models", models, *shlex.split(args.server_args))
    if getattr(args, "banner_excludes", ""):  # E.g. an instruction set the engine was capped below.
        at = server.banner.find(args.banner_excludes)
        checks(f"the server's start-up line names no {args.banner_excludes!r}"
               + (f" (it says ...{server.banner[max(at - 60, 0):at + 40]}...)" if at >= 0 else ""), at < 0)
    rng = np.random.default_rng(args.seed)
    try:
        with grpc.insecure_channel(server.target) as ch:
            stub = pb_grpc.AttentionServiceStub(ch)
            for name, (config, layers, rotary) in built.items():
                for i, attn in layers.items():
                    model = f"{name}_l{i}"
                    info = stub.GetModel(pb.GetModelRequest(name=model))
                    checks(f"{model}: GetModel says {info.num_kv_heads} key/value heads of {info.head_dim}, "
                           f"{info.family} layer {info.layer}",
                           info.num_kv_heads == config.num_key_value_heads and info.family == config.model_type
                           and info.layer == i and info.head_dim == attn.head_dim)
                    b, t, p0 = 2, int(rng.integers(5, 14)), int(rng.integers(0, 3000))
                    x = rng.standard_normal((b, t, config.hidden_size)).astype(np.float32)
                    pos = torch.arange(p0, p0 + t).expand(b, t)
                    want = reference(config, attn, rotary, torch.from_numpy(x), pos)
                    r = stub.Attend(pb.AttendRequest(model=model, query=lib.to_wire(pb, x), is_causal=True,
                                                     query_position=p0))
                    got = lib.from_wire(pb, r.output)
                    err = rel_err(got, want)
                    checks(f"{model}: prefill of {t} tokens from position {p0}: error {err:.1e} <= {args.tolerance}",
                           err <= args.tolerance)
                    err = rel_err(got, reference_sdpa(config, attn, rotary, torch.from_numpy(x), pos))
                    checks(f"{model}: the same prefill against scaled_dot_product_attention(enable_gqa=True): "
                           f"error {err:.1e}", err <= args.tolerance)
                    # Decoding: a prompt (64 tokens longer than the prefill's: the engine's kernels
                    # for a step over 64 keys or more), then one token a step, against the module
                    # with its cache.
                    steps, t = int(rng.integers(3, 7)), t + 64
                    xs = rng.standard_normal((b, t + steps, config.hidden_size)).astype(np.float32)
                    cache = DynamicCache(config=config)
                    handle = stub.OpenSession(pb.OpenSessionRequest(model=model, batch=b)).handle
                    worst, held = 0.0, 0
                    for chunk in [t] + [1] * steps:
                        xc = xs[:, held:held + chunk]
                        posc = torch.arange(held, held + chunk).expand(b, chunk)
                        want = reference(config, attn, rotary, torch.from_numpy(np.ascontiguousarray(xc)), posc, cache)
                        r = stub.Attend(pb.AttendRequest(model=model, session=handle, query=lib.to_wire(pb, xc)))
                        worst = max(worst, rel_err(lib.from_wire(pb, r.output), want))
                        held += chunk
                    checks(f"{model}: a {t}-token prompt then {steps} steps of one token: error {worst:.1e}",
                           worst <= args.tolerance)
                    # Roll back to `keep` tokens, fork there, and step each branch with its own
                    # tokens: both continue at position `keep`, against the module fed the prefix.
                    keep = int(rng.integers(1, held))
                    r = stub.TruncateSession(pb.TruncateSessionRequest(handle=handle, length=keep))
                    fork = stub.ForkSession(pb.ForkSessionRequest(handle=handle)).handle
                    worst = 0.0
                    for branch in (handle, fork):
                        cache = DynamicCache(config=config)
                        prefix = np.ascontiguousarray(xs[:, :keep])
                        reference(config, attn, rotary, torch.from_numpy(prefix),
                                  torch.arange(0, keep).expand(b, keep), cache)
                        for n in range(2):
                            xc = rng.standard_normal((b, 1, config.hidden_size)).astype(np.float32)
                            posc = torch.full((b, 1), keep + n)
                            want = reference(config, attn, rotary, torch.from_numpy(xc), posc, cache)
                            r = stub.Attend(pb.AttendRequest(model=model, session=branch, query=lib.to_wire(pb, xc)))
                            worst = max(worst, rel_err(lib.from_wire(pb, r.output), want))
                    for branch in (handle, fork):
                        stub.CloseSession(pb.ReleaseRequest(handle=branch))
                    checks(f"{model}: truncated to {keep} of {held} tokens, forked, two steps on each branch: "
                           f"error {worst:.1e}", worst <= args.tolerance)
    finally:
        server.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--tolerance", type=float, default=TOL)
    ap.add_argument("--random", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--banner-excludes", default="", help="text the server's start-up line must not hold")
    ap.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    args = ap.parse_args()
    checks = lib.Checks()
    run(args, checks)
    return checks.summary("decoder_conformance")


if __name__ == "__main__":
    sys.exit(main())
