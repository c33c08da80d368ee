"""The Pallas kernels decode block-scaled FP8 E4M3 and MXFP4 in-kernel (interpret mode):
`pallas_kernels.quant.load_fp8_tile` and `pallas_kernels.gguf` MXFP4 tiles, bit-exact with
the pure-jnp decoders (``jaxmoe.quant.dequantize_fp8_blocks``, ``dequantize_gguf_blocks``),
products against a float64 loop over the ``ml_dtypes`` / gguf.quants decode of the same
bytes; flips; named errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq
from helpers import gguf_block_bytes
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmoe.dispatch import plan_dispatch
from jaxmoe.impls.pallas import kernel_weight
from jaxmoe.quant import QuantizedTensor, dequantize_fp8_blocks, fp8_block_tensor, gguf_block_tensor
from pallas_kernels.decode import decode_down, decode_gate_up
from pallas_kernels.gmm import gmm
from pallas_kernels.launch import DecodeLaunch, Launch, Plan
from pallas_kernels.quant import QuantWeight, dequantize_reference, load_tile, weight_operands

F8 = ml_dtypes.float8_e4m3fn


def fp8_weight(rng, e, n_out, n_in, block, sdtype=np.float32, extreme=True):
    """An FP8 QuantizedTensor of stored shape [e, n_out, n_in] (random codes, every byte but
    the NaNs) and its float64 logical [e, n_in, n_out] (ml_dtypes decode times the scales)."""
    b = rng.integers(0, 256, size=(e, n_out, n_in), dtype=np.uint8)
    b = np.where((b & 0x7F) == 0x7F, b ^ 1, b).astype(np.uint8)
    codes = b.view(F8)
    s = np.exp2(rng.uniform(-10, 2, size=(e, -(-n_out // block), -(-n_in // block))))
    if extreme:
        s.reshape(-1)[:3] = (2.0**-100, 2.0**-60, 2.0**15)  # extreme (float16: 2^-100 is 0)
    s = s.astype(np.float32).astype(sdtype)
    full = np.repeat(np.repeat(s.astype(np.float64), block, 1), block, 2)[:, :n_out, :n_in]
    ref = codes.astype(np.float64) * full
    return fp8_block_tensor(jnp.asarray(codes), jnp.asarray(s), block), np.swapaxes(ref, 1, 2)


def mxfp4_weight(rng, e, n_out, n_in):
    """MXFP4 blocks with random codes and E8M0 bytes (0, 1, 2 and 254, 255 among them:
    subnormal and infinite products) and gguf.quants' float64 decode, logical [e, n_in, n_out]."""
    raw = gguf_block_bytes(rng, QT.MXFP4, (e, n_out, n_in))
    ex = raw.reshape(e, n_out, -1, 17)[..., 0]
    ex.reshape(-1)[:5] = (0, 1, 2, 254, 255)
    qw = gguf_block_tensor(jnp.asarray(raw), "mxfp4", n_in=n_in)
    return qw, np.swapaxes(gq.dequantize(raw, QT.MXFP4), 1, 2).astype(np.float64)


def plan_of(sizes, e, bm):
    ids = np.repeat(np.arange(e), sizes).reshape(-1, 1).astype(np.int32)
    p = plan_dispatch(jnp.asarray(ids), e, bm)
    return Plan(p.group_offsets, p.tile_group, p.tile_row, p.num_tiles), np.repeat(np.arange(e), sizes)


def weight_rows(w, e, k, n, bk, bn=32):
    """Every weight element as the kernels' `load_tile` decodes it, ``[e, k, n]`` float32:
    a kernel (interpret mode) that stores each ``[bn, bk]`` tile (K and N padded to whole tiles)."""
    lay, arrs = weight_operands(w, "w")
    kp, np_ = -(-k // bk) * bk, -(-n // bn) * bn

    def kernel(*refs):
        ei, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        t, k_major = load_tile(lay, refs[:-1], ei, i * bk, j * bn, bk, bn, jnp.float32)
        assert not k_major
        plgpu.store(refs[-1].at[ei, pl.ds(j * bn, bn), pl.ds(i * bk, bk)], t)

    out = jax.ShapeDtypeStruct((e, np_, kp), jnp.float32)
    y = pl.pallas_call(kernel, out_shape=out, grid=(e, kp // bk, np_ // bn), interpret=True)(*arrs)
    return np.swapaxes(np.asarray(y)[:, :n, :k], 1, 2)


@pytest.mark.parametrize("block, sdtype", [(128, np.float32), (32, ml_dtypes.bfloat16), (64, np.float16)])
@pytest.mark.slow
def test_fp8_tiles_bit_exact_and_products(rng, block, sdtype):
    """Partial last blocks along K and N (K 160, N 72): the in-kernel tile equals
    jaxmoe.quant.dequantize_fp8_blocks bit for bit; gmm at K steps 32 .. 128 and the decode
    kernels against the float64 loop; the weight reaches the kernels as its bytes."""
    e, n, k = 3, 72, 160
    qw, w64 = fp8_weight(rng, e, n, k, block, sdtype)
    w = kernel_weight(qw)
    assert isinstance(w, QuantWeight) and w.kind == "fp8_e4m3" and w.qdata.dtype == jnp.uint8
    lay, arrs = weight_operands(w, "w")
    assert (lay.kind, lay.k, lay.n, lay.group_size) == ("fp8_e4m3", k, n, block)
    exact = np.swapaxes(np.asarray(dequantize_fp8_blocks(jnp.asarray(qw.qdata), jnp.asarray(qw.scales), block)), 1, 2)
    np.testing.assert_array_equal(np.asarray(dequantize_reference(lay, arrs)), exact)
    np.testing.assert_array_equal(weight_rows(w, e, k, n, 32), exact)
    sizes = np.array([7, 0, 20])
    plan, owner = plan_of(sizes, e, 16)
    lhs = rng.standard_normal((sizes.sum(), k))
    want = np.einsum("pk,pkn->pn", lhs, w64[owner])
    for bk in (32, 64, 128):
        y = gmm(
            jnp.asarray(lhs, jnp.float32), w, plan, launch=Launch(block_m=16, block_n=32, block_k=bk, interpret=True)
        )
        np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=f"bk={bk}")
    ids = jnp.asarray(rng.integers(0, e, size=(3, 2)).astype(np.int32))
    h = rng.standard_normal((6, k))
    y = decode_down(jnp.asarray(h, jnp.float32), ids, w, launch=DecodeLaunch(block_n=32, block_k=64, interpret=True))
    want = np.einsum("pk,pkn->pn", h, w64[np.asarray(ids).reshape(-1)])
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_fp8_decode_gate_up_and_flips(rng):
    """decode_gate_up (two FP8 weights, one row per pair) against float64; a flipped code or
    a changed block scale changes the kernels' output."""
    e, d, f = 4, 96, 64
    qg, g64 = fp8_weight(rng, e, f, d, 32, extreme=False)
    qu, u64 = fp8_weight(rng, e, f, d, 32, extreme=False)
    ids = jnp.asarray(np.array([[1, 2], [3, 1]], np.int32))
    x = rng.standard_normal((2, d)) * 0.05
    launch = DecodeLaunch(block_n=32, block_k=32, interpret=True)
    y = np.asarray(
        decode_gate_up(jnp.asarray(x, jnp.float32), ids, kernel_weight(qg), kernel_weight(qu), launch=launch)
    )
    pid = np.asarray(ids)
    xg = np.einsum("tk,tpkn->tpn", x, g64[pid])
    xu = np.einsum("tk,tpkn->tpn", x, u64[pid])
    want = (xg / (1 + np.exp(-xg)) * xu).reshape(4, f)
    np.testing.assert_allclose(y, want, rtol=0, atol=5e-6 * np.abs(want).max())
    assert isinstance(qg.scales, jnp.ndarray)
    codes = np.asarray(qg.qdata).view(np.uint8).copy()
    codes[1, 3, 5] ^= 0x40
    flipped = fp8_block_tensor(jnp.asarray(codes.view(F8)), qg.scales, 32)
    scales = np.asarray(qu.scales).copy()
    scales[3, 0, 0] *= 4
    rescaled = fp8_block_tensor(qu.qdata, jnp.asarray(scales), 32)
    for wg, wu in ((flipped, qu), (qg, rescaled)):
        y2 = np.asarray(
            decode_gate_up(jnp.asarray(x, jnp.float32), ids, kernel_weight(wg), kernel_weight(wu), launch=launch)
        )
        assert np.abs(y2 - y).max() > 1e-6 * np.abs(y).max()


def test_fp8_operand_errors(rng):
    """Truncated scales, float8 codes given as such, a block edge the kernels cannot tile:
    ValueError naming the weight and the shapes; kernel_weight decodes an odd block edge with XLA."""
    qw, _ = fp8_weight(rng, 2, 40, 64, 32)
    u8 = jnp.asarray(np.asarray(qw.qdata).view(np.uint8))
    s = jnp.asarray(qw.scales)
    with pytest.raises(
        ValueError, match=r"w_up \(fp8_e4m3, 32 x 32 blocks\): scales must be .*\(2, 2, 2\).*\(2, 2, 1\)"
    ):
        weight_operands(QuantWeight(u8, s[:, :, :1], None, "fp8_e4m3", 32), "w_up")
    with pytest.raises(ValueError, match=r"w_up \(fp8_e4m3.*qdata must be the codes' bytes, uint8"):
        weight_operands(QuantWeight(jnp.asarray(qw.qdata), s, None, "fp8_e4m3", 32), "w_up")
    with pytest.raises(ValueError, match=r"w_up \(fp8_e4m3, 48 x 48 blocks\): the kernels take a block edge"):
        weight_operands(QuantWeight(u8, jnp.ones((2, 1, 2)), None, "fp8_e4m3", 48), "w_up")
    odd, _ = fp8_weight(rng, 2, 40, 64, 48)
    assert not isinstance(kernel_weight(odd), QuantWeight)


@pytest.mark.slow
def test_mxfp4_tiles_bit_exact_and_products(rng):
    """MXFP4 (rows of 3 blocks: 51 bytes, odd) decoded in-kernel: each element equals
    dequantize_gguf_blocks bit for bit, subnormal and infinite products included
    (gmm of one-hot rows); products against gguf.quants' float64 decode; a flipped nibble
    or exponent byte changes the output."""
    e, n, k = 2, 40, 96
    qw, w64 = mxfp4_weight(rng, e, n, k)
    w = kernel_weight(qw)
    assert isinstance(w, QuantWeight) and w.kind == "mxfp4"
    lay, arrs = weight_operands(w, "w")
    assert arrs[0].shape == (e, n * 51 // 2) and arrs[0].size * 2 == qw.qdata.size
    exact = np.asarray(qw.dequantize())
    np.testing.assert_array_equal(np.asarray(dequantize_reference(lay, arrs)), exact)
    assert (np.abs(exact[np.isfinite(exact)]) < 2.0**-126).any() and np.isinf(exact).any()
    for bk in (32, 64):
        np.testing.assert_array_equal(weight_rows(w, e, k, n, bk), exact)
    good, _ = mxfp4_weight(np.random.default_rng(7), e, n, k)
    raw = np.asarray(good.qdata).copy()
    raw.reshape(e, n, -1, 17)[..., 0] = np.clip(raw.reshape(e, n, -1, 17)[..., 0], 118, 136)  # finite products
    good = gguf_block_tensor(jnp.asarray(raw), "mxfp4", n_in=k)
    w64 = np.swapaxes(gq.dequantize(raw, QT.MXFP4), 1, 2).astype(np.float64)
    sizes = np.array([9, 12])
    plan, owner = plan_of(sizes, e, 16)
    lhs = rng.standard_normal((sizes.sum(), k))
    want = np.einsum("pk,pkn->pn", lhs, w64[owner])
    launch = Launch(block_m=16, block_n=32, block_k=64, interpret=True)
    y = np.asarray(gmm(jnp.asarray(lhs, jnp.float32), kernel_weight(good), plan, launch=launch))
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max())
    for pos in (1 * 51 + 17 + 5, 1 * 51 + 34):  # a code byte of row 1, block 1; row 1's block 2 exponent
        bad = raw.copy()
        bad[0].reshape(-1)[pos] ^= 0x13
        y2 = np.asarray(
            gmm(
                jnp.asarray(lhs, jnp.float32),
                kernel_weight(gguf_block_tensor(jnp.asarray(bad), "mxfp4", n_in=k)),
                plan,
                launch=launch,
            )
        )
        assert np.abs(y2 - y).max() > 1e-6 * np.abs(y).max()


def test_mxfp4_odd_expert_bytes_decode_with_xla(rng):
    """An expert of an odd number of bytes (odd rows of an odd number of blocks) has no
    uint16 word view: kernel_weight decodes it with XLA; weight_operands names the reason."""
    raw = gguf_block_bytes(rng, QT.MXFP4, (2, 3, 32))
    qw = gguf_block_tensor(jnp.asarray(raw), "mxfp4", n_in=32)
    assert not isinstance(kernel_weight(qw), QuantWeight) and isinstance(qw, QuantizedTensor)
    with pytest.raises(ValueError, match=r"w \(MXFP4.*odd number of bytes"):
        weight_operands(QuantWeight(jnp.asarray(raw), None, None, "mxfp4", 32), "w")
