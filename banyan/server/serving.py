"""OpenAIServing: OpenAI requests -> engine requests -> OpenAI responses (JSON or SSE).

Each handler: validate the body (protocol.py), tokenize off the event loop with a time cap, check
lengths against the model, admit (rate limits, queue), run a Generation, then answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from banyan.config import ServerConfig
from banyan.errors import BanyanError
from banyan.frontend.prepare import ChatInput, PreparedChat, prepare_chat, render_chat, tool_calling
from banyan.ipc.client import EngineClient, RequestError
from banyan.request import Slo
from banyan.sampling_params import SamplingParams
from banyan.scheduler.policy import blame, expected_wait, fair_ahead, refusal, with_defaults
from banyan.server import protocol
from banyan.server.audit import record_usage
from banyan.server.auth import ApiKeyAuth, RateLimiter, Tenant
from banyan.server.errors import APIError, error_body, from_banyan_error, model_not_found
from banyan.server.generation import Generation
from banyan.server.metrics import ServerMetrics
from banyan.server.renderers import ChatRender, CompletionRender
from banyan.server.sse import sse_event
from banyan.text.chat_template import ChatTemplateError
from banyan.text.reasoning import splitters
from banyan.text.tokenizer import encode_text, with_special_tokens

if TYPE_CHECKING:  # a type only: lora_adapters documents its routes through openapi, which imports this module
    from banyan.server.lora_adapters import LoRAAdapters

T = TypeVar("T")


class OpenAIServing:
    def __init__(self, config: ServerConfig, client: EngineClient, tokenizer, model_names: list[str], metrics: ServerMetrics):
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.metrics = metrics
        self.lora: LoRAAdapters | None = None  # with --enable-lora: adapters a request's `model` may name (launch.py)
        self.limiter = RateLimiter(config.requests_per_minute, config.tokens_per_minute)
        self.max_model_len = client.info.max_model_len
        self.vocab_size = client.info.vocab_size
        self.chat_template = config.chat_template
        self.live: set[Generation] = set()  # generations in flight, for the shutdown drain
        # Tokenizing and template rendering run here, off the event loop, under a time cap: a render
        # stops itself at the cap (or at once, _stop_renders: shutdown); the wait gives up 1 s after.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="banyan-text")
        self._stop_renders = threading.Event()
        self.finish_hooks: list[Callable[[Generation], None]] = []  # each finished generation (route metrics)

    # -- endpoints ----------------------------------------------------------------------------
    async def completions(self, body: dict, tenant: Tenant, http: Request) -> Response:
        req = protocol.parse(protocol.CompletionRequest, body)
        self.check_model(req.model)
        prompts = await self.offload(self.tokenize_prompts, req.prompt)
        params = protocol.to_sampling_params(req, default_max_tokens=None)
        gen = self._start(prompts, params, req, tenant, http)
        texts = [self.tokenizer.decode(p) for p in prompts] if req.echo else None
        render = CompletionRender(gen, req, self.tokenizer, self.answering(req.model), texts)
        if req.stream:
            return self.sse(gen, render.stream(), http)
        return await self.respond(gen, render.response, http)

    async def chat(self, body: dict, tenant: Tenant, http: Request) -> Response:
        req = protocol.parse(protocol.ChatCompletionRequest, body)
        gen, prepared = await self.start_chat(req, tenant, http)
        render = ChatRender(gen, req, self.tokenizer, self.answering(req.model), prepared.calling,
                            reasoning=splitters(self.client.info.reasoning_parser, prepared.prompts[0][0]))
        if req.stream:
            return self.sse(gen, render.stream(), http)
        return await self.respond(gen, render.response, http)

    async def start_chat(self, req: protocol.ChatCompletionRequest, tenant: Tenant,
                         http: Request) -> tuple[Generation, PreparedChat]:
        """A validated chat request running in the core (also /v1/responses' path): the template rendered with
        the tools, the grammar of tool calls or of the response format, admission."""
        self.check_model(req.model)
        if req.chat_template is not None and not self.config.allow_request_chat_template:
            raise APIError(400, "request chat templates are disabled on this server", param="chat_template")
        prepared = await self.offload(self._prepare_chat, req)
        params = protocol.to_sampling_params(req, default_max_tokens=None)
        if prepared.grammar is not None:
            params = params.clone(structured_outputs=prepared.grammar)
        gen = self._start([ids for _, ids in prepared.prompts], params, req, tenant, http)
        if prepared.grammar is not None:
            gen.structured_param = "tools"
        return gen, prepared

    async def tokenize(self, body: dict) -> Response:
        if "messages" in body:
            req = protocol.parse(protocol.TokenizeChatRequest, body)
            self.check_model(req.model)
            ids = await self.offload(self._render_chat, req)
            if req.add_special_tokens:  # around the rendered chat, as the tokenizer adds them around a text
                ids = with_special_tokens(self.tokenizer, ids)
        else:
            req = protocol.parse(protocol.TokenizeCompletionRequest, body)
            self.check_model(req.model)
            ids = await self.offload(lambda: encode_text(self.tokenizer, req.prompt, req.add_special_tokens))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, body: dict) -> Response:
        req = protocol.parse(protocol.DetokenizeRequest, body)
        self.check_model(req.model)
        self.check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": await self.offload(lambda: self.tokenizer.decode(req.tokens))})

    def models(self) -> dict:
        created = int(time.time())
        cards = [
            {"id": name, "object": "model", "created": created, "owned_by": "banyan", "max_model_len": self.max_model_len}
            for name in self.model_names
        ]
        return {"object": "list", "data": cards}

    # -- checks -------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names and (self.lora is None or self.lora.get(model) is None):
            raise model_not_found(model)

    def answering(self, model: str | None) -> str:
        """The `model` of the response: the adapter's name when one answered (as vLLM), else the model's."""
        return model if self.lora is not None and self.lora.get(model) is not None else self.model_names[0]

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of vocabulary (size {self.vocab_size})", param=param)

    def _check_lengths(self, prompts: list[list[int]], params: SamplingParams) -> None:
        for ids in prompts:
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            self.check_token_ids(ids, "prompt")
            wanted = len(ids) + (params.max_tokens or 1)
            if wanted > self.max_model_len:
                asked = f"{len(ids)} in the prompt + {params.max_tokens} to generate" if params.max_tokens else f"{len(ids)} in the prompt"
                raise APIError(
                    400,
                    f"this model's maximum context length is {self.max_model_len} tokens, but {asked} were requested",
                    param="max_tokens" if params.max_tokens else "prompt",
                    code="context_length_exceeded",
                )

    def _slo(self, req, tenant: Tenant) -> Slo | None:
        """The request's latency targets, the server's defaults where it sets none."""
        sched, asked = self.client.config.scheduler, req.slo
        slo = Slo(asked.ttft_ms, asked.tpot_ms, tenant.tenant_id) if asked else Slo(tenant=tenant.tenant_id)
        return with_defaults(slo, sched.default_ttft_slo_ms, sched.default_tpot_slo_ms)

    def _check_slo(self, slo: Slo | None, tenant: Tenant, prompts: list[list[int]]) -> None:
        """slo policy: refuse now what the queue would make late, before it costs a step: the core's own estimate
        (policy.expected_wait) from its measurements and queue, which come a few times a second, with the requests
        sent since (taken as long as this one) and this one behind them; of that queue, the part served before it
        when keys take turns (policy.fair_ahead over the requests in flight per key). 429 when this key holds more
        than its share of them (policy.blame), 503 otherwise; both with Retry-After."""
        stats = self.client.stats
        if slo is None or stats is None or not stats.slo_step_seconds:
            return
        queued = max(0, self.client.num_in_flight - stats.num_running - stats.num_waiting) + 1
        tokens = stats.slo_queue_tokens + queued * max(map(len, prompts))
        queued += stats.slo_queue_requests
        per_key = self._in_flight_per_key()
        own = per_key.pop(tenant.tenant_id, 0)
        ahead = min(queued, fair_ahead(own, per_key.values()) + 1)
        wait = expected_wait(stats.slo_step_seconds, stats.slo_prefill_per_step, stats.slo_admitted_per_step,
                             round(tokens * ahead / queued), ahead, stats.slo_wait_bias)
        error = refusal(slo, 0.0, wait, stats.slo_step_seconds)
        if error is not None:
            error = blame(error, own + 1, per_key.total() + own + 1, len(+per_key) + 1)
            self.metrics.observe_rejection(tenant.tenant_id, error.status, error.code)
            raise from_banyan_error(error)

    def _in_flight_per_key(self) -> Counter:
        """Sequences in flight per tenant (a request with n choices counts n times, as in the core)."""
        per_key = Counter()
        for gen in self.in_flight():
            per_key[gen.tenant] += len(gen.choices)
        return per_key

    def admit(self, tenant: Tenant, num_tokens: int, num_requests: int) -> None:
        if self.client.num_in_flight + num_requests > self.config.max_queued_requests:
            self.metrics.observe_rejection(tenant.tenant_id, 503, "server_overloaded")
            raise APIError(503, "the server is at capacity; retry shortly", type="server_error", code="server_overloaded", retry_after=1)
        wait = self.limiter.check(tenant.tenant_id, num_tokens)
        if wait is not None:
            self.metrics.observe_rejection(tenant.tenant_id, 429, "rate_limit_exceeded")
            raise APIError(429, "rate limit reached for this API key", type="rate_limit_error", code="rate_limit_exceeded", retry_after=wait)

    # -- text work off the loop -----------------------------------------------------------------
    async def offload(self, fn: Callable, *args):
        """Run fn in the text pool. Its time cap starts when a worker takes it: a request queued behind others
        (the pool saturated) is not the one at fault, and gets 503 + Retry-After if no worker is free in time."""
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def job():
            loop.call_soon_threadsafe(started.set)
            return fn(*args)

        future = loop.run_in_executor(self._pool, job)
        try:
            await asyncio.wait_for(started.wait(), self.config.render_timeout)
        except asyncio.TimeoutError:
            future.cancel()
            raise APIError(503, "every text worker is busy; retry shortly", type="server_error",
                           code="server_overloaded", retry_after=1) from None
        try:
            return await asyncio.wait_for(future, self.config.render_timeout + 1.0)
        except asyncio.TimeoutError:
            raise APIError(400, f"tokenizing or rendering took longer than {self.config.render_timeout} s", param="prompt") from None
        except BanyanError as e:  # e.g. a chat template that fails: the request's fault
            if self._stop_renders.is_set():
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down", retry_after=5) from None
            raise from_banyan_error(e) from None

    def tokenize_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [encode_text(self.tokenizer, prompt)]
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]
        return [encode_text(self.tokenizer, p) if isinstance(p, str) else list(p) for p in prompt]

    def _prepare_chat(self, req: protocol.ChatCompletionRequest) -> PreparedChat:
        with self._template_errors(req):
            return prepare_chat(self.tokenizer, [protocol.messages_for_template(req.messages)], self._chat_input(req),
                                backend=self.client.info.structured_output_backend, parser=self.config.tool_call_parser,
                                structured_param=req.structured_param, timeout=self.config.render_timeout,
                                cancel=self._stop_renders)

    def _render_chat(self, req: protocol.TokenizeChatRequest) -> list[int]:
        """The prompt ids alone (/tokenize): the tools in the prompt, no grammar."""
        chat = self._chat_input(req)
        with self._template_errors(req):
            calling = tool_calling(self.tokenizer, chat, backend=self.client.info.structured_output_backend,
                                   parser=self.config.tool_call_parser)
            _, ids = render_chat(self.tokenizer, protocol.messages_for_template(req.messages), chat, calling,
                                 timeout=self.config.render_timeout, cancel=self._stop_renders)
        return ids

    def _chat_input(self, req) -> ChatInput:
        tool_choice = getattr(req, "tool_choice", None)
        if isinstance(tool_choice, protocol.NamedToolChoice):
            tool_choice = tool_choice.model_dump()
        return ChatInput(
            chat_template=req.chat_template or self.chat_template,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
            documents=req.documents,
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            tool_choice=tool_choice,
            parallel_tool_calls=getattr(req, "parallel_tool_calls", None),
        )

    @staticmethod
    @contextlib.contextmanager
    def _template_errors(req) -> Iterator[None]:
        """Whatever the request's own chat template does wrong is about that field."""
        try:
            yield
        except ChatTemplateError as e:
            if req.chat_template is None:
                raise
            raise ChatTemplateError("chat_template", str(e).removeprefix(f"{e.param}: ")) from None

    # -- running --------------------------------------------------------------------------------
    def _start(self, prompts, params: SamplingParams, req, tenant: Tenant, http: Request) -> Generation:
        self._check_lengths(prompts, params)
        try:
            params.verify_for_model(self.vocab_size)
        except BanyanError as e:
            raise from_banyan_error(e) from e
        budget = sum(len(p) + (params.max_tokens or self.max_model_len - len(p)) for p in prompts) * params.num_sequences
        self.admit(tenant, budget, len(prompts) * params.num_sequences)
        slo = self._slo(req, tenant)
        self._check_slo(slo, tenant, prompts)
        namespace = ApiKeyAuth.namespace_for(tenant, req.cache_salt)
        gen = Generation(self.client, self.tokenizer, http.state.request_id, prompts, params, priority=req.priority,
                         cache_salt=namespace, slo=slo, max_buffered_events=self.config.max_buffered_events,
                         lora_request=self.lora.get(req.model) if self.lora is not None else None)
        gen.structured_param = req.structured_param  # a grammar that fails to compile is reported against it
        gen.route = getattr(http.state, "route", None)
        gen.tenant = tenant.tenant_id  # whose share of the requests in flight it counts in (_check_slo)
        self.live.add(gen)
        return gen

    def in_flight(self) -> list[Generation]:
        """Generations still running (a stream the client left before it began is pruned here)."""
        self.live = {gen for gen in self.live if not gen.done}
        return list(self.live)

    def abort_all(self) -> None:
        """End every generation in flight with finish_reason "abort", and every render (503)."""
        self._stop_renders.set()
        for gen in self.in_flight():
            gen.abort()

    def _finish(self, gen: Generation, http: Request) -> None:
        gen.close()
        self.live.discard(gen)
        self._record(gen)
        for hook in self.finish_hooks:
            hook(gen)
        record_usage(http.scope.setdefault("state", {}), model=self.model_names[0], prompt_tokens=gen.prompt_tokens,
                     completion_tokens=gen.completion_tokens, cached_tokens=gen.cached_tokens,
                     finish_reasons=[c.seq.finish_reason or "abort" for c in gen.choices])

    async def respond(self, gen: Generation, build: Callable[[], dict], http: Request) -> Response:
        """Wait for every choice (aborting them if the client leaves first), then answer in one body."""
        try:
            errors = await until_disconnect(gen.run(), http)  # None: the client left, the engine is freed now
        finally:
            self._finish(gen, http)
        if errors is None:
            return Response(status_code=499)
        if errors:
            raise _error_of(errors[0].error, gen.structured_param)
        return JSONResponse(build())

    def sse(self, gen: Generation, body: AsyncIterator[bytes | str], http: Request, *,
            error_event: Callable[[APIError], str] = lambda error: sse_event(error_body(error)),
            done: str = "data: [DONE]\n\n") -> StreamingResponse:
        """`body` (server-sent events, written as they come); a request-scoped failure mid-stream becomes
        `error_event`, then `done` ends the stream (chat and completions; /v1/responses brings its own)."""

        async def stream():
            try:
                async for piece in body:
                    yield piece
            except Exception as e:  # request-scoped failure mid-stream: an error event, then [DONE]
                yield error_event(_error_of(e, gen.structured_param))
            finally:
                self._finish(gen, http)
            if done:
                yield done

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _record(self, gen: Generation) -> None:
        if any(c.token_times for c in gen.choices):
            self.metrics.observe_max_generation_tokens(max(len(c.seq.token_ids) for c in gen.choices))
        for c in gen.choices:
            if not c.token_times:
                if c.seq.finish_reason == "error":  # failed before its first token: an error all the same
                    self.metrics.observe_request(0, 0, "error", ttft=None, itls=[], e2e=time.time() - c.arrival,
                                                 queue_time=None)
                continue
            times = c.token_times
            self.metrics.observe_request(
                prompt_tokens=len(gen.prompts[c.prompt_index]),
                generation_tokens=len(c.seq.token_ids),
                finished_reason=c.seq.finish_reason or "abort",
                ttft=times[0] - c.arrival,
                itls=[b - a for a, b in zip(times, times[1:])],
                e2e=times[-1] - c.arrival,
                queue_time=c.queue_time,
            )


async def _client_disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Awaitable[T], http: Request) -> T | None:
    """The result of `work`, or None when the client left first (`work` is cancelled then: its engine
    requests abort)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_disconnected(http))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            return None
        return task.result()
    finally:
        gone.cancel()


def _error_of(e: BaseException, structured_param: str | None = None) -> APIError:
    """structured_param: the field a structured-output error from the core (param structured_outputs*) is about."""
    error = from_banyan_error(e)
    if isinstance(e, RequestError) and structured_param and (error.param or "").startswith("structured_outputs"):
        error.param = structured_param
    return error
