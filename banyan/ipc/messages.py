"""Every message between the API server and the engine core: msgspec structs, msgpack on the wire.

Never pickle: decoding a message builds only these types (and the dataclasses they hold), so a
peer on the socket can send data, never code. A request's data crosses once (AddRequest); after
that only per-step deltas come back, batched per step.

    server -> core:  AddRequest | AbortRequests | KvQuery | ProfileControl | Shutdown
    core -> server:  Ready | StepOutputs | EngineStats | KvReport | ProfileStatus | EngineDead

A request that fails, at once or mid-generation, ends with a delta whose `error` says why.
"""

from __future__ import annotations

from typing import Union

import msgspec

from banyan.engine.stats import EngineSnapshot, KvCensus
from banyan.request import RequestDelta, Slo
from banyan.pooling_params import PoolingParams
from banyan.lora.request import LoRARequest
from banyan.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    slo: Slo | None = None
    pooling_params: PoolingParams | None = None
    """Set: an embedding request (its one delta carries the embedding)."""
    lora_request: LoRARequest | None = None
    """Set: the LoRA adapter the request runs with."""


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class KvQuery(msgspec.Struct, tag=True):
    """Check the KV cache's integrity and count its pages now (between two steps); answered by a KvReport."""

    query_id: int


class ProfileControl(msgspec.Struct, tag=True):
    """Start (into `directory`) or stop the core's torch profiler; answered by a ProfileStatus."""

    start: bool
    directory: str = ""


class Shutdown(msgspec.Struct, tag=True):
    """Abort everything still running and exit cleanly."""


class Ready(msgspec.Struct, tag=True):
    """The core has loaded the model and allocated its cache; it accepts requests from now on."""

    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_pages: int
    page_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    structured_output_backend: str = "llguidance"
    reasoning_parser: str | None = None


class StepOutputs(msgspec.Struct, tag=True):
    """The deltas of one engine step, for every request that advanced or ended (aborted, failed)."""

    deltas: list[RequestDelta]


class EngineStats(EngineSnapshot, tag=True, kw_only=True):
    """Engine.stats(), sent a few times a second, busy or idle (it doubles as a heartbeat)."""

    time: float
    num_steps: int  # grows while the core makes progress: a wedged core stops counting


class KvReport(KvCensus, tag=True, kw_only=True):
    """The answer to the KvQuery with the same query_id."""

    query_id: int


class ProfileStatus(msgspec.Struct, tag=True):
    """The answer to a ProfileControl: the trace written at stop, or why it could not be done."""

    running: bool
    trace_path: str | None = None
    error: str | None = None
    conflict: bool = False  # the error is the state's: started twice, or stopped while not running


class EngineDead(msgspec.Struct, tag=True):
    """The core hit a fatal error and is exiting; every in-flight request has failed."""

    message: str


ToCore = Union[AddRequest, AbortRequests, KvQuery, ProfileControl, Shutdown]
FromCore = Union[Ready, StepOutputs, EngineStats, KvReport, ProfileStatus, EngineDead]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def core_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the server sends to the core."""
    return msgspec.msgpack.Decoder(ToCore)


def client_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core sends to the server."""
    return msgspec.msgpack.Decoder(FromCore)
