"""Random ragged paged batches for the kernel tests, and the device and tolerances they run with."""

from __future__ import annotations

import os
import random

import pytest
import torch

from banyan.forward_batch import ForwardBatch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
TOLERANCES = {  # kernel vs the fp32 torch reference; low precision rounds p and v before the PV product
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def gpu(test):
    """A full-size case: runs only on a CUDA GPU, with compiled kernels."""
    return pytest.mark.gpu(pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")(test))


def make_batch(specs, *, page_size, num_kv_heads, group, head_dim, dtype=torch.float32, seed=0, spare_pages=3):
    """Requests given as (cached prefix length, new tokens), their pages shuffled over a noise cache.

    The noise already in a request's first pages stands for its cached prefix. Returns the batch,
    the new q/k/v rows and the k/v caches, all on DEVICE.
    """
    rng, gen = random.Random(seed), torch.Generator(DEVICE).manual_seed(seed)
    pages_per_seq = [-(-(prefix + new) // page_size) for prefix, new in specs]
    free = list(range(sum(pages_per_seq) + spare_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages_per_seq]
    slots, positions = [], []
    for (prefix, new), table in zip(specs, tables):
        positions += range(prefix, prefix + new)
        slots += [table[p // page_size] * page_size + p % page_size for p in range(prefix, prefix + new)]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    num_tokens, width = len(slots), max(pages_per_seq)
    cache_shape = (len(free) + sum(pages_per_seq), page_size, num_kv_heads, head_dim)
    query_lens = [new for _, new in specs]
    context_lens = [prefix + new for prefix, new in specs]
    batch = ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long, device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE),
        slot_mapping=torch.tensor(slots, device=DEVICE),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        logits_indices=torch.arange(num_tokens, device=DEVICE),
        query_lens=query_lens,
        context_lens=context_lens,
        page_size=page_size,
    )
    q = randn(num_tokens, num_kv_heads * group, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    return batch, q, k, v, randn(*cache_shape), randn(*cache_shape)


def random_specs(rng: random.Random, n: int, *, max_prefix: int, max_new: int):
    """n requests (cached prefix 0..max_prefix, new tokens 1..max_new)."""
    return [(rng.randint(0, max_prefix), rng.randint(1, max_new)) for _ in range(n)]


def poisoned(like: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel forgets to write stays NaN."""
    return torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


def reference_attention(q, k, v, k_cache, v_cache, batch, scale, sliding_window=None):
    """The torch backend in fp32 on copies of the caches: its output and the caches after the step."""
    from banyan.layers.attention.torch_backend import TorchAttentionBackend

    k_ref, v_ref = k_cache.float().clone(), v_cache.float().clone()
    out = TorchAttentionBackend(fused=False).forward(q.float(), k.float(), v.float(), k_ref, v_ref, batch, scale, sliding_window)
    return out, k_ref, v_ref


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert not out.isnan().any(), "an output element was never written"
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[out.dtype])
