"""docs/design.md, "Dependency direction": `renderer_actors` and `env_actors` never import each other, and of
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
# agent mode included) never loads the plane; the data models at the top import only the kernel and each
# other; the plane sits above everything but the CLI's job.
DATA = ("wire", "timings", "samples")
NEVER = {
    "rollout": ("plane", "policy", "inference", "job", "cli"),
    "policy": ("plane", "job", "cli"),
    "inference": ("plane", "job", "cli"),
    "plane": ("job", "cli"),
    "job": ("cli",),
    **{data: ("plane", "rollout", "policy", "inference", "job", "cli") for data in DATA},
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


CLIENT_MODULES = (
    "rollout_actors.rollout.worker",
    "renderer_actors.session",
    "rollout_actors.rollout.agent.history",
)
SERVER_ONLY = ("renderers", "renderer_actors.renderer", "renderer_actors.bundled")
"""What only a renderer actor loads: the `renderers` library and its model families."""


@pytest.mark.parametrize("module", CLIENT_MODULES)
def test_a_renderer_client_does_not_load_the_renderer_library(module):
    """Clients do not import servers: checking a bridge's message roles must not load every model family
    into every rollout worker (measured: 8 MB of RSS per worker process)."""
    assert loaded(module, SERVER_ONLY) == []


ENV_CLIENT_MODULES = ("rollout_actors.rollout.worker", "env_actors.session", "env_actors.direct")
ENV_SERVER_ONLY = (
    "env_actors.server",
    "env_actors.supervisor",
    "env_actors.readiness",
    "env_actors.pool",
    "env_actors.spawn",
)
"""What only an env server or its pool loads: the actor, its supervision and how it is spawned."""


@pytest.mark.parametrize("module", ENV_CLIENT_MODULES)
def test_an_env_client_does_not_load_the_env_server_or_its_supervisor(module):
    """Clients do not import servers: a rollout worker's env session reads the deadline failure's name and
    awaits Ray's refs without loading the env server, its pool or its supervisor."""
    assert loaded(module, ENV_SERVER_ONLY) == []


def loaded(module: str, watched: tuple[str, ...]) -> list[str]:
    """Which of `watched` a fresh interpreter holds after importing `module` alone."""
    probe = f"import sys, {module}; print(sorted(m for m in {watched!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.strip())


# No circles (issue 46, item 6): a module never imports itself through others, package `__init__` modules
# included, imports inside functions included (a lazy import hides a circle from the interpreter, not from
# a reader); and the parts (`rollout_actors.rollout`, `env_actors.server`, ...) sit in layers.


def module_of(path: Path) -> str:
    """`rollout_actors/kernel/__init__.py` -> `rollout_actors.kernel`."""
    names = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


MODULES = {module_of(path): path for package in PACKAGES for path in sources(package)}


def imported_modules(module: str) -> set[str]:
    """The project modules `module` imports, resolved: relative imports against its package, and
    `from package import name` to `package.name` where that is a module, else to the package."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(above + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph (`[a, b, ..., a]`), or `[]` when it has none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path, todo = [start], {start}, [(start, iter(sorted(graph[start])))]
        while todo:
            node, rest = todo[-1]
            step = next(rest, None)
            if step is None:
                todo.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif step in on_path:
                return path[path.index(step) :] + [step]
            elif step not in done:
                path.append(step)
                on_path.add(step)
                todo.append((step, iter(sorted(graph.get(step, ())))))
    return []


def test_no_module_of_the_project_imports_itself_through_others():
    graph = {module: imported_modules(module) for module in MODULES}
    found = cycle(graph)
    assert "rollout_actors.kernel.faults" in graph["rollout_actors.kernel"]  # the graph reads `__init__`
    assert not found, "import cycle: " + " -> ".join(found)


def test_the_parts_of_the_project_import_one_another_in_layers():
    """A part is a package's folder or top-level module (`rollout_actors.rollout`, `rollout_actors.wire`,
    `env_actors.server`): what lies inside it may import anything of it, but two parts never import each
    other, however indirectly (the rollout loop's agent mode lives in `rollout`, not beside it)."""

    def part_of(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for module in MODULES:
        graph.setdefault(part_of(module), set()).update(
            part_of(other) for other in imported_modules(module) if part_of(other) != part_of(module)
        )
    found = cycle(graph)
    assert not found, "import cycle between parts: " + " -> ".join(found)
