"""The serving benchmark's pure parts on synthetic data (exact values), and one quick run
against the OpenAI app over an in-process tiny engine, served by uvicorn on 127.0.0.1 in a
thread (no Ray). Never its speed."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from benchmarks import serving
from benchmarks.metrics import latency_summary, percentile
from benchmarks.serving import (
    QUICK,
    RequestResult,
    RunSpec,
    SSEDecoder,
    StreamTracker,
    Workload,
    arrival_times,
    cpu_delta,
    make_requests,
    summarize,
)
from rayserve_paged import cli

SERVED_NAME = "tiny-serving-test"


# ---------------------------------------------------------------------------- SSE


def test_sse_decoder_yields_each_event_data_at_its_blank_line():
    lines = [
        ": a comment",
        'data: {"a": 1}',
        "",
        "event: message",
        "data: first line\r",
        "data:second line",
        "id: 7",
        "",
        "",
        "data: [DONE]",
        "",
    ]
    decoder = SSEDecoder()
    assert [p for line in lines if (p := decoder.feed(line)) is not None] == [
        '{"a": 1}',
        "first line\nsecond line",
        "[DONE]",
    ]
    assert decoder.flush() is None


def test_sse_decoder_flush_returns_an_event_cut_off_by_the_end():
    decoder = SSEDecoder()
    assert decoder.feed("data: [DONE]") is None
    assert decoder.flush() == "[DONE]"


def _chunk(text: str) -> str:
    return json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": text}], "usage": None})


def _usage(completion_tokens: int) -> str:
    usage = {"prompt_tokens": 5, "completion_tokens": completion_tokens, "total_tokens": 5 + completion_tokens}
    return json.dumps({"object": "text_completion", "choices": [], "usage": usage})


def test_stream_tracker_times_first_choice_and_done_and_counts_usage_tokens():
    tracker = StreamTracker(prompt_len=5, output_len=3)
    for payload, t in ((_chunk(" a"), 0.5), (_chunk(" b"), 0.75), (_chunk(" c"), 0.875), (_usage(3), 0.9375),
                       ("[DONE]", 1.0)):  # fmt: skip
        tracker.on_event(payload, t)
    r = tracker.finish()
    assert r.is_ok and r.error is None
    assert (r.ttft_s, r.e2e_s, r.num_output_tokens) == (0.5, 1.0, 3)
    assert r.tpot_s == 0.25  # (1.0 - 0.5) / (3 - 1)
    assert r.itl_s == [0.25, 0.125]  # between the choice events only (not usage, not [DONE])


def test_stream_tracker_counts_choice_events_without_a_usage_event():
    tracker = StreamTracker(prompt_len=5, output_len=2)
    for payload, t in ((_chunk(" a"), 0.25), (_chunk(" b"), 0.5), ("[DONE]", 0.75)):
        tracker.on_event(payload, t)
    r = tracker.finish()
    assert r.is_ok and r.num_output_tokens == 2 and r.tpot_s == 0.5


@pytest.mark.parametrize(
    "payloads, error",
    [
        ([_chunk(" a"), json.dumps({"error": {"message": "engine down"}}), "[DONE]"], "error event: engine down"),
        ([_chunk(" a"), _usage(1)], "the stream ended without [DONE]"),
        ([_usage(0), "[DONE]"], "no choice in the stream"),
        (["{not json", "[DONE]"], "not JSON: '{not json'"),
    ],
)
def test_stream_tracker_failures(payloads, error):
    tracker = StreamTracker(prompt_len=5, output_len=1)
    for i, payload in enumerate(payloads):
        tracker.on_event(payload, 0.1 * (i + 1))
    r = tracker.finish()
    assert not r.is_ok and r.error == error and r.tpot_s is None


# ---------------------------------------------------------------------------- statistics


def test_percentile_interpolates_linearly_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    values = [float(v) for v in range(101)]
    assert percentile(values, 99) == 99.0 and percentile(values, 25) == 25.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([0.0, 10.0], 99) == 9.9
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_matches_numpy_on_random_data():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    for n in (2, 3, 17, 100):
        values = rng.exponential(size=n).tolist()
        for q in (50, 90, 99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_latency_summary():
    assert latency_summary([1.0, 2.0, 6.0]) == {"mean": 3.0, "median": 2.0, "p99": 5.92}
    assert latency_summary([]) == {"mean": None, "median": None, "p99": None}


def test_summarize_counts_only_completed_requests():
    results = [
        RequestResult(True, prompt_len=10, output_len=4, num_output_tokens=4, ttft_s=0.5, e2e_s=2.0),
        RequestResult(True, prompt_len=20, output_len=3, num_output_tokens=2, ttft_s=1.5, e2e_s=2.5),
        RequestResult(False, prompt_len=30, output_len=8, error="HTTP 500: boom"),
    ]
    s = summarize(results, duration_s=4.0)
    assert (s["num_requests"], s["num_completed"], s["num_failures"]) == (3, 2, 1)
    assert s["num_length_mismatches"] == 1
    assert (s["num_prompt_tokens"], s["num_output_tokens"]) == (30, 6)
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == 1.5
    assert s["ttft_s"]["mean"] == 1.0 and s["ttft_s"]["median"] == 1.0
    assert s["tpot_s"]["mean"] == 0.75  # (1.5 / 3 + 1.0 / 1) / 2
    assert s["e2e_s"]["median"] == 2.25
    assert s["errors"] == ["HTTP 500: boom"]


def test_cpu_delta_sums_per_label_and_counts_new_processes():
    before = {(1, 100): ("raylet", 2.0), (2, 200): ("ray::WorkerActor", 10.0)}
    after = {(1, 100): ("raylet", 2.5), (2, 200): ("ray::WorkerActor", 14.0), (3, 300): ("ray::WorkerActor", 1.0)}
    assert cpu_delta(before, after) == {"ray::WorkerActor": 5.0, "raylet": 0.5}


def test_compare_against_the_mean_of_the_bracketing_in_process_runs():
    in_process = [{"output_throughput": 100.0, "num_output_tokens": 1000, "cpu_seconds": 10.0},
                  {"output_throughput": 60.0, "num_output_tokens": 1000, "cpu_seconds": 12.0}]  # fmt: skip
    http = {"output_throughput": 64.0, "num_output_tokens": 1000,
            "cpu_seconds": {"ray::WorkerActor": 11.0, "ray::ProxyActor": 4.0, "load client (this process)": 1.0}}
    c = serving.compare(in_process, http)
    assert c["in_process_output_throughput"] == 80.0
    assert c["http_over_in_process"] == 0.8 and c["target_met"] is True
    assert c["http_over_each_in_process_run"] == [0.64, 64.0 / 60.0]
    assert c["cpu_seconds_per_1k_output_tokens"] == {"in_process": 11.0, "http": 16.0}
    assert serving.compare(in_process, {**http, "output_throughput": 63.0})["target_met"] is False


# ---------------------------------------------------------------------------- workload and schedule


def test_arrival_times_are_seeded_poisson_with_mean_gap_one_over_rate():
    times = arrival_times(20_000, rate=4.0, seed=0)
    assert times == arrival_times(20_000, rate=4.0, seed=0)
    assert times != arrival_times(20_000, rate=4.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 0.25) < 0.25 * 0.03
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert abs(std - 0.25) < 0.25 * 0.05  # exponential: std = mean


def test_every_rate_replays_the_same_schedule_scaled():
    assert arrival_times(50, rate=2.0, seed=3) == [2 * t for t in arrival_times(50, rate=4.0, seed=3)]
    assert arrival_times(5, rate=math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, rate=0.0, seed=0)


def test_requests_are_seeded_with_lengths_in_range():
    workload = Workload(num_requests=200, min_prompt_len=3, max_prompt_len=9, min_output_len=2, max_output_len=5)
    requests = make_requests(workload, seed=0)
    assert requests == make_requests(workload, seed=0)
    assert {len(r.prompt_token_ids) for r in requests} == set(range(3, 10))
    assert {r.output_len for r in requests} == set(range(2, 6))
    assert all(serving.FIRST_TOKEN_ID <= t < serving.TOKEN_ID_LIMIT for r in requests for t in r.prompt_token_ids)


def test_token_id_range_is_the_tiny_tokenizers_non_special_ids():
    from rayserve_paged.models.tiny import SPECIAL_TOKENS, TINY_VOCAB_SIZE

    assert (serving.FIRST_TOKEN_ID, serving.TOKEN_ID_LIMIT) == (len(SPECIAL_TOKENS), TINY_VOCAB_SIZE)


def test_run_specs_defaults_and_the_comparison_run():
    specs = serving.run_specs(None, None, compare=False)
    assert [s.name for s in specs] == ["1 req/s", "2 req/s", "4 req/s", "C=16"]
    specs = serving.run_specs([4.0, 1.0], None, compare=True)
    assert [s.name for s in specs] == ["all at once", "1 req/s", "4 req/s"]
    assert [s.mode for s in specs] == ["all-at-once", "poisson", "poisson"]
    assert serving.run_specs([math.inf], [8], compare=True) == [RunSpec(math.inf), RunSpec(math.inf, 8)]


def test_small_opt_config_is_valid_app_args_with_the_same_engine_options(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 512}))
    config = serving.small_opt_config(str(tmp_path), serving.FULL, threads=2, seed=0)
    config = serving.with_http_port(config, 12345)
    assert config["http_options"] == {"host": "127.0.0.1", "port": 12345}
    args = config["applications"][0]["args"]
    cpus = (args["worker_cpus"], args["scheduler_cpus"], args["ray_actor_options"]["num_cpus"])
    assert args["num_replicas"] == 1 and cpus == (1.0, 0.1, 0.1)
    assert "autoscaling_config" not in args
    options = serving.engine_options(config)
    assert options["model"] == str(tmp_path) and options["num_cpu_threads"] == 2
    assert options["kv_cache_memory_gb"] == args["kv_cache_memory_gb"] > 0


def test_ceiling_launch_is_a_one_layer_opt_of_hidden_16_with_256_streams_of_256_tokens(tmp_path):
    config, shape = serving._launch_config(serving.CEILING, str(tmp_path), serving.CEILING_WORKLOAD, 1, 0)
    assert (shape["num_hidden_layers"], shape["hidden_size"]) == (1, 16)
    model_dir = config["applications"][0]["args"]["model"]
    assert json.loads((tmp_path / serving.CEILING / "config.json").read_text())["hidden_size"] == 16
    assert model_dir.endswith(serving.CEILING)
    requests = serving.make_requests(serving.CEILING_WORKLOAD, 0)
    assert len(requests) == 256 and {r.output_len for r in requests} == {256}
    specs = serving.run_specs(None, list(serving.CEILING_CONCURRENCY), compare=True)
    assert [s.name for s in specs] == ["all at once", "C=16", "C=64"]


# ---------------------------------------------------------------------------- a quick run over HTTP


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    """create_openai_app over an in-process tiny engine, served by uvicorn on 127.0.0.1."""
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.deployments.openai_ingress import create_openai_app
    from rayserve_paged.engine.llm_engine import LLMEngine
    from rayserve_paged.models.tiny import make_tiny_model
    from tests.deployments.conftest import served_over_http
    from tests.deployments.engine_client import InProcessEngineClient

    path = make_tiny_model("opt", tmp_path_factory.mktemp("serving-opt"))
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=128, num_gpu_blocks_override=64,
                                    swap_space_gb=0.01, num_cpu_threads=1))  # fmt: skip
    app = create_openai_app(InProcessEngineClient(engine, SERVED_NAME), engine.tokenizer, SERVED_NAME)
    with served_over_http(app) as url:
        yield url


@pytest.fixture(scope="module")
def quick_run(fake_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-serving")
    argv = ["bench", "serving", "--url", fake_server, "--rate", "20", "--rate", "inf", "--max-concurrency", "2",
            "--quick", "--seed", "0", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    return out, json.loads((out / "serving.json").read_text())


def test_serving_is_registered():
    assert cli.BENCHMARKS["serving"] == "benchmarks.serving"


def test_quick_run_writes_json_and_png(quick_run):
    out, _ = quick_run
    assert (out / "serving.png").read_bytes().startswith(b"\x89PNG")


def test_quick_run_json_has_every_figure_per_run(quick_run):
    _, result = quick_run
    assert [r["name"] for r in result["runs"]] == ["20 req/s", "all at once", "C=2"]
    expected_tokens = sum(r.output_len for r in make_requests(QUICK, seed=0))
    for run in result["runs"]:
        assert run["num_requests"] == run["num_completed"] == QUICK.num_requests, run["errors"]
        assert run["num_failures"] == 0 and run["num_length_mismatches"] == 0
        assert run["num_output_tokens"] == expected_tokens  # ignore_eos: exactly max_tokens each
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            figures = run[key]
            assert set(figures) == {"mean", "median", "p99"}
            assert 0 < figures["median"] <= figures["p99"]
        assert run["ttft_s"]["median"] <= run["e2e_s"]["median"]
        assert len(run["loadavg_before"]) == len(run["loadavg_after"]) == 3
    assert result["runs"][0]["request_rate"] == 20 and result["runs"][2]["max_concurrency"] == 2
    assert result["in_process"] is None


def test_quick_run_records_the_config(quick_run, fake_server):
    _, result = quick_run
    config = result["config"]
    assert config["model"] == SERVED_NAME and config["url"] == fake_server
    assert config["workload"] == {"num_requests": 6, "min_prompt_len": 4, "max_prompt_len": 16,
                                  "min_output_len": 2, "max_output_len": 8}  # fmt: skip
    assert config["seed"] == 0 and config["quick"] is True
    assert "uniform" in config["length_distribution"] and "Poisson" in config["arrivals"]


def test_a_rejected_request_is_a_failure(fake_server):
    async def send():
        async with serving.make_client(4, 30.0) as client:
            return await serving.send_request(client, fake_server, "no-such-model", make_requests(QUICK, 0)[0], 30.0)

    r = asyncio.run(send())
    assert not r.is_ok and r.error.startswith("HTTP 404")


def test_compare_in_process_needs_launch(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["bench", "serving", "--url", "http://127.0.0.1:1", "--compare-in-process", "--out", str(tmp_path)])


def test_launch_options_reach_the_config_and_the_cluster_environment(tmp_path):
    from benchmarks.serving import LaunchedServer, _parser, with_app_args

    args = _parser().parse_args(["--launch", "ceiling", "--out", str(tmp_path), "--direct-ingress",
                                 "--stream-interval", "4", "--serve-env", "RAY_SERVE_X=1", "--serve-env", "Y=a=b"])  # fmt: skip
    assert args.serve_env == [("RAY_SERVE_X", "1"), ("Y", "a=b")] and args.stream_interval == 4
    with pytest.raises(SystemExit):
        _parser().parse_args(["--launch", "ceiling", "--out", str(tmp_path), "--serve-env", "NOVALUE"])
    config = {"applications": [{"name": "llm", "args": {"model": "m"}}]}
    assert with_app_args(config, stream_interval=4)["applications"][0]["args"] == {"model": "m", "stream_interval": 4}
    assert config["applications"][0]["args"] == {"model": "m"}  # the given config is left alone
    server = LaunchedServer(config, tmp_path, serve_env=dict(args.serve_env), direct_ingress=True)
    pinned = server.env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]
    assert server.env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and server.env["RAY_SERVE_X"] == "1"
    assert server.base_url == f"http://127.0.0.1:{pinned}"  # the load goes to the replica, not the proxy
    assert server.config["http_options"]["port"] != int(pinned)
