"""Security defaults: the API key comes from the environment (an `api_key` argument is
refused), guards every route but /health and /metrics, is compared in constant time and never
reaches the logs; request bodies are not logged at INFO; model code from the
hub is off unless asked for; the local config binds the loopback interface only."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import transformers
import yaml

from rayserve_paged.app import AppArgs
from rayserve_paged.config import EngineConfig
from rayserve_paged.deployments.llm_server import load_tokenizer
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.llm_engine import LLMEngine
from tests.deployments.conftest import MODEL, assert_openai_error, record_binds

pytestmark = pytest.mark.anyio

KEY = "sk-test-7f3a9c51"  # distinctive, so a leak into a log is unmistakable
WRONG_KEY = "sk-wrong-5b1d02"
OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def _http(app, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers)


@pytest.fixture
def keyed_app(engine_client, engine):
    return create_openai_app(engine_client, engine.tokenizer, MODEL, api_key=KEY)


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL}"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/no/such/route"),
    ],
)
async def test_every_route_but_health_and_metrics_needs_the_key(keyed_app, method, path):
    for key in (None, WRONG_KEY, KEY[:-1], KEY + "x"):
        async with _http(keyed_app, key) as http:
            error = assert_openai_error(await http.request(method, path, json=OK), 401)
            assert error["code"] == "invalid_api_key" and KEY not in error["message"]
    async with _http(keyed_app, KEY) as http:  # with the key: past the check (a 400, 404 or 200)
        assert (await http.request(method, path, json=OK)).status_code in (200, 400, 404)


async def test_health_is_open_and_the_key_comes_before_every_limit(engine_client, engine):
    app = create_openai_app(
        engine_client, engine.tokenizer, MODEL, api_key=KEY, max_request_body_bytes=100, max_pending_requests=1
    )
    for key in (None, WRONG_KEY):
        async with _http(app, key) as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
            # an oversize body without the key is a 401, not a 413: nothing is read first
            response = await http.post("/v1/completions", content=b"x" * 1000)
            assert assert_openai_error(response, 401)["code"] == "invalid_api_key"


async def test_metrics_is_open_by_default_and_can_be_closed(keyed_app, engine_client, engine):
    async with _http(keyed_app) as http:  # the Prometheus scrape needs no key (as vLLM's /metrics)
        response = await http.get("/metrics")
        assert response.status_code == 200 and "rayserve_paged_kv_cache_blocks" in response.text
    closed = create_openai_app(engine_client, engine.tokenizer, MODEL, api_key=KEY, open_paths=("/health",))
    async with _http(closed) as http:
        assert assert_openai_error(await http.get("/metrics"), 401)["code"] == "invalid_api_key"
        assert (await http.get("/health")).status_code == 200
    async with _http(closed, KEY) as http:
        assert (await http.get("/metrics")).status_code == 200


def test_api_key_argument_is_refused_without_echoing_it():
    from pydantic import ValidationError

    from rayserve_paged.app import build_app

    with pytest.raises(ValueError, match="RAYSERVE_PAGED_API_KEY") as refused:
        build_app({"model": "tiny-opt", "api_key": KEY})
    assert KEY not in str(refused.value) and "logs the arguments" in str(refused.value)
    with pytest.raises(ValidationError, match="RAYSERVE_PAGED_API_KEY") as refused:
        AppArgs(model="tiny-opt", api_key=KEY)
    assert KEY not in str(refused.value)


def test_the_key_is_read_from_the_environment(monkeypatch):
    from rayserve_paged.deployments.access import API_KEY_ENV, api_key_from_env

    assert API_KEY_ENV == "RAYSERVE_PAGED_API_KEY"
    assert api_key_from_env({API_KEY_ENV: f" {KEY}\n"}) == KEY  # a Secret file's newline is not part of it
    assert api_key_from_env({}) is None
    for blank in ("", " \n"):  # set but blank (an empty Secret): never "no key"
        with pytest.raises(RuntimeError, match=f"{API_KEY_ENV} is set but blank"):
            api_key_from_env({API_KEY_ENV: blank})
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert api_key_from_env() == KEY


def test_the_key_can_come_from_a_file_named_in_the_environment(tmp_path):
    from rayserve_paged.deployments.access import API_KEY_ENV, API_KEY_FILE_ENV, api_key_from_env

    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    assert api_key_from_env({API_KEY_FILE_ENV: str(path)}) == KEY
    assert api_key_from_env({API_KEY_FILE_ENV: str(path), API_KEY_ENV: WRONG_KEY}) == WRONG_KEY  # the key wins
    with pytest.raises(RuntimeError, match=f"{API_KEY_FILE_ENV}: cannot read"):
        api_key_from_env({API_KEY_FILE_ENV: str(tmp_path / "missing")})
    path.write_text("\n")
    with pytest.raises(RuntimeError, match="is empty"):  # a broken Secret never means "no key"
        api_key_from_env({API_KEY_FILE_ENV: str(path)})


def test_a_required_key_that_is_missing_stops_the_replica_and_no_key_warns_once(caplog):
    from rayserve_paged.deployments.access import API_KEY_ENV, API_KEY_FILE_ENV, replica_api_key

    with pytest.raises(RuntimeError, match=f"require_api_key is true but no API key is set: set {API_KEY_ENV}"):
        replica_api_key(True, {})
    with pytest.raises(RuntimeError, match="set but blank"):
        replica_api_key(False, {API_KEY_ENV: ""})
    caplog.set_level(logging.WARNING, logger="rayserve_paged.deployments.access")
    assert replica_api_key(True, {API_KEY_ENV: KEY}) == KEY and replica_api_key(False, {API_KEY_ENV: KEY}) == KEY
    assert caplog.records == []
    assert replica_api_key(False, {}) is None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert API_KEY_ENV in record.getMessage() and API_KEY_FILE_ENV in record.getMessage()
    assert "every route is open" in record.getMessage()


def test_require_api_key_reaches_the_replica(monkeypatch):
    assert AppArgs(model="tiny-opt").require_api_key is False
    bound = record_binds(monkeypatch, AppArgs(model="tiny-opt", device="cpu", require_api_key=True))
    assert bound["LLMServer"]["kwargs"]["http"]["require_api_key"] is True


def test_a_replica_without_its_required_key_refuses_before_it_starts_anything(monkeypatch, engine):
    from rayserve_paged.deployments.access import API_KEY_ENV, API_KEY_FILE_ENV
    from rayserve_paged.deployments.llm_server import LLMServer

    class _Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the scheduler actor was used ({name}) before the key check")

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)
    with pytest.raises(RuntimeError, match="require_api_key is true"):
        LLMServer(engine.config, scheduler_actor=_Untouchable(), http={"require_api_key": True})
    monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(RuntimeError, match="set but blank"):
        LLMServer(engine.config, scheduler_actor=_Untouchable(), http={"require_api_key": False})


async def test_the_key_is_compared_in_constant_time(keyed_app, monkeypatch):
    compared = []

    def compare_digest(a, b):
        compared.append((a, b))
        return hmac_compare_digest(a, b)

    hmac_compare_digest = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    for key, status in ((KEY, 200), ("x", 401), (WRONG_KEY, 401)):
        async with _http(keyed_app, key) as http:
            assert (await http.post("/v1/completions", json=OK)).status_code == status
    # every candidate, whatever its length, goes through compare_digest against the key
    assert compared == [(k.encode(), KEY.encode()) for k in (KEY, "x", WRONG_KEY)]


async def test_neither_the_key_nor_the_body_reaches_the_logs(keyed_app, caplog):
    marker = "SECRET-PROMPT-4242"
    caplog.set_level(logging.DEBUG)
    for key in (WRONG_KEY, KEY):
        async with _http(keyed_app, key) as http:
            await http.post("/v1/completions", json={**OK, "prompt": marker})
            await http.post("/v1/completions", json={**OK, "prompt": marker, "stream": True})
            await http.post("/v1/completions", json={**OK, "prompt": marker, "top_p": 7})  # a 400
            chat = {"messages": [{"role": "user", "content": marker}], "max_tokens": 2}
            await http.post("/v1/chat/completions", json=chat)
            await http.post("/v1/completions", content=b'{"prompt": "' + marker.encode() + b'", ')  # bad JSON
            await http.get("/v1/models")
    assert caplog.records  # the capture works: something was logged (e.g. the HTTP client's lines)
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "")
        assert KEY not in text and WRONG_KEY not in text, record
        assert record.levelno < logging.INFO or marker not in text, record
    assert KEY not in caplog.text and WRONG_KEY not in caplog.text


def test_trust_remote_code_is_off_by_default_and_reaches_tokenizers_and_engine(monkeypatch, tiny_opt_path):
    assert AppArgs(model="tiny-opt").trust_remote_code is False
    assert EngineConfig(model="tiny-opt").trust_remote_code is False
    for value in (False, True):
        bound = record_binds(monkeypatch, AppArgs(model="tiny-opt", device="cpu", trust_remote_code=value))
        # LLMServer(engine_config, ...): the config from which the replica loads the HTTP
        # app's tokenizer and the engine loads its own
        assert bound["LLMServer"]["args"][0]["trust_remote_code"] is value
    loaded = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: loaded.append(kw))
    load_tokenizer(tiny_opt_path)
    load_tokenizer(tiny_opt_path, trust_remote_code=True)
    for value in (False, True):
        config = EngineConfig(model=tiny_opt_path, trust_remote_code=value)
        LLMEngine._load_tokenizer(SimpleNamespace(config=config, model_path=tiny_opt_path))
    assert [kw["trust_remote_code"] for kw in loaded] == [False, True, False, True]


def _devices(args: dict) -> set[str | None]:
    """The devices a config's models run on (flat args: its one model; llm_configs: each entry's)."""
    from rayserve_paged.serve_llm import is_llm_configs, translate

    if not is_llm_configs(args):
        return {args.get("device")}
    return {m.args.get("device") for m in translate(args, frozenset(AppArgs.model_fields)).models}


def test_cpu_configs_bind_loopback_and_only_cluster_configs_bind_every_interface():
    """Cluster (GPU) configs bind 0.0.0.0 on purpose, for a load balancer in front of the
    cluster (docs/API.md); a local config must not expose the server to the network."""
    for path in CONFIGS:
        config = yaml.safe_load(path.read_text())
        host = config.get("http_options", {}).get("host", "127.0.0.1")  # Serve's default is loopback
        (app,) = config["applications"]
        if "cuda" in _devices(app["args"]):
            assert host in ("0.0.0.0", "127.0.0.1"), path.name
        else:
            assert host == "127.0.0.1", path.name
    tiny = yaml.safe_load((CONFIGS[0].parent / "tiny.yaml").read_text())
    assert tiny["http_options"]["host"] == "127.0.0.1"
