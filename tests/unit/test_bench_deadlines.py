"""`banyan bench deadlines`' client and its accounting (banyan/bench/deadlines.py): a request that has no first
token within the client's patience is given up, as real clients time out, and counts as late, never as met."""

from __future__ import annotations

import asyncio
import time

import httpx

from banyan.bench.deadlines import Sent, _one, summarize


def test_a_request_with_no_first_token_in_time_is_given_up():
    async def run() -> tuple[Sent, float]:
        async def never_answer(reader, writer):
            await reader.read(1 << 16)
            await asyncio.sleep(30)  # the head of the queue never moves
            writer.close()

        server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            start = time.monotonic()
            sent = await _one(http, {"prompt": [1, 2], "stream": True}, give_up_after=0.3)
            return sent, time.monotonic() - start

    sent, seconds = asyncio.run(run())
    assert sent.gave_up and sent.ttft is None and seconds < 5


def test_a_given_up_request_the_server_had_admitted_counts_as_late():
    sent = [Sent(status=200, ttft=0.5), Sent(status=200, ttft=3.5), Sent(status=200, gave_up=True),
            Sent(status=None, gave_up=True), Sent(status=503, answered_after=0.01)]
    report = summarize(sent, slo_s=2.0)
    assert report["met"] == 1 and report["goodput"] == 0.2
    assert report["admitted_late_by_over_50pct"] == 2  # 3.5 s, and the admitted one given up
    assert report["gave_up"] == 2 and report["refused"] == 1 and report["other"] == 0
