"""openai-agents with its default model (OpenAIResponsesModel, over /v1/responses) runs an
agent with a function tool to its final output, against the tiny model. The first turn is
forced to call the tool (tool_choice "required"; the SDK resets it to auto afterwards, as it
does by default), the second answers from the tool's output in the agent's output type (a
json_schema text format: the random-weight model finishes only under a constraint)."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.deployments.conftest import MODEL, asgi_client

agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.anyio


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


async def test_an_agent_with_a_function_tool_reaches_its_final_output(hermes_app):
    app = hermes_app  # the SDK sends tool_choice "auto" after the first turn: a parser reads it
    import openai
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider

    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    seen = []

    async def record(request):
        if request.url.path == "/v1/responses":
            seen.append(json.loads(request.content))

    async with asgi_client(app, event_hooks={"request": [record]}) as transport:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=transport, max_retries=0)
        agent = Agent(name="forecaster", instructions="Answer with the weather.", tools=[get_weather], model=MODEL,
                      output_type=Forecast,
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=56,
                                                   temperature=0))
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
        result = await Runner.run(agent, "Weather in Paris?", run_config=config, max_turns=3)
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    assert isinstance(result.final_output, Forecast)
    (message,) = result.raw_responses[-1].output
    assert result.final_output == Forecast.model_validate_json(message.content[0].text)
    first, second = seen
    assert first["tool_choice"] == "required" and "tool_choice" not in second  # reset to auto after the call
    (output,) = [item for item in second["input"] if item.get("type") == "function_call_output"]
    assert output["output"] == f"sunny in {calls[0]}"
