"""What an RL engineer reads after a run (`rollouts report`'s groups block, `rollouts export --samples`,
`rollouts show`), on a results file written the way `rollouts run` writes one. No Ray."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from rollout_actors.cli import main
from rollout_actors.job.group_stats import group_stats
from rollout_actors.job.report import format_summary, read_results, summarize
from rollout_actors.kernel import Failure
from rollout_actors.wire import Result, ToolCall, Turn


def turn(prompt: list[int], sampled: list[int], **fields) -> Turn:
    return Turn(new_prompt_ids=prompt, completion_ids=sampled, logprobs=[-0.5] * len(sampled), **fields)


def result(n: int, group: str, task: int, reward: float | None, kind: str = "ok", **fields) -> Result:
    return Result(
        request_id=f"req-{n}",
        lease_id=f"lease-{n}",
        group_id=group,
        task_index=task,
        kind=kind,
        reward=reward,
        **{"turns": [turn([1, 2, 3], [4, 5], content=f"answer {n}", finish_reason="stop")], **fields},
    )


@pytest.fixture
def run_file(tmp_path):
    results = [
        # group a (task 0): 1.0 and 0.0 -> signal, solved
        result(0, "a", 0, 1.0),
        result(1, "a", 0, 0.0),
        # group b (task 1): both 0.0 -> no signal, unsolved
        result(2, "b", 1, 0.0),
        result(3, "b", 1, 0.0),
        # group c (task 2): a two-turn rollout with a call, a cancelled member and an env failure
        result(
            4,
            "c",
            2,
            1.0,
            turns=[
                turn([1, 2], [7, 8], tool_calls=[ToolCall(name="calc", arguments={"x": 1})], reward=0.0),
                turn([9], [10, 11, 12], content="done", reasoning="think", finish_reason="stop", branch=1),
            ],
        ),
        result(5, "c", 2, None, kind="cancelled"),
        result(
            6,
            "c",
            2,
            None,
            kind="env",
            error=Failure(type="ValueError", message="the env broke", fault="env"),
        ),
        result(7, "c", 2, 1.0),
    ]
    path = tmp_path / "run.jsonl"
    path.write_text("".join(r.model_dump_json(exclude_defaults=True) + "\n" for r in results))
    return path


def test_group_statistics_say_which_groups_carry_a_learning_signal(run_file):
    stats = group_stats(read_results(run_file))
    assert stats.groups == 3  # a, b, and c's two scored members
    assert stats.flat == 2  # b (all 0.0) and c (both scored members 1.0)
    assert stats.spread == [0.5, 0.0, 0.0]
    assert stats.passed == {2: (2, 3)}  # a and c reached 1.0; b did not
    assert stats.task_means == {0: (0.5, 2), 1: (0.0, 2), 2: (1.0, 2)}
    text = format_summary(summarize(read_results(run_file)))
    assert "no learning signal (every member scored the same): 2 (66.7%)" in text
    assert "pass@2 (reward >= 1): 0.667 over 3 groups" in text
    assert "1: 0.00, 0: 0.50, 2: 1.00" in text  # hardest first
    assert all(len(line) <= 80 for line in text.splitlines() if line.startswith(("groups", "  no", "  pass")))


def test_a_run_without_groups_prints_no_groups_block(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(result(0, None, 0, 1.0).model_dump_json() + "\n")
    assert group_stats(read_results(path)) is None
    assert "groups:" not in format_summary(summarize(read_results(path)))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_writes_one_trainer_sample_per_branch_of_each_kept_rollout(run_file, tmp_path, capsys, suffix):
    out = tmp_path / f"samples{suffix}"
    assert main(["export", str(run_file), "--samples", str(out), "--use", "cancelled=mask"]) == 0
    rows = (
        pq.read_table(out).to_pylist()
        if suffix == ".parquet"
        else [json.loads(line) for line in out.read_text().splitlines()]
    )
    # 5 ok rollouts, one of them two branches; the cancelled one masked; the env failure dropped
    assert [(r["request_id"], r["branch"]) for r in rows] == [
        ("req-0", 0), ("req-1", 0), ("req-2", 0), ("req-3", 0), ("req-4", 0), ("req-4", 1), ("req-5", 0), ("req-7", 0)
    ]  # fmt: skip
    first = rows[0]
    assert first["token_ids"] == [1, 2, 3, 4, 5] and first["loss_mask"] == [0, 0, 0, 1, 1]
    assert first["logprobs"] == [0.0, 0.0, 0.0, -0.5, -0.5] and first["reward"] == 1.0
    assert first["group_id"] == "a" and first["policy_versions"] == [-1, -1, -1, 0, 0]
    masked = next(r for r in rows if r["request_id"] == "req-5")
    assert set(masked["loss_mask"]) == {0}
    assert f"samples: 8 from 8 rollouts -> {out}" in capsys.readouterr().out


def test_export_refuses_what_it_cannot_write_in_one_line(run_file, tmp_path, capsys):
    assert main(["export", str(run_file), "--samples", str(tmp_path / "s.csv")]) == 1
    assert main(["export", str(run_file), "--samples", str(tmp_path / "s.jsonl"), "--use", "ok=keep"]) == 1
    (tmp_path / "bad.jsonl").write_text('{"kind": "ok"}\n')
    assert main(["export", str(tmp_path / "bad.jsonl"), "--samples", str(tmp_path / "s.jsonl")]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(line.startswith("rollouts export: ") for line in errors), errors
    assert "name a .jsonl or .parquet file" in errors[0] and "KIND=train" in errors[1]
    assert "bad.jsonl:1: not a result line" in errors[2]


def test_show_prints_a_rollout_turn_by_turn_and_its_failure(run_file, capsys):
    assert main(["show", str(run_file), "-n", "1", "--kind", "env"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("rollout req-6: env\n") and "failure: ValueError (env): the env broke" in shown
    assert main(["show", str(run_file), "-n", "5"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("\nrollout ") == 4  # five rollouts, a blank line between each
    fifth = shown[shown.index("rollout req-4") :]
    assert "turn 0: +2 prompt tokens, 2 sampled" in fifth and 'tool call: calc({"x": 1})' in fifth
    assert "turn 1: +1 prompt tokens, 3 sampled (stop), branch 1" in fifth
    assert "reasoning: think" in fifth and "content: done" in fifth and "step reward 0" in fifth
    assert main(["show", str(run_file), "--kind", "caller"]) == 1
    assert "no rollout of kind caller" in capsys.readouterr().err
