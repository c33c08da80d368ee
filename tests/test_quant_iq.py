"""The IQ1-3 and ternary GGUF block kinds (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
IQ1_M, TQ1_0, TQ2_0) as resident `QuantizedTensor` kinds: the jnp decode bit-exact with
``gguf.quants.dequantize`` over any bytes, named errors for bad buffers, the C++ kernel and
the C++ kernel and the XLA impls against a float64 loop over gguf-py's dequantized
weights (the C++ backward: tests/test_impls_cpu_backward.py's frozen-expert test; ggml
activations: the oracle tests of tests/test_ggml_activations.py / test_impls_cpu_ggml.py). The GGUF file round
trip (held bytes = file bytes, ``save_gguf(dtype="keep")``) is tests/test_io_gguf.py's
``test_quantized_layer_stays_quantized`` (mixes ``iq2_xxs``, ``iq1_s``)."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from helpers import IQ_CODE_AT, gguf_block_bytes, needs_cpu_kernel, np_experts, same_bits, shrink, skewed_routing
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmoe
from jaxmoe.experts import ExpertWeights
from jaxmoe.impls.cpu import supports as cpu_supports
from jaxmoe.impls.policy import resolve_impl
from jaxmoe.params import MoEParams
from jaxmoe.quant import GGUF_BLOCKS, gguf_block_tensor
from jaxmoe.routing import Routing

IQ_KINDS = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0")
#: Where each kind's float16 ``d`` sits (IQ1_M: spread over the top nibbles of bytes 49, 51, 53, 55).
D_AT = {k: 0 for k in IQ_KINDS} | {"tq1_0": 52, "tq2_0": 64, "iq1_m": None}
EXTREMES = (0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x7C00, 0xFC00, 0x7E00, 0x8000, 0x0400)


def gguf_reference(raw: np.ndarray, kind: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, QT[kind.upper()])


def set_d(blocks: np.ndarray, kind: str, bits: int) -> None:
    """Writes the float16 bit pattern ``bits`` as every block's ``d`` (in place)."""
    at = D_AT[kind]
    if at is not None:
        blocks[:, at : at + 2] = np.array([bits], np.uint16).view(np.uint8)
        return
    sw = blocks[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
    for i in range(4):
        sw[:, i] |= np.uint16(((bits >> (4 * i)) & 0xF) << 12)
    blocks[:, 48:56] = sw.view(np.uint8)


def decode(raw: np.ndarray, kind: str) -> np.ndarray:
    """The jnp decode (jitted) of blocks ``[..., n * block_bytes]`` -> ``[..., n * 256]`` (gguf-py's layout)."""
    w = jax.tree.map(jnp.asarray, gguf_block_tensor(raw, kind))
    return np.swapaxes(np.asarray(jax.jit(lambda t: t.dequantize(jnp.float32))(w)), -1, -2)


def test_block_sizes_match_ggml():
    for kind in IQ_KINDS:
        assert GGUF_BLOCKS[kind] == GGML_QUANT_SIZES[QT[kind.upper()]], kind


@pytest.mark.parametrize("kind", IQ_KINDS)
def test_random_bytes_and_extreme_scales_bit_exact(kind):
    """Random bytes (every code, sign and sub-scale pattern), then the same with each extreme
    float16 ``d`` (largest, smallest subnormal, +-inf, NaN, -0, the smallest normal): the
    decode equals gguf-py's bit for bit."""
    size = GGUF_BLOCKS[kind][1]
    rng = np.random.default_rng(sum(map(ord, kind)))
    raw = rng.integers(0, 256, (len(EXTREMES) + 1, 6, 2 * size), dtype=np.uint8)
    for i, bits in enumerate(EXTREMES):
        set_d(raw[i].reshape(-1, size), kind, bits)
    same_bits(decode(raw, kind), gguf_reference(raw, kind))


@st.composite
def buffers(draw):
    kind = draw(st.sampled_from(IQ_KINDS))
    size = GGUF_BLOCKS[kind][1]
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    shape = (*lead, draw(st.integers(1, 4)), draw(st.integers(1, 3)) * size)
    raw = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, shape, dtype=np.uint8)
    extreme = draw(st.sampled_from((None, *EXTREMES)))
    if extreme is not None:
        set_d(raw.reshape(-1, size), kind, extreme)
    return kind, raw


@settings(max_examples=12, deadline=None)
@given(buffers())
@pytest.mark.slow
def test_hypothesis_any_bytes_bit_exact(case):
    kind, raw = case
    same_bits(np.swapaxes(np.asarray(gguf_block_tensor(raw, kind).dequantize()), -1, -2), gguf_reference(raw, kind))


@pytest.mark.parametrize("kind", IQ_KINDS)
def test_a_flipped_code_or_scale_changes_the_output(kind, rng):
    """A flipped code byte and a changed ``d`` each change the decode of their row only, as
    gguf-py does (so the tests above can fail)."""
    size = GGUF_BLOCKS[kind][1]
    raw = gguf_block_bytes(rng, QT[kind.upper()], (2, 256))
    base = decode(raw, kind)
    d_at = D_AT[kind] if D_AT[kind] is not None else 49  # IQ1_M: bits 4-7 of d in byte 49's top nibble
    for at, flip in ((IQ_CODE_AT[kind], 0x0F), (d_at, 0x05 if kind != "iq1_m" else 0x50)):
        bad = raw.copy()
        bad[1, at] ^= flip
        got = decode(bad, kind)
        assert not np.array_equal(got[1], base[1]), (kind, at)
        np.testing.assert_array_equal(got[0], base[0])
        same_bits(got, gguf_reference(bad, kind))
    assert raw.shape == (2, size)


@pytest.mark.parametrize("kind", IQ_KINDS)
def test_bad_buffers_are_named_errors(kind, rng):
    block, size = GGUF_BLOCKS[kind]
    raw = gguf_block_bytes(rng, QT[kind.upper()], (3, 2 * block))
    up = kind.upper()
    with pytest.raises(
        ValueError, match=rf"blk\.2\.ffn_up_exps\.weight \({up}, block 256 in {size} bytes\).*truncated"
    ):
        gguf_block_tensor(raw[:, :-1], kind, name="blk.2.ffn_up_exps.weight")
    with pytest.raises(ValueError, match=rf"w_down \({up}\).*\(3, {2 * size}\).*width 768.*{3 * size} bytes"):
        gguf_block_tensor(raw, kind, n_in=768, name="w_down")
    with pytest.raises(ValueError, match=rf"w \({up}\): input width 300 is not a multiple of the block size 256"):
        gguf_block_tensor(raw, kind, n_in=300, name="w")
    with pytest.raises(ValueError, match=rf"{up}.*uint8.*int8"):
        gguf_block_tensor(raw.view(np.int8), kind)


# ----------------------------------------------------------------------------- impls vs float64


def layer(rng, kinds, e: int, d: int = 256, f: int = 256):
    """(cfg, params, float64 weights [E, in, out]) of a layer whose experts are ``kinds`` blocks."""
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"), d=d, f=f, e=e)
    raws = [
        gguf_block_bytes(rng, QT[kinds[0].upper()], (e, f, d)),
        gguf_block_bytes(rng, QT[kinds[1].upper()], (e, f, d)),
        gguf_block_bytes(rng, QT[kinds[2].upper()], (e, d, f)),
    ]
    ws = [jax.tree.map(jnp.asarray, gguf_block_tensor(r, k)) for r, k in zip(raws, kinds)]
    params = MoEParams(w_router=jnp.asarray(rng.standard_normal((d, e)).astype(np.float32)), experts=ExpertWeights(*ws))
    ref = {
        n: np.swapaxes(gguf_reference(r, k), -1, -2).astype(np.float64)
        for n, r, k in zip(("w_gate", "w_up", "w_down"), raws, kinds)
    }
    return cfg, params, ref, raws


MIXES = [("iq2_xxs", "iq2_xs", "iq2_s"), ("iq3_xxs", "iq3_s", "iq1_s"), ("iq1_m", "tq1_0", "tq2_0")]


def run(params, x, cfg, impl, ids, ws, **kw):
    cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, top_k=ids.shape[1]))
    routing = Routing(jnp.asarray(ids), jnp.asarray(ws))
    return np.asarray(jaxmoe.moe_apply(params, jnp.asarray(x), cfg, impl=impl, routing=routing, **kw)), cfg


@pytest.mark.parametrize("kinds", MIXES)
@pytest.mark.parametrize("impl", ["xla", "xla_tiled"])
@pytest.mark.slow
def test_xla_impls_match_float64(kinds, impl, rng):
    e = 6
    cfg, params, ref, _ = layer(rng, kinds, e)
    for t in (1, 9):
        ids, ws = skewed_routing(rng, t, 2, e)
        x = rng.standard_normal((t, cfg.d_model)).astype(np.float32)
        y, c = run(params, x, cfg, impl, ids, ws)
        want = np_experts(x, ids, ws, ref, c)
        assert np.abs(y - want).max() <= 2e-5 * np.abs(want).max(), (impl, kinds, t)


# ----------------------------------------------------------------------------- the C++ kernel


def test_cpu_grid_tables_are_gguf_quants_grids():
    """iq_kinds.h's packed grids and sign table, row for row, against ``gguf.quants``' own
    (its ``init_grid`` unpacking of ggml's grids; ``IQ2_XXS.ksigns``)."""
    import re
    from pathlib import Path

    from pallas_kernels.gguf import grid_tables

    src = (Path(jaxmoe.__file__).parent / "impls" / "cpu" / "iq_kinds.h").read_text()

    def table(name: str) -> np.ndarray:
        body = re.search(rf"{name}\[(\d+)\] = \{{(.*?)\}};", src, re.S)
        assert body is not None, name
        vals = np.array([int(v, 16) for v in re.findall(r"0x[0-9a-f]+", body.group(2))], np.int64)
        assert len(vals) == int(body.group(1)), name
        return vals

    names = {
        "iq2_xxs": "IQ2XXS",
        "iq2_xs": "IQ2XS",
        "iq2_s": "IQ2S",
        "iq3_xxs": "IQ3XXS",
        "iq3_s": "IQ3S",
        "iq1_s": "IQ1S",
    }
    for kind, n in names.items():
        grid, ksigns, _ = grid_tables(kind)
        levels = np.asarray(getattr(gguf.quants, kind.upper()).grid_map, np.float32)
        bits = 2 if len(levels) <= 4 else 3
        packed = table(f"kGrid{n}")
        idx = (packed[:, None] >> (bits * np.arange(grid.shape[1]))) & ((1 << bits) - 1)
        np.testing.assert_array_equal(levels[idx], grid, err_msg=kind)
    np.testing.assert_array_equal(table("kKSigns"), grid_tables("iq2_xxs")[1])


@needs_cpu_kernel()
@pytest.mark.parametrize("kinds", MIXES)
def test_cpu_kernel_matches_float64(kinds, rng):
    """The C++ kernel reads each kind in place: T = 1 (per-column block decode in the tiles)
    and T = 40 (a decoded tile buffer per expert), within float rounding of the float64 loop
    over gguf-py's dequantized weights; ``auto`` takes the kernel for them."""
    e = 6
    cfg, params, ref, _ = layer(rng, kinds, e)
    assert cpu_supports(params.experts, jnp.float32) is None
    for t in (1, 40):
        ids, ws = skewed_routing(rng, t, 2, e)
        x = rng.standard_normal((t, cfg.d_model)).astype(np.float32)
        y, c = run(params, x, cfg, "cpu", ids, ws)
        want = np_experts(x, ids, ws, ref, c)
        assert np.abs(y - want).max() <= 2e-6 * np.abs(want).max(), (kinds, t)
    assert resolve_impl("auto", 80, "cpu", experts=params.experts) == "cpu"


@needs_cpu_kernel()
@pytest.mark.parametrize(
    "kind", [k if k in ("iq2_xs", "iq1_m", "tq1_0") else pytest.param(k, marks=pytest.mark.slow) for k in IQ_KINDS]
)
def test_cpu_kernel_a_flipped_code_byte_changes_the_output(kind, rng):
    """One code byte of the down weight of an expert every token uses, flipped: the kernel's
    output changes, and matches the float64 loop over the flipped bytes (so the test above
    can fail)."""
    e = 3
    cfg, params, ref, raws = layer(rng, ("q4_k", "q4_k", kind), e)
    ids = np.zeros((5, 1), np.int32)
    ws = np.ones((5, 1), np.float32)
    x = rng.standard_normal((5, cfg.d_model)).astype(np.float32)
    y0, c = run(params, x, cfg, "cpu", ids, ws)
    bad = raws[2].copy()
    bad[0, 7, IQ_CODE_AT[kind]] ^= 0x0F  # expert 0, output 7, the first block
    ew = dataclasses.replace(params.experts, w_down=jax.tree.map(jnp.asarray, gguf_block_tensor(bad, kind)))
    y1, _ = run(dataclasses.replace(params, experts=ew), x, cfg, "cpu", ids, ws)
    assert not np.array_equal(y0[:, 7], y1[:, 7])
    np.testing.assert_array_equal(np.delete(y0, 7, axis=1), np.delete(y1, 7, axis=1))
    want = np_experts(x, ids, ws, {**ref, "w_down": np.swapaxes(gguf_reference(bad, kind), -1, -2)}, c)
    assert np.abs(y1 - want).max() <= 2e-6 * np.abs(want).max()


# ----------------------------------------------------------------------------- Pallas


@pytest.mark.parametrize("t", [3, 40])
@pytest.mark.slow
def test_pallas_decodes_them_with_xla_first(t, rng):
    """The Pallas impl (interpret mode), decode (T k <= 64) and grouped paths: the kinds have
    no in-kernel decode (not `TILE_KINDS`), so `kernel_weight` decodes them with XLA into
    float experts before the kernels; the result matches the float64 loop."""
    from jaxmoe.execution import ExecConfig as Ex
    from jaxmoe.impls.pallas import experts_pallas
    from pallas_kernels.gguf import TILE_KINDS

    kinds = ("iq2_xxs", "iq3_s", "tq1_0")
    assert not set(kinds) & set(TILE_KINDS)
    e = 6
    cfg, params, ref, _ = layer(rng, kinds, e)
    ids, ws = skewed_routing(rng, t, 2, e)
    cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, top_k=2))
    x = rng.standard_normal((t, cfg.d_model)).astype(np.float32)
    run = jax.jit(lambda x, r, ew: experts_pallas(x, r, ew, cfg, Ex(interpret=True)))
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    y = np.asarray(run(jnp.asarray(x), r, params.experts))
    want = np_experts(x, ids, ws, ref, cfg)
    assert np.abs(y - want).max() <= 1e-4 * np.abs(want).max()
    assert "256x256xf32>" in run.lower(jnp.asarray(x), r, params.experts).as_text()  # the XLA-decoded experts
