"""Routing as pure functions: router logits and the one parameterised rule.

Every family of docs/routing.md ("Families") is one setting of `RouterConfig`:

1. ``s = score_fn(z)`` (softmax over E, sigmoid; for ``*_topk`` rules the selection
   runs on the logits themselves),
2. ``c = s + b`` with the selection bias ``b`` (selection only),
3. optional group limit: groups scored by ``max`` or ``top2_sum`` of ``c``, all
   experts outside the best ``topk_group`` groups set to ``-inf``,
4. ``ids = top_k(c, k)`` (slots by descending selection score, ties to the lower id),
5. ``w = s[ids]`` (unbiased), or softmax / sigmoid of the selected logits,
6. renormalization with the rule's floor, then ``* routed_scaling_factor``.

All routing math runs in float32, whatever the dtype of the activations.

NaN policy: a token whose logits hold any NaN gets NaN weights in every slot (its
ids stay in range), so that token's output is NaN and no other token is touched;
no expert is ever chosen silently for it. `route_checked` raises instead, through
`jax.experimental.checkify`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jaxmoe.config import RouterConfig
from jaxmoe.invariance import fixed_softmax, fixed_sum


class Routing(NamedTuple):
    """The routing of T tokens.

    Attributes:
      expert_ids: ``[T, k]`` int32, slots by descending selection score.
      weights: ``[T, k]`` float32 combine weights of those slots.
    """

    expert_ids: jax.Array
    weights: jax.Array


def router_logits(x: jax.Array, w_router: jax.Array, b_router: jax.Array | None = None) -> jax.Array:
    """Router logits in float32.

    Args:
      x: ``[T, d]`` activations (any float dtype; cast to float32).
      w_router: ``[d, E]``.
      b_router: ``[E]`` or None (gpt-oss has one).
    Returns:
      ``[T, E]`` float32.
    """
    if x.ndim != 2 or w_router.ndim != 2 or x.shape[-1] != w_router.shape[0]:
        raise ValueError(f"router_logits: x {x.shape} and w_router {w_router.shape} must be [T, d] and [d, E]")
    z = jnp.dot(x.astype(jnp.float32), w_router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    if b_router is not None:
        z = z + b_router.astype(jnp.float32)
    return z


def _check_inputs(logits: jax.Array, cfg: RouterConfig, selection_bias) -> None:
    if logits.ndim != 2:
        raise ValueError(f"route: logits must be [T, E], got shape {logits.shape}")
    if logits.shape[1] != cfg.num_experts:
        raise ValueError(
            f"route: logits width {logits.shape[1]} != num_experts {cfg.num_experts} (shape {logits.shape})"
        )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"route: logits must be floating point, got {logits.dtype}")
    if selection_bias is not None:
        if selection_bias.shape != (cfg.num_experts,):
            raise ValueError(f"route: selection_bias must have shape ({cfg.num_experts},), got {selection_bias.shape}")
    elif cfg.use_selection_bias:
        raise ValueError("route: the router config has use_selection_bias=True but no selection_bias was given")


def group_mask(c: jax.Array, cfg: RouterConfig) -> jax.Array:
    """Boolean ``[T, E]``: experts in the best ``topk_group`` groups of the scores ``c``."""
    t, e = c.shape
    g = c.reshape(t, cfg.n_group, cfg.experts_per_group)
    if cfg.group_score == "max":
        gs = g.max(axis=-1)
    else:
        top2 = jax.lax.top_k(g, 2)[0]
        gs = top2[..., 0] + top2[..., 1]
    _, gidx = jax.lax.top_k(gs, cfg.topk_group)  # [T, topk_group]
    keep = jnp.zeros((t, cfg.n_group), bool).at[jnp.arange(t)[:, None], gidx].set(True)
    return jnp.repeat(keep, cfg.experts_per_group, axis=1)


def route(logits: jax.Array, cfg: RouterConfig, selection_bias: jax.Array | None = None) -> Routing:
    """Selects ``k`` experts per token and their weights.

    Args:
      logits: ``[T, E]`` router logits (computed in float32 by `router_logits`).
      cfg: the rule.
      selection_bias: ``[E]`` bias added to the scores for selection only.
    Returns:
      `Routing` with ``expert_ids [T, k]`` int32 and ``weights [T, k]`` float32.
    """
    _check_inputs(logits, cfg, selection_bias)
    z = logits.astype(jnp.float32)
    k = cfg.top_k
    with jax.named_scope("route"):
        if cfg.score_fn == "softmax":
            s = fixed_softmax(z, axis=-1)
        elif cfg.score_fn == "sigmoid":
            s = jax.nn.sigmoid(z)
        else:  # *_topk: select on the logits themselves
            s = z
        c = s if selection_bias is None else s + selection_bias.astype(jnp.float32)
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            c = jnp.where(group_mask(c, cfg), c, -jnp.inf)
        _, ids = jax.lax.top_k(c, k)
        if cfg.score_fn == "softmax_topk":
            w = fixed_softmax(jnp.take_along_axis(z, ids, axis=-1), axis=-1)
        elif cfg.score_fn == "sigmoid_topk":
            w = jax.nn.sigmoid(jnp.take_along_axis(z, ids, axis=-1))
        else:
            w = jnp.take_along_axis(s, ids, axis=-1)
        if cfg.renorm != "none":
            den = fixed_sum(w, axis=-1, keepdims=True)
            if cfg.renorm == "clamp":
                den = jnp.maximum(den, cfg.renorm_eps)
            elif cfg.renorm == "add":
                den = den + cfg.renorm_eps
            w = w / den
        if cfg.routed_scaling_factor != 1.0:
            w = w * jnp.float32(cfg.routed_scaling_factor)
        bad = jnp.isnan(z).any(axis=-1, keepdims=True)
        w = jnp.where(bad, jnp.nan, w)
        ids = jnp.clip(ids, 0, cfg.num_experts - 1).astype(jnp.int32)
    return Routing(ids, w.astype(jnp.float32))


def route_checked(logits: jax.Array, cfg: RouterConfig, selection_bias: jax.Array | None = None) -> Routing:
    """`route` that raises (through checkify) when any logit is NaN or infinite.

    Use as ``err, r = checkify.checkify(route_checked)(logits, cfg)``; ``err.throw()``.
    Outside ``checkify`` the check runs eagerly when the inputs are concrete.
    """
    checkify.check(jnp.isfinite(logits).all(), "route: router logits contain NaN or Inf")
    return route(logits, cfg, selection_bias)


def expert_load(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """``[E]`` int32: how many (token, slot) pairs each expert received."""
    return jnp.zeros((num_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(1)
