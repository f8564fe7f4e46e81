"""The re-dispatch rule, declared as data and matched on a failure's typed fields (docs/design.md contract 5).

    rule = RedispatchRule(max_dispatches=3)
    losses.append(loss)
    match rule.decide(losses):
        case "redispatch": ...       # same lease, a fresh dispatch
        case "quarantine": ...       # same lease, a fresh dispatch alone on an env server of its own
        case "poison": ...           # answer `rule.poison(losses)` now
        case "spent": ...            # the dispatch budget is spent: `infrastructure`

A dispatch whose result names a lost part (`Failure.lost`, set where the loss was seen: `kernel.faults`)
is re-dispatched under its lease; a collateral loss (the part named another request as its culprit) does
not spend the request's `max_dispatches` (it has its own bound). Two losses of one of `poison_parts` the
same way at the same point (`Loss.point`: part, how, call, step), neither of them collateral
(`Loss.culprit` False: the part named another request's call as the one that wedged it), mean the failure
follows the request: it is a poison request, answered at once. This bound is what one bad task may cost:
an env server wedged by a known request's call is replaced outside the pool's restart budget
(`env_actors.supervisor`), so the budget is left for losses nobody can be blamed for.

Evidence must isolate the request (contract 5). A part in `attributed_parts` (an env server) names the
request that lost it: the call that wedged it (its probe answers), or the one session it held when it
died or wedged. A loss of such a part that named nobody (culprit None: a death, or a wedge whose probes
went unanswered, among several sessions) is evidence against no request in particular: an outside kill,
an OOM or a lost node strikes every session on the server, and load can silence probes. It still spends
the request's dispatches, and it counts toward poison only beside a loss that named the request at the
same point. Where such anonymous losses alone would have made it poison, the request is re-dispatched in
quarantine instead (`quarantine`): alone on a server of its own, where a loss names it, so a second death
there is proof. An environment that kills its own server every time is `env` poison after the anonymous
losses it shares with its neighbours and one death alone (two dispatches when it was alone from the
start); a healthy request struck by two outside kills at one point runs once alone, and ends `ok`.
Measured before this rule: 9 of 2,000 healthy rollouts ended `env` poison in a chaos run that killed two
env servers from outside. Of other parts (a renderer, which cannot isolate a request) an unnamed death
or wedge counts as before. A part lost with its node unreachable is evidence against nobody. A lost
rollout worker is never poison: a worker carries many rollouts, and the loss of a node or a killed worker
strikes them all at once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout_actors.kernel import Failure, Loss, Part
from rollout_actors.kernel.faults import PoisonRequest

Decision = Literal["redispatch", "quarantine", "poison", "spent"]


class RedispatchRule(BaseModel):
    """Which losses are re-dispatched, how often, and when a request is poison."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_dispatches: int = Field(default=3, ge=1)
    """Dispatches of one request that may end in a loss of its own (contract 5: re-dispatched at most
    twice)."""
    max_collateral: int = Field(default=64, ge=0)
    """Further dispatches for collateral losses (`Loss.culprit` False: the part named another request's
    call as the one that wedged it): they say nothing of this request, so they do not spend its
    `max_dispatches`; bounded all the same (and by the request's deadline). Measured: with 16 requests
    that wedge their server among 64 healthy ones in one pool, a healthy one was collateral up to 9
    times on two loaded cores, and 17 times in a full suite run: 64 leaves room for a worse pool."""
    parts: tuple[Part, ...] = ("worker", "env server", "renderer", "env pool", "renderer pool")
    """Losses of these parts are re-dispatched; a loss of any other stands as the result."""
    poison_parts: tuple[Part, ...] = ("env server", "renderer")
    """Parts whose repeated loss at one point makes the request poison: they run the request's own
    content (environment code, its messages). Not the worker or the pools: their losses are shared."""
    attributed_parts: tuple[Part, ...] = ("env server",)
    """Parts that name the request that lost them (`Loss.culprit`: the call that wedged them, or the one
    session they held): their losses with no culprit named count toward poison only beside one that named
    the request at the same point, and where they alone would have made it poison the request runs in
    quarantine (they still spend `max_dispatches`)."""
    poison_repeats: int = Field(default=2, ge=2)
    """Losses at the same point that make a request poison: twice, as contract 5 says."""
    poison_kind: dict[str, str] = {"env server": "env"}
    """The result kind of a poison request by the part it kept losing (`infrastructure` otherwise): an
    environment that wedges or kills its own server every time is the environment's fault."""

    @property
    def most_dispatches(self) -> int:
        """The bound on one request's dispatches, whatever it loses."""
        return self.max_dispatches + self.max_collateral

    def redispatches(self, failure: Failure | None) -> bool:
        """Whether this failure lost a part this rule re-dispatches."""
        return failure is not None and failure.lost is not None and failure.lost.part in self.parts

    def decide(self, losses: list[Loss]) -> Decision:
        """What to do after the latest of `losses` (every loss so far, oldest first)."""
        latest = losses[-1]
        same = sum(1 for loss in losses if loss.point() == latest.point() and self._counts(loss))
        repeated = latest.part in self.poison_parts and same >= self.poison_repeats
        if repeated and self._against(latest):
            return "poison"
        collateral = sum(1 for loss in losses if loss.culprit is False)
        own = len(losses) - collateral
        if own >= self.max_dispatches or collateral > self.max_collateral:
            return "spent"
        return "quarantine" if repeated and self._counts(latest) else "redispatch"

    def _against(self, loss: Loss) -> bool:
        """Whether a loss is evidence against this request: it named it, or it is of a part that cannot
        name anyone (a renderer's death or wedge)."""
        if loss.culprit is None:
            anonymous = loss.how == "died" or loss.how == "wedged"  # an unreachable node says nothing
            return anonymous and loss.part not in self.attributed_parts
        return loss.culprit

    def _counts(self, loss: Loss) -> bool:
        """Whether a loss counts toward the repeats at its point: evidence, or an attributed part's loss
        that named nobody (it counts only beside evidence: `decide` asks the latest to be evidence)."""
        if loss.culprit is None and loss.part in self.attributed_parts:
            return loss.how == "died" or loss.how == "wedged"
        return self._against(loss)

    def poison(self, losses: list[Loss], last: Failure | None = None) -> tuple[str, Failure]:
        """(result kind, failure) a poison request is answered with: the chain of its losses, the last
        traceback."""
        latest = losses[-1]
        chain = "; ".join(loss.describe() for loss in losses)
        fault = PoisonRequest(
            f"poison request: it lost {_article(latest.part)} {latest.part} {latest.how} at the same point "
            f"{self.poison_repeats} times ({chain}); not dispatched again",
            traceback=last.traceback if last is not None else None,
            losses=losses,
            kind=self.poison_kind.get(latest.part, "infrastructure"),
        )
        return fault.kind, fault.failure


REDISPATCH = RedispatchRule()
"""The production rule: three dispatches, poison after two identical losses of an env server or renderer
(an env server's that named the request: see the module docstring)."""


def _article(noun: str) -> str:
    return "an" if noun[:1] in "aeiou" else "a"
