"""EngineLoop: one in-process engine shared by many threads.

`LLM.generate` drives the engine from the caller's thread and returns when its batch is done. A program
language needs the other shape: many threads (programs, forked branches) each submit a request whenever
they reach a generation call, and all of them run together in one continuous batch. The loop owns the
engine on its own thread; `submit` may be called from any thread and returns a handle to wait on:

    thread A: loop.submit(ids, params) --inbox--> loop thread: add_request, step, step, ... --> handle A done
    thread B: loop.submit(ids, params) --inbox-/                 (A and B share every step)

While a loop runs, the LLM's own generate/chat/stream must not be used: the engine is not thread-safe.

Callers that submit together (the programs of a run_batch) register with `add_callers`. When the engine is
idle and a request arrives, the loop waits for every registered caller's request before the first step
(or until no request arrived for `gather_quiet_s`: a caller busy with something else), so calls made
together share their steps from the first. Without it the first arrival would step alone while the
others are still writing their prompts, and every round of calls that finish together would begin with
such a lone step. A running engine never waits: a late call joins the next step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from banyan.errors import BanyanError
from banyan.frontend.prepare import fan_out
from banyan.request import RequestStatus
from banyan.sampling_params import SamplingParams
from banyan.text.output_processor import OutputProcessor, PromptState, SequenceState
from banyan.text.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineLoopClosedError(BanyanError):
    """The loop was closed, or its engine failed; no request can run on it any more."""

    public_message = None


class Submission:
    """One submitted prompt: wait for its RequestOutput; `on_text` (if given) sees its text as it grows."""

    def __init__(self, on_text: Callable[[str], None] | None):
        self.on_text = on_text
        self.shown = 0  # characters of the first sequence already passed to on_text
        self._done = threading.Event()
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The output once every sequence ended (a failed one carries its error, as LLM.generate's); raises
        what refused the request (a typed error) or what ended the loop."""
        if not self._done.wait(timeout):
            raise TimeoutError("the request is still running")
        if self._error is not None:
            raise self._error
        return self._output

    def _finish(self, output: RequestOutput | None, error: BaseException | None = None) -> None:
        self._output, self._error = output, error
        self._done.set()


GATHER_QUIET_S = 0.02  # a few prompts' Python (chat, tokenize) under the GIL; short next to any step


class EngineLoop:
    def __init__(self, llm, gather_quiet_s: float = GATHER_QUIET_S):
        self.engine = llm.engine
        self.gather_quiet_s = gather_quiet_s
        self.tokenizer = llm.tokenizer
        self._processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._inbox: list[tuple[Submission, list[int], SamplingParams]] = []
        self._running: dict[str, Submission] = {}  # prompt key -> its submission
        self._wake = threading.Condition()
        self._callers = 0  # registered callers (add_callers)
        self._last_change = 0.0  # monotonic time of the latest submission or caller leaving
        self._closed: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="banyan-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               on_text: Callable[[str], None] | None = None) -> Submission:
        submission = Submission(on_text)
        with self._wake:
            if self._closed is not None:
                raise EngineLoopClosedError(f"the engine loop is closed: {self._closed}")
            self._inbox.append((submission, list(prompt_token_ids), params))
            self._last_change = time.monotonic()
            self._wake.notify()
        return submission

    def add_callers(self, count: int) -> None:
        """Register `count` callers that submit together (negative: unregister): while they run, an idle engine
        waits for each one's next request before stepping (see the module docstring)."""
        with self._wake:
            self._callers = max(0, self._callers + count)
            self._last_change = time.monotonic()
            self._wake.notify()

    def close(self) -> None:
        """Stop the loop; requests still running end with EngineLoopClosedError. Idempotent."""
        with self._wake:
            if self._closed is None:
                self._closed = EngineLoopClosedError("closed")
            self._wake.notify()
        self._thread.join()

    # -- the loop thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._take_inbox():
                self._step()
        except Exception as e:  # the engine failed: every request fails with it, none is lost
            logger.exception("the engine loop stopped: its engine failed")
            with self._wake:
                self._closed = EngineLoopClosedError(f"the engine failed: {e!r}")
        self._fail_all(self._closed)

    def _take_inbox(self) -> bool:
        """Add what was submitted; wait while there is nothing to do. False once closed."""
        with self._wake:
            while not self._inbox and not self.engine.has_unfinished_requests() and self._closed is None:
                self._wake.wait()
            if self._closed is not None:
                return False
            if not self.engine.has_unfinished_requests():
                self._gather_callers()
            inbox, self._inbox = self._inbox, []
        for submission, ids, params in inbox:
            self._add(submission, ids, params)
        return True

    def _gather_callers(self) -> None:
        """(Holding _wake, engine idle.) Wait until each registered caller's request is in, or no request came
        for gather_quiet_s. A caller that submits several (a select's options, a fork's branches) ends it early."""
        while len(self._inbox) < self._callers and self._closed is None:
            quiet_left = self._last_change + self.gather_quiet_s - time.monotonic()
            if quiet_left <= 0:
                return
            self._wake.wait(quiet_left)

    def _add(self, submission: Submission, ids: list[int], params: SamplingParams) -> None:
        key = f"lang-{next(self._ids)}"
        sequences = fan_out(key, params)
        added = []
        try:
            self.engine.check_prompt(ids)
            for s in sequences:
                added.append(self.engine.add_request(s.request_id, ids, s.params))
        except BanyanError as e:  # refused (a bad prompt or parameter): this request only
            self.engine.abort_requests([r.request_id for r in added])
            submission._finish(None, e)
            return
        states = [SequenceState(s.index, params, self.tokenizer, ids) for s in sequences]
        self._processor.add(PromptState(key, None, ids, states, metrics=added[0].metrics), [s.request_id for s in sequences])
        self._running[key] = submission

    def _step(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        to_abort = self._processor.process(self.engine.step())
        self.engine.abort_requests(to_abort, RequestStatus.FINISHED_STOPPED)
        for key, submission in self._running.items():
            if submission.on_text is not None:
                text = self._processor.prompts[key].sequences[0].text
                if len(text) > submission.shown:
                    submission.on_text(text[submission.shown:])
                    submission.shown = len(text)
        for key in self._processor.pop_finished():
            self._running.pop(key)._finish(self._processor.pop(key))

    def _fail_all(self, error: BaseException) -> None:
        try:
            self.engine.abort_requests(self._processor.unfinished_request_ids())
        except Exception:  # an engine that failed may fail again; the requests are answered below all the same
            logger.exception("aborting the engine loop's requests failed")
        with self._wake:
            inbox, self._inbox = self._inbox, []
        for submission in [s for s, _, _ in inbox] + list(self._running.values()):
            submission._finish(None, error)
        self._running.clear()
