"""The asyncio twin of attnserve.Client: the same arguments, each call awaited.

    async with attnserve.aio.Client("127.0.0.1:50051") as client:
        out = (await client.attend(q)).output
        async with await client.session("demo") as s:
            await s.step(x)
"""
import itertools

import grpc
import grpc.aio

from . import _calls, _tensors
from ._client import DEFAULT
from .errors import AttnserveError
from .v1 import attention_pb2 as pb


class Client:
    """attnserve.Client on grpc.aio: make it inside a running event loop; `await close()` (or `async
    with`) closes it."""

    def __init__(self, target="127.0.0.1:50051", *, tls=False, root_certs=None, cert=None, key=None,
                 server_name=None, deadline=30.0, service_config="default", max_message_bytes=64 << 20,
                 options=None, route_to_replica=True, wire_dtype="model", connections=4, metadata=()):
        if wire_dtype not in ("model", "as_given"):
            raise ValueError(f"wire_dtype: '{wire_dtype}'; allowed: model, as_given")
        self._channels = _calls.Channels(grpc.aio, target, route_to_replica=route_to_replica, tls=tls,
                                         root_certs=root_certs, cert=cert, key=key, server_name=server_name,
                                         service_config=service_config, max_message_bytes=max_message_bytes,
                                         options=options, connections=connections, metadata=metadata)
        self._stub = self._channels.stub
        self._deadline = deadline
        self._ids = itertools.count(1)
        self._wire_dtype = wire_dtype
        self._dtypes = {}

    async def _wire(self, tensor, model, version, kept=None):
        """See attnserve.Client._wire."""
        if self._wire_dtype != "model" or not _calls.is_float32(tensor):
            return None
        if kept is not None:
            model, version = kept.info.model, kept.info.model_version
        elif model is None:
            return None
        if (model, version) not in self._dtypes:
            try:
                info = await self.get_model(model, version)
            except AttnserveError:
                return None
            self._dtypes[(model, version)] = _calls.SIXTEEN.get(info.compute_dtype)
        return self._dtypes[(model, version)]

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        for ch in self._channels.all():
            await ch.close()

    async def _call(self, method, request, deadline):
        timeout = self._deadline if deadline is DEFAULT else deadline
        try:
            return await method(request, timeout=timeout, metadata=_calls.with_trace(self._channels.metadata))
        except grpc.RpcError as e:
            raise AttnserveError.from_rpc(e) from None

    async def _routed(self, name, request, deadline, route):
        stub, metadata, replica = self._channels.routed(route)
        timeout = self._deadline if deadline is DEFAULT else deadline
        try:
            return await getattr(stub, name)(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise _calls.error(e, replica) from None

    async def _make(self, name, request, deadline, kind):
        info = await self._routed(name, request, deadline, None)
        return kind(self, info, _calls.Route(info.replica))

    async def attend(self, query, key=None, value=None, *, model="demo", model_version=0, key_padding_mask=None,
                     attn_mask=None, is_causal=False, attn_weights="none", layout="batch_first", memory=None,
                     session=None, session_length=None, out=None, priority=0, queue_timeout_us=0,
                     query_position=None, key_position=0, positions=None, deadline=DEFAULT):
        """See attnserve.Client.attend (arrays of a SharedMemoryRegion, made by a blocking Client of the same
        server, travel as references here too)."""
        route = None
        kept = memory if isinstance(memory, _calls.Kept) else session if isinstance(session, _calls.Kept) else None
        if isinstance(memory, _calls.Kept):
            memory, route = memory.handle, memory.route
        if isinstance(session, _calls.Kept):
            session, route = session.handle, session.route
        wire = await self._wire(query, None if (memory or session) and kept is None else model, model_version,
                                kept)
        req = _calls.attend_request(query, key, value, model=model, model_version=model_version,
                                    key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
                                    attn_weights=attn_weights, layout=layout, memory=memory, session=session,
                                    session_length=session_length, request_id=next(self._ids), out=out, wire=wire,
                                    priority=priority, queue_timeout_us=queue_timeout_us,
                                    query_position=query_position, key_position=key_position,
                                    positions=positions)
        return _calls.result(await self._routed("Attend", req, deadline, route), _tensors.is_torch(query), out,
                             widen=wire is not None)

    async def step_many(self, steps, *, priority=0, queue_timeout_us=0, deadline=DEFAULT):
        """See attnserve.Client.step_many."""
        first = steps[0].kept if steps else None
        kept = first if isinstance(first, _calls.Kept) else None
        wire = await self._wire(steps[0].query, None, 0, kept) if kept else None
        if wire is not None and not all(_calls.is_float32(s.query) for s in steps):
            wire = None
        req = _calls.steps_request(steps, request_id=next(self._ids), wire=wire, priority=priority,
                                   queue_timeout_us=queue_timeout_us)
        resp = await self._routed("Attend", req, deadline, kept.route if kept else None)
        return _calls.step_results(resp, steps, widen=wire is not None)

    async def list_models(self, *, deadline=DEFAULT):
        return list((await self._call(self._stub.ListModels, pb.ListModelsRequest(), deadline)).models)

    async def get_model(self, name, version=0, *, deadline=DEFAULT):
        return await self._call(self._stub.GetModel, pb.GetModelRequest(name=name, version=version), deadline)

    async def session(self, model="demo", batch=1, *, model_version=0, deadline=DEFAULT):
        """Opens a decoding session (`async with await client.session(...) as s`)."""
        req = pb.OpenSessionRequest(model=model, model_version=model_version, batch=batch)
        return await self._make("OpenSession", req, deadline, Session)

    async def memory(self, key, value, *, model="demo", model_version=0, key_padding_mask=None,
                     layout="batch_first", key_position=0, deadline=DEFAULT):
        """Keeps projected keys and values on the server (`async with await client.memory(k, v) as m`)."""
        req = _calls.memory_request(key, value, model=model, model_version=model_version,
                                    key_padding_mask=key_padding_mask, layout=layout, key_position=key_position,
                                    wire=await self._wire(key, model, model_version))
        return await self._make("CreateMemory", req, deadline, Memory)

    async def _release(self, name, kept, deadline):
        return (await self._routed(name, pb.ReleaseRequest(handle=kept.handle), deadline, kept.route)).bytes_freed


class Session(_calls.Kept):
    """See attnserve.Session."""
    kind = "session"

    def __init__(self, client, info, route):
        super().__init__(client, info, route)
        self.length = info.length

    async def step(self, query, *, key_padding_mask=None, attn_mask=None, attn_weights="none",
                   layout="batch_first", query_position=None, positions=None, deadline=DEFAULT):
        r = await self._client.attend(query, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                      attn_weights=attn_weights, layout=layout, session=self,
                                      session_length=self.length, query_position=query_position,
                                      positions=positions, deadline=deadline)
        self.length = r.session_length
        return r

    async def fork(self, *, deadline=DEFAULT):
        """A new session holding this one's tokens (beam search, parallel sampling), shared on the server
        (nothing copied): each steps on its own. Use it with `with` too."""
        req = pb.ForkSessionRequest(handle=self.handle)
        info = await self._client._routed("ForkSession", req, deadline, self.route)
        return Session(self._client, info, _calls.Route(info.replica))

    async def truncate(self, length, *, deadline=DEFAULT):
        """Takes the session back to its first `length` tokens (speculative decoding: a rejected draft's
        tail); the next step appends after them. Returns the tokens it holds."""
        req = pb.TruncateSessionRequest(handle=self.handle, length=length)
        self.info = await self._client._routed("TruncateSession", req, deadline, self.route)
        self.length = self.info.length
        return self.length

    async def close(self, *, deadline=DEFAULT):
        return await self._client._release("CloseSession", self, deadline)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class Memory(_calls.Kept):
    """See attnserve.Memory."""
    kind = "memory"

    async def attend(self, query, *, attn_mask=None, is_causal=False, attn_weights="none", layout="batch_first",
                     deadline=DEFAULT):
        return await self._client.attend(query, attn_mask=attn_mask, is_causal=is_causal,
                                         attn_weights=attn_weights, layout=layout, memory=self,
                                         deadline=deadline)

    async def delete(self, *, deadline=DEFAULT):
        return await self._client._release("DeleteMemory", self, deadline)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.delete()
