"""The engine core in its own process: a busy loop around `Engine.step()`, msgspec over ZeroMQ.

    python .../banyan/ipc/core_launch.py --parent-pid PID --config-json JSON --input ipc://... --output ipc://...

The API server's `EngineClient` starts this process (through core_launch.py, which ties it to the
server before anything slow), binds both sockets in a private directory and owns the process's
life. The loop, one turn:

    1. drain every pending input message (block up to IDLE_WAIT_MS only when there is no work)
    2. AddRequest -> engine.add_request (a bad request fails alone: RequestFailed), AbortRequests, Shutdown
    3. one engine step -> one StepOutputs with every request's delta
    4. EngineStats every STATS_INTERVAL seconds, busy or idle (the client's heartbeat)

Anything that escapes a step is fatal: the core sends EngineDead and exits 1, and the client fails
every in-flight request. The core does not outlive its server: on Linux, from its first moment
(core_launch.py, before banyan is imported) the server's death by any means sends it a signal, and it
removes the server's socket files and exits 1 as soon as its main thread next runs Python (at once, or
when a long native call returns). Elsewhere only the loop compares the parent pid (every turn, and
while a send blocks), so a core whose server dies before the loop starts lives until it gets there.
Nothing here unpickles: decoding builds only the structs in messages.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import msgspec
import zmq

from banyan.config import EngineConfig
from banyan.engine.engine import Engine
from banyan.errors import CacheCapacityError, ContextLengthExceededError, InvalidParameterError
from banyan.ipc import messages as m
from banyan.ipc.core_launch import remove_ipc_files
from banyan.request import Request, RequestDelta

logger = logging.getLogger("banyan.engine.core")

IDLE_WAIT_MS = 50
STATS_INTERVAL = 0.2
SEND_TIMEOUT_MS = 1000  # a blocked send re-checks that the parent still lives
CLOSE_LINGER_MS = 2000  # time for the last messages (EngineDead, aborts) to leave on exit


class Orphaned(Exception):
    """The process that started the core is gone."""


@dataclass(frozen=True)
class Fault:
    """Fault injection for tests: `raise-after-steps=N` or `sleep-after-steps=N:SECONDS` (the N-th step),
    `grammar-raise-after-tokens=N` (the grammar library of every constrained request with N output tokens
    raises on its next token), `sleep-while-loading=SECONDS` (before the model loads)."""

    kind: str  # "raise" | "sleep" | "grammar" | "load"
    step: int  # grammar: output tokens
    seconds: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        name, _, value = spec.partition("=")
        if name == "raise-after-steps":
            return cls("raise", int(value))
        if name == "sleep-after-steps":
            step, _, seconds = value.partition(":")
            return cls("sleep", int(step), float(seconds))
        if name == "grammar-raise-after-tokens":
            return cls("grammar", int(value))
        if name == "sleep-while-loading":
            return cls("load", 0, float(value))
        raise ValueError(f"unknown fault {spec!r}")

    def while_loading(self) -> None:
        if self.kind == "load":
            logger.warning("injected fault: sleeping %.1f s while loading", self.seconds)
            time.sleep(self.seconds)

    def before_step(self, step: int, engine: Engine) -> None:
        if self.kind == "load":
            return
        if self.kind == "grammar":
            _break_grammars(engine, self.step)
            return
        if step != self.step:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at step {step}")
        logger.warning("injected fault: sleeping %.1f s in step %d", self.seconds, step)
        time.sleep(self.seconds)


def _break_grammars(engine: Engine, num_tokens: int) -> None:
    for request in engine.scheduler.running:
        if request.matcher is not None and request.num_output_tokens >= num_tokens:
            request.matcher.accept_token = _library_crash  # this request's matcher only


def _library_crash(token_id: int) -> bool:
    raise RuntimeError("injected grammar library fault")


class EngineCore:
    def __init__(self, engine: Engine, input_sock: zmq.Socket, output_sock: zmq.Socket, fault: Fault | None = None,
                 parent_pid: int | None = None):  # fmt: skip
        self.engine = engine
        self.input = input_sock
        self.output = output_sock
        self.fault = fault
        self.parent_pid = os.getppid() if parent_pid is None else parent_pid
        self.num_steps = 0
        self.stopping = False
        self._encoder = m.encoder()
        self._decoder = m.core_decoder()
        self._next_stats = 0.0

    def run(self) -> int:
        """Serve until Shutdown (returns 0); raises on a fatal error, Orphaned if the parent died."""
        self.send(ready_message(self.engine))
        try:
            while not self.stopping:
                self._check_parent()
                busy = self.engine.has_unfinished_requests()
                for raw in self._receive(0 if busy else IDLE_WAIT_MS):
                    self._handle(raw)
                if self.engine.has_unfinished_requests() and not self.stopping:
                    self._step()
                if time.monotonic() >= self._next_stats:
                    self._send_stats()
            self._abort(list(self.engine.scheduler.requests))
        finally:
            self.engine.close()
        return 0

    # -- input --------------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> list[bytes]:
        if not self.input.poll(timeout_ms):
            return []
        received = []
        while True:
            try:
                received.append(self.input.recv(zmq.NOBLOCK))
            except zmq.Again:
                return received

    def _handle(self, raw: bytes) -> None:
        try:
            msg = self._decoder.decode(raw)
        except msgspec.DecodeError as e:  # ValidationError included: a malformed request fails alone
            self._reject_undecodable(raw, e)
            return
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.AbortRequests):
            self._abort(msg.request_ids)
        elif isinstance(msg, m.Shutdown):
            logger.info("shutdown requested")
            self.stopping = True

    def _add(self, msg: m.AddRequest) -> None:
        try:
            self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.sampling_params,
                arrival_time=msg.arrival_time,
                priority=msg.priority,
                cache_salt=msg.cache_salt,
                group_id=msg.group_id,
            )
        except Exception as e:  # request-scoped: this request fails, the engine carries on
            self.send(request_failed(msg.request_id, e))

    def _abort(self, request_ids: list[str]) -> None:
        """Abort and tell the client, so that each aborted stream ends with finish_reason "abort"."""
        requests = self.engine.scheduler.requests
        live = [requests[rid] for rid in request_ids if rid in requests and not requests[rid].is_finished]
        self.engine.abort_requests(request_ids)
        if live:
            self.send(m.StepOutputs([aborted_delta(r) for r in live]))

    def _reject_undecodable(self, raw: bytes, error: Exception) -> None:
        try:
            fields = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            fields = None
        request_id = fields.get("request_id") if isinstance(fields, dict) else None
        if not isinstance(request_id, str):
            logger.warning("dropped an undecodable message: %s", error)
            return
        self.send(request_failed(request_id, error.__cause__ or error))

    # -- the loop -----------------------------------------------------------------------------
    def _step(self) -> None:
        if self.fault is not None:
            self.fault.before_step(self.num_steps + 1, self.engine)
        deltas = self.engine.step()
        self.num_steps += 1
        for failed in [d for d in deltas if d.finish_reason == "error"]:  # e.g. a grammar that did not compile
            self.send(m.RequestFailed(failed.request_id, str(failed.stop_reason), param=failed.error_param))
        deltas = [d for d in deltas if d.finish_reason != "error"]
        if deltas:
            self.send(m.StepOutputs(deltas))

    def _send_stats(self) -> None:
        kv = self.engine.kv.stats()
        sched = self.engine.scheduler
        grammars = self.engine.grammars.stats()
        self.send(
            m.EngineStats(
                time=time.time(),
                num_steps=self.num_steps,
                num_running=len(sched.running),
                num_waiting=len(sched.waiting),
                kv_usage=kv.usage,
                num_pages=kv.num_pages,
                num_free_pages=kv.num_free,
                prefix_query_tokens=sched.stats.prefix_query_tokens,
                prefix_hit_tokens=sched.stats.prefix_hit_tokens,
                num_preemptions=sched.stats.num_preemptions,
                grammar_cache_entries=grammars.get("entries", 0),
                grammar_cache_bytes=grammars.get("bytes", 0),
                grammar_cache_evictions=grammars.get("evictions", 0),
            )
        )
        self._next_stats = time.monotonic() + STATS_INTERVAL

    # -- output -------------------------------------------------------------------------------
    def send(self, msg: m.FromCore) -> None:
        data = self._encoder.encode(msg)
        while True:
            try:
                self.output.send(data, copy=False)
                return
            except zmq.Again:  # the client is not reading: fine while it lives
                self._check_parent()

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            raise Orphaned()


def ready_message(engine: Engine) -> m.Ready:
    return m.Ready(
        model=engine.config.model.model,
        architecture=engine.arch.architecture,
        vocab_size=engine.arch.vocab_size,
        max_model_len=engine.max_model_len,
        num_pages=engine.kv.num_pages,
        page_size=engine.config.cache.block_size,
        eos_token_ids=list(engine.eos_token_ids),
        device=str(engine.runner.device),
        structured_output_backend=engine.config.model.structured_output_backend,
        dtype=str(engine.runner.dtype).removeprefix("torch."),
    )


def request_failed(request_id: str, error: BaseException) -> m.RequestFailed:
    """The OpenAI-shaped error for one failed request; anything untyped is a 500 (and logged)."""
    if isinstance(error, ContextLengthExceededError):
        return m.RequestFailed(request_id, str(error), param=error.param, code="context_length_exceeded")
    if isinstance(error, InvalidParameterError):
        return m.RequestFailed(request_id, str(error), param=error.param)
    if isinstance(error, CacheCapacityError):
        return m.RequestFailed(request_id, str(error), code="request_too_large")
    if isinstance(error, (ValueError, msgspec.DecodeError)):
        return m.RequestFailed(request_id, f"invalid request: {error}")
    logger.error("request %s failed", request_id, exc_info=error)
    return m.RequestFailed(request_id, "internal error", error_type="server_error", status=500)


def aborted_delta(request: Request) -> RequestDelta:
    return RequestDelta(
        request_id=request.request_id,
        new_token_ids=[],
        new_logprobs=[] if request.logprobs is not None else None,
        cumulative_logprob=request.cumulative_logprob,
        finish_reason=request.finish_reason,
        stop_reason=None,
        num_cached_tokens=request.num_cached_tokens,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="banyan engine core (started by the API server)")
    parser.add_argument("--config-json", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input", required=True, help="address to pull requests from")
    parser.add_argument("--output", required=True, help="address to push outputs to")
    parser.add_argument("--parent-pid", type=int, help="the server's pid (default: the parent's now)")
    parser.add_argument("--fault", help="tests only: see Fault")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    # The server owns shutdown (it drains first, then sends Shutdown). Signals sent to the whole
    # process group (Ctrl-C, systemd's control-group kill) must not end the core before the drain;
    # if the server itself dies, the core notices its parent is gone and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    context = zmq.Context()
    input_sock = context.socket(zmq.PULL)
    output_sock = context.socket(zmq.PUSH)
    output_sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    input_sock.connect(args.input)
    output_sock.connect(args.output)
    try:
        fault = Fault.parse(args.fault) if args.fault else None
        config = msgspec.json.decode(args.config_json, type=EngineConfig)
        if fault is not None:
            fault.while_loading()
        core = EngineCore(Engine(config), input_sock, output_sock, fault, args.parent_pid)
        return core.run()
    except Orphaned:
        logger.error("the server process is gone; exiting")
        remove_ipc_files(args.input, args.output)
        return 1
    except Exception as e:
        logger.exception("engine core failed")
        message = f"engine core failed: {type(e).__name__}: {e}"
        try:
            output_sock.send(m.encoder().encode(m.EngineDead(message)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        return 1
    finally:
        input_sock.close(linger=0)
        output_sock.close(linger=CLOSE_LINGER_MS)
        context.term()


if __name__ == "__main__":
    sys.exit(main())
