"""The attention backend registry: a backend by name and device.

Imports point one way: backends -> paged_attention (the interface and the torch reference)
and backends -> triton_backend (only when asked for, since it imports triton) ->
paged_attention. paged_attention imports no backend.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from .paged_attention import AttentionBackend, TorchReferenceBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "triton", "flash")


# ---------------------------------------------------------------------------- dispatch


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name` for `device`.

    auto   -> triton on CUDA when its module imports, else torch
    torch  -> TorchReferenceBackend (any device)
    triton -> rayserve_paged.ops.triton_backend.TritonBackend (CUDA, or CPU under TRITON_INTERPRET=1)
    flash  -> rayserve_paged.ops.flash_backend.FlashBackend (CUDA, needs vllm_flash_attn)
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention_backend {name!r}; valid names: {', '.join(BACKEND_NAMES)}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchReferenceBackend()
    if name == "auto":
        try:
            return _load_triton_backend()
        except ImportError as error:
            logger.info("attention_backend 'auto': triton backend unavailable (%s); using torch", error)
            return TorchReferenceBackend()
    if name == "triton":
        return _get_triton_backend(device)
    return _get_flash_backend(device)


def _get_triton_backend(device: torch.device) -> AttentionBackend:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for tests), got {device}"
        )
    try:
        return _load_triton_backend()
    except ImportError as error:
        raise RuntimeError(f"attention_backend 'triton' cannot be imported: {error}") from error


def _load_triton_backend() -> AttentionBackend:
    # imports triton: only when asked for (by module name, so sys.modules decides, as for flash)
    return importlib.import_module("rayserve_paged.ops.triton_backend").TritonBackend()


def _get_flash_backend(device: torch.device) -> AttentionBackend:
    if device.type != "cuda":
        raise ValueError(f"attention_backend 'flash' needs a CUDA device, got {device}")
    try:
        importlib.import_module("vllm_flash_attn")
    except ImportError as error:
        raise RuntimeError(
            "attention_backend 'flash' needs the vllm_flash_attn package, which is not installed "
            f"({error})"
        ) from error
    try:
        module = importlib.import_module("rayserve_paged.ops.flash_backend")
    except ImportError as error:
        raise RuntimeError(
            f"attention_backend 'flash': rayserve_paged.ops.flash_backend cannot be imported: {error}"
        ) from error
    return module.FlashBackend()
