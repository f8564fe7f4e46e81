"""The adapters' guards, without a cluster: the user's package is imported only within the pool's own
allowlist, a missing framework says which packages the pool needs, and a pool's runtime env is data that
refuses what it does not know."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from env_actors.adapters import PackageGate
from env_actors.adapters.skyrl_gym import SkyRLGymEnv
from env_actors.adapters.verifiers_classic import VerifiersClassicEnv
from env_actors.config import EnvPoolConfig
from rollout_actors.kernel import DEFAULT_ALLOWED_PREFIXES, CallerError, RefResolver
from rollout_actors.wire import Ref

BROKEN = "env_actors.faults.broken_import"  # raises if it is ever imported


def test_a_gate_without_an_allowlist_imports_nothing():
    gate = PackageGate()
    with pytest.raises(CallerError, match="outside this pool's env_packages"):
        gate.load(BROKEN)
    assert BROKEN not in sys.modules


def test_a_gate_allows_exactly_the_pools_prefixes():
    gate = PackageGate()
    gate.allow(("my_envs.",))
    gate.check("my_envs.math")
    gate.check("my_envs")
    with pytest.raises(CallerError):
        gate.check("my_envs_evil.math")


def test_the_adapters_are_nameable_by_default_but_their_config_cannot_reach_the_gate():
    resolver = RefResolver(DEFAULT_ALLOWED_PREFIXES)
    env = resolver.resolve(
        Ref("env_actors.adapters.skyrl_gym:SkyRLGymEnv", {"package": "x"}), role="environment"
    )
    assert isinstance(env, SkyRLGymEnv)
    with pytest.raises(CallerError, match="rejected its config"):
        resolver.resolve(
            Ref("env_actors.adapters.skyrl_gym:SkyRLGymEnv", {"env_packages": ["os"]}), role="environment"
        )


@pytest.mark.parametrize(
    "env, wanted",
    [(SkyRLGymEnv(package="my_envs.x"), "skyrl-gym"), (VerifiersClassicEnv("my-env"), "verifiers")],
)
def test_an_adapter_without_its_framework_names_the_packages_its_pool_needs(env, wanted):
    if wanted.replace("-", "_") in sys.modules or _importable(wanted.replace("-", "_")):
        pytest.skip(f"{wanted} is installed in this interpreter")
    env.allow_packages(("my_envs.",))
    with pytest.raises(CallerError, match=f"runtime_env = {{'pip': \\['{wanted}"):
        env.load()


def test_a_pool_runtime_env_is_data_that_refuses_unknown_keys():
    config = EnvPoolConfig(runtime_env={"pip": ["skyrl-gym==0.4.0"], "env_vars": {"A": "1"}})
    assert config.runtime_env.ray_dict() == {"pip": ["skyrl-gym==0.4.0"], "env_vars": {"A": "1"}}
    with pytest.raises(ValidationError, match="conda"):
        EnvPoolConfig(runtime_env={"conda": "env.yaml"})


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
