"""The stand-in server holds 2,048 concurrent open model calls, each sleeping, on a 2-core machine.

Proof of concurrency, not speed: while every call sleeps, the server's own in-flight gauge reaches 2,048,
i.e. no call waited for another to finish. The deadline only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import re

import pytest

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases use httpx
    import httpx

from renderer_actors.tokenizer import BUNDLED_MODEL

CONCURRENT = 2048
SLEEP_S = 5.0  # the production shape: every rollout waits on the model far longer than it computes
DEADLINE_S = 90


@pytest.mark.slow
def test_server_holds_2048_concurrent_sleeping_requests(standin):
    async def scenario() -> tuple[list[int], int]:
        limits = httpx.Limits(max_connections=CONCURRENT + 8, max_keepalive_connections=CONCURRENT + 8)
        timeout = httpx.Timeout(60.0, pool=60.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:

            async def one(i: int) -> int:
                body = {"model": BUNDLED_MODEL, "prompt": [1, 2, 3, i], "max_tokens": 32, "seed": i}
                headers = {"X-Standin-Latency": str(SLEEP_S), "X-Session-ID": f"capacity-{i}"}
                response = await http.post(f"{standin.base_url}/completions", json=body, headers=headers)
                return response.status_code

            calls = asyncio.gather(*(one(i) for i in range(CONCURRENT)))
            peak = 0
            while not calls.done():
                metrics = (await http.get(f"{standin.url}/metrics")).text
                peak = max(peak, int(re.search(r"^standin_requests_in_flight (\d+)", metrics, re.M).group(1)))
                await asyncio.wait([calls], timeout=0.2)
            return await calls, peak

    statuses, peak = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert statuses == [200] * CONCURRENT
    assert peak == CONCURRENT
