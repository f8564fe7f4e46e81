"""One local Ray for the whole suite (it takes ~10 s to start here), sized for a 2-core machine."""

from __future__ import annotations

import os

import pytest

# A planted API key: set before Ray starts so every worker inherits it; tests assert it never leaks.
os.environ.setdefault("RAY_ROLLOUTS_TEST_SECRET", "sk-planted-" + os.urandom(12).hex())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


METRICS_PORT = _free_port()
"""The session Ray's Prometheus endpoint (`http://127.0.0.1:METRICS_PORT/metrics`), read by the metrics tests."""


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # Logical CPUs above the physical two: actors here mostly wait, and tests pack many of them.
        ray.init(
            address="local",  # a new cluster of our own, even if `ray start` left one to join on this machine
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
            _metrics_export_port=METRICS_PORT,
            _system_config={"metrics_report_interval_ms": 1000},  # tests read metrics within seconds
        )
    yield ray
    ray.shutdown()


def served_like_vllm(**overrides):
    """Stand-in options with the flags `ServerSpec` gives a production vLLM server (Qwen3 tool and reasoning
    parsers, LoRA sized for retention, weight-update routes), plus the test routes (`admin`)."""
    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.inference.server_actor import ServerSpec, standin_options

    return standin_options(ServerSpec(kind="standin", model=BUNDLED_MODEL), admin=True, **overrides)


@pytest.fixture(scope="session")
def standin():
    """One bundled stand-in inference server process for the whole suite, default options. Tests steer
    it per request with `X-Standin-*` headers (fault, latency, correct rate), never by restarting it."""
    from rollout_actors.inference.standin import StandinServer

    with StandinServer(served_like_vllm()) as server:
        yield server


@pytest.fixture(scope="session")
def standin_pair():
    """Two more stand-in servers (endpoint stickiness across servers); started only when asked for."""
    from rollout_actors.inference.standin import StandinServer

    options = served_like_vllm()
    pair = [StandinServer(options).start(wait=False), StandinServer(options).start(wait=False)]
    try:
        yield tuple(server.wait_ready() for server in pair)
    finally:
        for server in pair:
            server.stop()
