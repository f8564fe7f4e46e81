"""The re-dispatch rule, declared as data and matched on a failure's typed fields (DESIGN.md contract 5).

    rule = RedispatchRule(max_dispatches=3)
    losses.append(loss)
    match rule.decide(losses):
        case "redispatch": ...       # same lease, a fresh dispatch
        case "poison": ...           # answer `rule.poison(losses)` now
        case "spent": ...            # the dispatch budget is spent: `infrastructure`

A dispatch whose result names a lost part (`Failure.lost`, set where the loss was seen: `kernel.faults`)
is re-dispatched under its lease; a collateral loss (the part named another request as its culprit) does
not spend the request's `max_dispatches` (it has its own bound). Two losses of one of `poison_parts` the same way at the same point
(`Loss.point`: part, how, call, step), neither of them collateral (`Loss.culprit` False: the part named
another request's call as the one that wedged it), mean the failure follows the request: it is a
poison request, answered at once. This bound is what one bad task may cost: an env server wedged by a
known request's call is replaced outside the pool's restart budget (`env_actors.supervisor`), so the
budget is left for losses nobody can be blamed for. A loss whose culprit is unknown (None: a death, a
frozen process) counts toward poison like the request's own: two such losses at one point are the
evidence contract 5 names. Except a wedge of a part that names the call wedging it (`attributed_parts`:
an env server names it from its probe answers, or holds one session only): when it named nobody, it is
evidence against no request in particular (its probes went unanswered under load), so it spends the
request's dispatches and never makes it poison; measured, two such wedges under a healthy request at
load 39 on two cores judged it poison before this rule. Nor is a part lost with its node unreachable
evidence against anyone. A lost rollout worker is
never poison: a worker carries many rollouts, and the loss of a node or a killed worker strikes them all
at once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout_actors.kernel import Failure, Loss, Part
from rollout_actors.kernel.faults import PoisonRequest

Decision = Literal["redispatch", "poison", "spent"]


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
    """Parts that name the request whose call wedged them (`Loss.culprit`): their wedges with no culprit
    named never count toward poison (they still spend `max_dispatches`)."""
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
        if latest.part in self.poison_parts and self._against(latest):
            same = sum(1 for loss in losses if loss.point() == latest.point() and self._against(loss))
            if same >= self.poison_repeats:
                return "poison"
        collateral = sum(1 for loss in losses if loss.culprit is False)
        own = len(losses) - collateral
        if own >= self.max_dispatches or collateral > self.max_collateral:
            return "spent"
        return "redispatch"

    def _against(self, loss: Loss) -> bool:
        """Whether a loss is evidence against this request (it may count toward poison)."""
        if loss.culprit is None:  # an unreachable node says nothing of the requests on it
            return loss.how == "died" or (loss.how == "wedged" and loss.part not in self.attributed_parts)
        return loss.culprit

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
"""The production rule: three dispatches, poison after two identical losses of an env server or renderer."""


def _article(noun: str) -> str:
    return "an" if noun[:1] in "aeiou" else "a"
