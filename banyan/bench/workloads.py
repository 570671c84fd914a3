"""Workloads: lists of prompts (token ids) and how many tokens each should generate.

    random         independent random prompts of a fixed length (or a [min, max] range)
    shared-prefix  groups of requests that share one long random "system prompt"; SGLang's
                   generated-shared-prefix: [ system prompt (shared by the group) | question ]
    sharegpt       the first exchange of each conversation in a ShareGPT-format JSON file the user
                   supplies (nothing is downloaded): the human turn is the prompt, the reply's
                   length the output length
    multi-turn     conversations whose turns resend the growing history (see multi_turn_prompts)
    json-schema    the random workload's prompts, each output constrained to RECORDS (a JSON schema)
Random token ids are drawn from [0, vocab_size); with ignore_eos the output lengths are exact.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from banyan.errors import InvalidParameterError

WORKLOADS = ("random", "shared-prefix", "sharegpt", "multi-turn", "json-schema")
SPEC_WORKLOADS = ("copy", "code-edit", "random", "mixed")
"""`banyan bench speculative`'s: copy is speculative.copy_prompts (rewrite a given text), code-edit
code_edits.code_edit_prompts (change a given module, reply with all of it), mixed half copy and half random."""


@dataclass(frozen=True)
class BenchPrompt:
    prompt_token_ids: list[int]
    output_len: int
    conversation: int | None = None
    """Multi-turn: the conversation this turn belongs to; its turns run one after the other."""
    turn: int = 0
    structured_outputs: dict | None = None
    """vLLM's structured_outputs (json-schema); None: unconstrained."""
    temperature: float | None = None
    """This prompt's sampling temperature; None: the run's."""
    ignore_eos: bool = True
    """False: the request may stop at the end of the model's answer, output_len being its cap."""


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


RECORDS = {  # keys, enums, bounded numbers and strings: what response formats usually look like
    "type": "array",
    "minItems": 100,  # at least ~1,500 tokens: every request runs to its output length
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "maxLength": 24},
            "status": {"enum": ["active", "inactive", "pending"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["id", "name", "status", "score", "tags"],
        "additionalProperties": False,
    },
}


def json_schema_prompts(num_prompts: int, input_len: int, output_len: int, vocab_size: int, *,
                        range_ratio: float = 0.0, seed: int = 0) -> list[BenchPrompt]:
    """The random workload's prompts (the same ones, for the same seed), each constrained to RECORDS:
    compared with `random`, the difference is the cost of structured output."""
    prompts = random_prompts(num_prompts, input_len, output_len, vocab_size, range_ratio=range_ratio, seed=seed)
    return [dataclasses.replace(p, structured_outputs={"json": RECORDS}) for p in prompts]


def multi_turn_prompts(num_conversations: int, num_turns: int, system_len: int, user_len: int, output_len: int,
                       vocab_size: int, *, seed: int = 0) -> list[BenchPrompt]:
    """Every turn resends the conversation so far; one system prompt (none if 0) is shared by all.

        turn 0:  [ system | u0 ]
        turn 1:  [ system | u0 | r0 | u1 ]
        turn 2:  [ system | u0 | r0 | u1 | r1 | u2 ]
    u_k are random user turns of user_len tokens; r_k are scripted replies of output_len tokens,
    drawn in advance so that every engine is sent the same prompts whatever it generated. Turn-major
    order: all first turns, then all second turns, ...
    """
    rng = random.Random(seed)
    system = _tokens(rng, system_len, vocab_size)
    histories = [list(system) for _ in range(num_conversations)]
    prompts = []
    for turn in range(num_turns):
        for conv, history in enumerate(histories):
            if turn:
                history += _tokens(rng, output_len, vocab_size)  # the previous turn's reply
            history += _tokens(rng, user_len, vocab_size)
            prompts.append(BenchPrompt(list(history), output_len, conversation=conv, turn=turn))
    return prompts


def sharegpt_prompts(path: str | Path, num_prompts: int, encode: Callable[[str], list[int]], *, seed: int = 0,
                     output_len: int | None = None, max_prompt_len: int = 1024,
                     max_total_len: int = 2048) -> list[BenchPrompt]:
    """num_prompts first exchanges, shuffled by seed; the filters are vLLM's (too short, too long).

    The file is ShareGPT's: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}].
    output_len, when given, replaces the reply's token count (and its minimum).
    """
    pairs = _sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    prompts = []
    for question, answer in pairs:
        if len(prompts) == num_prompts:
            break
        ids = encode(question)
        n_out = output_len or len(encode(answer))
        too_short = len(ids) < 4 or (output_len is None and n_out < 4)
        if too_short or len(ids) > max_prompt_len or len(ids) + n_out > max_total_len:
            continue
        prompts.append(BenchPrompt(ids, n_out))
    if not prompts:
        raise InvalidParameterError("sharegpt_path", f"{path}: no conversation fits the length filters")
    return prompts


def make_workload(name: str, args, vocab_size: int,
                  encode: Callable[[str], list[int]] | None = None) -> list[BenchPrompt]:
    """The workload a `banyan bench` command line asks for (sharegpt needs `encode`: text -> token ids)."""
    if name in ("random", "json-schema"):
        make = random_prompts if name == "random" else json_schema_prompts
        return make(args.num_prompts, args.input_len, args.output_len, vocab_size, range_ratio=args.range_ratio,
                    seed=args.workload_seed)
    if name == "shared-prefix":
        groups = max(1, args.num_prompts // args.prompts_per_group)
        return shared_prefix_prompts(groups, args.prompts_per_group, args.system_prompt_len, args.input_len,
                                     args.output_len, vocab_size, seed=args.workload_seed)
    if name == "multi-turn":
        conversations = max(1, args.num_prompts // args.num_turns)
        return multi_turn_prompts(conversations, args.num_turns, args.system_prompt_len, args.input_len,
                                  args.output_len, vocab_size, seed=args.workload_seed)
    if name == "sharegpt":
        if not args.sharegpt_path or encode is None:
            raise InvalidParameterError("sharegpt_path", "the sharegpt workload needs --sharegpt-path FILE and a tokenizer")
        return sharegpt_prompts(args.sharegpt_path, args.num_prompts, encode, seed=args.workload_seed,
                                output_len=args.sharegpt_output_len)
    raise ValueError(f"unknown workload {name!r} ({', '.join(WORKLOADS)})")


def turns(prompts: list[BenchPrompt]) -> list[list[BenchPrompt]]:
    """Prompts grouped by turn, first turns first: each group may run at once, after the one before."""
    by_turn: dict[int, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_turn.setdefault(prompt.turn, []).append(prompt)
    return [by_turn[t] for t in sorted(by_turn)]


def conversations(prompts: list[BenchPrompt]) -> list[list[BenchPrompt]]:
    """Chains of prompts that must run in order: a conversation's turns, or a lone prompt."""
    chains: dict[object, list[BenchPrompt]] = {}
    for i, prompt in enumerate(prompts):
        key = ("c", prompt.conversation) if prompt.conversation is not None else ("p", i)
        chains.setdefault(key, []).append(prompt)
    return [sorted(chain, key=lambda p: p.turn) for chain in chains.values()]


def _sharegpt_pairs(path: str | Path) -> list[tuple[str, str]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidParameterError("sharegpt_path", f"cannot read {path}: {e}") from None
    if not isinstance(data, list):
        raise InvalidParameterError("sharegpt_path", f"{path}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        messages = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(messages, list) and len(messages) >= 2 and all(isinstance(m, dict) for m in messages[:2]):
            question, answer = messages[0].get("value"), messages[1].get("value")
            if isinstance(question, str) and isinstance(answer, str):
                pairs.append((question, answer))
    return pairs


def _length(rng: random.Random, length: int, range_ratio: float) -> int:
    if range_ratio <= 0:
        return length
    return max(1, rng.randint(int(length * (1 - range_ratio)), int(length * (1 + range_ratio))))


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(count)]
