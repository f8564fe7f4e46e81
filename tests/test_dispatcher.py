"""The dispatcher on its own: fake workers, fake pools, no Ray. Exactly once, the re-dispatch bound, late
duplicates, cancellation while a dispatch is being placed, and the bound on remembered leases."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

from waiting import runner

from rollout_actors.kernel import Loss
from rollout_actors.kernel.faults import PartLost
from rollout_actors.plane.dispatcher import Dispatcher
from rollout_actors.plane.inflight import AnsweredLeases, PolicyChoice
from rollout_actors.plane.lanes import Lane
from rollout_actors.plane.redispatch import RedispatchRule
from rollout_actors.wire import ClientConfig, Dispatch, Ref, Result, RolloutRequest

ENV = Ref(target="env_actors.examples.math_env:MathEnv")
DEADLINE_S = 20
run = runner(DEADLINE_S)


def request(**fields) -> RolloutRequest:
    return RolloutRequest(env=ENV, client=ClientConfig(base_url="http://127.0.0.1:1/v1", model="m"), **fields)


@dataclass(eq=False)
class FakeSlot:
    name: str
    alive: bool = True
    how: str = "died"
    gone: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    calls: list[Dispatch] = field(default_factory=list)
    pending: list[asyncio.Future[str]] = field(default_factory=list)


class FakeWorkers:
    """`Workers` and `WorkerCalls` at once: each dispatch is answered by `behaviour(slot, dispatch)`."""

    def __init__(self, behaviour, size: int = 2) -> None:
        self.slots = [FakeSlot(f"w{i}") for i in range(size)]
        self.behaviour = behaviour
        self.cancels: list[str] = []
        self.picked = asyncio.Event()
        self.release_pick = asyncio.Event()
        self.release_pick.set()

    async def pick_or_wait(self, timeout: float):
        self.picked.set()
        await self.release_pick.wait()
        live = [s for s in self.slots if s.alive]
        return min(live, key=lambda s: len(s.pending)) if live else None

    def dispatched(self, slot) -> None: ...

    def finished(self, slot) -> None: ...

    def declare_lost(self, slot, cause: str, how="died") -> None:
        slot.alive, slot.how = False, how
        if not slot.gone.done():
            slot.gone.set_result((cause, how))

    def run(self, slot, payload: bytes) -> asyncio.Future[str]:
        dispatch = Dispatch.model_validate_json(payload)
        slot.calls.append(dispatch)
        answer = asyncio.get_running_loop().create_future()
        slot.pending.append(answer)
        self.behaviour(self, slot, dispatch, answer)
        return answer

    async def cancel(self, slot, request_id: str) -> None:
        self.cancels.append(request_id)
        for answer in slot.pending:
            if not answer.done():
                answer.set_result(_answer(slot.calls[-1], "cancelled"))


def _answer(dispatch: Dispatch, kind: str = "ok", **fields) -> str:
    return Result.of(dispatch.rollout_request(), kind, worker="fake", **fields).model_dump_json()


class FakeRoute:
    def wire(self) -> tuple[str, str | None]:
        return "env-pool", "renderer-pool"


class FakePools:
    def env_pool_started(self, env) -> bool:
        return True

    async def ensure_env_pool(self, env) -> None: ...

    async def route(self, request, timeout, verify=False):
        return FakeRoute()

    def renderer_pool(self):
        return None


class FakeHost:
    policy_version = 0

    def __init__(self) -> None:
        self.delivered: list[Result] = []

    def checkout_policy(self, wanted):
        return PolicyChoice(version=0)

    def checkin_policy(self, choice) -> None: ...

    def deliver(self, result: Result) -> None:
        self.delivered.append(result)


def make(behaviour, **kwargs):
    host, workers = FakeHost(), FakeWorkers(behaviour)
    dispatcher = Dispatcher(
        host,
        workers,
        FakePools(),
        Counter(),
        pick_endpoint=lambda request, policy: "http://endpoint:8000/v1",
        calls=workers,
        answer_grace_s=kwargs.pop("answer_grace_s", 5.0),
        cancel_grace_s=1.0,
        **kwargs,
    )
    return host, workers, dispatcher


async def drive(dispatcher: Dispatcher, req: RolloutRequest):
    record = dispatcher.accept(req)
    lane = Lane("train", 8)
    assert lane.try_acquire()
    await dispatcher.drive(record, lane)
    assert lane.in_flight == 0  # the slot is given back whatever happened
    return record


def ok_now(workers, slot, dispatch, answer):
    answer.set_result(_answer(dispatch))


def test_the_dispatcher_runs_without_ray():
    check = "import sys, rollout_actors.plane.dispatcher; assert 'ray' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", check], timeout=60).returncode == 0


def test_a_request_is_answered_once_through_an_envelope_that_leaves_it_untouched():
    async def scenario():
        host, workers, dispatcher = make(ok_now)
        req = request(timeout_s=30)
        original = req.model_dump()
        await drive(dispatcher, req)
        return host, workers, dispatcher, req, original

    host, workers, dispatcher, req, original = run(scenario())
    assert [r.request_id for r in host.delivered] == [req.request_id]
    assert req.model_dump() == original  # the caller's request is not rewritten
    (dispatch,) = [d for s in workers.slots for d in s.calls]
    assert dispatch.request == req and dispatch.attempt == 1
    assert dispatch.endpoint == "http://endpoint:8000/v1" and 0 < dispatch.remaining_timeout_s <= 30
    assert (dispatch.env_pool, dispatch.renderer_pool) == ("env-pool", "renderer-pool")
    assert dispatch.rollout_request().client.base_url == "http://endpoint:8000/v1"
    assert dispatcher.counters["kind.ok"] == 1 and not list(dispatcher.in_flight())
    assert dispatcher.endpoint_load["http://endpoint:8000/v1"] == 0


def test_lost_workers_are_redispatched_under_one_lease_up_to_the_bound():
    def always_lost(workers, slot, dispatch, answer):
        lost = Loss(part="worker", how="died", name=slot.name)
        answer.set_exception(PartLost("killed", lost=lost, type_name="ActorDiedError"))
        for other in workers.slots:  # the plane's workers get replaced: new slots for the next dispatch
            other.alive, other.gone = True, asyncio.get_running_loop().create_future()

    async def scenario():
        host, workers, dispatcher = make(always_lost, rule=RedispatchRule(max_dispatches=3))
        await drive(dispatcher, request())
        return host, workers, dispatcher

    host, workers, dispatcher = run(scenario())
    (result,) = host.delivered
    assert result.kind == "infrastructure" and result.attempts == 3
    assert [loss.part for loss in result.error.losses] == ["worker"] * 3
    dispatches = [d for s in workers.slots for d in s.calls]
    assert sorted(d.attempt for d in dispatches) == [1, 2, 3]
    assert len({d.request.lease_id for d in dispatches}) == 1
    assert dispatcher.counters["redispatched"] == 2


def test_a_late_answer_after_the_plane_gave_up_is_dropped_and_counted():
    def never_answers(workers, slot, dispatch, answer):
        workers.late = (dispatch, answer)

    async def scenario():
        host, workers, dispatcher = make(never_answers, answer_grace_s=0.0)
        await drive(dispatcher, request(timeout_s=0.2))
        dispatch, answer = workers.late
        answer.set_result(_answer(dispatch))  # the worker answers after all
        await asyncio.sleep(0.05)
        return host, dispatcher

    host, dispatcher = run(scenario())
    (result,) = host.delivered
    assert result.kind == "infrastructure" and result.error.type == "DeadlineExceeded"
    assert dispatcher.counters["duplicates_dropped"] == 1
    assert dispatcher.counters["kind.ok"] == 0


def test_a_late_answer_while_the_record_is_open_answers_it_and_the_next_attempt_is_the_duplicate():
    def wedged_then_ok(workers, slot, dispatch, answer):
        if dispatch.attempt == 1:
            workers.first = (dispatch, answer)
            workers.declare_lost(slot, "wedged", "wedged")  # judged lost; its call is still open
        else:
            dispatch_1, answer_1 = workers.first
            answer_1.set_result(_answer(dispatch_1))  # the first attempt answers late, before this one
            asyncio.get_running_loop().call_later(0.05, answer.set_result, _answer(dispatch))

    async def scenario():
        host, workers, dispatcher = make(wedged_then_ok)
        await drive(dispatcher, request())
        return host, dispatcher

    host, dispatcher = run(scenario())
    assert len(host.delivered) == 1 and host.delivered[0].kind == "ok"
    assert dispatcher.counters["duplicates_dropped"] == 1 and dispatcher.counters["redispatched"] == 1


def test_a_cancel_while_the_dispatch_is_being_placed_never_reaches_a_worker():
    async def scenario():
        host, workers, dispatcher = make(ok_now)
        workers.release_pick.clear()  # the worker pick waits: the request is being placed
        req = request()
        driving = asyncio.ensure_future(drive(dispatcher, req))
        await workers.picked.wait()
        assert await dispatcher.cancel(req.request_id, ("Stale", "a newer policy"))
        assert not await dispatcher.cancel(req.request_id)  # already cancelling
        workers.release_pick.set()
        await driving
        assert not await dispatcher.cancel(req.request_id)  # answered: nothing to cancel
        return host, workers

    host, workers = run(scenario())
    (result,) = host.delivered
    assert result.kind == "cancelled" and result.error.type == "Stale"
    assert not [d for s in workers.slots for d in s.calls] and not workers.cancels


def test_answered_leases_are_remembered_within_their_bound():
    async def scenario():
        host, workers, dispatcher = make(ok_now, answered_kept=3)
        requests = [request() for _ in range(5)]
        for req in requests:
            await drive(dispatcher, req)
        return dispatcher, requests

    dispatcher, requests = run(scenario())
    assert len(dispatcher.answered) == 3
    assert [dispatcher.knows("other", r.lease_id) for r in requests] == [False, False, True, True, True]


def test_answered_leases_forget_the_oldest_first():
    leases = AnsweredLeases(limit=2)
    for lease in ("a", "b", "a", "c"):
        leases.add(lease)
    assert "a" not in leases and "b" in leases and "c" in leases and len(leases) == 2


def test_an_envelope_runs_the_request_on_the_adapter_with_the_base_models_tokenizer():
    req = request(timeout_s=600)
    envelope = Dispatch(
        request=req, model="policy-v3", policy_version=3, remaining_timeout_s=12.5, env_pool="e", attempt=2
    )
    runs = envelope.rollout_request()
    assert runs.client.model == "policy-v3" and runs.renderer.tokenizer == "m"  # the vocabulary stays
    assert runs.client.base_url == req.client.base_url  # no endpoint decided: the request's own
    assert (runs.policy_version, runs.timeout_s) == (3, 12.5)
    assert (runs.request_id, runs.lease_id) == (req.request_id, req.lease_id)
    assert req.client.model == "m" and req.policy_version is None  # the caller's request is untouched
    assert Dispatch.model_validate_json(envelope.model_dump_json()) == envelope  # it crosses as JSON


def test_a_request_whose_env_servers_died_twice_among_others_runs_alone_then_ends_on_its_own_merit():
    """Two anonymous env-server deaths at one point (an outside kill of each server it was on): not poison
    (contract 5), the third dispatch runs in quarantine (`Dispatch.quarantine`) and its answer stands."""
    anonymous = Loss(part="env server", how="died", call="step", step=1, culprit=None)

    def behaviour(workers, slot, dispatch, answer):
        if dispatch.attempt < 3:
            failure = PartLost("killed", lost=anonymous).failure
            answer.set_result(_answer(dispatch, "infrastructure", error=failure))
        else:
            answer.set_result(_answer(dispatch))

    async def scenario():
        host, workers, dispatcher = make(behaviour, rule=RedispatchRule(max_dispatches=3))
        await drive(dispatcher, request())
        calls = sorted((c for s in workers.slots for c in s.calls), key=lambda c: c.attempt)
        return host.delivered, calls, dispatcher.counters

    delivered, calls, counters = run(scenario())
    assert [r.kind for r in delivered] == ["ok"] and delivered[0].attempts == 3
    assert [c.quarantine for c in calls] == [False, False, True]
    assert counters["quarantined"] == 1 and counters["redispatched"] == 2
