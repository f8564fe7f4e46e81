"""DESIGN.md, "Dependency direction": `renderer_actors` and `env_actors` never import each other, and of
`rollout_actors` they import only the kernel (`rollout_actors.kernel` and its modules), which imports
nothing else of the project. Read from the source (every import statement, including those inside
functions), so a new import that breaks the direction fails here rather than in a deployment."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rollout_actors", "renderer_actors", "env_actors")
KERNEL = "rollout_actors.kernel"


def imports(path: Path) -> set[str]:
    """The project modules a file imports (absolute names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def in_kernel(module: str) -> bool:
    return module == KERNEL or module.startswith(KERNEL + ".")


@pytest.mark.parametrize(
    "package, other", [("renderer_actors", "env_actors"), ("env_actors", "renderer_actors")]
)
def test_renderer_and_env_packages_import_only_the_kernel_of_rollout_actors(package, other):
    broken = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in sources(package)
        for module in imports(path)
        if module.split(".")[0] == other or (module.startswith("rollout_actors") and not in_kernel(module))
    }
    assert not broken, sorted(broken)


def test_the_kernel_imports_nothing_else_of_the_project():
    broken = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in sources(KERNEL)
        for module in imports(path)
        if not in_kernel(module)
    }
    assert sources(KERNEL) and not broken, sorted(broken)


# Inside rollout_actors, folders by part (README, "What it is"). What runs on a rollout worker (`rollout`,
# `agent`) never loads the plane; the data models at the top import only the kernel and each other; the
# plane sits above everything but the CLI's job.
DATA = ("wire", "timings", "samples")
NEVER = {
    "rollout": ("plane", "policy", "inference", "job", "cli"),
    "agent": ("plane", "policy", "inference", "job", "cli"),
    "policy": ("plane", "job", "cli"),
    "inference": ("plane", "job", "cli"),
    "plane": ("job", "cli"),
    "job": ("cli",),
    **{data: ("plane", "rollout", "agent", "policy", "inference", "job", "cli") for data in DATA},
}


def part(module: str) -> str:
    """`rollout_actors.plane.dispatcher` -> `plane`; `rollout_actors.wire` -> `wire`."""
    return module.split(".")[1] if module.count(".") else ""


@pytest.mark.parametrize("folder", sorted(NEVER))
def test_each_part_of_rollout_actors_imports_only_the_parts_below_it(folder):
    base = ROOT / "rollout_actors"
    paths = sorted((base / folder).rglob("*.py")) if (base / folder).is_dir() else [base / f"{folder}.py"]
    broken = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in paths
        for module in imports(path)
        if module.startswith("rollout_actors.") and part(module) in NEVER[folder]
    }
    assert paths and not broken, sorted(broken)


CLIENT_MODULES = ("rollout_actors.rollout.worker", "renderer_actors.session", "rollout_actors.agent.history")
SERVER_ONLY = ("renderers", "renderer_actors.renderer", "renderer_actors.bundled")
"""What only a renderer actor loads: the `renderers` library and its model families."""


@pytest.mark.parametrize("module", CLIENT_MODULES)
def test_a_renderer_client_does_not_load_the_renderer_library(module):
    """Clients do not import servers: checking a bridge's message roles must not load every model family
    into every rollout worker (measured: 8 MB of RSS per worker process)."""
    probe = f"import sys, {module}; print(sorted(m for m in {SERVER_ONLY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
