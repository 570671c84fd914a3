"""GrammarCache: compiled grammars by canonical spec, bounded, compiled off the caller's thread.

    cache = GrammarCache(backend)                  # one per engine
    future = cache.compile_async(spec)             # never blocks; the request waits (WAITING_FOR_GRAMMAR)
    ... each step: if future.done(): compiled = future.result()   # or StructuredOutputError
    matcher = backend.matcher(compiled)

- Hits return an already-completed future; concurrent requests for one spec share one compile.
- LRU over both an entry count and a byte budget (RELIABILITY C4 G5): unique schemas never grow
  memory without bound. Entries still used by running matchers stay alive through those matchers.
- A compile that has not finished `compile_timeout_s` after it was asked for (queueing included)
  fails its future with StructuredOutputError (C4 G3). The library call itself cannot be
  interrupted: its thread finishes in the background and the result is dropped. Failures are
  remembered (bounded), so resending a bomb costs nothing and never takes a second thread.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

from banyan.structured.backend import CompiledGrammar, GrammarBackend, library_message
from banyan.structured.spec import StructuredOutputError, StructuredOutputSpec


class GrammarCache:
    def __init__(
        self,
        backend: GrammarBackend,
        max_entries: int = 512,
        max_bytes: int = 512 * 1024 * 1024,
        compile_timeout_s: float = 5.0,
        num_threads: int = 2,
        max_errors: int = 1024,
    ):
        self.backend = backend
        self.max_entries, self.max_bytes, self.max_errors = max_entries, max_bytes, max_errors
        self.compile_timeout_s = compile_timeout_s
        self._entries: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._errors: OrderedDict[str, StructuredOutputError] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._bytes = 0
        self._counts = dict(hits=0, misses=0, evictions=0, timeouts=0, errors=0)
        self._cond = threading.Condition()
        self._deadlines: list[tuple[float, int, str, Future, StructuredOutputSpec]] = []  # heap
        self._seq = itertools.count()
        self._closed = False
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="banyan-grammar")
        self._reaper = threading.Thread(target=self._expire_loop, name="banyan-grammar-timeouts", daemon=True)
        self._reaper.start()

    # -- public ------------------------------------------------------------------------------------
    def compile_async(self, spec: StructuredOutputSpec) -> Future[CompiledGrammar]:
        """A future of the compiled grammar; it fails with StructuredOutputError, at the latest
        compile_timeout_s from now."""
        key = spec.cache_key
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar cache is closed")
            if key in self._entries:
                self._entries.move_to_end(key)
                self._counts["hits"] += 1
                return _done(result=self._entries[key])
            if key in self._errors:
                self._counts["hits"] += 1
                return _done(error=self._errors[key])
            if key in self._pending:
                return self._pending[key]
            self._counts["misses"] += 1
            future: Future[CompiledGrammar] = Future()
            self._pending[key] = future
            heapq.heappush(self._deadlines, (time.monotonic() + self.compile_timeout_s, next(self._seq), key, future, spec))
            self._cond.notify()
        self._pool.submit(self._compile, key, spec, future)
        return future

    def get(self, spec: StructuredOutputSpec, timeout: float | None = None) -> CompiledGrammar:
        """Blocking form of compile_async (tests, tools); raises StructuredOutputError."""
        return self.compile_async(spec).result(timeout)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, int]:
        with self._cond:
            return dict(self._counts, entries=len(self._entries), bytes=self._bytes, pending=len(self._pending))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- workers -----------------------------------------------------------------------------------
    def _compile(self, key: str, spec: StructuredOutputSpec, future: Future) -> None:
        if future.done():  # timed out while queued
            return
        try:
            compiled = self.backend.compile(spec)
            if compiled.size_bytes > self.max_bytes:
                raise spec.error(f"the compiled grammar needs {compiled.size_bytes} bytes, over the cache's {self.max_bytes}")
        except StructuredOutputError as e:
            self._finish(key, future, error=e)
        except Exception as e:  # a library failure ends this request only (RELIABILITY C4)
            self._finish(key, future, error=spec.error(f"{self.backend.name} failed to compile: {library_message(e)}"))
        else:
            self._finish(key, future, result=compiled)

    def _finish(self, key: str, future: Future, result: CompiledGrammar | None = None, error: Exception | None = None) -> None:
        with self._cond:
            if self._pending.get(key) is not future or future.done():
                return  # timed out meanwhile: the timeout error stands
            del self._pending[key]
            if error is None:
                self._insert(key, result)
            else:
                self._remember_error(key, error)
        try:
            future.set_result(result) if error is None else future.set_exception(error)
        except InvalidStateError:  # cancelled by the caller
            pass

    def _insert(self, key: str, compiled: CompiledGrammar) -> None:
        self._entries[key] = compiled
        self._bytes += compiled.size_bytes
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size_bytes
            self._counts["evictions"] += 1

    def _remember_error(self, key: str, error: Exception) -> None:
        self._counts["errors"] += 1
        self._errors[key] = error
        while len(self._errors) > self.max_errors:
            self._errors.popitem(last=False)

    def _expire_loop(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0][0] <= now or self._deadlines[0][3].done()):
                    _, _, key, future, spec = heapq.heappop(self._deadlines)
                    if future.done() or self._pending.get(key) is not future:
                        continue
                    del self._pending[key]
                    error = spec.error(
                        f"compiling the grammar took longer than {self.compile_timeout_s:g} s; simplify it"
                    )
                    self._counts["timeouts"] += 1
                    self._remember_error(key, error)
                    try:
                        future.set_exception(error)
                    except InvalidStateError:
                        pass
                self._cond.wait(self._deadlines[0][0] - now if self._deadlines else None)


def _done(result: CompiledGrammar | None = None, error: Exception | None = None) -> Future:
    future: Future = Future()
    future.set_result(result) if error is None else future.set_exception(error)
    return future
