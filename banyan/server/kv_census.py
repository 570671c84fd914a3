"""GET /admin/kv's answer: the engine core's KV census, or with data-parallel replicas every replica's and their sum.

    one core      {num_pages, num_free, num_in_use, num_cached, num_locked, num_running, num_waiting,
                   integrity, integrity_error}
    N replicas    the same counts summed over the replicas that answered, integrity "ok" only when each of them
                  is, and "replicas": [{replica, state, <its counts>, integrity, integrity_error} or
                                       {replica, state, error} for one that did not answer (down, restarting, wedged)]
"""

from __future__ import annotations

import asyncio

import msgspec

from banyan.ipc import messages as m
from banyan.ipc.client import EngineClient, EngineDeadError
from banyan.ipc.dp_client import DataParallelClient

COUNTS = [name for name in m.KvCensus.__struct_fields__ if name != "integrity_error"]


async def kv_census(client: EngineClient | DataParallelClient) -> dict:
    """The census as GET /admin/kv shows it; EngineDeadError or asyncio.TimeoutError when no core answered."""
    if not isinstance(client, DataParallelClient):
        return census_of(await client.kv_report())
    answers = await client.kv_reports()
    answered = [a for a in answers if isinstance(a, m.KvReport)]
    if not answered:
        raise next((a for a in answers if isinstance(a, asyncio.TimeoutError)), EngineDeadError("no replica answered"))
    replicas = [{"replica": i, "state": health.state} | (census_of(a) if isinstance(a, m.KvReport) else
                                                         {"error": str(a).splitlines()[0] if str(a) else "no answer"})
                for i, (a, health) in enumerate(zip(answers, client.health))]
    errors = [f"replica {r['replica']}: {r['integrity_error']}" for r in replicas if r.get("integrity_error")]
    totals = {name: sum(getattr(a, name) for a in answered) for name in COUNTS}
    return totals | {"integrity": "broken" if errors else "ok", "integrity_error": "; ".join(errors) or None,
                     "replicas": replicas}


def census_of(report: m.KvReport) -> dict:
    census = msgspec.structs.asdict(report)
    del census["query_id"]
    return census | {"integrity": "ok" if report.integrity_error is None else "broken"}
