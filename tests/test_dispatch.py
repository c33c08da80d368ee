"""`plan_dispatch` against a plain Python reference (hypothesis over routings)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxmoe.dispatch import DispatchPlan, max_tiles, plan_dispatch


def reference_plan(ids: np.ndarray, e: int, bm: int):
    """Loop reference: stable sort, groups, and megablox visits (expert, row tile)."""
    t, k = ids.shape
    pairs = [(int(ids[tt, s]), tt * k + s) for tt in range(t) for s in range(k)]
    order = [p for _, p in sorted(pairs, key=lambda ep: ep[0])]  # Python sort is stable
    sizes = [0] * e
    for ex, _ in pairs:
        sizes[ex] += 1
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    visits = []
    for ex in range(e):
        lo, hi = offsets[ex], offsets[ex + 1]
        for tile in range(-(-len(order) // bm)):
            if max(lo, tile * bm) < min(hi, (tile + 1) * bm):
                visits.append((ex, tile))
    inv = [0] * len(order)
    for row, p in enumerate(order):
        inv[p] = row
    return dict(
        sort_idx=order,
        token_idx=[p // k for p in order],
        inv=inv,
        group_sizes=sizes,
        group_offsets=offsets,
        visits=visits,
    )


def check_plan(plan: DispatchPlan, ids: np.ndarray, e: int, bm: int):
    ref = reference_plan(ids, e, bm)
    for name in ("sort_idx", "token_idx", "inv", "group_sizes", "group_offsets"):
        got = np.asarray(getattr(plan, name))
        assert got.dtype == np.int32, name
        np.testing.assert_array_equal(got, np.asarray(ref[name], np.int32), err_msg=name)
    n = int(plan.num_tiles)
    assert n == len(ref["visits"])
    assert plan.tile_group.shape == plan.tile_row.shape == (max_tiles(ids.size, e, bm),)
    assert n <= plan.tile_group.shape[0]
    got_vis = list(zip(np.asarray(plan.tile_group).tolist(), np.asarray(plan.tile_row).tolist()))
    assert got_vis[:n] == ref["visits"]
    assert all(v == ref["visits"][-1] for v in got_vis[n:]), "padding visits must repeat the last valid one"
    assert (plan.block_m, plan.num_experts, plan.top_k) == (bm, e, ids.shape[1])


@st.composite
def routings(draw):
    e = draw(st.integers(1, 24))
    k = draw(st.integers(1, min(e, 4)))
    t = draw(st.integers(1, 40))
    bm = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 64]))
    mode = draw(st.sampled_from(["uniform", "skewed", "one", "few"]))
    seed = draw(st.integers(0, 2**31 - 1))
    r = np.random.default_rng(seed)
    if mode == "uniform":
        probs = np.full(e, 1.0 / e)
    elif mode == "skewed":
        probs = r.dirichlet(np.full(e, 0.2))
    elif mode == "one":  # one expert takes as much as top-k allows
        probs = np.full(e, 1e-9)
        probs[r.integers(e)] = 1.0
        probs /= probs.sum()
    else:  # only a few experts used, the rest empty
        probs = np.zeros(e)
        probs[r.choice(e, size=min(e, k + 1), replace=False)] = 1.0
        probs /= probs.sum()
    ids = np.stack(
        [
            r.choice(e, size=k, replace=False, p=probs)
            if np.count_nonzero(probs) >= k
            else r.choice(e, size=k, replace=False)
            for _ in range(t)
        ]
    ).astype(np.int32)
    return ids, e, bm


@given(routings())
@pytest.mark.slow
def test_plan_matches_reference(case):
    ids, e, bm = case
    check_plan(plan_dispatch(jnp.asarray(ids), e, bm), ids, e, bm)


def test_plan_under_jit_static_shapes(rng):
    e, k, bm = 12, 3, 8
    f = jax.jit(plan_dispatch, static_argnums=(1, 2))
    for t in (1, 5, 17, 33):
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
        check_plan(f(jnp.asarray(ids), e, bm), ids, e, bm)


def test_every_pair_on_one_expert_k1(rng):
    """k = 1 with every token on the same expert: one group, every tile visited once."""
    e, t, bm = 9, 37, 8
    ids = np.full((t, 1), int(rng.integers(e)), np.int32)
    plan = plan_dispatch(jnp.asarray(ids), e, bm)
    check_plan(plan, ids, e, bm)
    assert int(plan.num_tiles) == -(-t // bm)


def test_single_token(rng):
    e, k = 16, 4
    ids = rng.choice(e, k, replace=False).astype(np.int32)[None]
    for bm in (1, 4, 128):
        check_plan(plan_dispatch(jnp.asarray(ids), e, bm), ids, e, bm)


def test_max_tiles_is_tight(rng):
    """The bound is reached: every expert boundary inside a tile."""
    e, bm = 4, 4
    ids = rng.permutation(np.repeat(np.arange(e, dtype=np.int32), 3))[:, None]  # boundaries 3, 6, 9: mid-tile
    plan = plan_dispatch(jnp.asarray(ids), e, bm)
    check_plan(plan, ids, e, bm)
    assert int(plan.num_tiles) == max_tiles(ids.size, e, bm) == 6


@pytest.mark.parametrize(
    "bad, msg",
    [
        (dict(expert_ids=jnp.zeros((4,), jnp.int32)), "expert_ids must be \\[T, k\\]"),
        (dict(expert_ids=jnp.zeros((4, 2), jnp.float32)), "expert_ids must be integer"),
        (dict(num_experts=0), "num_experts"),
        (dict(block_m=0), "block_m"),
    ],
)
def test_bad_arguments(bad, msg):
    args = dict(expert_ids=jnp.zeros((4, 2), jnp.int32), num_experts=4, block_m=8) | bad
    with pytest.raises(ValueError, match=msg):
        plan_dispatch(**args)
