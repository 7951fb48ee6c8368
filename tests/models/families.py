"""Tiny random checkpoints of the decoder families, written with transformers' own config and
model classes (offline), for parity tests against transformers.

Windows of 8 tokens on 4-token blocks keep prompts longer than the window short. Norm
weights and biases get noise on top of HF's initialisation (ones / zeros), so a norm offset
or a bias that is loaded wrong changes the tokens; soft-caps are small enough to bend the
logits of these small random weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rayserve_paged.models.tiny import write_tokenizer

WINDOW = 8

COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip

# family -> (transformers config class, model class, config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # layer 0 global, layer 1 sliding (max_window_layers=1); biases on q/k/v only
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # both layers sliding, q/k norms
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    # layer 0 sliding, layer 1 global; soft-caps, query_pre_attn_scalar (tied: a test override)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    )),  # fmt: skip
    # layer 0 sliding, layer 1 global (pattern 2); q/k norms; the global layers' RoPE linearly
    # scaled on another base
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=24,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )),  # fmt: skip
    # fused qkv_proj / gate_up_proj in the checkpoint; every layer sliding
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW)),
}


def write_family_checkpoint(family: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    config_name, model_name, fields = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    write_tokenizer(out_dir, config.max_position_embeddings)
    return out_dir
