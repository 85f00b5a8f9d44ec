#!/usr/bin/python3
"""The server as outside tools see it: a Python gRPC client, server reflection, promtool, and a real
Prometheus scraping /metrics. Starts the real attnserve binary and stops it with SIGTERM (exit 0).

usage: python3 -m pytest python_client_test.py --attnserve PATH/TO/attnserve
"""
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request

import grpc
import numpy as np
from google.protobuf import descriptor_pb2

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402

check = lib.Checks()


def fields(buf):
    """Decodes one protobuf message level: [(field number, wire type, value)]."""
    out, i = [], 0
    while i < len(buf):
        key, i = varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = varint(buf, i)
        elif wt == 2:
            n, i = varint(buf, i)
            v, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wt}")
        out.append((num, wt, v))
    return out


def varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def reflection(channel, request):
    """One ServerReflectionInfo exchange, messages encoded by hand (no reflection package here)."""
    call = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                 request_serializer=lambda b: b, response_deserializer=lambda b: b)
    return next(iter(call(iter([request]), timeout=10)))


def test_python_client_reflection_and_metrics(attnserve):
    pb, rpc = lib.load_stubs()
    server = lib.Server(attnserve)
    channel = grpc.insecure_channel(server.target)
    stub = rpc.AttentionServiceStub(channel)
    tmp = lib.temp_dir("attnserve-pyclient-")
    prom = None
    try:
        # The Python client path.
        x = np.random.default_rng(1).standard_normal((2, 6, 512)).astype(np.float32)
        r = stub.Attend(pb.AttendRequest(model="demo", query=lib.to_wire(pb, x), request_id=5), timeout=30)
        out = lib.from_wire(pb, r.output)
        check("python client attends", out.shape == (2, 6, 512) and np.isfinite(out).all() and r.request_id == 5)
        try:
            stub.Attend(pb.AttendRequest(model="demo", query=lib.to_wire(pb, x[:, :, :500])), timeout=30)
            check("python client sees INVALID_ARGUMENT", False, "no error")
        except grpc.RpcError as e:
            check("python client sees INVALID_ARGUMENT", e.code() == grpc.StatusCode.INVALID_ARGUMENT
                  and "embed_dim=500" in e.details(), e.details())

        # Reflection: list_services (field 7), then file_containing_symbol (field 4).
        resp = fields(reflection(channel, b"\x3a\x00"))
        listing = [v for n, _, v in resp if n == 6][0]
        names = [fields(s)[0][2].decode() for n, _, s in fields(listing) if n == 1]
        check("reflection lists the services", "attnserve.v1.AttentionService" in names
              and "grpc.health.v1.Health" in names, names)
        sym = b"attnserve.v1.AttentionService"
        resp = fields(reflection(channel, b"\x22" + bytes([len(sym)]) + sym))
        fd_resp = [v for n, _, v in resp if n == 4][0]
        files = [descriptor_pb2.FileDescriptorProto.FromString(v) for n, _, v in fields(fd_resp) if n == 1]
        methods = [m.name for f in files for s in f.service for m in s.method]
        check("reflection serves the .proto", {"Attend", "AttendStream", "CreateMemory", "DeleteMemory",
                                               "OpenSession", "CloseSession"} <= set(methods), methods)

        # Keys and values kept on the server, from Python: a session's two steps equal one causal
        # self-attention over both (float32: 1e-5 relative to the output's scale); a memory equals
        # sending its key and value.
        seq = np.random.default_rng(2).standard_normal((1, 5, 512)).astype(np.float32)
        whole = lib.from_wire(pb, stub.Attend(pb.AttendRequest(model="demo", query=lib.to_wire(pb, seq),
                                                               is_causal=True), timeout=30).output)
        s = stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), timeout=30)
        first = stub.Attend(pb.AttendRequest(session=s.handle, query=lib.to_wire(pb, seq[:, :3])), timeout=30)
        second = stub.Attend(pb.AttendRequest(session=s.handle, query=lib.to_wire(pb, seq[:, 3:]), session_length=3),
                             timeout=30)
        steps = np.concatenate([lib.from_wire(pb, first.output), lib.from_wire(pb, second.output)], axis=1)
        err = float(np.abs(steps - whole).max() / np.abs(whole).max())
        freed = stub.CloseSession(pb.ReleaseRequest(handle=s.handle), timeout=30).bytes_freed
        check("python client: session steps = one causal call", len(s.handle) == 32 and second.session_length == 5
              and err <= 1e-5 and freed > 0, f"err {err:.2e}, length {second.session_length}, freed {freed}")
        mem = stub.CreateMemory(pb.CreateMemoryRequest(model="demo", key=lib.to_wire(pb, seq), value=lib.to_wire(pb, seq)),
                                timeout=30)
        q = x[:1]
        by_handle = lib.from_wire(pb, stub.Attend(pb.AttendRequest(memory=mem.handle, query=lib.to_wire(pb, q)),
                                                  timeout=30).output)
        by_value = lib.from_wire(pb, stub.Attend(pb.AttendRequest(model="demo", query=lib.to_wire(pb, q),
                                                                  key=lib.to_wire(pb, seq), value=lib.to_wire(pb, seq)),
                                                 timeout=30).output)
        err = float(np.abs(by_handle - by_value).max() / np.abs(by_value).max())
        stub.DeleteMemory(pb.ReleaseRequest(handle=mem.handle), timeout=30)
        try:
            stub.Attend(pb.AttendRequest(memory=mem.handle, query=lib.to_wire(pb, q)), timeout=30)
            gone = "answered"
        except grpc.RpcError as e:
            gone = f"{e.code().name}: {e.details()}"
        check("python client: memory = its key and value; deleted -> NOT_FOUND", err <= 1e-5
              and gone.startswith("NOT_FOUND") and "deleted" in gone, f"err {err:.2e}, then {gone}")

        # promtool on the exposition.
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read()
        lint = subprocess.run(["promtool", "check", "metrics"], input=metrics, capture_output=True)
        attn_problems = [l for l in (lint.stdout + lint.stderr).decode().splitlines() if "attnserve_" in l]
        check("promtool check metrics: attnserve_* clean", not attn_problems, attn_problems)

        # A real Prometheus scrapes the server and sees the requests.
        port = 19090 + os.getpid() % 1000
        with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
            f.write("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: attnserve\n"
                    f"    static_configs:\n      - targets: ['127.0.0.1:{server.metrics_port}']\n")
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp}/prometheus.yml",
                                 f"--storage.tsdb.path={tmp}/data", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        query = "sum(attnserve_requests_total{model=\"demo\",method=\"Attend\"})"
        seen = []

        def scraped():
            try:
                url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
                res = json.load(urllib.request.urlopen(url, timeout=2))["data"]["result"]
                seen[:] = [float(res[0]["value"][1])] if res else []
                return bool(seen) and seen[0] >= 2
            except OSError:
                return False

        check("prometheus scrapes attnserve_requests_total", lib.wait_until(scraped, timeout=60, step=0.5), seen)
    finally:
        if prom:
            prom.terminate()
            prom.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
        log = server.stop()
        check("SIGTERM drains and exits 0", "stopped" in log, log)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
