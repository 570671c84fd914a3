"""How run_batch feeds bl.Engine: every step of a batch of multi-call programs holds every program's call, from
the first step on and again after each round of calls that ended together; a program busy with something else
holds the others back for no longer than the loop's quiet period (never a hang)."""

from __future__ import annotations

import threading

import pytest

import banyan.lang as bl
from tests.factories import write_model_dir

pytestmark = pytest.mark.slow

PROGRAMS, ROUNDS, TOKENS = 8, 3, 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_lang_batching")
    write_model_dir(path, "llama", seed=11)
    backend = bl.Engine(str(path), block_size=4, num_threads=1, max_model_len=256)
    yield backend
    backend.close()


@pytest.fixture
def steps(engine):
    """The number of requests the engine holds before each step."""
    seen = []
    hook = lambda e: seen.append(len(e.scheduler.running) + len(e.scheduler.waiting))  # noqa: E731
    engine.llm.engine.before_step.append(hook)
    yield seen
    engine.llm.engine.before_step.remove(hook)


@bl.function
def rounds(s, index: int):
    s += f"Program {index} says"
    for r in range(ROUNDS):
        s += bl.gen(f"round{r}", max_tokens=TOKENS, ignore_eos=True)


def test_every_step_holds_every_programs_call(engine, steps):
    engine.loop.gather_quiet_s = 30.0  # only the callers' count decides when a step starts: no timing in the test
    try:
        states = rounds.run_batch([{"index": i} for i in range(PROGRAMS)], temperature=0, backend=engine)
    finally:
        engine.loop.gather_quiet_s = 0.02
    assert all(s.error() is None for s in states)
    # each round: one step for the prompt (and first token), one for the second token; all programs in each
    assert steps == [PROGRAMS] * (ROUNDS * TOKENS)
    alone = [rounds.run(index=i, temperature=0, backend=engine) for i in range(PROGRAMS)]
    assert [s.text() for s in states] == [s.text() for s in alone]


def test_a_program_busy_elsewhere_does_not_hold_the_batch(engine):
    engine.loop.gather_quiet_s = 0.05
    first_done = threading.Event()

    @bl.function
    def waits_for_the_other(s, index: int):
        if index == 1:  # waits on program 0's answer: a loop that waited for this program's call would hang
            assert first_done.wait(timeout=60), "program 0 was held back by program 1"
        s += f"Program {index} says" + bl.gen("answer", max_tokens=TOKENS)
        s["answer"]
        first_done.set()

    states = waits_for_the_other.run_batch([{"index": 0}, {"index": 1}], temperature=0, backend=engine)
    assert [s.error() for s in states] == [None, None]
    assert engine.loop._callers == 0
