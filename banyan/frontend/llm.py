"""LLM: the offline API, vLLM-compatible. The same Engine as the server, with the I/O swapped."""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm import tqdm

from banyan.config import DEFAULT_MODEL, EngineConfig
from banyan.config_args import config_from_kwargs
from banyan.errors import InvalidParameterError, InvalidRequestError
from banyan.frontend.prepare import ChatInput, fan_out, prepare_chat
from banyan.lora.request import LoRARequest
from banyan.pooling_params import PoolingParams
from banyan.request import RequestStatus
from banyan.sampling_params import SamplingParams
from banyan.text.output_processor import OutputProcessor, PromptState, SequenceState
from banyan.text.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from banyan.text.reasoning import splitters

PromptInput = str | Sequence[int] | dict[str, Any]


class LLM:
    """Generate from a batch of prompts.

    >>> llm = LLM()  # the default model, smollm2-135m-instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str = DEFAULT_MODEL, **settings: Any):
        """`settings`: any engine setting by vLLM's name, as `banyan serve --help` lists them (max_model_len=...,
        gpu_memory_utilization=..., scheduling_policy=...; also num_pages and trust_remote_code, which are not
        flags); see banyan/config_args.py. An unknown name is a TypeError naming it."""
        for name, alone in (("data_parallel_size", 1), ("data_parallel_backend", "mp")):
            if settings.get(name, alone) != alone:
                raise InvalidParameterError(name, "replicas are served by `banyan serve`; LLM runs one engine in this "
                                            "process (tensor_parallel_size splits it over processes, and "
                                            "distributed_executor_backend='ray' places those on a Ray cluster)")
        self._start(config_from_kwargs(dict(settings, model=model)))

    @classmethod
    def from_config(cls, config: EngineConfig, runner_factory: Callable[..., Any] | None = None) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config, runner_factory)
        return llm

    def _start(self, config: EngineConfig, runner_factory: Callable[..., Any] | None = None) -> None:
        """runner_factory: the engine's (None: ModelRunner). Torch and the model code load here, with the first
        LLM, not with `import banyan.frontend.llm`."""
        from banyan.engine.engine import Engine
        from banyan.runner.model_runner import ModelRunner

        self.engine = Engine(config, runner_factory or ModelRunner)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. lora_request: the LoRA adapter of
        every prompt, or one per prompt (None: the base model); the engine needs enable_lora=True."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(priority if priority is not None else 0, len(prompts), "priority")
        adapters = _per_prompt(lora_request, len(prompts), "lora_request")
        processor = OutputProcessor(self.tokenizer)
        request_ids = []
        try:
            for prompt, sp, prio, lora in zip(prompts, params, priorities, adapters):
                request_ids.append(self._add(processor, prompt, sp, prio, lora))
            self._run(processor, len(request_ids), use_tqdm)
        except BaseException:
            self.engine.abort_requests(processor.unfinished_request_ids())
            raise
        return [processor.pop(rid) for rid in request_ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        tool_call_parser: str = "auto",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template (sandboxed Jinja), then generate (lora_request: as
        generate's).

        With `tools` (OpenAI's shape), tool_choice "auto" (the default), "required" or
        {"type": "function", "function": {"name": ...}} constrains calls to the tools' schemas, and each
        output's `tool_calls` and `content` hold the reply read back (see banyan/tools)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = _per_prompt(sampling_params or SamplingParams(), len(conversations), "sampling_params")
        chat = ChatInput(chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs,
                         tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        structured = "structured_outputs" if any(p.structured_outputs is not None for p in params) else None
        prepared = prepare_chat(self.tokenizer, conversations, chat, parser=tool_call_parser, structured_param=structured,
                                backend=self.engine.config.model.structured_output_backend)
        if prepared.grammar is not None:
            params = [p.clone(structured_outputs=prepared.grammar) for p in params]
        prompts = [{"prompt": text, "prompt_token_ids": ids} for text, ids in prepared.prompts]
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        for output, (prompt_text, _) in zip(outputs, prepared.prompts):
            _read_replies(output, prepared.calling, splitters(self.engine.config.model.reasoning_parser, prompt_text))
        return outputs

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of each prompt (text or token ids), in input order: the model's last hidden states pooled
        as the engine's `pooling` setting says, normalised (docs/embeddings.md). Each is one prefill-only request
        through the same scheduler as generate's."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(pooling_params or PoolingParams(), len(prompts), "pooling_params")
        added: dict[str, list[int]] = {}
        embeddings: dict[str, list[float]] = {}
        try:
            for prompt, pooling in zip(prompts, params):
                request_id, token_ids = f"embed-{next(self._ids)}", self._tokenize(prompt)[1]
                self.engine.add_request(request_id, token_ids, SamplingParams(), pooling_params=pooling)
                added[request_id] = token_ids
            bar = tqdm(total=len(added), desc="Embedding", unit="req", disable=not use_tqdm)
            with bar, collections_paused():
                while len(embeddings) < len(added) and self.engine.has_unfinished_requests():
                    for delta in self.engine.step():
                        if delta.error is not None:
                            raise InvalidRequestError(delta.error.message)
                        if delta.embedding is not None:
                            embeddings[delta.request_id] = delta.embedding
                            bar.update(1)
        except BaseException:
            self.engine.abort_requests(added)
            raise
        return [EmbeddingRequestOutput(rid, ids, EmbeddingOutput(embeddings[rid])) for rid, ids in added.items()]

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion as it is generated (the first of its n sequences)."""
        if sampling_params is not None and sampling_params.num_sequences > sampling_params.n:
            raise InvalidParameterError("best_of", "cannot be used when streaming: the best are known only at the end")
        processor = OutputProcessor(self.tokenizer)
        request_id = self._add(processor, prompt, sampling_params or SamplingParams(), 0)
        state = processor.prompts[request_id]
        shown = 0
        try:
            while not state.finished and self.engine.has_unfinished_requests():
                self.engine.abort_requests(processor.process(self.engine.step()), RequestStatus.FINISHED_STOPPED)
                text = state.sequences[0].text
                if len(text) > shown:
                    yield text[shown:]
                    shown = len(text)
        finally:
            self.engine.abort_requests(processor.unfinished_request_ids())

    # -- internals ----------------------------------------------------------------------------
    def _add(self, processor: OutputProcessor, prompt: PromptInput, params: SamplingParams, priority: int,
             lora_request: LoRARequest | None = None) -> str:
        text, token_ids = self._tokenize(prompt)
        request_id = str(next(self._ids))
        sequences = fan_out(request_id, params)
        self.engine.check_prompt(token_ids)
        states = [SequenceState(s.index, params, self.tokenizer, token_ids) for s in sequences]
        processor.add(PromptState(request_id, text, token_ids, states, metrics=None), [s.request_id for s in sequences])
        requests = [self.engine.add_request(s.request_id, token_ids, s.params, priority=priority,
                                            lora_request=lora_request) for s in sequences]
        processor.prompts[request_id].metrics = requests[0].metrics
        return request_id

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise InvalidParameterError("prompts", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        return None, list(prompt)

    def _run(self, processor: OutputProcessor, total: int, use_tqdm: bool) -> None:
        with tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm) as bar, collections_paused():
            while self.engine.has_unfinished_requests():
                to_abort = processor.process(self.engine.step())
                self.engine.abort_requests(to_abort, RequestStatus.FINISHED_STOPPED)
                bar.update(len(processor.pop_finished()))


def _read_replies(output: RequestOutput, calling, reasoning) -> None:
    """Each reply read back, as the server reads it: the thinking (with a reasoning parser) into `reasoning`, the
    rest into `content`, with tools its calls into `tool_calls`."""
    for completion in output.outputs:
        text = completion.text
        if reasoning is not None:
            completion.reasoning, text = reasoning().parse(text)
            completion.content = text
        if calling.active:
            completion.content, completion.tool_calls = calling.parser().parse(text)


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the step loop: its garbage is freed by reference counts,
    while a collection walks every live request (a full one paused a batch-256 step by 15-30 ms).
    Collections resume afterwards and catch up then."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidParameterError(name, f"got {len(value)} values for {count} prompts")
        return list(value)
    return [value] * count
