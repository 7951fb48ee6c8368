"""The README's `client.responses.create` call: SmolLM2-135M-Instruct as `make run` serves it
(configs/smollm2.yaml's engine, in this process), answering through /v1/responses with the
official openai client (one call: the model costs seconds; the tiny model's tests hold the
stream to the plain answer)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import yaml

from rayserve_paged.app import AppArgs, engine_config_of
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.llm_engine import LLMEngine
from tests.deployments.conftest import asgi_client, idle_client

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CONFIG = Path(__file__).parents[2] / "configs" / "smollm2.yaml"
ANSWER = "The capital of France is Paris."  # as tests/serve/test_serve_smollm2.py has it over chat completions


@pytest.fixture(scope="module")
def smollm2():
    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    return LLMEngine(engine_config_of(AppArgs(**app["args"])))


async def test_smollm2_answers_through_responses(smollm2):
    async with idle_client(smollm2) as engine_client:
        app = create_openai_app(engine_client, smollm2.tokenizer, "smollm2")
        async with asgi_client(app) as transport:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=transport)
            response = await client.responses.create(
                model="smollm2", input="What is the capital of France?", max_output_tokens=24, temperature=0
            )
            assert (response.output_text, response.status) == (ANSWER, "completed")
            assert response.usage.output_tokens == 8 and response.output[0].type == "message"
