"""vLLM's runtime adapter routes (--enable-lora with --allow-runtime-lora-updating or
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true): POST /v1/load_lora_adapter and
/v1/unload_lora_adapter. See server/common/lora.py."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from engine.lora.checkpoint import AdapterError
from server.common.errors import APIError
from server.common.state import ServerState


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name decides here


def install_lora_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    adapters = state.lora
    assert adapters is not None

    @app.post("/v1/load_lora_adapter", dependencies=auth, response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        try:
            adapters.add(body.lora_name, body.lora_path, replace=body.load_inplace)
        except AdapterError as exc:
            raise APIError(400, str(exc), "lora_path", "invalid_lora_adapter") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_name", "invalid_value") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", dependencies=auth, response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        if adapters.remove(body.lora_name) is None:
            raise APIError(404, f"The LoRA adapter '{body.lora_name}' cannot be found.",
                           "lora_name", "model_not_found")
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
