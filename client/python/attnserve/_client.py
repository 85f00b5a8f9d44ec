"""The blocking client."""
import itertools

import grpc

from . import _calls, _shm, _tensors
from .errors import AttnserveError
from .v1 import attention_pb2 as pb

DEFAULT = object()  # A call's deadline when not given: the client's.


class Client:
    """A client of attnserve over one gRPC channel (one server, or balanced over replicas).

    target: any gRPC target ("host:port", "dns:///name:port", "ipv4:a:p,b:p").
    tls: TLS instead of plaintext; root_certs (CA PEM file; None: the system's), cert and key (PEM files,
        for mutual TLS), server_name (the name to check in the server's certificate).
    deadline: seconds each call may take (None: no limit); a call's own `deadline=` overrides it.
    service_config: "default" (round_robin, health checks, retries: deploy/grpc/service-config.json),
        "proxy" (retries only: for nginx or Envoy in front), None (gRPC's defaults), or a JSON text.
    max_message_bytes: largest message sent or received. options: more gRPC channel arguments.
    route_to_replica: a memory's or session's calls go straight to the replica holding it (the address it
        advertises, KvHandle.replica) over a channel of the client's own; False behind a proxy whose replicas
        the client cannot reach. Either way they name the replica in their `attnserve-replica` metadata,
        which deploy/nginx routes by (docs/kv.md "Sessions across replicas").
    wire_dtype: "model" (the default): float32 queries, keys and values of a model computing in bfloat16 or
        float16 travel in that dtype (half the bytes; the server rounds to it anyway) and answers come back
        widened to float32; "as_given": tensors travel as they are.
    connections: connections (HTTP/2) calls are spread over, round robin, so that large tensors from many
        threads do not queue on one.
    metadata: (key, value) pairs sent with every call, e.g. (("attnserve-tenant", "search"),) for a server
        behind a gateway it trusts to name tenants (docs/tenants.md).
    Thread-safe; close() (or `with`) closes the channels."""

    def __init__(self, target="127.0.0.1:50051", *, tls=False, root_certs=None, cert=None, key=None,
                 server_name=None, deadline=30.0, service_config="default", max_message_bytes=64 << 20,
                 options=None, route_to_replica=True, wire_dtype="model", connections=4, metadata=()):
        if wire_dtype not in ("model", "as_given"):
            raise ValueError(f"wire_dtype: '{wire_dtype}'; allowed: model, as_given")
        self._channels = _calls.Channels(grpc, target, route_to_replica=route_to_replica, tls=tls,
                                         root_certs=root_certs, cert=cert, key=key, server_name=server_name,
                                         service_config=service_config, max_message_bytes=max_message_bytes,
                                         options=options, connections=connections, metadata=metadata)
        self._stub = self._channels.stub
        self._deadline = deadline
        self._ids = itertools.count(1)
        self._wire_dtype = wire_dtype
        self._dtypes = {}  # (model, version) -> the 16-bit wire name, or None

    def _wire(self, tensor, model, version, kept=None):
        """The 16-bit dtype float32 `tensor` travels in for this model (wire_dtype "model"), or None."""
        if self._wire_dtype != "model" or not _calls.is_float32(tensor):
            return None
        if kept is not None:
            model, version = kept.info.model, kept.info.model_version
        elif model is None:
            return None  # A bare handle: its model is not known here.
        if (model, version) not in self._dtypes:
            try:
                info = self.get_model(model, version)
            except AttnserveError:
                return None  # The call itself will say what is wrong.
            self._dtypes[(model, version)] = _calls.SIXTEEN.get(info.compute_dtype)
        return self._dtypes[(model, version)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for ch in self._channels.all():
            ch.close()

    def _call(self, method, request, deadline):
        timeout = self._deadline if deadline is DEFAULT else deadline
        try:
            return method(request, timeout=timeout, metadata=_calls.with_trace(self._channels.metadata))
        except grpc.RpcError as e:
            raise AttnserveError.from_rpc(e) from None

    def _routed(self, name, request, deadline, route):
        """AttentionService method `name` for a memory or session with `route`, where it lives."""
        stub, metadata, replica = self._channels.routed(route)
        timeout = self._deadline if deadline is DEFAULT else deadline
        try:
            return getattr(stub, name)(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise _calls.error(e, replica) from None

    def _make(self, name, request, deadline, kind):
        """Makes a memory or session (`kind`) on whichever replica the target picks; its calls then follow it."""
        info = self._routed(name, request, deadline, None)
        return kind(self, info, _calls.Route(info.replica))

    def attend(self, query, key=None, value=None, *, model="demo", model_version=0, key_padding_mask=None,
               attn_mask=None, is_causal=False, attn_weights="none", layout="batch_first", memory=None,
               session=None, session_length=None, out=None, priority=0, queue_timeout_us=0, query_position=None,
               key_position=0, positions=None, deadline=DEFAULT):
        """nn.MultiheadAttention's forward on the server: self-attention without key and value, cross-attention
        with them. attn_weights: "none", "averaged" or "per_head"; layout: "batch_first" or "sequence_first".
        Bool masks: True = masked out. memory and session: a Memory or Session (routed to its replica) or a
        handle (sent through the target). Arrays of a SharedMemoryRegion (Client.shared_memory) travel as
        references; `out=`, such an array, receives the output (Result.output is then `out`). priority: the
        request's priority level where the model has levels (1 first, 0 the default); queue_timeout_us: its own
        queue timeout where the level allows one (docs/tenants.md). Models served from a decoder checkpoint
        (docs/models.md): query_position, the first query token's position (RoPE; default 0, in a session step
        its length), or positions, one per query token (batch-first); key_position, cross-attention's first key.
        Returns a Result; raises AttnserveError."""
        route = None
        kept = memory if isinstance(memory, _calls.Kept) else session if isinstance(session, _calls.Kept) else None
        if isinstance(memory, _calls.Kept):
            memory, route = memory.handle, memory.route
        if isinstance(session, _calls.Kept):
            session, route = session.handle, session.route
        wire = self._wire(query, None if (memory or session) and kept is None else model, model_version, kept)
        req = _calls.attend_request(query, key, value, model=model, model_version=model_version,
                                    key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
                                    attn_weights=attn_weights, layout=layout, memory=memory, session=session,
                                    session_length=session_length, request_id=next(self._ids), out=out, wire=wire,
                                    priority=priority, queue_timeout_us=queue_timeout_us,
                                    query_position=query_position, key_position=key_position,
                                    positions=positions)
        return _calls.result(self._routed("Attend", req, deadline, route), _tensors.is_torch(query), out,
                             widen=wire is not None)

    def step_many(self, steps, *, priority=0, queue_timeout_us=0, deadline=DEFAULT):
        """A batched step (docs/api.md "Many sessions in one call"): one step for each of many sessions, or a
        query for each of many memories, of one model version, in one call: `steps` is a list of
        attnserve.Step. Returns one StepResult per step, in order; a step that failed carries its
        AttnserveError in `error` and changed nothing, the others went on. Each Session stepped takes its new
        length. The call goes to the first step's replica. Raises AttnserveError when the call itself is
        refused (then no step was applied)."""
        first = steps[0].kept if steps else None
        kept = first if isinstance(first, _calls.Kept) else None
        wire = self._wire(steps[0].query, None, 0, kept) if kept else None
        if wire is not None and not all(_calls.is_float32(s.query) for s in steps):
            wire = None
        req = _calls.steps_request(steps, request_id=next(self._ids), wire=wire, priority=priority,
                                   queue_timeout_us=queue_timeout_us)
        resp = self._routed("Attend", req, deadline, kept.route if kept else None)
        return _calls.step_results(resp, steps, widen=wire is not None)

    def shared_memory(self, name, byte_size):
        """A POSIX shared memory region of `byte_size` bytes made on this host and registered with the server
        (which runs with --allow-shared-memory) as `name`: its arrays (region.array(shape, dtype, offset))
        travel as references, never through the socket. Use it with `with`, which unregisters and unlinks it."""
        return _shm.SharedMemoryRegion(self, name, byte_size)

    def register_shared_memory(self, name, key, offset, byte_size, *, deadline=DEFAULT):
        """Registers [offset, offset + byte_size) of the POSIX shared memory object `key` as region `name`."""
        req = pb.RegisterSharedMemoryRequest(name=name, key=key, offset=offset, byte_size=byte_size)
        self._call(self._stub.RegisterSharedMemory, req, deadline)

    def unregister_shared_memory(self, name="", *, deadline=DEFAULT):
        """Unregisters region `name` ("" = every region)."""
        self._call(self._stub.UnregisterSharedMemory, pb.UnregisterSharedMemoryRequest(name=name), deadline)

    def shared_memory_status(self, name="", *, deadline=DEFAULT):
        """The regions registered (SharedMemoryRegion messages: name, key, offset, byte_size)."""
        req = pb.SharedMemoryStatusRequest(name=name)
        return list(self._call(self._stub.SharedMemoryStatus, req, deadline).regions)

    def list_models(self, *, deadline=DEFAULT):
        """Every loaded version of every model (ModelInfo messages)."""
        return list(self._call(self._stub.ListModels, pb.ListModelsRequest(), deadline).models)

    def get_model(self, name, version=0, *, deadline=DEFAULT):
        """One model version (0: the highest loaded) as a ModelInfo message; NOT_FOUND when absent."""
        return self._call(self._stub.GetModel, pb.GetModelRequest(name=name, version=version), deadline)

    def session(self, model="demo", batch=1, *, model_version=0, deadline=DEFAULT):
        """Opens a decoding session: its keys and values stay on the server between steps. Use it with
        `with`, which closes it."""
        req = pb.OpenSessionRequest(model=model, model_version=model_version, batch=batch)
        return self._make("OpenSession", req, deadline, Session)

    def memory(self, key, value, *, model="demo", model_version=0, key_padding_mask=None, layout="batch_first",
               key_position=0, deadline=DEFAULT):
        """Projects `key` and `value` once and keeps them on the server for cross-attention. Use it with
        `with`, which deletes it."""
        req = _calls.memory_request(key, value, model=model, model_version=model_version,
                                    key_padding_mask=key_padding_mask, layout=layout, key_position=key_position,
                                    wire=self._wire(key, model, model_version))
        return self._make("CreateMemory", req, deadline, Memory)

    def _release(self, name, kept, deadline):
        return self._routed(name, pb.ReleaseRequest(handle=kept.handle), deadline, kept.route).bytes_freed


class Session(_calls.Kept):
    """A decoding session (Client.session): each step appends its tokens and attends causally over all so
    far. `length` is the tokens held; every step says how many it expects, so a step the server already
    applied (an answer lost, the call retried) is refused with ABORTED instead of applied twice.
    `info` is the server's KvHandle."""
    kind = "session"

    def __init__(self, client, info, route):
        super().__init__(client, info, route)
        self.length = info.length

    def step(self, query, *, key_padding_mask=None, attn_mask=None, attn_weights="none", layout="batch_first",
             query_position=None, positions=None, deadline=DEFAULT):
        """Appends the query's tokens and attends over all so far. A decoder layer's tokens are at the
        session's length onwards unless query_position or positions (one per token) say otherwise."""
        r = self._client.attend(query, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                attn_weights=attn_weights, layout=layout, session=self,
                                session_length=self.length, query_position=query_position,
                                positions=positions, deadline=deadline)
        self.length = r.session_length
        return r

    def fork(self, *, deadline=DEFAULT):
        """A new session holding this one's tokens (beam search, parallel sampling), shared on the server
        (nothing copied): each steps on its own. Use it with `with` too."""
        req = pb.ForkSessionRequest(handle=self.handle)
        info = self._client._routed("ForkSession", req, deadline, self.route)
        return Session(self._client, info, _calls.Route(info.replica))

    def truncate(self, length, *, deadline=DEFAULT):
        """Takes the session back to its first `length` tokens (speculative decoding: a rejected draft's
        tail); the next step appends after them. Returns the tokens it holds."""
        req = pb.TruncateSessionRequest(handle=self.handle, length=length)
        self.info = self._client._routed("TruncateSession", req, deadline, self.route)
        self.length = self.info.length
        return self.length

    def close(self, *, deadline=DEFAULT):
        """Frees it on the server; returns the bytes freed."""
        return self._client._release("CloseSession", self, deadline)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Memory(_calls.Kept):
    """Keys and values kept on the server for cross-attention (Client.memory). `info` is its KvHandle."""
    kind = "memory"

    def attend(self, query, *, attn_mask=None, is_causal=False, attn_weights="none", layout="batch_first",
               deadline=DEFAULT):
        return self._client.attend(query, attn_mask=attn_mask, is_causal=is_causal, attn_weights=attn_weights,
                                   layout=layout, memory=self, deadline=deadline)

    def delete(self, *, deadline=DEFAULT):
        """Frees it on the server; returns the bytes freed."""
        return self._client._release("DeleteMemory", self, deadline)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.delete()
