#!/usr/bin/python3
"""What a user might write instead of attnserve: a Python gRPC server (Debian's python3-grpcio) that
wraps torch.nn.MultiheadAttention behind the same .proto. Batch-first, unary Attend
only; computes in float32, or in bfloat16 with --dtype bfloat16 (as attnserve --dtype bfloat16 does);
takes FLOAT32 or BFLOAT16 queries, keys and values and answers in the query's dtype.
Runs on whichever PyTorch its interpreter has (Debian's 1.13, or the 2.x flavour's venv).

usage: python_server.py --port PORT [--workers N] [--dtype float32|bfloat16]
"""
import argparse
import os
import sys
from concurrent import futures

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "lib"))
import attnserve_py as lib  # noqa: E402  (stubs generated from proto/ at start)

pb, rpc = lib.load_stubs()


class Servicer(rpc.AttentionServiceServicer):
    def __init__(self, dtype):
        torch.manual_seed(0)
        self.dtype = dtype
        self.mha = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval().to(dtype)

    def Attend(self, request, context):
        bf16_wire = request.query.dtype == pb.DATA_TYPE_BFLOAT16

        def tensor(t):  # FLOAT32 or BFLOAT16 bytes (numpy has no bfloat16: through torch)
            if t.dtype == pb.DATA_TYPE_BFLOAT16:
                x = torch.frombuffer(bytearray(t.data), dtype=torch.bfloat16)
            else:
                x = torch.from_numpy(np.frombuffer(t.data, dtype=np.float32))
            return x.reshape(tuple(t.shape)).to(self.dtype)
        q = tensor(request.query)
        k = tensor(request.key) if request.HasField("key") else q
        v = tensor(request.value) if request.HasField("value") else q
        with torch.inference_mode():
            out, _ = self.mha(q, k, v, need_weights=False)
            # The answer in the query's dtype, as attnserve answers.
            out = out.to(torch.bfloat16 if bf16_wire else torch.float32).contiguous()
        data = out.view(torch.int16).numpy().tobytes() if bf16_wire else out.numpy().tobytes()
        return pb.AttendResponse(request_id=request.request_id, model="demo",
                                 output=pb.Tensor(dtype=pb.DATA_TYPE_BFLOAT16 if bf16_wire else pb.DATA_TYPE_FLOAT32,
                                                  shape=out.shape, data=data))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = p.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=a.workers),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    rpc.add_AttentionServiceServicer_to_server(Servicer(getattr(torch, a.dtype)), server)
    server.add_insecure_port(f"127.0.0.1:{a.port}")
    server.start()
    print(f"python baseline (PyTorch {torch.__version__}, {a.dtype}) serving on 127.0.0.1:{a.port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
