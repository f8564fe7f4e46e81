"""Trainer samples: what a `Result` records per turn, and what a trainer gets out of it."""

from __future__ import annotations

from rollout_actors.wire import Turn, VersionChange


def test_a_turn_that_straddles_an_update_gives_every_completion_token_its_version():
    turn = Turn(
        prompt_ids=[1, 2],
        completion_ids=[10, 11, 12, 13, 14],
        policy_version=3,
        version_changes=[VersionChange(at=2, version=4), VersionChange(at=4, version=5)],
    )
    assert turn.token_versions() == [3, 3, 4, 4, 5]
    assert Turn(prompt_ids=[1], completion_ids=[7, 8]).token_versions() == [0, 0]
