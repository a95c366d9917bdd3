"""LoRA adapters over HTTP: a request names its adapter in `model` (the OpenAI and Anthropic routes,
vLLM's convention) or `parameters.adapter_id` (/generate, TGI's); `/v1/models` lists them; vLLM's
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}
load and unload them at run time (behind --api_key, as every route). An adapter is checked here
(its config, its tensors' names and shapes, against the model and --max_lora_rank) before any
engine hears of it; the engines load its weights from `lora_path`, which they must be able to read."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from lightllm.common.lora_files import LoraAdapterError
from lightllm.frontend.errors import RequestError
from lightllm.server.httpserver.json_body import add_json_route
from lightllm.server.httpserver.openai_params import LENIENT
from lightllm.server.io_struct import LoraLoad, LoraUnload

logger = logging.getLogger(__name__)


class LoadLoraRequest(BaseModel):
    model_config = LENIENT  # vLLM's clients may send more (lora_int_id, base_model_name)

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = LENIENT

    lora_name: str


def add_lora_routes(app: FastAPI) -> None:
    add_json_route(app, "/v1/load_lora_adapter", load_lora_adapter)
    add_json_route(app, "/v1/unload_lora_adapter", unload_lora_adapter)


# The names TGI's clients give where they name no model (TGI serves one, whatever the name):
# huggingface_hub's chat_completion sends "dummy", TGI's documents "tgi". They are the base model
# here, unless an adapter has the name.
TGI_MODEL_NAMES = frozenset({"tgi", "dummy"})


def lora_id_of(model: str | None, state) -> int:
    """The engine id of the adapter a request names (0: the base model); 404 for a name not served."""
    if model is None or model == state.config.served_model_name:
        return 0
    lora_id = state.loras.id_of(model)
    if lora_id is None and model in TGI_MODEL_NAMES:
        return 0
    if lora_id is None:
        served = [state.config.served_model_name, *state.loras.ids]
        raise RequestError(f"model {model!r} does not exist; this server serves {', '.join(map(repr, served))}", 404)
    return lora_id


def adapter_objects(state, created: int) -> list[dict]:
    """The adapters as OpenAI model objects, with vLLM's `parent` (the base model) and `root` (the directory)."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "lightllm",
             "parent": state.config.served_model_name, "root": state.loras.paths[name],
             "max_model_len": state.limits.max_req_total_len} for name in state.loras.ids]


async def load_lora_adapter(request: Request, body: LoadLoraRequest) -> JSONResponse:
    state = request.app.state.server
    try:
        lora_id = state.loras.add(body.lora_name, body.lora_path)
    except LoraAdapterError as exc:
        raise RequestError(str(exc), 400) from None
    state.manager.send_all(LoraLoad(lora_id, body.lora_path))
    logger.info("LoRA adapter %r loaded from %s", body.lora_name, body.lora_path)
    return JSONResponse({"lora_name": body.lora_name, "lora_path": body.lora_path})


async def unload_lora_adapter(request: Request, body: UnloadLoraRequest) -> JSONResponse:
    state = request.app.state.server
    if state.loras.id_of(body.lora_name) is None:
        raise RequestError(f"no LoRA adapter named {body.lora_name!r} is loaded", 404)
    state.manager.send_all(LoraUnload(state.loras.remove(body.lora_name)))
    logger.info("LoRA adapter %r unloaded", body.lora_name)
    return JSONResponse({"lora_name": body.lora_name})
