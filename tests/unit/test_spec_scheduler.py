"""The scheduler with speculation, over thousands of randomised steps: drafts that are partly wrong, a stand-in
model, few pages (preemption), a small budget (chunked prefill), stop tokens met among accepted drafts. Every
request's output equals the plain run's, the cache's invariants hold after every step, a running request holds
exactly the pages of its verified tokens, and nothing leaks."""

from __future__ import annotations

import random

from banyan.config import SchedulerConfig
from banyan.kv_cache import KVCacheManager
from banyan.request import Request
from banyan.sampling_params import SamplingParams
from banyan.scheduler import SampledToken, Scheduler, StepResult
from banyan.spec.config import SpeculativeConfig
from banyan.spec.proposer import Proposer
from banyan.spec.speculator import Speculator

VOCAB = 13
EOS = 3


def model(tokens) -> int:
    """The stand-in target's greedy token after `tokens`: a function of the last two, so text repeats."""
    return (tokens[-1] * 5 + tokens[-2] * 3 + 1) % VOCAB


class NoisyProposer(Proposer):
    """Drafts the model's own continuation, each token wrong with probability 0.3 (then a random one)."""

    def __init__(self, rng: random.Random):
        self.rng, self.finished = rng, []

    def propose(self, request_id, token_ids, max_k):
        tokens, drafts = list(token_ids), []
        for _ in range(self.rng.randrange(max_k + 1)):
            token = model(tokens) if self.rng.random() < 0.7 else self.rng.randrange(VOCAB)
            drafts.append(token)
            tokens.append(token)
        return drafts

    def finish(self, request_id, output_token_ids):
        self.finished.append(request_id)


def step(scheduler: Scheduler) -> None:
    """schedule -> the stand-in model verifies greedily -> update, with the invariants checked."""
    batch = scheduler.schedule()
    result = StepResult()
    for item in batch.scheduled:
        if not item.samples:
            continue
        tokens = list(item.request.all_token_ids)
        if not item.draft_token_ids:
            result.sampled[item.request.request_id] = SampledToken(model(tokens), None)
            continue
        assert list(item.token_ids) == tokens[item.start :] + list(item.draft_token_ids)
        accepted = []
        for draft in item.draft_token_ids:
            if draft != model(tokens + accepted):
                break
            accepted.append(draft)
        result.verified[item.request.request_id] = [SampledToken(t, None) for t in accepted + [model(tokens + accepted)]]
    scheduler.update(batch, result)
    kv = scheduler.kv
    kv.check_integrity()
    for request in scheduler.running:
        assert len(kv.page_table(request.request_id)) == -(-request.num_computed_tokens // kv.page_size)
        assert request.num_computed_tokens < request.num_tokens  # the last token (the verifier's own) is not computed


def run(seed: int, speculate: bool) -> dict[str, list[int]]:
    rng = random.Random(seed)
    kv = KVCacheManager(num_pages=24, page_size=4)
    speculator = None
    if speculate:
        speculator = Speculator(SpeculativeConfig("ngram", 4, policy="fixed"))
        speculator.proposer = NoisyProposer(random.Random(seed + 1))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=6), kv, 64, speculator)
    requests = []
    for i in range(12):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 20))]
        max_tokens = rng.randrange(1, 30)
        request = Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                          eos_token_ids=(EOS,) if i % 3 == 0 else (), max_tokens=max_tokens, arrival_time=float(i))
        requests.append(request)
        scheduler.add_request(request)
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
    assert not scheduler.has_unfinished_requests() and kv.stats().num_in_use == 0
    if speculator is not None:
        assert sorted(speculator.proposer.finished) == sorted(r.request_id for r in requests)
        assert speculator.stats.num_accepted_tokens < speculator.stats.num_draft_tokens  # rejections happened
    return {r.request_id: list(r.output_token_ids) for r in requests}


def test_randomised_speculative_steps_keep_outputs_and_the_cache_exact():
    for seed in range(60):  # about 2,000 speculative steps, 70 preemptions
        assert run(seed, speculate=True) == run(seed, speculate=False)
