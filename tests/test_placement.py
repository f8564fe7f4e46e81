"""Placement policy (`rollout_actors.plane.placement`), without Ray: groups land together, within a load bound,
and a saturated server is never locked in by what it has cached."""

from __future__ import annotations

from collections import Counter

import pytest

from rollout_actors.plane.placement import Placement, PlacementConfig, prefix_key
from rollout_actors.plane.submission import _member
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest

SERVERS = ["http://a/v1", "http://b/v1", "http://c/v1", "http://d/v1"]


def _request(task_index: int, **changes: object) -> RolloutRequest:
    raw = {
        "env": Ref("env_actors.examples.math_env:MathEnv"),
        "task_index": task_index,
        "client": ClientConfig(base_url="http://unused/v1", model="m"),
        "sampling": {"seed": 7},
        **changes,
    }
    return RolloutRequest.model_validate(raw)


def _place_group(placement: Placement, key: str, n: int, load: Counter[str]) -> list[str]:
    placed = []
    for _ in range(n):
        url = placement.place(key, SERVERS, load)
        assert url is not None
        load[url] += 1
        placed.append(url)
    return placed


def test_group_members_share_a_prefix_key_and_other_tasks_do_not():
    raw = _request(3).model_dump()
    members = [RolloutRequest.model_validate(_member(raw, "g1", i)) for i in range(8)]
    assert len({m.sampling.seed for m in members}) == 8
    assert len({prefix_key(m) for m in members}) == 1
    assert prefix_key(_request(4)) != prefix_key(members[0])
    assert prefix_key(_request(3, client=ClientConfig(base_url="http://unused/v1", model="adapter-1"))) != (
        prefix_key(members[0])
    )
    # Each weight version has its own cache salt: nothing cached under the last one is a hit.
    assert prefix_key(_request(3, policy_version=2)) != prefix_key(_request(3, policy_version=1))


def test_a_group_lands_whole_on_one_server_and_groups_spread_over_servers():
    placement, load = Placement(), Counter[str]()
    homes = []
    for group in range(4):
        placed = _place_group(placement, f"task-{group}", 8, load)
        assert len(set(placed)) == 1, placed
        homes.append(placed[0])
    assert sorted(homes) == SERVERS
    # Nothing has finished: a fifth group whole on one server would put it past 1.25 x the mean, so it
    # splits over two, and the spread stays within the bound.
    fifth = _place_group(placement, "task-4", 8, load)
    assert len(set(fifth)) == 2 and max(load.values()) <= 1.25 * sum(load.values()) / 4


def test_a_new_member_goes_where_its_prefix_was_placed_even_if_another_server_is_emptier():
    placement, load = Placement(), Counter({url: 20 for url in SERVERS})
    home = placement.place("task", SERVERS, load)
    assert home is not None
    load[home] += 1
    load[SERVERS[3] if home != SERVERS[3] else SERVERS[0]] -= 10  # another server empties meanwhile
    assert placement.place("task", SERVERS, load) == home


def test_affinity_gives_way_at_the_load_bound():
    placement = Placement(PlacementConfig(slack=1.25, floor=0))
    load = Counter({url: 32 for url in SERVERS})
    home = placement.place("task", SERVERS, load)
    assert home is not None
    load[home] += 1
    placed = _place_group(placement, "task", 7, load)
    assert placed.count(home) == 7 and load[home] == 40  # the bound, 1.25 x 136 / 4 = 42.5, is not reached
    more = _place_group(placement, "task", 8, load)
    # The home takes 3 more (at 43 the bound is 1.25 x 140 / 4 = 43.75); the rest spill elsewhere.
    assert more.count(home) == 3 and load[home] == 43
    # The spill servers now hold the key too: the next member joins the least-loaded holder under the bound.
    spill = [url for url in more if url != home]
    assert placement.place("task", SERVERS, load) in spill


def test_a_saturated_server_is_not_locked_in_by_its_cached_prefixes():
    """A server that stopped finishing rollouts keeps what it holds in flight; the keys it ran go
    elsewhere once it is past the bound, and the spread stays within the bound, where hashing the key
    to a server (the session-sticky baseline) would keep feeding it."""
    prefix, hashed = Placement(), Placement(PlacementConfig(strategy="hashed"))
    for placement in (prefix, hashed):
        load = Counter[str]()
        stuck = placement.place("hot", SERVERS, load)
        assert stuck is not None
        on_stuck = 0
        for step in range(400):
            url = placement.place("hot" if step % 2 == 0 else f"other-{step % 16}", SERVERS, load)
            assert url is not None
            load[url] += 1
            on_stuck += url == stuck
            # Every server but the stuck one finishes what it was given at once.
            for other in SERVERS:
                if other != stuck:
                    load[other] = 0
        if placement is prefix:
            # It stops drawing at the floor (8): past it, 1.25 x a mean of a quarter of its own count.
            assert load[stuck] == 8 and on_stuck == 8
        else:
            assert on_stuck >= 200  # every "hot" rollout went to the stuck server


def test_a_server_that_leaves_routing_loses_its_keys_and_a_dead_holder_is_skipped():
    placement, load = Placement(), Counter[str]()
    home = placement.place("task", SERVERS, load)
    rest = [url for url in SERVERS if url != home]
    assert placement.place("task", rest, load) in rest
    assert placement.place("task", [], load) is None


def test_least_loaded_breaks_ties_by_the_server_chosen_least_recently():
    placement, load = Placement(PlacementConfig(strategy="least_loaded")), Counter[str]()
    picks = [placement.place(f"k{i}", SERVERS, load) for i in range(8)]  # nothing ever starts: all tie
    assert picks == SERVERS + SERVERS


@pytest.mark.parametrize("strategy", ["prefix", "least_loaded", "hashed"])
def test_no_key_means_least_loaded(strategy):
    placement = Placement(PlacementConfig(strategy=strategy))
    load = Counter({SERVERS[0]: 3, SERVERS[1]: 1, SERVERS[2]: 2, SERVERS[3]: 5})
    assert placement.place(None, SERVERS, load) == SERVERS[1]


def test_placement_config_refuses_unknown_fields():
    with pytest.raises(ValueError):
        PlacementConfig.model_validate({"strategy": "prefix", "slak": 2})


def _prefix_cache_counts(server) -> tuple[float, float]:
    """(hits, queries) in tokens, from the server's `/metrics`."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("prefix_cache_hits"), total("prefix_cache_queries")


@pytest.mark.slow
def test_a_groups_members_land_on_one_standin_and_meet_its_prefix_cache(ray_session, standin_pair):
    """Real plane, real stand-ins: two groups of four, each on one server (the two on different ones).
    Each group's prompt is some 500 tokens: its members after the first find all but the last partial
    block cached, so each server's hit rate passes 0.6 (3 of 4 prompts nearly whole); members spread two
    and two would give about 0.4."""
    import asyncio

    from env_pools import TEST_REF_PREFIXES

    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.plane import PlaneConfig, RolloutPlane
    from rollout_actors.wire import SamplingConfig

    endpoints = [server.base_url for server in standin_pair]
    before = [_prefix_cache_counts(server) for server in standin_pair]

    def group_request(task_index: int) -> RolloutRequest:
        client = ClientConfig(model=BUNDLED_MODEL, headers={"X-Standin-Latency": "0.3"})
        question = (
            " ".join(f"line {task_index}-{i}: the quick brown fox" for i in range(60)) + " What is 2 + 2?"
        )
        return RolloutRequest(
            env=Ref("env_actors.examples.math_env:MathEnv"),
            task={"question": question, "answer": 4},
            client=client,
            sampling=SamplingConfig(max_tokens=32, seed=5),
        )

    async def scenario():
        config = PlaneConfig(
            lanes={"train": 8},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
            endpoints=endpoints,
        )
        async with RolloutPlane(config) as plane:
            handles = [await plane.submit_group(group_request(task), n=4) for task in (0, 1)]
            return [await handle for handle in handles]

    groups = asyncio.run(asyncio.wait_for(scenario(), 180))
    sessions = [server.session_counts() for server in standin_pair]
    homes = []
    for group in groups:
        assert all(r.kind == "ok" for r in group.results), [(r.kind, r.error) for r in group.results]
        served_by = {
            i for r in group.results for i, counts in enumerate(sessions) if counts.get(r.request_id)
        }
        assert len(served_by) == 1, (group.group_id, sessions)
        homes.append(served_by.pop())
    assert sorted(homes) == [0, 1]
    after = [_prefix_cache_counts(server) for server in standin_pair]
    rates = [(a[0] - b[0]) / (a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    assert all(rate > 0.6 for rate in rates), rates
