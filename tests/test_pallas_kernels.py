"""Pallas kernels in interpret mode against their pure-jnp references, a float64 loop,
gguf-py's quantizers, and `experts_dense` through the full block.

Every kernel output buffer starts NaN-filled (aliased into the kernel), so a row or
column the kernel fails to write shows up as NaN.
"""

import dataclasses
import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import quants as gq
from helpers import gguf_block_weight, shrink

import jaxmoe
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.execution import ExecConfig
from jaxmoe.impls.pallas import experts_pallas, kernel_weight
from jaxmoe.quant import GGUF_BLOCKS, QuantizedTensor, pack_int4, quantize_int4_affine, quantize_int8
from pallas_kernels import tuning
from pallas_kernels.common import Activation
from pallas_kernels.decode import (
    combine_pairs,
    decode_down,
    decode_down_reference,
    decode_gate_up,
    decode_gate_up_reference,
)
from pallas_kernels.down import combine, down_project, down_project_reference
from pallas_kernels.gguf import TILE_KINDS
from pallas_kernels.gmm import gmm, gmm_reference
from pallas_kernels.launch import DecodeLaunch, Launch, Plan
from pallas_kernels.quant import (
    QuantWeight,
    as_words,
    dequantize_reference,
    split_tf32,
    tile_matmul,
    weight_operands,
    word_bytes,
)
from pallas_kernels.swiglu import gate_up_swiglu, gate_up_swiglu_reference

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
KINDS = ("f32", "bf16", "int8", "int4_mlx64", "q4_0")


# ---------------------------------------------------------------- helpers


def q8_0_from_gguf(w: np.ndarray) -> QuantizedTensor:
    """Logical ``[E, K, N]`` -> int8 QuantizedTensor via gguf-py's Q8_0 bytes."""
    t = np.ascontiguousarray(np.swapaxes(w, -1, -2), np.float32)  # [E, N, K]
    raw = gq.quantize(t, gguf.GGMLQuantizationType.Q8_0).reshape(*t.shape[:-1], -1, 34)
    d = raw[..., :2].copy().view(np.float16)[..., 0]
    q = raw[..., 2:].copy().view(np.int8).reshape(t.shape)
    return QuantizedTensor(jnp.asarray(q), jnp.asarray(d), None, "int8", 32)


def q4_0_from_gguf(w: np.ndarray) -> QuantizedTensor:
    """Logical ``[E, K, N]`` -> int4 QuantizedTensor (scale d, bias -8d) via Q4_0 bytes."""
    t = np.ascontiguousarray(np.swapaxes(w, -1, -2), np.float32)
    raw = gq.quantize(t, gguf.GGMLQuantizationType.Q4_0).reshape(*t.shape[:-1], -1, 18)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = raw[..., 2:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(t.shape)  # element j, j+16 of each block
    return QuantizedTensor(jnp.asarray(pack_int4(codes)), jnp.asarray(d), jnp.asarray(-8 * d), "int4", 32)


def gguf_dequant(kind: str, w_float: np.ndarray) -> np.ndarray:
    """gguf-py's quantize-then-dequantize of a logical ``[E, K, N]`` weight."""
    t = np.ascontiguousarray(np.swapaxes(w_float, -1, -2), np.float32)
    qt = gguf.GGMLQuantizationType.Q8_0 if kind == "int8" else gguf.GGMLQuantizationType.Q4_0
    return np.swapaxes(gq.dequantize(gq.quantize(t, qt), qt), -1, -2)


def make_weight(rng, shape, kind):
    """A random ``[E, K, N]`` expert weight of ``kind`` as a kernel operand (array or
    `QuantWeight`) and its float32 dequantized value."""
    w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    if kind == "f32":
        return jnp.asarray(w), w
    if kind == "bf16":
        a = jnp.asarray(w, jnp.bfloat16)
        return a, np.asarray(a.astype(jnp.float32))
    if kind == "int8":
        qt = q8_0_from_gguf(w)
    elif kind == "q4_0":
        qt = q4_0_from_gguf(w)
    else:
        qt = quantize_int4_affine(w, group_size=64)
    return kernel_weight(qt), np.asarray(qt.dequantize(jnp.float32))


def compute_dtype(kind):
    return jnp.bfloat16 if kind == "bf16" else jnp.float32


def routing_ids(rng, scenario: str, t: int, k: int, e: int) -> np.ndarray:
    """``[T, k]`` expert ids for a test scenario (kernels do not need distinct slots)."""
    if scenario == "one_expert":
        return np.full((t, k), e // 2, np.int32)
    if scenario == "uneven":  # skewed, with two experts never chosen
        pr = rng.dirichlet(np.full(e, 0.3))
        pr[[0, e - 2]] = 0
        pr /= pr.sum()
        return np.stack([rng.choice(e, size=k, replace=False, p=pr) for _ in range(t)]).astype(np.int32)
    return np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)]).astype(np.int32)


def nan_buf(shape, dtype):
    return jnp.full(shape, jnp.nan, dtype)


def assert_close(got, want, dtype, msg=""):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert not np.isnan(got).any(), f"{msg}: unwritten (NaN) entries at {np.argwhere(np.isnan(got))[:5]}"
    np.testing.assert_allclose(got, want, err_msg=msg, **TOL[dtype])


def plan_meta(plan):
    """The kernels' `Plan` of a `jaxmoe.dispatch` plan."""
    return Plan(plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)


# ---------------------------------------------------------------- quantized tiles


@pytest.mark.parametrize("kind", ["int8", "q4_0", "int4_mlx64"])
def test_dequantize_reference_matches_core_and_gguf(rng, kind):
    w, wf = make_weight(rng, (3, 128, 48), kind)
    lay, arrs = weight_operands(w, "w")
    got = np.asarray(dequantize_reference(lay, arrs))
    np.testing.assert_allclose(got, wf, rtol=0, atol=0)  # == QuantizedTensor.dequantize
    if kind != "int4_mlx64":  # independent: gguf-py's own dequantizer of the same bytes
        src = (rng.standard_normal((2, 64, 40)) / 8).astype(np.float32)
        qt = q8_0_from_gguf(src) if kind == "int8" else q4_0_from_gguf(src)
        lay, arrs = weight_operands(kernel_weight(qt), "w")
        np.testing.assert_allclose(
            np.asarray(dequantize_reference(lay, arrs)), gguf_dequant(kind, src), rtol=1e-6, atol=1e-7
        )


# ---------------------------------------------------------------- GGUF block kinds in the kernels


@pytest.mark.parametrize("kind", TILE_KINDS)
@pytest.mark.slow
def test_gguf_block_tiles_every_kind(rng, kind):
    """A GGUF block weight reaches the kernels as the file's bytes and is decoded per tile:
    the plain gmm at K steps of 32 (part of a scale group's super-block), 64, 256 (one
    super-block) and 512 (several), ragged N, and the decode kernel, against float64 products
    with gguf.quants' decoding of the same bytes. The pure-jnp reference decoder equals
    gguf.quants bit for bit."""
    e, k_in, n, bm = 4, 512, 48, 16
    qw, w64 = gguf_block_weight(rng, kind, (e, n, k_in))  # stored [E, out, in]; w64 logical [E, in, out]
    w = kernel_weight(qw)
    lay, arrs = weight_operands(w, "w")
    assert (lay.kind, lay.k, lay.n, arrs[0].dtype) == (kind, k_in, n, jnp.uint16)
    assert arrs[0].size * 2 == qw.qdata.size  # the file's bytes, no float copy
    np.testing.assert_array_equal(np.asarray(dequantize_reference(lay, arrs)), w64.astype(np.float32))
    sizes = np.array([5, 0, 33, 9])
    ids = jnp.asarray(np.repeat(np.arange(e), sizes).reshape(-1, 1).astype(np.int32))
    plan = plan_dispatch(ids, e, bm)
    lhs = rng.standard_normal((sizes.sum(), k_in))
    want = np.einsum("pk,pkn->pn", lhs, w64[np.repeat(np.arange(e), sizes)])
    tol = dict(rtol=0, atol=2e-5 * np.abs(want).max())
    for bk in (32, 64, 256, 512):
        lc = Launch(block_m=bm, block_n=32, block_k=bk, interpret=True)
        y = gmm(jnp.asarray(lhs, jnp.float32), w, plan_meta(plan), launch=lc)
        np.testing.assert_allclose(np.asarray(y), want, err_msg=f"{kind} gmm block_k={bk}", **tol)
    t, k = 3, 2
    dids = jnp.asarray(routing_ids(rng, "random", t, k, e))
    h = rng.standard_normal((t * k, k_in))
    y = decode_down(jnp.asarray(h, jnp.float32), dids, w, launch=DecodeLaunch(block_n=32, block_k=128, interpret=True))
    want = np.einsum("pk,pkn->pn", h, w64[np.asarray(dids).reshape(-1)])
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=f"{kind} decode")


def test_gguf_block_operand_errors(rng):
    """A truncated block buffer, scales given beside the blocks, a wrong group size or
    dtype: ValueError naming the weight, the type and the shapes."""
    qw, _ = gguf_block_weight(rng, "q4_k", (2, 16, 256))
    raw = jnp.asarray(qw.qdata)
    with pytest.raises(ValueError, match=r"w_up \(Q4_K, block 256 in 144 bytes\): rows of 143 bytes .*truncated"):
        weight_operands(QuantWeight(raw[..., :143], None, None, "q4_k", 256), "w_up")
    with pytest.raises(ValueError, match=r"w_up \(Q4_K.*scales/biases must be None"):
        weight_operands(QuantWeight(raw, jnp.ones((2, 16, 1)), None, "q4_k", 256), "w_up")
    with pytest.raises(ValueError, match=r"w_up \(Q4_K.*group_size must be the block size 256, got 32"):
        weight_operands(QuantWeight(raw, None, None, "q4_k", 32), "w_up")
    with pytest.raises(ValueError, match=r"w_up \(Q4_K.*block bytes must be uint8, got int8"):
        weight_operands(QuantWeight(raw.astype(jnp.int8), None, None, "q4_k", 256), "w_up")
    with pytest.raises(ValueError, match=r"w_down \(Q4_K.*K=256, expected 512"):
        weight_operands(kernel_weight(qw), "w_down", 2, 512, 16)


# ---------------------------------------------------------------- grouped kernels


GROUPED_CASES = [  # (scenario, T, k, E, weight kind): every kind and every scenario at least once
    ("uneven", 37, 2, 8, "f32"),
    ("uneven", 37, 2, 8, "int8"),
    ("one_expert", 21, 2, 8, "bf16"),
    ("one_expert", 21, 2, 8, "q4_0"),
    ("t1", 1, 2, 8, "int4_mlx64"),
    ("t1", 1, 2, 8, "f32"),
    ("random", 50, 4, 16, "bf16"),
]


@pytest.mark.parametrize("scenario,t,k,e,kind", GROUPED_CASES)
@pytest.mark.slow
def test_gate_up_and_down_grouped(rng, scenario, t, k, e, kind):
    """Ragged everywhere: T*k rows vs block_m 16, d = F = 192 vs blocks of 128."""
    d, f, bm = 192, 192, 16
    dt = compute_dtype(kind)
    ids = jnp.asarray(routing_ids(rng, scenario, t, k, e))
    plan = plan_dispatch(ids, e, bm)
    x = jnp.asarray(rng.standard_normal((t, d)), dt)
    wg, _ = make_weight(rng, (e, d, f), kind)
    wu, _ = make_weight(rng, (e, d, f), kind)
    wd, _ = make_weight(rng, (e, f, d), kind)
    p = t * k
    lc = Launch(block_m=bm, block_n=128, block_k=128, interpret=True)
    h = gate_up_swiglu(x, plan.token_idx, plan_meta(plan), wg, wu, out=nan_buf((p, f), dt), launch=lc)
    h_ref = gate_up_swiglu_reference(x, plan.token_idx, plan.group_offsets, wg, wu)
    assert_close(h, h_ref, dt, f"gate_up {kind} {scenario}")
    ws = jnp.asarray(rng.uniform(0.1, 1.0, p), jnp.float32)
    y = down_project(h_ref, plan_meta(plan), wd, row_scale=ws, out=nan_buf((p, d), jnp.float32), launch=lc)
    y_ref = down_project_reference(h_ref, plan.group_offsets, wd, row_scale=ws)
    assert_close(y, y_ref, dt, f"down {kind} {scenario}")


def test_nan_poison_catches_unwritten_rows(rng):
    """The poisoned buffer really shows a skipped visit: drop the last visit, its rows stay NaN."""
    t, k, e, d, f = 20, 2, 4, 64, 32
    ids = jnp.asarray(routing_ids(rng, "random", t, k, e))
    plan = plan_dispatch(ids, e, 16)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    wg, _ = make_weight(rng, (e, d, f), "f32")
    short = Plan(plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles - 1)
    lc = Launch(block_m=16, block_n=32, block_k=64, interpret=True)
    h = gate_up_swiglu(x, plan.token_idx, short, wg, wg, out=nan_buf((t * k, f), jnp.float32), launch=lc)
    last = int(plan.num_tiles) - 1
    e_last, row = int(plan.tile_group[last]), int(plan.tile_row[last])
    lo = max(int(plan.group_offsets[e_last]), row * 16)
    hi = min(int(plan.group_offsets[e_last + 1]), row * 16 + 16)
    nan_rows = np.where(np.isnan(np.asarray(h)).all(axis=1))[0]
    np.testing.assert_array_equal(nan_rows, np.arange(lo, hi))


@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai"])
def test_gate_up_biases_and_input_scale(rng, act):
    t, k, e, d, f = 29, 3, 8, 64, 48
    ids = jnp.asarray(routing_ids(rng, "uneven", t, k, e))
    plan = plan_dispatch(ids, e, 16)
    x = jnp.asarray(rng.standard_normal((t, d)) * 3, jnp.float32)  # large enough to hit the oai clamps
    wg, _ = make_weight(rng, (e, d, f), "f32")
    wu, _ = make_weight(rng, (e, d, f), "f32")
    bg, bu = (jnp.asarray(rng.standard_normal((e, f)), jnp.float32) for _ in range(2))
    rs = jnp.asarray(rng.uniform(0.2, 2.0, t * k), jnp.float32)
    h = gate_up_swiglu(
        x,
        plan.token_idx,
        plan_meta(plan),
        wg,
        wu,
        bg,
        bu,
        rs,
        nan_buf((t * k, f), jnp.float32),
        act=Activation(act),
        launch=Launch(block_m=16, block_n=16, block_k=32, interpret=True),
    )
    ref = gate_up_swiglu_reference(x, plan.token_idx, plan.group_offsets, wg, wu, bg, bu, rs, Activation(act))
    assert_close(h, ref, jnp.float32, act)
    if act == "swiglu_oai":
        g = np.asarray(
            jnp.einsum(
                "pd,pdf->pf",
                x[plan.token_idx],
                wg[jnp.asarray(np.searchsorted(np.asarray(plan.group_offsets[1:]), np.arange(t * k), side="right"))],
            )
        )
        assert (g * np.asarray(rs)[:, None] > 7).any(), "inputs never reach the gpt-oss clamp"


@pytest.mark.parametrize("kind", ["f32", "int8", "int4_mlx64"])
@pytest.mark.slow
def test_plain_gmm(rng, kind):
    e, k_in, n, bm = 6, 128, 80, 32
    sizes = np.array([0, 45, 3, 0, 70, 1])
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    ids = jnp.asarray(np.repeat(np.arange(e), sizes).reshape(-1, 1).astype(np.int32))
    plan = plan_dispatch(ids, e, bm)
    np.testing.assert_array_equal(np.asarray(plan.group_offsets), off)
    lhs = jnp.asarray(rng.standard_normal((sizes.sum(), k_in)), jnp.float32)
    w, _ = make_weight(rng, (e, k_in, n), kind)
    y = gmm(
        lhs,
        w,
        plan_meta(plan),
        nan_buf((sizes.sum(), n), jnp.float32),
        launch=Launch(block_m=bm, block_n=32, block_k=64, interpret=True),
    )
    assert_close(y, gmm_reference(lhs, w, plan.group_offsets), jnp.float32, kind)


@pytest.mark.parametrize(
    "t,k,kind", [(1, 1, "f32"), (1, 8, "int8"), (5, 4, "bf16"), (5, 4, "q4_0"), (1, 8, "int4_mlx64")]
)
@pytest.mark.slow
def test_decode_kernels(rng, t, k, kind):
    e, d, f = 16, 192, 64
    dt = compute_dtype(kind)
    ids = jnp.asarray(routing_ids(rng, "random", t, k, e))
    x = jnp.asarray(rng.standard_normal((t, d)), dt)
    wg, wg64 = make_weight(rng, (e, d, f), kind)
    wu, wu64 = make_weight(rng, (e, d, f), kind)
    wd, wd64 = make_weight(rng, (e, f, d), kind)
    h = decode_gate_up(x, ids, wg, wu, out=nan_buf((t * k, f), dt), launch=DecodeLaunch(block_n=32, interpret=True))
    h_ref = decode_gate_up_reference(x, ids, wg, wu)
    assert_close(h, h_ref, dt, f"decode gate_up {kind}")
    w = jnp.asarray(rng.uniform(0.1, 1, t * k), jnp.float32)
    lc = DecodeLaunch(block_n=64, block_k=64, interpret=True)
    y = decode_down(h_ref, ids, wd, row_scale=w, out=nan_buf((t * k, d), jnp.float32), launch=lc)
    assert_close(y, decode_down_reference(h_ref, ids, wd, row_scale=w), dt, f"decode down {kind}")
    # the whole decode layer against a float64 loop over the pairs (the dequantized weights)
    x64, w64, ids64 = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(w, np.float64), np.asarray(ids)
    want = np.zeros((t, d))
    for i in range(t):
        for j in range(k):
            g, u = x64[i] @ wg64[ids64[i, j]], x64[i] @ wu64[ids64[i, j]]
            want[i] += w64[i * k + j] * ((g / (1 + np.exp(-g)) * u) @ wd64[ids64[i, j]])
    got = combine_pairs(y, k)
    assert got.shape == (t, d) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=TOL[dt]["atol"] * np.abs(want).max())


@pytest.mark.parametrize("mma,split_k", [(True, 1), (True, 3), (False, 1), (False, 2)])
@pytest.mark.parametrize("kind", ["bf16", "int4_mlx64", "q4_k"])
@pytest.mark.slow
def test_decode_mma_and_split_k(rng, mma, split_k, kind):
    """Both ways to multiply (the row padded to 16 for a tensor-core dot, or a float32
    matvec) with K unsplit and split (3 splits of 8 K steps: the last one short; int4's
    group of 64 makes 4 steps, 2 splits of 2), with
    biases, an input scale and gpt-oss's activation, against the references (Q4_K gate / up
    with a Q5_0 down: the GGUF pieces path)."""
    t, k, e, d, f = 2, 4, 8, 256, 256
    dt = compute_dtype(kind)
    ids = jnp.asarray(routing_ids(rng, "random", t, k, e))
    x = jnp.asarray(rng.standard_normal((t, d)) * 2, dt)
    if kind == "q4_k":
        wg, wu = (kernel_weight(gguf_block_weight(rng, "q4_k", (e, f, d))[0]) for _ in range(2))
        wd = kernel_weight(gguf_block_weight(rng, "q5_0", (e, d, f))[0])
    else:
        wg, wu = (make_weight(rng, (e, d, f), kind)[0] for _ in range(2))
        wd, _ = make_weight(rng, (e, f, d), kind)
    bg, bu = (jnp.asarray(rng.standard_normal((e, f)), jnp.float32) for _ in range(2))
    bd = jnp.asarray(rng.standard_normal((e, d)), jnp.float32)
    rs = jnp.asarray(rng.uniform(0.2, 2, t * k), jnp.float32)
    lc = DecodeLaunch(block_n=32, block_k=32, mma=mma, split_k=split_k, interpret=True)
    oai = Activation("swiglu_oai")
    h = decode_gate_up(x, ids, wg, wu, bg, bu, rs, nan_buf((t * k, f), dt), act=oai, launch=lc)

    def close(got, want, what):  # float32: relative to the largest output (sums of 256 large terms)
        if dt == jnp.bfloat16:
            return assert_close(got, want, dt, what)
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=what)

    close(h, decode_gate_up_reference(x, ids, wg, wu, bg, bu, rs, oai), f"gate_up {kind}")
    y = decode_down(h, ids, wd, bd, rs, launch=dataclasses.replace(lc, block_n=64))
    close(y, decode_down_reference(h, ids, wd, bd, rs), f"down {kind}")


def test_decode_splits_and_errors(rng):
    """`tuning.decode_splits` makes up the programs an H200 needs from K steps; a bad
    ``split_k`` is a ValueError naming the kernel and the allowed range."""
    assert tuning.decode_splits(8 * 16, 8) == 3  # Qwen3.6 gate/up at T = 1: 128 programs, 8 K steps
    assert tuning.decode_splits(64 * 16, 8) == 1  # enough programs already
    assert tuning.decode_splits(2, 4) == 4  # at most one split per K step
    assert tuning.decode_splits(10, 1) == 1
    assert tuning.decode_splits(100, 4) == 2  # 3 splits of 4 steps would leave one empty
    x = jnp.asarray(rng.standard_normal((1, 128)), jnp.float32)
    w, _ = make_weight(rng, (4, 128, 32), "f32")
    ids = jnp.asarray([[1, 2]], jnp.int32)
    with pytest.raises(ValueError, match=r"decode_gate_up: split_k must be an int in \[1, 2\].*got 3"):
        decode_gate_up(x, ids, w, w, launch=DecodeLaunch(block_n=32, block_k=64, split_k=3, interpret=True))


def test_decode_biases_oai(rng):
    t, k, e, d, f = 3, 4, 8, 96, 80
    ids = jnp.asarray(routing_ids(rng, "random", t, k, e))
    x = jnp.asarray(rng.standard_normal((t, d)) * 3, jnp.float32)
    wg, wu = (make_weight(rng, (e, d, f), "f32")[0] for _ in range(2))
    wd, _ = make_weight(rng, (e, f, d), "f32")
    bg, bu = (jnp.asarray(rng.standard_normal((e, f)), jnp.float32) for _ in range(2))
    bd = jnp.asarray(rng.standard_normal((e, d)), jnp.float32)
    rs = jnp.asarray(rng.uniform(0.2, 2, t * k), jnp.float32)
    h = decode_gate_up(
        x,
        ids,
        wg,
        wu,
        bg,
        bu,
        rs,
        nan_buf((t * k, f), jnp.float32),
        act=Activation("swiglu_oai"),
        launch=DecodeLaunch(block_n=64, block_k=64, interpret=True),
    )
    assert_close(h, decode_gate_up_reference(x, ids, wg, wu, bg, bu, rs, Activation("swiglu_oai")), jnp.float32)
    lc = DecodeLaunch(block_n=32, block_k=32, interpret=True)
    y = decode_down(h, ids, wd, bd, rs, nan_buf((t * k, d), jnp.float32), launch=lc)
    assert_close(y, decode_down_reference(h, ids, wd, bd, rs), jnp.float32)


# ---------------------------------------------------------------- every table entry


def _table_cases():
    cases = []
    for i, (key, kc) in enumerate(sorted(tuning.TABLE.items())):
        cases.append(pytest.param(kc, KINDS[i % len(KINDS)], id=f"{key[0]}-{key[1]}x{key[2]}-{KINDS[i % len(KINDS)]}"))
    return cases


@pytest.mark.parametrize("kc,kind", _table_cases())
@pytest.mark.slow
def test_every_table_config(rng, kc, kind):
    """Each table entry's blocks on a shape that is not a multiple of them (ragged edges)."""
    gu, dn = kc.gate_up, kc.down
    d = max(64, 2 * max(gu.block_k, dn.block_n) - 64)
    f = max(gu.block_n, dn.block_k) + 64
    e = 8
    dt = compute_dtype(kind)
    wg, wu = (make_weight(rng, (e, d, f), kind)[0] for _ in range(2))
    wd, _ = make_weight(rng, (e, f, d), kind)
    if kc.decode:
        t, k = 3, 2
        ids = jnp.asarray(routing_ids(rng, "random", t, k, e))
        x = jnp.asarray(rng.standard_normal((t, d)), dt)
        lc = DecodeLaunch(
            block_n=gu.block_n, block_k=gu.block_k, num_warps=gu.num_warps, num_stages=gu.num_stages, interpret=True
        )
        h = decode_gate_up(x, ids, wg, wu, out=nan_buf((t * k, f), dt), launch=lc)
        assert_close(h, decode_gate_up_reference(x, ids, wg, wu), dt, "decode gate_up")
        lc = DecodeLaunch(block_n=dn.block_n, block_k=dn.block_k, interpret=True)
        y = decode_down(h, ids, wd, out=nan_buf((t * k, d), jnp.float32), launch=lc)
        assert_close(y, decode_down_reference(h, ids, wd), dt, "decode down")
        return
    k = 2
    t = (2 * gu.block_m + 5) // k
    ids = jnp.asarray(routing_ids(rng, "uneven", t, k, e))
    plan = plan_dispatch(ids, e, gu.block_m)
    x = jnp.asarray(rng.standard_normal((t, d)), dt)
    lc = Launch(
        block_m=gu.block_m,
        block_n=gu.block_n,
        block_k=gu.block_k,
        num_warps=gu.num_warps,
        num_stages=gu.num_stages,
        interpret=True,
    )
    h = gate_up_swiglu(x, plan.token_idx, plan_meta(plan), wg, wu, out=nan_buf((t * k, f), dt), launch=lc)
    assert_close(h, gate_up_swiglu_reference(x, plan.token_idx, plan.group_offsets, wg, wu), dt, "gate_up")
    lc = dataclasses.replace(lc, block_n=dn.block_n, block_k=dn.block_k)
    y = down_project(h, plan_meta(plan), wd, out=nan_buf((t * k, d), jnp.float32), launch=lc)
    assert_close(y, down_project_reference(h, plan.group_offsets, wd), dt, "down")


def test_table_is_powers_of_two_and_fits():
    for key, kc in tuning.TABLE.items():
        for b in (kc.gate_up, kc.down):
            for v in (b.block_m, b.block_n, b.block_k):
                assert tuning.is_pow2(v) and v >= 16, (key, b)
    kc = tuning.choose(3 * 8, 48, 24)
    assert kc.decode and kc.gate_up.block_n == 32 and kc.gate_up.block_k == 64
    assert tuning.choose(10_000, 4096, 14336) == tuning.TABLE[("large", 4096, 14336)]
    assert tuning.choose(100, 2048, 512).bucket == "small"
    with pytest.raises(ValueError, match="block_n"):
        tuning.Blocks(16, 48, 64)


def test_float32_caps(rng):
    """``for_dtype`` keeps 16-bit configs and caps float32 tiles, grouped and decode (what
    benchmarks/gpu_compile_check.py found spill-free); ``choose`` applies it."""
    for key, kc in tuning.TABLE.items():
        assert tuning.for_dtype(kc, jnp.bfloat16) == kc
        f32 = tuning.for_dtype(kc, jnp.float32)
        assert f32.decode == kc.decode, key
        assert f32.gate_up.block_m == f32.down.block_m <= tuning.F32_MAX_M, key
        for b in (f32.gate_up, f32.down):
            assert b.block_m * b.block_n <= tuning.F32_MAX_TILE and b.block_k <= tuning.F32_MAX_K, (key, b)
            assert b.num_warps <= tuning.F32_MAX_WARPS and b.num_stages <= tuning.F32_MAX_STAGES, (key, b)
    big = tuning.choose(10_000, 4096, 14336, jnp.float32)
    assert (big.gate_up.block_m, big.gate_up.block_n, big.gate_up.num_warps) == (16, 64, 4)
    assert tuning.choose(10_000, 4096, 14336, jnp.bfloat16) == tuning.TABLE[("large", 4096, 14336)]
    assert tuning.fixed(2048, 512, jnp.float32).gate_up.block_n <= tuning.F32_MAX_TILE // 16


def _tf32(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> TensorFloat-32 (10 mantissa bits), in numpy."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000
    return u.astype(np.uint32).view(np.float32)


def test_three_tf32_dots_are_float32_accurate(rng):
    """The float32 tile product (3xTF32): the split is exact, and with each tensor-core
    operand rounded to TF32 (simulated in numpy, as the GPU does) the three-dot sum stays
    within 2e-6 of the float64 product (relative to sum |x w|), where one TF32 dot is ~1e-4 off."""
    x = rng.standard_normal((32, 256)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (32, 1))).astype(np.float32)
    w = rng.standard_normal((256, 48)).astype(np.float32)
    xh, xl = (np.asarray(a) for a in split_tf32(jnp.asarray(x)))
    np.testing.assert_array_equal(xh + xl, x)  # exact
    assert not (xh.view(np.uint32) & 0x1FFF).any()  # hi holds only TF32 bits
    wh, wl = (np.asarray(a) for a in split_tf32(jnp.asarray(w)))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    f64 = lambda a: _tf32(a).astype(np.float64)  # noqa: E731
    three = f64(xh) @ f64(wh) + (f64(xh) @ f64(wl) + f64(xl) @ f64(wh))
    one = f64(x) @ f64(w)
    assert np.max(np.abs(three - ref) / scale) < 2e-6
    assert np.max(np.abs(one - ref) / scale) > 2e-5
    # on the CPU (interpret mode) the same three dots are plain float32
    got = np.asarray(tile_matmul(jnp.asarray(x), jnp.asarray(w), True))
    assert np.max(np.abs(got - ref) / scale) < 2e-6
    got_t = np.asarray(tile_matmul(jnp.asarray(x), jnp.asarray(np.ascontiguousarray(w.T)), False))
    assert np.max(np.abs(got_t - ref) / scale) < 2e-6


# ---------------------------------------------------------------- full path


def _quantize(ew, how):
    if how == "none":
        return ew
    qf = (
        (lambda w: quantize_int8(np.asarray(w)))
        if how == "int8"
        else (lambda w: quantize_int4_affine(np.asarray(w), group_size=32))
    )
    return dataclasses.replace(ew, w_gate=qf(ew.w_gate), w_up=qf(ew.w_up), w_down=qf(ew.w_down))


DECODE_TOO = ("gpt-oss-20b", "deepseek-v3", "qwen3.6-35b-a3b")


@pytest.mark.parametrize("name", jaxmoe.list_presets())
@pytest.mark.slow
def test_block_pallas_equals_dense(rng, name):
    """Every preset family (shrunk), quantized or not: grouped kernels (T * k = 96) and,
    for three families, the decode kernels (T * k = 24); one jit per path."""
    cfg = shrink(jaxmoe.load_config(name))
    params = jaxmoe.init_params(cfg, jax.random.key(int(rng.integers(1 << 30))))
    how = ("none", "int8", "int4")[sum(map(ord, name)) % 3]
    params = dataclasses.replace(params, experts=_quantize(params.experts, how))

    @jax.jit
    def both(p, x):
        y, r = jaxmoe.moe_apply(p, x, cfg, impl="pallas", return_routing=True)
        return y, jaxmoe.moe_apply(p, x, cfg, impl="dense", routing=r)

    for pairs in (96, 24) if name in DECODE_TOO else (96,):
        t = pairs // cfg.top_k
        assert t * cfg.top_k == pairs
        y, want = both(params, jnp.asarray(rng.standard_normal((t, cfg.d_model)), jnp.float32))
        assert_close(y, want, jnp.float32, f"{name} {how} T={t}")


def _loop64(x, ids, wts, wg, wu, wd, cfg, bg=None, bu=None, bd=None):
    """float64 loop over tokens and slots."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e, w = ids[t, s], wts[t, s]
            xin = x[t] * w if cfg.weight_on_input else x[t]
            g, u = xin @ wg[e], xin @ wu[e]
            if bg is not None:
                g, u = g + bg[e], u + bu[e]
            if cfg.activation == "swiglu":
                h = g / (1 + np.exp(-g)) * u
            else:
                g = np.minimum(g, cfg.swiglu_limit)
                u = np.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
                h = (u + 1) * g / (1 + np.exp(-cfg.swiglu_alpha * g))
            y = h @ wd[e] + (bd[e] if bd is not None else 0)
            out[t] += y if cfg.weight_on_input else w * y
    return out


@pytest.mark.parametrize(
    "name,woi,t",
    [
        ("gpt-oss-20b", False, 3),
        ("gpt-oss-20b", False, 40),
        ("qwen3.6-35b-a3b", True, 2),
        ("qwen3.6-35b-a3b", True, 33),
    ],
)
@pytest.mark.slow
def test_pallas_impl_matches_float64_loop(rng, name, woi, t):
    cfg = dataclasses.replace(shrink(jaxmoe.load_config(name)), weight_on_input=woi)
    ew = jaxmoe.init_params(cfg, jax.random.key(int(rng.integers(1 << 30)))).experts
    x = jnp.asarray(rng.standard_normal((t, cfg.d_model)) * 2, jnp.float32)
    ids = np.stack([rng.choice(cfg.num_experts, cfg.top_k, replace=False) for _ in range(t)]).astype(np.int32)
    wts = rng.uniform(0.05, 1, ids.shape).astype(np.float32)
    r = jaxmoe.Routing(jnp.asarray(ids), jnp.asarray(wts))
    y = experts_pallas(x, r, ew, cfg)
    a = {
        f: None if getattr(ew, f) is None else np.asarray(getattr(ew, f), np.float64)
        for f in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
    }
    want = _loop64(x, ids, wts, a["w_gate"], a["w_up"], a["w_down"], cfg, a["b_gate"], a["b_up"], a["b_down"])
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "fmts",
    [("q4_k", "q4_k", "q6_k"), ("q5_0", "q4_1", "q5_1"), ("q2_k", "q3_k", "iq4_xs"), ("iq4_nl", "mxfp4", "mxfp4")],
)
@pytest.mark.parametrize("t", [3, 40])
@pytest.mark.slow
def test_pallas_gguf_block_kinds_match_float64_loop(rng, fmts, t):
    """GGUF block kinds through the Pallas impl (interpret mode), decode (T k <= 64) and
    grouped paths, against the float64 loop over gguf.quants' decoding of the same bytes.
    The kernels decode the `TILE_KINDS` tile by tile: no float copy of any expert (neither
    the stack nor the selected experts) in the compiled program; MXFP4 is decoded by XLA
    into float experts first."""
    from helpers import gguf_block_weight

    e, k = 12, 2
    d, f = (256, 256) if GGUF_BLOCKS[fmts[0]][0] == 256 else (64, 96)
    cfg = dataclasses.replace(
        shrink(jaxmoe.load_config("qwen3-30b-a3b")),
        d_model=d,
        expert_dim=f,
        router=jaxmoe.RouterConfig(num_experts=e, top_k=k),
    )
    stored = {"w_gate": (e, f, d), "w_up": (e, f, d), "w_down": (e, d, f)}  # [E, out, in]
    qw, a = {}, {}
    for (name, shape), kind in zip(stored.items(), fmts):
        qw[name], a[name] = gguf_block_weight(rng, kind, shape)
    ew = jaxmoe.ExpertWeights(**qw)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    wts = rng.uniform(0.05, 1, ids.shape).astype(np.float32)
    r = jaxmoe.Routing(jnp.asarray(ids), jnp.asarray(wts))
    run = jax.jit(lambda x, r, ew: experts_pallas(x, r, ew, cfg, ExecConfig(interpret=True)))
    want = _loop64(x, ids, wts, a["w_gate"], a["w_up"], a["w_down"], cfg)
    np.testing.assert_allclose(np.asarray(run(x, r, ew)), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    hlo = run.lower(x, r, ew).as_text()
    float_experts = re.compile(rf"tensor<\d+x({d}x{f}|{f}x{d})x(f32|bf16)>")  # dequantized [., d, F] / [., F, d]
    in_kernel = all(kind in TILE_KINDS for kind in fmts)
    assert bool(float_experts.search(hlo)) != in_kernel, (t, fmts, float_experts.search(hlo))
    if in_kernel:
        assert "xui16>" in hlo  # the blocks as uint16 words


@pytest.mark.slow
def test_block_bf16_pallas(rng):
    cfg = shrink(jaxmoe.load_config("mixtral-8x7b"), e=8)
    block = jaxmoe.MoEBlock(cfg, rngs=nnx.Rngs(3), impl="pallas", dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((40, cfg.d_model)), jnp.bfloat16)
    y, r = nnx.jit(lambda b, a: b(a, return_routing=True))(block, x)
    want = jax.jit(lambda p, a, rr: jaxmoe.moe_apply(p, a, cfg, impl="dense", routing=rr))(block.params(), x, r)
    assert y.dtype == jnp.bfloat16
    assert_close(y, want, jnp.bfloat16, "bf16 block")


@pytest.mark.slow
def test_deterministic_and_nan_token_isolated(rng):
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"))
    ew = jaxmoe.init_params(cfg, jax.random.key(1)).experts
    x = jnp.asarray(rng.standard_normal((30, cfg.d_model)), jnp.float32)
    ids = np.stack([rng.choice(cfg.num_experts, cfg.top_k, replace=False) for _ in range(30)]).astype(np.int32)
    w = rng.uniform(0.1, 1, ids.shape).astype(np.float32)
    w[4] = np.nan
    r = jaxmoe.Routing(jnp.asarray(ids), jnp.asarray(w))
    y1, y2 = np.asarray(experts_pallas(x, r, ew, cfg)), np.asarray(experts_pallas(x, r, ew, cfg))
    np.testing.assert_array_equal(y1, y2)
    assert np.isnan(y1[4]).all() and not np.isnan(np.delete(y1, 4, axis=0)).any()


# ---------------------------------------------------------------- bad arguments


def test_bad_arguments_raise_value_error(rng):
    e, d, f = 4, 64, 32
    x = jnp.asarray(rng.standard_normal((5, d)), jnp.float32)
    ids = jnp.asarray(routing_ids(rng, "random", 5, 2, e))
    plan = plan_dispatch(ids, e, 16)
    wg = jnp.asarray(rng.standard_normal((e, d, f)), jnp.float32)
    kp, lc = plan_meta(plan), Launch(block_m=16, interpret=True)
    with pytest.raises(ValueError, match=r"w_up.*\(4, 64, 16\)"):
        gate_up_swiglu(x, plan.token_idx, kp, wg, wg[..., :16], launch=lc)
    with pytest.raises(ValueError, match="block_n"):
        gate_up_swiglu(x, plan.token_idx, kp, wg, wg, launch=dataclasses.replace(lc, block_n=24))
    with pytest.raises(ValueError, match="gate_up_swiglu: block_m must be a power of two >= 16, got None"):
        gate_up_swiglu(x, plan.token_idx, kp, wg, wg, launch=Launch(interpret=True))
    with pytest.raises(ValueError, match="out buffer"):
        gate_up_swiglu(x, plan.token_idx, kp, wg, wg, out=jnp.zeros((10, 16)), launch=lc)
    with pytest.raises(ValueError, match=r"w_down.*K=32, expected 48"):
        down_project(jnp.zeros((10, 48)), kp, jnp.swapaxes(wg, 1, 2), launch=lc)
    with pytest.raises(ValueError, match="group_offsets"):
        gmm(jnp.zeros((10, d)), wg, kp._replace(group_offsets=plan.group_offsets[:3]), launch=lc)
    with pytest.raises(ValueError, match=r"gmm: plan must be a pallas_kernels.launch.Plan, got tuple"):
        gmm(jnp.zeros((10, d)), wg, tuple(kp), launch=lc)
    with pytest.raises(ValueError, match=r"decode_down: h has 7 rows"):
        decode_down(jnp.zeros((7, f)), ids, jnp.swapaxes(wg, 1, 2), launch=DecodeLaunch(interpret=True))
    with pytest.raises(
        ValueError, match=r"decode_down: launch must be a pallas_kernels.launch.DecodeLaunch, got Launch"
    ):
        decode_down(jnp.zeros((10, f)), ids, jnp.swapaxes(wg, 1, 2), launch=lc)
    with pytest.raises(ValueError, match="inv"):
        combine(jnp.zeros((10, d)), jnp.zeros((9,), jnp.int32), 2)


def test_weight_operand_errors(rng):
    """Kernels take float arrays or `QuantWeight`s only; a bad `QuantWeight` is named."""
    w = (rng.standard_normal((2, 64, 16)) / 8).astype(np.float32)
    q8, q4 = quantize_int8(w), quantize_int4_affine(w, group_size=32)
    with pytest.raises(ValueError, match=r"w_gate: expert weight must be .*QuantWeight, got QuantizedTensor"):
        weight_operands(q8, "w_gate")
    with pytest.raises(ValueError, match=r"w_gate: expert weight must be floating point"):
        weight_operands(jnp.zeros((2, 64, 16), jnp.int32), "w_gate")
    lay, arrs = weight_operands(kernel_weight(q4), "w", 2, 64, 16)
    assert (lay.kind, lay.group_size, len(arrs)) == ("int4", 32, 3)
    assert weight_operands(kernel_weight(jnp.asarray(w)), "w")[0].kind == "dense"
    with pytest.raises(ValueError, match=r"w_up: int8 scales must be .* \(2, 16, 2\), got \(2, 16, 1\)"):
        weight_operands(QuantWeight(q8.qdata, q8.scales[..., :1], None, "int8", 32), "w_up")
    with pytest.raises(ValueError, match=r"w_up: int4 biases must be .*got None"):
        weight_operands(QuantWeight(q4.qdata, q4.scales, None, "int4", 32), "w_up")
    with pytest.raises(ValueError, match=r"w_up: int4 qdata must be uint8, got int8"):
        weight_operands(QuantWeight(q4.qdata.astype(jnp.int8), q4.scales, q4.biases, "int4", 32), "w_up")
    with pytest.raises(ValueError, match=r"w_up: an int8 QuantWeight takes no biases"):
        weight_operands(QuantWeight(q8.qdata, q8.scales, q8.scales, "int8", 32), "w_up")
    with pytest.raises(ValueError, match=r"w_up: quantization group size must be a power of two, got 48"):
        weight_operands(QuantWeight(q8.qdata[..., :48], q8.scales[..., :1], None, "int8", 48), "w_up")
    with pytest.raises(ValueError, match=r"QuantWeight.kind: unknown 'int2'"):
        QuantWeight(q8.qdata, q8.scales, None, "int2", 32)


# ---------------------------------------------------------------- int32 word loads (>= 2^31 codes)


@pytest.mark.parametrize("kind", ["int8", "q4_0", "int4_mlx64"])
@pytest.mark.slow
def test_word_loads_match_byte_loads(rng, kind):
    """Codes loaded as int32 words (what code arrays of >= 2^31 elements get, forced here
    at a small size) give the references' values, and exactly the byte loads' results in
    the grouped kernels (the decode kernel sums its code planes in another order)."""
    e, d, f, t, k, bm = 4, 128, 128, 9, 2, 16
    ids = jnp.asarray(routing_ids(rng, "uneven", t, k, e))
    plan = plan_dispatch(ids, e, bm)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    wg, wu = (make_weight(rng, (e, d, f), kind)[0] for _ in range(2))
    wd, _ = make_weight(rng, (e, f, d), kind)
    lay, arrs = weight_operands(wg, "w", word_loads=True)
    assert lay.word == 4 and arrs[0].dtype == jnp.int32 and arrs[0].shape[-1] * 4 == wg.qdata.shape[-1]
    assert weight_operands(wg, "w")[0].word == 1  # small arrays stay bytes by default
    for wl in (True, False):
        lc = Launch(block_m=bm, block_n=32, block_k=64, word_loads=wl, interpret=True)
        h = gate_up_swiglu(x, plan.token_idx, plan_meta(plan), wg, wu, launch=lc)
        y = down_project(h, plan_meta(plan), wd, launch=dataclasses.replace(lc, block_n=64))
        hd = decode_gate_up(x, ids, wg, wu, launch=DecodeLaunch(block_n=32, block_k=64, word_loads=wl, interpret=True))
        if wl:
            words = (h, y, hd)
            assert_close(h, gate_up_swiglu_reference(x, plan.token_idx, plan.group_offsets, wg, wu), jnp.float32, kind)
            assert_close(y, down_project_reference(h, plan.group_offsets, wd), jnp.float32, kind)
            assert_close(hd, decode_gate_up_reference(x, ids, wg, wu), jnp.float32, kind)
    for a, b in zip(words[:2], (h, y)):  # grouped kernels: same tiles, same float ops
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_close(words[2], hd, jnp.float32, f"decode {kind}: words vs bytes")  # planes sum in another order


def test_as_words_round_trip_and_errors(rng):
    q = jnp.asarray(rng.integers(-128, 128, (3, 5, 16)), jnp.int8)
    w = QuantWeight(q, jnp.asarray(rng.uniform(0.5, 1, (3, 5, 2)), jnp.float32), None, "int8", 8)
    lay, arrs = weight_operands(w, "w", word_loads=True)
    want = np.asarray(q).view(np.uint32).view(np.int32)  # numpy's little-endian view
    np.testing.assert_array_equal(np.asarray(arrs[0]), want)
    np.testing.assert_array_equal(np.asarray(word_bytes(arrs[0])).view(np.int8), np.asarray(q))
    np.testing.assert_array_equal(
        np.asarray(dequantize_reference(lay, arrs)), np.asarray(dequantize_reference(*weight_operands(w, "w")))
    )
    odd = QuantWeight(q[..., :6], jnp.ones((3, 5, 3), jnp.float32), None, "int8", 2)
    with pytest.raises(ValueError, match=r"w_down: int8 codes \(3, 5, 6\) are loaded as int32 words.*multiple of 4"):
        as_words(*weight_operands(odd, "w_down"), "w_down", word_loads=True)


def test_float32_gmm_matches_float64(rng):
    """float32 activations and weights: the grouped matmul agrees with a float64 numpy loop
    at float32 accuracy (the kernels multiply float32 tiles at full precision by default)."""
    e, k_in, n, bm = 3, 256, 48, 16
    sizes = np.array([7, 0, 20])
    ids = jnp.asarray(np.repeat(np.arange(e), sizes).reshape(-1, 1).astype(np.int32))
    plan = plan_dispatch(ids, e, bm)
    lhs = rng.standard_normal((sizes.sum(), k_in)).astype(np.float32)
    w = rng.standard_normal((e, k_in, n)).astype(np.float32)
    lc = Launch(block_m=bm, block_n=16, block_k=64, interpret=True)
    y = gmm(jnp.asarray(lhs), jnp.asarray(w), plan_meta(plan), launch=lc)
    ex = np.repeat(np.arange(e), sizes)
    want = np.stack([lhs[r].astype(np.float64) @ w[ex[r]].astype(np.float64) for r in range(sizes.sum())])
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5 * np.sqrt(k_in))


@pytest.mark.parametrize("rows, cols, group", [(20, 3, 8), (5, 7, 8), (16, 1, 8), (9, 4, 2), (1, 5, 8)])
def test_grouped_order_is_a_bijection_in_groups(rows, cols, group):
    """`common.grouped_order` maps the 1-D grid onto every (row tile, column block) once,
    and consecutive programs sweep ``group`` row tiles across all column blocks first."""
    from jax.experimental import pallas as pl

    from pallas_kernels import common

    def kernel(o_ref):
        v, j = common.grouped_order(rows, cols, group)
        o_ref[pl.program_id(0), 0] = v
        o_ref[pl.program_id(0), 1] = j

    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows * cols, 2), jnp.int32), grid=(rows * cols,), interpret=True
    )()
    vj = [tuple(int(a) for a in r) for r in np.asarray(out)]
    assert sorted(vj) == [(v, j) for v in range(rows) for j in range(cols)]
    for start in range(0, rows, group):  # each group of row tiles is one contiguous run of programs
        size = min(group, rows - start)
        run = vj[start * cols : (start + size) * cols]
        assert {v for v, _ in run} == set(range(start, start + size)), run
        assert [j for _, j in run] == sorted(j for _, j in run)  # column by column within the group
