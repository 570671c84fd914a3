"""POST /start_profile and /stop_profile (admin key only, app.ADMIN_PATHS): the engine core's torch profiler.

    POST /start_profile   -> 200 {"profiling": true}
    ... traffic ...
    POST /stop_profile    -> 200 {"profiling": false, "trace": "<profile_dir>/banyan-core-<pid>-<time>.pt.trace.json"}

Without --profile-dir both answer 400 saying so; a second start (or a stop with none running) is a 409.
The trace is written by the core process, on the core's machine (ipc/profiler.py).
"""

from __future__ import annotations

import asyncio
import logging

from banyan.ipc.client import EngineClient, EngineDeadError
from banyan.server.errors import APIError

logger = logging.getLogger("banyan.server")

START_DOC = "Admin key only. Start the engine core's torch profiler (needs --profile-dir)."
STOP_DOC = "Admin key only. Stop the engine core's torch profiler and write its trace into --profile-dir."


async def control_profiler(client: EngineClient, profile_dir: str | None, start: bool) -> dict:
    if profile_dir is None:
        raise APIError(400, "profiling is off: start the server with --profile-dir DIR", code="profiling_disabled")
    try:
        status = await client.profile(start, profile_dir)
    except (EngineDeadError, asyncio.TimeoutError):
        raise APIError(503, "the engine core did not answer", type="server_error", code="engine_unavailable",
                       retry_after=5) from None
    if status.error is not None:
        if status.conflict:
            raise APIError(409, status.error, code="profiler_state")
        raise APIError(500, f"the profiler failed: {status.error}", type="server_error", code="profiler_failed")
    if status.trace_path is not None:
        logger.info("profiler trace written to %s", status.trace_path)
        return {"profiling": False, "trace": status.trace_path}
    return {"profiling": status.running}
