"""LoRA adapters: capture what the caller hands over, write it where every inference server can read it.

Two steps with different owners. `capture_adapter` runs on the caller's path and only copies: the caller
may overwrite its arrays (or its adapter directory) the moment `publish` returns, so the capture must
not alias them. `write_adapter` runs off the caller's path (a thread of the publisher) and does the
serialisation: safetensors + `adapter_config.json` in the PEFT layout vLLM's `/v1/load_lora_adapter`
reads, written into a temporary directory and renamed into place, so a server never sees half a file.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from safetensors.numpy import save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt")
COPY_THREADS = 2  # memory bandwidth, not cores, bounds a copy: two threads got most of the gain here
PARALLEL_COPY_BYTES = 4 * 2**20  # below this one thread copies faster than two can be handed work
"""Files copied from an adapter directory: PEFT's config and weights (vLLM reads .safetensors or .bin)."""


def lora_config(
    rank: int, alpha: float, target_modules: list[str], base_model: str | None = None, **extra: Any
) -> dict[str, Any]:
    """A PEFT `adapter_config.json` for a LoRA adapter, with the fields vLLM's loader checks."""
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(target_modules),
        "bias": "none",
        "lora_dropout": 0.0,
        "base_model_name_or_path": base_model,
    }
    config.update(extra)
    return config


@dataclass(frozen=True)
class LoraAdapter:
    """Adapter tensors held by the caller: PEFT tensor names -> CPU arrays, plus the PEFT config.

    Arrays are anything `numpy.asarray` accepts without a device copy (numpy arrays, CPU torch
    tensors in float32/float16). bfloat16 has no numpy dtype: convert before publishing.
    """

    tensors: Mapping[str, Any]
    config: Mapping[str, Any]
    """The contents of `adapter_config.json` (see `lora_config`)."""


@dataclass(frozen=True)
class AdapterCapture:
    """An immutable CPU snapshot of an adapter: private copies, read-only arrays, nothing shared."""

    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, bytes] = field(default_factory=dict)
    """Verbatim files of an adapter handed over as a directory (config included)."""
    donated: bool = False
    """The tensors are the caller's own arrays, handed over (frozen, not copied): never recycled."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tensors.values()) + sum(len(b) for b in self.files.values())


class CaptureBuffers:
    """Recycles the arrays of captures that have been written, for the next capture of the same shapes.

    A training run publishes the same tensor shapes every step. Copying into fresh memory costs page
    faults on every page (measured here: 64 MiB in ~40-140 ms fresh, ~12 ms into warm buffers), and that
    copy is the part of publication the caller waits for. At most one adapter's worth is kept.
    Invariant: a capture is given back only once nothing reads it any more (after `write_adapter`).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[str, tuple[int, ...], str], np.ndarray] = {}
        self._lock = threading.Lock()

    def take(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self._lock:
            buffer = self._free.pop((name, shape, dtype.str), None)
        if buffer is None:
            return np.empty(shape, dtype)
        buffer.setflags(write=True)
        return buffer

    def give_back(self, capture: AdapterCapture) -> None:
        if capture.donated:  # the caller's arrays: theirs to reuse, not ours
            return
        with self._lock:
            self._free = {(name, a.shape, a.dtype.str): a for name, a in capture.tensors.items()}


def _copy_all(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """The capture's memcpy, the part of publication the caller waits for. `np.copyto` releases the GIL,
    so large adapters are copied by `COPY_THREADS` threads at once (measured: 64 MiB in 10.9 ms on one
    thread, 5.0 ms on two); small ones inline, where a thread hop would cost more than it saves."""
    if len(copies) < 2 or sum(source.nbytes for _, source in copies) < PARALLEL_COPY_BYTES:
        for array, source in copies:
            np.copyto(array, source)
        return
    stripes = [copies[i::COPY_THREADS] for i in range(COPY_THREADS)]
    for _ in _copier().map(lambda stripe: [np.copyto(a, s) for a, s in stripe], stripes):
        pass  # iterating re-raises a copy's exception here


@functools.cache
def _copier() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="lora-capture")


def capture_adapter(
    adapter: LoraAdapter | str | os.PathLike[str], buffers: CaptureBuffers | None = None, donate: bool = False
) -> AdapterCapture:
    """Copy `adapter` into an `AdapterCapture`. Raises ValueError for an adapter no server could load.

    Costs one memcpy of the weights (a directory: one read of its files); no serialisation. With `donate`,
    arrays are taken as they are and frozen (`writeable=False`) instead of copied: for a trainer that
    makes fresh CPU arrays every step anyway (`tensor.cpu().numpy()`), the capture is then free. The
    caller must not write them through another view afterwards.
    """
    if isinstance(adapter, LoraAdapter):
        if not adapter.tensors:
            raise ValueError("LoRA adapter has no tensors")
        for key in ("r", "lora_alpha", "target_modules"):
            if key not in adapter.config:
                raise ValueError(f"LoRA adapter config lacks {key!r} (build it with lora_config())")
        tensors, copies = {}, []
        for name, value in adapter.tensors.items():
            if not isinstance(name, str):
                raise ValueError(f"LoRA tensor names must be strings, got {name!r}")
            source = np.asarray(value)
            if source.dtype.kind not in "fiu":
                raise ValueError(f"LoRA tensor {name!r} has dtype {source.dtype}, not a number type")
            if donate:
                tensors[name] = source
                continue
            array = buffers.take(name, source.shape, source.dtype) if buffers else np.empty_like(source)
            copies.append((array, source))
            tensors[name] = array
        _copy_all(copies)
        for array in tensors.values():
            array.setflags(write=False)
        # json round trip: a deep copy that also proves the config is JSON before we leave the caller.
        config = json.loads(json.dumps(dict(adapter.config)))
        return AdapterCapture(
            tensors=MappingProxyType(tensors), config=MappingProxyType(config), donated=donate
        )

    directory = Path(adapter)
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter directory {directory} does not exist")
    if not (directory / CONFIG_FILE).is_file():
        raise ValueError(f"LoRA adapter directory {directory} has no {CONFIG_FILE}")
    files = {
        path.name: path.read_bytes()
        for path in sorted(directory.iterdir())
        if path.is_file() and path.suffix in ADAPTER_FILE_SUFFIXES
    }
    if len(files) < 2:
        raise ValueError(f"LoRA adapter directory {directory} has a config but no weights")
    return AdapterCapture(files=MappingProxyType(files))


def write_adapter(capture: AdapterCapture, storage_dir: str | os.PathLike[str], name: str) -> Path:
    """Serialise `capture` to `storage_dir/name` and return that path. Blocking: run it in a thread.

    The directory appears complete or not at all (temporary sibling + rename on one filesystem).
    Raises FileExistsError rather than replace a directory some server may have loaded already.
    """
    root = Path(storage_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    if final.exists():
        raise FileExistsError(f"adapter directory {final} already exists")
    staging = root / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
    staging.mkdir()
    try:
        if capture.files:
            for file_name, data in capture.files.items():
                (staging / file_name).write_bytes(data)
        else:
            save_file(dict(capture.tensors), str(staging / WEIGHTS_FILE))
            (staging / CONFIG_FILE).write_text(json.dumps(dict(capture.config), indent=2))
        _fsync_dir(staging)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def remove_adapter(path: str | os.PathLike[str]) -> None:
    """Delete a published adapter directory (retention). Missing is fine."""
    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    # Shared storage (NFS, EFS) is where servers on other nodes read from: flush before the rename
    # makes the directory visible, so "renamed" implies "readable in full".
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
