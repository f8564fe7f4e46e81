"""docs/design.md, "The fault model": failures are typed in one place each, and Ray's errors in one.

Read from the source, as `test_dependency_direction` reads imports: Ray's exception types are named in
`kernel.faults` (the mapper every boundary calls) and nowhere else; a `Failure` is built by a fault class
(`Fault.failure`), never typed by hand; and a failure's name stands for one fault class, whoever raises it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from test_dependency_direction import PACKAGES, ROOT, sources

from rollout_actors.kernel.faults import Fault

MAPPER = "rollout_actors/kernel/faults.py"
"""The one module that reads Ray's exceptions (`ray_lost`, `ray_errors`, `far_cause`, ...)."""
RAY_ERROR_NAMES = {"RayActorError", "ActorDiedError", "ActorUnavailableError", "RayTaskError", "RayError"}


def ray_error_uses(tree: ast.AST) -> list[int]:
    """Lines that import `ray.exceptions`, reach into it (`ray.exceptions.X`) or name one of its types."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "ray.exceptions":
            lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name == "ray.exceptions" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "exceptions":
            if isinstance(node.value, ast.Name) and node.value.id == "ray":
                lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in RAY_ERROR_NAMES:
            lines.append(node.lineno)
    return lines


def hand_typed_failures(tree: ast.AST) -> list[int]:
    """Lines that build a `Failure` with its type given by hand (`Failure(type=...)`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(k.arg == "type" for k in node.keywords):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name == "Failure":
                lines.append(node.lineno)
    return lines


def product_files() -> list[Path]:
    return [path for package in PACKAGES for path in sources(package)] + sorted(
        (ROOT / "scripts").glob("*.py")
    )


def offenders(rule, allowed: set[str]) -> list[str]:
    found = []
    for path in product_files():
        relative = str(path.relative_to(ROOT))
        if relative in allowed:
            continue
        found += [f"{relative}:{line}" for line in rule(ast.parse(path.read_text(), filename=relative))]
    return found


def test_the_rules_see_what_they_forbid():
    """The readers find each form they forbid (so a clean tree below is a finding, not a blind spot)."""
    code = ast.parse(
        "import ray.exceptions\n"
        "from ray.exceptions import RayError\n"
        "try:\n    pass\nexcept ray.exceptions.RayActorError:\n    pass\n"
        "failure = Failure(type='Lost', message='m')\n"
        "failure = kernel.Failure(message='m', type='Lost')\n"
        "ok = Failure.from_exception(exc)\n"
    )
    assert ray_error_uses(code) == [1, 2, 5]
    assert sorted(hand_typed_failures(code)) == [7, 8]


def test_only_the_mapper_reads_rays_exceptions():
    """Every Ray boundary (the plane's worker adapter, env calls, renderer calls, pool lookups, the
    supervisors) maps Ray's word through `kernel.faults`; none catches or names Ray's types itself."""
    assert not offenders(ray_error_uses, {MAPPER}), offenders(ray_error_uses, {MAPPER})


def test_no_failure_is_typed_by_hand():
    """A failure is one fault class, constructed where it happens; its `Failure` comes from the class."""
    assert not offenders(hand_typed_failures, {MAPPER}), offenders(hand_typed_failures, {MAPPER})


def classes_defined_twice() -> dict[str, list[str]]:
    """Class name -> the product modules that define a class of that name, where more than one does."""
    where: dict[str, list[str]] = {}
    for path in product_files():
        relative = path.relative_to(ROOT)
        if relative.parts[0] not in PACKAGES:
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module)
    return {name: modules for name, modules in where.items() if len(modules) > 1}


def test_a_failure_name_stands_for_one_fault_class():
    """Two fault classes of one name would let one failure (say `EnvDeadline`) be tagged two ways; and
    the class fixes the tag: whoever raises `EnvDeadline`, it is the environment's (`env`)."""
    twice = {
        name: modules
        for name, modules in classes_defined_twice().items()
        if any(issubclass(getattr(importlib.import_module(m), name, object), Fault) for m in modules)
    }
    assert not twice, twice
    from env_actors.failures import EnvDeadline, EnvNoAnswer

    assert (EnvDeadline("late").failure.fault, EnvDeadline("late").kind) == ("env", "env")
    assert (EnvNoAnswer("silent").failure.fault, EnvNoAnswer("silent").kind) == (
        "unavailable",
        "infrastructure",
    )
