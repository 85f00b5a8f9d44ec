"""What the blocking and the asyncio clients share: channel settings, requests, answers."""
import dataclasses
import importlib.resources
import itertools
import json
import threading
from typing import Any, Optional

import grpc

from . import _shm, _tensors
from .errors import AttnserveError
from .v1 import attention_pb2 as pb
from .v1 import attention_pb2_grpc as pb_grpc

try:  # The `tracing` extra: every call carries the caller's OpenTelemetry context (W3C traceparent).
    from opentelemetry import propagate as _propagate
except ImportError:
    _propagate = None

# The metadata key that names the replica holding a memory or session (KvHandle.replica): a call on
# one carries it, and deploy/nginx routes by it.
ROUTE_METADATA = "attnserve-replica"

LAYOUTS = {"batch_first": pb.LAYOUT_BATCH_FIRST, "sequence_first": pb.LAYOUT_SEQUENCE_FIRST}
WEIGHTS = {"none": pb.ATTN_WEIGHTS_NONE, "averaged": pb.ATTN_WEIGHTS_AVERAGED, "per_head": pb.ATTN_WEIGHTS_PER_HEAD}


def with_trace(metadata=None):
    """`metadata` plus the current OpenTelemetry context (`traceparent`, `tracestate`) when
    opentelemetry-api is installed and a span is current; `metadata` unchanged otherwise."""
    if _propagate is None:
        return metadata
    carrier = {}
    _propagate.inject(carrier)
    if not carrier:
        return metadata
    return tuple(metadata or ()) + tuple((k.lower(), v) for k, v in carrier.items())


def service_config(which):
    """The JSON text for `which`: "default" (round_robin over every address, client-side health checks,
    retries of UNAVAILABLE/CANCELLED: the C++ client's default, deploy/grpc/service-config.json), "proxy"
    (the same retries, no health checks: for a target that is nginx or Envoy), None (gRPC's defaults), or
    a JSON text of the caller's."""
    if which is None:
        return None
    if which in ("default", "proxy"):
        name = "service-config.json" if which == "default" else "service-config-proxy.json"
        return importlib.resources.files(__package__).joinpath(name).read_text()
    json.loads(which)  # A caller's config: refuse what is not JSON here, not inside gRPC.
    return which


READ_CHUNK_BYTES = 2 << 20


def channel_args(config, max_message_bytes, options):
    args = [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]
    # A megabyte answer read in a few reads, not hundreds of gRPC's 8 KiB (it adapts from there),
    # as the C++ client and the server read; a caller's own options win.
    if "grpc.experimental.tcp_read_chunk_size" not in (options or {}):
        args.append(("grpc.experimental.tcp_read_chunk_size", READ_CHUNK_BYTES))
    text = service_config(config)
    if text is not None:
        args.append(("grpc.service_config", text))
    args += list((options or {}).items())
    return args


def credentials(tls, root_certs, cert, key):
    """grpc.ssl_channel_credentials from PEM file paths; None for plaintext."""
    if not tls:
        if root_certs or cert or key:
            raise ValueError("root_certs, cert and key need tls=True")
        return None
    if bool(cert) != bool(key):
        raise ValueError("cert and key: give both for mutual TLS, or neither")

    def read(path, what):
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"{what}: cannot read '{path}': {e.strerror}") from e

    return grpc.ssl_channel_credentials(read(root_certs, "root_certs"), read(key, "key"), read(cert, "cert"))


def channel(grpc_module, target, *, tls, root_certs, cert, key, server_name, service_config, max_message_bytes,
            options):
    """A channel made by `grpc_module` (grpc, or grpc.aio) with the clients' settings."""
    args = channel_args(service_config, max_message_bytes, options)
    creds = credentials(tls, root_certs, cert, key)
    if creds is None:
        return grpc_module.insecure_channel(target, options=args)
    override = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc_module.secure_channel(target, creds, options=args + override)


@dataclasses.dataclass
class Result:
    """One answer. `output` (and `attn_weights` when asked for) are numpy arrays, or torch tensors when
    the query was one; the rest is what the server says about the computation."""
    output: Any
    attn_weights: Optional[Any]
    model: str
    model_version: int
    weights_hash: str
    session_length: int
    queue_seconds: float
    compute_seconds: float
    batch_size: int
    request_id: int


def attend_request(query, key, value, *, model, model_version, key_padding_mask, attn_mask, is_causal,
                   attn_weights, layout, memory, session, session_length, request_id, out=None, wire=None,
                   priority=0, queue_timeout_us=0, query_position=None, key_position=0, positions=None):
    if attn_weights not in WEIGHTS:
        raise ValueError(f"attn_weights: '{attn_weights}'; allowed: {', '.join(WEIGHTS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: '{layout}'; allowed: {', '.join(LAYOUTS)}")
    if (key is None) != (value is None):
        raise ValueError("key and value: give both (cross-attention) or neither (self-attention)")
    req = pb.AttendRequest(model="" if memory or session else model, model_version=model_version,
                           is_causal=is_causal, attn_weights=WEIGHTS[attn_weights], layout=LAYOUTS[layout],
                           request_id=request_id, memory=memory or "", session=session or "",
                           priority=priority, queue_timeout_us=queue_timeout_us)
    for name, t in (("query", query), ("key", key), ("value", value), ("key_padding_mask", key_padding_mask),
                    ("attn_mask", attn_mask)):
        if t is not None:
            _tensors.to_wire(t, name, getattr(req, name), wire if name in ("query", "key", "value") else None)
    if session_length is not None:
        req.session_length = session_length
    if query_position is not None:
        req.query_position = int(query_position)
    req.key_position = int(key_position)
    if positions is not None:
        req.positions.extend(int(p) for p in _tensors.flat_ints(positions))
    if out is not None:
        ref = _shm.ref_of(out)
        if ref is None:
            raise ValueError("out: not an array of a registered SharedMemoryRegion (Client.shared_memory)")
        req.output_shared_memory.CopyFrom(ref)
    return req


def result(resp, like_torch, out=None, widen=False):
    return Result(output=_tensors.from_wire(resp.output, like_torch, out, widen),
                  attn_weights=_tensors.from_wire(resp.attn_weights, like_torch, None, widen)
                  if resp.HasField("attn_weights") else None,
                  model=resp.model, model_version=resp.model_version, weights_hash=resp.weights_hash,
                  session_length=resp.session_length, queue_seconds=resp.timing.queue_seconds,
                  compute_seconds=resp.timing.compute_seconds, batch_size=resp.timing.batch_size,
                  request_id=resp.request_id)


@dataclasses.dataclass
class Step:
    """One entry of a batched step (Client.step_many): a Session's new tokens, or a query for a Memory.
    `kept` is the Session or Memory (or a bare handle, then `kind` says which); `session_length`, unset,
    is the Session's own length (a bare handle's is not checked); query_position or positions (one per
    token, batch-first) place a decoder layer's tokens; key_padding_mask [B, T] covers a session's new
    tokens."""
    kept: Any
    query: Any
    key_padding_mask: Any = None
    query_position: Optional[int] = None
    positions: Any = None
    session_length: Optional[int] = None
    kind: str = "session"


@dataclasses.dataclass
class StepResult:
    """One entry's answer (Client.step_many), in the order given: its output (numpy, or torch when its
    query was) and the session's length after it; or `error`, an AttnserveError, when this entry failed
    (it changed nothing; the others went on)."""
    output: Any
    session_length: int
    error: Optional[Exception] = None


def steps_request(steps, *, request_id, wire=None, priority=0, queue_timeout_us=0):
    """The AttendRequest of a batched step."""
    if not steps:
        raise ValueError("steps: empty; give at least one Step")
    req = pb.AttendRequest(request_id=request_id, priority=priority, queue_timeout_us=queue_timeout_us)
    for i, s in enumerate(steps):
        if not isinstance(s, Step):
            raise TypeError(f"steps[{i}]: {type(s).__name__}; expected attnserve.Step")
        handle = s.kept.handle if isinstance(s.kept, Kept) else str(s.kept)
        is_memory = (s.kept.kind if isinstance(s.kept, Kept) else s.kind) == "memory"
        entry = req.steps.add(**({"memory": handle} if is_memory else {"session": handle}))
        _tensors.to_wire(s.query, f"steps[{i}].query", entry.query, wire)
        if s.key_padding_mask is not None:
            _tensors.to_wire(s.key_padding_mask, f"steps[{i}].key_padding_mask", entry.key_padding_mask)
        length = s.session_length if s.session_length is not None else getattr(s.kept, "length", None)
        if length is not None and not is_memory:
            entry.session_length = int(length)
        if s.query_position is not None:
            entry.query_position = int(s.query_position)
        if s.positions is not None:
            entry.positions.extend(int(p) for p in _tensors.flat_ints(s.positions))
    return req


def step_results(resp, steps, widen=False):
    """A batched step's answers; each Session stepped takes its new length."""
    out = []
    for s, r in zip(steps, resp.steps):
        if r.HasField("error") and r.error.code != 0:
            out.append(StepResult(None, 0, AttnserveError.from_stream_error(r.error)))
            continue
        out.append(StepResult(_tensors.from_wire(r.output, _tensors.is_torch(s.query), None, widen),
                              r.session_length))
        if isinstance(s.kept, Kept) and s.kept.kind == "session":
            s.kept.length = r.session_length
    return out


def memory_request(key, value, *, model, model_version, key_padding_mask, layout, wire=None, key_position=0):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: '{layout}'; allowed: {', '.join(LAYOUTS)}")
    req = pb.CreateMemoryRequest(model=model, model_version=model_version, layout=LAYOUTS[layout],
                                 key_position=int(key_position))
    for name, t in (("key", key), ("value", value), ("key_padding_mask", key_padding_mask)):
        if t is not None:
            _tensors.to_wire(t, name, getattr(req, name), wire if name != "key_padding_mask" else None)
    return req


SIXTEEN = {pb.DATA_TYPE_BFLOAT16: "bfloat16", pb.DATA_TYPE_FLOAT16: "float16"}


def is_float32(x):
    """Whether `x` is float32 (numpy or torch): what the model's 16-bit wire narrows."""
    if _tensors.is_torch(x):
        return str(x.dtype) == "torch.float32"
    return getattr(x, "dtype", None) == "float32"


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a memory's or session's calls go: the address its replica advertised (KvHandle.replica; ""
    for none), named in each call's `attnserve-replica` metadata (a proxy routes by it) and, with
    route_to_replica, called straight."""
    replica: str = ""


class Channels:
    """A client's channel to its target, and with route_to_replica one to each replica holding a memory or
    session it made (no balancing: "proxy" retries, or gRPC's defaults when the client has no config)."""

    def __init__(self, grpc_module, target, *, route_to_replica, service_config, connections=1, metadata=(),
                 **settings):
        self._grpc, self._target, self._direct, self._settings = grpc_module, target, route_to_replica, settings
        # Sent with every call (e.g. a trusted gateway's tenant header, docs/tenants.md).
        self.metadata = tuple(metadata)
        self._replica_config = None if service_config is None else "proxy"
        self.main = channel(grpc_module, target, service_config=service_config, **settings)
        self.stub = pb_grpc.AttentionServiceStub(self.main)
        # The pool: more channels with subchannel pools of their own (equal channels share one
        # connection otherwise); unrouted calls go round robin over it.
        self.pool = [self.main]
        for i in range(1, max(1, connections)):
            extra = dict(settings)
            extra["options"] = list((settings.get("options") or {}).items()) + [
                ("grpc.use_local_subchannel_pool", 1), ("attnserve.connection", i)]
            extra["options"] = dict(extra["options"])
            self.pool.append(channel(grpc_module, target, service_config=service_config, **extra))
        self._pool_stubs = [pb_grpc.AttentionServiceStub(ch) for ch in self.pool]
        self._turn = itertools.count()
        self._replicas = {}
        self._lock = threading.Lock()

    def routed(self, route):
        """(stub, metadata, replica) for a call on a memory or session with `route` (None: not routed);
        replica is the address of the replica the call is routed to ("" when none)."""
        if route is None:
            return self._pool_stubs[next(self._turn) % len(self._pool_stubs)], with_trace(self.metadata), ""
        if not route.replica:
            return self.stub, with_trace(self.metadata), ""
        metadata = with_trace(self.metadata + ((ROUTE_METADATA, route.replica),))
        if not self._direct or route.replica == self._target:
            return self.stub, metadata, route.replica
        with self._lock:
            entry = self._replicas.get(route.replica)
            if entry is None:
                ch = channel(self._grpc, route.replica, service_config=self._replica_config, **self._settings)
                entry = self._replicas[route.replica] = (ch, pb_grpc.AttentionServiceStub(ch))
        return entry[1], metadata, route.replica

    def all(self):
        with self._lock:
            return list(self.pool) + [ch for ch, _ in self._replicas.values()]


def error(e, replica):
    """AttnserveError for a refused call; one routed to a replica that did not answer says so."""
    err = AttnserveError.from_rpc(e)
    if replica and err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        err = AttnserveError(err.code, f"{err.message} (the call went to the replica at {replica}, which holds "
                                       "this memory or session: if it stopped, what it held is gone; make it again)")
    return err


class Kept:
    """What a memory and a session share, blocking or asyncio: the client that made it, its KvHandle
    (`info`: handle, model, batch, length, bytes, ttl_seconds, replica) and its Route."""

    kind = ""  # "session" or "memory" (the subclasses')

    def __init__(self, client, info, route):
        self._client, self.info, self.route = client, info, route

    @property
    def handle(self):
        return self.info.handle
