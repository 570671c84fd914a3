"""The server's text pool saturated (found by the soak's text_pool fault): a request queued behind others is not
the one at fault. Its time cap starts when a worker takes it; no worker free in time is 503 + Retry-After, never
the 400 "took too long" that blames its prompt. Work that runs past the cap is still the request's 400."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from banyan.config import ServerConfig
from banyan.server.errors import APIError
from banyan.server.metrics import ServerMetrics
import banyan.server.app  # noqa: F401 - loads the server modules in the order their imports need
from banyan.server.serving import OpenAIServing

CAP = 0.3  # render_timeout, seconds


def serving() -> OpenAIServing:
    engine = SimpleNamespace(info=SimpleNamespace(max_model_len=64, vocab_size=100))  # never asked to generate here
    return OpenAIServing(ServerConfig(render_timeout=CAP), engine, tokenizer=None, model_names=["m"],
                         metrics=ServerMetrics("m"))


def test_a_request_queued_behind_a_busy_pool_gets_503_not_400():
    s, release = serving(), threading.Event()

    async def run():
        busy = [asyncio.ensure_future(s.offload(release.wait, 10)) for _ in range(2)]  # both workers held
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await s.offload(lambda: "never ran")
        release.set()
        await asyncio.gather(*busy)
        return refused.value, await s.offload(lambda: "ran")

    refused, after = asyncio.run(run())
    assert (refused.status, refused.code, refused.retry_after) == (503, "server_overloaded", 1)
    assert after == "ran"  # the pool serves again once free


def test_work_that_runs_past_the_cap_is_the_requests_400():
    async def run():
        with pytest.raises(APIError) as slow:
            await serving().offload(time.sleep, CAP + 1.5)
        return slow.value

    slow = asyncio.run(run())
    assert (slow.status, slow.param) == (400, "prompt")
