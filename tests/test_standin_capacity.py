"""The stand-in server holds 2,048 concurrent open model calls, each sleeping, on a 2-core machine.

Proof of concurrency, not speed: while every call sleeps, the server's own in-flight gauge reaches 2,048,
i.e. no call waited for another to finish. Each call sleeps far longer than opening all 2,048 can take on a
loaded machine, so no call ends before the last one arrives; once the gauge has shown all of them, the
calls are dropped and the server (its own, for this test) stopped. The deadline only turns a hang into a
failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest
from conftest import served_like_vllm

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases use httpx
    import httpx

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.standin import StandinServer

CONCURRENT = 2048
SLEEP_S = 120.0  # the production shape: every rollout waits on the model far longer than it computes
DEADLINE_S = 100


@pytest.mark.slow
def test_server_holds_2048_concurrent_sleeping_requests():
    async def scenario(server: StandinServer) -> int:
        limits = httpx.Limits(max_connections=CONCURRENT + 8, max_keepalive_connections=CONCURRENT + 8)
        timeout = httpx.Timeout(SLEEP_S + 30, pool=60.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:

            async def one(i: int) -> int:
                body = {"model": BUNDLED_MODEL, "prompt": [1, 2, 3, i], "max_tokens": 32, "seed": i}
                headers = {"X-Standin-Latency": str(SLEEP_S), "X-Session-ID": f"capacity-{i}"}
                response = await http.post(f"{server.base_url}/completions", json=body, headers=headers)
                return response.status_code

            calls = asyncio.gather(*(one(i) for i in range(CONCURRENT)))
            peak = 0
            try:
                while peak < CONCURRENT:
                    assert not calls.done(), calls.result() if not calls.exception() else calls.exception()
                    metrics = (await http.get(f"{server.url}/metrics")).text
                    peak = max(peak, int(re.search(r"^standin_requests_in_flight (\d+)", metrics, re.M)[1]))
                    await asyncio.wait([calls], timeout=0.2)
            finally:
                calls.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await calls
            return peak

    with StandinServer(served_like_vllm()) as server:
        peak = asyncio.run(asyncio.wait_for(scenario(server), DEADLINE_S))
    assert peak == CONCURRENT
