"""`MoEBlock` from a checkpoint, and back: ``from_pretrained`` and ``save_gguf``.

`jaxmoe.io` reads and writes configs and parameter pytrees; this module sits above it
and above `jaxmoe.block` and turns a loaded ``(MoEConfig, MoEParams)`` into an `MoEBlock`.
Both are re-exported as ``jaxmoe.from_pretrained`` and ``jaxmoe.save_gguf``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxmoe.block import MoEBlock
from jaxmoe.execution import REMOVED, ExecConfig, exec_config
from jaxmoe.experts import experts_frozen
from jaxmoe.io import checkpoint_format, load_layer
from jaxmoe.io import save_gguf as save_layer_gguf


def from_pretrained(
    path: str | os.PathLike,
    layer: int = 0,
    *,
    dtype=jnp.float32,
    impl: str | None = None,
    ex: ExecConfig | None = None,
    **loader_kwargs,
):
    """An `MoEBlock` for MoE layer ``layer`` of a GGUF file or an HF / MLX checkpoint directory.

    Args:
      path: a ``.gguf`` file or a directory with ``config.json`` and ``*.safetensors``
        (the format is found by `jaxmoe.io.checkpoint_format`).
      layer: the layer index (``blk.{i}`` in GGUF, ``layers.{i}`` in HF / MLX); a dense
        layer is a ValueError.
      dtype: the block's parameter and compute dtype, and the dtype the loader gives the
        float expert weights (Q8_0 / Q4_0 / MLX 4-bit experts stay quantized; the router
        is float32 always).
      impl: shorthand for ``ExecConfig(impl=...)``.
      ex: how the block runs (`jaxmoe.ExecConfig`). Left out (with ``impl`` None or
        ``auto``), a GGUF file whose routed experts stay quantized runs in llama.cpp's
        arithmetic, ``ExecConfig(activations="ggml")``, when the default device is a CPU:
        the numbers a GGUF user checks against llama.cpp. ``ex=jaxmoe.ExecConfig()`` keeps
        float activations; float GGUF experts, HF and MLX checkpoints and other devices
        take float activations.
      **loader_kwargs: the format's own options (e.g. ``quantized=`` for HF directories).
    """
    gone = [k for k in loader_kwargs if k in REMOVED]
    if gone:
        raise TypeError(f"from_pretrained: keyword {gone[0]!r} was removed; use {REMOVED[gone[0]]}")
    run = exec_config(ex, impl)
    cfg, params = load_layer(path, layer=layer, dtype=dtype, **loader_kwargs)
    if ex is None and run.impl == "auto" and ggml_by_default(path, params):
        run = dataclasses.replace(run, activations="ggml")
    return MoEBlock(cfg, params=params, ex=run, dtype=dtype)


def ggml_by_default(path: str | os.PathLike, params) -> bool:
    """Whether `from_pretrained` runs the layer in ggml arithmetic when not told otherwise:
    a GGUF file, routed experts kept quantized, the default device a CPU."""
    quantized = experts_frozen(params.experts)  # any routed weight a QuantizedTensor
    return quantized and jax.default_backend() == "cpu" and checkpoint_format(path) == "gguf"


def save_gguf(block_or_cfg_params, path: str | os.PathLike, layer: int = 0, dtype: str = "f16", **kwargs) -> Path:
    """Writes an `MoEBlock` (or a ``(MoEConfig, MoEParams)`` pair) as layer ``layer`` of a GGUF
    file with llama.cpp's names and keys.

    ``dtype`` (``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``) is the type of the expert and
    shared-expert matrices; ``arch=`` and ``name=`` go to `jaxmoe.io.gguf.save_gguf`.
    Returns the path written.
    """
    return save_layer_gguf(block_or_cfg_params, path, layer=layer, dtype=dtype, **kwargs)


__all__ = ["from_pretrained", "save_gguf"]
