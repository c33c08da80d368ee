"""Bitwise batch invariance (jaxmoe.invariance): a token's output row is the same, bit for
bit, alone and at a random position inside random batches of 1..300 tokens, for every
strategy and dtype, and across repeated calls (the needle test of vLLM's batch-invariant
mode). Compared with ``np.array_equal``, never a tolerance.

The first test is the test's own check: a strategy with one token-count-dependent switch
(``xla`` with its ``T``-dependent row chunk forced on) must be caught. The layers are
shrunk to d = 1024 (XLA:CPU's dots switch algorithms by row count from about that depth;
at d = 64 the switch above would go unseen).
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gguf_block_weight, quantize_experts, random_params, shrink
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxmoe
from jaxmoe.execution import ExecConfig
from jaxmoe.impls.registry import register_impl, unregister_impl
from jaxmoe.impls.xla import choose_block_m, experts_xla
from jaxmoe.invariance import fixed_softmax, fixed_sum, row_blocks

IMPLS = ["cpu", "auto", "xla", "gather", "dense", "xla_tiled", "ragged_dot", "pallas"]
SETTINGS = settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)


@functools.cache
def _case(preset: str, dtype: str, quant: str | None, seed: int = 0):
    cfg = shrink(jaxmoe.load_config(preset), d=1024, f=64, e=16)
    rng = np.random.default_rng(seed)
    p = random_params(cfg, rng, jnp.dtype(dtype))
    if quant:
        p = quantize_experts(p, quant)
    needle = jnp.asarray(rng.standard_normal((1, cfg.d_model)), jnp.dtype(dtype))
    return cfg, p, needle


def _layer(cfg, impl):
    ex = ExecConfig(impl=impl, batch_invariant=True)
    return jax.jit(lambda p, x: jaxmoe.moe_apply(p, x, cfg, ex))


def _needle_mismatches(cfg, p, needle, impl, sizes, rng) -> list[tuple[int, int]]:
    """``(T, position)`` of every batch where the needle's row differs from its row alone."""
    f = _layer(cfg, impl)
    alone = np.asarray(f(p, needle))[0]
    bad = []
    for t in sizes:
        pos = int(rng.integers(t))
        xb = jnp.asarray(rng.standard_normal((t, cfg.d_model)), needle.dtype).at[pos].set(needle[0])
        for _ in range(2):  # repeated calls too
            row = np.asarray(f(p, xb))[pos]
            if not np.array_equal(row, alone):
                bad.append((t, pos))
    again = np.asarray(f(p, needle))[0]
    if not np.array_equal(again, alone):
        bad.append((1, 0))
    return bad


@pytest.mark.slow
def test_a_token_count_dependent_switch_is_caught():
    """The check can fail: ``xla`` with its ``T``-dependent chunk size (choose_block_m)."""
    cfg, p, needle = _case("qwen3.6-35b-a3b", "float32", None)

    def switching(x, routing, ew, cfg, ex):
        t, k = routing.expert_ids.shape
        return experts_xla(x, routing, ew, cfg, dataclasses.replace(ex, block_m=choose_block_m(t * k, ew.num_experts)))

    register_impl("xla_switching", switching)
    try:
        bad = _needle_mismatches(cfg, p, needle, "xla_switching", [1, 5, 40, 130, 300], np.random.default_rng(1))
    finally:
        unregister_impl("xla_switching")
    assert bad, "a strategy whose chunk size follows T went unnoticed"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(sizes=st.lists(st.integers(1, 300), min_size=2, max_size=2), seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_needle_every_strategy(impl, dtype, sizes, seed):
    cfg, p, needle = _case("qwen3.6-35b-a3b", dtype, None)
    assert _needle_mismatches(cfg, p, needle, impl, sizes, np.random.default_rng(seed)) == []


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "deepseek-v3", "mixtral-8x7b", "qwen2-57b-a14b"])
@pytest.mark.parametrize("impl", ["auto", "xla", "gather"])
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(st.integers(2, 300), min_size=2, max_size=2), seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_needle_families(preset, impl, sizes, seed):
    """Biases and the clamped gpt-oss activation, sigmoid + group-limited routing with a
    shared expert and scaling (DeepSeek-V3), no shared expert (Mixtral), a gated shared
    expert (Qwen2)."""
    cfg, p, needle = _case(preset, "float32", None)
    assert _needle_mismatches(cfg, p, needle, impl, sizes, np.random.default_rng(seed)) == []


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("impl", ["cpu", "xla"])
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(st.integers(2, 300), min_size=2, max_size=2), seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_needle_quantized(quant, impl, sizes, seed):
    """Plus a batch of 257 tokens every time (about 128 rows per expert: the C++ kernel's
    packed path, where the needle alone takes the few-row tiles)."""
    cfg, p, needle = _case("qwen3.6-35b-a3b", "float32", quant)
    assert _needle_mismatches(cfg, p, needle, impl, [*sizes, 257], np.random.default_rng(seed)) == []


@functools.cache
def _block_case(up_kind: str, down_kind: str, seed: int = 0):
    """Qwen3.6 at d = 1024, F = 256 (both multiples of the 256-element super-blocks), gate
    and up in GGUF block kind ``up_kind``, down in ``down_kind`` (random blocks)."""
    cfg = shrink(jaxmoe.load_config("qwen3.6-35b-a3b"), d=1024, f=256, e=16)
    rng = np.random.default_rng(seed)
    p = random_params(cfg, rng)
    e, d, f = cfg.router.num_experts, cfg.d_model, cfg.expert_dim
    ew = dataclasses.replace(
        p.experts,
        w_gate=gguf_block_weight(rng, up_kind, (e, f, d))[0],
        w_up=gguf_block_weight(rng, up_kind, (e, f, d))[0],
        w_down=gguf_block_weight(rng, down_kind, (e, d, f))[0],
    )
    needle = jnp.asarray(rng.standard_normal((1, d)), jnp.float32)
    return cfg, dataclasses.replace(p, experts=ew), needle


@pytest.mark.parametrize("kinds", [("q4_k", "q6_k"), ("q5_k", "q5_0")])
@pytest.mark.slow
def test_needle_gguf_block_kinds(kinds):
    """GGUF block kinds in the C++ kernel: an expert with few rows decodes its blocks inside
    the tiles (Q4_K and Q6_K straight into registers), one with 8 or more into the float32
    tile buffer first; the needle's row is the same bits either way. Fixed batch sizes on
    both sides of that switch (16 experts, top 8: about T / 2 rows each), fresh positions."""
    cfg, p, needle = _block_case(*kinds)
    sizes = [3, 40, 257]
    assert _needle_mismatches(cfg, p, needle, "cpu", sizes, np.random.default_rng()) == []


@pytest.mark.parametrize("plats", [("cpu",), ("oneapi",)])
def test_the_default_is_the_fast_layer_and_true_adds_loops_only_where_asked(plats):
    """``ExecConfig()`` (default) is the fast layer (invariance costs time, docs/performance.md):
    no row-block loops in the program; ``batch_invariant=True`` adds them, on every
    lowering platform."""
    cfg, p, needle = _case("qwen3.6-35b-a3b", "float32", None)
    x = jnp.concatenate([needle] * 5)

    def whiles(ex):
        f = jax.jit(lambda p, x: jaxmoe.moe_apply(p, x, cfg, ex))
        return f.trace(p, x).lower(lowering_platforms=plats).as_text().count("stablehlo.while")

    base = whiles(None)
    assert base == whiles(ExecConfig(batch_invariant=False))
    assert whiles(ExecConfig(batch_invariant=True)) > base


@pytest.mark.parametrize("impl", ["cpu", "xla", "gather", "dense"])
@pytest.mark.slow
def test_invariant_mode_computes_the_same_layer(impl):
    """Invariance changes only the order of float operations: the output stays within
    float32 rounding of the fast mode's."""
    cfg, p, _ = _case("deepseek-v3", "float32", None)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((37, cfg.d_model)), jnp.float32)
    a = np.asarray(jaxmoe.moe_apply(p, x, cfg, ExecConfig(impl=impl, batch_invariant=True)))
    b = np.asarray(jaxmoe.moe_apply(p, x, cfg, ExecConfig(impl=impl)))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 300), t=st.integers(0, 11), seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_fixed_sum_and_softmax_against_float64(n, t, seed):
    v = np.random.default_rng(seed).standard_normal((t, n)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(fixed_sum(jnp.asarray(v))), v.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-4
    )
    e = np.exp(v.astype(np.float64) - v.max(-1, keepdims=True, initial=-np.inf))
    np.testing.assert_allclose(
        np.asarray(fixed_softmax(jnp.asarray(v))), e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("t", [0, 1, 7, 8, 9, 33])
def test_row_blocks_matches_the_plain_call(t):
    rng = np.random.default_rng(t)
    x = jnp.asarray(rng.standard_normal((t, 5)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 9, (t, 2)), jnp.int32)
    y, z = row_blocks(lambda r, s: (r[0] * s, r[1] + 1), (x, ids), 3.0)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 3.0)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(ids) + 1)
    with pytest.raises(ValueError, match="same leading size"):
        row_blocks(lambda r: r, (x, jnp.zeros((t + 1,), jnp.float32)))


@pytest.mark.parametrize("impl", ["auto", "dense"])
@pytest.mark.slow
def test_gradients_through_the_invariant_layer(impl):
    """The invariant forms' loops have no reverse mode of their own (their trip count is
    hidden from XLA); their VJP is that of the plain computation: same gradients."""
    cfg, p, _ = _case("deepseek-v3", "float32", None)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((11, cfg.d_model)), jnp.float32)

    def loss(inv):
        return lambda p, x: jnp.sum(jnp.sin(jaxmoe.moe_apply(p, x, cfg, ExecConfig(impl=impl, batch_invariant=inv))))

    ga = jax.grad(loss(True), argnums=(0, 1))(p, x)
    gb = jax.grad(loss(False), argnums=(0, 1))(p, x)
    chex.assert_trees_all_close(ga, gb, rtol=1e-4, atol=1e-4)
