"""Tensor parallelism (Megatron-LM's split), applied from outside the model, as gpt-fast does: each rank builds
the model at its shard's shape (`shard_arch`), reads only its slices of the checkpoint (`weight_shard`), and
`parallelize` hooks the few collectives onto the built model. Model code has no parallel branch.

Per decoder layer, with T ranks (rank r), H query heads, K KV heads, I intermediate, V vocabulary:

    qkv_proj   column-parallel: q heads [r*H/T, (r+1)*H/T), KV heads r*K/T.. (K >= T) or head r // (T/K)
               (K < T: each KV head replicated on T/K ranks, the ones holding its query heads)
    o_proj     row-parallel: input columns of this rank's heads; partial sums -> one all-reduce
    gate_up    column-parallel: intermediate rows [r*I/T, (r+1)*I/T) of gate and of up
    down_proj  row-parallel: those input columns -> one all-reduce
    embedding  vocabulary-parallel: rows [r*V', (r+1)*V'), V' = ceil(V/T); ids outside give 0 -> all-reduce
    lm_head    vocabulary-parallel: the same rows; the logit columns are gathered at rank 0, padding cut

A bias of a row-parallel layer is added once: rank 0 loads it, the others hold zeros.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from banyan.config import ModelArch
from banyan.distributed.collectives import TPGroup
from banyan.errors import InvalidParameterError
from banyan.quantization.formats import QuantizedWeight, pad_rows, take_columns, take_rows


def check_sizes(arch: ModelArch, size: int) -> None:
    """InvalidParameterError naming the numbers when the model does not split over `size` ranks."""
    def refuse(what: str) -> InvalidParameterError:
        return InvalidParameterError("tensor_parallel_size", f"{size} does not divide {what}")

    if size < 1:
        raise InvalidParameterError("tensor_parallel_size", f"must be >= 1, got {size}")
    heads, kv = arch.num_attention_heads, arch.num_key_value_heads
    if heads % size:
        raise refuse(f"the model's {heads} attention heads")
    if kv % size and size % kv:
        raise InvalidParameterError("tensor_parallel_size", f"{size} and the model's {kv} KV heads: one must "
                                    "divide the other (KV heads are split, or replicated when fewer than ranks)")
    if arch.intermediate_size % size:
        raise refuse(f"the model's intermediate size of {arch.intermediate_size}")


def shard_arch(arch: ModelArch, size: int) -> ModelArch:
    """The shape one rank builds: its heads, KV heads, intermediate rows and vocabulary rows."""
    return dataclasses.replace(
        arch,
        num_attention_heads=arch.num_attention_heads // size,
        num_key_value_heads=max(1, arch.num_key_value_heads // size),
        intermediate_size=arch.intermediate_size // size,
        vocab_size=-(-arch.vocab_size // size),
    )


@dataclass(frozen=True)
class WeightShard:
    """Rank's part of one checkpoint tensor: [start, stop) along `dim`, zero-padded to `size` rows there;
    zero: all zeros of the tensor's own shape (a row-parallel bias on ranks other than 0); skip: none of it, not
    even read (another pipeline stage's layer)."""

    dim: int
    start: int = 0
    stop: int = 0
    size: int = 0
    zero: bool = False
    skip: bool = False

    def index(self, ndim: int) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.stop),) + (slice(None),) * (ndim - self.dim - 1)

    def finish(self, part: torch.Tensor) -> torch.Tensor:
        """The sliced tensor padded to `size` along dim (only the last vocabulary shard is short)."""
        missing = self.size - part.shape[self.dim]
        if missing <= 0:
            return part
        pad = list(part.shape)
        pad[self.dim] = missing
        return torch.cat([part, part.new_zeros(pad)], dim=self.dim)

    def take(self, tensor: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """This shard of a whole tensor, or of a GGUF weight kept compact (its rows, or its inputs by whole groups)."""
        if self.zero:
            return torch.zeros_like(tensor)
        if not isinstance(tensor, torch.Tensor):
            if self.dim == 1:
                return take_columns(tensor, self.start, self.stop)
            return pad_rows(take_rows(tensor, slice(self.start, self.stop)), self.size)
        return self.finish(tensor[self.index(tensor.dim())])


_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.(weight|bias)$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


class ShardPlan:
    """Which slice of each checkpoint tensor rank `rank` of `size` holds (None: the whole tensor)."""

    def __init__(self, arch: ModelArch, size: int, rank: int):
        self.arch, self.size, self.rank = arch, size, rank
        self.local = shard_arch(arch, size)

    def __call__(self, name: str) -> WeightShard | None:
        if self.size == 1:
            return None
        if name in _VOCAB:
            rows = self.local.vocab_size
            return WeightShard(0, self.rank * rows, (self.rank + 1) * rows, rows)
        if match := _COLUMN.search(name):
            start, count = self._rows(match.group(1))
            return WeightShard(0, start, start + count, count)
        if match := _ROW.search(name):
            if match.group(2) == "bias":
                return None if self.rank == 0 else WeightShard(0, zero=True)
            start, count = self._rows("q_proj" if match.group(1) == "o_proj" else "gate_proj")
            return WeightShard(1, start, start + count, count)
        return None

    def _rows(self, projection: str) -> tuple[int, int]:
        """(first row, rows) of this rank's share of a column-parallel projection."""
        local, D, r = self.local, self.arch.head_dim, self.rank
        if projection == "q_proj":
            return r * local.num_attention_heads * D, local.num_attention_heads * D
        if projection in ("k_proj", "v_proj"):
            kv, size = self.arch.num_key_value_heads, self.size
            head = r * kv // size if kv >= size else r // (size // kv)  # first KV head of this rank
            return head * D, local.num_key_value_heads * D
        return r * local.intermediate_size, local.intermediate_size


@dataclasses.dataclass
class TensorParallel:
    """This rank's shard: what the runner builds, loads and hooks (the same protocol as pipeline.Pipeline)."""

    group: TPGroup
    arch: ModelArch

    def local_arch(self) -> ModelArch:
        return shard_arch(self.arch, self.group.size)

    def weights(self, source, compact: bool):
        return source.iter_weights(compact, shard=ShardPlan(self.arch, self.group.size, self.group.rank))

    def transform(self, model: nn.Module) -> nn.Module:
        return parallelize(model, self.group, self.arch)

    def agree_min(self, value: int) -> int:
        return self.group.agree_min(value)

    def worker_step(self, runner, fb) -> None:
        """Ranks 1..N-1: the forward and the logits' gather, as rank 0 runs them."""
        hidden = runner._forward(fb)
        runner.model.compute_logits(hidden[fb.logits_indices])


def parallelize(model: nn.Module, group: TPGroup, arch: ModelArch) -> nn.Module:
    """Hook the collectives onto a model built at `shard_arch(arch, group.size)` (after any quantization swap,
    before loading): all-reduce after each o_proj and down_proj, the vocabulary-parallel embedding lookup, and
    the logits gathered at rank 0 (full vocabulary there; other ranks get their own columns, unused)."""
    for name, module in model.named_modules():
        if name.endswith((".o_proj", ".down_proj")):
            module.register_forward_hook(lambda _m, _i, out: group.all_reduce(out))
    _vocab_parallel_embedding(model.model.embed_tokens, group, shard_arch(arch, group.size).vocab_size)
    model.lm_head.register_forward_hook(_gather_logits(group, arch.vocab_size))
    return model


def _vocab_parallel_embedding(embedding: nn.Module, group: TPGroup, rows: int) -> None:
    """ids in [start, start + rows) look up their local row; the rest look up row 0 and are zeroed; the
    all-reduce then gives each id the one rank's row that holds it."""
    start = group.rank * rows
    outside: list[torch.Tensor] = []  # the pre-hook's mask, for the hook after

    def to_local(_module, args):
        (ids,) = args
        mask = (ids < start) | (ids >= start + rows)
        outside[:] = [mask]
        return ((ids - start).masked_fill(mask, 0),)

    def reduce(_module, _args, out):
        return group.all_reduce(out.masked_fill(outside.pop()[:, None], 0.0))

    embedding.register_forward_pre_hook(to_local)
    embedding.register_forward_hook(reduce)


def _gather_logits(group: TPGroup, vocab_size: int):
    def gather(_module, _args, out):
        parts = group.gather_to_first(out)  # each [n, V'] -> rank 0
        return out if parts is None else torch.cat(parts, dim=-1)[..., :vocab_size]

    return gather
