"""Decode steps through the compiled CPU decoder layer (models/compiled_decode.py) against the
same group-quantized model run layer by layer: a tiny Llama written as Q4_1 and Q8_0 GGUF
files, loaded twice with `quantization: auto`; prefills run op by op in both, every decode step
of the first runs one compiled call per layer; logits within float32 summation-order tolerance,
the same greedy token at every step, the KV caches the same. A model that does not qualify
(layers by another family, float weights) never takes the compiled path."""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.models import quant
from rayserve_paged.models.loader import get_model_config, load_model
from rayserve_paged.models.tiny import make_tiny_model
from rayserve_paged.ops import cpu_layer

from .paged import PagedRunner
from .test_gguf import write_gguf

pytestmark = pytest.mark.skipif(
    not quant.cpu_kernel_plan().is_compiled or cpu_layer.load() is None,
    reason="the compiled group-quantized CPU kernels need AVX-512 and a C++ compiler",
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def layer_calls(monkeypatch):
    calls = []
    call = cpu_layer.DecoderLayerKernel.__call__
    monkeypatch.setattr(cpu_layer.DecoderLayerKernel, "__call__",
                        lambda self, layer, step, *a, **k: calls.append(step.struct.num_tokens) or call(self, layer, step, *a, **k))  # fmt: skip
    return calls


def _greedy_steps(model, config, num_steps: int) -> tuple[list[torch.Tensor], PagedRunner]:
    runner = PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_dim)
    prompts = {0: [1, 40, 41, 42, 43, 44], 1: [1, 9, 8], 2: [1, 17, 23, 5, 5, 7, 9, 11, 2, 3]}
    logits = [runner.step(list(prompts.items()))]
    for _ in range(num_steps):
        tokens = logits[-1].argmax(-1).tolist()
        logits.append(runner.step([], list(zip(prompts, tokens))))
    return logits, runner


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_compiled_decode_equals_the_layer_by_layer_model(type_name, llama_dir, tmp_path, layer_calls):
    path = tmp_path / f"tiny.{type_name}.gguf"
    write_gguf(path, llama_dir, type_name)
    config = get_model_config(path)
    compiled, reference = load_model(path, dtype=torch.float32), load_model(path, dtype=torch.float32)
    reference.model.use_compiled_decode = False
    num_steps = 12  # past a 4-token block boundary several times
    got, got_runner = _greedy_steps(compiled, config, num_steps)
    assert layer_calls == [3] * (config.num_layers * num_steps)  # every decode step, no prefill
    layer_calls.clear()
    want, want_runner = _greedy_steps(reference, config, num_steps)
    assert layer_calls == []
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.argmax(-1), w.argmax(-1)), step
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4 * w.abs().max().item())
    for (gk, gv), (wk, wv) in zip(got_runner.kv_caches, want_runner.kv_caches):
        written = ~wk.isnan()  # the NaN-filled caches: only the written slots hold numbers
        assert torch.equal(written, ~gk.isnan()) and torch.equal(written, ~gv.isnan())
        torch.testing.assert_close(gk[written], wk[written], rtol=0, atol=1e-4)
        torch.testing.assert_close(gv[written], wv[written], rtol=0, atol=1e-4)


def test_models_that_do_not_qualify_run_layer_by_layer(llama_dir, tmp_path, layer_calls):
    path = tmp_path / "tiny.Q4_1.gguf"
    write_gguf(path, llama_dir, "Q4_1")
    config = get_model_config(path)
    for model in (load_model(llama_dir, dtype=torch.float32), load_model(path, dtype=torch.float32, quantization="none")):
        _greedy_steps(model, config, 2)
        assert model.model._compiled is None
    assert layer_calls == []


def test_a_lora_engine_runs_its_base_only_decode_steps_compiled(llama_dir, tmp_path, layer_calls):
    """LoRA enabled: a step whose rows use no adapter takes the compiled layer; a step with
    an adapter row runs layer by layer (and equals PEFT, tests/engine/test_lora.py)."""
    from rayserve_paged import LLM, LoRARequest, SamplingParams
    from tests.peft_adapters import write_adapter

    path = tmp_path / "tiny.Q8_0.gguf"
    write_gguf(path, llama_dir, "Q8_0")
    adapter = write_adapter(llama_dir, tmp_path / "lora", "llama", "attn", 4, 8, seed=3)
    llm = LLM(model=str(path), tokenizer=str(llama_dir), enable_lora=True, max_lora_rank=8, max_model_len=64,
              kv_cache_memory_gb=0.01, swap_space_gb=0.01)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    num_layers = get_model_config(path).num_layers
    llm.generate([[1, 40, 41, 42]], params, use_tqdm=False)
    assert layer_calls == [1] * (num_layers * 5)  # every decode step of the base-only request
    layer_calls.clear()
    llm.generate([[1, 40, 41, 42]], params, lora_request=LoRARequest("a", 1, str(adapter)), use_tqdm=False)
    assert layer_calls == []  # an adapter row: layer by layer
