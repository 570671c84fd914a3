"""banyan.lang's errors: a backend call that failed names the call; a backend that cannot be reached says so."""

from __future__ import annotations

from banyan.errors import BanyanError


class LangError(BanyanError):
    """Base class of banyan.lang's errors."""

    public_message = None


class BackendError(LangError):
    """A backend refused or failed one call (an HTTP 4xx/5xx, a refused grammar, a request that ended in error).

    `call` names it (e.g. "gen('answer')"); `status`, `type`, `code`, `param` are the backend's (OpenAI's fields)."""

    def __init__(self, call: str, message: str, *, status: int | None = None, type: str | None = None,
                 code: str | None = None, param: str | None = None):
        super().__init__(f"{call}: {message}")
        self.call, self.message = call, message
        self.status, self.type, self.code, self.param = status, type, code, param


class BackendUnavailableError(BackendError):
    """The backend could not be reached, or died during the call."""


class ProgramUsageError(LangError, ValueError):
    """The program used the language wrongly (a role ended that was not begun, an unknown variable)."""
