"""The Open Inference Protocol front end carries the trace context too: unmodified tritonclient
(PyPI, tools/oip-env.sh triton) sends `traceparent` as a header (its `headers=` argument, gRPC
metadata), as Triton's own tracing reads it; a ModelStreamInfer request may carry its own as a
`traceparent` parameter. The collector (otlp_receiver.py, opentelemetry-proto) runs in the tracing
environment's Python, ATTNSERVE_TRACING_PYTHON (tests/tracing/tracing_test.sh sets it).
"""
import json
import os
import queue
import subprocess
import sys
import time

import numpy as np
import pytest
import tritonclient.grpc as tc

import attnserve_py as lib

check = lib.Checks()
HERE = os.path.dirname(os.path.abspath(__file__))
E = 512
TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


@pytest.fixture
def collector():
    """(endpoint, spans()): the receiver in its own process, its spans read from its JSON lines."""
    python = os.environ.get("ATTNSERVE_TRACING_PYTHON")
    if not python:
        raise pytest.UsageError("ATTNSERVE_TRACING_PYTHON: the tracing environment's python is required")
    tmp = lib.temp_dir("attnserve-oip-trace-")
    port_file, out = os.path.join(tmp, "port"), os.path.join(tmp, "spans.jsonl")
    proc = subprocess.Popen([python, os.path.join(HERE, "otlp_receiver.py"), "--port-file", port_file,
                             "--out", out])
    if not lib.wait_until(lambda: os.path.exists(port_file), timeout=30):
        proc.kill()
        raise RuntimeError("the OTLP receiver did not start")
    endpoint = "127.0.0.1:" + open(port_file).read().strip()

    def spans():
        if not os.path.exists(out):
            return []
        return [json.loads(l) for l in open(out).read().splitlines() if l.strip()]

    yield endpoint, spans
    proc.terminate()
    proc.wait(timeout=10)


def tensor(rng, length):
    t = tc.InferInput("query", [1, length, E], "FP32")
    t.set_data_from_numpy(rng.standard_normal((1, length, E)).astype(np.float32))
    return t


def test_tritonclient_headers_and_stream_parameters_carry_the_trace(attnserve, collector, checks):
    endpoint, spans = collector
    server = lib.Server(attnserve, "--trace-endpoint", endpoint)
    rng = np.random.default_rng(7)
    stream_trace = "5c8a2ee4d7b04f4c9f6d1e3b2a190807"
    try:
        client = tc.InferenceServerClient(server.target)
        result = client.infer("demo", [tensor(rng, 4)], headers={"traceparent": f"00-{TRACE}-{PARENT}-01",
                                                                  "tracestate": "triton=1"})
        checks("ModelInfer answered", result.as_numpy("attn_output").shape == (1, 4, E))
        answers = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("demo", [tensor(rng, 2)], request_id="traced",
                                  parameters={"traceparent": f"00-{stream_trace}-{PARENT}-01"})
        client.async_stream_infer("demo", [tensor(rng, 2)], request_id="untraced")
        got = [answers.get(timeout=30) for _ in range(2)]
        client.stop_stream()
        checks("both stream requests answered", all(e is None for _, e in got), [str(e) for _, e in got])
        found = lib.wait_until(lambda: any(s["trace_id"] == TRACE and s["kind"] == "server" for s in spans())
                               and any(s["trace_id"] == stream_trace and s["kind"] == "server" for s in spans()),
                               timeout=15)
    finally:
        server.stop()
    all_spans = spans()
    unary = [s for s in all_spans if s["trace_id"] == TRACE and s["kind"] == "server"]
    checks("the header's trace: ModelInfer's server span, under tritonclient's parent, with its tracestate",
           found and len(unary) == 1 and unary[0]["name"] == "inference.GRPCInferenceService/ModelInfer"
           and unary[0]["parent_span_id"] == PARENT and unary[0]["trace_state"] == "triton=1", unary)
    children = {s["name"] for s in all_spans if unary and s["parent_span_id"] == unary[0]["span_id"]}
    checks("with its decode, queue, compute and encode", children == {
        "attnserve.decode", "attnserve.queue", "attnserve.compute", "attnserve.encode"}, children)
    stream = [s for s in all_spans if s["trace_id"] == stream_trace and s["kind"] == "server"]
    checks("a stream request's own traceparent parameter: its own server span",
           len(stream) == 1 and stream[0]["name"] == "inference.GRPCInferenceService/ModelStreamInfer"
           and stream[0]["parent_span_id"] == PARENT, stream)
    checks("the stream's request without one made no span (rate 0)",
           len([s for s in all_spans if s["kind"] == "server"]) == 2)


def test_http_traceparent_header_carries_the_trace(attnserve, collector, checks):
    """The HTTP port reads `traceparent` and `tracestate` headers: the call's server span (an HTTP
    server span named by its route) is under the caller's parent, with its decode, queue, compute
    and encode."""
    import http.client

    endpoint, spans = collector
    server = lib.Server(attnserve, "--trace-endpoint", endpoint)
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    q = np.random.default_rng(8).standard_normal((1, 3, E)).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 3, E],
                                   "data": q.ravel().tolist()}]})
    try:
        c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        c.request("POST", "/v2/models/demo/infer", body=body,
                  headers={"traceparent": f"00-{trace}-{PARENT}-01", "tracestate": "http=1"})
        r = c.getresponse()
        r.read()
        checks("HTTP infer answered", r.status == 200, r.status)
        found = lib.wait_until(lambda: any(s["trace_id"] == trace and s["kind"] == "server" for s in spans()),
                               timeout=15)
    finally:
        server.stop()
    all_spans = spans()
    call = [s for s in all_spans if s["trace_id"] == trace and s["kind"] == "server"]
    checks("the header's trace: the HTTP call's server span under the caller's parent, with its tracestate",
           found and len(call) == 1 and call[0]["name"] == "POST /v2/models/{model_name}/infer"
           and call[0]["parent_span_id"] == PARENT and call[0]["trace_state"] == "http=1", call)
    children = {s["name"] for s in all_spans if call and s["parent_span_id"] == call[0]["span_id"]}
    checks("with its decode, queue, compute and encode", children == {
        "attnserve.decode", "attnserve.queue", "attnserve.compute", "attnserve.encode"}, children)

