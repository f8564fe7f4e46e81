"""Trainer samples: what a `Result` records per turn, and what a trainer gets out of it."""

from __future__ import annotations

import math
import random

from rollout_actors.samples import trainer_samples, turn_prompts
from rollout_actors.wire import Result, Turn, VersionChange


def test_a_turn_that_straddles_an_update_gives_every_completion_token_its_version():
    turn = Turn(
        new_prompt_ids=[1, 2],
        completion_ids=[10, 11, 12, 13, 14],
        policy_version=3,
        version_changes=[VersionChange(at=2, version=4), VersionChange(at=4, version=5)],
    )
    assert turn.token_versions() == [3, 3, 4, 4, 5]
    assert Turn(new_prompt_ids=[1], completion_ids=[7, 8]).token_versions() == [0, 0]


def _turn(new_prompt, completion, *, branch=0, synthetic=0, version=0, changes=()):
    return Turn(
        new_prompt_ids=new_prompt,
        completion_ids=completion,
        logprobs=[-0.5 - i for i in range(len(completion))],
        branch=branch,
        synthetic_ids=synthetic,
        policy_version=version,
        version_changes=list(changes),
    )


def _result(*turns, kind="ok", reward=1.0):
    return Result(
        request_id="req-1", lease_id="lease-1", group_id="g", kind=kind, reward=reward, turns=list(turns)
    )


def test_a_branch_is_its_turns_pieces_in_order_with_the_mask_on_sampled_tokens_only():
    result = _result(
        _turn([1, 2, 3], [10, 11], version=1),
        _turn([99, 4, 5], [12], synthetic=1, version=2),  # 99: the close token after a `length` cut
    )
    (sample,) = trainer_samples(result)
    assert sample.token_ids == [1, 2, 3, 10, 11, 99, 4, 5, 12]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.5, -1.5, 0.0, 0.0, 0.0, -0.5]
    assert sample.policy_versions == [-1, -1, -1, 1, 1, -1, -1, -1, 2]
    assert sample.synthetic == [5] and sample.prompt_len == 3
    assert (sample.request_id, sample.group_id, sample.branch, sample.reward) == ("req-1", "g", 0, 1.0)
    # The derived prompts are what the server was sent.
    assert turn_prompts(result) == [[1, 2, 3], [1, 2, 3, 10, 11, 99, 4, 5]]


def test_a_fork_gives_one_sample_per_branch_and_the_new_branch_starts_from_its_whole_prompt():
    result = _result(
        _turn([1, 2], [10]),
        _turn([3], [11]),
        _turn([1, 2, 7, 3], [12], branch=1),  # the template rewrote turn 0: full re-render
    )
    first, second = trainer_samples(result)
    assert (first.branch, first.token_ids, first.turns) == (0, [1, 2, 10, 3, 11], [0, 1])
    assert (second.branch, second.token_ids, second.loss_mask) == (1, [1, 2, 7, 3, 12], [0, 0, 0, 0, 1])
    assert turn_prompts(result)[2] == [1, 2, 7, 3]


def test_versions_within_a_turn_follow_its_version_changes_and_missing_logprobs_give_none():
    straddling = _turn([1], [10, 11, 12], version=3, changes=[VersionChange(at=1, version=4)])
    no_logprobs = Turn(new_prompt_ids=[2], completion_ids=[13])
    (sample,) = trainer_samples(_result(straddling, no_logprobs, kind="cancelled", reward=None))
    assert sample.policy_versions == [-1, 3, 4, 4, -1, 0]
    assert sample.logprobs is None and sample.reward is None


def test_a_64_turn_100k_token_result_is_at_most_1_2x_its_unique_tokens_and_logprobs():
    """Sizes, not speed: the JSON and the pickled (what Ray ships) forms of a long agentic result stay
    within 1.2x of its unique token ids + logprobs in the same encoding. The old shape (whole prompt per
    turn) was ~30x here."""
    import json
    import pickle
    import random

    rng = random.Random(0)
    turns = [
        _turn([rng.randrange(151_000) for _ in range(1500)], [rng.randrange(151_000) for _ in range(60)])
        for _ in range(64)
    ]
    result = _result(*turns)
    ids = [i for t in turns for i in (*t.new_prompt_ids, *t.completion_ids)]
    logprobs = [x for t in turns for x in t.logprobs]
    assert 95_000 < len(ids) < 105_000
    json_ratio = len(result.model_dump_json()) / len(json.dumps([ids, logprobs], separators=(",", ":")))
    pickle_ratio = len(pickle.dumps(result, protocol=5)) / len(pickle.dumps([ids, logprobs], protocol=5))
    assert json_ratio <= 1.2 and pickle_ratio <= 1.2, (json_ratio, pickle_ratio)


def test_a_result_read_back_from_its_json_is_the_result_non_finite_floats_included():
    """A result crosses Ray from its worker as its JSON (`RolloutWorker.run`): reading it back must give
    the same result. A `-inf` logprob or a NaN in leniently parsed tool arguments is written as
    `-Infinity` / `NaN` (`kernel.EXACT_JSON`), which reads back; written as `null`, it would not."""
    from renderer_actors.parse import ToolCall

    rng = random.Random(7)
    logprobs = [-(rng.random() ** 3) * 20 for _ in range(500)] + [float("-inf"), -1e-300, 5e-324]
    turn = Turn(
        new_prompt_ids=list(range(40)),
        completion_ids=list(range(100, 100 + len(logprobs))),
        logprobs=logprobs,
        tool_calls=[ToolCall(name="f", arguments={"x": float("nan"), "y": [1, 2.5]}, raw="{}")],
        version_changes=[VersionChange(at=3, version=2)],
    )
    result = Result(
        request_id="r", lease_id="l", kind="ok", reward=0.25, turns=[turn], metrics={"turns": 1, "a": [0.1]}
    )
    back = Result.model_validate_json(result.model_dump_json())
    assert back.turns[0].logprobs == logprobs  # bit for bit, the -inf included
    assert math.isnan(back.turns[0].tool_calls[0].arguments["x"])
    assert back.model_dump_json() == result.model_dump_json()
    assert back.metrics == result.metrics and back.turns[0].version_changes == turn.version_changes


def test_a_trainer_trains_masks_or_drops_each_result_kind_as_it_says():
    """`env` (the environment is broken) and `infrastructure` (ours lost it) are not the same to train on:
    `use` decides each kind; a kind it does not name is dropped, and None keeps every kind as it is."""
    turn = _turn([1, 2], [10, 11])
    env_bug = _result(turn, kind="env", reward=None)
    lost = _result(turn, kind="infrastructure", reward=None)
    use = {"ok": "train", "infrastructure": "mask"}
    assert trainer_samples(env_bug, use) == []
    (masked,) = trainer_samples(lost, use)
    assert masked.token_ids == [1, 2, 10, 11] and masked.loss_mask == [0, 0, 0, 0]
    assert trainer_samples(_result(turn), use)[0].loss_mask == [0, 0, 1, 1]
    assert trainer_samples(env_bug)[0].loss_mask == [0, 0, 1, 1]  # no policy: every kind as it is


def test_a_group_gives_ok_samples_by_default_and_any_kind_on_request():
    from rollout_actors.plane.groups import Group

    turn = _turn([1], [10])
    group = Group("g", "train", [_result(turn), _result(turn, kind="env", reward=None)], 0.0, 1.0)
    assert len(group.samples()) == 1 and len(group.by_kind("env")) == 1
    assert [s.loss_mask for s in group.samples({"ok": "train", "env": "mask"})] == [[0, 1], [0, 0]]
