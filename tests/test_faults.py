"""Typed failures (docs/design.md contracts 3 and 5): the kernel's hierarchy survives the JSON hop as data, Ray's
exceptions are mapped in one place, and the re-dispatch rule reads types, never strings. No cluster."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from renderer_actors.session import RendererSession
from rollout_actors.kernel import Failure, Loss
from rollout_actors.kernel.faults import (
    CallerError,
    EnvError,
    Fault,
    LoadFailed,
    PartLost,
    PoisonRequest,
    ray_errors,
    ray_loss,
)
from rollout_actors.plane.redispatch import RedispatchRule
from rollout_actors.rollout.failures import MalformedResponse, classify
from rollout_actors.wire import Result


def test_a_fault_crosses_json_and_pickle_as_the_same_type_with_its_loss():
    loss = Loss(part="env server", how="wedged", call="step", step=3, name="env-1")
    raised = PartLost("lost it", lost=loss, type_name="EnvServerLost")
    failure = Failure.model_validate_json(raised.failure.model_dump_json())
    assert failure.fault == "lost" and failure.lost == loss and failure.type == "EnvServerLost"
    rebuilt = Fault.from_failure(failure)
    assert isinstance(rebuilt, PartLost) and rebuilt.lost == loss and rebuilt.kind == "infrastructure"
    again = pickle.loads(pickle.dumps(LoadFailed("no tokenizer", kind="caller")))
    assert isinstance(again, LoadFailed) and again.kind == "caller" and str(again) == "no tokenizer"


def test_classify_reads_the_type_not_the_name():
    assert classify(CallerError("bad task"))[0] == "caller"
    assert classify(EnvError("env raised"))[0] == "env"
    kind, failure = classify(MalformedResponse("ids outside the vocabulary"))
    assert kind == "model" and failure.fault == "model" and failure.type == "MalformedResponse"
    # A plain exception that happens to be named like a loss is not one: it stands.
    imposter = type("EnvServerLost", (Exception,), {})("not really")
    kind, failure = classify(imposter)
    assert kind == "infrastructure" and failure.lost is None and not RedispatchRule().redispatches(failure)


def test_ray_errors_maps_deaths_and_unreachable_actors_and_nothing_else():
    assert ray_loss(ActorDiedError()) == "died"
    assert ray_loss(ActorUnavailableError("node gone", b"\0" * 16)) == "unreachable"
    assert ray_loss(TimeoutError()) is None
    with pytest.raises(PartLost) as lost:
        with ray_errors("renderer", "renderer-1", call="bridge", step=2):
            raise ActorDiedError()
    assert lost.value.lost == Loss(part="renderer", how="died", call="bridge", step=2, name="renderer-1")
    with pytest.raises(ValueError):  # an application error is not a loss: it propagates as it is
        with ray_errors("renderer"):
            raise ValueError("bad message")
    task_error = RayTaskError("f", "traceback text", ValueError("x"))
    assert ray_loss(task_error) is None


def loss(part="env server", how="wedged", call="step", step=1, culprit=True) -> Loss:
    return Loss(part=part, how=how, call=call, step=step, culprit=culprit)


def test_the_same_loss_at_the_same_point_twice_is_poison_and_says_its_chain():
    rule = RedispatchRule(max_dispatches=3)
    assert rule.decide([loss()]) == "redispatch"
    assert rule.decide([loss(), loss()]) == "poison"
    kind, failure = rule.poison([loss(), loss()])
    assert kind == "env" and failure.fault == "poison" and failure.losses == [loss(), loss()]
    assert isinstance(Fault.from_failure(failure), PoisonRequest)
    renderer = [loss("renderer", "died", "bridge", 2)] * 2
    assert rule.decide(renderer) == "poison" and rule.poison(renderer)[0] == "infrastructure"


def test_losses_that_differ_or_strike_a_worker_are_redispatched_until_the_budget():
    rule = RedispatchRule(max_dispatches=3)
    assert rule.decide([loss(step=1), loss(step=2)]) == "redispatch"  # another step: not the same point
    assert rule.decide([loss(how="died"), loss(how="wedged")]) == "redispatch"
    assert rule.decide([loss(step=1), loss(step=2), loss(step=3)]) == "spent"
    workers = [Loss(part="worker", how="died")] * 2  # a node or a killed worker: many rollouts at once
    assert rule.decide(workers) == "redispatch"
    assert RedispatchRule(max_dispatches=1).decide([loss()]) == "spent"


def test_collateral_losses_never_make_poison_and_do_not_spend_the_dispatch_budget():
    """A session that only shared a server another request wedged (`culprit` False) is re-dispatched:
    its own budget untouched, a bound of its own all the same."""
    rule = RedispatchRule(max_dispatches=3, max_collateral=2)
    collateral = Loss(part="env server", how="wedged", call="step", step=1, culprit=False)
    assert rule.decide([collateral, collateral]) == "redispatch"
    assert rule.decide([collateral, collateral, collateral]) == "spent"  # its own bound
    assert rule.decide([collateral, loss(), collateral, loss()]) == "poison"  # its own two, collateral aside
    assert rule.decide([collateral, loss(step=1), loss(step=2)]) == "redispatch"
    assert rule.most_dispatches == 5


def test_a_loss_nobody_was_blamed_for_is_poison_evidence_only_where_no_part_could_have_named_it():
    """Unknown culprit (None): a renderer's death or wedge still counts (nothing could name the call); an
    env server's does not on its own (it names the call that wedged it, or the one session it held: naming
    nobody, it was lost among several sessions: an outside kill, an OOM, probes lost under load); an
    unreachable node never does. Each still spends a dispatch."""
    rule = RedispatchRule(max_dispatches=3)
    unnamed = loss(culprit=None)
    assert rule.decide([unnamed]) == "redispatch"
    assert rule.decide([unnamed, unnamed, unnamed]) == "spent"  # not collateral: its dispatches spent
    assert rule.decide([unnamed, loss(), loss()]) == "poison"  # its own two, the unnamed one aside
    assert rule.decide([loss("renderer", "wedged", "bridge", 2, None)] * 2) == "poison"
    assert rule.decide([loss("renderer", "died", "bridge", 2, None)] * 2) == "poison"
    assert rule.decide([loss(how="unreachable", culprit=None)] * 2) == "redispatch"


def test_two_anonymous_env_server_deaths_never_make_poison_they_send_the_request_into_quarantine():
    """Contract 5: a death nobody was named for (an outside kill, an OOM) never makes a healthy request
    poison. Two at one point would have: the request runs alone instead (quarantine), where a death names
    it; that death, beside them, is proof. Seen under chaos: 9 of 2,000 healthy rollouts answered `env`
    poison after two env servers were killed from outside."""
    rule = RedispatchRule(max_dispatches=3)
    anonymous = loss(how="died", culprit=None)
    alone = loss(how="died", culprit=True)  # the server held its session alone when it died
    assert rule.decide([anonymous]) == "redispatch"
    assert rule.decide([anonymous, anonymous]) == "quarantine"
    assert rule.decide([anonymous, anonymous, alone]) == "poison"  # it killed its server alone: proof
    assert rule.poison([anonymous, anonymous, alone])[0] == "env"
    assert rule.decide([anonymous, alone]) == "poison"  # an environment that kills every server it is on
    assert rule.decide([alone, alone]) == "poison"  # alone from the start: two dispatches, as before
    assert rule.decide([anonymous, anonymous, anonymous]) == "spent"  # never poison, however often
    assert rule.decide([anonymous, loss(how="died", step=2, culprit=None)]) == "redispatch"  # not one point
    assert RedispatchRule(max_dispatches=2).decide([anonymous, anonymous]) == "spent"  # no dispatch left
    wedged = loss(culprit=None)  # a wedge whose probes named nobody, among several sessions
    assert rule.decide([wedged, wedged]) == "quarantine" and rule.decide([wedged, wedged, loss()]) == "poison"


def test_the_rule_is_declared_data_that_refuses_unknown_keys():
    with pytest.raises(ValueError):
        RedispatchRule(max_dispatches=3, retry_everything=True)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        RedispatchRule(poison_repeats=1)
    lost = Result.model_validate(
        {"request_id": "r", "lease_id": "l", "kind": "infrastructure", "error": PartLost(lost=loss()).failure}
    )
    assert RedispatchRule().redispatches(lost.error)
    assert not RedispatchRule(parts=("worker",)).redispatches(lost.error)


def test_a_fault_raised_on_the_renderer_side_reaches_the_rollout_typed_as_it_was_raised():
    """Ray carries the far side's exception as the cause of a `RayTaskError`; the session types it from
    the cause's class, never from its message: a load's failure is never a lost part (never re-dispatched)."""
    from renderer_actors.pool import RendererBudgetSpent, RendererStartupError
    from renderer_actors.session import RendererLoadFailed, RendererUnavailable, _far_fault
    from renderer_actors.tokenizer import TokenizerNotFound, TokenizerUnavailable

    cases = [
        (TokenizerUnavailable("no such directory"), "ready", RendererLoadFailed, "infrastructure"),
        (TokenizerNotFound("no hub id"), "ready", RendererLoadFailed, "caller"),
        (OSError("disk"), "ready", RendererLoadFailed, "infrastructure"),
        (RendererStartupError("failed to start", kind="caller"), "acquire", RendererLoadFailed, "caller"),
        (RendererBudgetSpent("restart budget spent"), "acquire", RendererUnavailable, "infrastructure"),
    ]
    for cause, method, expected, kind in cases:
        cause = pickle.loads(pickle.dumps(cause))  # as Ray ships it
        part = "renderer pool" if method == "acquire" else "renderer"
        raised = RayTaskError("f", "traceback text", cause)
        fault = _far_fault(raised, f"{part} {method}", part, loads=method == "ready")
        assert isinstance(fault, expected) and fault.kind == kind, (cause, fault)
        assert fault.failure.lost is None and fault.failure.traceback


def test_a_renderer_session_blames_no_request_for_what_happens_to_its_renderer_during_the_load():
    """A session's `ready` carries nothing of its request: a renderer that outlives the call still loading,
    or dies during it, is collateral (`culprit` False). Past the load, nobody can tell (None)."""

    class Pool:  # where a session reports a dead renderer
        def __init__(self) -> None:
            self.lost: list[str] = []
            self.renderer_lost = self

        def remote(self, renderer_id: str) -> None:
            self.lost.append(renderer_id)

    def never() -> asyncio.Future:  # an unanswered ref (a coroutine is a batched call: it keeps its own)
        return asyncio.get_running_loop().create_future()

    async def dies() -> None:
        raise ActorDiedError()

    async def loss_of(call, method: str) -> Loss:
        session = RendererSession(pool, key=None, multiplex=1, key_json="{}")
        session.renderer_id = "renderer-1"
        with pytest.raises(PartLost) as lost:
            await session._remote(
                call(), time.monotonic() + 0.05, "renderer", method, loads=method == "ready"
            )
        return lost.value.lost

    async def body() -> None:
        assert await loss_of(never, "ready") == Loss(
            part="renderer", how="wedged", call="ready", step=0, name="renderer-1", culprit=False
        )
        assert await loss_of(dies, "ready") == Loss(
            part="renderer", how="died", call="ready", step=0, name="renderer-1", culprit=False
        )
        assert (await loss_of(never, "bridge")).culprit is None
        assert (await loss_of(dies, "bridge")).culprit is None

    pool = Pool()
    asyncio.run(asyncio.wait_for(body(), 30))
    assert pool.lost == ["renderer-1", "renderer-1"]  # each death reported to the pool, which replaces it
