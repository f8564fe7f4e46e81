"""Trainer samples: what a trainer consumes, derived from a `Result` that stores every token once.

    for sample in trainer_samples(result):          # one per branch of the trajectory
        batch.add(sample.token_ids, sample.loss_mask, sample.logprobs, advantage=...)

A `Result` keeps, per turn, only what the turn added to its branch (`Turn.new_prompt_ids`) and what it
sampled (`completion_ids`, `logprobs`); a branch's token sequence is those pieces in order, so nothing is
stored twice and a sample is built in one pass over the result (contract 11). Branches exist because a
template may rewrite history (contract 7): each branch is its own sequence and its own sample, sharing
the result's reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from rollout_actors.wire import Result, Turn

Use = Literal["train", "mask", "drop"]
"""What a trainer does with a result of one kind: train on its samples, keep them with the loss mask all
zero (in the batch, contributing nothing), or drop them."""
OK_ONLY: Mapping[str, Use] = {"ok": "train"}
"""Train on `ok` results only; every other kind (a kind not named) is dropped."""

NOT_SAMPLED = -1
"""`TrainerSample.policy_versions` of a token the model did not sample (prompt, synthetic close)."""


@dataclass(frozen=True)
class TrainerSample:
    """One branch of one rollout, aligned token by token."""

    request_id: str
    group_id: str | None
    branch: int
    reward: float | None
    token_ids: list[int]
    """The branch's whole sequence: its first prompt, then each turn's completion and what followed."""
    loss_mask: list[int]
    """1 exactly on sampled tokens (completions); 0 on prompt and synthetic tokens."""
    logprobs: list[float] | None
    """The sampling logprob of each sampled token, 0.0 elsewhere; None when logprobs were not requested."""
    policy_versions: list[int]
    """The policy version each sampled token was sampled under; `NOT_SAMPLED` elsewhere."""
    turns: list[int]
    """Indices into `Result.turns` of the turns this branch holds, in order."""
    synthetic: list[int]
    """Positions in `token_ids` of synthetic tokens (a close token appended after a `length` cut)."""
    step_rewards: list[float | None]
    """The environment's per-step reward of each turn in `turns` (None where it gave none)."""

    @property
    def prompt_len(self) -> int:
        """Tokens before the first sampled one."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.loss_mask)


def trainer_samples(result: Result, use: Mapping[str, Use] | None = None) -> list[TrainerSample]:
    """One `TrainerSample` per branch, in branch order. Any result kind works (a cancelled rollout gives
    what it sampled), but only an `ok` result has a reward.

    `use` says, per result kind, what to do with it, so a trainer decides each kind explicitly (an `env`
    failure is a bug in the environment; an `infrastructure` one is ours; they are not the same to
    train on): `{"ok": "train", "cancelled": "mask"}` trains on `ok`, masks `cancelled` (loss mask all
    zero) and drops every kind not named. None: every kind as it is."""
    decision = "train" if use is None else use.get(result.kind, "drop")
    if decision == "drop":
        return []
    by_branch: dict[int, list[int]] = {}
    for index, turn in enumerate(result.turns):
        by_branch.setdefault(turn.branch, []).append(index)
    samples = [_branch_sample(result, branch, indices) for branch, indices in sorted(by_branch.items())]
    if decision == "mask":
        return [replace(sample, loss_mask=[0] * len(sample.loss_mask)) for sample in samples]
    return samples


def _branch_sample(result: Result, branch: int, indices: list[int]) -> TrainerSample:
    turns = [result.turns[i] for i in indices]
    with_logprobs = all(len(t.logprobs) == len(t.completion_ids) for t in turns)
    token_ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    synthetic: list[int] = []
    for turn in turns:
        added = len(turn.new_prompt_ids)
        synthetic.extend(range(len(token_ids), len(token_ids) + turn.synthetic_ids))
        token_ids += turn.new_prompt_ids
        token_ids += turn.completion_ids
        sampled = len(turn.completion_ids)
        mask += [0] * added + [1] * sampled
        versions += [NOT_SAMPLED] * added + turn.token_versions()
        if with_logprobs:
            logprobs += [0.0] * added + turn.logprobs
    return TrainerSample(
        request_id=result.request_id,
        group_id=result.group_id,
        branch=branch,
        reward=result.reward,
        token_ids=token_ids,
        loss_mask=mask,
        logprobs=logprobs if with_logprobs else None,
        policy_versions=versions,
        turns=indices,
        synthetic=synthetic,
        step_rewards=[turn.reward for turn in turns],
    )


def turn_prompts(result: Result) -> list[list[int]]:
    """The whole prompt each turn was sampled from, derived: its branch's earlier turns (new prompt ids +
    completion) followed by its own new prompt ids. Costs turns x context: for checks, not for training."""
    prompts: list[list[int]] = []
    context: dict[int, list[int]] = {}
    for turn in result.turns:
        prompt = context.get(turn.branch, []) + turn.new_prompt_ids
        prompts.append(prompt)
        context[turn.branch] = prompt + turn.completion_ids
    return prompts


def unique_tokens(turns: list[Turn]) -> int:
    """Tokens a result stores: each turn's new prompt ids and completion, once."""
    return sum(len(t.new_prompt_ids) + len(t.completion_ids) for t in turns)
