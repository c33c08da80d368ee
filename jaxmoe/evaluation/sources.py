"""Where an eval run's layers and activations come from.

`layer_specs` turns the ``model`` section into one `LayerSpec` per (model, layer) and
checks everything that needs only configs (no tensors): layer indices, shrink widths,
quantization group sizes, the width of an ``.npy`` input. `load_params` then builds a
layer's `MoEParams`: seeded random weights (numpy normal, fan-in scaled) for a preset
or a model YAML, or the tensors of a GGUF file / HF / MLX checkpoint through
`jaxmoe.pretrained.from_pretrained`. `case_params` casts and quantizes them for one case.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import MoEConfig, list_presets, load_config
from jaxmoe.evaluation.config import EvalConfig
from jaxmoe.evaluation.presets import shrink_config
from jaxmoe.evaluation.schema import Context
from jaxmoe.io import load_config as load_model_config
from jaxmoe.params import MoEParams, params_from_sampler
from jaxmoe.pretrained import from_pretrained
from jaxmoe.quant import QuantizedTensor, quantize_int4_affine, quantize_int8

#: Quantization group sizes along the input dimension: GGUF Q8_0 and MLX affine 4-bit.
GROUP_SIZE = {"int8": 32, "int4": 64}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer an eval run measures.

    Attributes:
      label: ``model/L<layer>`` (how tables and plots name it).
      model: the preset name or the path it came from.
      layer: layer index in that model.
      cfg: its `MoEConfig` (shrunk if the config says so).
      checkpoint: True when the weights are read from a file, False for random weights.
    """

    label: str
    model: str
    layer: int
    cfg: MoEConfig
    checkpoint: bool


def _is_checkpoint(path: str) -> bool:
    p = Path(path)
    return p.suffix not in (".yaml", ".yml")


def layer_specs(ecfg: EvalConfig, source: str) -> list[LayerSpec]:
    """The layers of the run, validated (raises `ConfigError` naming ``source`` and the key)."""
    fail = Context(source).fail

    m = ecfg.model
    models: list[tuple[str, MoEConfig, bool]] = []
    if m.preset is not None:
        names = (m.preset,) if isinstance(m.preset, str) else m.preset
        expanded: list[str] = []
        for n in names:
            for x in list_presets() if n == "all" else [n]:
                if x not in expanded:
                    expanded.append(x)
        for n in expanded:
            models.append((n, load_config(n), False))
    else:
        ckpt = _is_checkpoint(m.path)
        try:
            cfg = load_model_config(m.path)
        except ModuleNotFoundError as e:
            fail("model.path", f"the loader for {m.path} is not installed ({e})")
        except (ValueError, FileNotFoundError) as e:
            fail("model.path", str(e))
        models.append((m.path, cfg, ckpt))
    specs = []
    for name, cfg, ckpt in models:
        if m.shrink is not None:
            try:
                cfg = shrink_config(cfg, **m.shrink.widths())
            except ValueError as e:
                fail("model.shrink", f"{name}: {e}")
        for layer in m.layers:
            if layer >= cfg.num_layers:
                fail("model.layers", f"{name} has {cfg.num_layers} layers; layer {layer} does not exist")
            if not cfg.is_moe_layer(layer):
                fail(
                    "model.layers",
                    f"layer {layer} of {name} is a dense layer (dense_layers "
                    f"{list(cfg.dense_layers)}); pick an MoE layer",
                )
            for q in ecfg.quantize:
                g = GROUP_SIZE.get(q)
                if g and (cfg.d_model % g or cfg.expert_dim % g):
                    fail(
                        "quantize",
                        f"{q} needs d_model and expert_dim divisible by {g}; {name} has "
                        f"d_model={cfg.d_model}, expert_dim={cfg.expert_dim}",
                    )
            label = f"{Path(name).name if ckpt or name.endswith(('.yaml', '.yml')) else name}/L{layer}"
            specs.append(LayerSpec(label, name, layer, cfg, ckpt))
    if ecfg.inputs.kind == "npy":
        shape = np.load(ecfg.inputs.path, mmap_mode="r").shape
        for s in specs:
            if len(shape) < 2 or shape[-1] != s.cfg.d_model:
                fail("inputs.path", f"{ecfg.inputs.path} has shape {shape}; {s.label} needs [..., {s.cfg.d_model}]")
            rows = int(np.prod(shape[:-1]))
            if rows < max(ecfg.tokens):
                fail(
                    "inputs.path",
                    f"{ecfg.inputs.path} holds {rows} tokens (shape {shape}); tokens asks for up to {max(ecfg.tokens)}",
                )
    return specs


def _rng(seed: int, spec: LayerSpec, salt: str) -> np.random.Generator:
    return np.random.default_rng([seed, spec.layer, zlib.crc32(spec.model.encode()), zlib.crc32(salt.encode())])


@jax.jit
def _scale_codes(q: jax.Array, c: jax.Array) -> jax.Array:
    return q.astype(jnp.float32) * c


def random_params(cfg: MoEConfig, rng: np.random.Generator, dtype, scale: float = 1.0) -> MoEParams:
    """Seeded random weights, fan-in scaled: uniform with standard deviation
    ``scale / sqrt(fan_in)``, drawn as int16 codes by numpy and scaled by XLA (a full-width
    Qwen3.6 layer in a few seconds, where ``jax.random.normal`` on CPU takes over a minute)."""

    def nrm(shape, fan_in):
        q = rng.integers(-32768, 32768, size=shape, dtype=np.int16)
        # uniform on [-a, a) has std a / sqrt(3)
        c = np.float32(scale / fan_in**0.5 * 3**0.5 / 32768.0)
        if q.size < 1 << 22:  # small: numpy (no compile); large: XLA's threads
            return jnp.asarray(q.astype(np.float32) * c, dtype)
        return _scale_codes(jnp.asarray(q), c).astype(dtype)

    return params_from_sampler(cfg, nrm)


def load_params(spec: LayerSpec, ecfg: EvalConfig) -> MoEParams:
    """The layer's parameters in ``model.dtype``: random (seeded) or read from the checkpoint."""
    dtype = jnp.dtype(ecfg.model.dtype)
    if spec.checkpoint:
        block = from_pretrained(spec.model, layer=spec.layer, dtype=dtype)
        p = block.params()
        p.check(spec.cfg)
        return p
    return random_params(spec.cfg, _rng(ecfg.model.seed, spec, "weights"), dtype, ecfg.model.weight_scale)


def load_inputs(spec: LayerSpec, ecfg: EvalConfig, rows: int) -> np.ndarray:
    """``[N, d]`` float32 activations: seeded ``scale * N(0, 1)`` (``rows`` of them), or
    every token of the ``.npy`` file (flattened over its leading axes)."""
    inp = ecfg.inputs
    if inp.kind == "npy":
        a = np.load(inp.path)
        return np.asarray(a, np.float32).reshape(-1, a.shape[-1])
    rng = _rng(inp.seed, spec, "inputs")
    x = rng.standard_normal((rows, spec.cfg.d_model), dtype=np.float32)
    return x * np.float32(inp.scale)


def _cast(a, dtype):
    if a is None or isinstance(a, QuantizedTensor):
        return a
    return a.astype(dtype)


def case_params(base: MoEParams, dtype: str, quantize: str) -> MoEParams:
    """``base`` cast to ``dtype`` (quantized tensors kept) with the routed experts' matrices
    quantized (``int8``: GGUF Q8_0 rule, group 32; ``int4``: MLX affine rule, group 64)."""
    dt = jnp.dtype(dtype)
    p = jax.tree.map(lambda a: _cast(a, dt), base, is_leaf=lambda a: isinstance(a, QuantizedTensor))
    if quantize == "none":
        return p
    g = GROUP_SIZE[quantize]

    def q(w):
        dense = np.asarray(w.dequantize(jnp.float32) if isinstance(w, QuantizedTensor) else w.astype(jnp.float32))
        if quantize == "int8":
            return quantize_int8(dense, group_size=g)
        return quantize_int4_affine(dense, group_size=g)

    ew = p.experts
    return dataclasses.replace(
        p, experts=dataclasses.replace(ew, w_gate=q(ew.w_gate), w_up=q(ew.w_up), w_down=q(ew.w_down))
    )
