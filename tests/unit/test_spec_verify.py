"""The verifier: exact output law against the target's processed distribution (every path of the uniforms
enumerated), greedy acceptance, the bonus token, padding, and seeded reproducibility."""

import itertools

import pytest
import torch

from banyan.layers.sampler import Sampler, target_distribution
from banyan.request import Request
from banyan.sampling_params import SamplingParams
from banyan.spec.verify import AfterDrafts, draw_uniforms, verify, verify_plain_greedy

V = 5


def processed(logits, temperature=1.0, top_k=None):
    """A processed p: temperature-scaled softmax, optionally top-k (the rest exactly 0)."""
    p = torch.softmax(logits / temperature, dim=-1)
    if top_k is not None:
        p = torch.where(p >= p.topk(top_k).values[-1], p, 0.0)
    return p / p.sum()


def cells(breaks):
    """(midpoint, width) of each non-empty interval between sorted breakpoints in [0, 1]."""
    edges = sorted({0.0, 1.0, *(min(max(b, 0.0), 1.0) for b in breaks)})
    return [((a + b) / 2, b - a) for a, b in zip(edges, edges[1:]) if b - a > 1e-12]


def cdf(p):
    p = p.double()
    return (p.cumsum(0) / p.sum()).tolist()


def first_token_cells(p0, d, q):
    """The intervals of u_0 on which the verifier's decision at position 0 is constant."""
    if q is None:
        return cells(cdf(p0))  # x_0 = inverse CDF of p0
    r = min(1.0, p0[d].item() / q[d].item())
    residual = (p0 - q).clamp_min(0.0)
    tail = [r + (1 - r) * c for c in cdf(residual)] if r < 1 else []
    return cells([r, *tail])


def outcome_law(p0, p1, d, q):
    """{emitted tokens: probability} of one verify of the single draft d, from every cell of (u_0, u_1)."""
    grid = list(itertools.product(first_token_cells(p0, d, q), cells(cdf(p1))))
    n = len(grid)
    out = verify(
        torch.stack([p0, p1])[None].expand(n, 2, V),
        torch.full((n, 1), d),
        torch.ones(n, dtype=torch.long),
        None if q is None else q[None, None].expand(n, 1, V),
        greedy=[False] * n,
        uniforms=torch.tensor([[u0, u1] for (u0, _), (u1, _) in grid], dtype=torch.float64),
    )
    law = {}
    for tokens, ((_, w0), (_, w1)) in zip(out.token_ids, grid):
        law[tuple(tokens)] = law.get(tuple(tokens), 0.0) + w0 * w1
    return law


def check_law(law_by_draft, q_of, p0, p1_of):
    """First token ~ p0; given d accepted, the bonus ~ p1_of(d); a rejection emits one token."""
    first = torch.zeros(V, dtype=torch.float64)
    for d, law in law_by_draft.items():
        accepted = sum(w for tokens, w in law.items() if len(tokens) == 2)
        bonus = torch.zeros(V, dtype=torch.float64)
        for tokens, w in law.items():
            first[tokens[0]] += q_of(d) * w
            assert len(tokens) == 1 or tokens[0] == d
            if len(tokens) == 2:
                bonus[tokens[1]] += w / accepted
        if accepted > 0:
            torch.testing.assert_close(bonus, p1_of(d).double(), atol=1e-6, rtol=0)
    torch.testing.assert_close(first, p0.double(), atol=1e-6, rtol=0)


VARIANTS = [dict(), dict(temperature=0.5), dict(temperature=2.0), dict(top_k=2), dict(temperature=0.7, top_k=3)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_hot_drafts_emit_the_target_law_whatever_the_draft(variant):
    torch.manual_seed(0)
    p0 = processed(torch.randn(V) * 2, **variant)
    p1_of = {d: processed(torch.randn(V) * 2, **variant) for d in range(V)}
    for d in range(V):  # a deterministic proposer: each fixed draft alone must leave the law unchanged
        check_law({d: outcome_law(p0, p1_of[d], d, None)}, lambda _: 1.0, p0, p1_of.__getitem__)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("draft", ["random", "sparse", "equal", "disjoint-ish"])
def test_stochastic_drafts_emit_the_target_law(variant, draft):
    torch.manual_seed(1)
    p0 = processed(torch.randn(V) * 2, **variant)
    q = {
        "random": processed(torch.randn(V) * 2),
        "sparse": processed(torch.randn(V) * 2, top_k=2),  # q is 0 where p is not
        "equal": p0.clone(),  # every draft is accepted
        "disjoint-ish": processed(-torch.log(p0.clamp_min(1e-9))),  # q large where p is small
    }[draft]
    p1_of = {d: processed(torch.randn(V) * 2, **variant) for d in range(V)}
    laws = {d: outcome_law(p0, p1_of[d], d, q) for d in range(V) if q[d] > 0}
    check_law(laws, lambda d: q[d].item(), p0, p1_of.__getitem__)
    if draft == "equal":
        assert all(len(tokens) == 2 for law in laws.values() for tokens in law)


def greedy_probs(argmaxes):
    """[1, len, V] rows whose argmax is each of `argmaxes`."""
    p = torch.full((len(argmaxes), V), 0.1)
    p[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.6
    return p[None]


@pytest.mark.parametrize("q", [None, "draft model"])
@pytest.mark.parametrize(
    "drafts, argmaxes, accepted, emitted",
    [
        ([1, 2, 3], [1, 2, 4, 0], 2, [1, 2, 4]),  # stops at the first mismatch, emits the target's argmax there
        ([1, 2, 3], [1, 2, 3, 0], 3, [1, 2, 3, 0]),  # all accepted: the bonus from the last position
        ([1, 2, 3], [4, 2, 3, 0], 0, [4]),  # all rejected: exactly the plain greedy token
    ],
)
def test_greedy_accepts_while_the_draft_is_the_argmax(drafts, argmaxes, accepted, emitted, q):
    q = None if q is None else torch.full((1, 3, V), 1.0 / V)
    out = verify(greedy_probs(argmaxes), torch.tensor([drafts]), torch.tensor([3]), q, greedy=[True])
    assert out.num_accepted == [accepted] and out.token_ids == [emitted]


def test_plain_greedy_requests_take_verifys_tokens_from_one_argmax_of_their_rows():
    """verify_plain_greedy (the runner's path where every request is greedy with nothing changing its logits): the
    same counts and tokens as verify, from the raw rows laid end to end (1 + k_b per request, no padding)."""
    gen = torch.Generator().manual_seed(3)
    drafts = [[5, 9, 2], [], [7], [1, 4, 4, 8, 0]]
    vocab = 12
    rows = torch.randn(sum(1 + len(d) for d in drafts), vocab, generator=gen)
    first = 0
    for d in drafts:  # make each request's first drafts the argmax of their rows, up to a point
        for j, token in enumerate(d[:2]):
            rows[first + j, token] = 10.0
        first += 1 + len(d)
    width = 1 + max(map(len, drafts))
    padded, first = [], 0
    for d in drafts:  # verify's layout: K + 1 rows per request, the last repeated
        padded += [rows[first + min(j, len(d))] for j in range(width)]
        first += 1 + len(d)
    want = verify(torch.stack(padded).view(len(drafts), width, vocab),
                  torch.tensor([d + [0] * (width - 1 - len(d)) for d in drafts]),
                  torch.tensor([len(d) for d in drafts]), greedy=[True] * len(drafts))
    got = verify_plain_greedy(rows, drafts)
    assert got == want and got.num_accepted == [2, 0, 1, 2]


def test_padding_past_num_drafts_is_never_accepted_and_k0_is_plain_decoding():
    p = torch.cat([greedy_probs([1, 2, 3]), greedy_probs([4, 2, 3])])
    out = verify(p, torch.tensor([[1, 2], [4, 2]]), torch.tensor([1, 0]), greedy=[True, True])
    assert out.num_accepted == [1, 0]
    assert out.token_ids == [[1, 2], [4]]  # row 0: bonus at position 1; row 1 (k = 0): the argmax of p_0


def test_no_drafts_is_one_plain_draw_and_a_forbidden_draft_is_never_accepted():
    torch.manual_seed(4)
    p = torch.stack([processed(torch.randn(V), top_k=2) for _ in range(4)]).view(2, 2, V)
    u = torch.tensor([[0.3, 0.9], [0.3, 0.9]], dtype=torch.float64)
    q = torch.full((2, 1, V), 1.0 / V)
    out = verify(p[:, :1], torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), q[:, :0],
                 greedy=[False, False], uniforms=u[:, :1])
    plain = verify(p[:, :1], torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                   greedy=[False, False], uniforms=u[:, :1])
    assert out == plain and out.num_accepted == [0, 0]
    forbidden = int(p[0, 0].argmin())  # top_k = 2 of 5: p = 0 there
    q[0, 0, forbidden] = 0.0  # even a draft its q did not allow
    out = verify(p, torch.tensor([[forbidden], [forbidden]]), torch.tensor([1, 1]), q, greedy=[False, False],
                 uniforms=torch.zeros(2, 2, dtype=torch.float64))
    assert out.num_accepted[0] == 0 and out.token_ids[0] != [forbidden]


def test_mixed_batch_greedy_and_sampled_rows():
    p = torch.cat([greedy_probs([1, 2]), greedy_probs([1, 2])])
    q = torch.full((2, 1, V), 1.0 / V)
    out = verify(p, torch.tensor([[1], [1]]), torch.tensor([1, 1]), q, greedy=[True, False],
                 uniforms=torch.tensor([[0.99, 0.99], [0.0, 0.0]], dtype=torch.float64))
    assert out.token_ids[0] == [1, 2]  # greedy ignores the uniforms
    assert out.token_ids[1] == [1, 0]  # u = 0 accepts (r > 0) and draws token 0 from p_1


def seeded_run(seed, companions):
    torch.manual_seed(123)  # row 0 is the same request every time; the companions differ with their number
    p = processed(torch.cat([torch.randn(1, 4, V), torch.randn(companions, 4, V) * 3]))
    drafts = torch.cat([torch.tensor([[1, 2, 3]]), torch.randint(0, V, (companions, 3))])
    generators = [torch.Generator().manual_seed(seed)] + [None] * companions
    shared = torch.Generator().manual_seed(999 + companions)
    return verify(p, drafts, torch.full((1 + companions,), 3), greedy=[False] * (1 + companions),
                  generators=generators, default_generator=shared)


def test_seeded_rows_are_reproducible_whatever_the_batch():
    runs = [seeded_run(7, companions) for companions in (0, 3, 3, 8)]
    firsts = {tuple(r.token_ids[0]) for r in runs}
    assert len(firsts) == 1
    assert runs[1].token_ids == runs[2].token_ids  # same seeds everywhere: the same batch output
    assert len({tuple(seeded_run(s, 0).token_ids[0]) for s in range(20)}) > 1  # the seed matters


def test_draw_uniforms_takes_a_seeded_row_from_its_own_generator():
    generator = torch.Generator().manual_seed(5)
    u, states = draw_uniforms(3, 4, [(1, generator)], torch.Generator().manual_seed(0), "cpu")
    expected = torch.rand(4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert torch.equal(u[1], expected) and u.dtype == torch.float64 and ((0 <= u) & (u < 1)).all()
    assert len(states[1]) == 4 and list(states) == [1]


def test_a_seeded_generator_moves_one_draw_per_emitted_token():
    p = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0]).expand(2, 3, V)
    generators = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]
    out = verify(p, torch.tensor([[4, 4], [4, 4]]), torch.tensor([2, 2]), greedy=[False, True], generators=generators)
    assert out.num_accepted == [0, 0]  # p(4) = 0: rejected at once, one token emitted of the three drawn
    reference = torch.Generator().manual_seed(5)
    torch.rand(1, generator=reference, dtype=torch.float64)
    assert torch.equal(generators[0].get_state(), reference.get_state())
    assert torch.equal(generators[1].get_state(), torch.Generator().manual_seed(6).get_state())  # greedy: no draw


def test_seeded_speculation_samples_what_the_plain_sampler_samples_whatever_k():
    """Deterministic drafts, a random k each step: the same tokens as the plain Sampler with the same seed."""
    torch.manual_seed(0)
    table = processed(torch.randn(V, V) * 1.5)  # a Markov target: p(next | last token)
    plain = Request("plain", [0], SamplingParams(seed=11, max_tokens=60), max_tokens=60)
    sampler = Sampler(V)
    while plain.num_output_tokens < 45:
        plain.append_token(sampler(table[plain.all_token_ids[-1]].log()[None], [plain]).token_ids[0])
    rng = torch.Generator().manual_seed(1)
    tokens, generator = [0], torch.Generator().manual_seed(11)
    while len(tokens) < 41:
        k = int(torch.randint(0, 4, (1,), generator=rng))
        drafts = [int(t) for t in torch.randint(0, V, (k,), generator=rng)]
        drafts[: k // 2] = plain.all_token_ids[len(tokens) : len(tokens) + k // 2]  # some drafts right
        contexts = torch.tensor([tokens[-1], *drafts])
        out = verify(table[contexts][None], torch.tensor([drafts]).view(1, k), torch.tensor([k]), greedy=[False],
                     generators=[generator])
        tokens += out.token_ids[0]
    assert tokens[:41] == list(plain.all_token_ids[:41])


@pytest.mark.parametrize("params", [dict(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4),
                                    dict(temperature=0.8, repetition_penalty=1.6),
                                    dict(temperature=0.0, min_tokens=3, stop_token_ids=[2]),
                                    dict(temperature=0.5, top_k=3, logit_bias={1: 0.5}, presence_penalty=1.0)])
def test_verify_position_j_is_processed_as_the_plain_sampler_after_the_j_drafts_before_it(params):
    """target_distribution's row for AfterDrafts(request, d_1 .. d_j) equals the row of the same request with d_1 .. d_j
    appended as output: penalties count the drafts, min_tokens counts them as output, from one row to the next."""
    torch.manual_seed(3)
    drafts = [2, 4, 2, 2]  # repeats: each position's penalties differ from the one before
    request = Request("r", [1, 3], SamplingParams(max_tokens=50, **params), eos_token_ids=[0], max_tokens=50)
    request.append_token(4)
    raw = torch.randn(len(drafts) + 1, V)
    got = target_distribution(raw, [AfterDrafts(request, drafts[:j]) for j in range(len(drafts) + 1)])
    for j in range(len(drafts) + 1):
        plain = Request("p", [1, 3], SamplingParams(max_tokens=50, **params), eos_token_ids=[0], max_tokens=50)
        for token in [4, *drafts[:j]]:
            plain.append_token(token)
        want = target_distribution(raw[j : j + 1], [plain])
        torch.testing.assert_close(got[j : j + 1], want, rtol=0, atol=0)
    ignoring = target_distribution(raw, [AfterDrafts(request, ())] * (len(drafts) + 1))
    assert not torch.equal(got, ignoring)  # the drafts change what later positions draw from
