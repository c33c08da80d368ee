"""GGUF block kinds of `QuantizedTensor` (Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL,
IQ4_XS, MXFP4, and the IQ1-3 / TQ kinds, also in tests/test_quant_iq.py): the raw block
bytes kept as stored, decoded in jnp bit-exact with ``gguf.quants.dequantize``, validated with
named errors, and run by the reference impls against a float64 numpy forward."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from helpers import IQ_CODE_AT, gguf_block_bytes, np_experts, same_bits, shrink, skewed_routing
from hypothesis import given
from hypothesis import strategies as st

import jaxmoe
from jaxmoe.experts import ExpertWeights
from jaxmoe.params import MoEParams
from jaxmoe.quant import GGUF_BLOCKS, QuantizedTensor, dequantize_gguf_rows, gguf_block_tensor, materialize
from jaxmoe.routing import Routing

KINDS = list(GGUF_BLOCKS)
IQ_SCALE_AT = {k: 0 for k in IQ_CODE_AT} | {"iq1_m": 49, "tq1_0": 52, "tq2_0": 64}


def qtype(kind: str) -> QT:
    return QT[kind.upper()]


def gguf_reference(raw: np.ndarray, kind: str) -> np.ndarray:
    """gguf-py's float32 ``[..., out, in]`` of block bytes, swapped to the logical ``[..., in, out]``."""
    with np.errstate(all="ignore"):
        return np.swapaxes(gguf.quants.dequantize(raw, qtype(kind)), -1, -2)


def test_block_table_matches_ggml():
    for kind, (block, size) in GGUF_BLOCKS.items():
        assert GGML_QUANT_SIZES[qtype(kind)] == (block, size), kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_realistic_blocks_bit_exact(kind, rng):
    block, size = GGUF_BLOCKS[kind]
    raw = gguf_block_bytes(rng, qtype(kind), (3, 5, 2 * block))  # [E, out, in]
    w = gguf_block_tensor(raw, kind, n_in=2 * block)
    assert w.shape == (3, 2 * block, 5) and w.ndim == 3
    assert w.nbytes == raw.nbytes == 3 * 5 * 2 * size
    same_bits(w.dequantize(jnp.float32), gguf_reference(raw, kind))
    same_bits(jax.jit(lambda t: t.dequantize(jnp.float32))(jax.tree.map(jnp.asarray, w)), gguf_reference(raw, kind))
    # materialize in a low dtype is the float32 decode rounded once
    np.testing.assert_array_equal(
        np.asarray(materialize(w, jnp.bfloat16)),
        np.asarray(jnp.asarray(gguf_reference(raw, kind)).astype(jnp.bfloat16)),
    )


@st.composite
def block_buffers(draw):
    kind = draw(st.sampled_from(KINDS))
    block, size = GGUF_BLOCKS[kind]
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    out = draw(st.integers(1, 4))
    nb = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).integers(0, 256, (*lead, out, nb * size), dtype=np.uint8)
    # float16 scale fields: random bits, or forced extreme (max finite, subnormal, inf, nan, -0);
    # MXFP4's E8M0 exponent byte: random, or the extremes (subnormal, overflowing and largest scales)
    extreme = draw(st.sampled_from([None, 0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x7C00, 0xFC00, 0x7E00, 0x8000]))
    blocks = raw.reshape(-1, size)
    if kind == "mxfp4":
        e = draw(st.sampled_from([None, 0, 1, 2, 3, 126, 127, 128, 253, 254, 255]))
        if e is not None:
            blocks[:, 0] = e
    elif kind == "iq1_m" and extreme is not None:  # d's bits in the top nibbles of the 4 scale words
        sw = blocks[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for i in range(4):
            sw[:, i] |= np.uint16(((extreme >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = sw.view(np.uint8)
    elif extreme is not None:
        at = {"q6_k": [size - 2], "q3_k": [size - 2], "q2_k": [size - 4, size - 2]}.get(kind)
        at = at or {"tq1_0": [size - 2], "tq2_0": [size - 2]}.get(kind)
        at = at or ([0, 2] if kind in ("q4_1", "q5_1", "q4_k", "q5_k") else [0])
        for o in at:
            blocks[:, o : o + 2] = np.array([extreme], np.uint16).view(np.uint8)
    return kind, raw


@given(block_buffers())
@pytest.mark.slow
def test_random_bytes_bit_exact(case):
    """Any bytes, including inf / nan / subnormal / max scales: the jnp decode equals gguf-py's
    bit for bit (NaN where gguf-py gives NaN)."""
    kind, raw = case
    w = gguf_block_tensor(raw, kind)
    same_bits(w.dequantize(jnp.float32), gguf_reference(raw, kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_one_mutation_changes_the_output(kind, rng):
    """A flipped code nibble and a changed scale byte each change the decoded weights where
    gguf-py says they should (so the test above can fail)."""
    block, size = GGUF_BLOCKS[kind]
    raw = gguf_block_bytes(rng, qtype(kind), (2, block))
    base = np.asarray(gguf_block_tensor(raw, kind).dequantize())
    code_at = {
        "q4_0": 10,
        "q4_1": 10,
        "q5_0": 12,
        "q5_1": 14,
        "q4_k": 50,
        "q5_k": 90,
        "q6_k": 20,
        "q2_k": 30,
        "q3_k": 50,
    }
    code_at = code_at.get(kind) or {"iq4_nl": 10, "iq4_xs": 50, "mxfp4": 10}.get(kind) or IQ_CODE_AT[kind]
    scale_at = {"q4_0": 1, "q4_1": 1, "q5_0": 1, "q5_1": 3, "q4_k": 6, "q5_k": 6, "q6_k": 195, "q2_k": 3, "q3_k": 100}
    scale_at = scale_at.get(kind, {"iq4_nl": 1, "iq4_xs": 5, "mxfp4": 0, **IQ_SCALE_AT}.get(kind))
    assert scale_at is not None, kind
    for at, flip in ((code_at, 0x0F), (scale_at, 0x05)):
        bad = raw.copy()
        bad[1, at] ^= flip
        got = np.asarray(gguf_block_tensor(bad, kind).dequantize())
        assert not np.array_equal(got, base), (kind, at)
        same_bits(got, gguf_reference(bad, kind))
        np.testing.assert_array_equal(got[:, 0], base[:, 0])  # the other row is untouched


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_getitem_over_experts(kind, rng):
    block, _ = GGUF_BLOCKS[kind]
    raw = gguf_block_bytes(rng, qtype(kind), (4, 3, block))
    w = jax.tree.map(jnp.asarray, gguf_block_tensor(raw, kind))
    ids = jnp.array([3, 0, 3])
    sub = w[ids]
    assert isinstance(sub, QuantizedTensor) and sub.kind == kind and sub.shape == (3, block, 3)
    same_bits(sub.dequantize(), gguf_reference(raw[np.array([3, 0, 3])], kind))
    one = w[2]
    assert one.shape == (block, 3)
    same_bits(one.dequantize(), gguf_reference(raw[2], kind))
    # the ExpertWeights / jit path: a leaf with None scales passes through jit and take()
    ew = ExpertWeights(w, w, w)
    taken = jax.jit(lambda e: e.take(jnp.array([1])))(ew)
    same_bits(taken.w_up.dequantize(), gguf_reference(raw[1:2], kind))


def test_bad_buffers_are_named_errors(rng):
    raw = gguf_block_bytes(rng, QT.Q4_K, (2, 256))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up_exps\.weight.*Q4_K.*\(2, 143\).*truncated"):
        gguf_block_tensor(raw[:, :-1], "q4_k", name="blk.0.ffn_up_exps.weight")
    with pytest.raises(ValueError, match=r"w_down \(Q6_K\).*\(2, 144\).*width 256.*210 bytes"):
        gguf_block_tensor(raw, "Q6_K", n_in=256, name="w_down")
    with pytest.raises(ValueError, match=r"w \(Q5_0\): input width 300 is not a multiple of the block size 32"):
        gguf_block_tensor(np.zeros((2, 22 * 9), np.uint8), "q5_0", n_in=300, name="w")
    with pytest.raises(ValueError, match=r"w: GGUF type 'nvfp4'.*\(2, 144\).*expected one of"):
        gguf_block_tensor(raw, "nvfp4", name="w")
    with pytest.raises(ValueError, match=r"uint8.*int8"):
        gguf_block_tensor(raw.view(np.int8), "q4_k")
    with pytest.raises(ValueError, match=r"scales/biases must be None"):
        QuantizedTensor(raw, raw[:, :1], None, "q4_k", 256)
    with pytest.raises(ValueError, match=r"group_size must be the block size 256, got 32"):
        QuantizedTensor(raw, None, None, "q4_k", 32)
    with pytest.raises(ValueError, match=r"unknown 'nvfp4'"):
        QuantizedTensor(raw, None, None, "nvfp4", 256)
    with pytest.raises(ValueError, match=r"keeps raw GGUF blocks"):
        gguf_block_tensor(raw, "q4_k").codes()
    mx = gguf_block_bytes(rng, QT.MXFP4, (2, 64))  # odd 17-byte blocks
    with pytest.raises(ValueError, match=r"w_up \(MXFP4, block 32 in 17 bytes\).*\(2, 33\).*truncated"):
        gguf_block_tensor(mx[:, :-1], "mxfp4", name="w_up")
    xs = gguf_block_bytes(rng, QT.IQ4_XS, (3, 256))
    with pytest.raises(ValueError, match=r"w_gate \(IQ4_XS\).*\(3, 136\).*width 512.*272 bytes"):
        gguf_block_tensor(xs, "iq4_xs", n_in=512, name="w_gate")
    with pytest.raises(ValueError, match=r"Q3_K.*uint8.*float32"):
        QuantizedTensor(np.zeros((2, 110), np.float32), None, None, "q3_k", 256)


# ----------------------------------------------------------------------------- the reference impls


def layer(rng, kinds: tuple[str, str, str], e: int, d: int, f: int):
    """(cfg, params, float64 numpy weights) of a qwen3-moe-style layer whose experts are GGUF blocks."""
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"), d=d, f=f, e=e)
    raws = [
        gguf_block_bytes(rng, qtype(kinds[0]), (e, f, d)),
        gguf_block_bytes(rng, qtype(kinds[1]), (e, f, d)),
        gguf_block_bytes(rng, qtype(kinds[2]), (e, d, f)),
    ]
    ws = [jax.tree.map(jnp.asarray, gguf_block_tensor(r, k)) for r, k in zip(raws, kinds)]
    params = MoEParams(w_router=jnp.asarray(rng.standard_normal((d, e)).astype(np.float32)), experts=ExpertWeights(*ws))
    np_w = {n: gguf_reference(r, k).astype(np.float64) for n, r, k in zip(("w_gate", "w_up", "w_down"), raws, kinds)}
    return cfg, params, np_w


@pytest.mark.parametrize(
    "kinds,d,f",
    [
        (("q4_k", "q4_k", "q6_k"), 256, 256),
        (("q5_k", "q4_k", "q5_k"), 256, 256),
        (("q4_1", "q5_0", "q5_1"), 64, 96),
        (("q2_k", "q3_k", "iq4_xs"), 256, 256),
        (("iq4_nl", "mxfp4", "mxfp4"), 64, 96),
        (("q4_0", "q4_0", "q4_0"), 64, 96),
    ],
)
@pytest.mark.parametrize("impl", ["xla", "xla_tiled", "gather", "dense", "auto"])
@pytest.mark.slow
def test_reference_impls_on_block_experts(kinds, d, f, impl, rng):
    """Mixed block kinds in one layer, one hot expert, empty experts, T = 1, 7, 9, against a
    float64 numpy loop over weights dequantized by gguf-py."""
    e, k = 8, 2
    cfg, params, np_w = layer(rng, kinds, e, d, f)
    cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, top_k=k))
    for t in (1, 7, 9):
        ids, ws = skewed_routing(rng, t, k, e)
        x = rng.standard_normal((t, d)).astype(np.float32)
        routing = Routing(jnp.asarray(ids), jnp.asarray(ws))
        y = np.asarray(jaxmoe.moe_apply(params, jnp.asarray(x), cfg, impl=impl, routing=routing))
        want = np_experts(x, ids, ws, np_w, cfg)
        err = np.abs(y - want).max() / np.abs(want).max()
        assert err < 2e-5, (impl, kinds, t, err)


def test_rows_decode_matches_block_decode(rng):
    raw = gguf_block_bytes(rng, QT.Q5_K, (3, 512))
    same_bits(dequantize_gguf_rows(jnp.asarray(raw), "q5_k"), gguf.quants.dequantize(raw, QT.Q5_K))


@pytest.mark.parametrize("t", [16, 64])
@pytest.mark.slow
def test_jitted_layer_with_block_shared_expert_matches_eager(t, rng):
    """A jitted layer whose shared expert is Q5_0 (gate/up) and Q8_0 (down) beside float routed
    experts equals the eager layer: XLA:CPU miscompiled the fused dequantization here (4%
    errors) until `materialize` put an optimization barrier after each dequantized weight."""
    d, fs = 256, 256
    base = jaxmoe.load_config("qwen2-57b-a14b")
    cfg = shrink(base, d=d, f=64, e=8)
    cfg = dataclasses.replace(cfg, shared_expert_dim=fs, num_shared_experts=1)
    p = jaxmoe.init_params(cfg, jax.random.key(int(rng.integers(1 << 30))))
    gate = gguf_block_tensor(gguf_block_bytes(rng, QT.Q5_0, (fs, d)), "q5_0")
    up = gguf_block_tensor(gguf_block_bytes(rng, QT.Q5_0, (fs, d)), "q5_0")
    down = jaxmoe.quant.quantize_int8(rng.standard_normal((fs, d)).astype(np.float32) * 0.05)
    shared = dataclasses.replace(p.shared, w_gate=jax.tree.map(jnp.asarray, gate), w_up=jax.tree.map(jnp.asarray, up))
    p = dataclasses.replace(p, shared=dataclasses.replace(shared, w_down=down))
    x = jnp.asarray(rng.standard_normal((t, d)).astype(np.float32))
    eager = np.asarray(jaxmoe.moe_apply(p, x, cfg, impl="dense"))
    jitted = np.asarray(jax.jit(lambda p, x: jaxmoe.moe_apply(p, x, cfg, impl="dense"))(p, x))
    err = np.abs(jitted - eager).max() / np.abs(eager).max()
    assert err < 1e-5, err
