"""Pooling: the last layer's hidden states of an embedding request -> its embedding (see pooling_params.py).

A prompt may be computed over several steps (chunked prefill), so mean pooling keeps a running float64 sum on
the request; a chunk starting at position 0 (the first, or a recompute after preemption) starts it afresh:

    step 1: rows [0, a)   sum  = Σ h[0:a]
    step 2: rows [a, n)   sum += Σ h[a:n]     -> prompt complete: mean = sum / n

Last-token pooling needs only the row of the prompt's last position, in the step that completes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PoolRows(NamedTuple):
    """One pooling request's rows in a step's hidden states."""

    request: object  # Request
    first: int  # first hidden row
    count: int  # rows: the chunk's for mean pooling, the last position's (1) for last
    start: int  # the chunk's first prompt position
    completes: bool  # this step computes the prompt's last position


def pool(hidden: torch.Tensor, items: list[PoolRows]) -> dict[str, list[float]]:
    """The embeddings of the requests whose prompt this step completes, by request id; mean pooling's running
    sums advance for the others."""
    done = {}
    for item in items:
        request = item.request
        rows = hidden[item.first : item.first + item.count]  # [count, hidden]
        if request.pooling_params.pooling_type == "mean":
            part = rows.sum(dim=0, dtype=torch.float64)
            request.pool_state = part if item.start == 0 or request.pool_state is None else request.pool_state + part
            if not item.completes:
                continue
            vector = request.pool_state / request.num_prompt_tokens
        elif item.completes:
            vector = rows[-1].to(torch.float64)
        else:
            continue
        done[request.request_id] = finish(vector, request.pooling_params)
    return done


def finish(vector: torch.Tensor, params) -> list[float]:
    """Truncate to `dimensions` (Matryoshka), then L2-normalise (in float64; returned as Python floats)."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.float().tolist()
