"""The API server's process never loads torch: `import banyan`, the server, the offline API's module and
the CLI's help load none, and the server reads the model's tokenizer and shape through banyan.checkpoint,
getting what the engine gets."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from banyan.runner.weights import open_model
from banyan.text.tokenizer import _tokenizer_class
from tests.unit.test_weights import CHAT_TEMPLATE, make_gguf, save_hf_model, train_byte_level_bpe

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(code: str) -> str:
    """Run `code` in a fresh interpreter; fails if it loaded torch. Returns its last line of output."""
    code += "\nimport sys; print('torch loaded' if 'torch' in sys.modules else 'no torch')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    *lines, verdict = out.stdout.strip().splitlines()
    assert verdict == "no torch"
    return lines[-1] if lines else ""


@pytest.mark.parametrize("module", ["banyan", "banyan.server", "banyan.server.app", "banyan.server.launch",
                                    "banyan.frontend.llm", "banyan.checkpoint", "banyan.cli"])  # fmt: skip
def test_import_loads_no_torch(module):
    run_fresh(f"import {module}")


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"]])
def test_cli_help_loads_no_torch(argv):
    run_fresh(f"from banyan.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass")


def summary(checkpoint) -> dict:
    """What the server needs from a model, as JSON (sent as source to a fresh process: no imports)."""
    import dataclasses
    import json

    tok = checkpoint.tokenizer
    return json.loads(json.dumps({
        "arch": dataclasses.asdict(checkpoint.arch), "generation_config": checkpoint.generation_config,
        "class": type(tok).__name__, "len": len(tok), "ids": tok.encode("Hello, world! 123 <|im_end|> naïve"),
        "eos": tok.eos_token_id, "template": tok.chat_template, "specials": sorted(tok.all_special_tokens),
    }))  # fmt: skip


def server_summary(model: str, tokenizer: str | None = None) -> dict:
    """summary() of the model as the server reads it: banyan.checkpoint, in a process without torch."""
    code = (f"import json\nfrom banyan.checkpoint import open_checkpoint\n{inspect.getsource(summary)}\n"
            f"print(json.dumps(summary(open_checkpoint({model!r}, tokenizer={tokenizer!r}))))")  # fmt: skip
    return json.loads(run_fresh(code))


def test_server_reads_what_the_engine_reads_from_an_hf_dir(tmp_path):
    save_hf_model(tmp_path, "qwen2")
    engine = summary(open_model(str(tmp_path)))
    assert server_summary(str(tmp_path)) == engine
    assert engine["class"] == type(AutoTokenizer.from_pretrained(str(tmp_path))).__name__


def test_server_reads_what_the_engine_reads_from_a_gguf(tmp_path):
    path, _ = make_gguf(tmp_path)
    assert server_summary(str(path)) == summary(open_model(str(path)))


def test_tokenizer_option_reaches_the_server(tmp_path):
    """--tokenizer: another directory's tokenizer and chat template, for the server as for the engine."""
    path, _ = make_gguf(tmp_path)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    write_tokenizer_dir(tok_dir, "GPT2Tokenizer", model_type=None)
    server = server_summary(str(path), tokenizer=str(tok_dir))
    assert server == summary(open_model(str(path), tokenizer=str(tok_dir)))
    assert server["class"] == "GPT2Tokenizer" and server["template"] == CHAT_TEMPLATE


def write_tokenizer_dir(path, tokenizer_class, model_type):
    train_byte_level_bpe().save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    if tokenizer_class is not None:
        config["tokenizer_class"] = tokenizer_class
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if model_type is not None:
        (path / "config.json").write_text(json.dumps({"model_type": model_type}))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", None])
@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "TokenizersBackend", "GPT2Tokenizer",
                                             "GPT2TokenizerFast", "Qwen2Tokenizer", "LlamaTokenizer", None])  # fmt: skip
def test_tokenizer_class_is_autotokenizers(tmp_path, model_type, tokenizer_class):
    """Where banyan.text.tokenizer names the class without AutoTokenizer (whose tables import torch), it is
    the class AutoTokenizer loads; elsewhere it leaves the choice to AutoTokenizer."""
    write_tokenizer_dir(tmp_path, tokenizer_class, model_type)
    name = _tokenizer_class(tmp_path)
    if model_type == "qwen2" or (model_type in ("llama", "qwen3", None) and tokenizer_class == "PreTrainedTokenizerFast"):
        assert name is not None  # the common checkpoints never need AutoTokenizer
        assert name == type(AutoTokenizer.from_pretrained(str(tmp_path))).__name__
