"""SamplingParams: how one request samples, with vLLM's names and OpenAI's ranges.

Validation happens at construction and raises InvalidParameterError naming the field, so a bad
value never reaches the engine loop. Checks against the model (vocabulary, context length) happen in
`verify_for_model`, which the engine calls when a request arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from banyan.errors import InvalidParameterError
from banyan.structured.spec import StructuredOutputError, StructuredOutputSpec

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (0): they sample the argmax anyway, and logits / t overflows float32 (a
subnormal one such as 2.2e-313 is 0 there: the long fuzz tier's one 500)."""


@dataclass
class SamplingParams:
    n: int = 1
    """Completions to return for the prompt."""
    best_of: int | None = None
    """Completions to generate, of which the n with the highest cumulative log-probability are returned
    (OpenAI's legacy best_of; None: n). Every generated token counts in usage."""
    temperature: float = 1.0
    """0 means greedy (and so does anything below GREEDY_BELOW)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) means all tokens."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    """Per-request seed: the request's random draws come from its own generator, whatever else is in the batch.
    Its output (and a greedy one) is the same alone and in any batch only where the logits are too: with
    `batch_invariant` (ModelConfig; CPU, on by default on AVX2-only ones). Otherwise the batch picks the kernels
    and their rounding, and a
    completion may part from its solo one after some tokens (docs/quantization.md, "Batch invariance")."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """None means up to the model's context length."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Top log-probabilities to return per output token (plus the chosen one)."""
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    """With prompt_logprobs: the first prompt position whose log-probability is wanted (SGLang's
    logprob_start_len). Earlier positions report None and may come from the prefix cache; the default 0
    computes every position, so such a request skips the cache (cached positions have no logits)."""
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputSpec | None = None
    """What the output must match (vLLM's shape): a StructuredOutputSpec, or a dict with one of json,
    json_object, regex, choice, grammar (converted at construction)."""

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            self.logit_bias = {_int_key(k): v for k, v in self.logit_bias.items()}
        self.structured_outputs = _structured_spec(self.structured_outputs)
        self._validate()
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1, MAX_N)
            if self.best_of < self.n:
                raise InvalidParameterError("best_of", f"must be >= n ({self.n}), got {self.best_of}")
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, INT64_MAX)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, INT64_MAX)
        _check_int("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)
        _check_int("prompt_logprobs_start", self.prompt_logprobs_start, 0, INT64_MAX)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParameterError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise InvalidParameterError(
                    "stop", f"each stop string must be a non-empty string of at most {MAX_STOP_STRING_LEN} chars"
                )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, INT64_MAX)
        for token_id, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", token_id, 0, INT64_MAX)
            _check_float("logit_bias", bias, -100.0, 100.0)

    def verify_for_model(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary (not the tokenizer's)."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidParameterError("stop_token_ids", f"token id {t} is outside the vocabulary (size {vocab_size})")
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise InvalidParameterError("logit_bias", f"token id {t} is outside the vocabulary (size {vocab_size})")

    @property
    def num_sequences(self) -> int:
        """Sequences sampled per prompt: best_of when set, else n."""
        return self.best_of or self.n

    def sequence_params(self, index: int) -> SamplingParams:
        """The parameters of the engine request sampling sequence `index` of the prompt's num_sequences:
        a seeded request gives each its own stream (seed + index, wrapped to 64 bits, as vLLM does), and
        best_of candidates compute the log-probability they are ranked by."""
        if self.num_sequences == 1:
            return self
        changes: dict = {"n": 1, "best_of": None}
        if self.seed is not None:
            changes["seed"] = (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN
        if self.num_sequences > self.n and self.logprobs is None:
            changes["logprobs"] = 0
        return self.clone(**changes)

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalties: sampling that depends on the tokens so far."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self, **changes) -> SamplingParams:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _structured_spec(value) -> StructuredOutputSpec | None:
    if value is None or isinstance(value, StructuredOutputSpec):
        return value
    try:
        return StructuredOutputSpec.from_dict(value)
    except StructuredOutputError as e:
        raise e.with_param("structured_outputs") from None


def _int_key(key) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise InvalidParameterError("logit_bias", f"keys must be token ids (integers), got {key!r}") from None


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidParameterError(name, f"must be in [{low}, {high}], got {value}")


def _check_float(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidParameterError(name, f"must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidParameterError(name, f"must be in {bracket}{low}, {high}], got {value}")
