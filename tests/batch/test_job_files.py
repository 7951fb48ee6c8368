"""The batch job's files without Ray: the OpenAI batch line, the parts committed by rename
(a restart reads them back, a cut-short commit is discarded, another input is refused),
the output in input order, and the command's config (a Serve config's engine options)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rayserve_paged.app import AppArgs
from rayserve_paged.batch.format import LineError, output_line, parse_line
from rayserve_paged.batch.job import PartStore, read_lines
from rayserve_paged.cli import batch_config

ROOT = Path(__file__).resolve().parents[2]
URLS = ("/v1/chat/completions", "/v1/completions")


def _line(**fields) -> str:
    return json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}} | fields)


@pytest.mark.parametrize(
    "text, field, custom_id",
    [
        ("{oops", "invalid JSON line", None),
        (None, "invalid JSON line: not UTF-8", None),
        ("[1, 2]", "a batch line is a JSON object", None),
        (_line(custom_id=""), "custom_id:", None),
        (_line(custom_id=7), "custom_id:", None),
        (_line(method="GET"), "method:", "a"),
        (_line(url="/v1/embeddings"), "url:", "a"),
        (_line(body=[1]), "body:", "a"),
        (_line(body="{no"), "body: invalid JSON", "a"),
    ],
)
def test_a_line_that_is_not_a_request_names_what_is_wrong(text, field, custom_id):
    with pytest.raises(LineError) as raised:
        parse_line(text, URLS)
    assert str(raised.value).startswith(field) and raised.value.custom_id == custom_id


def test_a_request_line_and_its_result_line():
    assert parse_line(_line(), URLS) == ("a", "/v1/completions", {"prompt": "x"})
    assert parse_line(_line(body='{"prompt": "y"}'), URLS)[2] == {"prompt": "y"}  # a body column as JSON text
    result = json.loads(output_line("a", 200, '{"id":"cmpl-1","logprob":null}'))
    assert result["custom_id"] == "a" and result["error"] is None
    assert result["response"]["status_code"] == 200 and result["response"]["body"] == {"id": "cmpl-1", "logprob": None}
    assert result["id"].startswith("batch_req_") and result["response"]["request_id"].startswith("req_")
    assert json.loads(output_line(None, 400, "{}"))["custom_id"] is None


def test_read_lines_skips_blank_lines_and_keeps_positions(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \n\xff\xfe\n{"b": 2}')
    lines, digest = read_lines(path)
    assert lines == [(0, '{"a": 1}'), (3, None), (4, '{"b": 2}')]
    assert len(digest) == 64


def test_parts_survive_a_restart_and_the_output_keeps_input_order(tmp_path):
    output = tmp_path / "out.jsonl"
    store = PartStore(output, "digest-1", commit_rows=2, commit_interval_s=1e9)
    assert store.add(5, "five") and store.add(1, "one") and not store.add(5, "again")
    assert store.is_commit_due()
    store.commit()
    store.add(3, "three")
    assert not store.is_commit_due()  # one line pending: lost if the job stops now
    folder = tmp_path / "out.jsonl.parts"
    (folder / "part-000002.arrow.tmp").write_bytes(b"cut short")
    again = PartStore(output, "digest-1", commit_rows=2, commit_interval_s=1e9)
    assert again.done == {1, 5}
    assert not (folder / "part-000002.arrow.tmp").exists()
    with pytest.raises(ValueError, match="another input file"):
        PartStore(output, "digest-2", commit_rows=2, commit_interval_s=1e9)
    again.add(3, "three")
    again.add(0, "zero")
    again.commit()
    again.finish()
    assert output.read_text() == "zero\none\nthree\nfive\n"
    assert not folder.exists()


def _args(**flags) -> argparse.Namespace:
    defaults = {"config": None, "engine": [], "concurrency": "1", "batch_size": None, "max_concurrent_batches": None,
                "max_retries": None, "worker_cpus": None}  # fmt: skip
    return argparse.Namespace(**(defaults | flags))


def test_the_command_takes_a_serve_configs_engine_and_its_flags():
    config = batch_config(_args(config=str(ROOT / "configs" / "smollm2.yaml"), concurrency="1,3", batch_size=32,
                                engine=["num_cpu_threads=1", "max_num_seqs=64"]))  # fmt: skip
    import yaml

    (app,) = yaml.safe_load((ROOT / "configs" / "smollm2.yaml").read_text())["applications"]
    args = AppArgs.model_validate(app["args"])
    assert config.engine.model == "smollm2" and config.engine.kv_cache_memory_gb == args.kv_cache_memory_gb
    assert config.engine.num_cpu_threads == 1 and config.engine.max_num_seqs == 64
    assert config.worker_cpus == args.worker_cpus
    assert config.pool_size == (1, 3) and config.batch_size == 32
    laptop = batch_config(_args())
    assert laptop.engine.model == "smollm2" and laptop.engine.device == "cpu" and laptop.pool_size == (1, 1)
    with pytest.raises(ValueError, match="concurrency"):
        batch_config(_args(concurrency="3,1"))
