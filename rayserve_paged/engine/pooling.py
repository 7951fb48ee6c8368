"""A checkpoint's own pooling rule for embeddings, read once at startup.

sentence-transformers checkpoints say it in `modules.json` (a Pooling module's folder, whose
`config.json` names the mode; a Normalize module after it) -- gte-Qwen2 carries one. Without
it the rule is the decoder embedders' (Qwen3-Embedding's, vLLM's default for decoders):
the last token's hidden state, normalized.
"""

from __future__ import annotations

import json
from pathlib import Path

from rayserve_paged.core.sequence import PoolingParams

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


class PoolingConfigError(ValueError):
    """A checkpoint's pooling config asks for a mode this engine does not pool by."""


def checkpoint_pooling(model_path: str) -> PoolingParams:
    """The checkpoint's default PoolingParams (see the module docstring)."""
    root = Path(model_path)
    modules_file = root / "modules.json"
    if not root.is_dir() or not modules_file.is_file():
        return PoolingParams("last", normalize=True)
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    pooling_dir = next((m.get("path", "") for m in modules if m.get("type") == _POOLING), None)
    if pooling_dir is None:
        return PoolingParams("last", normalize=_NORMALIZE in types)
    config = json.loads((root / pooling_dir / "config.json").read_text())
    modes = [mode for key, mode in _MODES.items() if config.get(key)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _MODES]
    if len(modes) != 1 or others:
        raise PoolingConfigError(
            f"{pooling_dir}/config.json: pooling by {', '.join(modes + others) or 'nothing'}; this engine pools by "
            "exactly one of the last token, the mean or the first (cls) token"
        )
    return PoolingParams(modes[0], normalize=_NORMALIZE in types)
