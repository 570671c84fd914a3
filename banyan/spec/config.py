"""SpeculativeConfig: speculative decoding's settings, with vLLM's names so `--speculative-config` JSON ports.

    SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5,
                                 "prompt_lookup_min": 2, "prompt_lookup_max": 5})

Every check raises InvalidParameterError naming the field at fault, at start-up, never mid-step.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from typing import Any

from banyan.errors import InvalidParameterError
from banyan.registry import UnknownChoiceError

METHODS = ("ngram", "suffix", "draft_model", "layer_skip")
POLICIES = ("adaptive", "fixed", "table")
MAX_SPECULATIVE_TOKENS = 16
PROMPT_LOOKUP_DEFAULTS = (1, 5)
"""(prompt_lookup_min, prompt_lookup_max) when neither is given. 1, not 2: the adaptive controller learns one-token
matches' acceptance apart from longer ones' (evidence buckets), so they draft where they pass and cost nothing where
they do not. On the default model (Zen 4, 1 thread) ngram-adaptive with 1 against 2 measured 1.87x against 1.56x of
off at batch-1 copy, 1.28x against 1.19x tokens per CPU-second (E2E 0.78x against 0.85x) on the mixed workload with
arrivals, and 0.99x against 1.00x on 16 random streams (benchmarks/README.md)."""
_LOOKUP_METHODS = ("ngram",)
DEFAULT_SPECULATIVE_TOKENS = 5
ADAPTIVE_MODEL_FREE_MAX_K = 8
"""num_speculative_tokens when not given: ngram and suffix under the adaptive policy may draft up to 8 (the controller
picks each step's k from measured acceptance and step time, and their drafts cost no forward), everything else 5 (a
fixed k drafts that many whether they pay or not; a draft model pays a forward a draft). Batch-1 code edits on the
default model (2-vCPU Zen 4, `banyan bench speculative --rounds 3`, runs minutes apart): cap 5 ngram-adaptive
1.62-1.78x of off over three runs, cap 7 1.81-1.89x, cap 8 1.82x; suffix-adaptive 1.62-1.78x, 1.81-1.90x, 1.93x
(benchmarks/README.md): a verify of 8 tokens costs about what one of 6 does there (pairs of row groups)."""
SUFFIX_OPTIONS = {"max_tree_depth": "max_depth", "max_cached_requests": "max_cached_requests",
                  "max_spec_factor": "max_spec_factor", "min_token_prob": "min_token_prob"}
"""vLLM's suffix_decoding_<field> settings -> SuffixProposer's arguments."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """How drafts are made: ngram (prompt lookup), suffix (suffix tree over this and recent requests), draft_model
    (a smaller model with the same tokenizer) or layer_skip (the target's first num_layers layers)."""
    num_speculative_tokens: int | None = None
    """Most draft tokens per request per step (the controller's max_k). Default: 8 for ngram and suffix under the
    adaptive policy, else 5 (ADAPTIVE_MODEL_FREE_MAX_K)."""
    prompt_lookup_min: int | None = None
    """ngram: shortest suffix of the text looked up earlier in it (default: prompt_lookup_max, else 1)."""
    prompt_lookup_max: int | None = None
    """ngram: longest suffix looked up (default: prompt_lookup_min, else 5)."""
    suffix_decoding_max_tree_depth: int | None = None
    """suffix: the longest path its tries hold, matched text and drafts together (default 24)."""
    suffix_decoding_max_cached_requests: int | None = None
    """suffix: finished requests whose outputs the shared trie keeps (default 1000, within a million nodes; 0: none,
    each request drafts from its own text alone)."""
    suffix_decoding_max_spec_factor: float | None = None
    """suffix: at most this many drafts per token of the matched text (default 1.0)."""
    suffix_decoding_min_token_prob: float | None = None
    """suffix: drafting stops where the path's estimated probability falls below this (default 0.1)."""
    model: str | None = None
    """draft_model: the draft's Hugging Face directory or .gguf file (its tokenizer must be the target's)."""
    quantization: str | None = None
    """draft_model: how the draft's weights load (--quantization's choices, e.g. int4, or gguf to keep a GGUF
    file's own; default: the target's). A compact draft of the target's own checkpoint drafts for it in full
    precision: the same model, a fraction of the bytes a token."""
    num_layers: int | None = None
    """layer_skip: how many of the target's first layers draft (default: chosen when the model is loaded)."""
    policy: str | None = None
    """How many drafts each step verifies: adaptive (per request, from measured acceptance and step time), fixed
    (always num_speculative_tokens where the proposer has any) or table (num_speculative_tokens_per_batch_size).
    Default: table when a table is given, else adaptive."""
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    """vLLM's dynamic table: [[start_bs, end_bs, k], ...], k drafts while the step's batch size (requests in the
    step) is in [start_bs, end_bs]; a batch size in no range drafts nothing. Ranges must not overlap."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise UnknownChoiceError("method", self.method, METHODS)
        self._resolve_policy()
        if self.num_speculative_tokens is None:
            model_free = self.method in ("ngram", "suffix") and self.policy == "adaptive"
            self._set("num_speculative_tokens", ADAPTIVE_MODEL_FREE_MAX_K if model_free else DEFAULT_SPECULATIVE_TOKENS)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        self._resolve_prompt_lookup()
        self._check_method_fields()
        table = self.num_speculative_tokens_per_batch_size
        if table is not None:
            self._set("num_speculative_tokens_per_batch_size", _check_table(table, self.num_speculative_tokens))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """Build from `--speculative-config`'s parsed JSON; a key that is not a field is an error naming it."""
        if not isinstance(data, dict):
            raise InvalidParameterError("speculative_config", f"must be a JSON object, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise InvalidParameterError(unknown[0], f"unknown speculative_config key(s) {', '.join(unknown)}; "
                                                    f"known: {', '.join(sorted(fields))}")
        if "method" not in data:
            raise InvalidParameterError("method", f"is required; choose from {', '.join(METHODS)}")
        return cls(**data)

    def proposer_options(self) -> dict[str, Any]:
        """The keyword arguments of this method's proposer (banyan.spec.make_proposer): the fields set for it."""
        if self.method == "ngram":
            return {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        if self.method != "suffix":
            return {}
        options = {option: getattr(self, f"suffix_decoding_{field}") for field, option in SUFFIX_OPTIONS.items()}
        return {option: value for option, value in options.items() if value is not None}

    def draft_settings(self, model):
        """A draft model's settings: the target's (a ModelConfig), with this config's quantization where it has one."""
        return model if self.quantization is None else dataclasses.replace(model, quantization=self.quantization)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Build from the text of `--speculative-config '<json>'`."""
        return cls.from_dict(json_object("speculative_config", text))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # a resolved default, set once while the frozen instance is built

    def _resolve_prompt_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                if self.method not in _LOOKUP_METHODS:
                    raise InvalidParameterError(name, f"applies to method ngram only, not {self.method!r}")
                _check_int(name, value, 1, None)
        if self.method not in _LOOKUP_METHODS:
            return
        if lo is None and hi is None:
            lo, hi = PROMPT_LOOKUP_DEFAULTS
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise InvalidParameterError("prompt_lookup_min", f"must be <= prompt_lookup_max ({hi}), got {lo}")
        self._set("prompt_lookup_min", lo)
        self._set("prompt_lookup_max", hi)

    def _check_suffix_fields(self) -> None:
        for field in SUFFIX_OPTIONS:
            name = f"suffix_decoding_{field}"
            value = getattr(self, name)
            if value is None:
                continue
            if self.method != "suffix":
                raise InvalidParameterError(name, f"applies to method suffix only, not {self.method!r}")
            if field == "max_tree_depth":
                _check_int(name, value, 2, 1024)
            elif field == "max_cached_requests":
                _check_int(name, value, 0, None)
            elif not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InvalidParameterError(name, f"must be a number, got {value!r}")
            elif field == "max_spec_factor" and not value > 0:
                raise InvalidParameterError(name, f"must be > 0, got {value}")
            elif field == "min_token_prob" and not 0 <= value <= 1:
                raise InvalidParameterError(name, f"must be in [0, 1], got {value}")

    def _check_method_fields(self) -> None:
        self._check_suffix_fields()
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise InvalidParameterError("model", "method draft_model needs the draft model's path")
        else:
            for name in ("model", "quantization"):
                if getattr(self, name) is not None:
                    raise InvalidParameterError(name, f"applies to method draft_model only, not {self.method!r}")
        if self.num_layers is not None:
            if self.method != "layer_skip":
                raise InvalidParameterError("num_layers", f"applies to method layer_skip only, not {self.method!r}")
            _check_int("num_layers", self.num_layers, 1, None)

    def _resolve_policy(self) -> None:
        has_table = self.num_speculative_tokens_per_batch_size is not None
        policy = self.policy if self.policy is not None else ("table" if has_table else "adaptive")
        if policy not in POLICIES:
            raise UnknownChoiceError("policy", policy, POLICIES)
        if (policy == "table") != has_table:
            raise InvalidParameterError(
                "num_speculative_tokens_per_batch_size",
                "is required by policy table" if not has_table else f"is only read by policy table, not {policy!r}")
        self._set("policy", policy)


def json_object(name: str, text: str) -> dict[str, Any]:
    """The JSON object `text` holds, for the setting `name` (an InvalidParameterError naming it otherwise)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidParameterError(name, f"is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise InvalidParameterError(name, f"must be a JSON object, got {type(value).__name__}")
    return value


def _check_int(name: str, value: Any, lo: int, hi: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise InvalidParameterError(name, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}")


def _check_table(table: Any, max_k: int) -> tuple[tuple[int, int, int], ...]:
    """[[start_bs, end_bs, k], ...] as a tuple sorted by start_bs: 1 <= start <= end, 0 <= k <= max_k, no overlap."""
    name = "num_speculative_tokens_per_batch_size"
    if not isinstance(table, (list, tuple)) or not table:
        raise InvalidParameterError(name, "must be a non-empty list of [start_bs, end_bs, k]")
    rows = []
    for row in table:
        if not isinstance(row, (list, tuple)) or len(row) != 3:
            raise InvalidParameterError(name, f"each entry must be [start_bs, end_bs, k], got {row!r}")
        start, end, k = row
        for value in row:
            _check_int(name, value, 0, None)
        if not 1 <= start <= end:
            raise InvalidParameterError(name, f"needs 1 <= start_bs <= end_bs, got {list(row)}")
        if k > max_k:
            raise InvalidParameterError(name, f"k must be <= num_speculative_tokens ({max_k}), got {list(row)}")
        rows.append((start, end, k))
    rows.sort()
    for (_, end, _), (start, _, _) in itertools.pairwise(rows):
        if start <= end:
            raise InvalidParameterError(name, f"ranges overlap at batch size {start}")
    return tuple(rows)
