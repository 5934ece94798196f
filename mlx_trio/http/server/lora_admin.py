"""Runtime adapter management, vLLM's endpoints: `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`.

They exist only with `ServerConfig.enable_lora_admin` (`mlx-trio serve
--enable-lora-admin`); otherwise they are 404 like any unknown path, and
they need the API key like every endpoint that serves data. Bodies are
vLLM's: `{"lora_name": ..., "lora_path": ...}` to load (an mlx-lm adapter
directory on this machine), `{"lora_name": ...}` to unload. A load is one
GPU-lease job; an unload refuses new requests for the name at once and
answers once every request using it has ended.
"""

from __future__ import annotations

from quart import Quart, Response, request

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.server.body import decode_json_object
from mlx_trio.http.server.info import json_response
from mlx_trio.http.server.state import AppState


def register_lora_admin(app: Quart, state: AppState) -> None:
    if not state.config.enable_lora_admin:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter() -> Response:
        body = decode_json_object(await request.get_data())
        name, path = _name(body, "lora_name"), _name(body, "lora_path")
        await state.engine.load_adapter(name, path)
        return json_response({"object": "lora_adapter", "id": name, "status": "loaded",
                              "message": f"Success: LoRA adapter '{name}' added successfully."})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter() -> Response:
        body = decode_json_object(await request.get_data())
        name = _name(body, "lora_name")
        await state.engine.unload_adapter(name)
        return json_response({"object": "lora_adapter", "id": name, "status": "unloaded",
                              "message": f"Success: LoRA adapter '{name}' removed successfully."})


def _name(body: dict, field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidParameter(field, "must be a non-empty string")
    return value
