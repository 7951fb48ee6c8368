"""Random LoRA adapters written by `peft` for the tiny checkpoints, and HF + PeftModel's
greedy output on them (the reference the engine is held to)."""

from __future__ import annotations

from pathlib import Path

import torch

TARGETS = {
    "llama": {
        "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "attn": ["q_proj", "v_proj"],
        "mlp": ["gate_proj", "up_proj", "down_proj"],
    },
    "opt": {
        "all": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
        "attn": ["q_proj", "v_proj"],
        "mlp": ["fc1", "fc2"],
    },
}

# name -> (targets, r, lora_alpha, use_rslora): three adapters per family, ranks 8 / 4 / 16
ADAPTERS = {"a0": ("all", 8, 16, False), "a1": ("attn", 4, 8, False), "a2": ("mlp", 16, 32, True)}


def write_adapter(
    base: str | Path, out_dir: str | Path, arch: str, targets: str | list[str], r: int, alpha: float,
    *, seed: int, use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA directory with random, non-zero A and B (large enough to change greedy tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    modules = TARGETS[arch][targets] if isinstance(targets, str) else targets
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, init_lora_weights=False, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def write_adapters(base: str | Path, root: Path, arch: str) -> dict[str, str]:
    """ADAPTERS for one family: name -> directory."""
    return {
        name: str(write_adapter(base, root / name, arch, t, r, a, seed=10 + i, use_rslora=rs))
        for i, (name, (t, r, a, rs)) in enumerate(ADAPTERS.items())
    }


def peft_model(base: str | Path, adapter: str | Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).eval()


def greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF generate, greedy, one unpadded prompt: the new tokens up to and with an EOS."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
        )  # fmt: skip
    new = out[0, len(prompt_ids) :].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, token in enumerate(new):
        if token in eos:
            return new[: i + 1]
    return new
