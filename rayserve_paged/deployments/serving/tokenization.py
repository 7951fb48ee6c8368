"""/tokenize and /detokenize over the generation pipeline's tokenizer pool (a conversation
is rendered by the chat route's template)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from rayserve_paged.deployments.errors import bad_request
from rayserve_paged.deployments.protocol import RequestModel, check_unicode
from rayserve_paged.deployments.serving.chat import ChatCompletionRequest, ChatMessage, ChatServing
from rayserve_paged.deployments.serving.pipeline import GenerationPipeline


# --------------------------------------------------------------------------- request and response models


class TokenizeRequest(RequestModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the chat template."""

    model: str | None = Field(None, description="The served model name; omitted = the served model.")
    prompt: str | None = Field(None, description="Text to tokenize (give this or messages).")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A conversation, rendered by the chat template."
    )
    add_special_tokens: bool = Field(True, description="With prompt: add the tokenizer's special tokens (BOS).")
    add_generation_prompt: bool = Field(True, description="With messages: end with the assistant's turn opening.")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if self.prompt is not None:
            check_unicode(self.prompt)
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    """POST /detokenize (vLLM's)."""

    model: str | None = Field(None, description="The served model name; omitted = the served model.")
    tokens: list[int] = Field(description="Token ids to turn into text.")


class DetokenizeResponse(BaseModel):
    prompt: str


# --------------------------------------------------------------------------- the routes


class TokenizationServing:
    def __init__(self, pipeline: GenerationPipeline, chat: ChatServing) -> None:
        self.pipeline = pipeline
        self.chat = chat

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        pipeline = self.pipeline
        await pipeline.check_model(request.model)
        info = await pipeline.model_info()
        if request.messages is not None:
            conversation = ChatCompletionRequest(messages=request.messages)
            prompt = await pipeline.in_pool(lambda: self.chat.render(conversation, request.add_generation_prompt))
            token_ids = prompt.token_ids
        else:
            text, add_special = request.prompt, request.add_special_tokens
            token_ids = await pipeline.in_pool(lambda: pipeline.encode(text, "prompt", add_special))
        field = "messages" if request.messages is not None else "prompt"
        if len(token_ids) > info["max_model_len"]:  # capped like a prompt (vLLM's /tokenize too)
            raise bad_request(
                f"{field}: {len(token_ids)} tokens, more than this model's maximum context length of "
                f"{info['max_model_len']} tokens",
                param=field,
            )
        return TokenizeResponse(count=len(token_ids), max_model_len=info["max_model_len"], tokens=token_ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        pipeline = self.pipeline
        await pipeline.check_model(request.model)
        info = await pipeline.model_info()
        vocab_size = info.get("vocab_size")
        bad = next((t for t in request.tokens if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab_size})")
        return DetokenizeResponse(prompt=await pipeline.in_pool(lambda: pipeline.tokenizer.decode(request.tokens)))
