"""Sizing the KV pool: from a byte budget on CPU, from a profiling forward on a GPU.

On a GPU the pool takes what the model leaves of `gpu_memory_utilization` of the device:

    total * utilization
      - weights          (allocated once the weights are loaded)
      - activation peak  (the profiling forward at the largest step, above the weights)
      - non-torch        (CUDA context, cuBLAS workspaces, other processes: used but not torch's)
      = KV budget        -> pages of page_size tokens, every layer's K and V

On a CPU, without --kv-cache-memory, the pool takes what the host has left (CpuKVSizing):

    available      MemAvailable, or a cgroup limit less its usage when that is less (host_memory.py), read
                   once this process's weights are loaded
      + weights    added back: what the host had for this process
      - reserve    max(1 GiB, 10% of the memory): API process, tokenizers, page cache, other programs
      / pools      data-parallel replicas x tensor/pipeline ranks on this host, sizing theirs at the same time
                   (ParallelConfig.pools_on_host: those Ray placed on other nodes do not count)
      - weights, - activations (the largest step's tensors, estimated)
      = KV budget, at most what max_num_seqs requests of max_model_len tokens can ever fill

The arithmetic is pure (MemoryProfile, CpuKVSizing, KVCapacity); only `profile_cuda_forward` touches a device.
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from banyan.forward_batch import ForwardBatch
from banyan.host_memory import CPU_KV_ENV, GiB, HostMemory, cpu_kv_from_env, read_host_memory

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class MemoryProfile:
    """Device memory in bytes, measured after loading the weights and one forward at the largest step."""

    total: int
    weights: int
    activation_peak: int
    non_torch: int

    def kv_budget(self, utilization: float) -> int:
        """Bytes left for the KV pool within utilization * total (0 when the model alone exceeds it)."""
        return max(0, int(self.total * utilization) - self.weights - self.activation_peak - self.non_torch)

    def describe(self, utilization: float) -> str:
        return (f"{utilization:.2f} x {self.total / GiB:.1f} GiB - weights {self.weights / GiB:.2f} GiB"
                f" - activation peak {self.activation_peak / GiB:.2f} GiB - non-torch {self.non_torch / GiB:.2f} GiB"
                f" = {self.kv_budget(utilization) / GiB:.2f} GiB")


@dataclass(frozen=True)
class CpuKVSizing:
    """The CPU pool without --kv-cache-memory (the module docstring's sum). Each of `pools` processes reads
    `available` after loading its own weights, in any order, and adds back only those: their pools, weights and
    activations together stay within what the host had less the reserve, however their loads interleave."""

    host: HostMemory
    weights: int  # this process's, already out of host.available
    activations: int  # the largest step's tensors, this process
    pools: int  # processes on this host sizing a pool at the same time
    useful: int  # bytes of max_num_seqs x max_model_len tokens: a larger pool is never filled

    @property
    def share(self) -> int:
        return (self.host.available + self.weights - self.host.reserve) // self.pools - self.weights - self.activations

    @property
    def budget(self) -> int:
        return max(0, min(self.share, self.useful))

    def describe(self) -> str:
        host, reserve, weights = self.host.describe(), _gib(self.host.reserve), _gib(self.weights)
        if self.pools == 1:  # its weights are out of `available` already
            left = f"{host} after the weights ({weights}) - reserve {reserve}"
        else:
            left = f"({host} + weights {weights} - reserve {reserve}) / {self.pools} pools on this host - weights {weights}"
        capped = " (capped: max_num_seqs x max_model_len tokens fill no more)" if self.useful < self.share else ""
        return (f"free memory: {left} - activations {_gib(self.activations)} = {_gib(max(0, self.share))}; at most "
                f"{_gib(self.useful)}{capped}; --kv-cache-memory sets it")


def cpu_kv_budget(arch, vocab_size: int, limits, page_size: int, per_token: int, weights: int,
                  pools: int) -> tuple[int, str]:
    """Bytes for a CPU pool without --kv-cache-memory, and where they come from: $BANYAN_CPU_KV_CACHE_MEMORY when
    set, else CpuKVSizing from the host's memory now; either at most what the scheduler can fill (limits: the
    runner's largest step)."""
    seq_tokens = -(-limits.max_model_len // page_size) * page_size  # whole pages
    useful = limits.max_num_seqs * seq_tokens * per_token  # a larger pool is never filled
    if (fixed := cpu_kv_from_env()) is not None:
        capped = " (capped: max_num_seqs x max_model_len tokens fill no more)" if useful < fixed else ""
        return min(fixed, useful), f"${CPU_KV_ENV} {_gib(fixed)}{capped}"
    activations = activation_bytes(arch, limits.max_num_batched_tokens, limits.max_num_seqs, vocab_size)
    sizing = CpuKVSizing(read_host_memory(), weights, activations, pools, useful)
    return sizing.budget, sizing.describe()


def activation_bytes(arch, max_num_batched_tokens: int, max_num_seqs: int, vocab_size: int) -> int:
    """A bound on the CPU's largest step beside weights and KV, in float32: per token the residual, norm output,
    q, k, v, attention output and scratch (8 x hidden) and the MLP's gate, up, activation and product
    (4 x intermediate); the logits of max_num_seqs rows twice (the sampler's probabilities beside them). The
    default model at 2048 tokens and 128 rows: 138 MiB, against a measured peak of 131 MiB above its RSS."""
    per_token = 8 * arch.hidden_size + 4 * arch.intermediate_size
    return 4 * (max_num_batched_tokens * per_token + 2 * max_num_seqs * vocab_size)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class KVCapacity:
    """What a KV pool holds: the facts the start-up log reports on every device."""

    num_pages: int
    page_size: int
    bytes_per_token: int  # K and V of one token across all layers
    max_model_len: int
    dtype: str
    budget: str  # where the byte budget came from

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def full_length_requests(self) -> float:
        return self.num_tokens / self.max_model_len

    def describe(self) -> str:
        size = self.num_tokens * self.bytes_per_token / GiB
        return (f"KV cache: {self.num_pages} pages of {self.page_size} tokens = {self.num_tokens} tokens"
                f" ({self.dtype}, {size:.2f} GiB); {self.full_length_requests:.1f} requests of the full"
                f" {self.max_model_len}-token context fit; budget: {self.budget}")


def fitting_context(model_limit: int, pool_tokens: int) -> int:
    """--max-model-len auto: the longest context one request's K/V can fill in the pool, at most the model's."""
    length = min(model_limit, pool_tokens)
    logger.info("max_model_len auto: %d tokens (the model allows %d, the KV cache holds %d)",
                length, model_limit, pool_tokens)
    return length


def pages_for_budget(budget: int, page_size: int, bytes_per_token: int) -> int:
    return budget // (page_size * bytes_per_token)


def profile_batch(num_tokens: int, max_model_len: int, num_logits: int, page_size: int, device) -> ForwardBatch:
    """The largest step the scheduler can hand out: num_tokens new tokens in prompts of at most
    max_model_len, every K/V written into page 0 (the profile runs over a one-page cache)."""
    full, rest = divmod(num_tokens, max_model_len)
    lens = [max_model_len] * full + ([rest] if rest else [])
    width = -(-max(lens) // page_size)
    positions = [p for n in lens for p in range(n)]
    starts = list(itertools.accumulate(lens, initial=0))

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long, device=device),
        positions=tensor(positions, torch.long),
        slot_mapping=tensor([p % page_size for p in positions], torch.long),
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(lens, torch.int32),
        block_tables=torch.zeros(len(lens), width, dtype=torch.int32, device=device),
        logits_indices=torch.arange(num_tokens - min(num_logits, num_tokens), num_tokens, device=device),
        query_lens=lens,
        context_lens=list(lens),
        page_size=page_size,
    )


def profile_cuda_forward(run: Callable[[], object]) -> MemoryProfile:
    """Run the profiling forward `run` and measure it (call after the weights are loaded, before the KV pool)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    non_torch = max(0, total - free - torch.cuda.memory_reserved())
    torch.cuda.empty_cache()
    return MemoryProfile(total=total, weights=weights, activation_peak=peak - weights, non_torch=non_torch)


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in fresh anonymous memory, which the OS zero-fills page by page on first write: a KV
    pool of many GiB costs nothing at start-up (torch.zeros writes every byte, 1.3-2 s a GiB on a loaded 2-vCPU VM)
    and its resident size follows the pages in use (the block pool hands out the page freed last first). The
    memory is unmapped when the tensor goes (the tensor holds the mapping)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    private = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (not shared with a forked child)
    return torch.frombuffer(private, dtype=torch.uint8).view(dtype).view(shape)
