"""EngineLoop: one engine, requests submitted from many threads at once; each gets its own output (as
LLM.generate gives it), a refused request fails alone, and closing the loop answers what was still running."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from banyan import LLM, SamplingParams
from banyan.errors import InvalidParameterError
from banyan.frontend.engine_loop import EngineLoop, EngineLoopClosedError
from tests.factories import write_model_dir

PROMPTS = [[5 + i, 6 + i, 7 + i, 8 + i, 9 + i] for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_engine_loop")
    write_model_dir(path, "llama", seed=9)
    return path


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(str(model_dir), block_size=4, num_threads=1, max_model_len=128)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_threads_submit_together_and_each_gets_its_output(model_dir, expected):
    loop = EngineLoop(LLM(str(model_dir), block_size=4, num_threads=1, max_model_len=128))
    streamed = {i: [] for i in range(len(PROMPTS))}
    try:
        def one(i):
            submission = loop.submit(PROMPTS[i], GREEDY, on_text=streamed[i].append)
            return submission.result(timeout=120)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outputs = list(pool.map(one, range(len(PROMPTS))))
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert ["".join(streamed[i]) for i in range(len(PROMPTS))] == [out.outputs[0].text for out in outputs]
        with pytest.raises(InvalidParameterError, match="empty"):
            loop.submit([], GREEDY).result(timeout=60)
        assert loop.submit(PROMPTS[0], GREEDY).result(timeout=60).outputs[0].token_ids == expected[0]
    finally:
        loop.close()
    assert not loop.engine.has_unfinished_requests()


def test_closing_answers_every_request(model_dir):
    loop = EngineLoop(LLM(str(model_dir), block_size=4, num_threads=1, max_model_len=128))
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    pending = [loop.submit(p, long) for p in PROMPTS]
    loop.close()
    for submission in pending:
        try:
            submission.result(timeout=60)  # finished before the close, or
        except EngineLoopClosedError:
            pass  # answered by it; never left waiting
    with pytest.raises(EngineLoopClosedError):
        loop.submit(PROMPTS[0], long)
    assert not loop.engine.has_unfinished_requests()
