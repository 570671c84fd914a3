"""The engine's grammar side: one backend and its compile cache, built on the first constrained request.

    engine.add_request -> grammars.start(request)   request.grammar: a future of its matcher (JSON left
                                                    to the engine's whitespace default gets it here)
    scheduler.schedule -> a done future moves the request from WAITING_FOR_GRAMMAR to WAITING
    runner.execute     -> the backend (handed to the runner once, through on_build) fills the constrained
                          rows' bitmask

Unconstrained traffic never loads a grammar library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

from banyan.errors import InvalidParameterError
from banyan.request import Request
from banyan.structured import GrammarBackend, GrammarCache, make_backend
from banyan.structured.spec import default_compact


class Grammars:
    def __init__(
        self,
        backend_name: str,
        tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = 512,
        options: dict | None = None,
        on_build: Callable[[GrammarBackend], None] | None = None,
    ):
        """options: ModelConfig.structured_outputs_config (checked here: InvalidParameterError).
        on_build(backend): called once, when the first constrained request loads the backend."""
        self.backend_name = backend_name
        self.compact = default_compact(options)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids) or None
        self.cache_size = cache_size
        self.on_build = on_build
        self.backend: GrammarBackend | None = None
        self.cache: GrammarCache | None = None

    def start(self, request: Request) -> None:
        """Begin compiling the request's grammar (off this thread); request.grammar: its matcher's future."""
        if self.cache is None:
            self._build()
        matcher: Future = Future()
        backend = self.backend

        def done(compiled: Future) -> None:
            try:
                matcher.set_result(backend.matcher(compiled.result()))
            except Exception as e:  # StructuredOutputError: the scheduler fails the request with it
                matcher.set_exception(e)

        spec = request.sampling_params.structured_outputs.with_default_whitespace(self.compact)
        self.cache.compile_async(spec).add_done_callback(done)
        request.grammar = matcher

    def wait(self, requests: Sequence[Request], timeout: float) -> None:
        """Block until one of the requests' grammars is ready (or the timeout): nothing else to run."""
        pending = [r.grammar for r in requests if r.grammar is not None]
        if pending:
            wait(pending, timeout, FIRST_COMPLETED)

    def stats(self) -> dict[str, int]:
        """The compile cache's counters (GrammarCache.stats); empty before the first constrained request."""
        return self.cache.stats() if self.cache is not None else {}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def _build(self) -> None:
        try:
            self.backend = make_backend(self.backend_name, self.tokenizer, self.vocab_size, self.eos_token_ids)
        except ValueError as e:
            raise InvalidParameterError("structured_outputs", str(e)) from None
        self.cache = GrammarCache(self.backend, max_entries=self.cache_size)
        if self.on_build is not None:
            self.on_build(self.backend)
