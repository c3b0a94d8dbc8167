"""vLLM's LoRA routes (/v1/load_lora_adapter, /v1/unload_lora_adapter) and the model cards of /v1/models."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from gateway.core.generation import GenerationCore
from gateway.fleet.adapters import AdapterCallFailed, Adapters
from gateway.http_api.openai_errors import HttpError, error_response, grpc_code
from gateway.http_api.openai_protocol import parse_body
from rpcserver.errors import InvalidArgument

# The worker's status -> the HTTP status and vLLM's error type; others map as every route's errors do.
_VLLM_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "BadRequestError"),  # LoRA off on the workers
    grpc.StatusCode.NOT_FOUND: (404, "NotFoundError"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "NotImplementedError"),  # workers that cannot serve adapters at all
}


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's other fields (load_inplace) are taken and left unused
    lora_name: str = ""
    lora_path: str = ""  # a PEFT folder on the workers' filesystem


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = ""


def model_cards(core: GenerationCore, served_name: str) -> list[dict]:
    """The served model, then each LoRA adapter a serving worker has loaded, as vLLM lists them: an adapter's
    `root` is the folder it was loaded from and its `parent` the base model's id."""
    max_model_len = core.limits().max_context  # 503 while no worker has answered
    cards = [_card(served_name, core.downstreams.worker_info.model, None, max_model_len)]
    served = core.adapters.served() if core.adapters is not None else {}
    cards.extend(_card(name, adapter.path, served_name, max_model_len) for name, adapter in sorted(served.items()))
    return cards


def _card(model_id: str, root: str, parent: str | None, max_model_len: int) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "vllm-v0", "root": root, "parent": parent,
            "max_model_len": max_model_len}


def add_adapter_routes(app: FastAPI, core: GenerationCore, read_body: Callable[[Request], Awaitable[bytes]],
                       model_name: Callable[[], str], timeout: float | None) -> None:
    """`read_body`: the routes' body reader, which checks the API key; `timeout`: seconds a worker may take to load
    or unload (the gateway's --http-request-timeout; None: no limit)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        try:
            body = await parse_body(LoadLoraAdapterRequest, await read_body(request))
            if not body.lora_name or not body.lora_path:
                raise InvalidArgument("Both 'lora_name' and 'lora_path' must be provided.")
            if body.lora_name == model_name():
                raise InvalidArgument(f"lora_name {body.lora_name!r} is the base model's id; give the adapter a "
                                      "name of its own")
            message = await _adapters(core).load(body.lora_name, body.lora_path, timeout)
        except Exception as e:  # noqa: BLE001
            return adapter_error(e)
        return PlainTextResponse(message)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        try:
            body = await parse_body(UnloadLoraAdapterRequest, await read_body(request))
            if not body.lora_name:
                raise InvalidArgument("'lora_name' must be provided.")
            message = await _adapters(core).unload(body.lora_name, timeout)
        except Exception as e:  # noqa: BLE001
            return adapter_error(e)
        return PlainTextResponse(message)


def _adapters(core: GenerationCore) -> Adapters:
    if core.adapters is None:
        raise InvalidArgument("this gateway serves no LoRA adapters")
    return core.adapters


def adapter_error(error: BaseException) -> JSONResponse:
    """An error of the LoRA routes as vLLM answers them: 400 (or 404) with its type, the workers' words kept."""
    code = error.code if isinstance(error, AdapterCallFailed) else grpc_code(error)
    if code in _VLLM_ERRORS and not isinstance(error, HttpError):
        status, kind = _VLLM_ERRORS[code]
        error = HttpError(code, str(error), http_status=status, error_type=kind, error_code=status)
    elif isinstance(error, AdapterCallFailed):
        error = HttpError(code, str(error))
    return error_response(error)
