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


# ------------------------------------------------------------------------------- what vLLM accepts
# Read from vLLM 0.33.0 (commit 4ba787ec9): `vllm/config/lora.py` (MaxLoRARanks), `vllm/lora/peft_helper.py`
# (PEFTHelper.from_dict / _validate_features / validate_legal), `vllm/lora/lora_model.py`
# (check_unexpected_modules) and `vllm/lora/utils.py` (parse_fine_tuned_lora_name).

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""`--max-lora-rank` must be one of these; vLLM refuses to start with any other value."""
DECODER_LORA_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"}
)
"""Modules vLLM can adapt in a Llama/Qwen-style decoder (Qwen3: `qkv_proj` and `gate_up_proj` unpacked by
`packed_modules_mapping`, plus its `embedding_modules`)."""
_PEFT_REQUIRED = ("r", "lora_alpha", "target_modules")
_SUPPORTED_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
_UNSUPPORTED_FEATURES = {
    "use_dora": "vLLM does not yet support DoRA (use_dora)",
    "lora_bias": "vLLM does not support LoRA bias (lora_bias)",
    "alora_invocation_tokens": "vLLM does not support Activated LoRA (alora_invocation_tokens)",
    "layer_replication": "vLLM does not support layer_replication",
    "use_bdlora": "vLLM does not support block-diagonal LoRA (use_bdlora)",
    "use_qalora": "vLLM does not support QALoRA (use_qalora)",
}


@dataclass(frozen=True)
class AdapterLimits:
    """What the servers an adapter goes to accept (their `--max-lora-rank`, the model's LoRA modules)."""

    max_lora_rank: int = 64
    modules: frozenset[str] = DECODER_LORA_MODULES


def adapter_problems(
    config: Mapping[str, Any], tensor_names: list[str] | None, limits: AdapterLimits
) -> list[str]:
    """Why vLLM's loader would refuse this adapter (empty: it would load it). Each problem names the
    setting or the tensor. `tensor_names` None: not known (a `.bin` checkpoint), only the config is checked."""
    missing = [key for key in _PEFT_REQUIRED if key not in config]
    if missing:
        return [f"adapter_config.json lacks required field(s) {missing}"]
    problems = []
    rank, patterns = config["r"], config.get("rank_pattern") or {}
    ranks = [rank, *patterns.values()] if isinstance(patterns, Mapping) else [rank]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks):
        problems.append(f"LoRA rank r={rank!r} (and rank_pattern values) must be positive integers")
    elif max(ranks) > limits.max_lora_rank:
        problems.append(
            f"LoRA rank {max(ranks)} is greater than the servers' max_lora_rank {limits.max_lora_rank}"
        )
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config['bias']!r}: adapter bias is not supported (only 'none')")
    extra = [m for m in config.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if extra:
        problems.append(f"modules_to_save={extra}: vLLM only supports classifier/score heads there")
    problems += [why for key, why in _UNSUPPORTED_FEATURES.items() if config.get(key)]
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _SUPPORTED_INITS:
        problems.append(f"init_lora_weights={init!r} changes the base weights; vLLM does not support it")
    for name in tensor_names or []:
        problems += _tensor_problems(name, config, limits)
    return problems


def _tensor_problems(name: str, config: Mapping[str, Any], limits: AdapterLimits) -> list[str]:
    if (
        name.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight"))
        or "base_layer" in name
    ):
        return []
    parts = name.removeprefix("base_model.model.").split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        module = parts[-3]
    elif len(parts) >= 2 and parts[-1] in ("lora_embedding_A", "lora_embedding_B"):
        module = parts[-2]
    elif len(parts) >= 2 and parts[-1] in ("weight", "bias") and parts[-2] in ("score", "classifier"):
        module = parts[-2]
    else:
        return [f"tensor {name!r} is not a LoRA weight (names end in .lora_A.weight / .lora_B.weight)"]
    if module not in limits.modules and module not in (config.get("modules_to_save") or ()):
        return [
            f"tensor {name!r} adapts module {module!r}, which the model cannot adapt ({sorted(limits.modules)})"
        ]
    return []


def safetensors_names(data: bytes) -> list[str]:
    """Tensor names from a safetensors file's header, without reading the tensors."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return [name for name in header if name != "__metadata__"]


def check_adapter(capture: AdapterCapture, limits: AdapterLimits) -> None:
    """Raise ValueError naming every tensor or setting vLLM would refuse (before anything is written)."""
    if capture.files:
        try:
            config = json.loads(capture.files[CONFIG_FILE])
        except ValueError as exc:
            raise ValueError(f"vLLM would refuse this adapter: {CONFIG_FILE} is not JSON ({exc})") from exc
        weights = capture.files.get(WEIGHTS_FILE)
        try:
            names = safetensors_names(weights) if weights is not None else None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"vLLM would refuse this adapter: {WEIGHTS_FILE} is not a safetensors file"
            ) from exc
    else:
        config, names = dict(capture.config), list(capture.tensors)
    problems = adapter_problems(config, names, limits)
    if problems:
        raise ValueError("vLLM would refuse this adapter: " + "; ".join(problems))


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
