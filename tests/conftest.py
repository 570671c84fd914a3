"""For the whole suite: an engine on CPU without --kv-cache-memory gets a 1 GiB KV pool, as before pools were sized
from free memory (runner/memory.py). The suite starts many engines, several at once, on machines shared with other
work; servers it starts inherit the setting. Tests of the sizing itself unset it (monkeypatch.delenv)."""

import os

import pytest

os.environ.setdefault("BANYAN_CPU_KV_CACHE_MEMORY", "1GiB")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama checkpoint with its tokenizer (tests/factories.py), written once for the session."""
    from tests.factories import write_model_dir

    path = tmp_path_factory.mktemp("tiny_llama")
    write_model_dir(path, "llama", seed=0)
    return path
