"""Placement: which inference server a rollout runs on, chosen once for its whole life (contract 6).

    placement = Placement(PlacementConfig())                       # strategy "prefix", the default
    url = placement.place(prefix_key(request), live, load)         # load: rollouts in flight per server

A GRPO group sends one prompt `n` times, and a rollout's later turns extend its earlier ones: a vLLM server
computes a prompt's blocks once and serves every later request that starts with them from its prefix
cache, but only requests that reach the same server. Strategies:

- **prefix** (default): a rollout goes to a server that already ran its prefix key (the task, as the
  group's members share it), the least loaded of those, unless that server is past the load bound; then
  to the least-loaded server, which becomes another holder of the key. The bound is relative to the mean
  (`slack`), and never below `floor`, so a whole group can land on one server of an idle plane. A server that
  slows down holds its rollouts longer, so its count passes the bound and its keys spill elsewhere: the
  affinity never locks a saturated server into serving (and thrashing on) what it holds, the failure of
  hashing sessions to servers (prime-rl #3255).
- **least_loaded**: the fewest rollouts in flight, ties to the server chosen least recently (a tie broken
  by list order would pin every rollout that starts on a quiet plane to the first server). Each rollout
  still keeps its server for all its turns, so this is prime-rl's sticky least-loaded with the rollout as
  the session.
- **hashed**: the key's hash picks the server (session-sticky by consistent hashing), whatever its load.
  Kept as the baseline `scripts/bench_placement.py` measures against; not for production.

A rollout's later turns need no lookup: its client keeps the server it was placed on, re-dispatches
included. Plain state, no Ray: the plane calls `place` from its one event loop.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from itertools import count
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout_actors.plane.naming import canonical_json
from rollout_actors.wire import RolloutRequest

Strategy = Literal["prefix", "least_loaded", "hashed"]
MAX_KEYS = 65_536  # keys remembered, least recently placed dropped first: far more prompts than a
# server's prefix cache holds, so a forgotten key's blocks are most likely evicted there as well


class PlacementConfig(BaseModel):
    """How the plane places rollouts on inference servers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy = "prefix"
    slack: float = Field(default=1.25, ge=1.0, le=4.0)
    """A server past `slack` x the mean rollouts in flight per server draws no more rollouts by affinity."""
    floor: int = Field(default=8, ge=0, le=4096)
    """A server holding fewer rollouts than this draws by affinity whatever the mean: one GRPO group of
    the usual size, so a group lands whole on one server of a nearly idle plane. (A bound of mean plus a
    group let a busy plane run past `slack`.)"""


def prefix_key(request: RolloutRequest, model: str | None = None, policy_version: int | None = None) -> str:
    """What decides a rollout's first prompt blocks, hashed: the environment and its task, the model
    (an adapter's name is part of vLLM's block hashes), the renderer and the policy version (its
    `cache_salt`). A group's members differ only in ids and seeds, so they share it. `model` and
    `policy_version`, where given, are what the plane chose for it (the request itself is never rewritten)."""
    parts = [
        request.env.model_dump(mode="json"),
        request.task_index,
        request.task,
        model or request.client.model,
        request.mode,
        request.renderer.model_dump(mode="json"),
        request.policy_version if policy_version is None else policy_version,
    ]
    return hashlib.blake2b(canonical_json(parts), digest_size=12).hexdigest()


class Placement:
    """The placement state: which servers ran which keys, and when each server was last chosen."""

    def __init__(self, config: PlacementConfig | None = None) -> None:
        self.config = config or PlacementConfig()
        self._holders: OrderedDict[str, list[str]] = OrderedDict()
        """key -> servers it was placed on, most recent last; keys least recently placed first."""
        self._chosen_at: dict[str, int] = {}
        self._clock = count(1)

    def place(self, key: str | None, live: Sequence[str], load: Mapping[str, int]) -> str | None:
        """The server for a new rollout with prefix key `key` (None: no affinity), among `live`, given
        the rollouts in flight per server. None when no server is live."""
        if not live:
            return None
        strategy = self.config.strategy
        if key is None or strategy == "least_loaded":
            choice = self._least_loaded(live, load)
        elif strategy == "hashed":
            servers = sorted(live)
            choice = servers[
                int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest()) % len(servers)
            ]
        else:
            choice = self._by_prefix(key, live, load)
        self._chosen_at[choice] = next(self._clock)
        if key is not None:
            self._remember(key, choice)
        return choice

    def bound(self, total: int, servers: int) -> float:
        """Most rollouts a server may hold, this one included, and still draw rollouts by affinity, when
        `total` are in flight on `servers` servers counting the one being placed."""
        return max(self.config.slack * total / servers, self.config.floor)

    def holders(self, key: str) -> list[str]:
        """Servers the key was placed on, most recent last."""
        return list(self._holders.get(key, ()))

    def _by_prefix(self, key: str, live: Sequence[str], load: Mapping[str, int]) -> str:
        live_set = set(live)
        bound = self.bound(sum(load.get(url, 0) for url in live) + 1, len(live))
        room = [
            url for url in self._holders.get(key, ()) if url in live_set and load.get(url, 0) + 1 <= bound
        ]
        if room:
            return self._least_loaded(room, load)
        return self._least_loaded(live, load)

    def _least_loaded(self, servers: Sequence[str], load: Mapping[str, int]) -> str:
        return min(servers, key=lambda url: (load.get(url, 0), self._chosen_at.get(url, 0)))

    def _remember(self, key: str, server: str) -> None:
        holders = self._holders.pop(key, [])
        if server in holders:
            holders.remove(server)
        holders.append(server)
        self._holders[key] = holders
        while len(self._holders) > MAX_KEYS:
            self._holders.popitem(last=False)
