#!/usr/bin/python3
"""Writes the fuzz targets' seed corpora under tests/fuzz/corpus/: valid inputs of every kind the
readers accept (the fuzzer mutates from there). Run: /usr/bin/python3 tests/fuzz/make_corpus.py"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
import attnserve_py as lib  # noqa: E402

DATA = os.path.join(HERE, "..", "data")


def out(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


pb, _ = lib.load_stubs()
rng = np.random.default_rng(0)


def t(*shape, dtype="float32"):
    return lib.to_wire(pb, rng.standard_normal(shape), dtype)


requests = {
    "self": pb.AttendRequest(model="fuzz", query=t(2, 3, 16)),
    "cross_masks": pb.AttendRequest(model="fuzz", query=t(2, 3, 16), key=t(2, 5, 16), value=t(2, 5, 16),
                                    key_padding_mask=lib.to_wire(pb, rng.random((2, 5)) < 0.3),
                                    attn_mask=lib.to_wire(pb, rng.random((3, 5)) < 0.3), is_causal=True,
                                    attn_weights=pb.ATTN_WEIGHTS_PER_HEAD, request_id=7),
    "mask3d_seqfirst": pb.AttendRequest(model="fuzz", query=t(3, 2, 16), attn_mask=t(8, 3, 3),
                                        layout=pb.LAYOUT_SEQUENCE_FIRST, attn_weights=pb.ATTN_WEIGHTS_AVERAGED),
    "unbatched_half": pb.AttendRequest(model="fuzz", query=t(4, 16, dtype="float16"),
                                       key_padding_mask=lib.to_wire(pb, rng.random(4) < 0.5)),
    "kdim6": pb.AttendRequest(model="fuzz", query=t(1, 2, 8), key=t(1, 3, 6), value=t(1, 3, 6)),
}
for name, r in requests.items():
    out("request", name, r.SerializeToString())
for target, names in (("safetensors", ("mha_e8_h2.safetensors", "views_mixed_dtypes.safetensors")),
                      ("torch_archive", ("mha_e8_h2.pt", "views_mixed_dtypes.pt", "integer_weights.pt"))):
    for name in names:
        with open(os.path.join(DATA, name), "rb") as f:
            out(target, name, f.read())
configs = {
    "minimal": b'{"num_heads": 8}',
    "full": b'{"num_heads": 2, "weights": "model.safetensors", "add_zero_attn": true}',
    "nested": b'{"num_heads": 4, "weights": "m.pt", "add_zero_attn": false}',
}
for name, c in configs.items():
    out("config", name, c)
