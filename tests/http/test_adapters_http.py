"""Adapters over HTTP: `model: NAME` on every wire, 404 `model_not_found` in each wire's shape, `/v1/models`,
and `--enable-lora-admin`'s load and unload endpoints (vLLM's bodies)."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import httpx
import pytest
from mlx_lm import load

from mlx_trio.http import ServerConfig
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.engine.adapters.test_row_lora import MAX_TOKENS, _adapter_dir, _mlx_lm_tokens, _prompt
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, assert_openai_error, tiny_engine_config

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": {"prompt": "hi", "max_tokens": 4},
          "/v1/messages": CHAT, "/v1/responses": {"input": "hi", "max_output_tokens": 4}}


@pytest.fixture(scope="module")
def http() -> Iterator[tuple[httpx.Client, ServerThread]]:
    engine = attrs.evolve(tiny_engine_config(max_tokens=MAX_TOKENS),
                          lora_modules={"qv": str(_adapter_dir("llama", "qv"))}, enable_lora_admin=True)
    with ServerThread(engine, ServerConfig(port=0, enable_lora_admin=True)) as server:
        with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            yield client, server


def _text(client: httpx.Client, model: str, prompt: tuple[int, ...]) -> str:
    response = client.post("/v1/completions", json={"model": model, "prompt": list(prompt),
                                                    "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _decoded(name: str | None, prompt: tuple[int, ...]) -> str:
    _, tokenizer = load(str(tiny_model(LLAMA)))
    detokenizer = tokenizer.detokenizer  # the streaming detokenizer, as the server's text is made
    detokenizer.reset()
    for token in _mlx_lm_tokens("llama", name, prompt):
        if token not in tokenizer.eos_token_ids:
            detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def test_model_names_an_adapter_and_the_base_keeps_its_name(http) -> None:
    client, _ = http
    prompt = _prompt(1)
    assert _text(client, "qv", prompt) == _decoded("qv", prompt)
    assert _text(client, "default", prompt) == _decoded(None, prompt)
    base = client.get("/v1/models").json()["data"][0]["id"]
    assert _text(client, base, prompt) == _decoded(None, prompt)
    for path, body in BODIES.items():
        response = client.post(path, json={**body, "model": "qv"})
        assert response.status_code == 200, (path, response.text)


def test_v1_models_lists_the_base_then_each_adapter_with_its_parent(http) -> None:
    client, _ = http
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data][1:] == ["qv"] and data[1]["parent"] == data[0]["id"]
    assert client.get("/v1/models/qv").json()["parent"] == data[0]["id"]


@pytest.mark.parametrize("path", sorted(BODIES))
def test_an_unknown_model_is_a_404_model_not_found_naming_the_served_models(http, path: str) -> None:
    client, _ = http
    response = client.post(path, json={**BODIES[path], "model": "nope"})
    if path == "/v1/messages":
        assert response.status_code == 404
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
        message = error["error"]["message"]
    else:
        message = assert_openai_error(response, 404, code="model_not_found", param="model")["message"]
    assert "'nope'" in message and "'qv'" in message


def test_load_and_unload_endpoints(http, tmp_path) -> None:
    client, _ = http
    path = str(_adapter_dir("llama", "mlp"))
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": path})
    assert response.status_code == 200, response.text
    assert _text(client, "mlp", _prompt(2)) == _decoded("mlp", _prompt(2))
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "none")})
    assert_openai_error(bad, 400, param=None)
    assert "cannot read adapter_config.json" in bad.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    assert_openai_error(client.post("/v1/completions", json={"model": "mlp", "prompt": "hi"}), 404,
                        code="model_not_found")
    assert_openai_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}), 404, code="model_not_found")
    assert_openai_error(client.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, param="lora_path")


def test_a_load_replacing_an_adapter_a_request_still_names_is_a_400_naming_it() -> None:
    """Under paged KV a request's pinned prefix and its row's join must read one revision of its adapter: a load
    replacing the name while a request names it is refused (docs/design.md §6.5). A pin of qv's revision stands in
    for a request between admission and its row (deterministic, unlike timing a live one)."""
    from types import SimpleNamespace

    from mlx_trio.engine.prompt_cache.namespace import kv_revision

    engine = attrs.evolve(tiny_engine_config(max_tokens=MAX_TOKENS), kv_layout="paged",
                          kv_budget_bytes=16 << 20,  # a small pool: the default budget takes most of the machine
                          lora_modules={"qv": str(_adapter_dir("llama", "qv"))}, enable_lora_admin=True)
    with ServerThread(engine, ServerConfig(port=0, enable_lora_admin=True)) as server:
        with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            lane = server.server.engine.actors.lane
            paged = lane.model.paged_kv
            root = paged.peek_root(kv_revision("qv", lane.adapters.revisions["qv"]))
            server.call(lane.pins.__setitem__, "between", SimpleNamespace(root=root))
            try:
                response = client.post("/v1/load_lora_adapter",
                                       json={"lora_name": "qv", "lora_path": str(_adapter_dir("llama", "mlp"))})
            finally:
                server.call(lane.pins.pop, "between")
            message = assert_openai_error(response, 400, param=None)["message"]
            assert "'qv' is named by queued or running requests: unload it first" in message
            assert _text(client, "qv", _prompt(3)) == _decoded("qv", _prompt(3))  # the old revision still served
            ok = client.post("/v1/load_lora_adapter",
                             json={"lora_name": "qv", "lora_path": str(_adapter_dir("llama", "mlp"))})
            assert ok.status_code == 200, ok.text
            assert _text(client, "qv", _prompt(3)) == _decoded("mlp", _prompt(3))
