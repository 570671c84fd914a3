"""Every message between the API server and the engine core: msgspec structs, msgpack on the wire.

Never pickle: decoding a message builds only these types (and the dataclasses they hold), so a
peer on the socket can send data, never code. A request's data crosses once (AddRequest); after
that only per-step deltas come back, batched per step.

    server -> core:  AddRequest | AbortRequests | Shutdown
    core -> server:  Ready | StepOutputs | RequestFailed | EngineStats | EngineDead
"""

from __future__ import annotations

from typing import Union

import msgspec

from banyan.request import RequestDelta
from banyan.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    group_id: str | None = None


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


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


class StepOutputs(msgspec.Struct, tag=True):
    """The deltas of one engine step, for every request that advanced."""

    deltas: list[RequestDelta]


class RequestFailed(msgspec.Struct, tag=True):
    """One request ended with an error; the engine and every other request carry on."""

    request_id: str
    message: str
    error_type: str = "invalid_request_error"  # OpenAI error type
    param: str | None = None
    code: str | None = None
    status: int = 400


class EngineStats(msgspec.Struct, tag=True):
    """A snapshot the core sends a few times a second, busy or idle (it doubles as a heartbeat)."""

    time: float
    num_steps: int  # grows while the core makes progress: a wedged core stops counting
    num_running: int
    num_waiting: int
    kv_usage: float
    num_pages: int
    num_free_pages: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    grammar_cache_entries: int = 0  # compiled grammars held (bounded: RELIABILITY C4 G5)
    grammar_cache_bytes: int = 0
    grammar_cache_evictions: int = 0


class EngineDead(msgspec.Struct, tag=True):
    """The core hit a fatal error and is exiting; every in-flight request has failed."""

    message: str


ToCore = Union[AddRequest, AbortRequests, Shutdown]
FromCore = Union[Ready, StepOutputs, RequestFailed, EngineStats, EngineDead]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def core_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the server sends to the core."""
    return msgspec.msgpack.Decoder(ToCore)


def client_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core sends to the server."""
    return msgspec.msgpack.Decoder(FromCore)
