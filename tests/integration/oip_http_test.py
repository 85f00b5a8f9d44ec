"""The Open Inference Protocol over HTTP/REST with the clients people already have: unmodified
tritonclient[http] 2.73 from PyPI (tools/oip-env.sh), plain http.client and curl, against a real
attnserve's --http-address.

Checks: health, metadata and the repository index; infer() across a matrix (FP32, FP16, BF16;
masks; weights; both layouts; cross-attention), tensors as JSON and as binary data, against
torch.nn.MultiheadAttention (fixed seeds; max|out-ref|/max|ref| <= 1e-5 in FP32, 2e-3 FP16, 2e-2
BF16 against float64) and byte for byte equal to tritonclient.grpc's answer to the same request
(JSON numbers round-trip float32 exactly); errors as {"error": ...} with the status mapping's HTTP
codes; the bounds (a Content-Length past --max-message-bytes refused before the body is sent, a
chunked body when it passes it, a JSON nesting bomb, an encoded body, connections per peer, idle
connections, a body that trickles); shared memory and sequences; the calls counted in /metrics under
method="http/ModelInfer"; every curl command of docs/api.md "HTTP"; a request in flight at SIGTERM
answered.

usage: python3 -m pytest oip_http_test.py --attnserve PATH/TO/attnserve   (tools/oip-env.sh's python)
"""
import http.client
import json
import os
import re
import selectors
import shlex
import socket
import struct
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
import attnserve_py as lib  # noqa: E402
import export_model  # noqa: E402

E, H = 64, 4
NP = {"FP32": np.float32, "FP16": np.float16, "BF16": ml_dtypes.bfloat16}
TOL = {"FP32": 1e-5, "FP16": 2e-3, "BF16": 2e-2}


def build(seed, kdim=None, vdim=None):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=True)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if "bias" in pname:
                p.uniform_(-0.5, 0.5)
    return m.train()


def serve(attnserve, *args, models=None):
    tmp = lib.temp_dir("attnserve-http-")
    models = models or {"mha": build(3001), "xattn": build(3002, kdim=32, vdim=48)}
    for name, m in models.items():
        export_model.export(m, os.path.join(tmp, name))
    return lib.Server(attnserve, "--models", tmp, *args), models


def request(server, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data, r


def reference(m, q, k, v, kpm, mask, weights, sf):
    f64 = lambda a: None if a is None else torch.from_numpy(np.asarray(a, dtype=np.float64))
    bf = lambda a: None if a is None else (a.transpose(1, 0, 2) if sf else a)
    with torch.no_grad():
        out, w = m.double()(f64(bf(q)), f64(bf(k)), f64(bf(v)),
                            key_padding_mask=None if kpm is None else torch.from_numpy(kpm),
                            attn_mask=None if mask is None else torch.from_numpy(mask),
                            need_weights=weights != "none", average_attn_weights=weights == "averaged")
    out = out.numpy()
    return (out.transpose(1, 0, 2) if sf else out), (None if w is None else w.numpy())


# name, model, batch, Lq, Lk (None: self), dtype, layout, weights, kpm, bool mask
CASES = [
    ("fp32 self", "mha", 2, 7, None, "FP32", "batch_first", "none", False, False),
    ("fp32 kpm + bool mask, averaged", "mha", 2, 5, None, "FP32", "batch_first", "averaged", True, True),
    ("fp32 per head, sequence-first", "mha", 3, 4, None, "FP32", "sequence_first", "per_head", False, False),
    ("fp16 self", "mha", 2, 6, None, "FP16", "batch_first", "none", False, False),
    ("bf16 self", "mha", 1, 6, None, "BF16", "batch_first", "none", False, False),
    ("fp32 cross kdim/vdim, kpm", "xattn", 2, 3, 8, "FP32", "batch_first", "averaged", True, False),
]


def test_tritonclient_http_matches_torch_and_grpc(attnserve, checks):
    server, models = serve(attnserve)
    client = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    grpc_client = tg.InferenceServerClient(server.target)
    rng = np.random.default_rng(20261205)
    checks("server live and ready", client.is_server_live() and client.is_server_ready())
    checks("model ready; an absent one not", client.is_model_ready("mha") and client.is_model_ready("xattn", "1")
           and not client.is_model_ready("nope"))
    meta = client.get_server_metadata()
    checks("server metadata names attnserve", meta["name"] == "attnserve" and meta["version"], str(meta))
    mm = client.get_model_metadata("xattn")
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in mm["inputs"]}
    checks("model metadata: inputs with integer shapes", inputs.get("key") == ("FP32", [-1, -1, 32])
           and mm["versions"] == ["1"], str(mm))
    index = client.get_model_repository_index()
    checks("repository index lists both models ready",
           sorted((m["name"], m["state"]) for m in index) == [("mha", "READY"), ("xattn", "READY")], str(index))

    for (name, model, b, lq, lk, dtype, layout, weights, kpm, mask) in CASES:
        sf = layout == "sequence_first"
        shape = lambda length, dim: (length, b, dim) if sf else (b, length, dim)
        cross = lk is not None
        lk = lk or lq
        q = rng.standard_normal(shape(lq, E)).astype(NP[dtype])
        k = rng.standard_normal(shape(lk, 32)).astype(NP[dtype]) if cross else None
        v = rng.standard_normal(shape(lk, 48)).astype(NP[dtype]) if cross else None
        kpm_a = (np.arange(lk)[None, :] >= rng.integers(1, lk + 1, size=b)[:, None]) if kpm else None
        mask_a = None
        if mask:
            mask_a = rng.random((lq, lk)) < 0.4
            mask_a[:, 0] = False
        tensors = [(n, a) for n, a in [("query", q), ("key", k), ("value", v), ("key_padding_mask", kpm_a),
                                       ("attn_mask", mask_a)] if a is not None]
        params = {"layout": layout, "attn_weights": weights}
        outs = ["attn_output"] + (["attn_weights"] if weights != "none" else [])
        answers = {}
        for form in ["binary", "json"] if dtype != "BF16" else ["binary"]:
            ins = []
            for tname, a in tensors:
                t = th.InferInput(tname, list(a.shape), "BOOL" if a.dtype == np.bool_ else dtype)
                t.set_data_from_numpy(a, binary_data=form == "binary")
                ins.append(t)
            requested = [th.InferRequestedOutput(o, binary_data=form == "binary") for o in outs]
            try:
                answers[form] = client.infer(model, ins, outputs=requested, parameters=params, request_id=name)
            except InferenceServerException as e:
                checks(f"http infer {name} ({form})", False, str(e))
        gins = []
        for tname, a in tensors:
            t = tg.InferInput(tname, list(a.shape), "BOOL" if a.dtype == np.bool_ else dtype)
            t.set_data_from_numpy(a)
            gins.append(t)
        g = grpc_client.infer(model, gins, outputs=[tg.InferRequestedOutput(o) for o in outs], parameters=params)
        ref, ref_w = reference(models[model], q, k if cross else q, v if cross else q, kpm_a, mask_a, weights, sf)
        for form, r in answers.items():
            out = r.as_numpy("attn_output")
            checks(f"http infer {name} ({form}): id, datatype", r.get_response()["id"] == name and
                   r.get_output("attn_output")["datatype"] == dtype, str(r.get_response()["outputs"]))
            err = np.abs(np.asarray(out, dtype=np.float64) - ref).max() / np.abs(ref).max()
            checks(f"http infer {name} ({form}): matches nn.MultiheadAttention", err <= TOL[dtype], f"{err:.2e}")
            same = all(np.array_equal(r.as_numpy(o).astype(NP[dtype]).view(np.uint8),
                                      g.as_numpy(o).view(np.uint8)) for o in outs)
            checks(f"http infer {name} ({form}): the same bytes as over gRPC", same)
            if ref_w is not None:
                werr = np.abs(np.asarray(r.as_numpy("attn_weights"), dtype=np.float64) - ref_w).max()
                checks(f"http infer {name} ({form}): weights match", werr <= 10 * TOL[dtype], f"{werr:.2e}")

    # A sequence (Triton's sequence_id) over HTTP steps a session, as over gRPC.
    steps = [rng.standard_normal((1, 1 + s, E)).astype(np.float32) for s in range(3)]
    got = []
    for s, x in enumerate(steps):
        t = th.InferInput("query", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        got.append(client.infer("mha", [t], sequence_id=77, sequence_start=s == 0,
                                sequence_end=s == len(steps) - 1).as_numpy("attn_output"))
    want = []
    for s, x in enumerate(steps):
        t = tg.InferInput("query", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        want.append(grpc_client.infer("mha", [t], sequence_id=78, sequence_start=s == 0,
                                      sequence_end=s == len(steps) - 1).as_numpy("attn_output"))
    checks("a sequence over HTTP steps as the same sequence over gRPC",
           all(np.array_equal(a, b) for a, b in zip(got, want)))
    counted = [l for l in lib.metrics_lines(server, "attnserve_requests_total") if 'method="http/ModelInfer"' in l]
    total = sum(float(l.rsplit(" ", 1)[1]) for l in counted)
    checks("HTTP calls counted under method=\"http/ModelInfer\"", total >= len(CASES) + 3, str(counted))
    server.stop()


def test_concurrent_callers_get_their_own_answers(attnserve, checks):
    """12 callers at once over HTTP (binary and JSON alternating, lengths differing, so the batcher
    packs them together) beside a gRPC caller: each of 240 answers is the answer its own query gets
    alone over gRPC, to float32 rounding (lib.same_answer: batched and alone, the engine may cut the
    query differently); another caller's answer would differ entirely."""
    server, _ = serve(attnserve, models={"mha": build(3013)})
    grpc_client = tg.InferenceServerClient(server.target)
    rng = np.random.default_rng(20261206)
    queries = [rng.standard_normal((1, 3 + 5 * i, E)).astype(np.float32) for i in range(12)]

    def alone(q):
        t = tg.InferInput("query", list(q.shape), "FP32")
        t.set_data_from_numpy(q)
        return grpc_client.infer("mha", [t]).as_numpy("attn_output")

    want = [alone(q) for q in queries]
    wrong, errors, lock = [], [], threading.Lock()

    def caller(i):
        client = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        for k in range(20):
            binary = (i + k) % 2 == 0
            t = th.InferInput("query", list(queries[i].shape), "FP32")
            t.set_data_from_numpy(queries[i], binary_data=binary)
            try:
                got = client.infer("mha", [t], outputs=[th.InferRequestedOutput("attn_output", binary_data=binary)])
                same, _ = lib.same_answer(got.as_numpy("attn_output").tobytes(), want[i].tobytes())
                if not same:
                    with lock:
                        wrong.append((i, k))
            except InferenceServerException as e:
                with lock:
                    errors.append(str(e))

    stop = threading.Event()

    def grpc_load():
        while not stop.is_set():
            alone(queries[0])

    side = threading.Thread(target=grpc_load)
    side.start()
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    side.join()
    checks("240 concurrent HTTP answers, each its own query's", not wrong and not errors,
           f"wrong {wrong[:5]} errors {errors[:3]}")
    server.stop()


def test_json_numbers_round_trip_float32(attnserve, checks):
    """A JSON request of float32 values (written as Python's repr of each float32) gets the same
    answer bytes as the binary request, and the JSON answer reads back as the binary answer's
    float32 values exactly, including values that need 9 digits."""
    server, _ = serve(attnserve, models={"mha": build(3003)})
    rng = np.random.default_rng(5)
    q = (rng.standard_normal((1, 4, E)) * 10.0 ** rng.integers(-6, 6, (1, 4, E))).astype(np.float32)
    body = {"inputs": [{"name": "query", "datatype": "FP32", "shape": list(q.shape),
                        "data": [float(repr(x)) for x in q.ravel()]}]}
    status, data, _ = request(server, "POST", "/v2/models/mha/infer", json.dumps(body),
                              {"Content-Type": "application/json"})
    checks("JSON infer answers 200", status == 200, data[:200])
    out = json.loads(data)["outputs"][0]
    raw = q.tobytes()
    header = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": list(q.shape),
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "outputs": [{"name": "attn_output", "parameters": {"binary_data": True}}]}).encode()
    status, bdata, r = request(server, "POST", "/v2/models/mha/infer", header + raw,
                               {"Inference-Header-Content-Length": str(len(header))})
    n = int(r.getheader("Inference-Header-Content-Length"))
    binary = np.frombuffer(bdata[n:], dtype=np.float32)
    checks("binary infer answers 200 with the header length", status == 200 and len(bdata) - n == 4 * q.size)
    checks("JSON answer's numbers are the binary answer's float32 values exactly",
           np.array_equal(np.asarray(out["data"], dtype=np.float32), binary))
    checks("JSON answer's shape and datatype", out["shape"] == [1, 4, E] and out["datatype"] == "FP32", str(out)[:200])
    server.stop()


def raw_exchange(port, data, read=True, timeout=10):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    got = b""
    if read:
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
                if b"\r\n\r\n" in got:
                    head, _, rest = got.partition(b"\r\n\r\n")
                    m = re.search(rb"content-length: *(\d+)", head, re.I)
                    if m and len(rest) >= int(m.group(1)):
                        break
        except socket.timeout:
            pass
    s.close()
    return got


def test_errors_and_bounds(attnserve, checks):
    server, _ = serve(attnserve, "--max-message-bytes", "1048576", "--tenant-header", "x-tenant",
                      models={"mha": build(3004)})
    q = np.zeros((1, 2, E), np.float32)
    good = {"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 2, E], "data": q.ravel().tolist()}]}

    def infer(body, headers=None, path="/v2/models/mha/infer"):
        status, data, _ = request(server, "POST", path, body if isinstance(body, (bytes, str)) else json.dumps(body),
                                  headers)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    status, j = infer({"inputs": [dict(good["inputs"][0], name="queries")]})
    checks("an unknown input: 400 naming it", status == 400 and "'queries'" in j.get("error", ""), str(j))
    status, j = infer(good, path="/v2/models/nope/infer")
    checks("an unknown model: 404", status == 404 and "nope" in j.get("error", ""), str(j))
    status, j = infer(good, path="/v2/nothing")
    checks("an unknown route: 404 JSON error", status == 404 and "error" in j, str(j))
    status, j = infer({"inputs": [dict(good["inputs"][0], shape=[1, 3, E])]})
    checks("data that does not fill the shape: 400 naming inputs[0].data", status == 400 and
           "inputs[0].data" in j.get("error", ""), str(j))
    status, j = infer({"inputs": [dict(good["inputs"][0], data=["x"] * (2 * E))]})
    checks("a string among the numbers: 400 naming its index", status == 400 and
           "inputs[0].data[0]" in j.get("error", ""), str(j))
    status, j = infer("[" * 100000 + "]" * 100000)
    checks("a JSON nesting bomb: 400, no crash", status == 400 and "deeper" in j.get("error", ""), str(j)[:200])
    status, j = infer("{\"inputs\": [")
    checks("JSON cut short: 400", status == 400 and "not JSON" in j.get("error", ""), str(j))
    status, j = infer(good, {"Content-Encoding": "gzip"})
    checks("an encoded body: 415", status == 415, str(j))
    status, j = infer(good, {"Inference-Header-Content-Length": "99999999"})
    checks("a header length past the body: 400", status == 400 and "Inference-Header-Content-Length" in
           j.get("error", ""), str(j))
    header = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 2, E],
                                     "parameters": {"binary_data_size": 4 * 2 * E + 4}}]}).encode()
    status, j = infer(header + q.tobytes(), {"Inference-Header-Content-Length": str(len(header))})
    checks("binary_data_size past the body: 400", status == 400 and "binary_data_size" in j.get("error", ""), str(j))
    status, j = infer(good, {"x-tenant": "a b"})
    checks("a tenant header that names no tenant: 400 naming the header", status == 400 and
           "x-tenant" in j.get("error", ""), str(j))
    status, j = infer(good, {"x-tenant": "team-a"})
    checks("a tenant header: served", status == 200, str(j)[:200])

    # A Content-Length past --max-message-bytes: refused before a byte of the body is sent.
    got = raw_exchange(server.http_port, b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\n"
                       b"Content-Length: 2000000\r\n\r\n")
    checks("a Content-Length past the bound: 413 before the body", got.startswith(b"HTTP/1.1 413"), got[:200])
    # A chunked body that passes it: 413 once it does.
    chunk = b"a" * 65536
    body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(20)) + b"0\r\n\r\n"
    got = raw_exchange(server.http_port, b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n" + body)
    checks("a chunked body past the bound: 413", got.startswith(b"HTTP/1.1 413"), got[:200])
    # Framing a proxy in front could read otherwise (request smuggling): refused.
    got = raw_exchange(server.http_port, b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                       b"Content-Length: 40\r\n\r\n{}" + b" " * 38)
    checks("two Content-Length headers: 400", got.startswith(b"HTTP/1.1 400") and b"Content-Length" in got, got[:300])
    got = raw_exchange(server.http_port, b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    checks("Content-Length with Transfer-Encoding: 400", got.startswith(b"HTTP/1.1 400") and
           b"Transfer-Encoding" in got, got[:300])
    for te in (b"gzip, chunked", b"identity", b"xchunked"):
        got = raw_exchange(server.http_port, b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\n"
                           b"Transfer-Encoding: " + te + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        checks(f"Transfer-Encoding {te.decode()}: refused at once (501)", got.startswith(b"HTTP/1.1 501"), got[:200])
    got = raw_exchange(server.http_port, b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\n"
                       b"Transfer-Encoding : chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    checks("a header name with a space before its colon: 400", got.startswith(b"HTTP/1.1 400"), got[:200])
    got = raw_exchange(server.http_port, b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\n"
                       b"Content-Encoding: identity\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}")
    checks("a second Content-Encoding: 415", got.startswith(b"HTTP/1.1 415"), got[:200])
    for path in ("/v2/models/mha%2Finfer", "/v2/models/mha%00/ready", "//v2//models//mha//infer"):
        status, j = infer(good, path=path)
        checks(f"{path}: not a route (404)", status == 404, str(j)[:200])
    data = json.dumps(q.ravel().tolist())
    status, j = infer('{"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 2, %d], "shape": [1, 2, %d], '
                      '"data": %s}]}' % (E, E, data))
    checks("a key given twice in an input: 400", status == 400 and "twice" in j.get("error", ""), str(j)[:200])
    status, j = infer({"inputs": [dict(good["inputs"][0], data=[1e39] + [0.0] * (2 * E - 1))]})
    checks("a number past FP32's range: 400 naming it", status == 400 and "inputs[0].data[0]" in
           j.get("error", ""), str(j)[:200])
    status, j = infer({"inputs": [dict(good["inputs"][0], datatype="FP16", data=[70000.0] + [0.0] * (2 * E - 1))]})
    checks("a number past FP16's range: 400", status == 400 and "inputs[0].data[0]" in j.get("error", ""),
           str(j)[:200])
    status, j = infer(dict(good, outputs=[{"name": "attn_output"}, {"name": "attn_output"}]))
    checks("an output asked twice: 400", status == 400 and "twice" in j.get("error", ""), str(j)[:200])
    # Headers past the connection's buffer: refused, the server goes on.
    got = raw_exchange(server.http_port, b"GET /v2 HTTP/1.1\r\nHost: x\r\n" +
                       b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(200)) + b"\r\n")
    checks("a header flood: refused (431 or closed)", got == b"" or got.startswith(b"HTTP/1.1 431"), got[:100])
    status, _, _ = request(server, "GET", "/v2/health/live")
    checks("the server goes on after all of it", status == 200)
    server.stop()


def body_room(server):
    """The room of request bodies being received, as /metrics counts it."""
    return sum(float(l.rsplit(" ", 1)[1]) for l in lib.metrics_lines(server, "attnserve_http_body_bytes"))


def small_json_request():
    """A two-token JSON infer request's body."""
    q = np.zeros((1, 2, E), np.float32)
    return json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 2, E],
                                   "data": q.ravel().tolist()}]}).encode()


def test_bodies_arriving_bounded(attnserve, checks):
    """The room of bodies being received is bounded in all (--max-inflight-bytes) and counted as
    bytes arrive (attnserve_http_body_bytes): a body that would pass the bound is answered 503,
    while the one holding the room, finished, is served; bodies that trickle in hold only their
    first 64 KiB each (their share of so small a bound; the review's starvation: four connections each sending one byte of a 4 MiB
    body had taken the whole bound, and ordinary calls got 503)."""
    server, _ = serve(attnserve, "--max-inflight-bytes", "3000000", "--max-message-bytes", "2000000",
                      models={"mha": build(3009)})
    room = lambda: body_room(server)
    small = small_json_request()
    body = small + b" " * (1_900_000 - len(small))  # JSON allows trailing spaces.
    head = b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    # Trickling bodies: a byte each of four 1.9 MB bodies; ordinary calls are still served.
    tricklers = [socket.create_connection(("127.0.0.1", server.http_port), timeout=30) for _ in range(4)]
    for t in tricklers:
        t.sendall(head + body[:1])
    counted = lib.wait_until(lambda: room() >= 4 * 65536, timeout=20, step=0.02)
    status, _, _ = request(server, "POST", "/v2/models/mha/infer", small)
    checks("four trickling bodies hold 64 KiB each; an ordinary call is served", counted and status == 200 and
           room() <= 4 * (65536 + 64), f"{room()} {status}")
    for t in tricklers:
        t.close()
    lib.wait_until(lambda: room() == 0, timeout=20, step=0.02)
    # A body held with 1.2 MB of it sent takes its whole room (1.9 MB); another 1.9 MB cannot fit.
    held = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    held.sendall(head + body[:1_200_000])
    counted = lib.wait_until(lambda: room() >= 1_200_000, timeout=20, step=0.02)
    got = raw_exchange(server.http_port, head + body)
    checks("a body past every body's bound: 503", counted and got.startswith(b"HTTP/1.1 503"), got[:200])
    held.sendall(body[1_200_000:])
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += held.recv(65536)
    held.close()
    checks("the held body, finished, is served", answer.startswith(b"HTTP/1.1 200"), answer[:200])
    server.stop()


def test_a_body_takes_its_whole_room_at_once_within_its_share(attnserve, checks):
    """A body's first room is its whole Content-Length, up to its share of the bound (half of
    --max-inflight-bytes over --http-max-connections; never under 64 KiB): a 700 KB JSON request is
    not copied as its room doubles, and every connection's first room together holds at most half
    the bound, so trickling bodies still cannot starve ordinary calls."""
    server, _ = serve(attnserve, "--max-inflight-bytes", "16000000", "--http-max-connections", "8",
                      models={"mha": build(3010)})
    room = lambda: body_room(server)
    small = small_json_request()
    share = 16_000_000 // (2 * 8)
    for length in (700_000, 1_900_000):  # Within the share, and past it.
        body = small + b" " * (length - len(small))
        head = b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        tricklers = [socket.create_connection(("127.0.0.1", server.http_port), timeout=30) for _ in range(4)]
        for t in tricklers:
            t.sendall(head + body[:1])
        want = 4 * min(length + 64, share)  # (64: the room past a body's end its parser reads.)
        counted = lib.wait_until(lambda: room() >= want, timeout=20, step=0.02)
        status, _, _ = request(server, "POST", "/v2/models/mha/infer", small)
        checks(f"four bodies of {length} bytes, one byte each sent, hold {want} in all; an ordinary "
               "call is served", counted and room() == want and status == 200, f"{room()} {status}")
        for t in tricklers:
            t.sendall(body[1:])
        for t in tricklers:
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += t.recv(65536)
            checks(f"the {length}-byte body, finished, is served", answer.startswith(b"HTTP/1.1 200"), answer[:200])
            t.close()
        checks("their room given back", lib.wait_until(lambda: room() == 0, timeout=20, step=0.02), room())
    server.stop()


def trickle(port, first, rest, interval):
    """Sends `first`, then `rest` a byte each `interval` s, until the server closes the connection
    (True) or `rest` runs out (False); and the seconds it took."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(first)
    start, ended = time.monotonic(), False
    for i in range(len(rest)):
        try:
            s.sendall(rest[i:i + 1])
            s.settimeout(interval)
            if s.recv(100) == b"":
                ended = True
                break
        except socket.timeout:
            continue
        except OSError:
            ended = True
            break
    s.close()
    return ended, time.monotonic() - start


def test_connections_bounded(attnserve, checks):
    server, _ = serve(attnserve, "--http-max-connections-per-peer", "4", "--http-idle-timeout", "1",
                      "--http-body-timeout", "2", models={"mha": build(3005)})
    held = [socket.create_connection(("127.0.0.1", server.http_port), timeout=10) for _ in range(4)]
    extra = socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
    try:
        extra.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        refused = extra.recv(100) == b""
    except OSError:
        refused = True
    checks("a fifth connection from one peer is closed at once", refused)
    start = time.monotonic()
    closed = all(s.recv(1) == b"" for s in held)  # Idle: each closed by the server (blocks until).
    checks("idle connections are closed after --http-idle-timeout", closed and time.monotonic() - start < 8,
           f"{time.monotonic() - start:.1f} s")
    for s in held + [extra]:
        s.close()
    # The client sees each end before libmicrohttpd gives back its peer's slot: wait for the open
    # connections to settle at none (the slot is given back before that count drops).
    gone = lib.wait_until(lambda: lib.metrics_lines(server, "attnserve_http_connections")
                          == ["attnserve_http_connections 0"], timeout=10)
    checks("the server counts no connection open once they are closed", gone,
           str(lib.metrics_lines(server, "attnserve_http_connections")))
    status, _, _ = request(server, "GET", "/v2/health/ready")
    checks("a new caller is served once they are gone", status == 200)
    # Headers a byte every 0.3 s (slowloris): closed once the idle timeout passes without a whole
    # request head (the review's: 64 such connections kept the port from every other caller).
    head = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    ended, took = trickle(server.http_port, b"", head, 0.3)
    checks("a header trickling in is cut once the idle timeout passes", ended and took < 6, f"{took:.1f} s")
    # A body that trickles a byte every 0.5 s: its connection is closed past --http-body-timeout.
    ended, took = trickle(server.http_port, b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: 1000\r\n\r\n", b" " * 16, 0.5)
    checks("a trickling body's connection is closed", ended, f"{took:.1f} s")
    server.stop()


def test_shared_memory_over_http(attnserve, checks):
    """tritonclient.http's shared-memory calls: register, infer with the query and the output in
    regions (the same bytes as in the message), status, another tenant sees none of it,
    unregister."""
    import tritonclient.utils.shared_memory as shm

    server, _ = serve(attnserve, "--allow-shared-memory", "--tenant-header", "x-tenant",
                      models={"mha": build(3006)})
    client = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    q = np.random.default_rng(8).standard_normal((1, 5, E)).astype(np.float32)
    key = f"/attnserve-http-{os.getpid()}"
    hq = shm.create_shared_memory_region("q", key + "-q", q.nbytes)
    ho = shm.create_shared_memory_region("o", key + "-o", q.nbytes)
    try:
        shm.set_shared_memory_region(hq, [q])
        client.register_system_shared_memory("q", key + "-q", q.nbytes)
        client.register_system_shared_memory("o", key + "-o", q.nbytes)
        status = client.get_system_shared_memory_status()
        checks("status lists both regions", sorted(r["name"] for r in status) == ["o", "q"], str(status))
        other = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        seen = other.get_system_shared_memory_status(headers={"x-tenant": "other"})
        checks("another tenant sees none of them", seen == [], str(seen))
        t = th.InferInput("query", list(q.shape), "FP32")
        t.set_shared_memory("q", q.nbytes)
        out = th.InferRequestedOutput("attn_output", binary_data=False)
        out.set_shared_memory("o", q.nbytes)
        client.infer("mha", [t], outputs=[out])
        got = shm.get_contents_as_numpy(ho, np.float32, list(q.shape))
        t2 = th.InferInput("query", list(q.shape), "FP32")
        t2.set_data_from_numpy(q)
        want = client.infer("mha", [t2]).as_numpy("attn_output")
        checks("input and output in regions: the same bytes as in the message", np.array_equal(got, want))
        try:
            t3 = th.InferInput("query", list(q.shape), "FP32")
            t3.set_shared_memory("q", q.nbytes)
            other.infer("mha", [t3], headers={"x-tenant": "other"})
            checks("another tenant cannot name the region", False, "served")
        except InferenceServerException as e:
            checks("another tenant cannot name the region", "q" in str(e), str(e))
        # An answer into a region whose object its owner may only read: refused before compute,
        # naming the output and why (the review of issue 67: "Bad file descriptor" after compute).
        os.chmod("/dev/shm" + key + "-o", 0o444)
        client.register_system_shared_memory("ro", key + "-o", q.nbytes)
        try:
            out_ro = th.InferRequestedOutput("attn_output", binary_data=False)
            out_ro.set_shared_memory("ro", q.nbytes)
            client.infer("mha", [t2], outputs=[out_ro])
            checks("an answer into a read-only region is refused", False, "served")
        except InferenceServerException as e:
            checks("an answer into a read-only region is refused, naming the output and why",
                   "outputs[0]" in str(e) and "read-only" in str(e), str(e))
        client.unregister_system_shared_memory()
        checks("unregister all", client.get_system_shared_memory_status() == [])
    finally:
        shm.destroy_shared_memory_region(hq)
        shm.destroy_shared_memory_region(ho)
    server.stop()


NOBODY_REGISTERS = r"""
import http.client, json, os, sys
port, own, roots = int(sys.argv[1]), sys.argv[2], sys.argv[3]
fd = os.open("/dev/shm" + own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
os.close(fd)
out = {}
for name, key in (("own", own), ("roots", roots)):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", f"/v2/systemsharedmemory/region/{name}/register",
              body=json.dumps({"key": key, "offset": 0, "byte_size": 4096}))
    r = c.getresponse()
    out[name] = [r.status, r.read().decode()]
os.unlink("/dev/shm" + own)
print(json.dumps(out))
"""


def test_shared_memory_objects_of_the_callers_own_uid(attnserve, checks):
    """The review of issue 67: a server running as root registered any root-owned object for any
    caller on its host (and would write answers into it). A caller on loopback registers only
    objects of its own uid, found by its socket: uid 65534's own object is registered, a root-owned
    one is refused (403, naming both uids); root's caller is refused 65534's object."""
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root): to run a caller as uid 65534")
    server, _ = serve(attnserve, "--allow-shared-memory", "--shared-memory-uids", "65534",
                      models={"mha": build(3014)})
    key = f"/attnserve-http-uid-{os.getpid()}"
    fd = os.open("/dev/shm" + key + "-root", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    try:
        ran = subprocess.run(["/usr/bin/python3", "-c", NOBODY_REGISTERS, str(server.http_port), key + "-nobody",
                              key + "-root"], capture_output=True, text=True, timeout=60,
                             user=65534, group=65534, cwd="/")
        got = json.loads(ran.stdout or "{}")
        checks("uid 65534 registers its own object", got.get("own", [0])[0] == 200, ran.stdout + ran.stderr)
        roots = got.get("roots", [0, ""])
        checks("uid 65534 is refused root's object: 403 naming both uids",
               roots[0] == 403 and "belongs to uid 0, and this call came from a process of uid 65534" in roots[1],
               str(roots))
        fd = os.open("/dev/shm" + key + "-65534", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        os.fchown(fd, 65534, 65534)
        os.close(fd)
        code, body = request(server, "POST", "/v2/systemsharedmemory/region/theirs/register",
                             json.dumps({"key": key + "-65534", "offset": 0, "byte_size": 4096}))[:2]
        checks("root's caller is refused uid 65534's object", code == 403 and "uid 65534" in str(body),
               f"{code} {body}")
    finally:
        for suffix in ("-root", "-65534", "-nobody"):
            if os.path.exists("/dev/shm" + key + suffix):
                os.unlink("/dev/shm" + key + suffix)
    server.stop()


def test_docs_curl_commands(attnserve, checks):
    """Every curl command in docs/api.md's HTTP section, run against a server on a free port: each
    exits 0 with a 2xx answer."""
    text = open(os.path.join(HERE, "..", "..", "docs", "api.md")).read()
    section = text.split("## HTTP", 1)[1].split("\n## ", 1)[0]
    commands = [c.strip() for c in re.findall(r"^(curl [^\n]*(?:\\\n[^\n]*)*)", section, re.M)]
    checks("docs/api.md's HTTP section has curl commands", len(commands) >= 4, str(len(commands)))
    server = lib.Server(attnserve)  # The demo model, as the docs' commands name it.
    for command in commands:
        line = command.replace("\\\n", " ").replace("localhost:8000", f"127.0.0.1:{server.http_port}")
        # A command the docs show refused says so in its comment ("# refused: 400").
        expected = re.search(r"# refused: (\d+)", line)
        args = shlex.split(line, comments=True)
        r = subprocess.run(args + ["-sS", "-o", "/dev/null", "-w", "%{http_code}"], capture_output=True, text=True,
                           timeout=30, cwd=os.path.join(HERE, "..", ".."))
        ok = r.stdout == expected.group(1) if expected else r.returncode == 0 and r.stdout.startswith("2")
        checks(f"docs: {line[:80]}", ok, r.stdout + r.stderr)
    server.stop()


def test_tls_and_client_certificates(attnserve, checks, tmp_path):
    """With --tls-cert/--tls-key the HTTP port speaks TLS with the same certificate as gRPC (a
    plaintext request gets no answer); with --tls-client-ca a request needs a client certificate
    that CA signed (401 without one; the TLS handshake itself refuses another CA's), and the
    certificate's name is the tenant, whatever a trusted header claims (the access log says)."""
    import ssl

    import pki

    d = str(tmp_path)
    pki.make_pki(d)
    log = tmp_path / "access.log"
    server, _ = serve(attnserve, "--tls-cert", f"{d}/server.pem", "--tls-key", f"{d}/server.key",
                      "--tls-client-ca", f"{d}/ca.pem", "--tenant-header", "x-tenant", "--access-log", str(log),
                      models={"mha": build(3010)})

    def call(cert=None, method="GET", path="/v2/health/ready", body=None, headers=None):
        ctx = ssl.create_default_context(cafile=f"{d}/ca.pem")
        if cert:
            ctx.load_cert_chain(f"{d}/{cert}.pem", f"{d}/{cert}.key")
        c = http.client.HTTPSConnection("127.0.0.1", server.http_port, context=ctx, timeout=20)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, r.read()
        except (ssl.SSLError, OSError) as e:
            return None, str(e).encode()
        finally:
            c.close()

    status, data = call("client")
    checks("HTTPS with the client's certificate: 200", status == 200, data[:200])
    status, data = call()
    checks("HTTPS without a client certificate: 401", status == 401 and b"--tls-client-ca" in data, data[:200])
    status, data = call("stranger")
    checks("another CA's certificate: refused", status in (None, 401), f"{status} {data[:200]}")
    plain = raw_exchange(server.http_port, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
    checks("plaintext HTTP to the TLS port: no HTTP answer", not plain.startswith(b"HTTP/1.1 200"), plain[:100])
    q = np.zeros((1, 2, E), np.float32)
    body = json.dumps({"id": "tls", "inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 2, E],
                                                "data": q.ravel().tolist()}]})
    status, data = call("client", "POST", "/v2/models/mha/infer", body, {"x-tenant": "admin"})
    checks("infer over HTTPS: 200", status == 200, data[:200])
    server.stop()
    tenants = [l.get("tenant") for l in map(json.loads, log.read_text().splitlines())
               if l.get("method") == "http/ModelInfer"]
    checks("the certificate's name is the tenant, not the header's", tenants == ["client"], str(tenants))


def test_behind_nginx_on_kept_alive_connections(attnserve, checks):
    """deploy/nginx/nginx.conf's HTTP server in front of two replicas: 40 infer calls, each on a new
    client connection, answered as the replicas answer them directly, spread over both, on upstream
    connections nginx keeps open (HTTP/1.1 keepalive: no connection to a replica closed and left in
    TIME_WAIT, at most a few open)."""
    models = {"mha": build(3011)}
    a, _ = serve(attnserve, models=models)
    b, _ = serve(attnserve, models=models)
    prefix = lib.temp_dir("attnserve-http-nginx-")
    port = lib.free_port()
    nginx = lib.start_nginx(prefix, [a.port, b.port], lib.free_port(), http_ports=[a.http_port, b.http_port],
                            http_listen_port=port)
    try:
        lib.wait_until(lambda: lib.port_open(port), timeout=20, step=0.05)
        q = np.random.default_rng(12).standard_normal((1, 3, E)).astype(np.float32)
        raw = q.tobytes()
        header = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": list(q.shape),
                                         "parameters": {"binary_data_size": len(raw)}}],
                             "parameters": {"binary_data_output": True}}).encode()
        headers = {"Inference-Header-Content-Length": str(len(header))}
        ports = f"( dport = :{a.http_port} or dport = :{b.http_port} )"
        sockets = lambda state: set(subprocess.run(["ss", "-Htan", "state", state, ports], capture_output=True,
                                                   text=True).stdout.splitlines())
        # Connections of earlier tests to a port now a replica's may still wait out their 60 s: only
        # those closed from here on count.
        waited_before = sockets("time-wait")
        answers = []
        for _ in range(40):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            c.request("POST", "/v2/models/mha/infer", body=header + raw, headers=headers)
            r = c.getresponse()
            answers.append((r.status, r.read()))
            c.close()
        counted = [sum(float(l.rsplit(" ", 1)[1]) for l in lib.metrics_lines(s, "attnserve_requests_total")
                       if 'method="http/ModelInfer"' in l) for s in (a, b)]
        checks("spread over both replicas", all(n >= 5 for n in counted), str(counted))
        waiting = sockets("time-wait") - waited_before
        open_now = sockets("established")
        checks("upstream connections kept alive: none closed into TIME_WAIT", not waiting, "\n".join(sorted(waiting)))
        checks("a few upstream connections open", 1 <= len(open_now) <= 8, "\n".join(sorted(open_now)))
        # Then straight to a replica (its own connection, closed by this client: after the counts).
        status, direct, _ = request(a, "POST", "/v2/models/mha/infer", header + raw, headers)
        checks("40 calls through nginx answered as a replica answers directly",
               status == 200 and all(x == (200, direct) for x in answers), str([x[0] for x in answers][:10]))
    finally:
        nginx.terminate()
        nginx.wait(timeout=30)
        a.stop()
        b.stop()


def test_stop_under_keep_alive_callers(attnserve, checks):
    """SIGTERM while 8 keep-alive callers loop on their connections (the review's crash: the server
    aborted in libmicrohttpd, a connection suspended as it stopped): exit 0, within seconds; from
    the drain on, answers close their connections; every answer is 200, or 503 for a request that
    reached a stopping server. Five rounds."""
    q = np.zeros((1, 2, E), np.float32)
    body = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 2, E],
                                   "data": q.ravel().tolist()}]})
    for round_ in range(5):
        server, _ = serve(attnserve, "--shutdown-grace", "10", models={"mha": build(3012)})
        statuses, closes, lock, answered = [], [], threading.Lock(), threading.Event()

        def loop():
            c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
            while True:
                try:
                    c.request("POST", "/v2/models/mha/infer", body=body)
                    r = c.getresponse()
                    r.read()
                except (OSError, http.client.HTTPException):
                    return
                with lock:
                    statuses.append(r.status)
                    closes.append(r.getheader("Connection") == "close")
                    if len(statuses) >= 200:
                        answered.set()

        threads = [threading.Thread(target=loop) for _ in range(8)]
        for t in threads:
            t.start()
        answered.wait(timeout=60)
        start = time.monotonic()
        out = server.stop()  # Raises unless the exit code is 0.
        took = time.monotonic() - start
        for t in threads:
            t.join(timeout=30)
        checks(f"round {round_}: exit 0 within 5 s", took < 5 and "stopped" in out, f"{took:.1f} s {out[-300:]}")
        checks(f"round {round_}: every answer 200 or 503", set(statuses) <= {200, 503}, str(set(statuses)))
        checks(f"round {round_}: answers from the drain on close their connections", any(closes), str(len(closes)))


def http_calls(server, name):
    """The sum of series `name` over the HTTP calls (method="http/ModelInfer")."""
    return sum(float(l.rsplit(" ", 1)[1]) for l in lib.metrics_lines(server, name)
               if 'method="http/ModelInfer"' in l)


def test_request_in_flight_at_stop_is_answered(attnserve, checks):
    server, _ = serve(attnserve, "--workers", "1", models={"mha": build(3008)})
    q = np.random.default_rng(9).standard_normal((8, 1024, E)).astype(np.float32)
    raw = q.tobytes()
    header = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": list(q.shape),
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    results = []

    def call():
        results.append(request(server, "POST", "/v2/models/mha/infer", header + raw,
                               {"Inference-Header-Content-Length": str(len(header))})[0])

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    # Every request accepted (in flight or answered), at least one still in flight: then SIGTERM.
    lib.wait_until(lambda: http_calls(server, "attnserve_requests_in_flight") >= 1 and
                   http_calls(server, "attnserve_requests_in_flight") +
                   http_calls(server, "attnserve_requests_total") >= 4,
                   timeout=60, step=0.005)
    out = server.stop()
    for t in threads:
        t.join(timeout=60)
    checks("every request in flight at SIGTERM answered 200", results == [200] * 4, f"{results} {out[-300:]}")


def test_callers_that_leave_mid_request_do_not_hold_the_stop(attnserve, checks):
    """32 keep-alive callers, as a load generator runs them, all close their connections at once
    while requests are being computed (what one does at the end of its run): once the pipeline has
    answered those, SIGTERM ends the server within seconds, not at --shutdown-grace (the stop waited
    for suspended connections' answers to be queued, and libmicrohttpd never asks for the answer of
    a connection it found closed). Three rounds."""
    q = np.random.default_rng(10).standard_normal((1, 64, E)).astype(np.float32)
    raw = q.tobytes()
    header = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": list(q.shape),
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    data = (f"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(header) + len(raw)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n").encode() + header + raw
    for round_ in range(3):
        server, _ = serve(attnserve, "--shutdown-grace", "20", models={"mha": build(3013)})

        sel = selectors.DefaultSelector()
        for i in range(32):
            s = socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
            if i % 2:  # Half end with a reset, half with a FIN.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.sendall(data)
            sel.register(s, selectors.EVENT_READ, bytearray())
        answers = 0
        while answers < 600:  # Each answer read whole, then the next request on its connection.
            for key, _ in sel.select(timeout=30):
                buf = key.data
                buf += key.fileobj.recv(1 << 20)
                head_end = buf.find(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", buf[:head_end]) if head_end >= 0 else None
                if length and len(buf) >= head_end + 4 + int(length.group(1)):
                    del buf[:head_end + 4 + int(length.group(1))]
                    answers += 1
                    key.fileobj.sendall(data)
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        lib.wait_until(lambda: http_calls(server, "attnserve_requests_in_flight") == 0, timeout=60, step=0.01)
        start = time.monotonic()
        out = server.stop()  # Raises unless the exit code is 0.
        took = time.monotonic() - start
        checks(f"round {round_}: exit within 5 s of SIGTERM (--shutdown-grace 20)",
               took < 5 and "took longer" not in out, f"{took:.1f} s {out[-300:]}")
