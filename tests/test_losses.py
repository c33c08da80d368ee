"""Router losses against hand-computed float64 numpy values, and the loss-free bias update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxmoe import RouterConfig, route
from jaxmoe.losses import (
    expert_counts,
    router_aux,
    router_z_loss,
    sequence_balance_loss,
    switch_load_balancing_loss,
    update_selection_bias,
)


def np_softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_switch(z, ids):
    t, e = z.shape
    k = ids.shape[1]
    p = np_softmax(z)
    total = 0.0
    for i in range(e):
        f_i = sum(1 for tt in range(t) for s in range(k) if ids[tt, s] == i) / (t * k)
        total += f_i * p[:, i].mean()
    return e * total


def np_sequence(z, ids):
    b, s, e = z.shape
    k = ids.shape[-1]
    out = 0.0
    for bb in range(b):
        sc = 1.0 / (1.0 + np.exp(-np.asarray(z[bb], np.float64)))
        sc = sc / sc.sum(-1, keepdims=True)
        for i in range(e):
            count = sum(1 for t in range(s) for j in range(k) if ids[bb, t, j] == i)
            out += (e / (k * s)) * count * sc[:, i].mean()
    return out / b


@given(t=st.integers(1, 40), e=st.integers(2, 12), seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_switch_and_z_loss_match_numpy(t, e, seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, e + 1))
    z = rng.normal(scale=3.0, size=(t, e)).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    got = switch_load_balancing_loss(jnp.asarray(z), jnp.asarray(ids))
    np.testing.assert_allclose(float(got), np_switch(z, ids), rtol=2e-5)
    lse = np.log(np.exp(np.asarray(z, np.float64)).sum(-1))
    np.testing.assert_allclose(float(router_z_loss(jnp.asarray(z))), np.mean(lse**2), rtol=2e-5)


def test_uniform_router_gives_one(rng):
    e, k, t = 8, 2, 16
    z = np.repeat(rng.normal(size=(t, 1)), e, axis=1).astype(np.float32)  # equal logits within each token
    ids = np.array([[(k * i) % e, (k * i + 1) % e] for i in range(t)], np.int32)  # t * k / e pairs per expert
    np.testing.assert_allclose(float(switch_load_balancing_loss(jnp.asarray(z), jnp.asarray(ids))), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(sequence_balance_loss(jnp.asarray(z), jnp.asarray(ids))), 1.0, rtol=1e-6)


def test_sequence_balance_loss_matches_numpy(rng):
    b, s, e, k = 3, 11, 16, 4
    z = rng.normal(scale=2.0, size=(b, s, e)).astype(np.float32)
    ids = np.stack([np.stack([rng.permutation(e)[:k] for _ in range(s)]) for _ in range(b)]).astype(np.int32)
    got = sequence_balance_loss(jnp.asarray(z), jnp.asarray(ids))
    np.testing.assert_allclose(float(got), np_sequence(z, ids), rtol=2e-5)
    one = sequence_balance_loss(jnp.asarray(z[1]), jnp.asarray(ids[1]))  # [S, E] is one sequence
    np.testing.assert_allclose(float(one), np_sequence(z[1:2], ids[1:2]), rtol=2e-5)


def test_losses_differentiate_through_the_probabilities_only(rng):
    t, e, k = 12, 8, 2
    z = jnp.asarray(rng.normal(size=(t, e)), jnp.float32)
    ids = jax.lax.top_k(z, k)[1]
    g = jax.grad(lambda z: switch_load_balancing_loss(z, ids))(z)
    # d/dz of E * sum_i f_i * mean_t softmax(z_t)_i, f held fixed: softmax Jacobian times E f_i / T
    f = np.asarray(expert_counts(ids, e)) / (t * k)
    p = np_softmax(np.asarray(z))
    want = e / t * p * (f[None, :] - (p * f[None, :]).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=1e-7)
    gz = jax.grad(router_z_loss)(z)
    lse = np.log(np.exp(np.asarray(z, np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(gz), 2 * lse * p / t, rtol=1e-4, atol=1e-7)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="switch_load_balancing_loss"):
        switch_load_balancing_loss(jnp.ones((4, 8)), jnp.ones((5, 2), jnp.int32))
    with pytest.raises(ValueError, match="expert_ids must be integer"):
        switch_load_balancing_loss(jnp.ones((4, 8)), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="router_z_loss"):
        router_z_loss(jnp.ones((4,)))
    with pytest.raises(ValueError, match="score_fn"):
        sequence_balance_loss(jnp.ones((4, 8)), jnp.ones((4, 2), jnp.int32), score_fn="relu")
    with pytest.raises(ValueError, match="gamma"):
        update_selection_bias(jnp.zeros((8,)), jnp.ones((4, 2), jnp.int32), 0.0)


def test_bias_update_moves_load_toward_uniform(rng):
    """A skewed sigmoid router (DeepSeek-V3 style): 50 loss-free bias steps flatten the load."""
    e, k, t, d = 16, 2, 256, 32
    cfg = RouterConfig(num_experts=e, top_k=k, score_fn="sigmoid", use_selection_bias=True)
    w = rng.normal(size=(d, e)).astype(np.float32) / np.sqrt(d)
    skew = np.zeros((e,), np.float32)
    skew[:3] = 2.5  # experts 0..2 win most tokens
    bias = jnp.zeros((e,), jnp.float32)

    def imbalance(b, x):
        ids = route(jnp.asarray(x @ w + skew), cfg, b).expert_ids
        load = np.asarray(expert_counts(ids, e))
        return load.max() / load.mean(), ids

    x0 = rng.normal(size=(t, d)).astype(np.float32)
    start, _ = imbalance(bias, x0)
    for _ in range(50):
        x = rng.normal(size=(t, d)).astype(np.float32)
        _, ids = imbalance(bias, x)
        bias = update_selection_bias(bias, ids, gamma=0.02)
    end, _ = imbalance(bias, x0)
    assert start > 3.0, start
    assert end < 0.5 * start and end < 2.0, (start, end)
    assert np.asarray(bias)[:3].max() < 0 < np.asarray(bias)[3:].max()


def test_hand_computed_two_tokens():
    """Two tokens, two experts, logits (0, ln 3): p = (1/4, 3/4), both pick expert 1."""
    z = jnp.asarray([[0.0, np.log(3.0)], [0.0, np.log(3.0)]], jnp.float32)
    ids = jnp.asarray([[1], [1]], jnp.int32)
    # f = (0, 1), P = (1/4, 3/4): E * sum f P = 2 * 3/4
    np.testing.assert_allclose(float(switch_load_balancing_loss(z, ids)), 1.5, rtol=1e-6)
    np.testing.assert_allclose(float(router_z_loss(z)), np.log(4.0) ** 2, rtol=1e-6)  # logsumexp = ln 4
    # softmax scores: P = (1/4, 3/4), f = E / (k S) * count = (0, 2): 2 * 3/4
    np.testing.assert_allclose(float(sequence_balance_loss(z, ids, score_fn="softmax")), 1.5, rtol=1e-6)
    # sigmoid scores (1/2, 3/4) normalized to (2/5, 3/5): 2 * 3/5
    np.testing.assert_allclose(float(sequence_balance_loss(z, ids, score_fn="sigmoid")), 1.2, rtol=1e-6)


def test_sequence_balance_loss_softmax_scores_match_numpy(rng):
    b, s, e, k = 2, 9, 8, 3
    z = rng.normal(scale=2.0, size=(b, s, e)).astype(np.float32)
    ids = np.stack([np.stack([rng.permutation(e)[:k] for _ in range(s)]) for _ in range(b)]).astype(np.int32)
    want = 0.0
    for bb in range(b):
        p = np_softmax(z[bb]).mean(0)
        counts = np.bincount(ids[bb].reshape(-1), minlength=e)
        want += (e / (k * s) * counts * p).sum()
    got = sequence_balance_loss(jnp.asarray(z), jnp.asarray(ids), score_fn="softmax")
    np.testing.assert_allclose(float(got), want / b, rtol=2e-5)


def test_expert_counts_drop_invalid_ids():
    ids = jnp.asarray([[0, 8], [-1, 2], [2, 0]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(expert_counts(ids, 8)), [2, 0, 2, 0, 0, 0, 0, 0])


def test_router_aux_is_the_three_losses(rng):
    t, e, k, s = 12, 8, 2, 4
    z = jnp.asarray(rng.normal(size=(t, e)), jnp.float32)
    r = route(z, RouterConfig(num_experts=e, top_k=k))
    aux = router_aux(z, r, score_fn="sigmoid", seq_len=s)
    assert aux.routing is r and aux.logits is z
    np.testing.assert_allclose(
        float(aux.load_balancing_loss), np_switch(np.asarray(z), np.asarray(r.expert_ids)), rtol=2e-5
    )
    lse = np.log(np.exp(np.asarray(z, np.float64)).sum(-1))
    np.testing.assert_allclose(float(aux.z_loss), np.mean(lse**2), rtol=2e-5)
    want = np_sequence(np.asarray(z).reshape(t // s, s, e), np.asarray(r.expert_ids).reshape(t // s, s, k))
    np.testing.assert_allclose(float(aux.sequence_balance_loss), want, rtol=2e-5)
    one = router_aux(z, r)  # one sequence of all T tokens
    np.testing.assert_allclose(
        float(one.sequence_balance_loss), float(sequence_balance_loss(z, r.expert_ids, score_fn="softmax")), rtol=1e-6
    )
    with pytest.raises(ValueError, match="seq_len must divide the 12 tokens"):
        router_aux(z, r, seq_len=5)
