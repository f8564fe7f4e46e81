"""Old spellings of public names, kept working for a while: a field renamed to docs/design.md's glossary
("Words") still reads under its old name, with a `DeprecationWarning` naming the new one. Like the rest
of the kernel it imports nothing else of the project.

>>> from pydantic import BaseModel, model_validator
>>> class Settings(BaseModel):
...     timeout_s: float = 1.0
...     _old = model_validator(mode="before")(renamed_fields({"deadline_s": "timeout_s"}))
>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     Settings(deadline_s=5.0).timeout_s, str(caught[0].message)
(5.0, 'Settings: deadline_s is now timeout_s (the old name will go)')
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed_fields(renames: Mapping[str, str]) -> Callable[[type, Any], Any]:
    """A `model_validator(mode="before")` body that moves each old key to its new name, with a warning.
    Both spellings at once is the caller's mistake, refused rather than guessed."""

    def rename(cls: type, data: Any) -> Any:
        if not isinstance(data, dict) or not any(old in data for old in renames):
            return data
        data = dict(data)
        for old, new in renames.items():
            if old not in data:
                continue
            if new in data:
                raise ValueError(
                    f"{old} and {new} are the same setting ({old} is its old name): give {new} only"
                )
            warn_renamed(f"{cls.__name__}: {old}", new, stacklevel=4)  # the caller that built the model
            data[new] = data.pop(old)
        return data

    rename.__name__ = "_renamed_fields"
    return classmethod(rename)  # type: ignore[return-value]


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """The one deprecation message for a renamed public name."""
    warnings.warn(f"{old} is now {new} (the old name will go)", DeprecationWarning, stacklevel=stacklevel)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Old import paths of modules that moved inside a package, kept working for a while: importing one
    gives a module that forwards every name to the new one (the same objects), with a `DeprecationWarning`
    naming the new path. Installed last on `sys.meta_path`, so a module that exists is always found first.
    """

    def __init__(self, package: str, moves: Mapping[str, str]):
        self._moves = {f"{package}.{old}": f"{package}.{new}" for old, new in moves.items()}

    def install(self) -> None:
        if not any(finder is self for finder in sys.meta_path):
            sys.meta_path.append(self)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self._moves:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> None:
        return None  # the default module, filled in by `exec_module`

    def exec_module(self, module: types.ModuleType) -> None:
        new = self._moves[module.__name__]
        warn_renamed(module.__name__, new, stacklevel=3)
        moved = importlib.import_module(new)
        module.__dict__["__getattr__"] = lambda name: getattr(moved, name)
        module.__dict__["__doc__"] = f"Moved to `{new}`."
