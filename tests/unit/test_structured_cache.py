"""GrammarCache: bounded (C4 G5), asynchronous with a compile timeout (C4 G3), shared compiles."""

from __future__ import annotations

import threading
import time

import pytest

from banyan.structured import GrammarCache, StructuredOutputError, StructuredOutputSpec
from banyan.structured.backend import CompiledGrammar
from tests.unit.structured_helpers import BACKEND_NAMES, backend


class SlowBackend:
    """Wraps a real backend; compiles of specs whose regex starts with "slow" block until released."""

    name = "slow"

    def __init__(self, inner):
        self.inner, self.release, self.compiles = inner, threading.Event(), 0

    def compile(self, spec):
        self.compiles += 1
        if spec.kind == "regex" and spec.text.startswith("slow"):
            self.release.wait(10)
        return self.inner.compile(spec)


def _schema(i: int) -> StructuredOutputSpec:
    return StructuredOutputSpec.json({"type": "object", "properties": {f"field_{i}": {"type": "integer"}}})


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_g5_a_thousand_unique_schemas_keep_the_cache_bounded(name):
    cache = GrammarCache(backend(name), max_entries=64, max_bytes=64 * 1024 * 1024)
    try:
        futures = [cache.compile_async(_schema(i)) for i in range(1000)]
        for f in futures:
            assert isinstance(f.result(30), CompiledGrammar)
        stats = cache.stats()
        assert len(cache) == stats["entries"] == 64 and stats["evictions"] == 1000 - 64
        assert 0 < cache.size_bytes <= 64 * 1024 * 1024 and stats["pending"] == 0
        assert cache.get(_schema(999)) is futures[999].result()  # the most recent stayed
    finally:
        cache.close()


def test_the_byte_budget_evicts_too():
    compiled = backend("llguidance").compile(_schema(0))
    cache = GrammarCache(backend("llguidance"), max_entries=1000, max_bytes=3 * compiled.size_bytes)
    try:
        for i in range(10):
            cache.get(_schema(i))
        assert len(cache) <= 3 and cache.size_bytes <= 3 * compiled.size_bytes
    finally:
        cache.close()


def test_hits_and_concurrent_requests_share_one_compile():
    slow = SlowBackend(backend("llguidance"))
    cache = GrammarCache(slow)  # type: ignore[arg-type]
    try:
        spec = StructuredOutputSpec.regex("slow[0-9]+")
        first, second = cache.compile_async(spec), cache.compile_async(spec)
        assert first is second and not first.done()
        slow.release.set()
        compiled = first.result(5)
        assert cache.compile_async(spec).result(0) is compiled  # a hit: already done
        assert slow.compiles == 1 and cache.stats()["hits"] == 1
    finally:
        cache.close()


def test_g3_a_compile_that_hangs_times_out_without_blocking_other_requests():
    slow = SlowBackend(backend("llguidance"))
    cache = GrammarCache(slow, compile_timeout_s=0.5, num_threads=2)  # type: ignore[arg-type]
    try:
        start = time.monotonic()
        stuck = cache.compile_async(StructuredOutputSpec.regex("slow-bomb"))
        assert time.monotonic() - start < 0.1  # the caller never waits
        other = cache.get(StructuredOutputSpec.regex("[0-9]+"), timeout=5)  # the second thread serves it
        assert other.spec.text == "[0-9]+"
        with pytest.raises(StructuredOutputError, match="longer than 0.5 s") as e:
            stuck.result(5)
        assert e.value.param == "structured_outputs.regex"
        assert time.monotonic() - start < 2.0
        # asking again answers from memory: no second thread is tied up by the same bomb
        with pytest.raises(StructuredOutputError):
            cache.compile_async(StructuredOutputSpec.regex("slow-bomb")).result(0)
        assert slow.compiles == 2 and cache.stats()["timeouts"] == 1
    finally:
        slow.release.set()
        cache.close()


def test_errors_are_remembered_and_bounded():
    cache = GrammarCache(backend("llguidance"), max_errors=5)
    try:
        for i in range(10):
            with pytest.raises(StructuredOutputError):
                cache.get(StructuredOutputSpec.regex(f"({i}"))
        assert len(cache._errors) == 5 and cache.stats()["errors"] == 10
    finally:
        cache.close()


def test_a_library_crash_becomes_a_structured_output_error():
    class Broken:
        name = "broken"

        def compile(self, spec):
            raise RuntimeError("internal error in the grammar library")

    cache = GrammarCache(Broken())  # type: ignore[arg-type]
    try:
        with pytest.raises(StructuredOutputError, match="broken failed to compile: internal error"):
            cache.get(StructuredOutputSpec.regex("a"))
    finally:
        cache.close()
