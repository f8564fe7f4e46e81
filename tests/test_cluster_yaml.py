"""cluster.yaml: valid for Ray's own cluster launcher, and it says what docs/design.md claims it says."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from rollout_actors.inference.server_actor import GPU_NODE_RESOURCE

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"
RAY_SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
PRIVATE_PORTS = {8265, 6379, 10001}
"""Dashboard / job API, GCS, Ray client: reachable by anyone who can connect means code execution."""


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _all_commands(config: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
    keys += ("head_start_ray_commands", "worker_start_ray_commands")
    commands = [c for key in keys for c in config.get(key, [])]
    for node_type in config["available_node_types"].values():
        commands += node_type.get("worker_setup_commands", []) + node_type.get("initialization_commands", [])
    return commands


def test_cluster_yaml_validates_against_the_autoscaler_schema_shipped_with_ray(config):
    assert RAY_SCHEMA.is_file(), f"ray {ray.__version__} no longer ships {RAY_SCHEMA}"
    schema = json.loads(RAY_SCHEMA.read_text())
    jsonschema.validate(config, schema)


def test_cluster_yaml_passes_the_launchers_own_checks_after_defaults_are_merged(config):
    # What `ray up` runs before launching anything (private API: if it moves, the schema test stays).
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    # Ray's merge rule: the GPU type's own list replaces the common setup, the CPU types inherit it.
    assert prepared["worker_setup_commands"] == config["setup_commands"]


def test_head_is_cpu_only_and_takes_no_actors(config):
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("CPU") == 0
    assert head["resources"].get("GPU", 0) == 0


def test_cpu_worker_type_hosts_rollout_env_and_renderer_actors(config):
    cpu = config["available_node_types"]["cpu_worker"]
    assert cpu["resources"]["CPU"] > 0
    assert cpu["resources"].get("GPU", 0) == 0
    assert GPU_NODE_RESOURCE not in cpu["resources"]
    assert cpu["max_workers"] >= cpu.get("min_workers", 0) >= 1


def test_gpu_worker_type_offers_gpus_and_the_resource_inference_servers_request(config):
    gpu = config["available_node_types"]["gpu_worker"]
    assert gpu["resources"]["GPU"] >= 1
    # One unit per GPU, so a TP=N server (which requests N units) fits exactly where N GPUs are free.
    assert gpu["resources"][GPU_NODE_RESOURCE] == gpu["resources"]["GPU"]
    assert gpu["docker"]["worker_image"].endswith("-gpu")
    # Only this type offers the custom resource: vLLM actors cannot land anywhere else.
    others = [
        name for name, t in config["available_node_types"].items() if GPU_NODE_RESOURCE in t["resources"]
    ]
    assert others == ["gpu_worker"]


def test_setup_installs_the_synced_project_and_gpu_nodes_add_the_vllm_extra(config):
    remote_dirs = [remote for remote, local in config["file_mounts"].items() if local == "."]
    assert remote_dirs == ["~/ray-rollouts"], "the working tree must be synced to every node"
    assert any(re.search(r"pip install -e \"\$HOME/ray-rollouts\"", c) for c in config["setup_commands"])
    # A node type's worker_setup_commands replace the global ones (Ray's merge rule), so the GPU type
    # must install the project itself, with the vllm extra.
    gpu_setup = config["available_node_types"]["gpu_worker"]["worker_setup_commands"]
    assert any('pip install -e "$HOME/ray-rollouts[vllm]"' in c for c in gpu_setup)


def test_every_ray_pin_matches_the_installed_ray(config):
    version = ray.__version__
    images = [
        config["docker"]["image"],
        config["available_node_types"]["gpu_worker"]["docker"]["worker_image"],
    ]
    assert all(image.startswith(f"rayproject/ray:{version}-") for image in images), images
    pins = re.findall(r"ray\[default\]==([\w.]+)", " ".join(_all_commands(config)))
    assert pins and set(pins) == {version}


def test_dashboard_is_not_exposed_publicly(config):
    commands = _all_commands(config)
    assert not any("0.0.0.0" in c for c in commands)
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start --head" in c]
    assert "--dashboard-host=127.0.0.1" in head_start
    for rule in config["provider"]["security_group"].get("IpPermissions", []):
        public = [r.get("CidrIp") for r in rule.get("IpRanges", [])] + [
            r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])
        ]
        if {"0.0.0.0/0", "::/0"} & set(public):
            low, high = rule.get("FromPort", -1), rule.get("ToPort", -1)
            opened = set(range(0, 65536)) if low == -1 else set(range(low, high + 1))
            assert not opened & PRIVATE_PORTS, rule


def test_every_node_starts_ray_with_token_authentication(config):
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"
    starts = [
        c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c
    ]
    assert len(starts) == 2
    assert all("RAY_AUTH_MODE=token ray start" in c for c in starts)
