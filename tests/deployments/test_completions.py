"""/v1/completions against a real engine on the tiny OPT (non-streaming and streaming)."""

from __future__ import annotations

import pytest

from rayserve_paged import SamplingParams
from tests.deployments.conftest import MODEL, parse_sse

pytestmark = pytest.mark.anyio

PROMPT = "Hello world"
GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}


async def complete(http, **body) -> dict:
    response = await http.post("/v1/completions", json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_string_prompt_matches_the_engine_with_exact_usage(http, engine, engine_client):
    body = await complete(http, prompt=PROMPT, max_tokens=6)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    (choice,) = body["choices"]
    direct = await engine_client.generate(
        engine.tokenizer(PROMPT).input_ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "direct"
    )
    assert choice["text"] == direct.outputs[0].text
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    num_prompt = len(engine.tokenizer(PROMPT).input_ids)
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 6,
        "total_tokens": num_prompt + 6,
        "prompt_tokens_details": None,  # cached_tokens are reported only when enabled
    }


async def test_token_id_prompts_equal_their_text(http, engine):
    ids = engine.tokenizer(PROMPT).input_ids
    text = (await complete(http, prompt=PROMPT, max_tokens=5))["choices"][0]["text"]
    assert (await complete(http, prompt=ids, max_tokens=5))["choices"][0]["text"] == text
    batch = await complete(http, prompt=[ids, ids[:3]], max_tokens=5)
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["choices"][0]["text"] == text
    assert batch["usage"]["prompt_tokens"] == len(ids) + 3


async def test_list_of_prompts_with_n_indexes_choices_by_prompt(http, engine):
    prompts = ["Hello world", "The quick brown fox"]
    body = await complete(http, prompt=prompts, n=2, temperature=1.0, seed=7, max_tokens=4)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    num_prompt = sum(len(engine.tokenizer(p).input_ids) for p in prompts)  # each prompt once, whatever n
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 16,
        "total_tokens": num_prompt + 16,
        "prompt_tokens_details": None,  # cached_tokens are reported only when enabled
    }
    # choices 2 and 3 belong to the second prompt: the same as asking for it alone
    alone = await complete(http, prompt=prompts[1], n=2, temperature=1.0, seed=7, max_tokens=4)
    assert [c["text"] for c in body["choices"][2:]] == [c["text"] for c in alone["choices"]]


async def test_logprobs_in_openai_completions_format(http):
    body = await complete(http, prompt=PROMPT, max_tokens=5, logprobs=2)
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    tokens = logprobs["tokens"]
    assert len(tokens) == 5 == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0
    for i, (token, logprob, top) in enumerate(zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"])):
        assert logprob <= 0 and top[token] == logprob
        assert 2 <= len(top) <= 3  # the two most likely and the sampled token
        assert logprob == max(top.values())  # greedy: the sampled token is the most likely
        if i:
            assert logprobs["text_offset"][i] == logprobs["text_offset"][i - 1] + len(tokens[i - 1])


async def test_echo_puts_the_prompt_first(http, engine):
    plain = (await complete(http, prompt=PROMPT, max_tokens=4))["choices"][0]["text"]
    assert (await complete(http, prompt=PROMPT, max_tokens=4, echo=True))["choices"][0]["text"] == PROMPT + plain
    ids = engine.tokenizer(PROMPT).input_ids
    echoed = (await complete(http, prompt=ids, max_tokens=4, echo=True))["choices"][0]["text"]
    assert echoed == engine.tokenizer.decode(ids, skip_special_tokens=True) + plain


async def test_stop_strings_cut_the_text(http):
    full = (await complete(http, prompt=PROMPT, max_tokens=24))["choices"][0]["text"]
    stop = full[6:8]
    at = full.find(stop)
    (choice,) = (await complete(http, prompt=PROMPT, max_tokens=24, stop=[stop, "never-seen"]))["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (full[:at], "stop", stop)
    kept = (await complete(http, prompt=PROMPT, max_tokens=24, stop=stop, include_stop_str_in_output=True))
    assert kept["choices"][0]["text"] == full[: at + len(stop)]
    # streamed, the text held back as a possible stop-string start never leaks out
    streamed = await http.post(
        "/v1/completions", json={**GREEDY, "prompt": PROMPT, "max_tokens": 24, "stop": stop, "stream": True}
    )
    assert "".join(e["choices"][0]["text"] for e in parse_sse(streamed)) == full[:at]


async def test_seed_reproduces_a_sample(http):
    sample = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 1234}
    first = await complete(http, **sample)
    again = await complete(http, **sample)
    other = await complete(http, **{**sample, "seed": 99})
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert first["choices"][0]["text"] != other["choices"][0]["text"]


async def test_stream_deltas_add_up_to_the_non_stream_text(http):
    prompts = ["Hello world", "The quick brown fox"]
    expected = await complete(http, prompt=prompts, max_tokens=10)
    response = await http.post("/v1/completions", json={**GREEDY, "prompt": prompts, "max_tokens": 10, "stream": True})
    events = parse_sse(response)
    texts = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for event in events:
        assert event["id"].startswith("cmpl-") and event["object"] == "text_completion"
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert len({e["id"] for e in events}) == 1
    assert [texts[0], texts[1]] == [c["text"] for c in expected["choices"]]
    assert finishes == {0: ["length"], 1: ["length"]}
    assert all(e["usage"] is None for e in events)


async def test_stream_include_usage_ends_with_a_usage_chunk(http):
    body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 1}
    expected = await complete(http, **body)
    response = await http.post(
        "/v1/completions", json={**GREEDY, **body, "stream": True, "stream_options": {"include_usage": True}}
    )
    *chunks, last = parse_sse(response)
    assert last["choices"] == [] and last["usage"] == expected["usage"]
    assert all(c["usage"] is None for c in chunks)
    streamed_tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed_tokens == expected["choices"][0]["logprobs"]["tokens"]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == expected["choices"][0]["logprobs"]["text_offset"]


async def test_stream_echo_comes_first(http):
    response = await http.post(
        "/v1/completions", json={**GREEDY, "prompt": PROMPT, "max_tokens": 3, "echo": True, "stream": True}
    )
    events = parse_sse(response)
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == (await complete(http, prompt=PROMPT, max_tokens=3, echo=True))["choices"][0]["text"]
