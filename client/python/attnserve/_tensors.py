"""numpy arrays and torch tensors to and from attnserve.v1 Tensors (row-major little-endian bytes)."""
import sys

import numpy as np

from . import _shm
from .v1 import attention_pb2 as pb

_NUMPY = {"float32": pb.DATA_TYPE_FLOAT32, "float16": pb.DATA_TYPE_FLOAT16, "bfloat16": pb.DATA_TYPE_BFLOAT16,
          "bool": pb.DATA_TYPE_BOOL}
_NAMES = {pb.DATA_TYPE_FLOAT32: "float32", pb.DATA_TYPE_FLOAT16: "float16", pb.DATA_TYPE_BFLOAT16: "bfloat16",
          pb.DATA_TYPE_BOOL: "bool"}


def _torch():
    """torch when the caller has imported it (a torch tensor cannot exist otherwise)."""
    return sys.modules.get("torch")


def is_torch(x):
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def narrowed(x, wire):
    """float32 `x` (numpy or torch) as the 16-bit bytes of `wire` ("bfloat16", "float16"): a uint16 numpy
    array of bfloat16 bits (rounded to nearest even) or a float16 array; None when `x` is not float32."""
    if is_torch(x):
        torch = _torch()
        if x.dtype != torch.float32:
            return None
        x = x.detach().to("cpu").contiguous().numpy()
    a = np.asarray(x)
    if a.dtype != np.float32 or _shm.ref_of(a) is not None:
        return None
    a = np.ascontiguousarray(a, dtype="<f4")
    if wire == "float16":
        return a.astype("<f2")
    u = a.view("<u4")
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def widened(a):
    """A 16-bit answer (numpy bfloat16 or float16, or torch) as float32, exactly."""
    if is_torch(a):
        return a.float()
    if a.dtype == np.float16:
        return a.astype(np.float32)
    if a.dtype.name == "bfloat16":
        return (a.view("<u2").astype("<u4") << 16).view("<f4")
    return a


def to_wire(x, field, into, wire=None):
    """Writes a numpy array (float32, float16, ml_dtypes.bfloat16, bool) or torch tensor (float32,
    float16, bfloat16, bool; any device) into the Tensor message `into` (in place: the bytes are copied
    once, into the message); with `wire` ("bfloat16" or "float16"), float32 goes in that dtype. TypeError
    naming `field` for anything else."""
    if wire is not None:
        n = narrowed(x, wire)
        if n is not None:
            return _fill(into, _NUMPY[wire], tuple(x.shape), n)
    if is_torch(x):
        torch = _torch()
        t = x.detach().to("cpu").contiguous()
        names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.bool: "bool"}
        if t.dtype not in names:
            raise TypeError(f"{field}: torch dtype {t.dtype}; allowed: float32, float16, bfloat16, bool")
        # bfloat16 has no numpy twin in torch: its bits travel as int16.
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return _fill(into, _NUMPY[names[t.dtype]], t.shape, raw.numpy())
    a = np.asarray(x)
    if a.dtype.name not in _NUMPY:
        raise TypeError(f"{field}: numpy dtype {a.dtype}; allowed: float32, float16, bfloat16 (ml_dtypes), bool")
    ref = _shm.ref_of(a)
    if ref is not None:  # Backed by a registered region: the server reads it there.
        into.dtype = _NUMPY[a.dtype.name]
        into.shape[:] = list(a.shape)
        into.shared_memory.CopyFrom(ref)
        return into
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    return _fill(into, _NUMPY[a.dtype.name], a.shape, a)


def _fill(into, dtype, shape, array):
    into.dtype = dtype
    into.shape[:] = list(shape)
    into.data = array.tobytes()
    return into


def from_wire(t, like_torch, out=None, widen=False):
    """A Tensor as a numpy array, or as a torch tensor when `like_torch` (the query was one); `out`, when the
    server wrote the answer into that region-backed array; `widen`: a 16-bit answer as float32 (the query
    was float32, sent in the model's dtype)."""
    if out is not None:
        return out
    if widen and not like_torch and t.dtype in (pb.DATA_TYPE_BFLOAT16, pb.DATA_TYPE_FLOAT16):
        bits = np.frombuffer(t.data, dtype="<u2").reshape(tuple(t.shape))
        if t.dtype == pb.DATA_TYPE_FLOAT16:
            return bits.view("<f2").astype(np.float32)
        return (bits.astype("<u4") << 16).view("<f4")
    if widen and like_torch:
        return widened(from_wire(t, like_torch))
    name = _NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"answer: tensor dtype {t.dtype} is not one attnserve sends")
    shape = tuple(t.shape)
    if like_torch:
        torch = _torch()
        dtypes = {"float32": torch.float32, "float16": torch.float16, "bool": torch.bool}
        if name == "bfloat16":
            bits = torch.from_numpy(np.frombuffer(t.data, dtype="<i2").copy())
            return bits.view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(np.frombuffer(t.data, dtype=name).copy()).reshape(shape)
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:
            raise ImportError("a bfloat16 answer as numpy needs ml_dtypes (pip install 'attnserve[bfloat16]'), "
                              "or send torch tensors") from e
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(name)
    return np.frombuffer(t.data, dtype=dt).reshape(shape)


def flat_ints(x):
    """Positions (a list, a numpy array or a torch tensor of any shape) as a flat list of ints, batch-first."""
    if is_torch(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise ValueError(f"positions: dtype {a.dtype}; expected integers")
    return a.reshape(-1).tolist()
