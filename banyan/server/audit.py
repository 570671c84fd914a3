"""The audit log: one line per API request on the `banyan.audit` logger, written when its response ends.

    request_id  tenant  method  path  model  status  prompt_tokens  completion_tokens  cached_tokens
    finish_reasons  latency_s

`tenant` is the key's id (a short non-reversible hash, auth.Tenant), never the key; no prompt, message or
output text is ever in a line. Refused requests are audited too (401, 413, 429, 503: status and latency,
no tokens). The model and token counts come from the handler (`record_usage`); latency runs to the last
byte, so a stream's line is written when the stream ends. Health checks, metric scrapes and the
playground's static files are not audited (QUIET_PATHS).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("banyan.audit")

QUIET_PATHS = ("/health", "/metrics", "/", "/favicon.ico")
QUIET_PREFIXES = ("/static/",)


def record_usage(scope_state: dict, *, model: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                 finish_reasons: list[str]) -> None:
    """Called by a handler once its request's numbers are known (scope_state: the ASGI scope's "state")."""
    scope_state["audit"] = {"model": model, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "cached_tokens": cached_tokens, "finish_reasons": finish_reasons}


class AuditLog:
    """Pure ASGI middleware, outside the Guard (so the Guard's refusals are audited too)."""

    def __init__(self, app, enabled: bool = True):
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.enabled or path in QUIET_PATHS or path.startswith(QUIET_PREFIXES):
            return await self.app(scope, receive, send)
        start = time.monotonic()
        state = scope.setdefault("state", {})
        status = [500]  # what the client got when the app fails before answering (the server's error handler)

        async def send_and_watch(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            write_line(scope, state, status[0], time.monotonic() - start)


def write_line(scope: dict, state: dict, status: int, latency: float) -> None:
    tenant = state.get("tenant")
    fields = {
        "event": "request",
        "request_id": state.get("request_id"),
        "tenant": tenant.tenant_id if tenant is not None else state.get("principal", "anonymous"),
        "method": scope.get("method"),
        "path": scope.get("path"),
        "status": status,
        **state.get("audit", {}),
        "latency_s": round(latency, 4),
    }
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k != "event" and v is not None)
    logger.info("request %s", text, extra={"fields": fields})
