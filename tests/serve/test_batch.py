"""`rayserve-paged batch` on Ray Data: an OpenAI batch file on the tiny model with two engine
actors on the session's Ray cluster. Every input line gets exactly one result line; the
bodies are the server's (the same lines sent over HTTP to the OpenAI app over an
in-process engine of the same config: equal but for `id` and `created`), LoRA and
structured-output lines included; a killed engine actor is replaced and its batches
retried; a stopped job started again answers only the lines not yet written.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
import yaml

from rayserve_paged import cli
from rayserve_paged.batch import BatchConfig
from rayserve_paged.batch.job import run_batch_file
from rayserve_paged.config import EngineConfig
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.deployments.serving.batch_routes import OpenAIBatchRoutes
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.models.tiny import make_tiny_model
from tests.deployments.conftest import asgi_client
from tests.deployments.engine_client import InProcessEngineClient
from tests.peft_adapters import write_adapter

pytestmark = pytest.mark.ray

SERVED = "tiny"
NUM_LINES = 200
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def engine_options(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("batch")
    model = make_tiny_model("opt", root / "opt")
    adapter = write_adapter(model, root / "ad", "opt", "attn", 4, 8, seed=11)
    return {"model": str(model), "device": "cpu", "max_model_len": 128, "num_gpu_blocks_override": 96,
            "swap_space_gb": 0.01, "max_num_seqs": 16, "max_logprobs": 5, "num_cpu_threads": 1,
            "lora_modules": {"ad": str(adapter)}, "max_lora_rank": 8}  # fmt: skip


def _config(engine_options: dict, concurrency: int) -> BatchConfig:
    return BatchConfig(engine=EngineConfig(**engine_options), served_model_name=SERVED, concurrency=concurrency,
                       batch_size=8, max_concurrent_batches=2, max_retries=2, worker_cpus=0.4,
                       cpu_stage_cpus=0.1)  # fmt: skip


def _request(i: int) -> tuple[str, dict]:
    """The i-th line's route and body: chat, completions, LoRA, constraints, refusals."""
    kind = i % 10
    chat = {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 6, "temperature": 0}
    completion = {"prompt": f"text number {i} is", "max_tokens": 6, "temperature": 0}
    if kind in (0, 1):
        return "/v1/chat/completions", chat | {"model": SERVED}
    if kind == 2:
        return "/v1/completions", completion | {"logprobs": 2}
    if kind == 3:
        return "/v1/completions", completion | {"prompt": [f"first {i}", f"second {i}"], "echo": True}
    if kind == 4:
        return "/v1/chat/completions", chat | {"model": "ad", "logprobs": True, "top_logprobs": 2}
    if kind == 5:
        return "/v1/completions", completion | {"model": "ad", "stop": [" "]}
    if kind == 6:
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        return "/v1/chat/completions", chat | {"response_format": fmt, "max_tokens": 30}
    if kind == 7:
        return "/v1/completions", completion | {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}
    if kind == 8:  # refused the way the server refuses them
        return "/v1/completions", [completion | {"temperature": -1}, completion | {"model": "nope"},
                                   completion | {"max_tokens": 500}, chat][i // 10 % 4]  # fmt: skip
    return "/v1/completions", completion


def _lines(n: int) -> list[str]:
    lines = []
    for i in range(n):
        url, body = _request(i)
        lines.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body}))
    # not requests at all: 400 lines
    lines[9] = "{not json"
    lines[19] = json.dumps({"method": "POST", "url": "/v1/completions", "body": {}})
    lines[29] = json.dumps({"custom_id": "line-29", "method": "POST", "url": "/v1/embeddings", "body": {}})
    return lines


def _write(path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def _results(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _server_answers(engine_options: dict, lines: list[str]) -> dict[str, tuple[int, dict]]:
    """custom_id -> (status, body) from the OpenAI app over an in-process engine."""
    engine = LLMEngine(EngineConfig(**engine_options))
    client = InProcessEngineClient(engine, SERVED)
    requests = []
    for text in lines:
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if "custom_id" in line and line["url"] != "/v1/embeddings":
            requests.append(line)
    try:
        async with asgi_client(create_openai_app(client, engine.tokenizer, SERVED)) as http:
            slots = asyncio.Semaphore(16)  # within the app's tokenizer queue (64): no 503s

            async def post(line: dict):
                async with slots:
                    return await http.post(line["url"], json=line["body"])

            responses = await asyncio.gather(*(post(line) for line in requests))
    finally:
        await client.close()
    return {line["custom_id"]: (r.status_code, r.json()) for line, r in zip(requests, responses)}


def _comparable(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in ("id", "created")}


def _same(a, b) -> bool:
    """Equal JSON, floats (logprobs) within 1e-3: the same tokens computed in batches of
    other sizes differ in their last digits."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-3
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_batch_file_on_two_engine_actors_with_one_killed(ray_cluster, engine_options, tmp_path):
    lines = _lines(NUM_LINES)
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(source, lines)
    killed = []

    def kill_one(summary) -> None:
        if not killed:  # mid-job: SIGKILL the engine actor that answered first
            replica = next(iter(summary.replicas))
            killed.append(replica)
            os.kill(int(replica.rsplit(":", 1)[1]), signal.SIGKILL)

    summary = run_batch_file(source, output, _config(engine_options, 2), OpenAIBatchRoutes, progress=False,
                             commit_rows=30, on_commit=kill_one)  # fmt: skip
    assert killed
    results = _results(output)
    assert len(results) == NUM_LINES == summary.num_lines == summary.num_written
    assert not (tmp_path / "out.jsonl.parts").exists()
    custom_ids = [r["custom_id"] for r in results]
    assert custom_ids.count(None) == 2  # lines 9 and 19 have none
    expected_ids = {f"line-{i}" for i in range(NUM_LINES)} - {"line-9", "line-19"}
    assert len(set(custom_ids) - {None}) == len(custom_ids) - 2 and set(custom_ids) - {None} == expected_ids
    # a replacement actor took over (a new process reported), besides the two first ones
    assert len(summary.replicas) >= 3, summary.replicas
    by_id = {r["custom_id"]: r["response"] for r in results}
    for response in [r["response"] for r in results if r["custom_id"] is None] + [by_id["line-29"]]:
        assert response["status_code"] == 400
        assert set(response["body"]["error"]) == {"message", "type", "param", "code"}
    assert by_id["line-29"]["body"]["error"]["param"] == "url"
    # every request line: the server's status and body
    server = asyncio.run(_server_answers(engine_options, lines))
    assert set(server) == expected_ids - {"line-29"}
    statuses = set()
    for custom_id, (status, body) in server.items():
        response = by_id[custom_id]
        assert response["status_code"] == status, (custom_id, response, body)
        assert _same(_comparable(response["body"]), _comparable(body)), (custom_id, response["body"], body)
        statuses.add(status)
    assert statuses == {200, 400, 404}
    assert summary.num_errors == sum(r["response"]["status_code"] != 200 for r in results)
    constrained = json.loads(by_id["line-6"]["body"]["choices"][0]["message"]["content"])
    assert constrained["city"] in ("Paris", "Rome")
    assert by_id["line-7"]["body"]["choices"][0]["text"] in ("yes", "no", "maybe")


class _Stopped(Exception):
    pass


def test_a_stopped_job_started_again_answers_each_line_once(ray_cluster, engine_options, tmp_path, capsys):
    lines = [line for i, line in enumerate(_lines(40)) if i % 10 in (0, 2, 5, 7)]  # answered by the engine
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(source, lines)
    config = _config(engine_options, 1)

    def stop(summary) -> None:
        raise _Stopped  # as a Ctrl-C or a killed driver, after the first part is committed

    with pytest.raises(_Stopped):
        run_batch_file(source, output, config, OpenAIBatchRoutes, progress=False, commit_rows=4, on_commit=stop)
    parts = tmp_path / "out.jsonl.parts"
    assert not output.exists() and len(list(parts.glob("part-*.arrow"))) == 1
    (parts / "part-000002.arrow.tmp").write_bytes(b"half a part")  # a commit cut short
    # started again from the command line, with the same engine in a YAML file
    config_file = tmp_path / "batch.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    code = cli.main(["batch", str(source), str(output), "--config", str(config_file), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    answered, before = (int(printed.split(f" {word}")[0].rsplit(" ", 1)[1]) for word in ("answered now", "written"))
    assert before >= 4 and answered + before == len(lines), printed
    results = _results(output)
    assert sorted(r["custom_id"] for r in results) == sorted(json.loads(line)["custom_id"] for line in lines)
    assert [r for r in results if r["response"]["status_code"] != 200] == []
    assert not parts.exists()
