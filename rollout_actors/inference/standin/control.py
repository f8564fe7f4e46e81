"""The stand-in's routes besides the OpenAI ones: LoRA load/unload, pause/resume and weight updates (vLLM's
dev routes), and the test-only `/admin` routes.

Read from vLLM 0.33.0 (commit 4ba787ec9): `vllm/entrypoints/serve/lora/api_router.py` and
`vllm/entrypoints/openai/models/serving.py` (load/unload and their errors: a refused adapter is a 500
`InternalServerError` carrying the loader's message), `vllm/lora/peft_helper.py` and
`vllm/lora/lora_model.py` (what the loader refuses; shared with the publisher's own check in
`rollout_actors.policy.lora.adapter_problems`), `vllm/entrypoints/rl/online/api_router.py` (`/pause`,
`/resume`, `/is_paused`, `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, `/weight_info`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollout_actors.inference.standin.wire import (
    FaultSettings,
    FinishWeightsRequest,
    InitWeightTransferRequest,
    LoadLoRAAdapterRequest,
    LoadWeightsRequest,
    PauseQuery,
    UnloadLoRAAdapterRequest,
)
from rollout_actors.policy.lora import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterLimits,
    adapter_problems,
    safetensors_names,
)
from rollout_actors.policy.weights import init_info_problems, update_info_problems

log = logging.getLogger("rollout_actors.standin")


def lora_routes(state: Any, parse: Any, error: Any) -> list[Route]:
    """`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (served with `--enable-lora`, as vLLM serves
    them with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`)."""

    async def load_lora(request: Request) -> Response:
        body = await parse(request, LoadLoRAAdapterRequest)
        if not body.lora_name or not body.lora_path:
            return error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if body.lora_name == state.options.model:
            msg = f"The lora adapter '{body.lora_name}' conflicts with a served base model."
            return error(msg, "InvalidUserInput", 400)
        if body.lora_name in state.loras and not body.load_inplace:
            msg = (
                f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True."
            )
            return error(msg, "InvalidUserInput", 400)
        refusal = _refusal(body.lora_path, state.adapter_limits)
        if refusal == "missing":
            msg = f"Loading lora {body.lora_name} failed: No adapter found for {body.lora_path}"
            return error(msg, "NotFoundError", 404)
        if refusal:
            return error(refusal, "InternalServerError", 500)
        state.loras[body.lora_name] = body.lora_path
        log.info("loaded LoRA adapter %s from %s", body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora(request: Request) -> Response:
        body = await parse(request, UnloadLoRAAdapterRequest)
        if state.loras.pop(body.lora_name, None) is None:
            return error(f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError", 404)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return [
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
    ]


def _refusal(path: str, limits: AdapterLimits) -> str | None:
    """None when vLLM's loader would take the adapter at `path`; "missing" when there is none; else why."""
    try:
        with open(os.path.join(path, CONFIG_FILE)) as handle:
            config = json.load(handle)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as exc:
        return f"{CONFIG_FILE} of {path} cannot be read: {exc}"
    weights = os.path.join(path, WEIGHTS_FILE)
    names: list[str] | None = None
    if os.path.isfile(weights):
        try:
            with open(weights, "rb") as handle:
                names = safetensors_names(handle.read())
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            return f"{weights} is not a safetensors file: {exc}"
    elif not any(os.path.isfile(os.path.join(path, f)) for f in ("adapter_model.bin", "adapter_model.pt")):
        return f"{path} doesn't contain tensors"
    if not isinstance(config, dict):
        return f"{CONFIG_FILE} of {path} is not an object"
    problems = adapter_problems(config, names, limits)
    return " ".join(problems) or None


def weight_routes(state: Any, parse: Any, error: Any, parse_query: Any) -> list[Route]:
    """vLLM's pause/resume and weight-update routes (served with `--weight-updates`, as vLLM serves them with
    `VLLM_SERVER_DEV_MODE=1`), as strict as vLLM 0.33.0's worker (`vllm/v1/worker/gpu_worker.py`) and
    transfer backend: `/init_weight_transfer_engine` with the backend's `init_info` before any update;
    `update_info` checked per backend; a second `/start_weight_update` while one is open refused; a refused
    `/update_weights` closes the session. The new weights take effect at `/finish_weight_update`, whose
    `weight_version` changes the scripted policy's answers."""
    backend = state.options.weight_transfer_backend
    updating: dict[str, Any] = {"active": False, "update_info": None, "init_info": None}

    async def pause(request: Request) -> Response:
        query = parse_query(request, PauseQuery)
        await state.engine.pause(query.mode)
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        state.engine.resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": state.engine.pause_mode is not None})

    async def init_transfer(request: Request) -> Response:
        body = await parse(request, InitWeightTransferRequest)
        problems = init_info_problems(backend, body.init_info)
        if problems:
            return error(f"Invalid init_info: {'; '.join(problems)}", "BadRequestError", 400)
        updating["init_info"] = body.init_info
        return JSONResponse({"message": "Weight transfer initialized"})

    async def start_update(request: Request) -> Response:
        if updating["active"]:
            msg = "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            return error(msg, "InternalServerError", 500)
        updating["active"] = True
        return JSONResponse({"message": "Weight update started"})

    async def update(request: Request) -> Response:
        body = await parse(request, LoadWeightsRequest)
        if not updating["active"]:
            return error(
                "start_weight_update must be called before update_weights.", "InternalServerError", 500
            )
        # vLLM's worker ends the session on any failure inside update_weights.
        if updating["init_info"] is None and backend == "nccl":
            updating["active"] = False
            msg = "NCCL weight transfer not initialized. Call init_transfer_engine() first."
            return error(msg, "InternalServerError", 500)
        problems = update_info_problems(backend, body.update_info)
        if problems:
            updating["active"] = False
            return error(f"Invalid update_info: {'; '.join(problems)}", "BadRequestError", 400)
        updating["update_info"] = body.update_info
        return JSONResponse({"message": "Weights updated"})

    async def finish_update(request: Request) -> Response:
        body = await parse(request, FinishWeightsRequest)
        if not updating["active"]:
            msg = "finish_weight_update called without a matching start_weight_update."
            return error(msg, "InternalServerError", 500)
        updating["active"] = False
        if body.weight_version is not None:
            state.engine.weight_version = body.weight_version
        log.info("weights updated to version %s", state.engine.weight_version)
        return JSONResponse({"message": "Weight update finished"})

    async def weight_info(request: Request) -> Response:
        return JSONResponse({"weight_version": state.engine.weight_version})

    return [
        Route("/pause", pause, methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/is_paused", is_paused, methods=["GET"]),
        Route("/init_weight_transfer_engine", init_transfer, methods=["POST"]),
        Route("/start_weight_update", start_update, methods=["POST"]),
        Route("/update_weights", update, methods=["POST"]),
        Route("/finish_weight_update", finish_update, methods=["POST"]),
        Route("/weight_info", weight_info, methods=["GET"]),
    ]


def admin_routes(state: Any, parse: Any) -> list[Route]:
    """Test-only (`--admin`): live fault settings, and what the server saw of each request."""

    async def faults(request: Request) -> Response:
        if request.method == "POST":
            state.faults.settings = await parse(request, FaultSettings)
        return Response(state.faults.settings.model_dump_json(), media_type="application/json")

    async def sessions(request: Request) -> Response:
        return JSONResponse({"sessions": state.stats.sessions, "overflow": state.stats.sessions_overflow})

    async def requests(request: Request) -> Response:
        return JSONResponse({"requests": list(state.recent)})

    async def bodies(request: Request) -> Response:
        sent = [{"path": path, "body": json.loads(body)} for path, body in state.bodies]
        return JSONResponse({"bodies": sent})

    return [
        Route("/admin/bodies", bodies, methods=["GET"]),
        Route("/admin/faults", faults, methods=["GET", "POST"]),
        Route("/admin/sessions", sessions, methods=["GET"]),
        Route("/admin/requests", requests, methods=["GET"]),
    ]
