"""impl="cpu" reads block-scaled FP8 E4M3 experts in place (kind ``fp8_e4m3``,
jaxmoe/impls/cpu/fp8_kind.h): forward and input gradients against a float64 loop over the
``ml_dtypes``-decoded weights, random codes and block scales (extreme ones included),
partial last blocks, every scale dtype; flips; named errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import np_experts
from test_impls_cpu import cfg_of, uniform_routing

from jaxmoe import Routing
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights
from jaxmoe.impls import policy
from jaxmoe.impls.cpu import experts_cpu, supports
from jaxmoe.impls.cpu import kernel as cpu_kernel
from jaxmoe.impls.xla import experts_xla
from jaxmoe.quant import QuantizedTensor, fp8_block_tensor

F8 = ml_dtypes.float8_e4m3fn


def random_codes(rng, shape) -> np.ndarray:
    """Random E4M3 codes, every byte but the two NaNs (subnormals, zeros, +-448 included)."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b = np.where((b & 0x7F) == 0x7F, b ^ 0x01, b).astype(np.uint8)
    return b.view(F8)


def random_scales(rng, shape, dtype, gain: float, extreme: bool = True) -> np.ndarray:
    """Block scales 2^U(-9, 0) * gain; with ``extreme``, three of them tiny (2^-60, 2^-130:
    a float32 subnormal) and large (2^8 gain)."""
    s = np.exp2(rng.uniform(-9, 0, size=shape)) * gain
    flat = s.reshape(-1)
    picks = rng.choice(flat.size, size=min(3, flat.size), replace=False) if extreme else []
    for i, v in zip(picks, (2.0**-60, 2.0**-130, 2.0**8 * gain)):
        flat[i] = v
    return s.astype(np.float32).astype(dtype)


def fp8_weight(rng, e, n_in, n_out, block, sdtype, gain=1.0, extreme=True):
    """An FP8 QuantizedTensor for logical [e, n_in, n_out] and its float64 value (ml_dtypes decode)."""
    codes = random_codes(rng, (e, n_out, n_in))
    scales = random_scales(rng, (e, -(-n_out // block), -(-n_in // block)), sdtype, gain, extreme)
    s = np.repeat(np.repeat(scales.astype(np.float64), block, 1), block, 2)[:, :n_out, :n_in]
    ref = codes.astype(np.float64) * s  # exact products of the two float32 values
    return fp8_block_tensor(jnp.asarray(codes), jnp.asarray(scales), block), np.swapaxes(ref, 1, 2)


def fp8_case(rng, d, f, e, block, sdtype=np.float32, extreme=True):
    gain = 2.0 / np.sqrt(d)  # codes up to 448: keep the products moderate
    ws, ref = {}, {}
    for name, (a, b) in (("w_gate", (d, f)), ("w_up", (d, f)), ("w_down", (f, d))):
        g = gain if name != "w_down" else 2.0 / np.sqrt(f)
        ws[name], ref[name] = fp8_weight(rng, e, a, b, block, sdtype, g, extreme)
    return ExpertWeights(**ws), ref


def as_fp8(w) -> QuantizedTensor:
    assert isinstance(w, QuantizedTensor) and w.scales is not None
    return w


def run_check(cfg, ew, ref, ids, ws, rng, tol=3e-6):
    x = (rng.normal(size=(ids.shape[0], cfg.d_model)) * 0.05).astype(np.float32)
    y = experts_cpu(jnp.asarray(x), Routing(jnp.asarray(ids), jnp.asarray(ws)), ew, cfg)
    with np.errstate(over="ignore"):  # sigmoid of a gate from a large block scale
        want = np_experts(x, ids, ws, ref, cfg)
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=tol * np.abs(want).max())
    return x, np.asarray(y)


@pytest.mark.parametrize(
    "d, f, block, sdtype",
    [(256, 192, 128, np.float32), (128, 96, 64, ml_dtypes.bfloat16), (160, 128, 32, np.float16)],
)
@pytest.mark.parametrize("t", [3, 40])
def test_fp8_matches_float64(d, f, block, sdtype, t, rng):
    """Forward within float rounding of the float64 loop: partial last blocks along both
    axes (f = 192 with 128-blocks, d = 160 with 32-blocks), few-row tiles (t = 3) and the
    packed path (t = 40: experts with 8 rows or more), each scale dtype."""
    cfg = cfg_of(d, f, 6, 2)
    ew, ref = fp8_case(rng, d, f, 6, block, sdtype)
    assert supports(ew, jnp.float32) is None
    run_check(cfg, ew, ref, *uniform_routing(rng, t, 2, 6), rng)


def test_auto_takes_the_kernel(rng):
    ew, _ = fp8_case(rng, 128, 64, 4, 64)
    assert policy.resolve_impl("auto", 1, platform="cpu", experts=ew) == "cpu"
    assert policy.resolve_impl("auto", 64, platform="cpu", experts=ew) == "cpu"


def test_a_flipped_code_or_scale_changes_the_output(rng):
    """One code of one routed expert's gate (and separately one block scale of its down
    weight) changed: the kernel's output changes, as the float64 loop's does."""
    d, f, e = 128, 64, 4
    cfg = cfg_of(d, f, e, 1)
    ew, ref = fp8_case(rng, d, f, e, 64, extreme=False)
    ids = np.zeros((4, 1), np.int32)
    ws = np.ones((4, 1), np.float32)
    x, y0 = run_check(cfg, ew, ref, ids, ws, rng)
    wg, wd = as_fp8(ew.w_gate), as_fp8(ew.w_down)
    codes = np.asarray(wg.qdata).view(np.uint8).copy()
    codes[0, 5, 7] ^= 0x40  # exponent bit of expert 0's gate row 5, element 7
    gate = fp8_block_tensor(jnp.asarray(codes.view(F8)), wg.scales, 64)
    scales = np.asarray(wd.scales).copy()
    scales[0, 0, 0] *= 3
    down = fp8_block_tensor(wd.qdata, jnp.asarray(scales), 64)
    for changed in (ExpertWeights(gate, ew.w_up, ew.w_down), ExpertWeights(ew.w_gate, ew.w_up, down)):
        y = np.asarray(experts_cpu(jnp.asarray(x), Routing(jnp.asarray(ids), jnp.asarray(ws)), changed, cfg))
        assert np.abs(y - y0).max() > 1e-3 * np.abs(y0).max()


@pytest.mark.slow
def test_input_gradient_matches_xla(rng):
    """The C++ backward's input gradient (FP8 experts frozen) against the XLA strategy's."""
    d, f, e = 128, 96, 4
    cfg = cfg_of(d, f, e, 2)
    ew, _ = fp8_case(rng, d, f, e, 32)
    ids, ws = uniform_routing(rng, 5, 2, e)
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    x = jnp.asarray((rng.normal(size=(5, d)) * 0.05).astype(np.float32))
    g = jnp.asarray(rng.normal(size=(5, d)).astype(np.float32))

    def loss(fn):
        return jax.grad(lambda x: jnp.vdot(fn(x, r, ew, cfg), g))(x)

    got, want = loss(experts_cpu), loss(experts_xla)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5 * np.abs(want).max())


def test_bad_scales_and_widths_are_named(rng, monkeypatch):
    """Scales of the wrong shape: a ValueError naming the tensor and both shapes when the
    weight is built (or rebuilt under a transform); past that check (operands
    monkeypatched), the kernel's own check names the operand. Widths that are not
    multiples of 32 are refused before the call (auto falls back); ggml activations are a
    named error (FP8 has no ggml type)."""
    d, f, e = 128, 64, 4
    cfg = cfg_of(d, f, e, 1)
    ew, _ = fp8_case(rng, d, f, e, 64)
    with pytest.raises(ValueError, match=r"w_up \(fp8_e4m3, 64 x 64 blocks\): scales of shape \(4, 1, 1\)"):
        wu = as_fp8(ew.w_up)
        fp8_block_tensor(wu.qdata, np.asarray(wu.scales)[:, :, :1], 64, name="w_up")
    x = jnp.asarray(rng.normal(size=(2, d)).astype(np.float32))
    r = Routing(jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), jnp.float32))
    real = cpu_kernel.operands

    def truncated(w):
        (codes, scales, qb), kind, group = real(w)
        return (codes, scales[:, :, :1], qb), kind, group

    monkeypatch.setattr(cpu_kernel, "operands", truncated)
    with pytest.raises(
        Exception, match=r"w_gate: block-scaled FP8 .*scales must be \[E, ceil\(out / b\), ceil\(in / b\)\]"
    ):
        jax.block_until_ready(experts_cpu(x, r, ew, cfg))
    monkeypatch.undo()
    odd, _ = fp8_case(rng, 120, 64, e, 40)
    why = supports(odd, jnp.float32)
    assert why and "multiples of 32" in why
    assert policy.resolve_impl("auto", 1, platform="cpu", experts=odd) != "cpu"
    with pytest.raises(ValueError, match="no ggml vec_dot_type for weight kind 'fp8_e4m3'"):
        experts_cpu(x, r, ew, cfg, ExecConfig(activations="ggml"))
