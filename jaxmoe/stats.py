"""Routing statistics as pure, jittable functions: no host sync, no Python loop over tokens.

- `expert_counts`: tokens per expert ``[E]`` int32 from a `jaxmoe.Routing` (or its
  ``expert_ids``): each (token, slot) pair counts once for its expert. Pairs the layer
  never computes do not count: ids outside ``[0, E)`` (which the layer turns into an
  exact zero, docs/routing.md "Invalid expert ids") and tokens masked out by ``valid``
  (e.g. padding rows). A token with NaN weights counts: its experts still ran.
- `device_load`: tokens per device ``[D]`` from per-expert (or per-physical-slot) counts
  and the device of each expert / slot; `contiguous_devices` is the layout of
  `jaxmoe.parallel.moe_apply_ep` without a placement (expert ``e`` on device
  ``e // (E / D)``; with a `jaxmoe.placement.Placement` of ``P`` slots, slot ``p`` on
  device ``p // (P / D)`` and the counts are ``EPStats.expert_load [P]``).

Accumulate across calls and layers by adding: ``stats = stats + expert_counts(r, E)``
(inside or outside ``jit``), or let `jaxmoe.MoEBlock` do it (``track_load=True``: the
`jaxmoe.block.ExpertLoad` variable ``block.expert_load``, `MoEBlock.reset_expert_load`). Counts are
int32: reset them before any count could pass the int32 range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.dispatch import id_valid
from jaxmoe.routing import Routing


def expert_counts(
    routing: Routing | jax.Array | np.ndarray, num_experts: int, *, valid: jax.Array | np.ndarray | None = None
) -> jax.Array:
    """Tokens per expert: ``[E]`` int32, the (token, slot) pairs routed to each expert.

    Args:
      routing: a `jaxmoe.Routing`, or its ``expert_ids`` ``[..., k]`` (any integer dtype).
      num_experts: ``E``; ids outside ``[0, E)`` are not counted.
      valid: optional bool mask over the tokens (``expert_ids.shape[:-1]``); a False
        token (padding) is not counted.
    Returns:
      ``[E]`` int32 counts; their sum is the number of counted pairs.
    """
    ids = routing.expert_ids if isinstance(routing, Routing) else routing
    ids = jnp.asarray(ids)
    if not isinstance(num_experts, int | np.integer) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"expert_counts: num_experts must be a positive int, got {num_experts!r}")
    if ids.ndim < 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"expert_counts: expert_ids must be an integer array [..., k], got {ids.dtype} {ids.shape}")
    ok = id_valid(ids, num_experts)
    if valid is not None:
        valid = jnp.asarray(valid)
        if valid.shape != ids.shape[:-1] or valid.dtype != jnp.bool_:
            raise ValueError(
                f"expert_counts: valid must be bool {ids.shape[:-1]} (the tokens of expert_ids {ids.shape}), "
                f"got {valid.dtype} {valid.shape}"
            )
        ok = ok & valid[..., None]
    # invalid pairs go to index E, which the scatter drops
    idx = jnp.where(ok, ids, num_experts).reshape(-1).astype(jnp.int32)
    return jnp.zeros((num_experts,), jnp.int32).at[idx].add(1, mode="drop")


def contiguous_devices(num_slots: int, num_devices: int) -> np.ndarray:
    """``[num_slots]`` int32: the device of each expert (or physical slot) when each device
    holds a contiguous ``num_slots / num_devices`` of them, as `jaxmoe.parallel.moe_apply_ep`
    places them. ValueError unless ``num_devices`` divides ``num_slots``."""
    for name, v in (("num_slots", num_slots), ("num_devices", num_devices)):
        if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < 1:
            raise ValueError(f"contiguous_devices: {name} must be a positive int, got {v!r}")
    if num_slots % num_devices:
        raise ValueError(f"contiguous_devices: num_devices={num_devices} does not divide num_slots={num_slots}")
    return (np.arange(num_slots) // (num_slots // num_devices)).astype(np.int32)


def device_load(counts: jax.Array | np.ndarray, expert_to_device, num_devices: int) -> jax.Array:
    """Tokens per device: ``[..., D]`` int32, the sum of ``counts`` over each device's experts.

    Args:
      counts: ``[..., N]`` integer counts per expert (or per physical slot), e.g. from
        `expert_counts` or ``EPStats.expert_load``.
      expert_to_device: ``[N]`` integer, the device of each expert / slot (a traced array is
        fine: a new layout does not recompile); e.g. `contiguous_devices`.
      num_devices: ``D`` (static).
    Returns:
      ``[..., D]`` int32; entries of ``expert_to_device`` outside ``[0, D)`` are not counted.
    """
    counts = jnp.asarray(counts)
    dev = jnp.asarray(expert_to_device)
    if counts.ndim < 1 or not jnp.issubdtype(counts.dtype, jnp.integer):
        raise ValueError(f"device_load: counts must be an integer array [..., N], got {counts.dtype} {counts.shape}")
    if dev.shape != counts.shape[-1:] or not jnp.issubdtype(dev.dtype, jnp.integer):
        raise ValueError(
            f"device_load: expert_to_device must be integer [{counts.shape[-1]}] (one device per entry of "
            f"counts {counts.shape}), got {dev.dtype} {dev.shape}"
        )
    if not isinstance(num_devices, int | np.integer) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"device_load: num_devices must be a positive int, got {num_devices!r}")
    dev = jnp.where((dev >= 0) & (dev < num_devices), dev, num_devices).astype(jnp.int32)
    out = jnp.zeros((*counts.shape[:-1], num_devices), jnp.int32)
    return out.at[..., dev].add(counts.astype(jnp.int32), mode="drop")
