"""The multi-model ingress app (deployments/multi_model.py) over two models' OpenAI apps in
this process: each request reaches the app of the model its body names (its answer carries
that model's name), /v1/models lists both, and the guards run before a body is read."""

from __future__ import annotations

import pytest

from rayserve_paged.deployments.multi_model import ModelDispatch, ServedModel, create_multi_model_app
from rayserve_paged.deployments.openai_ingress import create_openai_app
from tests.deployments.conftest import asgi_client, assert_openai_error

pytestmark = pytest.mark.anyio

MODELS = ("smol", "tiny/opt.v2")


@pytest.fixture
def served(engine_client, engine):
    """Two models' apps (one engine behind both: what differs is the app that answers)."""
    return {
        name: ServedModel(create_openai_app(engine_client, engine.tokenizer, name), (f"{name}-sql",) if i else ())
        for i, name in enumerate(MODELS)
    }


@pytest.fixture
async def http(served):
    async with asgi_client(create_multi_model_app(served)) as client:
        yield client


def _completion(model=None, **extra):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    return body | ({"model": model} if model is not None else {}) | extra


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_each_request_reaches_the_app_of_its_model(http, path):
    body = _completion() if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    for model in (*MODELS, MODELS[1]):
        response = await http.post(path, json=body | {"model": model})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model


async def test_models_lists_every_model_and_each_card(http):
    listed = (await http.get("/v1/models")).json()["data"]
    assert [card["id"] for card in listed] == list(MODELS)
    card = (await http.get(f"/v1/models/{MODELS[1]}")).json()
    assert card["id"] == MODELS[1]
    assert_openai_error(await http.get("/v1/models/nope"), 404, "model", "'nope' does not exist", "'smol'")
    assert (await http.get("/health")).json() == {"status": "ok"}


async def test_a_request_without_model_needs_one_when_several_are_served(http, served):
    assert_openai_error(await http.post("/v1/completions", json=_completion()), 400, "model", "several models", "smol")
    async with asgi_client(create_multi_model_app({"smol": served["smol"]})) as one:
        response = await one.post("/v1/completions", json=_completion())
        assert response.status_code == 200 and response.json()["model"] == "smol"  # the only model


async def test_names_route_by_model_adapter_or_model_id_prefix(served):
    dispatch = ModelDispatch(app=None, models=served)
    assert dispatch.model_of("smol") == "smol"
    assert dispatch.model_of("tiny/opt.v2-sql") == "tiny/opt.v2"  # one of its adapters
    assert dispatch.model_of("smol:any-adapter") == "smol"  # Ray Serve LLM's <model_id>:<adapter>
    assert dispatch.model_of("other:x") is None and dispatch.model_of("") is None


async def test_unknown_models_and_adapters_are_404_naming_them(http):
    error = assert_openai_error(await http.post("/v1/completions", json=_completion("llama")), 404, "model")
    assert error["code"] == "model_not_found" and "'llama'" in error["message"]
    # the base model's own app answers for an adapter it does not hold
    assert_openai_error(await http.post("/v1/completions", json=_completion("smol:nope")), 404, "model", "smol:nope")
    long = "x" * 10_000
    error = assert_openai_error(await http.post("/v1/completions", json=_completion(long)), 404, "model")
    assert len(error["message"]) < 400


async def test_bodies_that_name_no_model_get_the_models_own_errors(http):
    response = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(response, 400)
    assert_openai_error(await http.post("/v1/completions", json=_completion(7)), 400, "model")
    nested = b"[" * 100_000 + b"]" * 100_000
    assert (await http.post("/v1/completions", content=nested, headers={"content-type": "application/json"})).status_code == 400


async def test_the_guards_run_before_a_body_is_read(served):
    app = create_multi_model_app(served, "secret", max_request_body_bytes=200)
    async with asgi_client(app) as http:
        assert_openai_error(await http.post("/v1/completions", json=_completion("smol")), 401)
        assert (await http.get("/health")).status_code == 200  # open, as in every app
        auth = {"authorization": "Bearer secret"}
        response = await http.post("/v1/completions", json=_completion("smol", prompt="x" * 300), headers=auth)
        assert_openai_error(response, 413)
        response = await http.post("/v1/completions", json=_completion("smol"), headers=auth)
        assert response.status_code == 200 and response.json()["model"] == "smol"


async def test_a_chat_template_replaces_the_tokenizers(tiny_opt_path, engine_client):
    """vLLM's chat_template: the app renders conversations with it (a tokenizer of its own
    here: the app sets the template on the tokenizer it is given)."""
    from rayserve_paged.deployments.llm_server import load_tokenizer

    tokenizer = load_tokenizer(tiny_opt_path)
    template = "{% for m in messages %}<{{ m['role'] }}:{{ m['content'] }}>{% endfor %}"
    app = create_openai_app(engine_client, tokenizer, "m", chat_template=template)
    async with asgi_client(app) as http:
        body = {"messages": [{"role": "user", "content": "Hi there"}]}
        response = await http.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        tokens = response.json()["tokens"]
        text = (await http.post("/detokenize", json={"tokens": tokens})).json()["prompt"]
    assert text == "<user:Hi there>"
