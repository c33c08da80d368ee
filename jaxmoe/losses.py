"""Router losses and load balancing, as pure functions of the router logits and the routing.

- `switch_load_balancing_loss`: ``E * sum_i f_i * P_i`` (Switch Transformer, Fedus et
  al. 2021, eq. 4; top-k form as Megatron-LM's ``switch_load_balancing_loss_func``).
- `router_z_loss`: ``mean_t logsumexp(z_t)^2`` (ST-MoE, Zoph et al. 2022, eq. 5).
- `sequence_balance_loss`: DeepSeek-V3's complementary sequence-wise balance loss
  (DeepSeek-V3 technical report, eqs. 17-20).
- `update_selection_bias`: the auxiliary-loss-free balancing step ``b_i += gamma *
  sign(mean_load - load_i)`` (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing
  Strategy for Mixture-of-Experts"; DeepSeek-V3 report, section 2.1.2). It returns the
  new selection bias; the bias is a state updated outside the optimizer, not a parameter.

`router_aux` computes the three losses of one layer's call at once (`RouterAux`, what
``MoEBlock(...)(x, return_aux=True)`` returns beside the output).

None of them multiplies by a loss coefficient: scale them in the training loss. The
selection (the top-k, the group limit, the selection bias) carries no gradient; the
losses are differentiable in the logits through the probabilities ``P``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.routing import Routing


def _check(logits: jax.Array, expert_ids: jax.Array, name: str) -> tuple[int, int, int]:
    if logits.ndim != 2 or expert_ids.ndim != 2 or logits.shape[0] != expert_ids.shape[0]:
        raise ValueError(
            f"{name}: logits must be [T, E] and expert_ids [T, k] with the same T, "
            f"got {tuple(logits.shape)} and {tuple(expert_ids.shape)}"
        )
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"{name}: expert_ids must be integer, got {expert_ids.dtype}")
    (t, e), k = logits.shape, expert_ids.shape[1]
    return t, e, k


def expert_counts(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """``[E]`` float32: how many (token, slot) pairs chose each expert (ids outside ``[0, E)`` are not counted)."""
    flat = expert_ids.reshape(-1)
    flat = jnp.where(flat < 0, num_experts, flat)  # a negative index would wrap around in the scatter
    return jnp.zeros((num_experts,), jnp.float32).at[flat].add(1.0, mode="drop")


def switch_load_balancing_loss(logits: jax.Array, expert_ids: jax.Array) -> jax.Array:
    """Switch load-balancing loss ``E * sum_i f_i * P_i``, a float32 scalar.

    ``f_i = count_i / (T * k)`` is the fraction of the ``T * k`` (token, slot) pairs routed
    to expert ``i`` and ``P_i = mean_t softmax(z_t)_i`` the mean router probability. It is
    1 for a perfectly uniform router. (Hugging Face's ``load_balancing_loss_func`` sums the
    fractions of each slot instead, ``k`` times this value.)

    Args:
      logits: ``[T, E]`` router logits.
      expert_ids: ``[T, k]`` the selected experts (`jaxmoe.Routing.expert_ids`).
    """
    t, e, k = _check(logits, expert_ids, "switch_load_balancing_loss")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [T, E]
    f = jax.lax.stop_gradient(expert_counts(expert_ids, e)) / (t * k)
    p = probs.mean(axis=0)
    return e * jnp.sum(f * p)


def router_z_loss(logits: jax.Array) -> jax.Array:
    """Router z-loss ``mean_t (logsumexp_j z_tj)^2`` over ``logits [T, E]``, a float32 scalar."""
    if logits.ndim != 2:
        raise ValueError(f"router_z_loss: logits must be [T, E], got shape {tuple(logits.shape)}")
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return jnp.mean(lse**2)


def sequence_balance_loss(logits: jax.Array, expert_ids: jax.Array, *, score_fn: str = "sigmoid") -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss ``sum_i f_i * P_i``, averaged over sequences.

    Per sequence of ``S`` tokens: ``s'_t = s_t / sum_j s_tj`` with ``s = sigmoid(z)``
    (``score_fn="softmax"``: ``softmax(z)``), ``P_i = mean_t s'_ti`` and
    ``f_i = E / (k * S) * count_i`` (``count_i``: tokens of the sequence that selected
    expert ``i``). It is 1 for a perfectly uniform router.

    Args:
      logits: ``[B, S, E]`` (or ``[S, E]``: one sequence) router logits.
      expert_ids: ``[B, S, k]`` (or ``[S, k]``) the selected experts.
      score_fn: ``sigmoid`` (DeepSeek-V3) or ``softmax``.
    """
    if score_fn not in ("sigmoid", "softmax"):
        raise ValueError(f"sequence_balance_loss: score_fn must be 'sigmoid' or 'softmax', got {score_fn!r}")
    if logits.ndim == 2:
        logits, expert_ids = logits[None], expert_ids[None]
    if logits.ndim != 3 or expert_ids.ndim != 3 or logits.shape[:2] != expert_ids.shape[:2]:
        raise ValueError(
            "sequence_balance_loss: logits must be [B, S, E] and expert_ids [B, S, k] with the same B, S, "
            f"got {tuple(logits.shape)} and {tuple(expert_ids.shape)}"
        )
    _, s, e = logits.shape
    k = expert_ids.shape[-1]
    z = logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(z) if score_fn == "sigmoid" else jax.nn.softmax(z, axis=-1)
    normed = scores / scores.sum(axis=-1, keepdims=True)  # [B, S, E]
    p = normed.mean(axis=1)  # [B, E]
    counts = jax.vmap(lambda ids: expert_counts(ids, e))(expert_ids)  # [B, E]
    f = jax.lax.stop_gradient(counts) * (e / (k * s))
    return jnp.mean(jnp.sum(f * p, axis=-1))


def update_selection_bias(bias: jax.Array, expert_ids: jax.Array, gamma: float) -> jax.Array:
    """One auxiliary-loss-free balancing step: ``b_i + gamma * sign(mean_load - load_i)``.

    Overloaded experts (``load_i`` above the mean) get a lower selection bias, underloaded
    ones a higher, so the next steps' selection moves toward uniform load. The bias is
    used for selection only (``RouterConfig.use_selection_bias``), never in the weights.

    Args:
      bias: ``[E]`` the current selection bias (``MoEParams.selection_bias``).
      expert_ids: ``[..., k]`` the experts selected in the last step(s).
      gamma: the bias update speed (DeepSeek-V3 used 0.001).
    Returns:
      ``[E]`` the new bias, in ``bias.dtype``.
    """
    if bias.ndim != 1:
        raise ValueError(f"update_selection_bias: bias must be [E], got shape {tuple(bias.shape)}")
    if not gamma > 0:
        raise ValueError(f"update_selection_bias: gamma must be positive, got {gamma!r}")
    load = expert_counts(expert_ids, bias.shape[0])
    step = gamma * jnp.sign(load.mean() - load)
    return (bias.astype(jnp.float32) + step).astype(bias.dtype)


class RouterAux(NamedTuple):
    """What one MoE layer call adds to a training loss (a pytree; `router_aux` builds it).

    Attributes:
      logits: ``[T, E]`` float32 router logits over the flattened tokens.
      routing: the `Routing` ``[T, k]`` the layer used.
      load_balancing_loss: `switch_load_balancing_loss` of the logits and routing.
      z_loss: `router_z_loss` of the logits.
      sequence_balance_loss: `sequence_balance_loss` over the sequences of the call.
    """

    logits: jax.Array
    routing: Routing
    load_balancing_loss: jax.Array
    z_loss: jax.Array
    sequence_balance_loss: jax.Array


def router_aux(
    logits: jax.Array, routing: Routing, *, score_fn: str = "softmax", seq_len: int | None = None
) -> RouterAux:
    """The router losses of one layer call, as `RouterAux`.

    Args:
      logits: ``[T, E]`` router logits (`jaxmoe.router_logits`).
      routing: the `Routing` ``[T, k]`` selected from them.
      score_fn: ``softmax`` or ``sigmoid``: the scores of `sequence_balance_loss` (a
        router's ``RouterConfig.score_fn`` family: ``sigmoid*`` -> ``sigmoid``).
      seq_len: tokens per sequence ``S`` (the ``T`` tokens are ``T // S`` sequences in
        order); None: one sequence of ``T``.
    """
    t = logits.shape[0] if logits.ndim == 2 else -1
    _check(logits, routing.expert_ids, "router_aux")
    s = t if seq_len is None else seq_len
    if s < 1 or t % s:
        raise ValueError(f"router_aux: seq_len must divide the {t} tokens, got {seq_len!r}")
    e, k = logits.shape[1], routing.expert_ids.shape[1]
    seq = sequence_balance_loss(
        logits.reshape(t // s, s, e), routing.expert_ids.reshape(t // s, s, k), score_fn=score_fn
    )
    return RouterAux(
        logits=logits,
        routing=routing,
        load_balancing_loss=switch_load_balancing_loss(logits, routing.expert_ids),
        z_loss=router_z_loss(logits),
        sequence_balance_loss=seq,
    )
