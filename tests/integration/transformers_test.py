"""transformers as a real client (attnserve.transformers): a small random-weight Hugging Face decoder
(Llama, Mistral with a sliding window, Qwen2, Qwen3) whose every layer's attention runs on a real
attnserve server, one batched step (AttendRequest.steps) per layer per forward for the whole batch,
generates the same tokens with model.generate() as the same model locally: greedy over one prompt,
greedy over a batch of prompts of different lengths (left padding), and sampling with a fixed seed.
The server counts the batched calls: one per layer per forward.

Float32 (the server's answers equal the module's to float32 rounding: decoder_conformance); weights
drawn with a wide initializer so that the next token's logits are seldom within rounding of each
other (a tie broken differently would change a token without anything being wrong).

usage: (tools/torch2-env.sh's python) -m pytest transformers_test.py --attnserve PATH/TO/attnserve
"""
import os

import pytest
import torch

import attnserve_py as lib  # tests/lib, on the path by tests/conftest.py

FAMILIES = {
    "llama": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=2, sliding_window=5),
    "qwen2": dict(num_key_value_heads=2),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
}


def build(family, seed):
    import transformers
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    config = config_class(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                          vocab_size=97, max_position_embeddings=256, initializer_range=0.3, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **FAMILIES[family])
    torch.manual_seed(seed)
    model_class = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                   "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
    model = model_class(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # always max_new_tokens: nothing stops early
    return model


@pytest.fixture(scope="module")
def setup(attnserve, tmp_path_factory):
    attnserve_pkg = lib.load_package()
    import attnserve.transformers as at
    root = str(tmp_path_factory.mktemp("transformers"))
    models, names = {}, {}
    for i, family in enumerate(FAMILIES):
        model = build(family, 100 + i)
        model.save_pretrained(os.path.join(root, "checkpoints", family))
        names[family] = at.model_repository(os.path.join(root, "checkpoints", family), os.path.join(root, "models"),
                                            model.config.num_hidden_layers, prefix=f"{family}_l")
        models[family] = model
    server = lib.Server(attnserve, "--models", os.path.join(root, "models"))
    client = attnserve_pkg.Client(server.target)
    yield attnserve_pkg, at, server, client, models, names
    client.close()
    server.stop()


def batched_calls(server):
    """Batched steps the server answered: attnserve_requests_total of Attend counts every call; the
    batched ones are told apart by the test's own count of calls it made."""
    total = 0.0
    for line in lib.metrics_lines(server, "attnserve_requests_total"):
        if 'method="Attend"' in line:
            total += float(line.split()[-1])
    return total


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_gives_the_same_tokens_through_the_server(setup, family, checks):
    attnserve, at, server, client, models, names = setup
    model = models[family]
    gen = torch.Generator().manual_seed(7)
    one = torch.randint(3, 97, (1, 6), generator=gen)
    # Three prompts of 7, 4 and 2 tokens, left-padded to 7.
    lengths = [7, 4, 2]
    batch = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for r, n in enumerate(lengths):
        batch[r, 7 - n:] = torch.randint(3, 97, (n,), generator=gen)
        mask[r, 7 - n:] = 1
    runs = {
        "greedy, one prompt": dict(input_ids=one, attention_mask=torch.ones_like(one), do_sample=False),
        "greedy, three prompts left-padded": dict(input_ids=batch, attention_mask=mask, do_sample=False),
        "sampling, seed 11": dict(input_ids=batch, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                  temperature=1.0, seed=11),
    }
    for name, kw in runs.items():
        kw = dict(kw)
        seed = kw.pop("seed", None)
        new = 12
        with torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            local = model.generate(**kw, max_new_tokens=new)
            before = batched_calls(server)
            with at.RemoteAttention(model, client, names[family]):
                if seed is not None:
                    torch.manual_seed(seed)
                remote = model.generate(**kw, max_new_tokens=new)
            calls = batched_calls(server) - before
        layers = model.config.num_hidden_layers
        checks(f"{family}, {name}: the same tokens through the server", torch.equal(local, remote),
               f"\nlocal  {local.tolist()}\nremote {remote.tolist()}")
        checks(f"{family}, {name}: one batched call per layer per forward ({new} forwards x {layers} layers)",
               calls == new * layers, f"{calls} Attend calls")
        # The model has its own attention back.
        with torch.no_grad():
            again = model.generate(**kw, max_new_tokens=2) if seed is None else local
        checks(f"{family}, {name}: the local attention is back after the `with`",
               torch.equal(again[:, :kw["input_ids"].shape[1] + 2], local[:, :kw["input_ids"].shape[1] + 2]))
