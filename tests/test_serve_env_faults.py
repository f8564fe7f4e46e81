"""`rollouts serve-env` under faults, with real actors killed: which runs are dispatched again and which are
answered, and how fast. The environment is `env_actors.faults.serve_envs:HeldServeEnv`, whose frames name
the process that produced them, and the client speaks the serve protocol on a bare DEALER, so the test
sees every frame the front sent a run: a run dispatched twice would show frames of two processes.

- an env server SIGKILLed before its run streamed a delta: the run is dispatched again and answered ok,
  once, every frame from one episode;
- killed after deltas streamed: answered `success=False` naming the env server, never dispatched again;
- the node running a run's env server lost (a two-node `Cluster`, `serve_env_node_loss.py`): answered
  within seconds, the front on the head serving on;
- the front's own actor (its env pool) SIGKILLed with runs in flight: every run answered once, the pool
  restarted, the next 16 runs ok; killed past its restart budget: runs answered at once, none waits.

And our rows of the fault table (`scripts/serve_env_faults.py`), measured as the script measures them
(`serve_env_fault_rows.py`: verifiers' own `EnvClient`, verifiers' episode code, the verifiers-0.4
interpreter), each outcome held with a bound generous enough for a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest
import ray
import zmq
from env_pools import TEST_REF_PREFIXES
from node_loss import report_of
from serve_env_fault_rows import FAULTS, NEXT_RUNS, Setup, front_row
from test_serve_env import Front, vf04_python

from env_actors.config import EnvPoolConfig
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.kernel import Ref
from rollout_actors.kernel.supervision import RestartIntensity
from rollout_actors.plane.config import PoolSupervision
from rollout_actors.serve_env.front import ServeEnvConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HELD = Ref(target="env_actors.faults.serve_envs:HeldServeEnv")
ANSWERED_WITHIN_S = 30.0  # a loss is seen in milliseconds; this is a loaded 2-core CI's slack
QUIET_S = 3.0  # after its reply, how long a run is watched for frames of a second episode
DEADLINE_S = 120.0


def pool(**overrides: Any) -> EnvPoolConfig:
    settings = {"num_cpus": 0.1, "min_servers": 2, "max_servers": 2, "probe_interval_s": 0.2,
                "hang_timeout_s": 5.0, "allowed_ref_prefixes": TEST_REF_PREFIXES, **overrides}  # fmt: skip
    return EnvPoolConfig(**settings)


class Client:
    """A serve-protocol client on a bare DEALER: it sends runs and keeps every frame each one got."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self.socket = self._ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.frames: dict[str, list[tuple[str, dict]]] = {}

    def run(self, **instructions: Any) -> str:
        request_id = uuid.uuid4().hex
        self.frames[request_id] = []
        self.socket.send_multipart([request_id.encode(), b"run", msgpack.packb(instructions)])
        return request_id

    def pump(self, timeout: float) -> None:
        """Take every frame that arrives within `timeout`."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0 and self.socket.poll(int(left * 1000)):
            request_id, kind, data = self.socket.recv_multipart()
            self.frames[request_id.decode()].append((kind.decode(), msgpack.unpackb(data, raw=False)))

    def until(self, done: Any, timeout: float = DEADLINE_S) -> float:
        """Pump until `done()`; the seconds it took. Fails at the deadline: nothing may wait forever."""
        started = time.monotonic()
        while not done():
            assert time.monotonic() - started < timeout, f"still waiting after {timeout} s: {self.frames}"
            self.pump(0.05)
        return time.monotonic() - started

    def replies(self, request_id: str) -> list[dict]:
        return [data for kind, data in self.frames[request_id] if kind == "reply"]

    def deltas(self, request_id: str) -> list[dict]:
        return [data for kind, data in self.frames[request_id] if kind == "delta"]

    def answered(self, *request_ids: str) -> Any:
        return lambda: all(self.replies(r) for r in request_ids)

    def close(self) -> None:
        self.socket.close()
        self._ctx.term()


@pytest.fixture
def front(ray_session):
    fronts: list[Front] = []

    def start(**config: Any) -> Front:
        settings = {"address": "tcp://127.0.0.1:0", "env": HELD, "pool": pool(), **config}
        fronts.append(Front(ServeEnvConfig(**settings)))
        assert fronts[-1].call(fronts[-1].front.wait_loaded(DEADLINE_S), DEADLINE_S)
        return fronts[-1]

    yield start
    for started in fronts:
        started.close()


@pytest.fixture
def client(front):
    clients: list[Client] = []

    def connect(address: str) -> Client:
        clients.append(Client(address))
        return clients[-1]

    yield connect
    for c in clients:
        c.close()


@pytest.fixture
def hold(tmp_path) -> Path:
    """A file that holds back the episodes naming it until it is gone."""
    path = tmp_path / "hold"
    path.touch()
    return path


def server_holding_a_session(front: Front) -> Any:
    end = time.monotonic() + DEADLINE_S
    while True:
        busy = [s for s in ray.get(front.front.pool.stats.remote(), timeout=10).servers if s.sessions]
        if busy:
            return busy[0]
        assert time.monotonic() < end, "the run never reached an env server"
        time.sleep(0.05)


def test_a_server_killed_before_its_run_streamed_a_delta_is_replaced_by_one_more_dispatch(
    front, client, hold
):
    served = front()
    c = client(served.front.address)
    run = c.run(hold=str(hold), deltas=2, gap_s=0.1)
    victim = server_holding_a_session(served)
    c.pump(0.5)
    assert c.frames[run] == []  # held: nothing streamed yet
    os.kill(victim.pid, signal.SIGKILL)
    hold.unlink()
    took = c.until(c.answered(run))
    c.pump(QUIET_S)
    [reply] = c.replies(run)  # answered once
    assert reply["success"] is True, reply
    assert reply["pid"] != victim.pid  # by another server: dispatched again
    assert [d["pid"] for d in c.deltas(run)] == [reply["pid"]] * 2  # one episode's deltas, no other's
    assert took < ANSWERED_WITHIN_S


def test_a_server_killed_after_its_run_streamed_deltas_ends_the_run_with_a_reply_naming_it(front, client):
    served = front()
    c = client(served.front.address)
    run = c.run(deltas=3, gap_s=60.0)
    c.until(lambda: c.deltas(run))
    [first] = c.deltas(run)
    os.kill(first["pid"], signal.SIGKILL)
    took = c.until(c.answered(run))
    c.pump(QUIET_S)
    [reply] = c.replies(run)
    assert reply["success"] is False
    error = reply["error"]
    assert error.startswith("PartLost: env server") and "died during the run" in error, error
    assert "streamed 1 delta(s), so it is not dispatched again" in error
    assert c.deltas(run) == [first]  # never dispatched again: no second episode's frames
    assert took < ANSWERED_WITHIN_S


def test_the_fronts_env_pool_killed_mid_runs_is_restarted_and_every_run_is_answered_once(front, client, hold):
    served = front()
    c = client(served.front.address)
    streaming = c.run(deltas=2, gap_s=60.0)
    held = c.run(hold=str(hold), deltas=1)
    c.until(lambda: c.deltas(streaming))
    while sum(s.sessions for s in ray.get(served.front.pool.stats.remote(), timeout=10).servers) < 2:
        time.sleep(0.05)
    pool_pid = ray.get(served.front.pool.health.remote(), timeout=10).pid
    os.kill(pool_pid, signal.SIGKILL)  # its env servers are its children: Ray ends them with it
    took = c.until(c.answered(streaming))
    [lost] = c.replies(streaming)
    assert lost["success"] is False and lost["error"].startswith("PartLost: env server"), lost
    assert took < ANSWERED_WITHIN_S
    hold.unlink()
    c.until(c.answered(held))
    [reply] = c.replies(held)  # it had streamed nothing: dispatched again, on the restarted pool
    assert reply["success"] is True, reply
    assert served.front.supervised.incarnation == 2
    after = [c.run(deltas=1) for _ in range(16)]
    c.until(c.answered(*after))
    c.pump(QUIET_S)
    assert [len(c.replies(r)) for r in [streaming, held, *after]] == [1] * 18
    assert all(c.replies(r)[0]["success"] for r in after)


def test_an_env_pool_lost_past_its_restart_budget_answers_runs_at_once(front, client):
    once = PoolSupervision(restart=RestartIntensity(max_restarts=1, window_s=600.0), probe_interval_s=0.2)
    served = front(pool_supervision=once)
    supervised = served.front.supervised
    c = client(served.front.address)
    for incarnation, state in ((2, "serving"), (2, "failed")):  # restarted once, then the budget refuses
        os.kill(ray.get(served.front.pool.health.remote(), timeout=10).pid, signal.SIGKILL)
        end = time.monotonic() + DEADLINE_S
        while (supervised.incarnation, supervised.state) != (incarnation, state) or (
            state == "serving" and served.front.pool is None
        ):
            assert time.monotonic() < end, (supervised.incarnation, supervised.state)
            time.sleep(0.1)
    runs = [c.run(deltas=1) for _ in range(4)]
    took = c.until(c.answered(*runs))
    for run in runs:
        [reply] = c.replies(run)
        assert reply["success"] is False and "is not restarted" in reply["error"], reply
    assert took < ANSWERED_WITHIN_S


EXPECTED_ROWS = {
    "sigkill": (("reply: ", "PartLost: env server", "died during the run"), NEXT_RUNS),
    "import": (("reply: ", "LoadFailed: the environment failed to load 2 time(s)", "framework"), 0),
    "blocks": (("reply: ", "PartLost: env server", "wedged"), NEXT_RUNS),
    "router": (("still waiting after",), NEXT_RUNS),
}
"""Per fault: how our row's client learned (how its text starts, what it names: verifiers' client raises a
failed reply's error as a `RuntimeError`), and how many of the next 16
runs are ok (every one is answered in each row: after the ROUTER's loss, by the front started again)."""
HANG_TIMEOUT_S = 3.0  # the blocked loop's wedge is judged at this (production: 30 s)
LEARNED_WITHIN_S = 30.0


@pytest.mark.parametrize("fault", list(FAULTS))
def test_our_row_of_the_fault_table(ray_session, standin, fault):
    setup = Setup(
        python=vf04_python(), base_url=standin.base_url, model=BUNDLED_MODEL, wait_s=20.0, next_wait_s=300.0
    )
    row = asyncio.run(front_row(setup, fault, hang_timeout_s=HANG_TIMEOUT_S))
    (how, *named), ok = EXPECTED_ROWS[fault]
    assert row.learned.startswith(how) and all(n in row.learned for n in named), row
    if fault == "router":  # its process is gone: the run it held is never answered (docs/prime-rl.md)
        assert row.seconds is None, row
    else:
        assert row.seconds is not None and row.seconds < LEARNED_WITHIN_S, row
    assert (row.next_answered, row.next_ok) == (NEXT_RUNS, ok), row


NODE_LOSS_TIMEOUT_S = 300  # the scenario's own waits are bounded at 120 s each: this catches a hung process


@pytest.mark.ray  # a two-node Ray cluster of its own, in a subprocess
@pytest.mark.timeout(NODE_LOSS_TIMEOUT_S + 30)
def test_losing_the_node_of_a_runs_env_server_ends_the_run_and_the_front_on_the_head_serves_on():
    report = report_of("serve_env_node_loss.py", timeout=NODE_LOSS_TIMEOUT_S)
    assert report["sessions_on_doomed_node"] == [True], report  # both runs' sessions, on the lost node
    assert report["pool_on_head"] and report["pool_incarnation"] == 1, report  # the front never faltered
    [streaming] = report["streaming"]  # streamed before the loss: answered, naming its env server
    assert streaming["success"] is False and "env server" in streaming["error"], report
    assert "not dispatched again" in streaming["error"] and len(report["streaming_deltas_pids"]) == 1
    assert report["streaming_s"] < ANSWERED_WITHIN_S, report
    [held] = report["held"]  # nothing streamed: dispatched again, to a server on the surviving node
    assert held["success"] is True, report
    assert [len(replies) for replies in report["after"]] == [1] * 4, report
    assert all(replies[0]["success"] for replies in report["after"]), report
    assert "survivor" in report["servers_after_on"], report
