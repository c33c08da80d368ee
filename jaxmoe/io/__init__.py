"""Checkpoint readers and the GGUF writer: configs and parameter pytrees, no modules.

``load_layer(path, layer=i)`` returns the ``(MoEConfig, MoEParams)`` of one MoE layer and
dispatches on what ``path`` is (`checkpoint_format`):

- a ``.gguf`` file (or any file starting with the ``GGUF`` magic) -> `jaxmoe.io.gguf`
  (llama.cpp names and metadata keys);
- a directory with ``config.json`` whose config carries ``quantization`` (or a
  ``quantization_config`` with ``bits`` and ``group_size``) -> `jaxmoe.io.mlx` (mlx-lm);
- any other directory with ``config.json`` and ``*.safetensors`` -> `jaxmoe.io.hf`.

``load_config(name_or_path)`` gives the `MoEConfig` of such a checkpoint (no tensors
read), and of a preset name or model YAML otherwise (`jaxmoe.config.load_config`).
``save_gguf((cfg, params), path, layer=i, dtype=...)`` writes one layer as GGUF.

An `MoEBlock` from a checkpoint is `jaxmoe.pretrained.from_pretrained` (``jaxmoe.from_pretrained``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxmoe.config import MoEConfig
from jaxmoe.config import load_config as load_preset_config
from jaxmoe.io import gguf, hf, mlx
from jaxmoe.io.errors import CheckpointError
from jaxmoe.params import MoEParams

#: `checkpoint_format` name -> the module that reads that format.
FORMATS = {"gguf": gguf, "hf": hf, "mlx": mlx}


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a checkpoint rather than a preset or a model YAML: a ``.gguf``
    path (existing or not), a file that starts with the GGUF magic, or a directory with a
    ``config.json``."""
    p = Path(path)
    if p.suffix == ".gguf":
        return True
    if p.is_dir():
        return (p / "config.json").is_file()
    if p.is_file():
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    return False


def checkpoint_format(path: str | os.PathLike) -> str:
    """``gguf``, ``mlx`` or ``hf``: the format of the checkpoint at ``path`` (see the module doc).

    Raises FileNotFoundError for a missing path and ValueError for anything else that is
    not a checkpoint.
    """
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


def load_layer(path: str | os.PathLike, layer: int = 0, **kwargs) -> tuple[MoEConfig, MoEParams]:
    """``(MoEConfig, MoEParams)`` of MoE layer ``layer`` of a GGUF file or an HF / MLX checkpoint
    directory.

    Keyword arguments (``dtype=``, and the format's own, e.g. ``quantized=`` for HF) go to
    the format module's ``load_layer``.
    """
    return FORMATS[checkpoint_format(path)].load_layer(path, layer=layer, **kwargs)


def load_config(name_or_path: str | os.PathLike) -> MoEConfig:
    """The `MoEConfig` of a checkpoint (GGUF file, HF / MLX directory; no tensors read), or of a
    preset name / model YAML path (`jaxmoe.config.load_config`)."""
    if is_checkpoint(name_or_path):
        return FORMATS[checkpoint_format(name_or_path)].load_config(name_or_path)
    return load_preset_config(name_or_path)


def save_gguf(model, path: str | os.PathLike, layer: int = 0, dtype: str = "f16", **kwargs) -> Path:
    """Writes ``model`` (``(MoEConfig, MoEParams)``, or an object with ``.cfg`` and ``.params()``)
    as layer ``layer`` of a GGUF file with llama.cpp's names and keys; see `jaxmoe.io.gguf.save_gguf`."""
    return gguf.save_gguf(model, path, layer=layer, dtype=dtype, **kwargs)


__all__ = [
    "FORMATS",
    "CheckpointError",
    "checkpoint_format",
    "is_checkpoint",
    "load_config",
    "load_layer",
    "save_gguf",
]
