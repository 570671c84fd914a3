"""Perplexity of a model on a fixed text, through the engine's prompt logprobs: the accuracy check
for a quantized model against its full-precision self (lower is better; equal weights, equal value)."""

from __future__ import annotations

import math

from banyan.sampling_params import SamplingParams


def perplexity(llm, text: str) -> tuple[float, int]:
    """(exp of the mean negative log-likelihood of each token given the ones before, tokens scored)."""
    out = llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    logprobs = [position[token].logprob for position, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)
