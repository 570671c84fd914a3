"""The padded static-buffer decode path of CUDA graphs, run without capture on CPU: it must give exactly the
eager outputs, and its padding rows must write only the reserved page. Capture itself runs on a GPU only."""

from __future__ import annotations

import random

import pytest
import torch

from banyan import LLM, SamplingParams
from banyan.runner.cuda_graphs import graph_buckets
from banyan.forward_batch import ForwardBatch
from tests.factories import write_model_dir

MAX_NUM_SEQS = 8  # buckets 1, 2, 4, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_graphs")
    vocab = write_model_dir(path, "llama", seed=5).config.vocab_size
    rng = random.Random(2)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))] for _ in range(7)]
    return path, prompts


def make_llm(path, **kw):
    return LLM(str(path), device="cpu", block_size=4, num_pages=96, max_num_seqs=MAX_NUM_SEQS, num_threads=1, **kw)


def count_graph_runs(runner) -> list[int]:
    """Start the padded path (no capture) and record the size of every step it runs."""
    runner.start_decode_graphs(capture=False)
    graphs, sizes = runner.decode_graphs, []
    run = graphs.run
    graphs.run = lambda fb: sizes.append(fb.num_seqs) or run(fb)
    return sizes


def test_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]


@pytest.mark.parametrize("num_prompts", [3, 7])
def test_padded_decode_equals_eager(tiny, num_prompts):
    path, prompts = tiny
    # different lengths: the batch shrinks as requests finish, so rows of larger steps become padding again
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(num_prompts)]
    inputs = [{"prompt_token_ids": p} for p in prompts[:num_prompts]]
    eager = [o.outputs[0].token_ids for o in make_llm(path).generate(inputs, params, use_tqdm=False)]
    llm = make_llm(path)
    sizes = count_graph_runs(llm.engine.runner)
    padded = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    assert padded == eager
    assert any(n not in graph_buckets(MAX_NUM_SEQS) for n in sizes)  # some steps were padded
    llm.engine.kv.check_integrity()


def decode_batch(tables: list[list[int]], lens: list[int], page_size: int) -> ForwardBatch:
    """One decode row per request: its last token at position len - 1."""
    width = max(len(t) for t in tables)
    slots = [t[(n - 1) // page_size] * page_size + (n - 1) % page_size for t, n in zip(tables, lens)]
    return ForwardBatch(
        input_ids=torch.tensor([5 + i for i in range(len(lens))]),
        positions=torch.tensor([n - 1 for n in lens]),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        logits_indices=torch.arange(len(lens)),
        query_lens=[1] * len(lens),
        context_lens=list(lens),
        page_size=page_size,
    )


def test_padding_rows_write_only_the_reserved_page(tiny):
    path, _ = tiny
    llm = make_llm(path)
    runner = llm.engine.runner
    assert runner.reserved_page >= llm.engine.kv.num_pages  # no request is ever handed this page
    runner.start_decode_graphs(capture=False)
    tables, lens = [[3, 7], [1], [9, 2, 4]], [6, 2, 11]  # 3 requests: bucket 4, one padding row
    fb = decode_batch(tables, lens, runner.page_size)
    before = [k.clone() for k, _ in runner.kv_caches]
    with torch.inference_mode():
        hidden = runner.decode_graphs.run(fb)
        real_slots = set(fb.slot_mapping.tolist())
        for (k, _), old in zip(runner.kv_caches, before):
            changed = (k != old).flatten(2).any(-1).flatten().nonzero().flatten().tolist()  # slots written
            pages = {s // runner.page_size for s in changed if s not in real_slots}
            assert pages == {runner.reserved_page}, "a padding row wrote outside the reserved page"
            assert real_slots <= set(changed)
        eager = runner.model(fb, [(k.clone(), v.clone()) for k, v in runner.kv_caches])
    torch.testing.assert_close(hidden, eager, atol=1e-5, rtol=1e-5)
