"""The dispatch plan: (token, slot) pairs sorted by expert, with tile metadata.

From ``expert_ids [T, k]`` `plan_dispatch` builds, with static shapes under ``jit``:

- the stable sort of the ``P = T * k`` pairs ``p = t * k + slot`` by expert,
- the token of each sorted row and the inverse permutation,
- group sizes and exclusive offsets per expert,
- megablox-style tile metadata for a row block ``block_m``: the sorted rows are cut
  into row tiles of ``block_m``; each (expert, row tile) pair that shares at least
  one row is one *visit*, in order of expert then tile. A tile straddling two experts
  is visited once per expert; an empty expert has no visit. Visits past
  ``num_tiles`` repeat the last valid visit (recomputing it is harmless).

No ``[T, E, ...]`` array is ever formed; the only expert-sized arrays are ``[E]``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer


def is_concrete(a) -> bool:
    """True when ``a`` holds values (not a tracer under ``jit`` / ``vmap`` / ``grad``)."""
    return not isinstance(a, Tracer)


def check_expert_ids(
    expert_ids, num_experts: int, name: str, shape: tuple[int | None, ...] | None = None, weights=None
) -> None:
    """ValueError naming ``name`` unless ``expert_ids`` is an integer ``[T, k]`` array (of
    ``shape`` where given, ``None`` = any) and, when its values are concrete, every id is
    in ``[0, num_experts)``; ``weights`` (optional) must be a float array of the same shape.

    Under ``jit`` (or for an array spanning several processes) the values are not checked;
    the plan then drops invalid pairs
    (see the module docstring). Reading the values of a device array here synchronizes
    with the device once (``T * k`` integers).
    """
    ids_shape = tuple(getattr(expert_ids, "shape", ()))
    dt = getattr(expert_ids, "dtype", None)
    if len(ids_shape) != 2:
        raise ValueError(f"{name}: routing.expert_ids must be [T, k], got shape {ids_shape}")
    if shape is not None and any(w is not None and w != g for w, g in zip(shape, ids_shape)):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        raise ValueError(f"{name}: routing.expert_ids has shape {ids_shape}, expected {want}")
    if dt is None or not jnp.issubdtype(dt, jnp.integer) or jnp.dtype(dt) == jnp.dtype(bool):
        raise ValueError(f"{name}: routing.expert_ids must be an integer array, got dtype {dt}")
    if weights is not None:
        w_shape = tuple(getattr(weights, "shape", ()))
        if w_shape != ids_shape:
            raise ValueError(f"{name}: routing.weights has shape {w_shape}, expert_ids {ids_shape}")
        wdt = getattr(weights, "dtype", None)
        if wdt is None or not jnp.issubdtype(wdt, jnp.floating):
            raise ValueError(f"{name}: routing.weights must be a float array, got dtype {wdt}")
    if not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise ValueError(f"{name}: num_experts must be a positive int, got {num_experts!r}")
    if is_concrete(expert_ids) and expert_ids.size and getattr(expert_ids, "is_fully_addressable", True):
        ids = np.asarray(expert_ids)
        bad = (ids < 0) | (ids >= num_experts)
        if bad.any():
            t, s = np.argwhere(bad)[0]
            raise ValueError(
                f"{name}: routing.expert_ids must lie in [0, {num_experts}); {int(bad.sum())} of {ids.size} "
                f"do not, first expert_ids[{t}, {s}] = {int(ids[t, s])}"
            )


def id_valid(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """``expert_ids`` in ``[0, num_experts)`` (bool, same shape): the pairs any strategy computes."""
    return (expert_ids >= 0) & (expert_ids < num_experts)


def replace_invalid(expert_ids: jax.Array, num_experts: int, fill: int) -> jax.Array:
    """``expert_ids`` with every id outside ``[0, num_experts)`` replaced by ``fill``
    (``num_experts``: an index a ``mode="drop"`` scatter or a sort puts past every expert;
    ``0``: a safe index whose result the caller masks). Same shape and dtype."""
    return jnp.where(id_valid(expert_ids, num_experts), expert_ids, fill)


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the number of tile visits.

    Each of the ``cdiv(P, block_m)`` row tiles is visited once, plus once more for
    every expert boundary falling inside a tile: at most ``min(E, P) - 1`` of them.
    """
    if num_pairs < 0 or num_experts < 1 or block_m < 1:
        raise ValueError(
            f"max_tiles: need num_pairs >= 0, num_experts >= 1, block_m >= 1; got "
            f"num_pairs={num_pairs}, num_experts={num_experts}, block_m={block_m}"
        )
    row_tiles = -(-num_pairs // block_m)
    return max(1, row_tiles + min(num_experts, num_pairs) - 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Sorted order of the (token, slot) pairs and the tile visits over it.

    Attributes:
      sort_idx: ``[P]`` int32, pair ids ``p = t * k + slot`` stably sorted by expert.
      token_idx: ``[P]`` int32, token of each sorted row (``sort_idx // k``).
      inv: ``[P]`` int32, inverse permutation: the sorted row of pair ``p``.
      group_sizes: ``[E]`` int32 rows per expert.
      group_offsets: ``[E + 1]`` int32, exclusive cumulative sum of ``group_sizes``.
      tile_group: ``[max_tiles]`` int32, expert of each tile visit.
      tile_row: ``[max_tiles]`` int32, row tile of each visit (rows
        ``tile_row * block_m`` to ``+ block_m``; clip to the expert's group).
      num_tiles: ``[]`` int32, number of valid visits.
      block_m, num_experts, top_k: static.
    """

    sort_idx: jax.Array
    token_idx: jax.Array
    inv: jax.Array
    group_sizes: jax.Array
    group_offsets: jax.Array
    tile_group: jax.Array
    tile_row: jax.Array
    num_tiles: jax.Array
    block_m: int = dataclasses.field(metadata=dict(static=True), default=128)
    num_experts: int = dataclasses.field(metadata=dict(static=True), default=1)
    top_k: int = dataclasses.field(metadata=dict(static=True), default=1)

    @property
    def num_pairs(self) -> int:
        return self.sort_idx.shape[0]

    @property
    def max_tiles(self) -> int:
        return self.tile_group.shape[0]

    @property
    def num_valid(self) -> jax.Array:
        """``[]`` int32: pairs with an id in ``[0, E)``, the sorted rows ``[0, num_valid)``."""
        return self.group_offsets[-1]

    def pair_valid(self) -> jax.Array:
        """``[P]`` bool in pair order ``p = t * k + slot``: the pair's id is in ``[0, E)``."""
        return self.inv < self.group_offsets[-1]

    def row_valid(self) -> jax.Array:
        """``[P]`` bool in sorted order: the row belongs to an expert (not a dropped pair)."""
        return jnp.arange(self.num_pairs, dtype=jnp.int32) < self.group_offsets[-1]


def plan_dispatch(expert_ids: jax.Array, num_experts: int, block_m: int) -> DispatchPlan:
    """The `DispatchPlan` of ``expert_ids [T, k]`` (int, values in ``[0, num_experts)``).

    Pairs with ids outside ``[0, num_experts)`` are dropped (sorted last, in no group);
    this function does not raise for them (`check_expert_ids` does, eagerly).
    """
    if expert_ids.ndim != 2:
        raise ValueError(f"plan_dispatch: expert_ids must be [T, k], got shape {expert_ids.shape}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"plan_dispatch: expert_ids must be integer, got {expert_ids.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"plan_dispatch: num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"plan_dispatch: block_m must be a positive int, got {block_m!r}")
    return _plan(expert_ids, num_experts=num_experts, block_m=block_m)


def sort_pairs(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The stable sort of the ``P = T * k`` pairs of ``expert_ids [T, k]`` by expert, traced
    inline: ``(sort_idx [P], token_idx [P], inv [P], group_sizes [E])``, all int32, as in
    `DispatchPlan`. Pairs with ids outside ``[0, num_experts)`` sort last, in no group."""
    t, k = expert_ids.shape
    p, e = t * k, num_experts
    # invalid ids (checked before the int32 cast) sort after every expert, in no group
    flat = replace_invalid(expert_ids.reshape(p), e, e).astype(jnp.int32)
    sort_idx = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [P]
    # unsigned indices: no negative-index wrap (a compare and a kernel of its own on a GPU)
    inv = (
        jnp.zeros((p,), jnp.int32)
        .at[sort_idx.astype(jnp.uint32)]
        .set(jnp.arange(p, dtype=jnp.int32), unique_indices=True)
    )
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1, mode="drop")  # [E]
    return sort_idx, sort_idx // k, inv, sizes


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m"))
def _plan(expert_ids: jax.Array, num_experts: int, block_m: int) -> DispatchPlan:
    t, k = expert_ids.shape
    p = t * k
    e = num_experts
    n_vis = max_tiles(p, e, block_m)
    with jax.named_scope("plan_dispatch"):
        sort_idx, token_idx, inv, sizes = sort_pairs(expert_ids, e)
        ends = jnp.cumsum(sizes, dtype=jnp.int32)  # [E]
        offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # [E+1]
        starts = offsets[:-1]
        first_tile = starts // block_m  # [E]
        last_tile = jnp.maximum(ends - 1, 0) // block_m
        n_tiles_e = jnp.where(sizes > 0, last_tile - first_tile + 1, 0)  # [E]
        vis_end = jnp.cumsum(n_tiles_e, dtype=jnp.int32)  # [E]
        num_tiles = vis_end[-1]
        i = jnp.minimum(jnp.arange(n_vis, dtype=jnp.int32), jnp.maximum(num_tiles - 1, 0))  # [V]
        grp = jnp.searchsorted(vis_end, i, side="right", method="compare_all").astype(
            jnp.int32
        )  # no loop: [V, E] compares
        grp = jnp.minimum(grp, e - 1)
        vis_start = vis_end[grp] - n_tiles_e[grp]
        row = first_tile[grp] + (i - vis_start)
    return DispatchPlan(
        sort_idx=sort_idx,
        token_idx=token_idx,
        inv=inv,
        group_sizes=sizes,
        group_offsets=offsets,
        tile_group=grp,
        tile_row=row.astype(jnp.int32),
        num_tiles=num_tiles,
        block_m=block_m,
        num_experts=e,
        top_k=k,
    )
