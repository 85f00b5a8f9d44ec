#!/usr/bin/env python3
"""A peer a user would pick to serve a PyTorch module over the Open Inference Protocol: KServe's Python
model server (kserve 0.21), set up as its documentation for custom Python models says: a kserve.Model
subclass whose load() builds the module and whose predict() takes an InferRequest and returns an
InferResponse, handed to kserve.ModelServer(...).start([model]). Serves torch.nn.MultiheadAttention
(E=512, 8 heads, batch-first; its own random weights, torch.manual_seed(0), float32, eval mode) as
model `demo` over KServe v2 gRPC (inference.GRPCInferenceService), so bench/python_clients.py's "oip"
client (tritonclient) drives it unchanged: input "query" FP32 [1, L, 512] (self-attention: key = value
= query; optional inputs "key" and "value" make it cross-attention), output "attn_output" FP32 [1, L, 512].

Settings are KServe's defaults, as a user would run it: one process (KServe's `workers` only multiplies
its REST server, never the gRPC one), the documented synchronous predict() run on the server's event
loop one request at a time, PyTorch's own intra-op threads (one per core). Only its log line per
request (enable_latency_logging) is turned off: it would write a line a millisecond. KServe's request
batching is a Kubernetes sidecar (the InferenceService's `batcher`), not part of the Python server, so
there is none here.

usage (tools/peer-env.sh kserve makes the venv): build-peers/venv-kserve/bin/python
    bench/baselines/kserve_peer.py --port PORT [--http-port PORT] [--torch-threads N]
Prints "... serving on 127.0.0.1:PORT" when ready; SIGTERM stops it (KServe's own signal handling).
"""
import argparse
import socket
import sys
import threading
import time
import uuid


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True, help="gRPC (Open Inference Protocol) port")
    p.add_argument("--http-port", type=int, default=0, help="KServe's REST port (default: a free one)")
    p.add_argument("--torch-threads", type=int, default=0, help="PyTorch's threads (default: its own, one per core)")
    a = p.parse_args()
    http_port = a.http_port or free_port()
    # kserve.model_server parses sys.argv when imported (parse_known_args): show it none of ours.
    sys.argv = sys.argv[:1]

    from importlib.metadata import version

    import numpy as np
    import torch
    from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer

    class Attention(Model):
        def __init__(self, name):
            super().__init__(name)
            self.mha = None
            self.ready = False
            self.load()

        def load(self):
            if a.torch_threads:
                torch.set_num_threads(a.torch_threads)
            torch.manual_seed(0)
            self.mha = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval()
            self.ready = True

        def predict(self, payload: InferRequest, headers=None, response_headers=None) -> InferResponse:
            inputs = {i.name: torch.from_numpy(np.asarray(i.as_numpy(), dtype=np.float32)) for i in payload.inputs}
            query = inputs["query"]
            key = inputs.get("key", query)
            value = inputs.get("value", key)
            with torch.inference_mode():
                out, _ = self.mha(query, key, value, need_weights=False)
            output = InferOutput(name="attn_output", shape=list(out.shape), datatype="FP32")
            output.set_data_from_numpy(out.numpy(), binary_data=True)
            return InferResponse(response_id=payload.id or str(uuid.uuid4()), model_name=self.name,
                                 infer_outputs=[output])

    model = Attention("demo")

    def announce():  # ModelServer.start() blocks: say "serving" once the gRPC port takes connections.
        while True:
            try:
                socket.create_connection(("127.0.0.1", a.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        print(f"kserve {version('kserve')} peer (torch {torch.__version__}, {torch.get_num_threads()} threads) "
              f"serving on 127.0.0.1:{a.port} (REST on {http_port})", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    ModelServer(grpc_port=a.port, http_port=http_port, enable_latency_logging=False).start([model])


if __name__ == "__main__":
    main()
