"""Configuration as data: `PlaneConfig` and `rollouts run --config` refuse unknown keys by path, flags win."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollout_actors.cli import _parser, overrides_from_flags
from rollout_actors.job.run_config import ConfigError, RunConfig, load_run_config, to_toml
from rollout_actors.plane.config import PlaneConfig

EXAMPLE = Path(__file__).resolve().parent.parent / "scripts" / "run.example.toml"


def test_plane_config_refuses_a_misspelled_pool_key_when_built_not_at_first_use():
    with pytest.raises(ValidationError, match="min_workres"):
        PlaneConfig(env_pool={"min_workres": 2})
    with pytest.raises(ValidationError, match="hang_timeout_seconds"):
        PlaneConfig(hang_timeout_seconds=3)
    with pytest.raises(ValidationError, match="lane limits"):
        PlaneConfig(lanes={"train": 0})
    config = PlaneConfig(env_pool={"min_servers": 2}, renderer_pool={"idle_timeout_s": 1.0})
    assert config.env_pool.min_servers == 2 and config.renderer_pool.idle_timeout_s == 1.0
    with pytest.raises(ValidationError, match="frozen"):
        config.workers = 3


def test_the_shipped_example_lists_the_defaults_and_round_trips():
    example = load_run_config(EXAMPLE)
    assert example == RunConfig()
    resolved = EXAMPLE.parent / "resolved.toml"
    try:
        resolved.write_text(to_toml(example))
        assert load_run_config(resolved) == example
    finally:
        resolved.unlink(missing_ok=True)


def test_errors_name_every_bad_key_by_its_path(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        "[plane.env_pool]\nmin_workres = 2\n[sampling]\ntemprature = 1\n[client]\nread_timout = 3\n"
        "[run]\ntasks = 0\n"
    )
    with pytest.raises(ConfigError) as failed:
        load_run_config(bad)
    message = str(failed.value)
    for path in ("plane.env_pool.min_workres", "sampling.temprature", "client.read_timout", "run.tasks"):
        assert path in message, message


def test_flags_override_the_file(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[run]\ntasks = 5\ngroup_size = 3\n[plane]\nlanes = {"train" = 7}\n')
    args = _parser().parse_args(["run", "--config", str(config), "--tasks", "9", "--concurrency", "12"])
    resolved = load_run_config(args.config, overrides_from_flags(args))
    assert (resolved.run.tasks, resolved.run.group_size) == (9, 3)
    assert resolved.plane.lanes == {"train": 12, "eval": 3}
    args = _parser().parse_args(["run", "--config", str(config), "--base-url", "http://a/v1", "--model", "m"])
    resolved = load_run_config(args.config, overrides_from_flags(args))
    assert resolved.servers.endpoints == ["http://a/v1"] and resolved.plane.lanes == {"train": 7}


def test_print_config_shows_the_resolved_configuration_and_a_bad_key_exits_2(tmp_path):
    def rollouts(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "rollout_actors.cli", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    shown = rollouts("run", "--print-config", "--tasks", "3", "--no-progress")
    assert shown.returncode == 0, shown.stderr
    assert "tasks = 3" in shown.stdout and "progress = false" in shown.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[plane]\nworkerz = 2\n")
    refused = rollouts("run", "--config", str(bad))
    assert refused.returncode == 2 and "plane.workerz" in refused.stderr
