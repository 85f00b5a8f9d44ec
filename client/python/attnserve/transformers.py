"""A Hugging Face decoder's attention on an attnserve server (attention disaggregation).

    import attnserve, attnserve.transformers as at
    names = at.model_repository("ckpt/llama", "models", num_layers=model.config.num_hidden_layers)
    # ... the server runs with --models models ...
    with at.RemoteAttention(model, attnserve.Client("127.0.0.1:50051"), names):
        tokens = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

Each decoder layer's `self_attn` (Llama, Mistral, Qwen2, Qwen3: `model.model.layers[i].self_attn`) is
replaced by a module that steps, for every sequence of the batch, a session of that layer's model on the
server: one batched call (Client.step_many) per layer per forward, for the whole batch. The layer's
projections, RoPE, q/k norms, window and its kept keys and values are the server's (each layer served
from the same checkpoint folder: docs/models.md "A layer of a decoder"); the model keeps its
embeddings, norms and feed-forward layers. Padding (left, as generate() pads a batch of prompts of
different lengths) is never sent: each sequence's session holds only its real tokens, at the positions
the model gives them. A new generation (a cache holding nothing for a layer) opens new sessions and
closes the previous ones. generate()'s cache stays in use for its lengths only (one float per token).
Needs torch and transformers (not dependencies of the attnserve package).
"""
import json
import os

import torch

from ._calls import Step

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def model_repository(checkpoint, repository, num_layers, prefix="layer"):
    """Writes REPOSITORY/{prefix}{i}/config.json for each of `num_layers` layers, each serving layer i of
    the checkpoint folder `checkpoint` (save_pretrained's layout); returns the model names in layer order."""
    names = []
    for i in range(num_layers):
        name = f"{prefix}{i}"
        os.makedirs(os.path.join(repository, name), exist_ok=True)
        with open(os.path.join(repository, name, "config.json"), "w") as f:
            json.dump({"checkpoint": os.path.abspath(checkpoint), "layer": i}, f)
        names.append(name)
    return names


class RemoteAttention:
    """Puts `model`'s attention on the server `client` reaches: layer i's on the model `names[i]` (a layer
    of the same checkpoint, model_repository()). Use it with `with`, or call close(): the layers get their
    own attention back and the sessions are closed."""

    def __init__(self, model, client, names):
        family = getattr(model.config, "model_type", "")
        if family not in _FAMILIES:
            raise ValueError(f"model_type '{family}': allowed: {', '.join(_FAMILIES)}")
        layers = model.model.layers
        if len(names) != len(layers):
            raise ValueError(f"names: {len(names)} models for {len(layers)} layers; give one per layer")
        self._client, self._names, self._model = client, list(names), model
        self._sessions = {}  # layer -> one Session per sequence of the batch
        self._padding = None  # the call's 2-D attention mask [B, S] (1: a real token), or None
        self._local = []
        for i, layer in enumerate(layers):
            self._local.append(layer.self_attn)
            layer.self_attn = _RemoteSelfAttention(self, i)
        self._hook = model.register_forward_pre_hook(self._note_padding, with_kwargs=True)

    def _note_padding(self, module, args, kwargs):
        self._padding = kwargs.get("attention_mask")

    def _session_of(self, layer, batch, fresh):
        """The layer's sessions, one per sequence: new ones at a new generation (`fresh`)."""
        if fresh or layer not in self._sessions or len(self._sessions[layer]) != batch:
            for s in self._sessions.pop(layer, []):
                s.close()
            self._sessions[layer] = [self._client.session(self._names[layer], batch=1) for _ in range(batch)]
        return self._sessions[layer]

    def step(self, layer, hidden_states, position_ids, cache):
        """Layer `layer`'s attention for every sequence of the batch in one call: [B, T, E] in and out."""
        b, t, _ = hidden_states.shape
        if cache is None:
            raise ValueError("attnserve.transformers needs generate()'s cache (use_cache=True): it counts the "
                             "tokens each layer's sessions hold")
        fresh = cache.get_seq_length(layer) == 0
        sessions = self._session_of(layer, b, fresh)
        real = torch.ones(b, t, dtype=torch.bool)
        if self._padding is not None and self._padding.dim() == 2:
            real = self._padding[:, -t:].to("cpu").bool()
        positions = (position_ids if position_ids is not None
                     else torch.arange(t).unsqueeze(0) + cache.get_seq_length(layer)).to("cpu").expand(b, t)
        x = hidden_states.detach().to("cpu")
        steps, rows = [], []
        for i in range(b):
            idx = real[i].nonzero().flatten()
            if idx.numel() == 0:
                continue
            steps.append(Step(sessions[i], x[i:i + 1, idx].contiguous(), positions=positions[i, idx].reshape(1, -1)))
            rows.append((i, idx))
        out = torch.zeros_like(x)
        for (i, idx), r in zip(rows, self._client.step_many(steps) if steps else []):
            if r.error is not None:
                raise r.error
            out[i, idx] = r.output[0].to(out.dtype)
        # The cache counts each layer's tokens (generate() reads its length); one float a token.
        shadow = torch.zeros(b, 1, t, 1, dtype=hidden_states.dtype)
        cache.update(shadow, shadow, layer)
        return out.to(hidden_states.device)

    def close(self):
        self._hook.remove()
        for layer, attn in zip(self._model.model.layers, self._local):
            layer.self_attn = attn
        for sessions in self._sessions.values():
            for s in sessions:
                s.close()
        self._sessions.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _RemoteSelfAttention(torch.nn.Module):
    """A decoder layer's self_attn whose computation is the server's (RemoteAttention.step)."""

    def __init__(self, remote, layer):
        super().__init__()
        self._remote, self.layer_idx = remote, layer

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                position_ids=None, **kwargs):
        return self._remote.step(self.layer_idx, hidden_states, position_ids, past_key_values), None
