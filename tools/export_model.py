#!/usr/bin/python3
"""Exports a multi-head attention module into an attnserve model directory.

One command:
    tools/export_model.py SOURCE.pt --out models/NAME [--num-heads H] [--format safetensors|pt]

SOURCE.pt is torch.save(module) of an nn.MultiheadAttention, or torch.save(module.state_dict()) of
nn.MultiheadAttention or of the tutorial modules (seed 000/002: W_q/W_k/W_v/W_o; seed 003:
query.linear/key.linear/value.linear/output). num_heads cannot be read from a state_dict: pass
--num-heads. From Python, export(module, out_dir) does the same for any such module object.

The directory gets config.json and model.safetensors (default) or model.pt (torch.save of the
state_dict, read by the server's LibTorch pickle loader). Uses Debian's python3-torch only.

Decoder layers (docs/models.md "A layer of a decoder"): export_decoder(module, checkpoint_dir,
model_dirs) writes a transformers module (an attention module such as LlamaAttention,
MistralAttention, Qwen2Attention or Qwen3Attention, or a whole model) as a Hugging Face-style
checkpoint (config.json as save_pretrained writes it, model.safetensors with
model.layers.N.self_attn.* tensors), and for each {layer: model_dir} an attnserve model directory
serving that layer ({"checkpoint": ..., "layer": N}). Needs `transformers` (the LibTorch 2.x
environment has it: tools/torch2-env.sh).
"""
import argparse
import json
import os
import struct
import sys

import torch

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float64: "F64"}


def write_safetensors(path, tensors):
    """Writes {name: tensor} in the safetensors format (header length, JSON header, raw data)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be exported")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # Keeps the data section 8-byte aligned.
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def _num_heads_of(module):
    for attr in ("num_heads", "heads"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    return None


def export(source, out_dir, num_heads=None, add_zero_attn=None, fmt="safetensors"):
    """Writes out_dir/config.json and the weights of `source` (a module or a state_dict)."""
    if isinstance(source, torch.nn.Module):
        num_heads = num_heads or _num_heads_of(source)
        if add_zero_attn is None:
            add_zero_attn = bool(getattr(source, "add_zero_attn", False))
        state = source.state_dict()
    else:
        state = dict(source)
    if not num_heads:
        raise ValueError("num_heads is unknown: pass --num-heads")
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    os.makedirs(out_dir, exist_ok=True)
    weights = "model.safetensors" if fmt == "safetensors" else "model.pt"
    if fmt == "safetensors":
        write_safetensors(os.path.join(out_dir, weights), state)
    elif fmt == "pt":
        torch.save({k: v.detach().cpu().contiguous() for k, v in state.items()},
                   os.path.join(out_dir, weights))
    else:
        raise ValueError(f"format {fmt}: expected safetensors or pt")
    config = {"num_heads": int(num_heads), "weights": weights,
              "add_zero_attn": bool(add_zero_attn)}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return config


def _attention_layers(module):
    """{layer index: attention module} of a transformers attention module or whole model."""
    if hasattr(module, "q_proj") and hasattr(module, "layer_idx"):
        return {int(module.layer_idx): module}
    layers = None
    for path in ("model.layers", "layers", "model.model.layers"):
        obj = module
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            layers = obj
            break
    if layers is None:
        raise ValueError(f"{type(module).__name__}: neither an attention module nor a model with layers")
    return {i: layer.self_attn for i, layer in enumerate(layers)}


def export_decoder(module, checkpoint_dir, model_dirs=None):
    """Writes `module`'s attention as a checkpoint directory, plus attnserve model directories."""
    layers = {i: attn.state_dict() for i, attn in _attention_layers(module).items()}
    # config.json as save_pretrained writes it for real checkpoints: the family's defaults left out.
    return export_decoder_weights(module.config.save_pretrained, layers, checkpoint_dir, model_dirs)


def export_decoder_weights(config, layers, checkpoint_dir, model_dirs=None):
    """The same from plain data, without transformers: `config` a dict for config.json (or a function
    writing it into a directory), `layers` {layer: {"q_proj.weight": tensor, ...}}."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    tensors = {f"model.layers.{i}.self_attn.{name}": t for i, state in layers.items() for name, t in state.items()}
    write_safetensors(os.path.join(checkpoint_dir, "model.safetensors"), tensors)
    if callable(config):
        config(checkpoint_dir)
    else:
        with open(os.path.join(checkpoint_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
    for layer, model_dir in (model_dirs or {}).items():
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({"checkpoint": os.path.relpath(checkpoint_dir, model_dir), "layer": int(layer)}, f)
            f.write("\n")
    return sorted(tensors)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="torch.save()'d nn.MultiheadAttention or state_dict (.pt)")
    p.add_argument("--out", required=True, help="model directory to write (its name is the model's)")
    p.add_argument("--num-heads", type=int, help="heads (required for a state_dict)")
    p.add_argument("--add-zero-attn", action="store_true", default=None,
                   help="the module was built with add_zero_attn=True (state_dict sources)")
    p.add_argument("--format", choices=["safetensors", "pt"], default="safetensors")
    a = p.parse_args(argv)
    source = torch.load(a.source, map_location="cpu")
    config = export(source, a.out, a.num_heads, a.add_zero_attn, a.format)
    print(f"exported {a.source} to {a.out}: {config}")


if __name__ == "__main__":
    main(sys.argv[1:])
