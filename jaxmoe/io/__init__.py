"""Checkpoint loaders and exporters.

``from_pretrained(path, layer=i)`` dispatches on what ``path`` is:

- a ``.gguf`` file -> `jaxmoe.io.gguf` (llama.cpp names and metadata keys);
- a directory with ``config.json`` whose config carries ``quantization`` and whose
  tensors use the mlx-lm ``switch_mlp`` layout -> `jaxmoe.io.mlx`;
- any other directory with ``config.json`` and ``*.safetensors`` -> `jaxmoe.io.hf`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _kind(path: str | os.PathLike) -> str:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    if p.is_file():
        if p.suffix == ".gguf":
            return "gguf"
        with open(p, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ValueError(f"{p}: not a GGUF file (wrong magic) and not a checkpoint directory")
    cfgp = p / "config.json"
    if not cfgp.is_file():
        raise ValueError(f"{p}: a checkpoint directory needs a config.json")
    with open(cfgp) as f:
        cfg = json.load(f)
    qc = cfg.get("quantization_config")
    if "quantization" in cfg or (isinstance(qc, dict) and qc.get("bits") and qc.get("group_size")):
        return "mlx"
    return "hf"


def from_pretrained(path, layer: int = 0, **kwargs):
    """An `MoEBlock` for layer ``layer`` of a GGUF file or an HF / MLX checkpoint directory.

    Keyword arguments (``dtype=``, ``impl=``, ...) go to the format's loader.
    """
    kind = _kind(path)
    if kind == "gguf":
        from jaxmoe.io import gguf as mod
    elif kind == "mlx":
        from jaxmoe.io import mlx as mod
    else:
        from jaxmoe.io import hf as mod
    return mod.from_pretrained(path, layer=layer, **kwargs)


def load_config_from_checkpoint(path):
    """The `MoEConfig` of a GGUF file or checkpoint directory (no tensors read)."""
    kind = _kind(path)
    if kind == "gguf":
        from jaxmoe.io import gguf as mod
    elif kind == "mlx":
        from jaxmoe.io import mlx as mod
    else:
        from jaxmoe.io import hf as mod
    return mod.load_config(path)


def save_gguf(block, path, layer: int = 0, dtype: str = "f16", **kwargs):
    from jaxmoe.io import gguf as mod

    return mod.save_gguf(block, path, layer=layer, dtype=dtype, **kwargs)
