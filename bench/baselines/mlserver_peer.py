#!/usr/bin/env python3
"""A peer a user would pick to serve a PyTorch module over the Open Inference Protocol: Seldon MLServer
(mlserver 1.7.1), set up as its documentation for custom runtimes says: an mlserver.MLModel subclass
(`async def load`, `async def predict(payload: InferenceRequest) -> InferenceResponse`, NumpyCodec to
decode and encode), named by a model-settings.json and served with `mlserver start DIR`. Serves
torch.nn.MultiheadAttention (E=512, 8 heads, batch-first; its own random weights, torch.manual_seed(0),
float32, eval mode) as model `demo` over KServe v2 gRPC (inference.GRPCInferenceService), so
bench/python_clients.py's "oip" client (tritonclient) drives it unchanged: input "query" FP32
[1, L, 512] (self-attention: key = value = query; optional inputs "key" and "value" make it
cross-attention), output "attn_output" FP32 [1, L, 512].

Settings (written to a temporary directory, the model's own folder): parallel_workers = one inference
worker process per core (MLServer's default is 1), the cores split between them as PyTorch threads
(1 each on 2 cores); debug (a log line per request) and the Prometheus metrics server off; REST on a
free port; everything on 127.0.0.1. No adaptive batching (max_batch_size/max_batch_time): it merges
requests by joining their data and summing their first axes under the first request's other dimensions
(mlserver/batching/requests.py), so requests of different lengths L, as in W1, would be mis-shaped; it
pads nothing.

usage (tools/peer-env.sh mlserver makes the venv): build-peers/venv-mlserver/bin/python
    bench/baselines/mlserver_peer.py --port PORT [--workers N] [--http-port PORT]
Prints "... serving on 127.0.0.1:PORT" once the model is ready; SIGTERM stops MLServer and its worker
processes (MLServer's own shutdown, then whatever is left of its process group).
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib.metadata import version

import numpy as np
import torch
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class Attention(MLModel):
    """The runtime MLServer's workers import (model-settings.json: "mlserver_peer.Attention")."""

    async def load(self) -> bool:
        torch.set_num_threads(int(os.environ.get("ATTNSERVE_PEER_TORCH_THREADS", "1")))
        torch.manual_seed(0)
        self.mha = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval()
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {i.name: torch.from_numpy(np.asarray(self.decode(i, default_codec=NumpyCodec), dtype=np.float32))
                  for i in payload.inputs}
        query = inputs["query"]
        key = inputs.get("key", query)
        value = inputs.get("value", key)
        with torch.inference_mode():
            out, _ = self.mha(query, key, value, need_weights=False)
        return InferenceResponse(model_name=self.name, id=payload.id,
                                 outputs=[NumpyCodec.encode_output("attn_output", out.numpy())])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True, help="gRPC (Open Inference Protocol) port")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="MLServer's parallel_workers")
    p.add_argument("--http-port", type=int, default=0, help="MLServer's REST port (default: a free one)")
    a = p.parse_args()
    http_port = a.http_port or free_port()
    threads = max(1, os.cpu_count() // max(1, a.workers))
    root = tempfile.mkdtemp(prefix="attnserve-mlserver-")
    with open(os.path.join(root, "settings.json"), "w") as f:
        json.dump({"host": "127.0.0.1", "grpc_port": a.port, "http_port": http_port,
                   "parallel_workers": a.workers, "debug": False, "metrics_endpoint": None,
                   "load_models_at_startup": True}, f)
    model_dir = os.path.join(root, "demo")
    os.mkdir(model_dir)
    with open(os.path.join(model_dir, "model-settings.json"), "w") as f:
        json.dump({"name": "demo", "implementation": "mlserver_peer.Attention"}, f)
    env = dict(os.environ, ATTNSERVE_PEER_TORCH_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                        os.environ.get("PYTHONPATH")])))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    # Its own session (process group), so that whatever MLServer leaves (its workers) can be ended at once.
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "mlserver"), "start", root],
                              cwd=root, env=env, start_new_session=True)
    try:
        ready = f"http://127.0.0.1:{http_port}/v2/models/demo/ready"
        while not stop and server.poll() is None:
            try:
                with urllib.request.urlopen(ready, timeout=1) as r:
                    if r.status == 200:
                        socket.create_connection(("127.0.0.1", a.port), timeout=1).close()
                        break
            except OSError:
                pass
            time.sleep(0.2)
        if server.poll() is None and not stop:
            print(f"mlserver {version('mlserver')} peer (torch {torch.__version__}, {a.workers} workers, "
                  f"{threads} torch threads each) serving on 127.0.0.1:{a.port} (REST on {http_port})", flush=True)
        while not stop and server.poll() is None:
            time.sleep(0.2)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)  # MLServer stops its servers and its inference workers.
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(server.pid, signal.SIGKILL)  # Anything of its group still there (none, normally).
        except ProcessLookupError:
            pass
        server.wait()
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if stop else server.returncode or 1)


if __name__ == "__main__":
    main()
