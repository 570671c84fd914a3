"""Log-probabilities in OpenAI's two formats, from a sequence's vLLM-shaped logprobs.

A sequence's `logprobs[i]` maps token id -> Logprob(logprob, rank, decoded) for output position i:
the chosen token (`token_ids[i]`) and the top ones. Both formats take a range [start, end) of
positions so that streams send each position once.
"""

from __future__ import annotations

from banyan.text.output_processor import SequenceState


def _top(position: dict, k: int) -> list[tuple[int, object]]:
    """The k most likely tokens of a position, most likely first."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank)[:k]


def _text(tokenizer, token_id: int, lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])


def chat_logprobs(seq: SequenceState, tokenizer, k: int, start: int = 0, end: int | None = None) -> dict | None:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}"""
    if seq.logprobs is None:
        return None
    content = []
    for i in range(start, len(seq.logprobs) if end is None else end):
        position, token_id = seq.logprobs[i], seq.token_ids[i]
        chosen = position[token_id]
        text = _text(tokenizer, token_id, chosen)
        top = [
            {"token": (t := _text(tokenizer, tid, lp)), "logprob": lp.logprob, "bytes": list(t.encode())}
            for tid, lp in _top(position, k)
        ]
        content.append({"token": text, "logprob": chosen.logprob, "bytes": list(text.encode()), "top_logprobs": top})
    if not content:
        return None
    return {"content": content, "refusal": None}


def completion_logprobs(seq: SequenceState, tokenizer, k: int, start: int = 0, end: int | None = None,
                        offset: int = 0) -> dict | None:
    """The legacy format: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}; `offset`:
    the text before the completion (an echoed prompt)."""
    if seq.logprobs is None:
        return None
    end = len(seq.logprobs) if end is None else end
    offset += sum(len(tokenizer.decode([t])) for t in seq.token_ids[:start])
    return _legacy(seq.token_ids[start:end], seq.logprobs[start:end], tokenizer, k, offset)


def echoed_prompt_logprobs(prompt_ids: list[int], positions: list, tokenizer, k: int) -> dict | None:
    """The legacy format for an echoed prompt: the first position (and any the prefix cache served) is null."""
    return _legacy(prompt_ids, positions, tokenizer, k, 0)


def joined(first: dict | None, second: dict | None) -> dict | None:
    """Two runs of legacy-format positions as one (the echoed prompt's, then the completion's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def _legacy(token_ids, positions, tokenizer, k: int, offset: int) -> dict | None:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, positions):
        chosen = None if position is None else position[token_id]
        text = tokenizer.decode([token_id]) if chosen is None else _text(tokenizer, token_id, chosen)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if chosen is None else chosen.logprob)
        top = None if position is None else {_text(tokenizer, tid, lp): lp.logprob for tid, lp in _top(position, k)}
        out["top_logprobs"].append(top or None)
        out["text_offset"].append(offset)
        offset += len(text)
    if not out["tokens"]:
        return None
    return out


def vllm_prompt_logprobs(positions: list | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt position null or {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if p is None else {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for tid, lp in p.items()} for p in positions]
