"""bl.Engine: programs on banyan in this process.

Every gen, select option and prefix warm-up is an ordinary engine request submitted through one
EngineLoop, so the calls of all running programs (run_batch, fork branches) share the engine's batches,
and a fork's branches find the parent's pages in the radix tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from banyan.errors import BanyanError
from banyan.lang.backend import (
    Backend, GenCall, GenResult, SelectCall, SelectResult, choose_normalized, finish_reason_meta, option_start,
    structured_outputs,
)
from banyan.lang.errors import BackendError, BackendUnavailableError


class Engine(Backend):
    """banyan in process: `bl.Engine(model=..., **engine_args)` (the LLM's settings; model: the default one)."""

    def __init__(self, model: str | None = None, *, llm=None, **engine_args: Any):
        """llm: an LLM to run on (its engine then belongs to this backend); else one is built from the arguments."""
        super().__init__()
        from banyan.frontend.engine_loop import EngineLoop
        from banyan.frontend.llm import LLM

        if llm is None:
            llm = LLM(model, **engine_args) if model is not None else LLM(**engine_args)
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.loop = EngineLoop(llm)

    def render_chat(self, messages: list[dict]) -> str:
        from banyan.text.chat_template import render_chat_template

        return render_chat_template(self.tokenizer, messages, add_generation_prompt=False)

    def generate(self, call: GenCall, on_text: Callable[[str], None] | None = None) -> GenResult:
        from banyan.sampling_params import SamplingParams

        started = time.monotonic()
        options = call.sampling.given()
        options["max_tokens"] = call.max_tokens
        structured = structured_outputs(call)
        try:
            params = SamplingParams(**options, structured_outputs=structured)
        except BanyanError as e:
            raise BackendError(call.name, str(e), status=getattr(e, "status", None), param=e.param) from e
        output = self._run(call.name, self.tokenizer.encode(call.prompt), params, on_text)
        completion = output.outputs[0]
        return GenResult(completion.text, {
            "id": output.request_id,
            "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": len(completion.token_ids),
            "cached_tokens": output.num_cached_tokens,
            "finish_reason": finish_reason_meta(completion.finish_reason, completion.stop_reason, len(completion.token_ids)),
            "e2e_latency": time.monotonic() - started,
        })

    def select(self, call: SelectCall) -> SelectResult:
        """Every option scored in one batch: prefix + option, with prompt log-probabilities from where the
        option begins (the prefix before it comes from the cache)."""
        from banyan.sampling_params import SamplingParams

        prefix_ids = self.tokenizer.encode(call.prompt)
        submitted = []
        for choice in call.choices:
            full = self.tokenizer.encode(call.prompt + choice)
            start = option_start(prefix_ids, full)
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, prompt_logprobs_start=start)
            submitted.append((full, start, self._submit(call.name, full, params)))
        scores, cached = [], []
        for full, start, submission in submitted:
            output = self._wait(call.name, submission)
            scores.append([output.prompt_logprobs[i][full[i]].logprob for i in range(start, len(full))])
            cached.append(output.num_cached_tokens)
        return choose_normalized(scores, call.choices, len(prefix_ids), min(cached))

    def cache_prefix(self, prompt: str) -> None:
        from banyan.sampling_params import SamplingParams

        self._run("fork", self.tokenizer.encode(prompt), SamplingParams(max_tokens=1, temperature=0.0), None)

    def add_callers(self, count: int) -> None:
        self.loop.add_callers(count)

    def close(self) -> None:
        self.loop.close()
        self.llm.engine.close()

    # -- internals ----------------------------------------------------------------------------
    def _run(self, name: str, ids: list[int], params, on_text):
        return self._wait(name, self._submit(name, ids, params, on_text))

    def _submit(self, name: str, ids: list[int], params, on_text=None):
        from banyan.frontend.engine_loop import EngineLoopClosedError

        try:
            return self.loop.submit(ids, params, on_text)
        except EngineLoopClosedError as e:
            raise BackendUnavailableError(name, str(e)) from e

    @staticmethod
    def _wait(name: str, submission):
        from banyan.frontend.engine_loop import EngineLoopClosedError

        try:
            output = submission.result()
        except EngineLoopClosedError as e:
            raise BackendUnavailableError(name, str(e)) from e
        except BanyanError as e:
            raise BackendError(name, str(e), status=e.status, type=e.type, code=e.code, param=e.param) from e
        error = output.outputs[0].error
        if error is not None:
            raise BackendError(name, error.message, status=error.status, type=error.type, code=error.code,
                               param=error.param)
        return output
