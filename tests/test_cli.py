"""`rollouts` as a user meets it: a mistake is one line naming the flag typed, exit status 2, and nothing
started; a run ends with the report's numbers and failure block; the progress line fits 80 columns.
Ray-free: the checks run before Ray would start, and the run's end reads a results file."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from rollout_actors.cli import _parser, overrides_from_flags
from rollout_actors.job.progress import RunStatus
from rollout_actors.job.report import failure_lines, format_summary, read_results, summarize
from rollout_actors.job.run_batch import CountedFailures, _report
from rollout_actors.job.run_config import RunConfig, load_run_config
from rollout_actors.rollout.failures import log_failure
from rollout_actors.wire import Failure, Result

REPO = Path(__file__).resolve().parent.parent
GUESS_ENV = """
from env_actors.interface import Environment, ScoreOut, StepOut

class GuessEnv(Environment):
    def num_tasks(self):
        return 4
    def task(self, index):
        return {"n": index}
    def reset(self, task):
        raise ValueError("guess env exploded")
    def step(self, state, message):
        return StepOut(messages=[], done=True)
    def score(self, state):
        return ScoreOut(reward=0.0)
"""
# The CLI in a process of its own; afterwards it says whether Ray was started and what it left running.
RUN_CLI = (
    "import sys, psutil, ray\n"
    "from rollout_actors.cli import main\n"
    "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as exc:  # argparse's own refusals\n    code = exc.code\n"
    "print('ray started:', ray.is_initialized(), 'children:', len(psutil.Process().children(recursive=True)))\n"
    "sys.exit(code)\n"
)


def rollouts(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-c", RUN_CLI, *argv]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=90)


REFUSED = [
    (["--env", "guess_env.GuessEnv"], "--env guess_env.GuessEnv: must look like 'package.module:Class'"),
    (
        ["--base-url", "localhost:8000/v1", "--model", "m"],
        "--base-url localhost:8000/v1: must be an http(s) URL",
    ),
    (["--base-url", "http://localhost:8000/v1"], "--model: required with --base-url"),
    (["--env-config", "{bad"], "--env-config: not JSON"),
    (["--env", "guess_env:GuessEnv"], "allow it with --allow-ref-prefix guess_env"),
    (
        ["--env", "no_such_env:Env", "--allow-ref-prefix", "no_such_env"],
        "--env no_such_env:Env: cannot import",
    ),
    (
        ["--mode", "agent"],
        "--mode agent: env_actors.examples.calculator_env:CalculatorEnv is not an agent env",
    ),
    (["--env", "env_actors.adapters.verifiers_agent:VerifiersV1AgentEnv"], "add --mode agent"),
    (["--tasks", "0"], "--tasks: "),
    (["--top-p", "0"], "--top-p: "),
    (["--output", "/no/such/folder/results.jsonl"], "--output /no/such/folder/results.jsonl: no folder"),
]


@pytest.mark.parametrize("print_config", [False, True], ids=["run", "print-config"])
@pytest.mark.parametrize(("flags", "said"), REFUSED, ids=[" ".join(flags) for flags, _ in REFUSED])
def test_a_flag_that_cannot_work_is_one_line_naming_it_exit_2_and_nothing_starts(
    flags, said, print_config, tmp_path
):
    (tmp_path / "guess_env.py").write_text(GUESS_ENV)
    done = rollouts("run", *(["--print-config"] if print_config else []), *flags, cwd=tmp_path)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line
    assert said in done.stderr and done.stderr.startswith("rollouts run: "), done.stderr
    assert "Traceback" not in done.stderr
    assert "ray started: False children: 0" in done.stdout, done.stdout


def test_the_common_knobs_have_flags_and_metavars_that_read_as_values():
    args = _parser().parse_args(
        [
            "run",
            "--top-p",
            "0.9",
            "--renderer-family",
            "qwen3",
            "--no-enable-thinking",
            "--max-failed-fraction",
            "0.1",
        ]
    )
    config = load_run_config(None, overrides_from_flags(args))
    assert config.sampling.top_p == 0.9 and config.renderer.family == "qwen3"
    assert config.renderer.template_kwargs == {"enable_thinking": False}
    assert config.run.max_failed_fraction == 0.1
    assert RunConfig().run.max_failed_fraction == 0.0  # any failure fails the command by default
    help_text = _parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "--enable-thinking" in help_text and "--top-p P" in help_text and "--env MODULE:CLASS" in help_text
    for dotted in ("SERVERS.", "RUN.", "SAMPLING.", "PLANE.", "RENDERER.", "ALLOW_REF_PREFIX", "CONCURRENCY"):
        assert dotted not in help_text, dotted


def test_the_orchestrator_demo_help_shows_its_defaults():
    shown = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "orchestrator_demo.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert shown.returncode == 0, shown.stderr
    assert "--steps N" in shown.stdout and "(default: 6)" in shown.stdout and "(default: 0.2)" in shown.stdout


def _result(index: int, kind: str, error: Failure | None = None) -> Result:
    return Result(
        request_id=f"req-{index}",
        lease_id=f"lease-{index}",
        kind=kind,
        error=error,
        reward=1.0 if kind == "ok" else None,
        started_at=1000.0 + index * 0.1,
        finished_at=1001.0 + index * 0.1,
    )


def _run_file(path: Path, failed: int, ok: int, cancelled: int = 0) -> Path:
    exploded = Failure(type="ValueError", message="guess env exploded\nTraceback ...", fault="env")
    results = [_result(i, "env", exploded) for i in range(failed)]
    results += [_result(failed + i, "ok") for i in range(ok)]
    results += [
        _result(failed + ok + i, "cancelled", Failure(type="Cancelled", message="asked"))
        for i in range(cancelled)
    ]
    path.write_text("".join(r.model_dump_json(exclude_defaults=True) + "\n" for r in results))
    return path


def _config(**run: object) -> RunConfig:
    return RunConfig.model_validate({"run": run})


def test_the_end_of_a_run_prints_the_reports_numbers_and_failures_once_per_type_with_a_count(
    tmp_path, capsys
):
    path = _run_file(tmp_path / "r.jsonl", failed=32, ok=8)
    kinds = Counter(line["kind"] for line in read_results(path))
    assert (
        _report(_config(), path, kinds) == 1
    )  # a failure that is not `cancelled`: the default threshold is 0
    printed = capsys.readouterr()
    report = format_summary(summarize(read_results(path)))
    assert printed.out.startswith(report)  # the same wall time, rate and failure block as `rollouts report`
    block = failure_lines(summarize(read_results(path)))
    assert (
        block[1] == "      32  env/ValueError: guess env exploded"
        and printed.out.count("guess env exploded") == 1
    )
    assert f"results: {path}" in printed.out
    assert "80.0% of the rollouts failed, more than --max-failed-fraction 0" in printed.err
    assert _report(_config(max_failed_fraction=0.8), path, kinds) == 0


def test_cancelled_rollouts_do_not_fail_the_command(tmp_path, capsys):
    path = _run_file(tmp_path / "r.jsonl", failed=0, ok=4, cancelled=4)
    assert _report(_config(), path, Counter(line["kind"] for line in read_results(path))) == 0


def test_per_rollout_failure_lines_are_counted_not_printed_and_other_warnings_pass():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    counted = CountedFailures()
    handler.addFilter(counted)
    logger = logging.getLogger("test_cli.plane")
    logger.addHandler(handler)
    try:
        failure = Failure(type="CallerError", message="Ref 'x:Y' is outside the allowlist", fault="caller")
        for index in range(32):
            log_failure(logger, _result(index, "caller", failure))
        logger.warning("a pool node is gone")
    finally:
        logger.removeHandler(handler)
    assert counted.dropped == 32 and stream.getvalue() == "a pool node is gone\n"


def _render(total: int, done: int, in_flight: int, failed: dict[str, int], stage: str | None = None) -> str:
    console = Console(width=80, file=io.StringIO(), record=True)
    clock = iter([0.0, 60.0]).__next__  # the first submission, then a minute later
    status = RunStatus(total=total, live=True, console=console, clock=clock)
    with status:
        if stage is not None:
            status.stage(stage)
        else:
            status.submitted()
            status.update(done=done, in_flight=in_flight, failed=failed)
    return console.export_text()


def test_the_progress_line_counts_rollouts_and_fits_80_columns_whole():
    for text in (
        _render(256, 31, 64, {}),
        _render(256, 256, 0, {}),
        _render(100_000, 99_999, 2048, {"caller": 12_345, "model": 3}),
    ):
        (line,) = text.splitlines()
        assert len(line) <= 80 and "…" not in line, line
    assert "31/256" in _render(256, 31, 64, {}) and "256/256" in _render(256, 256, 0, {})
    assert "failed 12348" in _render(100_000, 99_999, 2048, {"caller": 12_345, "model": 3})
    waiting = _render(256, 0, 0, {}, stage="starting the env pool")
    assert "starting the env pool" in waiting and "0/256" in waiting
    assert "-:--:--" in waiting  # its clock starts at the first submission, as the report's does


def test_serve_standin_prints_the_base_url_and_model_and_serves_until_ctrl_c(tmp_path):
    from renderer_actors.tokenizer import BUNDLED_MODEL

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "rollout_actors.cli", "serve-standin", "--port", "0"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = server.stdout.readline()  # blocks until the server is ready (or the process ends)
        assert first.startswith("stand-in inference server: base URL http://127.0.0.1:"), (
            first + server.stderr.read()
        )
        base_url = first.split("base URL ")[1].split(",")[0]
        assert first.strip().endswith(f"model {BUNDLED_MODEL}")
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"{base_url}/models", timeout=10
        ) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == [BUNDLED_MODEL]
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
