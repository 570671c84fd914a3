"""Typed errors: every failure a user can cause has its own class, never a bare assert.

Each class says how it reaches an OpenAI client: the HTTP `status`, OpenAI's error `type` and `code`
(class attributes). `error_info` is the one mapping from an exception to what the client is told; the
core uses it for a request that fails, the server for everything it answers, the offline LLM hands it
back on the output. A class without its own status is a fault on our side: a 500 that says no more.
"""

from __future__ import annotations

import msgspec

INTERNAL_ERROR = "internal server error"


class ErrorInfo(msgspec.Struct, frozen=True):
    """Why a request failed, as the client reads it: OpenAI's error fields and the HTTP status.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}} with `status`."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None  # the request field at fault, if any
    code: str | None = None
    status: int = 400
    retry_after: float | None = None  # seconds, for a refusal worth retrying (503 slo_unattainable)


class BanyanError(Exception):
    """Base class of banyan's own errors."""

    status = 500
    type = "server_error"
    code: str | None = None
    param: str | None = None
    public_message: str | None = INTERNAL_ERROR
    """What the client reads instead of the error's own text; None: the text itself."""


class InvalidRequestError(BanyanError, ValueError):
    """The request cannot be served as sent (the client's to fix)."""

    status = 400
    type = "invalid_request_error"
    public_message = None


class InvalidParameterError(InvalidRequestError):
    """A user-supplied value is out of range; `param` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class ContextLengthExceededError(InvalidParameterError):
    """Prompt plus requested tokens do not fit the model's context."""

    code = "context_length_exceeded"

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(param, message)


class ModelLoadError(BanyanError):
    """A model directory or file is missing, malformed, unsafe or unsupported."""

    public_message = None


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not one banyan implements."""


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be used: missing files, a pickle, wrong shapes, a rank above max_lora_rank,
    unknown target modules; or LoRA asked of an engine without it. The message names the problem."""

    code = "invalid_lora_adapter"

    def __init__(self, message: str, param: str = "lora_request"):
        super().__init__(message)
        self.param = param


class WorkerError(BanyanError):
    """A tensor-parallel worker died, or a collective between the workers timed out (a worker hung): the engine
    cannot take another step. Its requests fail with a 500; a server exits non-zero."""

    code = "engine_worker_failed"


class CacheCapacityError(InvalidRequestError):
    """A request needs more KV pages than the whole cache holds."""

    code = "request_too_large"


def error_info(error: BaseException) -> ErrorInfo:
    """What the client is told about an error raised while serving its request (anything that is not
    banyan's own is a 500 that says no more)."""
    if not isinstance(error, BanyanError):
        return ErrorInfo(INTERNAL_ERROR, type="server_error", status=500)
    message = error.public_message or str(error)
    return ErrorInfo(message, type=error.type, param=error.param, code=error.code, status=error.status,
                     retry_after=getattr(error, "retry_after", None))
