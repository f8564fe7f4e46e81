"""How loaded an inference server is, read from its `/metrics` (what load-aware concurrency steers by).

    reader = LoadReader(api_key_var="VLLM_KEY")
    load = await reader.read("http://gpu-1:8000/v1")   # ServerLoad(kv_cache_usage=0.42, running=96, waiting=3)
    await reader.aclose()

vLLM 0.33.0 exports, per engine (labels `model_name`, `engine`; `vllm/v1/metrics/loggers.py`):
`vllm:kv_cache_usage_perc` (1 means 100 percent), `vllm:num_requests_running`,
`vllm:num_requests_waiting`, and the counter `vllm:num_preemptions_total` (running requests preempted for
want of a KV block). A server with several engines (data parallel) is summed for the counts and
its fullest engine taken for KV usage: preemption starts where the first engine fills. The bundled
stand-in exports the same series from its finite KV budget. `/metrics` is outside vLLM's guarded `/v1`
prefix, but the key is sent anyway (a proxy in front may guard everything).
"""

from __future__ import annotations

import re

from pydantic import BaseModel

from rollout_actors.rollout.client import auth_headers

try:  # openai >= 3 ships its own fork of httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

READ_TIMEOUT_S = 5.0  # a metrics scrape that takes longer says more about the server than its figures
_SAMPLE = re.compile(
    r"^(vllm:kv_cache_usage_perc|vllm:num_requests_running|vllm:num_requests_waiting|vllm:num_preemptions_total)"
    r"(\{[^}]*\})? (\S+)$",
    re.M,
)


class ServerLoad(BaseModel):
    kv_cache_usage: float
    """Fraction of the KV cache in use (0..1), the fullest engine's."""
    running: int
    waiting: int
    preemptions: int = 0
    """Preemptions since the server started (a counter: what matters is how it moves between reads)."""


class MetricsMissing(Exception):
    """The server's `/metrics` lacks vLLM's load series (not a vLLM, or metrics disabled)."""


def parse_load(text: str) -> ServerLoad:
    usage: list[float] = []
    counts = {
        "vllm:num_requests_running": 0.0,
        "vllm:num_requests_waiting": 0.0,
        "vllm:num_preemptions_total": 0.0,
    }
    seen = set()
    for name, _labels, value in _SAMPLE.findall(text):
        seen.add(name)
        if name == "vllm:kv_cache_usage_perc":
            usage.append(float(value))
        else:
            counts[name] += float(value)
    required = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    if not required <= seen:
        raise MetricsMissing(f"/metrics lacks {sorted(required - seen)}")
    return ServerLoad(
        kv_cache_usage=max(usage),
        running=int(counts["vllm:num_requests_running"]),
        waiting=int(counts["vllm:num_requests_waiting"]),
        preemptions=int(counts["vllm:num_preemptions_total"]),
    )


class LoadReader:
    """Reads `ServerLoad` from servers' `/metrics`, with their API key, under a deadline."""

    def __init__(self, api_key_var: str | None = None, timeout_s: float = READ_TIMEOUT_S) -> None:
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), trust_env=False, headers=auth_headers(api_key_var)
        )

    async def read(self, url: str) -> ServerLoad:
        """`url`: the server's base URL, with or without `/v1`. Raises httpx errors or `MetricsMissing`."""
        response = await self._http.get(f"{url.rstrip('/').removesuffix('/v1')}/metrics")
        response.raise_for_status()
        return parse_load(response.text)

    async def aclose(self) -> None:
        await self._http.aclose()
