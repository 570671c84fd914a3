"""POST /start_profile and /stop_profile (admin key only, app.ADMIN_PATHS): the engine cores' torch profilers.

    POST /start_profile   -> 200 {"profiling": true}
    ... traffic ...
    POST /stop_profile    -> 200 {"profiling": false, "trace": "<profile_dir>/banyan-core-<pid>-<time>.pt.trace.json",
                                  "traces": {"<model>": "<that path>", ...}}

Every ready model's core is profiled (one trace each; `trace` is the first), and with data-parallel replicas every
live replica's core, each into its own file (its pid in the name): `traces` names the first replica's, and
`replica_traces` {"<model>": [replica 0's path, replica 1's, ...]} each one's (null for a replica down, or whose
profiler was not running: a core restarted meanwhile). Without --profile-dir both answer 400 saying so; a start or
stop that no core of a model could do is a 409 (started twice, stopped while not running) or a 500. Each trace is
written by its core process, on the core's machine (ipc/profiler.py).
"""

from __future__ import annotations

import logging

from banyan.ipc import messages as m
from banyan.ipc.client import EngineClient, EngineDeadError
from banyan.ipc.dp_client import DataParallelClient
from banyan.server.errors import APIError

logger = logging.getLogger("banyan.server")

START_DOC = ("Admin key only. Start the torch profiler of every model's engine core, every data-parallel replica's "
             "(needs --profile-dir).")
STOP_DOC = ("Admin key only. Stop the engine cores' torch profilers and write one trace per core (per data-parallel "
            "replica) into --profile-dir.")


async def control_profilers(clients: dict[str, EngineClient | DataParallelClient], profile_dir: str | None,
                            start: bool) -> dict:
    """clients: model name -> its engine client (the ready models)."""
    if profile_dir is None:
        raise APIError(400, "profiling is off: start the server with --profile-dir DIR", code="profiling_disabled")
    traces, replica_traces = {}, {}
    for name, client in clients.items():
        paths = await _control(client, profile_dir, start)
        for path in filter(None, paths):
            logger.info("profiler trace of %s written to %s", name, path)
        if isinstance(client, DataParallelClient):
            replica_traces[name] = paths
        if any(paths):
            traces[name] = next(filter(None, paths))
    if start:
        return {"profiling": True}
    return {"profiling": False, "trace": next(iter(traces.values()), None), "traces": traces,
            **({"replica_traces": replica_traces} if replica_traces else {})}


async def _control(client: EngineClient | DataParallelClient, profile_dir: str, start: bool) -> list[str | None]:
    """Each core's trace path (stop; None where it wrote none), once at least one core did what was asked."""
    try:
        answers = await client.profiles(start, profile_dir)
    except EngineDeadError:  # every data-parallel replica is gone
        answers = []
    statuses = [a for a in answers if isinstance(a, m.ProfileStatus)]
    if not statuses:
        raise APIError(503, "the engine core did not answer", type="server_error", code="engine_unavailable",
                       retry_after=5)
    done = [s for s in statuses if s.error is None]
    for status in statuses:
        if status.error is not None and done:  # another core did it: say why this one did not, go on
            logger.warning("a data-parallel replica's profiler: %s", status.error)
    if not done:
        status = statuses[0]
        if status.conflict:
            raise APIError(409, status.error, code="profiler_state")
        raise APIError(500, f"the profiler failed: {status.error}", type="server_error", code="profiler_failed")
    return [a.trace_path if isinstance(a, m.ProfileStatus) and a.error is None else None for a in answers]
