"""The blocking client."""
import itertools

import grpc

from . import _calls, _tensors
from .errors import AttnserveError
from .v1 import attention_pb2 as pb
from .v1 import attention_pb2_grpc as pb_grpc

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
    Thread-safe; close() (or `with`) closes the channel."""

    def __init__(self, target="127.0.0.1:50051", *, tls=False, root_certs=None, cert=None, key=None,
                 server_name=None, deadline=30.0, service_config="default", max_message_bytes=64 << 20,
                 options=None):
        self._channel = _calls.channel(grpc, target, tls=tls, root_certs=root_certs, cert=cert, key=key,
                                       server_name=server_name, service_config=service_config,
                                       max_message_bytes=max_message_bytes, options=options)
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._deadline = deadline
        self._ids = itertools.count(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._channel.close()

    def _call(self, method, request, deadline):
        timeout = self._deadline if deadline is DEFAULT else deadline
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise AttnserveError.from_rpc(e) from None

    def attend(self, query, key=None, value=None, *, model="demo", model_version=0, key_padding_mask=None,
               attn_mask=None, is_causal=False, attn_weights="none", layout="batch_first", memory=None,
               session=None, session_length=None, deadline=DEFAULT):
        """nn.MultiheadAttention's forward on the server: self-attention without key and value, cross-attention
        with them. attn_weights: "none", "averaged" or "per_head"; layout: "batch_first" or "sequence_first".
        Bool masks: True = masked out. Returns a Result; raises AttnserveError."""
        req = _calls.attend_request(query, key, value, model=model, model_version=model_version,
                                    key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
                                    attn_weights=attn_weights, layout=layout, memory=memory, session=session,
                                    session_length=session_length, request_id=next(self._ids))
        return _calls.result(self._call(self._stub.Attend, req, deadline), _tensors.is_torch(query))

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
        return Session(self, self._call(self._stub.OpenSession, req, deadline))

    def memory(self, key, value, *, model="demo", model_version=0, key_padding_mask=None, layout="batch_first",
               deadline=DEFAULT):
        """Projects `key` and `value` once and keeps them on the server for cross-attention. Use it with
        `with`, which deletes it."""
        req = _calls.memory_request(key, value, model=model, model_version=model_version,
                                    key_padding_mask=key_padding_mask, layout=layout)
        return Memory(self, self._call(self._stub.CreateMemory, req, deadline))

    def _release(self, method, handle, deadline):
        return self._call(method, pb.ReleaseRequest(handle=handle), deadline).bytes_freed


class Session(_calls.Kept):
    """A decoding session (Client.session): each step appends its tokens and attends causally over all so
    far. `length` is the tokens held; every step says how many it expects, so a step the server already
    applied (an answer lost, the call retried) is refused with ABORTED instead of applied twice.
    `info` is the server's KvHandle."""

    def __init__(self, client, info):
        super().__init__(client, info)
        self.length = info.length

    def step(self, query, *, key_padding_mask=None, attn_mask=None, attn_weights="none", layout="batch_first",
             deadline=DEFAULT):
        r = self._client.attend(query, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                attn_weights=attn_weights, layout=layout, session=self.handle,
                                session_length=self.length, deadline=deadline)
        self.length = r.session_length
        return r

    def fork(self, *, deadline=DEFAULT):
        """A new session holding a copy of this one's tokens (beam search, parallel sampling): each steps on
        its own. Use it with `with` too."""
        req = pb.ForkSessionRequest(handle=self.handle)
        return Session(self._client, self._client._call(self._client._stub.ForkSession, req, deadline))

    def truncate(self, length, *, deadline=DEFAULT):
        """Takes the session back to its first `length` tokens (speculative decoding: a rejected draft's
        tail); the next step appends after them. Returns the tokens it holds."""
        req = pb.TruncateSessionRequest(handle=self.handle, length=length)
        self.info = self._client._call(self._client._stub.TruncateSession, req, deadline)
        self.length = self.info.length
        return self.length

    def close(self, *, deadline=DEFAULT):
        """Frees it on the server; returns the bytes freed."""
        return self._client._release(self._client._stub.CloseSession, self.handle, deadline)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Memory(_calls.Kept):
    """Keys and values kept on the server for cross-attention (Client.memory). `info` is its KvHandle."""

    def attend(self, query, *, attn_mask=None, is_causal=False, attn_weights="none", layout="batch_first",
               deadline=DEFAULT):
        return self._client.attend(query, attn_mask=attn_mask, is_causal=is_causal, attn_weights=attn_weights,
                                   layout=layout, memory=self.handle, deadline=deadline)

    def delete(self, *, deadline=DEFAULT):
        """Frees it on the server; returns the bytes freed."""
        return self._client._release(self._client._stub.DeleteMemory, self.handle, deadline)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.delete()
