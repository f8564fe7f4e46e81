"""Refs name code; only what is meant to be named, under the resolving side's own allowlist, can run."""

from __future__ import annotations

import pytest

from rollout_actors.kernel import (
    MAX_CONFIG_DEPTH,
    CallerError,
    Failure,
    Ref,
    RefResolver,
    redact,
    register_secret,
)

EXAMPLES = RefResolver()
WIDE = RefResolver(("env_actors.", "rollout_actors.", "renderer_actors.", "os", "subprocess", "builtins"))


def test_ref_takes_target_and_config_positionally_or_by_keyword():
    assert Ref("env_actors.examples.math_env:MathEnv", {"limit": 3}) == Ref(
        target="env_actors.examples.math_env:MathEnv", config={"limit": 3}
    )


def test_ref_with_an_unknown_field_is_refused():
    with pytest.raises(ValueError, match="extra"):
        Ref.model_validate({"target": "env_actors.examples.math_env:MathEnv", "confg": {}})


def test_default_allowlist_reaches_only_the_bundled_examples():
    env = EXAMPLES.resolve(Ref("env_actors.examples.math_env:MathEnv", {"limit": 3}), role="environment")
    assert type(env).__name__ == "MathEnv"
    with pytest.raises(CallerError, match="outside the allowlist"):
        EXAMPLES.resolve(Ref("env_actors.faults.envs:EchoEnv"))


@pytest.mark.parametrize(
    "target",
    [
        "rollout_actors.kernel:RefResolver",  # a resolver: would resolve an inner Ref under its own list
        "os:system",
        "subprocess:run",
        "builtins:eval",
        "env_actors.examples.calculator_env:evaluate",  # a plain function of an allowed module
        "env_actors.examples.calculator_env:ast",  # a module re-exported by an allowed module
        "env_actors.examples.math_env:Path",  # a class defined elsewhere, imported by an allowed module
        "env_actors.server:EnvServer",
    ],
)
def test_targets_not_meant_to_be_named_are_refused_even_under_a_wide_allowlist(target):
    with pytest.raises(CallerError, match="not meant to be named"):
        WIDE.resolve(Ref(target))


def test_the_resolver_bypass_runs_nothing(tmp_path):
    """The shape of the reported exploit: an allowed resolver named with its own allowlist in the config
    and an inner Ref spelled with one extra key, so it travels as a plain dict."""
    planted = tmp_path / "ran"
    inner = {"target": "os:system", "config": {"command": f"touch {planted}"}, "x": 1}
    for target in ("rollout_actors.kernel:RefResolver", "rollout_actors.wire:Ref"):
        ref = Ref(target, {"allowed_prefixes": ["os"], "ref": inner})
        with pytest.raises(CallerError):
            WIDE.resolve(ref, role="environment")
    assert not planted.exists()


def test_nested_ref_must_be_a_marked_part_too(tmp_path):
    planted = tmp_path / "ran"
    env = Ref(
        "env_actors.examples.math_env:MathEnv",
        {"path": Ref("os:system", {"command": f"touch {planted}"})},
    )
    with pytest.raises(CallerError):
        WIDE.resolve(env, role="environment")
    assert not planted.exists()


def test_a_part_cannot_stand_in_for_an_environment():
    with pytest.raises(CallerError, match="not an environment"):
        WIDE.resolve(Ref("env_actors.faults.envs:constant_grader", {"value": 1.0}), role="environment")
    grader = WIDE.resolve(Ref("env_actors.faults.envs:constant_grader", {"value": 0.5}))
    assert grader("anything") == 0.5


def test_config_nested_absurdly_deep_is_a_value_error_not_a_recursion_error():
    deep: dict = {}
    node = deep
    for _ in range(3000):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ValueError, match=f"deeper than {MAX_CONFIG_DEPTH}"):
        Ref("env_actors.examples.math_env:MathEnv", deep)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), object(), b"bytes"])
def test_config_holds_json_only(value):
    with pytest.raises(ValueError):
        Ref("env_actors.examples.math_env:MathEnv", {"x": value})


def test_registered_secrets_never_appear_in_a_failure():
    secret = "sk-test-redaction-0123456789"
    register_secret(secret)
    try:
        raise RuntimeError(f"401 from server: header Authorization: Bearer {secret}")
    except RuntimeError as exc:
        failure = Failure.from_exception(exc)
    assert secret not in failure.message and secret not in (failure.traceback or "")
    assert "[redacted]" in failure.message
    assert secret not in failure.model_dump_json()
    assert redact(f"x{secret}y") == "x[redacted]y"
