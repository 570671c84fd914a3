"""For the whole suite: an engine on CPU without --kv-cache-memory gets a 1 GiB KV pool, as before pools were sized
from free memory (runner/memory.py). The suite starts many engines, several at once, on machines shared with other
work; servers it starts inherit the setting. Tests of the sizing itself unset it (monkeypatch.delenv).

Tests marked `long` (minutes each, and a shorter test in the default run covers the same path) run only with
BANYAN_LONG_TESTS=1 (`make test-long`): the default run, CI's, must stay within its time on two cores."""

import os

import pytest

os.environ.setdefault("BANYAN_CPU_KV_CACHE_MEMORY", "1GiB")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("BANYAN_LONG_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="the long tier: BANYAN_LONG_TESTS=1 (make test-long) runs it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama checkpoint with its tokenizer (tests/factories.py), written once for the session."""
    from tests.factories import write_model_dir

    path = tmp_path_factory.mktemp("tiny_llama")
    write_model_dir(path, "llama", seed=0)
    return path
