"""POST /start_profile and /stop_profile (admin key only, app.ADMIN_PATHS): the engine cores' torch profilers.

    POST /start_profile   -> 200 {"profiling": true}
    ... traffic ...
    POST /stop_profile    -> 200 {"profiling": false, "trace": "<profile_dir>/banyan-core-<pid>-<time>.pt.trace.json",
                                  "traces": {"<model>": "<that path>", ...}}

Every ready model's core is profiled (one trace each; `trace` is the first). Without --profile-dir both answer
400 saying so; a second start (or a stop with none running) is a 409. Each trace is written by its core process,
on the core's machine (ipc/profiler.py).
"""

from __future__ import annotations

import asyncio
import logging

from banyan.ipc.client import EngineClient, EngineDeadError
from banyan.server.errors import APIError

logger = logging.getLogger("banyan.server")

START_DOC = "Admin key only. Start the torch profiler of every model's engine core (needs --profile-dir)."
STOP_DOC = "Admin key only. Stop the engine cores' torch profilers and write one trace per core into --profile-dir."


async def control_profilers(clients: dict[str, EngineClient], profile_dir: str | None, start: bool) -> dict:
    """clients: model name -> its engine client (the ready models)."""
    if profile_dir is None:
        raise APIError(400, "profiling is off: start the server with --profile-dir DIR", code="profiling_disabled")
    traces = {}
    for name, client in clients.items():
        path = await _control(client, profile_dir, start)
        if path is not None:
            logger.info("profiler trace of %s written to %s", name, path)
            traces[name] = path
    if start:
        return {"profiling": True}
    return {"profiling": False, "trace": next(iter(traces.values()), None), "traces": traces}


async def _control(client: EngineClient, profile_dir: str, start: bool) -> str | None:
    try:
        status = await client.profile(start, profile_dir)
    except (EngineDeadError, asyncio.TimeoutError):
        raise APIError(503, "the engine core did not answer", type="server_error", code="engine_unavailable",
                       retry_after=5) from None
    if status.error is not None:
        if status.conflict:
            raise APIError(409, status.error, code="profiler_state")
        raise APIError(500, f"the profiler failed: {status.error}", type="server_error", code="profiler_failed")
    return status.trace_path
