"""An OTLP/gRPC trace collector for the tracing tests and benchmark, built on PyPI's
opentelemetry-proto (tools/python-env.sh tracing): it decodes every Export call with OpenTelemetry's
own messages, so what attnserve's exporter writes is read exactly as a real collector reads it.

As a module: Receiver(mode) starts one on a free port; `spans()` returns what arrived as dicts.
As a program: python otlp_receiver.py --port-file F [--mode ok|stall|refuse] [--out spans.jsonl]
  writes its port to F, then appends each span as one JSON line to --out (for tests in another
  virtual environment, such as tritonclient's, and for the benchmark).

Modes: ok (accepts), stall (accepts the call, then never answers: a collector that hangs),
refuse (answers UNAVAILABLE at once).
"""
import argparse
import json
import sys
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def value_of(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def span_dict(resource, scope, span):
    return {
        "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(), "trace_state": span.trace_state,
        "name": span.name, "kind": KINDS.get(span.kind, str(span.kind)),
        "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
        "attributes": {kv.key: value_of(kv.value) for kv in span.attributes},
        "links": [{"trace_id": l.trace_id.hex(), "span_id": l.span_id.hex()} for l in span.links],
        "status": {"code": span.status.code, "message": span.status.message},
        "resource": {kv.key: value_of(kv.value) for kv in resource.attributes},
        "scope": scope.name,
    }


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver):
        self.r = receiver

    def Export(self, request, context):
        self.r.calls += 1
        if self.r.mode == "refuse":
            context.abort(grpc.StatusCode.UNAVAILABLE, "refusing (test collector)")
        if self.r.mode == "stall":
            self.r.stalled.wait()  # until stop(): the exporter's deadline ends the call first
            context.abort(grpc.StatusCode.UNAVAILABLE, "stalled (test collector)")
        if not self.r.keep:  # counting only (the memory test's hundreds of thousands)
            with self.r.lock:
                self.r.count += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()
        got = [span_dict(rs.resource, ss.scope, s)
               for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        with self.r.lock:
            self.r._spans.extend(got)
            self.r.count += len(got)
        if self.r.sink:
            for s in got:
                self.r.sink.write(json.dumps(s) + "\n")
            self.r.sink.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


class Receiver:
    def __init__(self, mode="ok", port=0, sink=None, keep=True, tls=None):
        """tls: (key PEM, certificate PEM) bytes to serve over TLS."""
        self.mode, self.sink, self.calls, self.keep, self.count = mode, sink, 0, keep, 0
        self.lock, self.stalled = threading.Lock(), threading.Event()
        self._spans = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self.server)
        if tls:
            creds = grpc.ssl_server_credentials([tls])
            self.port = self.server.add_secure_port(f"127.0.0.1:{port}", creds)
        else:
            self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.port}"

    def spans(self):
        with self.lock:
            return list(self._spans)

    def wait_for(self, predicate, timeout=15):
        """Spans once predicate(spans) holds, or what arrived by the timeout."""
        end = time.time() + timeout
        while time.time() < end:
            got = self.spans()
            if predicate(got):
                return got
            time.sleep(0.05)
        return self.spans()

    def stop(self):
        self.stalled.set()
        self.server.stop(0)


def tree(spans, trace_id):
    """One trace as indented lines: name, kind, duration, parent chain (for docs and failures)."""
    mine = [s for s in spans if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in mine}
    children = {}
    for s in mine:
        children.setdefault(s["parent_span_id"] if s["parent_span_id"] in ids else None, []).append(s)
    lines = []

    def walk(parent, depth):
        for s in sorted(children.get(parent, []), key=lambda s: s["start"]):
            ms = (s["end"] - s["start"]) / 1e6
            extra = f"  links {len(s['links'])}" if s["links"] else ""
            lines.append(f"{'  ' * depth}{s['name']} ({s['kind']}, {ms:.3f} ms, "
                         f"{s['resource'].get('service.name', '?')}){extra}")
            walk(s["span_id"], depth + 1)

    walk(None, 0)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--mode", choices=["ok", "stall", "refuse"], default="ok")
    ap.add_argument("--out", default=None, help="append spans here as JSON lines")
    ap.add_argument("--count-only", action="store_true", help="decode and count, keep nothing")
    args = ap.parse_args()
    sink = open(args.out, "a") if args.out else None
    r = Receiver(args.mode, args.port, sink, keep=not args.count_only)
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(r.port))
    import os
    os.replace(args.port_file + ".tmp", args.port_file)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        r.stop()


if __name__ == "__main__":
    sys.exit(main())
