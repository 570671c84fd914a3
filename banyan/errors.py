"""Typed errors: every failure a user can cause has its own class, never a bare assert."""


class BanyanError(Exception):
    """Base class of banyan's own errors."""


class InvalidParameterError(BanyanError, ValueError):
    """A user-supplied value is out of range; `param` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class ContextLengthExceededError(InvalidParameterError):
    """Prompt plus requested tokens do not fit the model's context."""

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(param, message)


class ModelLoadError(BanyanError):
    """A model directory or file is missing, malformed, unsafe or unsupported."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not one banyan implements."""


class CacheCapacityError(BanyanError, ValueError):
    """A request needs more KV pages than the whole cache holds."""
