#!/usr/bin/python3
"""What a user might write instead of attnserve: a Python gRPC server (grpcio) that wraps
torch.nn.MultiheadAttention behind the same .proto. Batch-first, unary Attend and GetModel only;
one request at a time per gRPC worker thread, no batching. Computes on --device (cpu, cuda, cuda:N)
in --dtype (float32, bfloat16, float16: as attnserve --dtype); takes FLOAT32, FLOAT16 or BFLOAT16
queries, keys and values and answers in the query's dtype. GetModel says where it computes.
The model: an attnserve model directory (--model-dir DIR: config.json and model.safetensors, as
tools/export_model.py writes them; served under its directory's name), or, by default, a
512-wide, 8-head nn.MultiheadAttention from seed 0 served as "demo".
Runs on whichever PyTorch its interpreter has (Debian's 1.13, the 2.x flavour's venv, or the GPU
machine's).

usage: python_server.py --port PORT [--workers N] [--device D] [--dtype T] [--model-dir DIR]
"""
import argparse
import json
import os
import struct
import sys
from concurrent import futures

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "lib"))
import attnserve_py as lib  # noqa: E402  (stubs generated from proto/ at start)

pb, rpc = lib.load_stubs()

_WIRE = {pb.DATA_TYPE_FLOAT32: torch.float32, pb.DATA_TYPE_FLOAT16: torch.float16,
         pb.DATA_TYPE_BFLOAT16: torch.bfloat16}
_SAFETENSORS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F64": torch.float64}


def read_safetensors(path):
    """{name: tensor} of a safetensors file (8-byte header length, JSON header, raw data)."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[lo:hi]), dtype=_SAFETENSORS[t["dtype"]]).reshape(t["shape"])
    return out


def load_model(model_dir):
    """(name, nn.MultiheadAttention) of an attnserve model directory, or the built-in demo."""
    if not model_dir:
        torch.manual_seed(0)
        return "demo", torch.nn.MultiheadAttention(512, 8, batch_first=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    state = read_safetensors(os.path.join(model_dir, config.get("weights", "model.safetensors")))
    embed = state["out_proj.weight"].shape[0]
    separate = "q_proj_weight" in state  # kdim or vdim other than embed_dim
    mha = torch.nn.MultiheadAttention(embed, config["num_heads"], batch_first=True,
                                      bias="in_proj_bias" in state, add_bias_kv="bias_k" in state,
                                      add_zero_attn=config.get("add_zero_attn", False),
                                      kdim=state["k_proj_weight"].shape[1] if separate else None,
                                      vdim=state["v_proj_weight"].shape[1] if separate else None)
    mha.load_state_dict(state)
    return os.path.basename(os.path.normpath(model_dir)), mha


class Servicer(rpc.AttentionServiceServicer):
    def __init__(self, name, mha, device, dtype):
        self.name, self.device, self.dtype = name, torch.device(device), dtype
        self.mha = mha.eval().to(self.device, dtype)

    def GetModel(self, request, context):
        dtype = {torch.float32: pb.DATA_TYPE_FLOAT32, torch.float16: pb.DATA_TYPE_FLOAT16,
                 torch.bfloat16: pb.DATA_TYPE_BFLOAT16}[self.dtype]
        device = str(self.device) if self.device.type == "cpu" or self.device.index is not None \
            else f"cuda:{torch.cuda.current_device()}"
        return pb.ModelInfo(name=self.name, embed_dim=self.mha.embed_dim, num_heads=self.mha.num_heads,
                            kdim=self.mha.kdim, vdim=self.mha.vdim, compute_dtype=dtype, device=device,
                            version=1, source="python_server.py")

    def Attend(self, request, context):
        wire = _WIRE.get(request.query.dtype)
        if wire is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "query: dtype must be FLOAT32, FLOAT16 or BFLOAT16")

        def tensor(t):  # Wire bytes (numpy has no bfloat16: through torch) on the device.
            x = torch.frombuffer(bytearray(t.data), dtype=_WIRE[t.dtype]).reshape(tuple(t.shape))
            return x.to(self.device, self.dtype)
        q = tensor(request.query)
        k = tensor(request.key) if request.HasField("key") else q
        v = tensor(request.value) if request.HasField("value") else q
        with torch.inference_mode():
            out, _ = self.mha(q, k, v, need_weights=False)
            out = out.to(wire).cpu().contiguous()  # The answer in the query's dtype, as attnserve's.
        data = out.view(torch.int16).numpy().tobytes() if wire != torch.float32 else out.numpy().tobytes()
        return pb.AttendResponse(request_id=request.request_id, model=self.name,
                                 output=pb.Tensor(dtype=request.query.dtype, shape=out.shape, data=data))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--model-dir", default="")
    a = p.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=a.workers),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    name, mha = load_model(a.model_dir)
    rpc.add_AttentionServiceServicer_to_server(Servicer(name, mha, a.device, getattr(torch, a.dtype)), server)
    server.add_insecure_port(f"127.0.0.1:{a.port}")
    server.start()
    print(f"python baseline (PyTorch {torch.__version__}, {name} on {a.device} in {a.dtype}) serving on "
          f"127.0.0.1:{a.port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
