#!/usr/bin/python3
"""Writes the small torch.save() fixtures in this directory with Debian's PyTorch, each valid one with
a safetensors twin holding the float32 values the reader must produce. Run from anywhere:
    /usr/bin/python3 tests/data/make_fixtures.py
"""
import json
import os
import struct

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def safetensors(path, tensors):
    header, data = {}, b""
    for name, t in tensors.items():
        raw = t.detach().to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


torch.manual_seed(3)
plain = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True).state_dict()
torch.save(plain, os.path.join(HERE, "mha_e8_h2.pt"))
safetensors(os.path.join(HERE, "mha_e8_h2.safetensors"), plain)

# Views (a transpose, an offset into a larger storage) and every float storage type.
base = torch.randn(8, 8)
big = torch.randn(40)
views = {
    "in_proj_weight": torch.randn(24, 8).to(torch.float16),
    "in_proj_bias": big[10:34].to(torch.float64)[::1],
    "out_proj.weight": base.t().to(torch.bfloat16),
    "out_proj.bias": big[30:38],
}
torch.save(views, os.path.join(HERE, "views_mixed_dtypes.pt"))
safetensors(os.path.join(HERE, "views_mixed_dtypes.safetensors"), views)

ints = dict(plain)
ints["in_proj_weight"] = torch.arange(24 * 8, dtype=torch.int64).reshape(24, 8)
torch.save(ints, os.path.join(HERE, "integer_weights.pt"))

# Hostile variants of the plain archive, each with valid CRCs (unless the CRC is the point), so that
# the reader's own checks are what refuses them.
import zipfile  # noqa: E402


def variant(name, change):
    src = zipfile.ZipFile(os.path.join(HERE, "mha_e8_h2.pt"))
    entries = [(i.filename.replace("mha_e8_h2/", name[:-3] + "/"), src.read(i)) for i in src.infolist()]
    entries = change(entries)
    with zipfile.ZipFile(os.path.join(HERE, name), "w", zipfile.ZIP_STORED) as out:
        for entry_name, data in entries:
            out.writestr(entry_name, data)


def patch(suffix, f):
    return lambda entries: [(n, f(d) if n.endswith(suffix) else d) for n, d in entries]


variant("storage_cut_short.pt", patch("/data/0", lambda d: d[:-4]))
variant("storage_padded.pt", patch("/data/0", lambda d: d + b"\0\0\0\0"))
variant("pickle_tuple1_on_empty_stack.pt", patch("data.pkl", lambda d: b"\x80\x02\x85."))
variant("pickle_global_os_system.pt", patch("data.pkl", lambda d: b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueR."))
variant("pickle_truncated.pt", patch("data.pkl", lambda d: d[: len(d) // 2]))
with open(os.path.join(HERE, "mha_e8_h2.pt"), "rb") as f:
    raw = bytearray(f.read())
info = zipfile.ZipFile(os.path.join(HERE, "mha_e8_h2.pt")).getinfo("mha_e8_h2/data/0")
name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
raw[info.header_offset + 30 + name_len + extra_len + 5] ^= 0xFF  # a byte of that storage
with open(os.path.join(HERE, "crc_mismatch.pt"), "wb") as f:
    f.write(raw)
