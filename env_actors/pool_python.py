"""A pool's own interpreter: a virtualenv whose packages are layered over the plane's interpreter.

An env pool runs its servers with `runtime_env.py_executable` when its environment stack clashes with the
plane's packages (verifiers 0.4 needs `openai<3`, the plane runs 3.x). That interpreter must import what
every Ray worker imports (ray, pydantic, this project) and the stack, the stack's own packages winning.

`venv --system-site-packages` does not give that when the plane itself runs in a virtualenv (the normal
install): it exposes the *base* Python's packages, not the venv's, so the pool has no ray and no project
and its servers never start. Here the new virtualenv gets one `.pth` file that appends the running
interpreter's own site directories (venv or not) after its own, through `site.addsitedir`, so their `.pth`
files run too (editable installs). pip sees the plane's packages as installed outside the environment: it
installs the stack's own versions beside them and never uninstalls the plane's.

    python = build_pool_python("~/.pools/vf04", ["verifiers==0.4.0"])
    EnvPoolConfig(runtime_env={"py_executable": str(python)})

`rollouts pool-python DIR REQUIREMENT...` does the same from the command line.
"""

from __future__ import annotations

import site
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

LAYER_PTH = "_plane_site_packages.pth"
"""The file in the pool's site-packages that layers the plane's site directories under its own."""
BUILD_TIMEOUT_S = 1200.0  # a cold build of a framework stack on 2 cores takes minutes; past this pip is stuck


class PoolPythonError(RuntimeError):
    """Building a pool interpreter failed: the step that failed and its output's tail."""


def plane_site_dirs() -> list[str]:
    """The site directories of the running interpreter, in its order: a venv's own (and the base's only when
    the venv includes them), else the installation's; the user site where this interpreter reads it."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def build_pool_python(
    home: str | Path,
    requirements: Sequence[str],
    *,
    pip_args: Sequence[str] = (),
    timeout_s: float = BUILD_TIMEOUT_S,
) -> Path:
    """Create (or recreate) a virtualenv at `home` layered over the running interpreter, install
    `requirements` into it with pip, and return its interpreter's path. Raises `PoolPythonError`."""
    home = Path(home).expanduser().absolute()
    python = home / "bin" / "python"
    _run([sys.executable, "-m", "venv", "--clear", str(home)], timeout_s)
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], timeout_s)
    dirs = plane_site_dirs()
    # A .pth line that starts with `import` is executed at startup, after the venv's own site-packages
    # went on sys.path: the plane's directories come after it, so the pool's own packages win.
    (Path(purelib.strip()) / LAYER_PTH).write_text(f"import site; list(map(site.addsitedir, {dirs!r}))\n")
    if requirements:
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        _run([*pip, *pip_args, *requirements], timeout_s)
    return python


def _run(command: list[str], timeout_s: float) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise PoolPythonError(f"{' '.join(command)} took more than {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise PoolPythonError(f"{' '.join(command)} failed (exit {done.returncode}):\n{tail}")
    return done.stdout
