"""``ExecConfig(activations="ggml")`` in the C++ kernel (``impl="cpu"``): the input rows
converted by the gate / up weights' ggml format before the call, the hidden activations
by the down weight's format inside it (``h_fmt``), then the float path.

References: the float64 oracle of tests/test_ggml_activations.py (`ggml_layer`: gguf-py's
decode, the activations converted by the numpy port of ggml's quantizers, with the slack
of hidden values that sit on a rounding boundary) for every kind the kernel has the mode
for; the in-kernel conversion of h bit for bit against `jaxmoe.ggml_activations.ggml_round`
(and within the float32 rounding of the product against the numpy port), on hidden
activations made exact by the layer's construction (``h = 64 x``). Also the XLA strategies
in the same mode, batch invariance, ``auto`` taking the kernel (and an XLA strategy for
Q4_1 / Q5_1 when the kernel's integer dots are off: their ``q8_1`` block-sum term exists
only there).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import needs_cpu_kernel
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ggml_activations import _check, _rows, ggml_layer, layer_case

from jaxmoe import ExecConfig, moe_apply
from jaxmoe.config import MoEConfig, RouterConfig
from jaxmoe.evaluation.reference import ggml_quantize_np
from jaxmoe.experts import ExpertWeights
from jaxmoe.ggml_activations import ggml_round
from jaxmoe.impls.cpu import build, ggml_problem
from jaxmoe.impls.cpu import kernel as cpu_kernel

pytestmark = needs_cpu_kernel()

#: every weight kind the kernel has the mode for (``f32`` / ``bf16``: float experts)
KINDS = (
    "int8",
    "int4",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "iq4_nl",
    "mxfp4",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "iq4_xs",
    "bf16",
    "f32",
)
KINDS += ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0")
#: the quick subset (``-m "not slow"``): one kind per activation format
_QUICK = ("q4_k", "bf16", "f32")  # q8_0: test_hidden_activation_is_requantized


def case(kind, seed=0, tokens=6):
    """`layer_case` of ``kind``; ``f32``: the ``bf16`` case's weights stored float32;
    ``q4_k_m``: routed gate / up ``q4_k``, down ``q6_k``, the shared expert ``int8``
    (three activation formats in one call)."""
    if kind == "f32":
        cfg, p, x = layer_case("bf16", seed, tokens)
        to32 = lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a  # noqa: E731
        return (
            cfg,
            dataclasses.replace(p, experts=jax.tree.map(to32, p.experts), shared=jax.tree.map(to32, p.shared)),
            x,
        )
    if kind == "q4_k+q5_k":  # one Q8_K format, two kinds with integer dots
        cfg, p, x = layer_case("q4_k", seed, tokens)
        _, p5, _ = layer_case("q5_k", seed + 100, tokens)
        return cfg, dataclasses.replace(p, experts=dataclasses.replace(p.experts, w_up=p5.experts.w_up)), x
    if kind == "q4_k_m":
        cfg, p, x = layer_case("q4_k", seed, tokens)
        _, p6, _ = layer_case("q6_k", seed + 100, tokens)
        _, p8, _ = layer_case("int8", seed + 200, tokens)
        ew = dataclasses.replace(p.experts, w_down=p6.experts.w_down)
        return cfg, dataclasses.replace(p, experts=ew, shared=_shared_of(p8, p)), x
    return layer_case(kind, seed, tokens)


def _shared_of(src, dst):
    """``src``'s shared expert matrices with ``dst``'s shared gate."""
    assert src.shared is not None and dst.shared is not None
    return dataclasses.replace(src.shared, gate=dst.shared.gate)


def _run(p, x, cfg, impl, **kw):
    return np.asarray(moe_apply(p, jnp.asarray(x), cfg, ExecConfig(impl=impl, activations="ggml", **kw)))


@pytest.mark.parametrize(
    "kind", [k if k in _QUICK else pytest.param(k, marks=pytest.mark.slow) for k in (*KINDS, "q4_k_m", "q4_k+q5_k")]
)
def test_layer_matches_the_ggml_oracle(kind):
    cfg, p, x = case(kind)
    assert ggml_problem(p.experts) is None
    want, slack = ggml_layer(p, x, cfg)
    got = _run(p, x, cfg, "cpu")
    _check(got, want, slack)
    # the XLA strategy in the same mode agrees within the oracle's allowance of each other
    xla = _run(p, x, cfg, "xla")
    _check(got, xla, 2 * slack)
    # float activations are much further from the oracle: the mode does something
    if kind != "f32":  # (f32 experts: ggml converts nothing)
        flt = np.asarray(moe_apply(p, jnp.asarray(x), cfg, ExecConfig(impl="cpu")), np.float64)
        assert np.linalg.norm(flt - want) > 20 * np.linalg.norm(got - want)


def _exact_hidden_case(d):
    """One expert whose hidden activations are ``h = 64 x`` exactly (zero gate / up weights:
    g = the gate bias 64, silu(64) = 64 in float32; u = x through an identity up weight) and
    whose down weight is the identity: the output is h as the kernel converted it."""
    eye = jnp.eye(d, dtype=jnp.float32)[None]
    zero = jnp.zeros((1, d, d), jnp.float32)
    ew = ExpertWeights(
        zero,
        eye,
        eye,
        b_gate=jnp.full((1, d), 64.0, jnp.float32),
        b_up=jnp.zeros((1, d), jnp.float32),
        b_down=jnp.zeros((1, d), jnp.float32),
    )
    cfg = MoEConfig(d_model=d, expert_dim=d, router=RouterConfig(num_experts=1, top_k=1))
    return ew, cfg


def _same_bits(got, want):
    """Equal float32 bits, but for the sign of zero: the identity down product's float32
    sum starts at +0, so a converted -0 (a q8_K code 0 times a negative scale) comes out +0."""
    got, want = (np.asarray(a, np.float32) + np.float32(0) for a in (got, want))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(scale=st.sampled_from([1e-3, 1.0, 37.0]), fmt=st.sampled_from(["bf16", "q8_0", "q8_K"]), data=st.data())
def test_hidden_conversion_is_ggml_round_bit_for_bit(scale, fmt, data):
    x = _rows(scale, data) / np.float32(64)  # h = 64 x: the drawn rows
    # XLA:CPU runs the call with subnormals flushed to zero: a subnormal x (the "tiny" rows
    # divided by 64) reaches h as 0, so the exact construction holds for normal x only
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0
    h = x * np.float32(64)
    ew, cfg = _exact_hidden_case(x.shape[1])
    n = x.shape[0]
    call = jax.jit(
        lambda xs: cpu_kernel.grouped_swiglu(
            xs,
            jnp.zeros((1,), jnp.int32),
            jnp.full((1,), n, jnp.int32),
            ew,
            cfg,
            h_fmt=cpu_kernel.GGML_H_FMT[fmt],
        )
    )
    got = np.asarray(call(jnp.asarray(x)))
    _same_bits(got, ggml_round(jnp.asarray(h), fmt))
    np.testing.assert_allclose(got, ggml_quantize_np(h, fmt)[0], rtol=2**-24, atol=0)


def test_hidden_conversion_quick_and_checked():
    """The quick subset's bitwise check of each format (one draw of rows) and the call's
    error for a width that is not whole blocks."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 512)) * np.float32(0.3)).astype(np.float32)
    x[1, 5] = x[1, 37] = 127 / 64  # a tie-free row with a repeated largest value (the first counts)
    x[2, :32] = 0  # an all-zero block
    ew, cfg = _exact_hidden_case(512)
    for fmt in ("bf16", "q8_0", "q8_K"):
        got = cpu_kernel.grouped_swiglu(
            jnp.asarray(x),
            jnp.zeros((1,), jnp.int32),
            jnp.full((1,), 3, jnp.int32),
            ew,
            cfg,
            h_fmt=cpu_kernel.GGML_H_FMT[fmt],
        )
        _same_bits(got, ggml_round(jnp.asarray(x * np.float32(64)), fmt))
    ew2, cfg2 = _exact_hidden_case(96)
    one = (jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32))
    with pytest.raises(Exception, match="h_fmt 3 converts blocks of 256; F = 96"):
        cpu_kernel.grouped_swiglu(jnp.ones((1, 96)), *one, ew2, cfg2, h_fmt=3).block_until_ready()
    # q8_1 (4): only for a Q4_1 / Q5_1 down weight, and only with ggml's integer dots (int_dot 2)
    with pytest.raises(Exception, match=r"h_fmt 4 \(q8_1\) is for w_down of kind Q4_1 / Q5_1"):
        cpu_kernel.grouped_swiglu(jnp.ones((1, 512)), *one, ew, cfg, h_fmt=4).block_until_ready()
    cfg5, p5, _ = layer_case("q5_1", seed=1, tokens=1)
    e5 = p5.experts.num_experts
    x5, at5 = jnp.ones((1, cfg5.d_model)), (jnp.zeros((e5,), jnp.int32), jnp.zeros((e5,), jnp.int32).at[0].set(1))
    with pytest.raises(Exception, match=r"h_fmt 4 \(q8_1\) needs int_dot 2"):
        cpu_kernel.grouped_swiglu(x5, *at5, p5.experts, cfg5, h_fmt=4).block_until_ready()


def test_hidden_activation_is_requantized(monkeypatch):
    """The kernel's output meets the oracle that converts h, not the one that does not; a
    kernel that skips the in-kernel conversion (``h_fmt`` 0, and no integer dot, whose
    Q8_0 quantizer would convert h by itself) fails the check."""
    cfg, p, x = case("int8", seed=2)
    want, slack = ggml_layer(p, x, cfg)
    got = _run(p, x, cfg, "cpu")
    _check(got, want, slack)
    no_requant, _ = ggml_layer(p, x, cfg, requantize_hidden=False)
    off = np.abs(no_requant - want) > slack + 3e-6 * np.abs(want).max()
    assert off.mean() > 0.5, off.mean()
    jax.clear_caches()
    monkeypatch.setattr(cpu_kernel, "GGML_H_FMT", dict.fromkeys(cpu_kernel.GGML_H_FMT, 0))
    monkeypatch.setattr(cpu_kernel, "GGML_INT_DOT", False)
    skipped = _run(p, x, cfg, "cpu")
    jax.clear_caches()
    with pytest.raises(AssertionError):
        _check(skipped, want, slack)


def test_shared_gate_reads_the_unconverted_rows():
    """The shared expert's gate is a float32 weight: ggml multiplies it with the rows as
    they are, not as converted for the shared expert (bf16 experts: the rows rounded to
    bf16 before the call). Two elements the gate reads, 1 + 2^-8 (a tie bf16 rounds to 1)
    and -1, each times 300: the gate is sigmoid(300 / 256) on the rows as given and
    sigmoid(0) on the converted ones, and the layer must meet the oracle of the first."""
    cfg, p, x = case("bf16", seed=7, tokens=5)
    x = x.copy()
    x[:, 1], x[:, 2] = 1 + 2**-8, -1.0
    gate = np.zeros(cfg.d_model, np.float32)
    gate[1] = gate[2] = 300.0
    p = dataclasses.replace(p, shared=dataclasses.replace(p.shared, gate=jnp.asarray(gate)))
    assert not cpu_kernel._unconverted_input(p.shared)  # the call gets the converted rows
    assert float(ggml_round(jnp.asarray(x), "bf16")[0, 1]) == 1.0
    want, slack = ggml_layer(p, x, cfg)
    _check(_run(p, x, cfg, "cpu"), want, slack)
    _check(_run(p, x, cfg, "xla"), want, slack)


@pytest.mark.parametrize(
    "kind", ["bf16", pytest.param("q4_k_m", marks=pytest.mark.slow), pytest.param("q5_1", marks=pytest.mark.slow)]
)
def test_batch_invariant_in_the_mode(kind):
    cfg, p, x = case(kind, seed=4, tokens=9)
    alone = _run(p, x[3:4], cfg, "cpu", batch_invariant=True)
    among = _run(p, x, cfg, "cpu", batch_invariant=True)[3:4]
    np.testing.assert_array_equal(alone, among)


def _kernel_calls(p, x, cfg):
    """How many calls of the routed + shared kernel, and of the routed-only one, the jitted
    ``auto`` layer in ggml mode compiles to."""
    run = jax.jit(lambda p, x: moe_apply(p, x, cfg, ExecConfig(activations="ggml")))
    hlo = run.lower(p, jnp.asarray(x)).compile().as_text() or ""
    return tuple(hlo.count(f'custom_call_target="{t}"') for t in (build.TARGET_SHARED, build.TARGET))


@pytest.mark.slow
def test_auto_takes_the_kernel_and_falls_back_for_q8_1_kinds_without_integer_dots(monkeypatch):
    cfg, p, x = case("q4_k_m", seed=5, tokens=2)
    assert _kernel_calls(p, x, cfg) == (1, 0), "routed + shared in one kernel call"
    want, slack = ggml_layer(p, x, cfg)
    _check(_run(p, x, cfg, "auto"), want, slack)
    # Q4_1 / Q5_1 (the q8_1 format): the kernel, through its integer dots
    cfg1, p1, x1 = case("q4_1", seed=6, tokens=2)
    assert ggml_problem(p1.experts) is None
    assert sum(_kernel_calls(p1, x1, cfg1)) == 1
    want1, slack1 = ggml_layer(p1, x1, cfg1)
    _check(_run(p1, x1, cfg1, "auto"), want1, slack1)
    # without them (the float path has no block-sum term) auto takes an XLA strategy and an
    # explicit impl="cpu" says why not
    jax.clear_caches()
    monkeypatch.setattr(cpu_kernel, "GGML_INT_DOT", False)
    assert "q8_1" in (ggml_problem(p1.experts) or "")
    assert _kernel_calls(p1, x1, cfg1) == (0, 0)
    _check(_run(p1, x1, cfg1, "auto"), want1, slack1)
    with pytest.raises(ValueError, match="no activations='ggml' arithmetic for w_gate of kind 'q4_1'"):
        _run(p1, x1, cfg1, "cpu")
    jax.clear_caches()


@pytest.mark.slow
def test_shared_expert_of_a_q8_1_kind_runs_in_the_call():
    """Routed Q4_K experts and a Q5_1 shared expert: both in one kernel call (the shared
    expert's rows quantized by Q8_1, its h by h_fmt q8_1), at the oracle."""
    cfg, p, x = case("q4_k", seed=8, tokens=3)
    _, p5, _ = layer_case("q5_1", 9, 3)
    p = dataclasses.replace(p, shared=_shared_of(p5, p))
    assert _kernel_calls(p, x, cfg) == (1, 0)
    want, slack = ggml_layer(p, x, cfg)
    _check(_run(p, x, cfg, "cpu"), want, slack)


@pytest.mark.slow
def test_gradient_is_close_to_the_xla_modes():
    """Gradients pass straight through the conversions (the kernel's float backward): close
    to the XLA strategy's in the same mode."""
    cfg, p, x = case("q4_k", seed=11, tokens=4)
    cot = jnp.asarray(np.random.default_rng(12).standard_normal(x.shape).astype(np.float32))

    def grad(impl):
        f = lambda x: jnp.vdot(jnp.asarray(moe_apply(p, x, cfg, ExecConfig(impl=impl, activations="ggml"))), cot)  # noqa: E731
        return np.asarray(jax.grad(f)(jnp.asarray(x)), np.float64)

    g_cpu, g_xla = grad("cpu"), grad("xla")
    assert np.linalg.norm(g_cpu - g_xla) / np.linalg.norm(g_xla) < 0.05


@pytest.mark.slow
def test_weight_on_input_converts_the_weighted_rows():
    """With the routing weight on the expert input the rows are weighted, then converted
    (as the ``xla`` strategy does): the kernel meets it far closer than float activations."""
    cfg, p, x = case("q4_k", seed=13, tokens=4)
    cfg = dataclasses.replace(cfg, weight_on_input=True)
    got, xla = _run(p, x, cfg, "cpu"), _run(p, x, cfg, "xla")
    flt = np.asarray(moe_apply(p, jnp.asarray(x), cfg, ExecConfig(impl="cpu")))
    assert np.linalg.norm(got - xla) * 20 < np.linalg.norm(flt - xla)


@pytest.mark.parametrize(
    "kind",
    [
        "int8",
        *(
            pytest.param(k, marks=pytest.mark.slow)
            for k in (
                "int4",
                "q4_0",
                "q5_0",
                "q4_1",
                "q5_1",
                "iq4_nl",
                "mxfp4",
                "q4_k",
                "q6_k",
                "q4_k_m",
                "q2_k",
                "q3_k",
                "q5_k",
                "iq4_xs",
                "q4_k+q5_k",
                "iq2_xxs",
                "iq2_xs",
                "iq2_s",
                "iq3_xxs",
                "iq3_s",
                "iq1_s",
                "iq1_m",
                "tq1_0",
                "tq2_0",
            )
        ),
    ],
)
def test_codes_multiplied_in_integers(kind, monkeypatch):
    """int8 / int4 / Q4_0 / Q5_0 / IQ4_NL / MXFP4 experts (ggml format Q8_0), Q4_1 / Q5_1 (Q8_1)
    and Q2_K ... Q6_K / IQ4_XS / the IQ1-3 / TQ kinds (Q8_K, its codes made in the call from
    the unconverted rows) multiply the codes in integers (`GGML_INT_DOT`): other bits than the float path over the
    converted values, and both meet the oracle (a kernel that clamps the Q8_0 or the Q8_K
    codes to +-126, or takes Q8_1's block sum unrounded, fails it). Q4_1 / Q5_1 have no
    float path in the mode: the kernel refuses them there."""
    cfg, p, x = case(kind, seed=14)
    want, slack = ggml_layer(p, x, cfg)
    got = _run(p, x, cfg, "cpu")
    _check(got, want, slack)
    jax.clear_caches()
    monkeypatch.setattr(cpu_kernel, "GGML_INT_DOT", False)
    if kind in ("q4_1", "q5_1"):
        with pytest.raises(ValueError, match="without its integer dots"):
            _run(p, x, cfg, "cpu")
        jax.clear_caches()
        return
    flt = _run(p, x, cfg, "cpu")
    jax.clear_caches()
    _check(flt, want, slack)
    # (a build without AVX2, $JAXMOE_CXXFLAGS=-march=x86-64, multiplies Q4_0 / Q5_0 / IQ4_NL / MXFP4 / the Q8_K kinds'
    # blocks by the float path over the Q8_0 / Q8_K values: no integer sums to tell apart)
    if kind in ("int8", "int4") or not {"-march=x86-64", "-march=x86-64-v2"} & set(build.extra_flags()):
        assert not np.array_equal(got, flt)
