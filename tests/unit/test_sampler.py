"""The sampler: every parameter against a hand-computed expectation, seeded determinism, and the
sampled distribution against softmax."""

import math

import pytest
import torch

from banyan.kernels import cpu_argmax
from banyan.kernels.cpu_argmax import argmax_in_blocks, argmax_rows
from banyan.layers.sampler import (
    BLOCK,
    Sampler,
    _apply_min_p,
    _apply_penalties,
    _apply_top_k_top_p,
    _pick,
    compute_prompt_logprobs,
)
from banyan.request import Request
from banyan.sampling_params import SamplingParams
from banyan.structured import allocate_bitmask

V = 8


def make_request(prompt=(1, 2, 3), output=(), eos=(7,), rid="r", **params) -> Request:
    request = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=eos, max_tokens=100)
    for t in output:
        request.append_token(t)
    return request


def finite_support(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


LOGITS = torch.tensor([[3.0, 1.0, 0.5, 2.5, -1.0, 0.0, 2.0, -2.0]])  # order: 0, 3, 6, 1, 2, 5, 4, 7


def test_greedy_takes_argmax():
    logits = torch.randn(5, V)
    out = Sampler(V)(logits, [make_request(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5
    assert out.chosen_logprobs == [None] * 5  # as in vLLM: no logprobs asked, none computed
    with_logprobs = Sampler(V)(logits, [make_request(temperature=0.0, logprobs=0) for _ in range(5)])
    # float32 either way, summed in another order: equal to a few ulps of the log-sum-exp (~1e-6), not of the result
    want = torch.log_softmax(logits, -1).max(-1).values.tolist()
    assert with_logprobs.chosen_logprobs == pytest.approx(want, rel=1e-6, abs=1e-5)


@pytest.mark.parametrize("temperature", [2.2250738585e-313, 1e-300, 1e-6])
def test_a_temperature_too_small_to_sample_is_greedy(temperature):
    """The long fuzz tier's one 500: temperature 2.2e-313 is 0 in float32, and logits / 0 sampled from NaN."""
    logits = torch.randn(5, V)
    out = Sampler(V)(logits, [make_request(temperature=temperature, seed=1) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert SamplingParams(temperature=temperature).greedy and not SamplingParams(temperature=1e-5).greedy


def test_padded_vocabulary_columns_are_never_sampled():
    logits = torch.zeros(3, V + 4)
    logits[:, V:] = 100.0
    out = Sampler(V)(logits, [make_request(temperature=t) for t in (0.0, 1.0, 0.5)])
    assert all(t < V for t in out.token_ids)


@pytest.mark.parametrize(
    "params, support",
    [
        (dict(top_k=1), {0}),
        (dict(top_k=3), {0, 3, 6}),
        (dict(top_k=V + 5), set(range(V))),
        (dict(top_p=1e-6), {0}),
        (dict(min_p=0.5), {0, 3}),  # p_i / p_max >= 0.5  <=>  l_i >= 3 - ln 2 = 2.31
        (dict(min_p=math.exp(-1.01)), {0, 3, 6}),
        (dict(top_k=2, min_p=0.9), {0}),
    ],
)
def test_masks_leave_exactly_the_right_support(params, support):
    sp = [SamplingParams(**params)]
    logits = LOGITS.clone()
    _apply_top_k_top_p(logits, sp)
    _apply_min_p(logits, sp)
    assert finite_support(logits) == [support]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS[0], -1)
    order = probs.argsort(descending=True).tolist()
    cumulative = probs[order].cumsum(0).tolist()  # the first 2 cover cumulative[1]
    for p, expected_len in ((cumulative[1] - 1e-4, 2), (cumulative[1] + 1e-4, 3), (cumulative[4] - 1e-4, 5)):
        logits = LOGITS.clone()
        _apply_top_k_top_p(logits, [SamplingParams(top_p=p)])
        assert finite_support(logits) == [set(order[:expected_len])]


def test_top_k_and_top_p_per_row_in_one_batch():
    logits = LOGITS.repeat(3, 1)
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_p=1e-6)]
    _apply_top_k_top_p(logits, params)
    assert finite_support(logits) == [{0, 3}, set(range(V)), {0}]


def test_top_k_ties_keep_exactly_k():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    _apply_top_k_top_p(logits, [SamplingParams(top_k=2)])
    assert len(finite_support(logits)[0]) == 2


def test_sampled_tokens_stay_in_the_support():
    logits = LOGITS.repeat(500, 1)
    out = Sampler(V)(logits, [make_request(top_k=3, temperature=1.5) for _ in range(500)])
    assert set(out.token_ids) == {0, 3, 6}


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0, 1.0, 1.0, 1.0]])
    request = make_request(prompt=(0, 1), output=(1, 3), repetition_penalty=2.0)
    _apply_penalties(logits, [request])
    assert logits.tolist() == [[1.0, -4.0, 2.0, -4.0, 2.0, 1.0, 1.0, 1.0]]


def test_presence_and_frequency_penalties_over_output_only():
    logits = torch.zeros(2, V)
    requests = [
        make_request(prompt=(5, 5, 5), output=(1, 1, 2), frequency_penalty=0.5, presence_penalty=1.5),
        make_request(prompt=(1,), output=(2,)),  # no penalties: untouched in the same batch
    ]
    _apply_penalties(logits, requests)
    expected = [0.0] * V
    expected[1] = -(0.5 * 2 + 1.5)
    expected[2] = -(0.5 * 1 + 1.5)
    assert logits[0].tolist() == pytest.approx(expected)
    assert logits[1].tolist() == [0.0] * V


def test_all_penalties_together():
    logits = torch.tensor([[3.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    request = make_request(prompt=(0,), output=(1, 2, 2), repetition_penalty=1.5, frequency_penalty=1.0,
                           presence_penalty=0.25)
    _apply_penalties(logits, [request])
    expected = [3.0 / 1.5, -1.0 * 1.5 - 1.25, 0.5 / 1.5 - 2.25, 0, 0, 0, 0, 0]
    assert logits[0].tolist() == pytest.approx(expected)


def test_logit_bias_changes_the_greedy_choice():
    logits = LOGITS.repeat(2, 1)
    biased = make_request(temperature=0.0, logit_bias={5: 10.0, 0: -100.0}, logprobs=0)
    requests = [biased, make_request(temperature=0.0)]
    out = Sampler(V)(logits, requests)
    assert out.token_ids == [5, 0]
    # logprobs and chosen_logprobs still describe the raw logits
    assert out.chosen_logprobs[0] == pytest.approx(torch.log_softmax(LOGITS[0], -1)[5].item())


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 6], logits[0, 2] = 5.0, 4.0, 3.0  # eos 7, stop id 6
    early = make_request(output=(1,), eos=(7,), temperature=0.0, min_tokens=2, stop_token_ids=[6])
    assert Sampler(V)(logits, [early]).token_ids == [2]
    done = make_request(output=(1, 1), eos=(7,), temperature=0.0, min_tokens=2, stop_token_ids=[6])
    assert Sampler(V)(logits, [done]).token_ids == [7]
    ignore = make_request(output=(), eos=(7,), temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler(V)(logits, [ignore]).token_ids == [7]  # ignore_eos: eos is no stop, nothing to mask


def _run_steps(sampler, make_batch, position, steps=12):
    """Sample `steps` tokens for the request at `position` of batches that make_batch() builds."""
    batch = make_batch()
    tokens = []
    for _ in range(steps):
        logits = torch.randn(len(batch), 64)
        logits[position] = torch.linspace(-1, 1, 64)  # the tracked row always sees the same logits
        out = sampler(logits, batch)
        tokens.append(out.token_ids[position])
        for request, t in zip(batch, out.token_ids):
            request.append_token(t)
    return tokens


def test_seeded_rows_ignore_batch_composition_and_position():
    def seeded():
        return make_request(rid="seeded", seed=1234, temperature=1.0)

    alone = _run_steps(Sampler(64, default_seed=0), lambda: [seeded()], 0)
    crowd = _run_steps(
        Sampler(64, default_seed=99),
        lambda: [make_request(), make_request(seed=5), seeded(), make_request(temperature=0.0)],
        2,
    )
    assert alone == crowd
    assert len(set(alone)) > 1  # really sampled
    other_seed = _run_steps(Sampler(64), lambda: [make_request(seed=4321)], 0)
    assert other_seed != alone


def test_seeded_generator_survives_on_the_request():
    request = make_request(seed=7)
    sampler = Sampler(V)
    first = sampler(LOGITS, [request]).token_ids
    assert request.generator is not None
    state = request.generator.get_state()
    sampler(LOGITS, [request])
    assert not torch.equal(state, request.generator.get_state())  # advances: a new draw each step
    assert first[0] in range(V)


def test_the_engine_seed_makes_unseeded_rows_repeat_and_none_makes_them_fresh():
    cpu = torch.device("cpu")
    same = [Sampler(V, default_seed=7).generator(cpu).get_state() for _ in range(2)]
    fresh = [Sampler(V, default_seed=None).generator(cpu).get_state() for _ in range(2)]
    assert torch.equal(*same) and not torch.equal(*fresh)


def _expected_distribution(logits, temperature, top_p=1.0):
    probs = torch.softmax(logits / temperature, -1)
    sorted_probs, order = probs.sort(descending=True)
    keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
    truncated = torch.zeros_like(probs)
    truncated[order[keep]] = probs[order[keep]]
    return truncated / truncated.sum()


def _total_variation(tokens, expected):
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).double()
    return 0.5 * (counts / counts.sum() - expected.double()).abs().sum().item()


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (2.0, 0.95)])
def test_sampled_distribution_matches_softmax(temperature, top_p):
    n = 8000
    expected = _expected_distribution(LOGITS[0], temperature, top_p)
    out = Sampler(V, default_seed=3)(LOGITS.repeat(n, 1), [make_request(temperature=temperature, top_p=top_p)] * n)
    assert _total_variation(out.token_ids, expected) < 0.03  # sampling noise here is ~0.01
    assert set(out.token_ids) <= set(torch.nonzero(expected).flatten().tolist())


def test_seeded_rows_sample_the_softmax_distribution_too():
    n = 3000
    requests = [make_request(seed=s, temperature=0.8) for s in range(n)]
    out = Sampler(V)(LOGITS.repeat(n, 1), requests)
    assert _total_variation(out.token_ids, _expected_distribution(LOGITS[0], 0.8)) < 0.04


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_k():
    logits = LOGITS.repeat(3, 1)
    requests = [
        make_request(logprobs=3, temperature=0.0, logit_bias={4: 50.0}),  # bias picks 4; logprobs stay raw
        make_request(logprobs=0, temperature=0.5, repetition_penalty=1.3, presence_penalty=1.0, output=(0,)),
        make_request(),
    ]
    out = Sampler(V)(logits, requests)
    raw = torch.log_softmax(LOGITS[0], -1)
    first = out.logprobs[0]
    assert first.token_id == 4 and out.token_ids[0] == 4
    assert first.logprob == pytest.approx(raw[4].item())
    assert first.rank == 7  # 4 is the 7th most likely token of the raw logits
    assert list(first.top) == [0, 3, 6]
    assert list(first.top.values()) == pytest.approx(raw[[0, 3, 6]].tolist())
    second = out.logprobs[1]
    assert second.top == {} and second.logprob == pytest.approx(raw[second.token_id].item())
    assert second.rank == 1 + int((raw > raw[second.token_id]).sum())
    assert out.logprobs[2] is None
    assert out.chosen_logprobs[:2] == pytest.approx([raw[t].item() for t in out.token_ids[:2]])
    assert out.chosen_logprobs[2] is None


def test_compute_prompt_logprobs():
    logits = torch.randn(4, V)
    targets = torch.tensor([3, 0, 7, 7])
    entries = compute_prompt_logprobs(logits, targets, k=2)
    raw = torch.log_softmax(logits, -1)
    for j, entry in enumerate(entries):
        t = targets[j].item()
        assert entry.token_id == t and entry.logprob == pytest.approx(raw[j, t].item())
        assert entry.rank == 1 + int((raw[j] > raw[j, t]).sum())
        assert list(entry.top) == raw[j].topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits, targets, k=0)[0].top == {}


# -- fast paths against the general path --------------------------------------------------------
def _reference_top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
    """The definition, with a full sort of every row."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    sorted_logits.masked_fill_(torch.arange(vocab)[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params])[:, None]
    sorted_logits.masked_fill_((probs.cumsum(dim=-1) - probs >= top_p) & (top_p < 1.0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


@pytest.mark.parametrize("scale", [0.1, 8.0])  # flat rows: top_p's candidates fall short; peaked rows: they cover it
def test_top_k_top_p_from_candidates_equal_a_full_sort(scale):
    vocab = 3000  # more than TOP_P_CANDIDATES
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)) * scale
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=40), SamplingParams(top_k=2000, top_p=0.5),
              SamplingParams(), SamplingParams(top_p=0.99), SamplingParams(top_k=5, top_p=0.7)]
    fast = logits.clone()
    _apply_top_k_top_p(fast, params)
    assert finite_support(fast) == finite_support(_reference_top_k_top_p(logits, params))
    kept = fast.isfinite()
    assert torch.equal(fast[kept], logits[kept])


def _argmax_cases(vocab: int) -> torch.Tensor:
    x = torch.randn(12, vocab, generator=torch.Generator().manual_seed(2))
    x[1] = 1.0  # all tied: the first index
    x[2, [5, vocab - 3]] = 100.0  # tie across blocks (and across the kernel's lanes)
    x[3] = float("-inf")
    x[4, [BLOCK + 1, 2]] = float("nan")  # NaN counts as the max, first one wins
    x[5, -1] = 50.0
    x[6, [40, 8]] = 60.0  # tied in one lane of the kernel (32 apart), the later index seen first by no lane
    x[7, [vocab - 1, 3]] = float("inf")
    x[8, vocab - 2] = float("nan")  # a NaN past the last whole group of 32
    x[9] = float("-inf")
    x[9, vocab - 1] = -1.0  # the only finite value, in the tail
    x[10] = torch.randint(0, 3, (vocab,), generator=torch.Generator().manual_seed(3)).float()  # many ties
    return x


@pytest.mark.parametrize("vocab", [BLOCK * 3, 1000])  # whole blocks, and a padded last block
def test_argmax_in_blocks_equals_torch_argmax(vocab):
    x = _argmax_cases(vocab)
    assert torch.equal(argmax_in_blocks(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [BLOCK * 3, 1000, 49_152])
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_kernel_equals_torch_argmax(vocab, threads):
    """The C kernel (kernels/cpu_argmax.c) answers torch's argmax bit for bit, also on a view with padded columns
    (the sampler's logits[:, :vocab_size])."""
    kernel = cpu_argmax.argmax_for(torch.zeros(1, 8))
    if kernel is None:
        pytest.skip("no CPU kernels here (no AVX2 or no compiler)")
    padded = torch.full((12, vocab + 5), 1e9)
    padded[:, :vocab] = _argmax_cases(vocab)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x in (padded[:, :vocab], padded[:, :vocab].contiguous()):
            assert torch.equal(kernel(x), x.argmax(dim=-1))
        short = torch.randn(5, 7, generator=torch.Generator().manual_seed(4))  # all of it past the groups of 32
        short[1], short[2, [6, 1]] = float("-inf"), float("nan")
        assert torch.equal(kernel(short), short.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


def _batch(n_greedy, n_sampled, **params):
    return [make_request(rid=f"g{i}", temperature=0.0, **params) for i in range(n_greedy)] + [
        make_request(rid=f"s{i}", temperature=0.9, **params) for i in range(n_sampled)
    ]


@pytest.mark.parametrize("params", [{}, dict(repetition_penalty=1.3, output=(5, 9)), dict(logprobs=2)])
def test_greedy_rows_take_the_same_tokens_on_every_path(params):
    """All-greedy batch (argmax only), greedy rows among sampled ones, many chunks or one: same tokens."""
    logits = torch.randn(40, 1000, generator=torch.Generator().manual_seed(3))
    alone = Sampler(1000)(logits[:20], _batch(20, 0, **params))
    mixed = Sampler(1000)(logits, _batch(20, 20, **params))
    chunked = Sampler(1000, cpu_chunk_bytes=1)(logits, _batch(20, 20, **params))  # one row per chunk
    expected = logits[:20].clone()
    if "repetition_penalty" in params:
        _apply_penalties(expected, _batch(20, 0, **params))
    assert alone.token_ids == mixed.token_ids[:20] == chunked.token_ids[:20] == expected.argmax(-1).tolist()
    assert mixed.token_ids == chunked.token_ids  # the same uniforms, whatever the chunking
    if "logprobs" in params:
        raw = torch.log_softmax(logits, -1)
        chosen = [raw[i, t].item() for i, t in enumerate(mixed.token_ids)]
        assert mixed.chosen_logprobs == pytest.approx(chosen, abs=1e-5)
        assert alone.logprobs == mixed.logprobs[:20] == chunked.logprobs[:20]


def test_a_plain_greedy_step_takes_the_tokens_of_the_full_path():
    """Greedy rows without logprobs or logit processors skip to the argmax (the batch-1 fast path); a row asking for
    logprobs sends the batch through the full path: the same tokens, ties and NaN included, padded columns ignored."""
    logits = torch.randn(6, BLOCK * 2 + 8, generator=torch.Generator().manual_seed(4))
    logits[1, [3, BLOCK + 5]] = 9.0  # a tie across blocks: the first
    logits[2, 7] = float("nan")  # NaN counts as the max
    logits[3, -4:] = 99.0  # padded vocabulary columns
    vocab = BLOCK * 2 + 4
    plain = Sampler(vocab)(logits, [make_request(rid=f"g{i}", temperature=0.0) for i in range(6)])
    full = Sampler(vocab)(logits, [make_request(rid=f"g{i}", temperature=0.0, logprobs=0 if i == 5 else None)
                                   for i in range(6)])
    alone = [Sampler(vocab)(logits[i : i + 1], [make_request(temperature=0.0)]).token_ids[0] for i in range(6)]
    assert plain.token_ids == full.token_ids == alone == logits[:, :vocab].argmax(-1).tolist()
    assert plain.logprobs == plain.chosen_logprobs == [None] * 6


def test_grammar_rows_follow_their_chunk():
    vocab = 64
    bitmask = allocate_bitmask(4, vocab)
    bitmask[:2] = 0
    bitmask[0, 0] = 1 << 3  # row 1 of the batch may only emit token 3
    bitmask[1, 1] = 1 << 7  # row 4 only token 39
    requests = [make_request(rid=str(i), temperature=0.0) for i in range(6)]
    logits = torch.randn(6, vocab)
    for chunk_bytes in (1, 3 * 4 * vocab, 1 << 20):
        out = Sampler(vocab, cpu_chunk_bytes=chunk_bytes)(logits, requests, (bitmask, [1, 4]))
        assert out.token_ids[1] == 3 and out.token_ids[4] == 39
        assert [out.token_ids[i] for i in (0, 2, 3, 5)] == logits[[0, 2, 3, 5]].argmax(-1).tolist()


@pytest.mark.parametrize("vocab, temperature", [(BLOCK * 4, 1.0), (300, 0.6)])
def test_inverse_cdf_samples_the_softmax_distribution(vocab, temperature):
    """Unscaled rows and scaled ones; a padded last block when vocab % BLOCK."""
    n = 20000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) * 2
    row[BLOCK : 2 * BLOCK] = float("-inf")  # a whole block that can never win
    out = Sampler(vocab, default_seed=5)(row.repeat(n, 1), [make_request(temperature=temperature)] * n)
    expected = torch.softmax(row / temperature, -1)
    assert _total_variation(out.token_ids, expected) < 0.06  # noise at n=20000 over these supports: ~0.03
    assert not set(out.token_ids) & set(range(BLOCK, 2 * BLOCK))


def test_inverse_cdf_never_picks_an_empty_slice():
    widths = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]]).double()
    for u in (0.0, 0.5, 1 - 2**-53):
        index, inside = _pick(widths, torch.full((3,), u, dtype=torch.float64))
        assert widths[torch.arange(3), index].gt(0).all()
        assert ((0 <= inside) & (inside < 1)).all()
    index, _ = _pick(widths, torch.tensor([0.49, 0.99, 0.0], dtype=torch.float64))
    assert index.tolist() == [1, 0, 4]


def test_repetition_penalty_touches_exactly_the_seen_tokens():
    """The sparse update equals the dense definition: repeats, ids past the vocabulary, unpenalised rows."""
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(6)) * 3
    requests = [
        make_request(prompt=(4, 4, 9, 49), output=(9, 60, 0), repetition_penalty=1.7),  # 60: past the vocabulary
        make_request(prompt=(1, 2), output=(3,)),
        make_request(prompt=(7,), output=(7, 7, 8), repetition_penalty=0.8),
    ]
    expected = logits.clone()
    for i, r in enumerate(requests):
        p = r.sampling_params.repetition_penalty
        for t in set(r.all_token_ids) & set(range(vocab)):
            expected[i, t] = expected[i, t] / p if expected[i, t] > 0 else expected[i, t] * p
    _apply_penalties(logits, requests)
    assert torch.equal(logits, expected)
