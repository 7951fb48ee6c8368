"""The OpenAI routes' logic, independent of FastAPI wiring: one module per route family
over one generation pipeline.

    pipeline.py      validate -> tokenize (the replica's pool) -> engine requests -> the
                     response body or its SSE events; model info and /v1/models
    completions.py   /v1/completions
    chat.py          /v1/chat/completions (chat templates, tool calls)
    responses.py     /v1/responses over the chat route (input items, typed events), and
                     its stored responses (response_store.py)
    tokenization.py  /tokenize, /detokenize
    logprobs.py      each token's text and bytes for logprobs
"""
