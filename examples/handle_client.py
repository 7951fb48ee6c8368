"""Call a running rayserve-paged app through Serve handles (start it first: `make run`).

    .venv/bin/python examples/handle_client.py
"""

from __future__ import annotations

import asyncio

import ray
from ray import serve

from rayserve_paged import SamplingParams


async def main() -> None:
    # the LLMServer deployment of the app named "llm" in configs/tiny.yaml
    llm = serve.get_deployment_handle("LLMServer", app_name="llm")
    params = SamplingParams(temperature=0.0, max_tokens=16)

    # one call, the whole output
    out = await llm.generate.remote("The paged KV cache stores", params)
    print("generate:", repr(out.outputs[0].text), out.outputs[0].finish_reason)

    # streaming: deltas, one per engine step (what is new since the previous one); join them
    text = ""
    async for delta in llm.options(stream=True).generate_stream.remote("Once upon a time", params):
        for choice in delta.outputs:
            text += choice.text
            print("stream: +", choice.token_ids, repr(choice.text), choice.finish_reason or "")
    print("stream, joined:", repr(text))

    # many concurrent calls share the engine's batches
    outs = await asyncio.gather(*[llm.generate.remote(f"request {i}", params) for i in range(8)])
    print("concurrent:", [len(o.outputs[0].token_ids) for o in outs])


if __name__ == "__main__":
    ray.init(address="auto")
    asyncio.run(main())
