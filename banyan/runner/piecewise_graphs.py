"""Piecewise CUDA graphs: steps with prefill rows too, attention eager between captured dense pieces.

A decode-only step is one graph (cuda_graphs.py). A step holding prefill chunks cannot be: attention's work
follows each request's query and context lengths. Everything else in the forward is row-wise (embedding,
norms, projections, RoPE, MLP), so its work depends only on the number of rows. The forward is cut at
each attention into L + 1 dense pieces, each captured once per token bucket T and replayed:

    piece 0:      embed -> norm -> q, k, v (rotated)                          layer 0's input half
    attention 0:  eager, over the real rows [0, n) with the step's own batch
    piece i:      o_proj(o) + x -> norm -> MLP -> + -> norm -> q, k, v       layer i-1's rest, layer i's input half
    ...
    piece L:      o_proj(o) + x -> norm -> MLP -> + -> final norm             the hidden states

A step of n tokens runs in the smallest bucket T >= n. The pieces read and write fixed buffers of T rows:

    rows:      [ r0 r1 ... r(n-1) | padding ]
    input_ids, positions: the step's rows copied in; padding rows keep stale values (valid ids and positions)
    q, k, v:   written by piece i; attention reads only rows [0, n) (so padding never reaches the KV cache)
    o:         attention's rows copied to [0, n); padding rows keep stale values
    x, hidden: the residual stream and the output; rows [0, n) are read

Padding rows compute on stale values, but every dense op is row-wise, so they never mix into a real row
(fp8 weights quantize activations per row too). With capture=False the same padded pieces run eagerly:
how CPU tests check it against the plain forward.
"""

from __future__ import annotations

import logging
import time

import torch

from banyan.forward_batch import ForwardBatch
from banyan.models.blocks import CausalLM, DecoderLayer, RopeAttention

logger = logging.getLogger(__name__)

LARGEST_BUCKET = 512
"""Steps of more tokens run eagerly: their matmuls are long enough that launch overhead no longer counts."""


def token_buckets(max_num_batched_tokens: int, largest: int = LARGEST_BUCKET) -> list[int]:
    """8, 16, 32, ... up to min(largest, max_num_batched_tokens), which is the last bucket."""
    top = min(largest, max_num_batched_tokens)
    buckets = [1 << i for i in range(3, top.bit_length()) if 1 << i < top]
    return buckets + [top]


def piecewise_capable(model: torch.nn.Module) -> bool:
    """Whether the model is a stack of DecoderLayers with RopeAttention: the shape the pieces are cut from."""
    return isinstance(model, CausalLM) and all(
        isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, RopeAttention) for layer in model.model.layers)


class PiecewiseGraphs:
    def __init__(self, model: CausalLM, kv_caches, *, buckets: list[int], device: torch.device, capture: bool = True):
        self.model, self.kv_caches, self.buckets, self.capture = model, kv_caches, buckets, capture
        self.layers = list(model.model.layers)
        attn = self.layers[0].self_attn
        size, hidden, dtype = buckets[-1], model.arch.hidden_size, model.model.embed_tokens.weight.dtype
        make = dict(dtype=dtype, device=device)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.x = torch.zeros(size, hidden, **make)  # the residual stream between pieces
        self.q = torch.zeros(size, attn.num_heads, attn.head_dim, **make)
        self.k = torch.zeros(size, attn.num_kv_heads, attn.head_dim, **make)
        self.v = torch.zeros(size, attn.num_kv_heads, attn.head_dim, **make)
        self.o = torch.zeros(size, attn.num_heads, attn.head_dim, **make)  # attention's output, the next piece's input
        self.hidden = torch.zeros(size, hidden, **make)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bucket, piece) -> graph

    def fits(self, fb: ForwardBatch) -> bool:
        return 0 < fb.num_tokens <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states [n, hidden] of a step of n <= buckets[-1] tokens, any mix of prefill and decode rows."""
        n = fb.num_tokens
        T = self.bucket(n)
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self._piece(T, 0)
        for i, layer in enumerate(self.layers):
            o = layer.self_attn.attend(self.q[:n], self.k[:n], self.v[:n], self.kv_caches[i], fb)
            self.o[:n].copy_(o)
            self._piece(T, i + 1)
        return self.hidden[:n]

    def _piece(self, T: int, i: int) -> None:
        if self.capture:
            self.graphs[T, i].replay()
        else:
            self._dense(T, i)

    def _dense(self, T: int, i: int) -> None:
        """Piece i over the first T rows of the buffers (the module docstring's table)."""
        if i == 0:
            x = self.model.model.embed_tokens(self.input_ids[:T])
        else:
            layer = self.layers[i - 1]
            x = layer.after_attention(self.x[:T], layer.self_attn.o_proj(self.o[:T].flatten(1)))
        if i == len(self.layers):
            self.hidden[:T].copy_(self.model.model.norm(x))
            return
        self.x[:T].copy_(x)
        layer = self.layers[i]
        # A new view of positions in every piece: RoPE's lookup cache, keyed by the tensor, never spans graphs.
        q, k, v = layer.self_attn.project(layer.input_layernorm(x), self.positions[:T])
        self.q[:T].copy_(q)
        self.k[:T].copy_(k)
        self.v[:T].copy_(v)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every piece at every bucket, largest bucket first, all in one memory pool: pieces run one after another
        and keep nothing in the pool between them (their outputs go to the fixed buffers)."""
        start, pool = time.perf_counter(), None
        for T in reversed(self.buckets):
            for i in range(len(self.layers) + 1):
                side = torch.cuda.Stream()  # warm-up off the capturing stream, as torch advises
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._dense(T, i)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._dense(T, i)
                pool = graph.pool()
                self.graphs[T, i] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs: captured %d pieces for mixed steps of token buckets %s in %.1f s "
                    "(attention eager between them; --enforce-eager turns them off)",
                    len(self.graphs), self.buckets, time.perf_counter() - start)
