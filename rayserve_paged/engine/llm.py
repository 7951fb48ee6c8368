"""Offline batch generation without Serve: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.lora import LoRARequest
from rayserve_paged.core.sequence import PoolingParams, SamplingParams, StructuredOutputsParams
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.engine.output_processor import OutputProcessor
from rayserve_paged.engine.pooling import checkpoint_pooling
from rayserve_paged.engine.outputs import RequestOutput
from rayserve_paged.engine.tool_calls import ToolSet, forced_calls, forced_schema
from rayserve_paged.engine.tool_parsers import parse_tool_calls

PromptLike = str | list[int] | dict


class LLM:
    """An engine in this process. Engine options are EngineConfig's fields."""

    def __init__(self, model: str = "tiny-opt", **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.processor = OutputProcessor(self.engine.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptLike | Seq[PromptLike] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": ...}.
        `lora_request` runs every prompt on one LoRA adapter, or each on its own (a list,
        None for the base model); an adapter not yet registered is checked and registered.
        """
        items = _normalise_prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Seq) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Seq) else [lora_request] * len(items)
        if len(loras) != len(items):
            raise ValueError(f"lora_request: {len(loras)} given for {len(items)} prompts")
        # grammars compiled first (each distinct one once): a bad constraint adds nothing
        grammars = [self.engine.compile_constraint(p) for p in params]
        order = {}
        for (text, token_ids), p, lora, grammar in zip(items, params, loras, grammars):
            request_id = f"offline-{next(self._ids)}"
            order[request_id] = len(order)
            if token_ids is None:
                if not isinstance(text, str):
                    raise ValueError("prompt: give a string or prompt_token_ids")
                token_ids = self.engine.encode(text)
            self.engine.add_request(request_id, text, p, prompt_token_ids=token_ids, lora_request=lora, grammar=grammar)
            self.processor.add_request(request_id, text, token_ids, p)
        return self._run(order, use_tqdm)

    def embed(
        self,
        prompts: PromptLike | Seq[PromptLike] | None = None,
        pooling_params: PoolingParams | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[list[float]]:
        """One pooled vector per prompt (PoolingParams: last / mean / cls, normalize,
        dimensions; by default the checkpoint's rule, engine/pooling.py), in the order of the
        prompts."""
        pooling = pooling_params or checkpoint_pooling(self.engine.model_path)
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        outputs = self.generate(prompts, params, prompt_token_ids=prompt_token_ids, use_tqdm=use_tqdm)
        return [out.pooled for out in outputs]

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        tool_call_parser: str | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation ([{"role", "content"}, ...]) or to
        each of several, rendered with the tokenizer's chat template (as /v1/chat/completions).

        With `tools` (OpenAI's tool definitions, passed to the template) and tool_choice
        "required" or {"type": "function", "function": {"name": ...}}, the output is
        constrained to calls; with "auto" and a `tool_call_parser` ("hermes",
        "llama3_json", "mistral", "pythonic") calls of the declared tools are read from
        the text. Either way each choice's
        `tool_calls` holds them (ToolCall: name, arguments as JSON text, id)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"the model {self.engine.config.model!r} has no chat template; use generate()")
        use_tools = bool(tools) and tool_choice != "none"
        options = {"tools": tools} if use_tools else {}
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **options)
            # the template renders the BOS itself: no special tokens added on top
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
        schema = forced_schema(tools, tool_choice) if use_tools else None
        if schema is not None:
            sampling_params = _constrained(sampling_params, StructuredOutputsParams(json=schema))
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        if use_tools and (schema is not None or tool_call_parser is not None):
            declared = ToolSet(tools) if schema is None else None
            for choice in (c for o in outputs for c in o.outputs):
                if schema is not None:
                    choice.tool_calls = forced_calls(choice.text, tool_choice) if choice.finish_reason == "stop" else []
                else:
                    choice.tool_calls = parse_tool_calls(tool_call_parser, choice.text, declared)[1]
        return outputs

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for step_output in self.engine.step():
                    output, stop = self.processor.process(step_output)
                    if stop is not None:  # a stop string ended choices: free them now
                        self.engine.stop_sequences(stop.request_id, stop.stops)
                    if output is not None and output.finished and output.request_id in order:
                        if output.error is not None:
                            raise RuntimeError(f"request {output.request_id}: {output.error}")
                        results[order[output.request_id]] = output
                        if bar is not None:
                            bar.update(1)
        finally:
            # after a failure the other requests of this call end too: no state left behind,
            # in the output processor or in the engine
            for request_id in order:
                self.processor.abort_request(request_id)
                self.engine.abort_request(request_id)
            if bar is not None:
                bar.close()
        return results


def _constrained(params, constraint: StructuredOutputsParams):
    """The sampling parameters with the tool-call constraint (one or a list)."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, Seq):
        return [_constrained(p, constraint) for p in params]
    if params.structured_outputs is not None:
        raise ValueError("tool_choice: cannot be combined with structured_outputs")
    return dataclasses.replace(params, structured_outputs=constraint)


def _normalise_prompts(prompts, prompt_token_ids) -> list[tuple[str | None, list[int] | None]]:
    if prompt_token_ids is not None:
        return [(None, list(ids)) for ids in prompt_token_ids]
    if prompts is None:
        raise ValueError("prompts: give prompts or prompt_token_ids")
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    items = []
    for p in prompts:
        if isinstance(p, str):
            items.append((p, None))
        elif isinstance(p, dict):
            items.append((p.get("prompt"), p.get("prompt_token_ids")))
        else:
            items.append((None, list(p)))
    return items
