"""@function, run and run_batch: a Python function over a ProgramState, run on a backend.

    @bl.function
    def qa(s, question):
        s += bl.user(question)
        s += bl.assistant(bl.gen("answer", max_tokens=64))

    state = qa.run(question="...", temperature=0)           # one program, on the default backend
    states = qa.run_batch([{"question": q} for q in qs])    # many at once: their calls share the engine's batches

A program that raises keeps the exception with its state (`state.error()`); run_batch returns every
program's state, failed or not.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from banyan.errors import InvalidParameterError
from banyan.lang.backend import Backend
from banyan.lang.ir import SamplingOptions
from banyan.lang.state import ProgramState

MAX_AUTO_THREADS = 128


@dataclass
class _Defaults:
    """The backend programs run on when run() names none (SGLang's set_default_backend)."""

    backend: Backend | None = None
    lock: threading.Lock = threading.Lock()


_default = _Defaults()


def set_default_backend(backend: Backend) -> None:
    with _default.lock:
        _default.backend = backend


def get_default_backend() -> Backend | None:
    return _default.backend


class Program:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(self, *args: Any, max_new_tokens: int | None = None, stop: str | list[str] | None = None,
            temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
            min_p: float | None = None, frequency_penalty: float | None = None,
            presence_penalty: float | None = None, ignore_eos: bool | None = None,
            stream: bool = False, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        """Run the program; the sampling settings are defaults for its gens (each gen's own win). With
        stream=True it runs in the background and the state is returned at once (read it with text_iter)."""
        defaults = SamplingOptions(max_new_tokens, None, stop, None, temperature, top_p, top_k, min_p,
                                   frequency_penalty, presence_penalty, ignore_eos)
        state = ProgramState(_backend(backend), defaults, stream=stream)
        if stream:
            threading.Thread(target=self._execute, args=(state, args, kwargs), daemon=True,
                             name="banyan-lang-program").start()
        else:
            self._execute(state, args, kwargs)
        return state

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any]], *, num_threads: int | str = "auto",
                  progress_bar: bool = False, backend: Backend | None = None, **sampling: Any) -> list[ProgramState]:
        """Run the program once per kwargs dict, `num_threads` at a time ("auto": all of them, up to 128);
        returns the states in order, each with its own result or error."""
        batch_kwargs = list(batch_kwargs)
        if num_threads == "auto":
            num_threads = max(1, min(len(batch_kwargs), MAX_AUTO_THREADS))
        if not isinstance(num_threads, int) or num_threads < 1:
            raise InvalidParameterError("num_threads", f"must be a positive integer or 'auto', got {num_threads!r}")
        backend = _backend(backend)
        if not batch_kwargs:
            return []
        from tqdm import tqdm

        running = _RunningPrograms(backend, min(num_threads, len(batch_kwargs)), len(batch_kwargs))

        def run_one(kwargs: dict[str, Any]) -> ProgramState:
            try:
                return self.run(backend=backend, **sampling, **kwargs)
            finally:
                running.program_ended()

        with running, ThreadPoolExecutor(num_threads, thread_name_prefix="banyan-lang-batch") as pool, \
                tqdm(total=len(batch_kwargs), disable=not progress_bar, desc="Programs") as bar:
            futures = [pool.submit(run_one, kwargs) for kwargs in batch_kwargs]
            for future in futures:
                future.add_done_callback(lambda _: bar.update(1))
            return [future.result() for future in futures]

    def _execute(self, state: ProgramState, args: tuple, kwargs: dict) -> None:
        try:
            self.fn(state, *args, **kwargs)
            state.sync()
        except Exception as e:  # the program's own exception, kept with its state
            state.sync()
            if state._error is None:
                state._error = e
        finally:
            state.end_stream()
            state.close()


class _RunningPrograms:
    """Keeps the backend told how many of a batch's programs run at once: min(num_threads, those not finished),
    so that the engine starts a batch with every running program's call in it (Backend.add_callers)."""

    def __init__(self, backend: Backend, num_threads: int, total: int):
        self.backend, self.unfinished, self.running = backend, total, num_threads
        self.lock = threading.Lock()

    def __enter__(self) -> _RunningPrograms:
        self.backend.add_callers(self.running)
        return self

    def program_ended(self) -> None:
        with self.lock:
            self.unfinished -= 1
            if self.running > self.unfinished:  # no program left to take the ended one's thread
                self.running -= 1
                self.backend.add_callers(-1)

    def __exit__(self, *_exc) -> None:
        with self.lock:
            self.backend.add_callers(-self.running)
            self.running = 0


def function(fn: Callable[..., Any] | None = None, **_options: Any) -> Program | Callable[[Callable], Program]:
    """Decorate a program: `@bl.function` or `@bl.function()` (SGLang's options are accepted and unused)."""
    if fn is None:
        return Program
    return Program(fn)


def _backend(backend: Backend | None) -> Backend:
    backend = backend or _default.backend
    if backend is None:
        raise InvalidParameterError("backend", "no backend: pass backend=... or call bl.set_default_backend(...)")
    return backend
