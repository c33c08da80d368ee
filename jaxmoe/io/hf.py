"""Hugging Face safetensors checkpoints -> one MoE layer's ``(MoEConfig, MoEParams)``.

``load_layer(dir, layer=i)`` reads ``config.json`` (`jaxmoe.io.hf_config`), finds
layer ``i``'s MoE module and reads only its tensors (`SafetensorsDir`, lazily, single
file or sharded with ``model.safetensors.index.json``). Layouts, all checked against
``save_pretrained`` output of transformers 5.x in the tests (torch ``(out, in)``):

- per-expert: ``{P}.experts.{j}.{gate_proj,up_proj,down_proj}.weight`` (Qwen, OLMoE,
  DeepSeek, GLM, ...), Mixtral's ``{P}.experts.{j}.{w1,w3,w2}.weight``
  (``P = model.layers.{i}.block_sparse_moe``);
- fused parameters: ``{P}.experts.gate_up_proj (E, 2F, d)`` (rows ``[0:F]`` gate,
  ``[F:2F]`` up) and ``{P}.experts.down_proj (E, d, F)``; gpt-oss instead stores them
  input-major: ``gate_up_proj (E, d, 2F)`` with gate / up in the even / odd columns,
  ``gate_up_proj_bias (E, 2F)``, ``down_proj (E, F, d)``, ``down_proj_bias (E, d)``; the
  gpt-oss Hub checkpoints hold them as MXFP4 ``*_blocks`` / ``*_scales`` (out-major),
  kept as GGUF ``mxfp4`` block bytes (`mxfp4_tensors`: the nibbles re-packed once at load,
  the same byte count); block-scaled FP8 weights (DeepSeek-V3 / Qwen3 FP8 Hub:
  ``*.weight`` F8_E4M3 with ``*.weight_scale_inv``, ``quantization_config.weight_block_size``)
  are kept as ``fp8_e4m3`` `QuantizedTensor` s (the file's codes and scales) when the block
  is square; ``load_layer(quantized=False)``, E5M2 codes and non-square blocks dequantize;
- stacked linears (mlx-lm): ``{P}.switch_mlp.{gate_proj,up_proj,down_proj}.weight``
  ``(E, out, in)`` (or ``{P}.experts.<proj>.weight`` with ``.bias``, gpt-oss in mlx-lm),
  MLX-quantized when ``.scales`` / ``.biases`` sit beside them (`jaxmoe.io.mlx_codec`);
- router ``{P}.gate.weight (E, d)`` or ``{P}.router.{weight,bias}`` (gpt-oss), selection
  bias ``{P}.gate.e_score_correction_bias (E,)`` (``{P}.gate.expert_bias`` in Ling / bailing); shared expert ``{P}.shared_expert.*``
  (Qwen) or ``{P}.shared_experts.*`` (DeepSeek, GLM), gate ``{P}.shared_expert_gate.weight (1, d)``.

The layer prefix is found from the tensor names (``model.layers.``,
``model.language_model.layers.`` of the Qwen3.5 multimodal checkpoints,
``language_model.model.layers.`` of mlx-lm). Any missing tensor, shape mismatch,
mixed layout or dense layer raises ValueError before any parameters are returned.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxmoe.config import MoEConfig
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.io import hf_config, mlx_codec
from jaxmoe.io.gguf_codec import aligned_empty
from jaxmoe.io.safetensors_dir import SafetensorsDir
from jaxmoe.params import MoEParams
from jaxmoe.quant import QuantizedTensor, dequantize_fp8_numpy, fp8_block_tensor, gguf_block_tensor

_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_SKIP_BASES = ("mtp", "visual", "vision", "audio")
_LAYER_RE = re.compile(r"^(?P<base>(?:[A-Za-z_][\w]*\.)*?)layers\.(?P<i>\d+)\.(?P<mod>mlp|block_sparse_moe)\.")


def load_config(path: str | os.PathLike) -> MoEConfig:
    """The `MoEConfig` of an HF checkpoint directory (``config.json`` only)."""
    return hf_config.load_config(path)


def moe_prefix(keys, layer: int, source: str) -> str:
    """``<base>layers.{layer}.<mlp|block_sparse_moe>`` of the layer's MoE module."""
    found: dict[str, str] = {}
    for k in keys:
        m = _LAYER_RE.match(k)
        if m and int(m["i"]) == layer and not any(s in m["base"] for s in _SKIP_BASES):
            found[m["base"]] = f"{m['base']}layers.{layer}.{m['mod']}"
    if not found:
        raise ValueError(
            f"{source}: no MLP tensors for layer {layer} (no '*layers.{layer}.mlp.*' or "
            f"'*layers.{layer}.block_sparse_moe.*' names)"
        )
    if len(found) > 1:
        raise ValueError(f"{source}: layer {layer} appears under several prefixes {sorted(found)}")
    return next(iter(found.values()))


def _float_linear(
    st: SafetensorsDir, module: str, shape: tuple[int, ...], fp8_block=None, keep: bool = False
) -> np.ndarray | QuantizedTensor:
    """``{module}.weight``; block-scaled FP8 (DeepSeek-V3 style ``weight_scale_inv``) kept as
    an ``fp8_e4m3`` `QuantizedTensor` (the file's codes and scales) when ``keep``, the codes
    are E4M3 and the block is square, else dequantized to float32."""
    w = st.get(f"{module}.weight", shape)
    sname = f"{module}.weight_scale_inv"
    if sname not in st:
        if w.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
            raise ValueError(f"{st.path}: tensor {module + '.weight'!r} is FP8 but {sname!r} is missing")
        return w
    bo, bi = fp8_block or (128, 128)
    *lead, out, n_in = shape
    s = st.get(sname, (*lead, -(-out // bo), -(-n_in // bi)))
    if keep and bo == bi and w.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return fp8_block_tensor(w, s, bo, name=f"{st.path}: {module}.weight / {sname}")
    s = np.repeat(np.repeat(np.asarray(s, np.float32), bo, axis=-2), bi, axis=-1)[..., :out, :n_in]
    return w.astype(np.float32) * s


def read_linear(
    st: SafetensorsDir,
    module: str,
    shape: tuple[int, ...],
    qlookup=None,
    keep_int4: bool = False,
    fp8_block=None,
    keep_fp8: bool = False,
):
    """``{module}.weight`` of logical torch shape ``(..., out, in)``.

    Returns a float ndarray ``(..., out, in)`` (stored dtype), or a `QuantizedTensor`
    (logical ``[..., in, out]``) when MLX-quantized at 4 bits and ``keep_int4``, or
    block-scaled FP8 E4M3 with a square block and ``keep_fp8``.
    """
    spec = qlookup(module) if qlookup is not None else None
    if spec is None:
        if st.dtype(f"{module}.weight") == "U32":
            raise ValueError(
                f"{st.path}: tensor {module + '.weight'!r} is packed uint32 but the module is not "
                "quantized in config.json (no .scales / 'quantization' entry)"
            )
        return _float_linear(st, module, shape, fp8_block, keep_fp8)
    *lead, out, n_in = shape
    if (n_in * spec.bits) % 32 or n_in % spec.group_size:
        raise ValueError(
            f"{st.path}: {module}: input width {n_in} does not fit {spec.bits}-bit words / groups of {spec.group_size}"
        )
    w = st.get(f"{module}.weight", (*lead, out, n_in * spec.bits // 32))
    gshape = (*lead, out, n_in // spec.group_size)
    s = st.get(f"{module}.scales", gshape)
    b = st.get(f"{module}.biases", gshape)
    if keep_int4 and spec.bits == 4:
        return mlx_codec.to_quantized_tensor(w, s, b, spec.group_size, name=module)
    return mlx_codec.dequantize(w, s, b, spec, name=module)


#: The 16 FP4 (E2M1) values of MXFP4 codes 0..15.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


#: Output rows re-packed at a time by `mxfp4_tensors`.
_MXFP4_ROWS = 256


def _mxfp4_check(st: SafetensorsDir, name: str, shape: tuple[int, ...]) -> None:
    """`_mxfp4_parts`' checks from the header alone (no bytes read)."""
    *lead, out, n_in = shape
    if n_in % 32:
        raise ValueError(f"{st.path}: {name}: input width {n_in} is not a multiple of the MXFP4 block 32")
    for sfx, want in (("_blocks", (*lead, out, n_in // 32, 16)), ("_scales", (*lead, out, n_in // 32))):
        got = st.shape(name + sfx)
        if got != want:
            raise ValueError(f"{st.path}: tensor {name + sfx!r} has shape {got}, expected {want}")
    dts = (st.dtype(f"{name}_blocks"), st.dtype(f"{name}_scales"))
    if dts != ("U8", "U8"):
        raise ValueError(f"{st.path}: {name}_blocks / {name}_scales must be uint8, got {dts[0]} / {dts[1]}")


def _mxfp4_parts(st: SafetensorsDir, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss's ``{name}_blocks (..., out, in/32, 16)`` and ``{name}_scales (..., out, in/32)``,
    checked (shapes, uint8) with errors naming the tensor."""
    *lead, out, n_in = shape
    if n_in % 32:
        raise ValueError(f"{st.path}: {name}: input width {n_in} is not a multiple of the MXFP4 block 32")
    blocks = st.get(f"{name}_blocks", (*lead, out, n_in // 32, 16))
    scales = st.get(f"{name}_scales", (*lead, out, n_in // 32))
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"{st.path}: {name}_blocks / {name}_scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    return blocks, scales


def mxfp4_to_gguf_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss MXFP4 ``blocks (..., G, 16)`` + ``scales (..., G)`` uint8 -> GGUF MXFP4 block bytes
    ``(..., G * 17)`` uint8 (`jaxmoe.quant.GGUF_BLOCKS`): per block the E8M0 byte unchanged
    (both read it as ``2^(s - 127)`` times the E2M1 value), then the 32 codes re-packed from
    HF's pairs (element ``2j`` low, ``2j + 1`` high nibble of byte ``j``) to ggml's halves
    (element ``i`` low, ``16 + i`` high nibble of byte ``i``). The same codes and exponent:
    the decoded values equal `read_mxfp4`'s (code 8, E2M1's negative zero, decodes as +0)."""
    if blocks.shape[-1:] != (16,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4_to_gguf_blocks: blocks {blocks.shape} must be scales {scales.shape} + (16,) (uint8 MXFP4)"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # natural order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1).astype(np.uint8)
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * 17)


def mxfp4_tensors(
    st: SafetensorsDir, name: str, shape: tuple[int, ...], rows=(slice(None),)
) -> tuple[QuantizedTensor, ...]:
    """gpt-oss MXFP4 ``{name}_blocks`` / ``{name}_scales`` of logical torch shape ``(..., out, in)``
    as ``mxfp4`` `QuantizedTensor` s, one per slice of output rows in ``rows`` (read once):
    the file's codes and exponents re-packed into GGUF block bytes (`mxfp4_to_gguf_blocks`),
    as many bytes as the file holds for those rows. The 32-element blocks run along ``in``
    in both layouts, so taking rows never splits a block."""
    *lead, out, n_in = shape
    if not lead:
        blocks, scales = _mxfp4_parts(st, name, shape)
        parts = [mxfp4_to_gguf_blocks(blocks[r, :, :], scales[r, :]) for r in rows]
    else:  # _MXFP4_ROWS file rows at a time into the kept buffers: a few MiB beyond them
        _mxfp4_check(st, name, shape)
        bn, sn = f"{name}_blocks", f"{name}_scales"
        kept = [np.arange(out)[r] for r in rows]  # the file rows of each part, increasing
        parts = [aligned_empty((*lead, len(k), n_in // 32 * 17), np.uint8) for k in kept]
        flat = [p.reshape(-1, len(k), n_in // 32 * 17) for p, k in zip(parts, kept)]
        for j in range(int(np.prod(lead))):
            for a in range(0, out, _MXFP4_ROWS):
                b = min(a + _MXFP4_ROWS, out)
                blocks, scales = st.get_part(bn, j, rows=(a, b)), st.get_part(sn, j, rows=(a, b))
                for f, k in zip(flat, kept):
                    lo, hi = np.searchsorted(k, (a, b))
                    f[j, lo:hi] = mxfp4_to_gguf_blocks(blocks[k[lo:hi] - a], scales[k[lo:hi] - a])
    return tuple(gguf_block_tensor(b, "mxfp4", n_in, name=f"{st.path}: {name}_blocks") for b in parts)


def read_mxfp4(st: SafetensorsDir, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 ``(..., out, in)`` from gpt-oss's MXFP4 ``{name}_blocks (..., out, in/32, 16)`` uint8
    (element ``2j`` in the low nibble of byte ``j``) and ``{name}_scales (..., out, in/32)`` uint8
    (E8M0: ``2^(s - 127)``). Dequantized; exact in float32 (``load_layer(quantized=False)``;
    the default keeps the bytes, `mxfp4_tensors`)."""
    *lead, out, n_in = shape
    blocks, scales = _mxfp4_parts(st, name, shape)
    vals = np.stack([FP4_VALUES[blocks & 0xF], FP4_VALUES[blocks >> 4]], axis=-1)  # (..., G, 16, 2)
    vals = vals.reshape(*blocks.shape[:-1], 32)
    w = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127)
    return w.reshape(*lead, out, n_in).astype(np.float32)


def _xw(a, dtype):
    """torch ``(..., out, in)`` ndarray -> jnp ``[..., in, out]`` in ``dtype`` (QuantizedTensor as is)."""
    if isinstance(a, QuantizedTensor):
        return a
    return jnp.asarray(np.swapaxes(np.asarray(a), -1, -2)).astype(dtype)


def _vec(st: SafetensorsDir, name: str, shape, dtype):
    return jnp.asarray(st.get(name, shape)).astype(dtype)


def _stack(ws: list, name: str):
    """Per-expert weights stacked on a new leading axis: float arrays with numpy, ``fp8_e4m3``
    `QuantizedTensor` s of one block size as one (codes and scales stacked); a mix is
    dequantized to float32 first."""
    if not any(isinstance(w, QuantizedTensor) for w in ws):
        return np.stack(ws)
    q0 = next(w for w in ws if isinstance(w, QuantizedTensor))
    if all(isinstance(w, QuantizedTensor) and (w.kind, w.group_size) == (q0.kind, q0.group_size) for w in ws):
        return fp8_block_tensor(np.stack([w.qdata for w in ws]), np.stack([w.scales for w in ws]), q0.group_size, name)
    return np.stack(
        [dequantize_fp8_numpy(w.qdata, w.scales, w.group_size) if isinstance(w, QuantizedTensor) else w for w in ws]
    )


class _ExpertStack:
    """Per-expert weights written one by one into stacked buffers, so that a load holds one
    expert's bytes beyond the result (a list then `_stack` held every expert twice). Float
    arrays of one shape and dtype, or ``fp8_e4m3`` `QuantizedTensor` s of one block size and
    shape, stack in place; anything else (a mix) falls back to `_stack`."""

    def __init__(self, e: int, name: str):
        self.e, self.name = e, name
        self.bufs: tuple[np.ndarray, ...] | None = None
        self.quant: tuple[str, int] | None = None
        self.items: list | None = None  # the fallback

    @staticmethod
    def _leaves(w) -> tuple[np.ndarray, ...]:
        return (np.asarray(w.qdata), np.asarray(w.scales)) if isinstance(w, QuantizedTensor) else (np.asarray(w),)

    def _entry(self, j: int):
        assert self.bufs is not None
        if self.quant is None:
            return self.bufs[0][j]
        return fp8_block_tensor(self.bufs[0][j], self.bufs[1][j], self.quant[1], self.name)

    def add(self, j: int, w) -> None:
        if self.items is not None:
            self.items.append(w)
            return
        quant = (w.kind, w.group_size) if isinstance(w, QuantizedTensor) else None
        leaves = self._leaves(w)
        if self.bufs is None:
            if quant is not None and quant[0] != "fp8_e4m3":
                self.items = [w]
                return
            self.quant = quant
            self.bufs = tuple(aligned_empty((self.e, *x.shape), x.dtype) for x in leaves)
        fits = quant == self.quant and all(
            x.shape == b.shape[1:] and x.dtype == b.dtype for x, b in zip(leaves, self.bufs, strict=True)
        )
        if not fits:
            self.items = [self._entry(i) for i in range(j)] + [w]
            return
        for x, b in zip(leaves, self.bufs, strict=True):
            b[j] = x

    def result(self):
        if self.items is not None or self.bufs is None:
            return _stack(self.items or [], self.name)
        if self.quant is None:
            return self.bufs[0]
        return fp8_block_tensor(self.bufs[0], self.bufs[1], self.quant[1], self.name)


def _experts(
    st: SafetensorsDir, p: str, cfg: MoEConfig, qlookup, dtype, keep_int4: bool, fp8_block=None, keep: bool = True
) -> ExpertWeights:
    e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
    per_expert = [names for names in _PROJ_NAMES if f"{p}.experts.0.{names[0]}.weight" in st]
    stacked = [f"{p}.{grp}" for grp in ("switch_mlp", "experts") if f"{p}.{grp}.gate_proj.weight" in st]
    fused = any(f"{p}.experts.{n}{sfx}" in st for n in ("gate_up_proj", "down_proj") for sfx in ("", "_blocks"))
    layouts = len(per_expert) + len(stacked) + int(fused)
    if layouts == 0:
        if f"{p}.gate_proj.weight" in st or f"{p}.w1.weight" in st:
            raise ValueError(f"{st.path}: {p} holds a dense MLP, not experts (is this layer dense?)")
        raise ValueError(
            f"{st.path}: no routed-expert tensors under {p!r} (looked for {p}.experts.0.gate_proj.weight, "
            f"{p}.experts.gate_up_proj, {p}.switch_mlp.gate_proj.weight)"
        )
    if layouts > 1:
        raise ValueError(f"{st.path}: {p} mixes expert layouts (per-expert / stacked / fused); refusing to guess")
    bias = {}
    if per_expert:
        g_n, u_n, d_n = per_expert[0]
        extra = f"{p}.experts.{e}.{g_n}.weight"
        if extra in st:
            raise ValueError(f"{st.path}: checkpoint holds more experts than num_experts={e} ({extra!r} exists)")
        stacks = {n: _ExpertStack(e, f"{st.path}: {p}.experts.*.{n}") for n in (g_n, u_n, d_n)}
        for j in range(e):
            for n, shp in ((g_n, (f, d)), (u_n, (f, d)), (d_n, (d, f))):
                stacks[n].add(j, read_linear(st, f"{p}.experts.{j}.{n}", shp, qlookup, False, fp8_block, keep))
        wg, wu, wd = (stacks[n].result() for n in (g_n, u_n, d_n))
    elif stacked:
        s = stacked[0]
        wg = read_linear(st, f"{s}.gate_proj", (e, f, d), qlookup, keep_int4, fp8_block, keep)
        wu = read_linear(st, f"{s}.up_proj", (e, f, d), qlookup, keep_int4, fp8_block, keep)
        wd = read_linear(st, f"{s}.down_proj", (e, d, f), qlookup, keep_int4, fp8_block, keep)
        if cfg.expert_bias:
            bias = dict(
                b_gate=_vec(st, f"{s}.gate_proj.bias", (e, f), dtype),
                b_up=_vec(st, f"{s}.up_proj.bias", (e, f), dtype),
                b_down=_vec(st, f"{s}.down_proj.bias", (e, d), dtype),
            )
    else:
        gu_name, dn_name = f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj"
        if cfg.family == "gpt_oss":
            if f"{gu_name}_blocks" in st and keep:  # MXFP4, out-major (the Hub checkpoints): kept
                # gate / up interleave output rows; each row's blocks run along d, as GGUF's do
                wg, wu = mxfp4_tensors(st, gu_name, (e, 2 * f, d), (slice(0, None, 2), slice(1, None, 2)))
                (wd,) = mxfp4_tensors(st, dn_name, (e, d, f))
            elif f"{gu_name}_blocks" in st:
                gu = read_mxfp4(st, gu_name, (e, 2 * f, d))
                wg, wu = gu[:, 0::2], gu[:, 1::2]  # (E, F, d)
                wd = read_mxfp4(st, dn_name, (e, d, f))
            else:  # input-major, gate / up interleaved
                gu = _unscaled(st, gu_name, st.get(gu_name, (e, d, 2 * f)))
                dn = _unscaled(st, dn_name, st.get(dn_name, (e, f, d)))
                wg, wu = np.swapaxes(gu[..., 0::2], -1, -2), np.swapaxes(gu[..., 1::2], -1, -2)  # (E, F, d)
                wd = np.swapaxes(dn, -1, -2)  # (E, d, F)
            if cfg.expert_bias:
                gub = st.get(f"{gu_name}_bias", (e, 2 * f))
                bias = dict(
                    b_gate=jnp.asarray(gub[..., 0::2]).astype(dtype),
                    b_up=jnp.asarray(gub[..., 1::2]).astype(dtype),
                    b_down=_vec(st, f"{dn_name}_bias", (e, d), dtype),
                )
        else:  # torch (out, in): rows [0:F] gate, [F:2F] up
            gu = _unscaled(st, gu_name, st.get(gu_name, (e, 2 * f, d)))
            wg, wu = gu[:, :f], gu[:, f:]
            wd = _unscaled(st, dn_name, st.get(dn_name, (e, d, f)))
    if cfg.expert_bias and not bias:
        raise ValueError(f"{st.path}: the config has expert biases but {p} stores none")
    return ExpertWeights(_xw(wg, dtype), _xw(wu, dtype), _xw(wd, dtype), **bias)


def _shared(
    st: SafetensorsDir, p: str, cfg: MoEConfig, qlookup, dtype, fp8_block=None, keep: bool = True
) -> SharedWeights | None:
    fs, d = cfg.shared_expert_dim, cfg.d_model
    if not fs:
        return None
    names = [f"{p}.{n}" for n in ("shared_expert", "shared_experts") if f"{p}.{n}.gate_proj.weight" in st]
    if not names:
        raise ValueError(
            f"{st.path}: missing tensor {p + '.shared_expert.gate_proj.weight'!r} "
            f"(or {p + '.shared_experts.gate_proj.weight'!r}); the config has a shared expert of width {fs}"
        )
    s = names[0]
    wg = read_linear(st, f"{s}.gate_proj", (fs, d), qlookup, fp8_block=fp8_block, keep_fp8=keep)
    wu = read_linear(st, f"{s}.up_proj", (fs, d), qlookup, fp8_block=fp8_block, keep_fp8=keep)
    wd = read_linear(st, f"{s}.down_proj", (d, fs), qlookup, fp8_block=fp8_block, keep_fp8=keep)
    gate = None
    if cfg.shared_expert_gate:
        g = read_linear(st, f"{p}.shared_expert_gate", (1, d), qlookup)
        gate = jnp.asarray(np.asarray(g, np.float32)[0]).astype(dtype)
    return SharedWeights(_xw(wg, dtype), _xw(wu, dtype), _xw(wd, dtype), gate)


def load_params(
    st: SafetensorsDir,
    cfg: MoEConfig,
    layer: int,
    dtype=jnp.float32,
    qlookup=None,
    keep_int4: bool = False,
    fp8_block: tuple[int, int] | None = None,
    keep_blocks: bool = True,
) -> MoEParams:
    """`MoEParams` of MoE layer ``layer`` (router and its biases in float32, the rest in ``dtype``).

    ``qlookup``: MLX quantization per module (`jaxmoe.io.mlx_codec.quant_lookup`); ``keep_int4``: keep
    4-bit routed experts quantized; ``fp8_block``: ``(out, in)`` block of FP8 ``weight_scale_inv``;
    ``keep_blocks``: keep gpt-oss MXFP4 experts (as GGUF MXFP4 blocks) and block-scaled FP8
    E4M3 expert / shared-expert weights with a square block (``fp8_e4m3``) in their bytes,
    instead of dequantizing them.
    """
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ValueError(f"layer must be an int, got {layer!r}")
    if not cfg.is_moe_layer(layer):  # raises for an index out of range
        raise ValueError(f"{st.path}: layer {layer} is a dense layer, not MoE (dense layers: {list(cfg.dense_layers)})")
    e, d = cfg.num_experts, cfg.d_model
    p = moe_prefix(st.keys(), layer, str(st.path))
    if (f"{p}.gate_proj.weight" in st or f"{p}.w1.weight" in st) and f"{p}.gate.weight" not in st:
        raise ValueError(f"{st.path}: {p} holds a dense MLP, not experts (is layer {layer} dense? the config says MoE)")
    rname = f"{p}.router" if f"{p}.router.weight" in st else f"{p}.gate"
    if f"{rname}.weight" not in st:
        raise ValueError(f"{st.path}: missing tensor {p + '.gate.weight'!r} (the router of layer {layer})")
    w_router = jnp.asarray(np.swapaxes(np.asarray(read_linear(st, rname, (e, d), qlookup), np.float32), 0, 1))
    b_router = None
    if cfg.router.router_bias:
        b_router = _vec(st, f"{rname}.bias", (e,), jnp.float32)
    sel = None
    if cfg.router.use_selection_bias:  # Ling / bailing checkpoints call it gate.expert_bias
        bname = f"{p}.gate.expert_bias" if f"{p}.gate.expert_bias" in st else f"{p}.gate.e_score_correction_bias"
        sel = _vec(st, bname, (e,), jnp.float32)
    experts = _experts(st, p, cfg, qlookup, dtype, keep_int4, fp8_block, keep_blocks)
    shared = _shared(st, p, cfg, qlookup, dtype, fp8_block, keep_blocks)
    params = MoEParams(w_router, experts, b_router, sel, shared)
    params.check(cfg)
    return params


def _unscaled(st: SafetensorsDir, name: str, w):
    """``w`` (fused expert tensor ``name``) unless it holds FP8 codes: no scale layout is
    known for fused FP8 experts, and codes read without their scales would be wrong."""
    if np.dtype(w.dtype) in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
        raise ValueError(
            f"{st.path}: {name} holds {np.dtype(w.dtype)} codes in a fused expert layout, whose scale "
            f"tensors jaxmoe does not know; per-expert FP8 weights with weight_scale_inv load"
        )
    return w


def fp8_block_size(raw: dict, source: str) -> tuple[int, int] | None:
    """``quantization_config.weight_block_size`` of an FP8 checkpoint (``quant_method: fp8``), else None."""
    qc = raw.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    b = qc.get("weight_block_size", [128, 128])
    if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(isinstance(v, int) and v > 0 for v in b)):
        raise ValueError(f"{source}: quantization_config.weight_block_size must be two positive ints, got {b!r}")
    return int(b[0]), int(b[1])


def load_layer(
    path: str | os.PathLike, layer: int = 0, dtype=jnp.float32, quantized: bool | None = None
) -> tuple[MoEConfig, MoEParams]:
    """``(MoEConfig, MoEParams)`` of MoE layer ``layer`` of an HF (or mlx-lm) checkpoint directory.

    Args:
      path: directory with ``config.json`` and ``*.safetensors``.
      layer: decoder layer index; a dense layer is a ValueError.
      dtype: dtype of the expert and shared-expert weights (router math is float32 always).
      quantized: read MLX quantization from ``config.json`` and keep 4-bit routed experts
        quantized (default: when it has a ``quantization`` entry). gpt-oss MXFP4 experts and
        block-scaled FP8 E4M3 weights (square ``weight_block_size``) stay in their bytes
        unless ``quantized=False``, which dequantizes them to float32 at load.
    """
    p = Path(path)
    raw = hf_config.read_config_json(p)
    cfg = hf_config.moe_config_from_hf(raw, source=str(p / "config.json"), name=p.name)
    keep_blocks = quantized is not False
    if quantized is None:
        quantized = "quantization" in raw
    fp8_block = fp8_block_size(raw, str(p / "config.json"))
    with SafetensorsDir(p) as st:
        qlookup = (
            mlx_codec.quant_lookup(hf_config.text_config(raw), st.keys(), str(p / "config.json")) if quantized else None
        )
        params = load_params(
            st,
            cfg,
            layer,
            dtype=dtype,
            qlookup=qlookup,
            keep_int4=bool(quantized),
            fp8_block=fp8_block,
            keep_blocks=keep_blocks,
        )
    return cfg, params
