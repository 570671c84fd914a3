"""LogitsPlan: which hidden rows of a step become logits, and what each logits row is for (the runner builds one
per step in _prepare and reads it when sampling)."""

from __future__ import annotations

from banyan.layers.pooler import PoolRows
from banyan.scheduler.batch import ScheduledRequest


class LogitsPlan:
    """Which hidden rows become logits, and what each logits row is for.

    rows:     hidden-state rows to project, in logits order
    prompt:   (request, first logits row, count, next-token targets) for prompt logprobs
    sample:   one logits row per request that samples this step
    verify:   (request, its drafts, first logits row) for a request that verifies k drafts: k + 1 rows
    pool:     hidden rows (not logits) each embedding request pools this step
    """

    def __init__(self):
        self.rows: list[int] = []
        self.prompt: list[tuple] = []
        self.sample_requests: list = []
        self.sample_logit_rows: list[int] = []
        self.verify: list[tuple] = []
        self.pool: list[PoolRows] = []

    def add_prompt_rows(self, item: ScheduledRequest, row0: int) -> None:
        request = item.request
        if request.prompt_logprobs is None:
            return
        # Position p predicts prompt token p + 1. Positions whose logprobs are already known
        # (computed before a preemption) are skipped, so recompute never duplicates them.
        first = max(item.start, len(request.prompt_logprobs) - 1)
        last = min(item.end, request.num_prompt_tokens - 1)
        if first >= last:
            return
        self.prompt.append((request, len(self.rows), last - first, list(request.all_token_ids[first + 1 : last + 1])))
        self.rows.extend(range(row0 + first - item.start, row0 + last - item.start))

    def add_verify_rows(self, request, drafts, row: int) -> None:
        """Hidden rows row .. row + k: the last token's and each draft's, whose logits check the next draft."""
        self.verify.append((request, drafts, len(self.rows)))
        self.rows.extend(range(row, row + len(drafts) + 1))

    def add_pool_rows(self, item: ScheduledRequest, row0: int) -> None:
        """Mean pooling reads every row of the chunk; last-token pooling only the prompt's last, when it runs."""
        completes = item.end == item.request.num_prompt_tokens
        if item.request.pools_every_token:
            self.pool.append(PoolRows(item.request, row0, item.num_new_tokens, item.start, completes))
        elif completes:
            self.pool.append(PoolRows(item.request, row0 + item.num_new_tokens - 1, 1, item.start, True))

    def add_sample_row(self, request, row: int) -> None:
        self.sample_requests.append(request)
        self.sample_logit_rows.append(len(self.rows))
        self.rows.append(row)

    def drop_finished(self) -> None:
        """Async scheduling: a request that ended at the step before this one (found out after this step was
        launched) has a row here one token too many; it samples nothing."""
        keep = [i for i, request in enumerate(self.sample_requests) if not request.is_finished]
        if len(keep) < len(self.sample_requests):
            self.sample_requests = [self.sample_requests[i] for i in keep]
            self.sample_logit_rows = [self.sample_logit_rows[i] for i in keep]
