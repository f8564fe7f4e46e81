"""The suite's shared fixtures: one local Ray for the whole suite (it takes ~10 s to start here), sized for a
2-core machine, and the stand-in servers.

Two layers. A test that uses Ray (the `ray_session` fixture, directly or through another fixture) or starts
a Ray cluster of its own (marked `ray` in its module) is a real-actor test and carries the `ray` marker;
every other test is a Ray-free unit test (fakes, pure functions, or a stand-in server process), and fails if
it starts Ray. `pytest` runs both; `pytest -m "not ray"` runs only the Ray-free layer, in about a minute.
Shared helpers live beside this file: `waiting` (run under a deadline, poll), `planes` (small planes),
`env_pools`, `adapters`."""

from __future__ import annotations

import os
import sys

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

RAY_MARKER = "ray: a real-actor test (the session Ray or a Ray cluster of its own); -m 'not ray' skips it"


def pytest_configure(config):
    config.addinivalue_line("markers", RAY_MARKER)


def pytest_collection_modifyitems(items):
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def _unit_tests_stay_ray_free(request):
    """A test without the `ray` marker that starts Ray in this process fails: it belongs to the real-actor
    layer (ask for `ray_session`), or it reached Ray by accident."""
    if request.node.get_closest_marker("ray") is not None or _ray_running():
        yield
        return
    yield
    assert not _ray_running(), f"{request.node.nodeid} started Ray without the `ray` marker or `ray_session`"


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # The raylet gives the dashboard agent this long to come up; its default (~30 s) is not enough on a
    # loaded 2-core machine, and the raylet then aborts the whole session's startup.
    os.environ.setdefault("RAY_agent_register_timeout_ms", "300000")
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
            server.close()
