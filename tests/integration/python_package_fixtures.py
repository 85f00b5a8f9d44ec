"""Fixtures for python_package_test.py, made with Debian's torch (the package's newest-grpcio environment
has no torch): two models exported as a model repository, random inputs (fixed seeds) and their
float64 nn.MultiheadAttention references, in DIR/cases.npz; a decoder layer's checkpoint (random
weights) served as model "dec".

usage: python_package_fixtures.py DIR      (Debian's python3)
"""
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
import attnserve_py as lib  # noqa: E402
import export_model  # noqa: E402

E, H = 32, 4


def build(seed, **kw):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, H, batch_first=True, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "bias" in name:
                p.uniform_(-0.5, 0.5)
    return m.train()  # dropout 0: eval()'s numbers, off 1.13's fast path


def main(outdir):
    models = {"mha": build(31), "xattn": build(32, kdim=16, vdim=24)}
    for name, m in models.items():
        export_model.export(m, os.path.join(outdir, "models", name))
    rng = np.random.default_rng(20261124)
    f64 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64))
    cases = {}
    mha, xattn = models["mha"].double(), models["xattn"].double()
    with torch.no_grad():
        # Self-attention, key padding (bool) and a bool mask, averaged weights.
        q = rng.standard_normal((2, 6, E)).astype(np.float32)
        kpm = np.arange(6)[None, :] >= np.array([[6], [4]])
        mask = rng.random((6, 6)) < 0.3
        mask[:, 0] = False
        out, w = mha(f64(q), f64(q), f64(q), key_padding_mask=torch.from_numpy(kpm), attn_mask=torch.from_numpy(mask))
        cases.update(self_q=q, self_kpm=kpm, self_mask=mask, self_out=out.numpy(), self_w=w.numpy())
        # Sequence-first, a float mask per head, per-head weights.
        q = rng.standard_normal((5, 3, E)).astype(np.float32)
        fm = rng.standard_normal((3 * H, 5, 5)).astype(np.float32)
        qb = f64(q.transpose(1, 0, 2))
        out, w = mha(qb, qb, qb, attn_mask=f64(fm), average_attn_weights=False)
        cases.update(sf_q=q, sf_mask=fm, sf_out=out.numpy().transpose(1, 0, 2), sf_w=w.numpy())
        # Causal, and the half-precision dtypes (references on the values as sent).
        q = rng.standard_normal((1, 9, E)).astype(np.float32)
        causal = torch.ones(9, 9, dtype=torch.bool).triu(1)
        cases.update(causal_q=q, causal_out=mha(f64(q), f64(q), f64(q), attn_mask=causal)[0].numpy())
        q16 = rng.standard_normal((2, 5, E)).astype(np.float16)
        cases.update(fp16_q=q16, fp16_out=mha(f64(q16), f64(q16), f64(q16))[0].numpy())
        qbf = torch.from_numpy(rng.standard_normal((2, 5, E)).astype(np.float32)).bfloat16()
        cases.update(bf16_q=qbf.float().numpy(), bf16_out=mha(qbf.double(), qbf.double(), qbf.double())[0].numpy())
        # Cross-attention (kdim, vdim); the same keys and values as a memory.
        q = rng.standard_normal((2, 3, E)).astype(np.float32)
        k = rng.standard_normal((2, 7, 16)).astype(np.float32)
        v = rng.standard_normal((2, 7, 24)).astype(np.float32)
        cases.update(cross_q=q, cross_k=k, cross_v=v, cross_out=xattn(f64(q), f64(k), f64(v))[0].numpy())
        # A session's steps of 2, 3 and 1 tokens = causal self-attention over the six, row by row.
        x = rng.standard_normal((2, 6, E)).astype(np.float32)
        causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
        cases.update(session_x=x, session_out=mha(f64(x), f64(x), f64(x), attn_mask=causal)[0].numpy())
    # A decoder layer (Llama-style: 4 query heads on 2 key/value heads, RoPE), random weights.
    lib.export_random_decoder(outdir, E, H, 2, rng)
    cases.update(dec_x=rng.standard_normal((2, 6, E)).astype(np.float32))
    np.savez(os.path.join(outdir, "cases.npz"), **cases)


if __name__ == "__main__":
    main(sys.argv[1])
