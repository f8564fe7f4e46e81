"""A pool's interpreter (`env_actors.pool_python`, `rollouts pool-python`) sees the interpreter that built it,
a virtualenv's included, under its own packages: an env pool's `py_executable` imports ray and this project
whatever the plane was installed into, and the stack's own versions win."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from env_actors.pool_python import build_pool_python

PROBE = (
    "import json, sys, ray, rollout_actors, layer_probe; print(json.dumps({'prefix': sys.prefix, "
    "'ray': ray.__file__, 'project': rollout_actors.__file__, 'probe': layer_probe.WHO, "
    "'probe_file': layer_probe.__file__}))"
)


def _wheel(folder: Path, version: str, who: str) -> Path:
    """A one-module wheel, `layer_probe` saying who installed it: built by hand, so no index is needed."""
    dist = f"layer_probe-{version}"
    files = {
        "layer_probe/__init__.py": f"WHO = {who!r}\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: layer-probe\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in {**files, f"{dist}.dist-info/RECORD": "\n".join(record) + "\n"}.items():
            archive.writestr(name, text)
    return path


def _probe(python: Path) -> dict:
    done = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pool_python_built_from_a_venv_imports_the_venvs_packages_under_its_own(tmp_path):
    ray_here = importlib.util.find_spec("ray").origin
    project_here = importlib.util.find_spec("rollout_actors").origin
    # The plane as a user installs it: a virtualenv that does not include the base Python's packages, with
    # a package of its own. It is itself layered over this interpreter, which has ray and the project.
    plane = build_pool_python(
        tmp_path / "plane", [str(_wheel(tmp_path, "1.0", "plane"))], pip_args=["--no-index"]
    )
    assert "include-system-site-packages = false" in (tmp_path / "plane" / "pyvenv.cfg").read_text()
    assert _probe(plane)["probe"] == "plane"

    # From inside that venv, the README's recipe: `rollouts pool-python HOME REQUIREMENT...`.
    built = subprocess.run(
        [
            str(plane),
            "-m",
            "rollout_actors.cli",
            "pool-python",
            str(tmp_path / "pool"),
            str(_wheel(tmp_path, "2.0", "pool")),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    pool = Path(built.stdout.strip())
    assert pool == tmp_path / "pool" / "bin" / "python"

    seen = _probe(pool)
    assert Path(seen["prefix"]) == tmp_path / "pool"
    assert seen["ray"] == ray_here and seen["project"] == project_here  # the plane's, through its venv
    assert seen["probe"] == "pool" and seen["probe_file"].startswith(str(tmp_path / "pool"))  # its own wins
    assert _probe(plane)["probe"] == "plane"  # and the plane's own is untouched


def test_a_pool_python_that_cannot_install_says_which_step_failed(tmp_path):
    from env_actors.pool_python import PoolPythonError

    with pytest.raises(PoolPythonError) as failed:
        build_pool_python(
            tmp_path / "pool", [str(tmp_path / "missing-0.1-py3-none-any.whl")], pip_args=["--no-index"]
        )
    assert "pip install" in str(failed.value) and "missing-0.1" in str(failed.value)
