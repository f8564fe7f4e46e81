"""Policy publication (LoRA) against two real stand-in servers: capture, write, load, switch, fail."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest
from adapters import served_models, unload_adapters
from safetensors.numpy import load_file
from waiting import runner

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.policy.lora import CONFIG_FILE, WEIGHTS_FILE, LoraAdapter, lora_config
from rollout_actors.policy.publish import ActivePolicy, PolicyPublisher, PublishFailure

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

DEADLINE_S = 60  # per test; publication itself is bounded by the publisher's timeouts


run = runner(DEADLINE_S)


@pytest.fixture(scope="module")
def servers(standin_pair):
    return [server.base_url for server in standin_pair]


@pytest.fixture(autouse=True)
def no_adapters_loaded(servers):
    """Every test starts from servers holding only the base model."""
    yield
    unload_adapters(servers)


def adapter(seed: int = 0, rank: int = 8, width: int = 64) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    tensors = {
        f"base_model.model.layers.0.self_attn.{m}.lora_{ab}.weight": rng.standard_normal(
            (rank, width) if ab == "A" else (width, rank), dtype=np.float32
        )
        for m in ("q_proj", "v_proj")
        for ab in ("A", "B")
    }
    return LoraAdapter(tensors, lora_config(rank, 2 * rank, ["q_proj", "v_proj"], BUNDLED_MODEL))


def write_adapter_dir(path, seed: int = 0) -> None:
    """The files a trainer writes for one adapter (PEFT layout), into `path`."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    lora = adapter(seed=seed, rank=4)
    save_file(dict(lora.tensors), str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps(dict(lora.config)))


def load_directly(url: str, name: str, path: str) -> int:
    with httpx.Client(timeout=5, trust_env=False) as client:
        body = {"lora_name": name, "lora_path": path}
        return client.post(f"{url.removesuffix('/v1')}/v1/load_lora_adapter", json=body).status_code


def test_publish_returns_at_capture_then_every_server_loads_it_and_new_rollouts_switch(servers, tmp_path):
    lora = adapter()

    async def scenario():
        publisher = PolicyPublisher(servers, tmp_path, load_timeout_s=10, retries=1)
        try:
            handle = await publisher.publish(lora, version=1)
            # Nothing is written or switched yet: the caller only waited for the capture.
            assert publisher.current() is None and not handle.done()
            policy = await handle.wait()
            assert policy == ActivePolicy("policy-v1", 1) == publisher.current()
            return policy
        finally:
            await publisher.aclose()

    policy = run(scenario())
    for url in servers:
        assert policy.name in served_models(url)
        with httpx.Client(timeout=10, trust_env=False) as client:
            body = {"model": policy.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert client.post(f"{url}/chat/completions", json=body).status_code == 200
    (directory,) = [p for p in tmp_path.iterdir() if p.name.startswith("policy-v1")]
    written = load_file(str(directory / WEIGHTS_FILE))
    assert written.keys() == lora.tensors.keys()
    assert all(np.array_equal(written[k], lora.tensors[k]) for k in written)
    assert json.loads((directory / CONFIG_FILE).read_text())["r"] == 8


def test_caller_may_overwrite_its_arrays_as_soon_as_publish_returns(servers, tmp_path):
    lora = adapter(seed=1)
    original = {k: v.copy() for k, v in lora.tensors.items()}

    async def scenario():
        async with asyncio.timeout(DEADLINE_S):
            publisher = PolicyPublisher(servers, tmp_path, load_timeout_s=10, retries=1)
            handle = await publisher.publish(lora, version=1)
            for array in lora.tensors.values():  # before the event loop even starts the write
                array[...] = 0.0
            await handle.wait()
            await publisher.aclose()

    asyncio.run(scenario())
    (directory,) = tmp_path.glob("policy-v1-*")
    written = load_file(str(directory / WEIGHTS_FILE))
    assert all(np.array_equal(written[k], original[k]) for k in original)


def test_donated_arrays_are_frozen_not_copied_and_published(servers, tmp_path):
    donated = adapter(seed=3)

    async def scenario():
        publisher = PolicyPublisher(servers, tmp_path, load_timeout_s=10, retries=1)
        try:
            handle = await publisher.publish(donated, version=1, donate=True)
            return await handle.wait(timeout=30)
        finally:
            await publisher.aclose()

    active = run(scenario())
    assert active.version == 1 and all("policy-v1" in served_models(url) for url in servers)
    written = load_file(str(next(tmp_path.iterdir()) / WEIGHTS_FILE))
    for name, array in donated.tensors.items():
        assert not array.flags.writeable  # handed over: the caller can no longer change it under us
        with pytest.raises(ValueError):
            array[0, 0] = 1.0
        np.testing.assert_array_equal(written[name], array)


def test_adapter_directory_is_captured_so_the_trainer_can_overwrite_it(servers, tmp_path):
    source = tmp_path / "trainer-out"
    write_adapter_dir(source, seed=1)
    first = (source / WEIGHTS_FILE).read_bytes()

    async def scenario():
        publisher = PolicyPublisher(servers, tmp_path / "published", load_timeout_s=10, retries=1)
        handle = await publisher.publish(source, version=3)
        write_adapter_dir(source, seed=2)  # the next step's weights, over the same files
        await handle.wait()
        await publisher.aclose()

    run(scenario())
    (directory,) = (tmp_path / "published").glob("policy-v3-*")
    assert (directory / WEIGHTS_FILE).read_bytes() == first != (source / WEIGHTS_FILE).read_bytes()
    assert all("policy-v3" in served_models(url) for url in servers)


def test_refusing_server_fails_the_publication_by_name_and_the_previous_policy_stays(servers, tmp_path):
    refuser = servers[1]
    # The second server already holds a different adapter under the name v2 will get: vLLM (and the
    # stand-in) refuse a second load of a name with 400.
    stale = tmp_path / "stale"
    write_adapter_dir(stale, seed=9)
    assert load_directly(refuser, "policy-v2", str(stale)) == 200

    async def scenario():
        publisher = PolicyPublisher(servers, tmp_path / "published", load_timeout_s=10, retries=2)
        try:
            await (await publisher.publish(adapter(), version=1)).wait()
            handle = await publisher.publish(adapter(seed=2), version=2)
            with pytest.raises(PublishFailure) as caught:
                await handle.wait()
            return caught.value, publisher.current()
        finally:
            await publisher.aclose()

    failure, current = run(scenario())
    assert failure.server == refuser.removesuffix("/v1") and failure.stage == "load"
    assert failure.failure.status_code == 400 and "already been loaded" in failure.failure.message
    assert list(failure.failures) == [refuser.removesuffix("/v1")]
    assert refuser.removesuffix("/v1") in str(failure)
    assert current == ActivePolicy("policy-v1", 1)
    # The server that did take v2 was rolled back, and v2's files are gone.
    assert "policy-v2" not in served_models(servers[0])
    assert not list((tmp_path / "published").glob("policy-v2-*"))


def test_server_that_is_down_fails_the_publication_after_bounded_retries(servers, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"  # bound, never listening: refused

    async def scenario():
        publisher = PolicyPublisher([*servers, down], tmp_path, load_timeout_s=2, retries=2)
        try:
            with pytest.raises(PublishFailure) as caught:
                await (await publisher.publish(adapter(), version=1)).wait()
            return caught.value, publisher.current()
        finally:
            await publisher.aclose()

    failure, current = run(scenario())
    assert failure.server == down.removesuffix("/v1")
    assert failure.failure.type == "ConnectError"
    assert current is None
    assert all("policy-v1" not in served_models(url) for url in servers)


def test_wedged_server_times_out_within_the_load_timeout_and_retries(servers, tmp_path):
    async def scenario():
        async def never_answer(reader, writer):
            await asyncio.sleep(3600)

        wedged = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{wedged.sockets[0].getsockname()[1]}"
        publisher = PolicyPublisher([servers[0], url], tmp_path, load_timeout_s=0.5, retries=1)
        try:
            with pytest.raises(PublishFailure) as caught:
                # Two attempts of 0.5 s plus one backoff: bounded. The deadline fails the test on a hang.
                await (await publisher.publish(adapter(), version=1)).wait(timeout=20)
            return caught.value, url
        finally:
            await publisher.aclose()
            wedged.close()

    failure, wedged_url = run(scenario())
    assert failure.server == wedged_url and "Timeout" in failure.failure.type


def test_versions_must_increase_and_unloadable_adapters_are_refused_on_the_callers_path(servers, tmp_path):
    empty_dir = tmp_path / "no-config"
    empty_dir.mkdir()
    (empty_dir / WEIGHTS_FILE).write_bytes(b"x")

    async def scenario():
        publisher = PolicyPublisher(servers, tmp_path / "published", load_timeout_s=10, retries=1)
        try:
            await (await publisher.publish(adapter(), version=5)).wait()
            with pytest.raises(ValueError, match="not newer"):
                await publisher.publish(adapter(), version=5)
            with pytest.raises(ValueError, match=CONFIG_FILE):
                await publisher.publish(empty_dir, version=6)
            with pytest.raises(ValueError, match="lora_alpha"):
                await publisher.publish(LoraAdapter(adapter().tensors, {"r": 8}), version=6)
            assert publisher.current() == ActivePolicy("policy-v5", 5)
        finally:
            await publisher.aclose()

    run(scenario())


def test_no_live_server_is_a_publish_failure_not_a_silent_success(tmp_path):
    async def scenario():
        publisher = PolicyPublisher(lambda: [], tmp_path, load_timeout_s=1, retries=0)
        try:
            with pytest.raises(PublishFailure) as caught:
                await (await publisher.publish(adapter(), version=1)).wait()
            assert caught.value.stage == "servers" and caught.value.server is None
            assert publisher.current() is None
        finally:
            await publisher.aclose()

    run(scenario())


def test_old_versions_are_unloaded_and_deleted_past_retention(servers, tmp_path):
    async def scenario():
        publisher = PolicyPublisher(servers, tmp_path, load_timeout_s=10, retries=1, retain=2)
        try:
            for version in (1, 2, 3):
                await (await publisher.publish(adapter(seed=version), version=version)).wait()
        finally:
            await publisher.aclose()

    run(scenario())
    for url in servers:
        assert {"policy-v2", "policy-v3"} <= served_models(url)
        assert "policy-v1" not in served_models(url)
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == ["v2", "v3"]


def test_a_checked_out_version_outlives_retention_until_checked_in(servers, tmp_path):
    async def scenario():
        publisher = PolicyPublisher(servers, tmp_path, load_timeout_s=10, retries=1, retain=2)
        try:
            await (await publisher.publish(adapter(seed=1), version=1)).wait()
            in_use = publisher.checkout()
            for version in (2, 3, 4):
                await (await publisher.publish(adapter(seed=version), version=version)).wait()
            kept = {url: served_models(url) for url in servers}
            publisher.checkin(in_use.version)
            for _ in range(100):
                if all("policy-v1" not in served_models(url) for url in servers):
                    break
                await asyncio.sleep(0.05)
            return in_use, kept
        finally:
            await publisher.aclose()

    in_use, kept = run(scenario())
    assert in_use.version == 1
    for url in servers:
        assert {"policy-v1", "policy-v3", "policy-v4"} <= kept[url] and "policy-v2" not in kept[url]
        assert "policy-v1" not in served_models(url)
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == ["v3", "v4"]


@pytest.mark.slow
def test_replacement_server_gets_the_active_adapter_before_traffic(servers, tmp_path):
    async def scenario():
        publisher = PolicyPublisher(servers[:1], tmp_path, load_timeout_s=10, retries=1)
        try:
            await (await publisher.publish(adapter(), version=1)).wait()
            assert "policy-v1" not in served_models(servers[1])
            await publisher.load_current(servers[1])  # what InferenceServerSet.before_routing calls
            await publisher.load_current(servers[1])  # idempotent: the name is ours and holds this adapter
        finally:
            await publisher.aclose()

    run(scenario())
    assert "policy-v1" in served_models(servers[1])
