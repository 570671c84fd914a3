"""How a checkpoint pools hidden states into an embedding, read from its files (no torch).

    modules.json                 sentence-transformers' pipeline: which folder holds the Pooling module
    1_Pooling/config.json        its mode: pooling_mode_lasttoken -> last, pooling_mode_mean_tokens -> mean
    config.json                  is_matryoshka / matryoshka_dimensions: may the embedding be truncated

A directory without them (and every GGUF file) pools the last token, vLLM's default for decoder models, and
allows no truncation. `--pooling` overrides the mode.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from banyan.errors import InvalidParameterError
from banyan.pooling_params import POOLING_TYPES

logger = logging.getLogger(__name__)

DEFAULT_POOLING = "last"
_ST_MODES = {  # sentence-transformers' pooling flags -> banyan's name (None: not implemented)
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": None,
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


@dataclass(frozen=True)
class ModelPooling:
    pooling_type: str | None
    """last or mean; None: the model's own mode is one banyan does not implement (`unsupported` names it)."""
    source: str
    """Where the mode came from, for messages: --pooling, a sentence-transformers config, or the default."""
    matryoshka: bool = False
    """The model was trained so that a prefix of its embedding is an embedding (truncation allowed)."""
    matryoshka_dimensions: tuple[int, ...] = ()
    """The prefix lengths it was trained for, when the config lists them (then only these)."""
    unsupported: str | None = None

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """InvalidParameterError (param "dimensions") unless the embedding may be cut to `dimensions`."""
        if dimensions is None or dimensions == hidden_size and not self.matryoshka_dimensions:
            return
        if not self.matryoshka:
            raise InvalidParameterError("dimensions", "this model does not support Matryoshka embeddings (its config "
                                                      "has no is_matryoshka or matryoshka_dimensions); leave it unset")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            allowed = ", ".join(map(str, self.matryoshka_dimensions))
            raise InvalidParameterError("dimensions", f"must be one of {allowed}, got {dimensions}")
        if not 1 <= dimensions <= hidden_size:
            raise InvalidParameterError("dimensions", f"must be in [1, {hidden_size}], got {dimensions}")

    def require_type(self) -> str:
        """The pooling type, or InvalidParameterError when the model's own is not implemented."""
        if self.pooling_type is None:
            raise InvalidParameterError("pooling", f"the model's {self.source} asks for {self.unsupported}, which "
                                                   f"banyan does not implement; start it with --pooling "
                                                   f"{' or '.join(POOLING_TYPES)}")
        return self.pooling_type


def model_pooling(path: Path, override: str | None = None) -> ModelPooling:
    """How the checkpoint at `path` (a directory or a GGUF file) pools; `override`: the --pooling setting."""
    if override is not None and override not in POOLING_TYPES:
        raise InvalidParameterError("pooling", f"must be one of {', '.join(POOLING_TYPES)}, got {override!r}")
    if path.is_file():
        return ModelPooling(override or DEFAULT_POOLING, "--pooling" if override else "default")
    config = _read(path / "config.json")
    dims = config.get("matryoshka_dimensions")
    dims = tuple(d for d in dims if type(d) is int and d > 0) if isinstance(dims, list) else ()
    matryoshka = bool(config.get("is_matryoshka")) or bool(dims)
    if override is not None:
        return ModelPooling(override, "--pooling", matryoshka, dims)
    mode = _sentence_transformers_mode(path)
    if mode is None:
        return ModelPooling(DEFAULT_POOLING, "default", matryoshka, dims)
    source = "sentence-transformers pooling config"
    if _ST_MODES[mode] is None:
        return ModelPooling(None, source, matryoshka, dims, unsupported=mode)
    return ModelPooling(_ST_MODES[mode], source, matryoshka, dims)


def _sentence_transformers_mode(path: Path) -> str | None:
    """The first pooling flag set in the Pooling module's config (modules.json names its folder), or None."""
    modules = _read(path / "modules.json", default=[])
    folders = [m.get("path") for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")]
    if not folders or not isinstance(folders[0], str):
        return None
    config = _read(path / folders[0] / "config.json")
    return next((mode for mode in _ST_MODES if config.get(mode) is True), None)


def _read(path: Path, default=None):
    """A JSON file's content; `default` ({} unless given) when it is absent or unreadable (logged)."""
    default = {} if default is None else default
    if not path.is_file():
        return default
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        logger.warning("%s: ignored, not readable JSON (%s)", path, e)
        return default
    return data if isinstance(data, type(default)) else default
