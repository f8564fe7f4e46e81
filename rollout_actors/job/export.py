"""`rollouts export RESULTS.jsonl --samples OUT` and `rollouts show RESULTS.jsonl`: a finished run's lines
as a trainer and as a person read them.

    rollouts export run.jsonl --samples samples.jsonl          # or samples.parquet (needs pyarrow)
    rollouts show run.jsonl -n 1                               # the first rollout, turn by turn

Export writes one row per branch of each kept rollout (`rollout_actors.samples.trainer_samples`): token
ids, loss mask, logprobs, the policy version of every token, reward, group and request ids. `--use` says
per result kind what to do with it, over the default `ok=train` (`cancelled=mask`; every kind not named
is dropped), so a trainer never trains on our failures by accident. Show prints each turn's text as the model sampled it
(content, reasoning, tool calls), the tokens it added, its phases, its reward, and the failure if any.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import get_args

from rollout_actors.samples import OK_ONLY, TrainerSample, Use, trainer_samples
from rollout_actors.wire import Result

FORMATS = (".jsonl", ".parquet")
TEXT_SHOWN = 600  # characters of one turn's text; the rest is counted, not printed


class ExportError(ValueError):
    """A request `export` or `show` cannot serve: one line naming what to change."""


def results(path: str | Path) -> Iterator[Result]:
    """Each line of a run's results file as a `Result` (a line that is not one says where)."""
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield Result.model_validate_json(line)
                except ValueError as exc:
                    first = str(exc).splitlines()[0]
                    raise ExportError(f"{path}:{number}: not a result line ({first})") from None


def parse_use(pairs: list[str] | None) -> Mapping[str, Use]:
    """`["cancelled=mask"]` as `trainer_samples` takes it, over the default (`ok=train`, every other kind
    dropped): `ok=drop` is said the same way."""
    use: dict[str, Use] = dict(OK_ONLY)
    for pair in pairs or ():
        kind, _, decision = pair.partition("=")
        if decision not in get_args(Use):
            raise ExportError(f"--use {pair}: say KIND=train, KIND=mask or KIND=drop")
        use[kind] = decision  # type: ignore[assignment]
    return use


def sample_row(sample: TrainerSample) -> dict:
    return asdict(sample)


def export_samples(path: str | Path, out: str | Path, use: Mapping[str, Use]) -> tuple[int, int]:
    """Write the trainer samples of `path` to `out` (JSON lines or parquet, by its suffix); (rollouts read,
    samples written)."""
    out = Path(out)
    if out.suffix not in FORMATS:
        raise ExportError(f"--samples {out}: name a .jsonl or .parquet file")
    read, rows = 0, []
    for result in results(path):
        read += 1
        rows += [sample_row(sample) for sample in trainer_samples(result, use)]
    if out.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ExportError("--samples *.parquet needs pyarrow (pip install pyarrow)") from None
        pq.write_table(pa.Table.from_pylist(rows), out)
    else:
        with open(out, "w") as sink:
            for row in rows:
                sink.write(json.dumps(row) + "\n")
    return read, len(rows)


def _clip(text: str) -> str:
    return (
        text if len(text) <= TEXT_SHOWN else f"{text[:TEXT_SHOWN]}... ({len(text) - TEXT_SHOWN} more chars)"
    )


def show_lines(result: Result) -> list[str]:
    """One rollout, turn by turn, as a person reads it."""
    head = f"rollout {result.request_id}: {result.kind}"
    if result.reward is not None:
        head += f", reward {result.reward:g}"
    where = [f"task {result.task_index}" if result.task_index is not None else None]
    where += [f"group {result.group_id}" if result.group_id else None, f"{len(result.turns)} turn(s)"]
    where += [f"{result.attempts} dispatches" if result.attempts > 1 else None]
    lines = [head, "  " + ", ".join(part for part in where if part)]
    for index, turn in enumerate(result.turns):
        t = turn.timings
        phases = (
            f"render {t.render_s * 1e3:.1f} ms, model {t.model_s * 1e3:.1f} ms, env {t.env_s * 1e3:.1f} ms"
        )
        lines.append(
            f"turn {index}: +{len(turn.new_prompt_ids)} prompt tokens, {len(turn.completion_ids)} sampled "
            f"({turn.finish_reason or 'unfinished'}), branch {turn.branch}, policy {turn.policy_version}"
        )
        lines.append(f"  {phases}" + (f", step reward {turn.reward:g}" if turn.reward is not None else ""))
        if turn.reasoning:
            lines.append(f"  reasoning: {_clip(turn.reasoning)}")
        if turn.content:
            lines.append(f"  content: {_clip(turn.content)}")
        for call in turn.tool_calls:
            arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
            status = "" if call.status == "ok" else f" [{call.status}]"
            lines.append(f"  tool call: {call.name}({_clip(arguments)}){status}")
    if result.error is not None:
        lines.append(
            f"failure: {result.error.type} ({result.error.fault or result.kind}): {result.error.message}"
        )
    return lines


def show(path: str | Path, n: int, kind: str | None = None) -> list[str]:
    """The first `n` rollouts of the file (of one kind, if named), each as `show_lines`."""
    lines: list[str] = []
    shown = 0
    for result in results(path):
        if shown >= n:
            break
        if kind is not None and result.kind != kind:
            continue
        lines += ([""] if lines else []) + show_lines(result)
        shown += 1
    if not shown:
        raise ExportError(f"{path}: no rollout" + (f" of kind {kind}" if kind else ""))
    return lines
