"""The API key set the documented way (a key file named in runtime_env.env_vars, the config
Serve and Ray log holding only its path) guards the API, and afterwards appears nowhere:
not in any file under the Ray session's log folder, not in `serve run`'s output."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from .conftest import REPO
from .test_serve_run import _serve_bin, _wait_healthy

pytestmark = pytest.mark.ray

KEY = "sk-fleet-9d4e27b3c1a8"  # distinctive: any occurrence in a log is a leak


@pytest.fixture(scope="module")
def keyed_server(ray_cluster, serve_port, tmp_path_factory):
    """configs/tiny.yaml with one replica and the key file in the app's runtime_env."""
    tmp = tmp_path_factory.mktemp("keyed")
    key_file = tmp / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config["http_options"]["port"] = serve_port
    (app,) = config["applications"]
    app["args"].pop("autoscaling_config")
    app["runtime_env"] = {"env_vars": {"RAYSERVE_PAGED_API_KEY_FILE": str(key_file)}}
    path = tmp / "keyed.yaml"
    path.write_text(yaml.safe_dump(config))
    output = tmp / "serve-run.log"
    with open(output, "w") as log:
        proc = subprocess.Popen(
            [_serve_bin(), "run", str(path)], cwd=REPO, env=dict(os.environ, RAY_ADDRESS=ray_cluster),
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        base = f"http://127.0.0.1:{serve_port}"
        try:
            _wait_healthy(base, proc)  # /health needs no key
            yield base, output
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            from ray import serve

            for name in list(serve.status().applications):
                serve.delete(name)


def _session_logs() -> Path:
    import ray

    return Path(ray._private.worker.global_worker.node.get_logs_dir_path())


def test_key_guards_the_api_and_never_reaches_a_log(keyed_server):
    base, output = keyed_server
    body = {"model": "tiny-opt", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    authorized = {"Authorization": f"Bearer {KEY}"}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/v1/models", timeout=60).status_code == 401
    r = httpx.post(f"{base}/v1/completions", json=body, headers=authorized, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{base}/v1/models", headers=authorized, timeout=60).json()["data"][0]["id"] == "tiny-opt"
    scrape = httpx.get(f"{base}/metrics", timeout=60)  # the Prometheus scrape needs no key
    assert scrape.status_code == 200 and "rayserve_paged_request_finished_total" in scrape.text

    logs = _session_logs()
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert any("controller" in p.name for p in files)  # the folder Serve's controller logs to
    leaks = [str(p) for p in files if KEY.encode() in p.read_bytes()]
    assert leaks == []
    # the output of this very run, replicas' request logs included (what a leak would ride on);
    # the replicas' lines reach `serve run`'s output through Ray's log monitor, a moment later
    deadline = time.monotonic() + 30
    text = output.read_text()
    while "POST /v1/completions 200" not in text and time.monotonic() < deadline:
        time.sleep(0.5)
        text = output.read_text()
    assert "Running config file" in text and "POST /v1/completions 200" in text
    assert KEY not in text
