"""Pipeline parallelism: each rank holds a contiguous range of decoder layers (a stage) and their KV; the
hidden states travel rank 0 -> 1 -> ... -> last -> rank 0, one micro-batch after another so stages overlap.

    layers:      [ 0 .. 9 | 10 .. 19 | 20 .. 29 ]          stage_ranges(30, 3): the first stages take any extra
    rank 0:      embed, stage 0, ─send─►      ...      ◄─recv─ final hidden, norm -> logits, sampling
    rank 1:                  ─recv─► stage 1 ─send─►
    rank 2:                                  ─recv─► stage 2 ─send─► rank 0

A step's ForwardBatch is cut into micro-batches of whole requests (about equal tokens; one per stage when each gets
MIN_MICRO_BATCH_TOKENS, else the whole batch at once; --pipeline-micro-batches N: N; never more than requests):

    time ->     mb0      mb1      mb2
    rank 0:   [ s0 ]   [ s0 ]   [ s0 ]
    rank 1:            [ s1 ]   [ s1 ]   [ s1 ]
    rank 2:                     [ s2 ]   [ s2 ]   [ s2 ]

Every rank loads the embedding, the final norm and lm_head (small beside the layers; rank 0 uses them), and only
its own layers, renamed to start at 0. Sends and receives have the step timeout (collectives.py). Composable
with tensor parallel: each stage is then a TP group (ranks stage * T .. stage * T + T - 1), and rank t of a
stage sends to rank t of the next (every TP rank holds the whole hidden state).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from banyan.config import ModelArch
from banyan.distributed.collectives import TPGroup
from banyan.distributed.tensor_parallel import ShardPlan, TensorParallel, WeightShard, shard_arch
from banyan.errors import InvalidParameterError
from banyan.forward_batch import ForwardBatch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SKIP = WeightShard(0, skip=True)


def stage_ranges(num_layers: int, size: int) -> list[range]:
    """Contiguous layer ranges, one per stage, sizes differing by at most one (the first stages the larger)."""
    base, extra = divmod(num_layers, size)
    starts = [s * base + min(s, extra) for s in range(size + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(size)]


def check_stages(arch: ModelArch, size: int) -> None:
    if size > arch.num_hidden_layers:
        raise InvalidParameterError("pipeline_parallel_size", f"{size} stages for the model's "
                                    f"{arch.num_hidden_layers} layers: each stage needs one")


MIN_MICRO_BATCH_TOKENS = 64
"""Fewer tokens than this, and a micro-batch costs about what the whole batch does (each one reads its stage's weights
and pays the per-layer overhead again): by default such a step goes through whole. On the loaded 2-vCPU EPYC, decode
steps of 8 and 16 requests cut in two ran 0.62-0.99x as fast as whole, prefill steps 0.92-1.19x (benchmarks/README.md);
64 lies between, untuned."""


def micro_batch_count(num_tokens: int, num_seqs: int, stages: int, requested: int | None = None) -> int:
    """`requested` (--pipeline-micro-batches), else one per stage as long as each gets MIN_MICRO_BATCH_TOKENS; never
    more than the requests, never fewer than 1."""
    parts = requested or min(stages, num_tokens // MIN_MICRO_BATCH_TOKENS)
    return max(1, min(parts, num_seqs))


def micro_batch_bounds(query_lens: list[int], parts: int) -> list[int]:
    """Request boundaries [0, ..., num_seqs] cutting the batch into at most `parts` runs of about equal tokens."""
    total, bounds, running = sum(query_lens), [0], 0
    for i, n in enumerate(query_lens[:-1], 1):
        running += n
        if running * parts >= total * len(bounds) and len(bounds) < parts:
            bounds.append(i)
    return bounds + [len(query_lens)]


def split(fb: ForwardBatch, first: int, last: int) -> ForwardBatch:
    """Requests [first, last) of the batch as a batch of their own (no logits rows: stages return hidden states).

        rows:  [ ... | first's rows ... last-1's rows | ... ]
                      r0 = query_start_loc[first]      r1 = query_start_loc[last]
    """
    r0, r1 = sum(fb.query_lens[:first]), sum(fb.query_lens[:last])
    return ForwardBatch(
        input_ids=fb.input_ids[r0:r1], positions=fb.positions[r0:r1], slot_mapping=fb.slot_mapping[r0:r1],
        query_start_loc=fb.query_start_loc[first : last + 1] - r0, seq_lens=fb.seq_lens[first:last],
        block_tables=fb.block_tables[first:last], logits_indices=fb.logits_indices[:0],
        query_lens=fb.query_lens[first:last], context_lens=fb.context_lens[first:last], page_size=fb.page_size,
    )


@dataclasses.dataclass
class Pipeline:
    """This rank's stage: what the runner builds, loads, and how a forward runs (stage 0: PipelineModel).

    With tensor parallel inside each stage (tp: this rank's TensorParallel over its stage's ranks), global rank
    = stage * tp_size + t, and hidden states go from rank t of one stage to rank t of the next."""

    group: TPGroup  # every rank: the sends, the start-up agreement
    arch: ModelArch
    stages: int
    tp: TensorParallel | None = None
    num_micro_batches: int | None = None  # None: micro_batch_count's default

    @property
    def tp_size(self) -> int:
        return self.tp.group.size if self.tp is not None else 1

    @property
    def stage(self) -> int:
        return self.group.rank // self.tp_size

    def peer(self, stage_offset: int) -> int:
        """The rank holding this rank's TP part in the stage `stage_offset` away (wrapping around)."""
        return (self.stage + stage_offset) % self.stages * self.tp_size + self.group.rank % self.tp_size

    @property
    def layers(self) -> range:
        return stage_ranges(self.arch.num_hidden_layers, self.stages)[self.stage]

    def local_arch(self) -> ModelArch:
        staged = dataclasses.replace(self.arch, num_hidden_layers=len(self.layers))
        return shard_arch(staged, self.tp_size)

    def weights(self, source, compact: bool):
        """The checkpoint's tensors this stage holds: its layers (renumbered from 0), the embedding, norm, lm_head
        (with tensor parallel: this rank's slices of them)."""
        first = self.layers.start
        for name, tensor in source.iter_weights(compact, shard=self._part):
            match = _LAYER.match(name)
            yield (name if match is None else f"model.layers.{int(match.group(1)) - first}.{name[match.end():]}"), tensor

    def _part(self, name: str) -> WeightShard | None:
        match = _LAYER.match(name)
        if match is not None and int(match.group(1)) not in self.layers:
            return SKIP
        return ShardPlan(self.arch, self.tp_size, self.tp.group.rank)(name) if self.tp is not None else None

    def transform(self, model: nn.Module) -> nn.Module:
        if self.tp is not None:
            model = self.tp.transform(model)
        return PipelineModel(model, self) if self.stage == 0 else model

    def agree_min(self, value: int) -> int:
        return self.group.agree_min(value)

    def micro_batches(self, fb: ForwardBatch) -> list[ForwardBatch]:
        parts = micro_batch_count(fb.num_tokens, fb.num_seqs, self.stages, self.num_micro_batches)
        bounds = micro_batch_bounds(fb.query_lens, parts)
        return [split(fb, a, b) for a, b in zip(bounds, bounds[1:])]

    def run_layers(self, model: nn.Module, x: torch.Tensor, kv_caches, mb: ForwardBatch) -> torch.Tensor:
        for layer, kv_cache in zip(model.model.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, mb)
        return x

    def worker_step(self, runner, fb: ForwardBatch) -> None:
        """Ranks other than 0: at stage 0 (TP ranks beside rank 0) the whole pipeline as rank 0 runs it, logits
        included (their gather); at the others, receive each micro-batch's hidden states, run this stage, send on."""
        if self.stage == 0:
            hidden = runner._forward(fb)
            runner.model.compute_logits(hidden[fb.logits_indices])
            return
        sent = []
        for i, mb in enumerate(self.micro_batches(fb)):
            x = torch.empty(mb.num_tokens, self.arch.hidden_size, dtype=runner.dtype, device=runner.device)
            self.group.recv(x, self.peer(-1), tag=i)
            x = self.run_layers(runner.model, x, runner.kv_caches, mb)
            sent.append((x, self.group.isend(x, self.peer(1), tag=i)))
        for _, work in sent:
            work.wait()


class PipelineModel(nn.Module):
    """Rank 0's model: embedding and stage 0 here, the other stages in the workers, the final norm here again.
    Returns what CausalLM.forward does: the final hidden states of every row."""

    def __init__(self, model: nn.Module, pipeline: Pipeline):
        super().__init__()
        self.inner, self.pipeline = model, pipeline

    def forward(self, fb: ForwardBatch, kv_caches) -> torch.Tensor:
        pipeline, inner = self.pipeline, self.inner
        sent, parts = [], pipeline.micro_batches(fb)
        for i, mb in enumerate(parts):
            x = pipeline.run_layers(inner, inner.model.embed_tokens(mb.input_ids), kv_caches, mb)
            sent.append((x, pipeline.group.isend(x, pipeline.peer(1), tag=i)))  # the next runs while this one travels
        outs = []
        for i, mb in enumerate(parts):
            out = torch.empty(mb.num_tokens, inner.arch.hidden_size, dtype=sent[i][0].dtype, device=sent[i][0].device)
            pipeline.group.recv(out, pipeline.peer(-1), tag=i)  # from the last stage
            outs.append(out)
        for _, work in sent:
            work.wait()
        return inner.model.norm(torch.cat(outs))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)
