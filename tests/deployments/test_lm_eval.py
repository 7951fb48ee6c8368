"""lm-eval-harness as a client: its `local-completions` model against the app served over
real HTTP (uvicorn on 127.0.0.1) scores a small multiple-choice task from a local file, and
every choice's log-likelihood (so the accuracy) equals what lm-eval's own HF backend
computes for the same tiny OPT and task."""

from __future__ import annotations

import json

import pytest

from rayserve_paged.config import EngineConfig
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.llm_engine import LLMEngine
from tests.deployments.conftest import MODEL, served_over_http
from tests.deployments.engine_client import InProcessEngineClient

TASK = "tiny_mc"
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
DOCS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin"], 0),
    ("The quick brown fox jumps over the", [" lazy dog", " moon", " fence"], 0),
    ("Two plus two equals", [" four", " five", " twenty two"], 0),
    ("Water boils at one hundred degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
    ("The sun rises in the", [" east", " west", " north", " south"], 0),
    ("Hello world, said the", [" program", " cat", " old man by the sea"], 1),
    ("A week has seven", [" days", " hours"], 0),
    ("The opposite of hot is", [" cold", " warm", " wet"], 0),
    ("Bees make", [" honey", " milk", " bread and butter"], 0),
]


@pytest.fixture(scope="module")
def completions_url(tiny_opt_path):
    """/v1/completions of the OpenAI app over an in-process engine, served by uvicorn."""
    engine = LLMEngine(EngineConfig(model=tiny_opt_path, device="cpu", max_model_len=128, num_gpu_blocks_override=64,
                                    swap_space_gb=0.01, max_logprobs=5))  # fmt: skip
    app = create_openai_app(InProcessEngineClient(engine, MODEL), engine.tokenizer, MODEL)
    with served_over_http(app) as url:
        yield f"{url}/v1/completions"
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    root = tmp_path_factory.mktemp("lm-eval-task")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    (root / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return TaskManager(include_path=str(root), include_defaults=False)  # only this task: indexing all costs seconds


@pytest.fixture(scope="module")
def evaluate(task_manager, tmp_path_factory):
    import lm_eval

    cache = tmp_path_factory.mktemp("hf-datasets")

    def run(model: str, model_args: dict) -> dict:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("HF_DATASETS_CACHE", str(cache))
            env.setenv("HF_DATASETS_OFFLINE", "1")
            env.setenv("HF_HUB_OFFLINE", "1")
            return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=task_manager,
                                           batch_size=4, bootstrap_iters=0, log_samples=True)  # fmt: skip

    return run


def _loglikelihoods(results: dict) -> dict[int, list[tuple[float, bool]]]:
    """doc id -> each choice's (log-likelihood, is greedy)."""
    return {s["doc_id"]: [tuple(r[0]) for r in s["resps"]] for s in results["samples"][TASK]}


def test_local_completions_scores_equal_the_hf_backend(completions_url, tiny_opt_path, evaluate):
    served = evaluate("local-completions", {
        "model": MODEL, "base_url": completions_url, "tokenizer": tiny_opt_path, "tokenizer_backend": "huggingface",
        "add_bos_token": True,  # as the HF backend encodes with this tokenizer (it prepends <s>)
        "max_retries": 1,  # an error response fails the run instead of being retried
    })  # fmt: skip
    hf = evaluate("hf", {"pretrained": tiny_opt_path, "dtype": "float32", "device": "cpu"})
    ours, theirs = _loglikelihoods(served), _loglikelihoods(hf)
    assert sorted(ours) == list(range(len(DOCS))) and sorted(theirs) == list(range(len(DOCS)))
    for doc_id, (_, choices, _) in enumerate(DOCS):
        assert len(ours[doc_id]) == len(choices) == len(theirs[doc_id])
        for (ll, greedy), (hf_ll, hf_greedy) in zip(ours[doc_id], theirs[doc_id]):
            assert abs(ll - hf_ll) < 1e-3, (doc_id, ours[doc_id], theirs[doc_id])
            assert greedy == hf_greedy
    acc = served["results"][TASK]["acc,none"]
    assert acc == hf["results"][TASK]["acc,none"]
    picks = [max(range(len(lls)), key=lambda i: lls[i][0]) for lls in (theirs[d] for d in range(len(DOCS)))]
    assert acc == sum(pick == answer for pick, (_, _, answer) in zip(picks, DOCS)) / len(DOCS)
