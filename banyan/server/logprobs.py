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


def completion_logprobs(seq: SequenceState, tokenizer, k: int, start: int = 0, end: int | None = None) -> dict | None:
    """The legacy format: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}."""
    if seq.logprobs is None:
        return None
    end = len(seq.logprobs) if end is None else end
    offset = sum(len(tokenizer.decode([t])) for t in seq.token_ids[:start])
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i in range(start, end):
        position, token_id = seq.logprobs[i], seq.token_ids[i]
        chosen = position[token_id]
        text = _text(tokenizer, token_id, chosen)
        out["tokens"].append(text)
        out["token_logprobs"].append(chosen.logprob)
        out["top_logprobs"].append({_text(tokenizer, tid, lp): lp.logprob for tid, lp in _top(position, k)} or None)
        out["text_offset"].append(offset)
        offset += len(text)
    if not out["tokens"]:
        return None
    return out
