"""/tokenize and /detokenize over the generation pipeline's tokenizer pool (a conversation
is rendered by the chat route's template)."""

from __future__ import annotations

from rayserve_paged.deployments.errors import bad_request
from rayserve_paged.deployments.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from rayserve_paged.deployments.serving.chat import ChatServing
from rayserve_paged.deployments.serving.pipeline import GenerationPipeline


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
