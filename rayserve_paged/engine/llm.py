"""Offline batch generation without Serve: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.engine.output_processor import OutputProcessor
from rayserve_paged.engine.outputs import RequestOutput

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
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": ...}.
        """
        items = _normalise_prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Seq) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")
        order = {}
        for (text, token_ids), p in zip(items, params):
            request_id = f"offline-{next(self._ids)}"
            order[request_id] = len(order)
            if token_ids is None:
                if not isinstance(text, str):
                    raise ValueError("prompt: give a string or prompt_token_ids")
                token_ids = self.engine.encode(text)
            self.engine.add_request(request_id, text, p, prompt_token_ids=token_ids)
            self.processor.add_request(request_id, text, token_ids, p)
        return self._run(order, use_tqdm)

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
