"""What an RL engineer reads of a run's groups: is there a learning signal in them?

    stats = group_stats(results)          # result lines as dicts (`rollouts report` reads them so)
    print("\n".join(group_lines(stats)))

A group is the results sharing a `group_id` (one task sampled n times, `submit_group`); a member counts
when it has a reward (failed members have none, and a trainer drops or masks them). GRPO-style training
learns from the spread of rewards inside a group: a group whose scored members all got the same reward
has no signal (every advantage is zero). pass@k counts a group as solved when any scored member reached
`solved_at` (a full reward, by default: 1.0 on the bundled environments). Per task, the mean reward over
every scored rollout of it, hardest first.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

SOLVED_AT = 1.0
"""The reward at which a member counts as solving its task, for pass@k."""
TASKS_SHOWN = 5
"""How many of the hardest and of the easiest tasks the summary names."""


@dataclass
class GroupStats:
    groups: int
    """Groups with at least two scored members (a lone member has no spread to learn from)."""
    flat: int
    """Of those, groups whose scored members all got the same reward: no learning signal."""
    spread: list[float]
    """Each such group's reward standard deviation (population), in group order."""
    passed: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Group size k -> (groups of that size with a member at `solved_at`, groups of that size)."""
    task_means: dict[int, tuple[float, int]] = field(default_factory=dict)
    """Task index -> (mean reward, scored rollouts), over every scored rollout of the task."""
    solved_at: float = SOLVED_AT


def _reward(result: dict[str, Any]) -> float | None:
    reward = result.get("reward")
    return float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None


def group_stats(results: list[dict[str, Any]], solved_at: float = SOLVED_AT) -> GroupStats | None:
    """The run's group statistics, or None when it has no group of two scored members."""
    members: dict[str, list[float]] = defaultdict(list)
    by_task: dict[int, list[float]] = defaultdict(list)
    for result in results:
        reward = _reward(result)
        if reward is None:
            continue
        if result.get("group_id") is not None:
            members[str(result["group_id"])].append(reward)
        if isinstance(result.get("task_index"), int):
            by_task[result["task_index"]].append(reward)
    groups = [rewards for rewards in members.values() if len(rewards) >= 2]
    if not groups:
        return None
    passed: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for rewards in groups:
        tally = passed[len(rewards)]
        tally[0] += any(r >= solved_at for r in rewards)
        tally[1] += 1
    return GroupStats(
        groups=len(groups),
        flat=sum(1 for rewards in groups if max(rewards) == min(rewards)),
        spread=[statistics.pstdev(rewards) for rewards in groups],
        passed={k: (n, total) for k, (n, total) in sorted(passed.items())},
        task_means={t: (statistics.fmean(r), len(r)) for t, r in sorted(by_task.items())},
        solved_at=solved_at,
    )


def group_lines(stats: GroupStats | None) -> list[str]:
    """The summary's `groups` block (at most 80 columns a line); nothing for a run without groups."""
    if stats is None:
        return []
    spread = sorted(stats.spread)
    lines = [
        f"groups: {stats.groups} with 2+ scored members; reward spread (std) "
        f"mean {statistics.fmean(spread):.3f}, median {statistics.median(spread):.3f}",
        f"  no learning signal (every member scored the same): {stats.flat} "
        f"({stats.flat / stats.groups:.1%})",
    ]
    for k, (solved, total) in stats.passed.items():
        lines.append(f"  pass@{k} (reward >= {stats.solved_at:g}): {solved / total:.3f} over {total} groups")
    if stats.task_means:
        ranked = sorted(stats.task_means.items(), key=lambda item: (item[1][0], item[0]))
        shown = ranked if len(ranked) <= 2 * TASKS_SHOWN else ranked[:TASKS_SHOWN] + ranked[-TASKS_SHOWN:]

        def tasks(items: list[tuple[int, tuple[float, int]]]) -> str:
            return ", ".join(f"{task}: {mean:.2f}" for task, (mean, _) in items)

        lines.append(f"  per task, mean reward ({len(ranked)} tasks, hardest first):")
        if len(shown) == len(ranked):
            lines.append(f"    {tasks(ranked)}")
        else:
            lines.append(f"    hardest {tasks(shown[:TASKS_SHOWN])}")
            lines.append(f"    easiest {tasks(shown[TASKS_SHOWN:])}")
    return lines
