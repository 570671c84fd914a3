"""The engine core in its own process: a busy loop around `Engine.step()`, msgspec over ZeroMQ.

    python .../banyan/ipc/core_launch.py --parent-pid PID --config-json JSON --input ipc://... --output ipc://...

The API server's `EngineClient` starts this process (through core_launch.py, which ties it to the
server before anything slow), binds both sockets in a private directory and owns the process's
life. The loop, one turn:

    1. drain every pending input message (block up to IDLE_WAIT_MS only when there is no work)
    2. AddRequest -> engine.add_request (a bad request fails alone: a delta with its error), AbortRequests
       (the aborted requests' last deltas), KvQuery (a KvReport: integrity checked, pages counted), Shutdown
    3. one engine step -> one StepOutputs with every request's delta (one that failed carries its error)
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

import msgspec
import zmq

from banyan.config import EngineConfig
from banyan.distributed.curve import secure_connect
from banyan.engine.engine import Engine
from banyan.engine.faults import Fault
from banyan.errors import BanyanError, InvalidRequestError, error_info
from banyan.ipc import messages as m
from banyan.ipc.core_launch import remove_ipc_files
from banyan.ipc.profiler import CoreProfiler, ProfilerStateError
from banyan.logs import LOG_FORMATS, configure_logging
from banyan.request import RequestDelta

logger = logging.getLogger("banyan.engine.core")

IDLE_WAIT_MS = 50
STATS_INTERVAL = 0.2
SEND_TIMEOUT_MS = 1000  # a blocked send re-checks that the parent still lives
CLOSE_LINGER_MS = 2000  # time for the last messages (EngineDead, aborts) to leave on exit


class Orphaned(Exception):
    """The process that started the core is gone."""


class EngineCore:
    def __init__(self, engine: Engine, input_sock: zmq.Socket, output_sock: zmq.Socket, parent_pid: int | None = None):
        self.engine = engine
        self.input = input_sock
        self.output = output_sock
        self.parent_pid = os.getppid() if parent_pid is None else parent_pid
        self.num_steps = 0
        self.stopping = False
        self._encoder = m.encoder()
        self._decoder = m.core_decoder()
        self._next_stats = 0.0
        self.profiler = CoreProfiler()

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
            self._abort(self.engine.unfinished_request_ids())
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
        elif isinstance(msg, m.KvQuery):
            census = self.engine.kv_census()
            self.send(m.KvReport(query_id=msg.query_id, **msgspec.structs.asdict(census)))
        elif isinstance(msg, m.ProfileControl):
            self.send(self._profile(msg))
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
                slo=msg.slo,
                pooling_params=msg.pooling_params,
                lora_request=msg.lora_request,
            )
        except Exception as e:  # request-scoped: this request fails, the engine carries on
            self.send(m.StepOutputs([failed_delta(msg.request_id, e)]))

    def _profile(self, msg: m.ProfileControl) -> m.ProfileStatus:
        try:
            if msg.start:
                self.profiler.start(msg.directory)
                return m.ProfileStatus(running=True)
            return m.ProfileStatus(running=False, trace_path=self.profiler.stop())
        except (ProfilerStateError, OSError) as e:
            return m.ProfileStatus(running=self.profiler.running, error=str(e), conflict=isinstance(e, ProfilerStateError))

    def _abort(self, request_ids: list[str]) -> None:
        """Abort and tell the client, so that each aborted stream ends with finish_reason "abort"."""
        deltas = self.engine.abort_requests(request_ids)
        if deltas:
            self.send(m.StepOutputs(deltas))

    def _reject_undecodable(self, raw: bytes, error: Exception) -> None:
        try:
            fields = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            fields = None
        request_id = fields.get("request_id") if isinstance(fields, dict) else None
        if not isinstance(request_id, str):
            logger.warning("dropped an undecodable message: %s", error)
            return
        self.send(m.StepOutputs([failed_delta(request_id, error.__cause__ or error)]))

    # -- the loop -----------------------------------------------------------------------------
    def _step(self) -> None:
        deltas = self.engine.step()
        self.num_steps += 1
        if deltas:
            self.send(m.StepOutputs(deltas))

    def _send_stats(self) -> None:
        stats = self.engine.stats()
        self.send(m.EngineStats(time=time.time(), num_steps=self.num_steps, **msgspec.structs.asdict(stats)))
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
        num_pages=engine.num_pages,
        page_size=engine.config.cache.block_size,
        eos_token_ids=list(engine.eos_token_ids),
        device=engine.device,
        structured_output_backend=engine.config.model.structured_output_backend,
        reasoning_parser=engine.config.model.reasoning_parser,
        dtype=engine.dtype,
    )


def failed_delta(request_id: str, error: BaseException) -> RequestDelta:
    """The delta of a request refused before it ran; an untyped ValueError (a malformed message) is the
    client's, anything else untyped is a 500 (and logged)."""
    if isinstance(error, ValueError) and not isinstance(error, BanyanError):  # msgspec's DecodeError included
        error = InvalidRequestError(f"invalid request: {error}")
    info = error_info(error)
    if info.status >= 500:
        logger.error("request %s failed", request_id, exc_info=error)
    return RequestDelta.failed(request_id, info)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="banyan engine core (started by the API server)")
    parser.add_argument("--config-json", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input", required=True, help="address to pull requests from")
    parser.add_argument("--output", required=True, help="address to push outputs to")
    parser.add_argument("--parent-pid", type=int, help="the server's pid (default: the parent's now)")
    parser.add_argument("--fault", help="tests only: see banyan/engine/faults.py")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO, args.log_format, role="engine-core")
    # The server owns shutdown (it drains first, then sends Shutdown). Signals sent to the whole
    # process group (Ctrl-C, systemd's control-group kill) must not end the core before the drain;
    # if the server itself dies, the core notices its parent is gone and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    context = zmq.Context()
    input_sock = context.socket(zmq.PULL)
    output_sock = context.socket(zmq.PUSH)
    output_sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    secure_connect(input_sock, args.input)  # over TCP (a core Ray placed), with the keys in our environment
    secure_connect(output_sock, args.output)
    try:
        fault = Fault.parse(args.fault) if args.fault else None
        config = msgspec.json.decode(args.config_json, type=EngineConfig)
        if fault is not None:
            fault.while_loading()
        engine = Engine(config)
        if fault is not None:
            engine.before_step.append(fault)
        core = EngineCore(engine, input_sock, output_sock, args.parent_pid)
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
