"""Routing equals an independent float64 numpy loop for every family of docs/routing.md ("Families")."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import np_route
from hypothesis import given
from hypothesis import strategies as st

import jaxmoe
from jaxmoe import RouterConfig, route

# One rule per family of docs/routing.md, "Families" (shrunk to E=16 or 32).
FAMILIES = {
    "qwen3_5_moe": RouterConfig(num_experts=32, top_k=8, score_fn="softmax", renorm="sum"),
    "qwen3_5_moe_llamacpp": RouterConfig(num_experts=32, top_k=8, renorm="clamp", renorm_eps=2.0**-14),
    "qwen2_moe": RouterConfig(num_experts=16, top_k=4, renorm="none"),
    "qwen3_moe": RouterConfig(num_experts=16, top_k=4, renorm="sum"),
    "mixtral": RouterConfig(num_experts=8, top_k=2, renorm="sum"),
    "deepseek_v2_group_max": RouterConfig(
        num_experts=32, top_k=6, n_group=8, topk_group=3, group_score="max", renorm="none", routed_scaling_factor=16.0
    ),
    "deepseek_v3": RouterConfig(
        num_experts=32,
        top_k=8,
        score_fn="sigmoid",
        use_selection_bias=True,
        n_group=8,
        topk_group=4,
        renorm="add",
        renorm_eps=1e-20,
        routed_scaling_factor=2.5,
    ),
    "ernie4_5": RouterConfig(num_experts=16, top_k=4, use_selection_bias=True, renorm="clamp", renorm_eps=1e-12),
    "granite": RouterConfig(num_experts=16, top_k=4, score_fn="softmax_topk", renorm="none"),
    "gpt_oss": RouterConfig(num_experts=32, top_k=4, score_fn="softmax_topk", router_bias=True, renorm="none"),
    "llama4": RouterConfig(num_experts=16, top_k=1, score_fn="sigmoid_topk", renorm="none"),
}


def _check(rc, logits, bias):
    r = route(jnp.asarray(logits, jnp.float32), rc, None if bias is None else jnp.asarray(bias, jnp.float32))
    chex.assert_shape(r.expert_ids, (logits.shape[0], rc.top_k))
    chex.assert_type(r.expert_ids, jnp.int32)
    chex.assert_type(r.weights, jnp.float32)
    ids, ws = np_route(logits.astype(np.float32), rc, None if bias is None else bias.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(r.expert_ids), ids)
    np.testing.assert_allclose(np.asarray(r.weights), ws, rtol=2e-6, atol=1e-7)
    return r


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_route_matches_numpy(family, rng):
    rc = FAMILIES[family]
    logits = rng.normal(size=(64, rc.num_experts)) * 2.0
    bias = rng.normal(size=rc.num_experts) * 0.5 - 0.3 if rc.use_selection_bias else None
    _check(rc, logits, bias)


@pytest.mark.parametrize("k", [1, 16])
@pytest.mark.parametrize("norm", ["sum", "none"])
@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_route_k_edges(k, norm, score_fn, rng):
    rc = RouterConfig(num_experts=16, top_k=k, score_fn=score_fn, renorm=norm)
    _check(rc, rng.normal(size=(20, 16)), None)


def test_negative_selection_bias_with_groups(rng):
    # Biases all negative and large: selection scores of kept groups fall below zero, so
    # masking with 0 instead of -inf would select masked experts. The reference masks -inf.
    rc = FAMILIES["deepseek_v3"]
    logits = rng.normal(size=(50, rc.num_experts))
    bias = -2.0 - rng.random(rc.num_experts)
    r = _check(rc, logits, bias)
    # every token's experts come from at most topk_group groups
    groups = np.asarray(r.expert_ids) // rc.experts_per_group
    assert max(len(set(g)) for g in groups) <= rc.topk_group


@given(t=st.integers(1, 40), e_pow=st.integers(2, 5), data=st.data())
@pytest.mark.slow
def test_route_properties(t, e_pow, data):
    e = 2**e_pow
    k = data.draw(st.integers(1, e))
    score_fn = data.draw(st.sampled_from(["softmax", "sigmoid", "softmax_topk"]))
    renorm = data.draw(st.sampled_from(["none", "sum"]))
    scale = data.draw(st.sampled_from([1.0, 2.5]))
    seed = data.draw(st.integers(0, 2**31 - 1))
    rc = RouterConfig(num_experts=e, top_k=k, score_fn=score_fn, renorm=renorm, routed_scaling_factor=scale)
    logits = np.random.default_rng(seed).normal(size=(t, e)) * 3
    r = _check(rc, logits, None)
    ids = np.asarray(r.expert_ids)
    assert ids.min() >= 0 and ids.max() < e
    assert all(len(set(row)) == k for row in ids)
    if renorm == "sum" or score_fn == "softmax_topk":
        np.testing.assert_allclose(np.asarray(r.weights).sum(-1), scale, rtol=1e-5)


def test_bias_changes_selection_not_weights(rng):
    rc = RouterConfig(num_experts=16, top_k=4, score_fn="sigmoid", use_selection_bias=True, renorm="none")
    logits = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    bias = np.zeros(16, np.float32)
    bias[[3, 7, 11, 13]] = 10.0  # these four always win
    r = route(logits, rc, jnp.asarray(bias))
    assert set(np.asarray(r.expert_ids).ravel()) == {3, 7, 11, 13}
    s = jax.nn.sigmoid(logits)
    np.testing.assert_allclose(
        np.asarray(r.weights), np.take_along_axis(np.asarray(s), np.asarray(r.expert_ids), 1), rtol=1e-6
    )
    assert np.asarray(r.weights).max() < 1.0  # unbiased scores, not score + 10


def test_router_math_float32_for_bf16_inputs(rng):
    x = jnp.asarray(rng.normal(size=(8, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(32, 16)), jnp.bfloat16)
    z = jaxmoe.router_logits(x, w)
    assert z.dtype == jnp.float32
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(z), ref, rtol=1e-5, atol=1e-5)


def test_nan_token_gets_nan_weights_only(rng):
    rc = RouterConfig(num_experts=16, top_k=4)
    logits = rng.normal(size=(6, 16)).astype(np.float32)
    logits[2, 5] = np.nan
    r = route(jnp.asarray(logits), rc)
    w = np.asarray(r.weights)
    assert np.isnan(w[2]).all()
    assert np.isfinite(np.delete(w, 2, axis=0)).all()
    ids = np.asarray(r.expert_ids)
    assert ids.min() >= 0 and ids.max() < 16


def test_route_checked_raises_on_nan(rng):
    from jax.experimental import checkify

    rc = RouterConfig(num_experts=8, top_k=2)
    logits = rng.normal(size=(4, 8)).astype(np.float32)
    err, _ = checkify.checkify(jax.jit(lambda z: jaxmoe.route_checked(z, rc)))(jnp.asarray(logits))
    err.throw()  # finite: no error
    logits[1, 0] = np.nan
    err, _ = checkify.checkify(jax.jit(lambda z: jaxmoe.route_checked(z, rc)))(jnp.asarray(logits))
    with pytest.raises(Exception, match="NaN or Inf"):
        err.throw()


@pytest.mark.parametrize("shape", [(16,), (2, 4, 16), (4, 8)])
def test_bad_logits_shape(shape, rng):
    rc = RouterConfig(num_experts=16, top_k=2)
    z = jnp.asarray(rng.normal(size=shape), jnp.float32)
    with pytest.raises(ValueError, match="logits"):
        route(z, rc)


def test_bad_selection_bias(rng):
    rc = RouterConfig(num_experts=16, top_k=2, use_selection_bias=True)
    z = jnp.asarray(rng.normal(size=(3, 16)), jnp.float32)
    with pytest.raises(ValueError, match="selection_bias"):
        route(z, rc)
    with pytest.raises(ValueError, match="selection_bias"):
        route(z, rc, jnp.ones(8))


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(num_experts=16, top_k=17), "top_k"),
        (dict(num_experts=16, top_k=2, n_group=3), "n_group"),
        (dict(num_experts=16, top_k=2, n_group=4, topk_group=5), "topk_group"),
        (dict(num_experts=16, top_k=2, score_fn="relu"), "score_fn"),
        (dict(num_experts=16, top_k=2, renorm="max"), "renorm"),
        (dict(num_experts=16, top_k=2, renorm="clamp"), "renorm_eps"),
        (dict(num_experts=0, top_k=1), "num_experts"),
        (dict(num_experts=16, top_k=2, n_group=16, topk_group=2), "n_group"),
        (dict(num_experts=16, top_k=12, n_group=4, topk_group=2), "top_k"),
        (dict(num_experts=16, top_k=2, routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    ],
)
def test_bad_router_config(kw, field):
    with pytest.raises(ValueError, match=f"RouterConfig.{field}"):
        RouterConfig(**kw)


def test_replace_revalidates():
    rc = RouterConfig(num_experts=16, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(rc, num_experts=1)
