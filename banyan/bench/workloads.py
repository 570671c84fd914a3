"""Workloads: lists of prompts (token ids) and how many tokens each should generate.

    random         independent random prompts of a fixed length (or a [min, max] range)
    shared-prefix  groups of requests that share one long random "system prompt"; SGLang's
                   generated-shared-prefix: [ system prompt (shared by the group) | question ]
Token ids are drawn from [0, vocab_size); with ignore_eos the output lengths are exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchPrompt:
    prompt_token_ids: list[int]
    output_len: int


def random_prompts(num_prompts: int, input_len: int, output_len: int, vocab_size: int, *,
                   range_ratio: float = 0.0, seed: int = 0) -> list[BenchPrompt]:
    """Lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]; 0 keeps them fixed."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        n_in, n_out = _length(rng, input_len, range_ratio), _length(rng, output_len, range_ratio)
        prompts.append(BenchPrompt(_tokens(rng, n_in, vocab_size), n_out))
    return prompts


def shared_prefix_prompts(num_groups: int, prompts_per_group: int, system_len: int, question_len: int,
                          output_len: int, vocab_size: int, *, seed: int = 0) -> list[BenchPrompt]:
    """num_groups * prompts_per_group prompts, interleaved across groups as requests would arrive."""
    rng = random.Random(seed)
    systems = [_tokens(rng, system_len, vocab_size) for _ in range(num_groups)]
    return [
        BenchPrompt(systems[g] + _tokens(rng, question_len, vocab_size), output_len)
        for _ in range(prompts_per_group)
        for g in range(num_groups)
    ]


def make_workload(name: str, args, vocab_size: int) -> list[BenchPrompt]:
    """The workload a `banyan bench` command line asks for."""
    if name == "random":
        return random_prompts(args.num_prompts, args.input_len, args.output_len, vocab_size,
                              range_ratio=args.range_ratio, seed=args.workload_seed)
    if name == "shared-prefix":
        groups = max(1, args.num_prompts // args.prompts_per_group)
        return shared_prefix_prompts(groups, args.prompts_per_group, args.system_prompt_len, args.input_len,
                                     args.output_len, vocab_size, seed=args.workload_seed)
    raise ValueError(f"unknown workload {name!r} (random, shared-prefix)")


def _length(rng: random.Random, length: int, range_ratio: float) -> int:
    if range_ratio <= 0:
        return length
    return max(1, rng.randint(int(length * (1 - range_ratio)), int(length * (1 + range_ratio))))


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(count)]
