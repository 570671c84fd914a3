"""How long a data-parallel replica is out after its core dies: until a new core is ready, when the first new core
fails at start-up (retried after the backoff) and when it does not.

    python benchmarks/dp_restart.py --model DIR [--rounds 2]

Each round starts two replicas with --fault fail-restarts=1 (ipc/dp_client.py), SIGKILLs replica 0 and times until
it is up again (a failed start, the 1 s backoff, a start), then SIGKILLs it again and times the plain restart.
The difference is what a failed start costs; requests go to replica 1 all the while."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time

from banyan.config_args import config_from_kwargs
from banyan.ipc.dp_client import DataParallelClient


async def time_to_up(client: DataParallelClient) -> float:
    start = time.monotonic()
    os.kill(client.replicas[0].pid, signal.SIGKILL)
    while client.health[0].state == "up":  # until the client sees the death
        await asyncio.sleep(0.05)
    while client.health[0].state != "up":
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def one_round(model: str) -> dict:
    config = config_from_kwargs(dict(model=model, num_threads=1, block_size=4, num_pages=64, data_parallel_size=2))
    client = await DataParallelClient.start(config, fault="fail-restarts=1")
    try:
        with_failure = await time_to_up(client)
        plain = await time_to_up(client)
        return {"with_a_failed_start_s": round(with_failure, 2), "plain_s": round(plain, 2),
                "failed_starts": client.health[0].failed_starts, "restarts": client.health[0].restarts}
    finally:
        await client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.rounds):
        print(json.dumps(asyncio.run(one_round(args.model))), flush=True)


if __name__ == "__main__":
    main()
