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


def plan_dispatch(expert_ids: jax.Array, num_experts: int, block_m: int) -> DispatchPlan:
    """The `DispatchPlan` of ``expert_ids [T, k]`` (int, values in ``[0, num_experts)``).

    Ids outside ``[0, num_experts)`` are a caller error; they are not checked under jit.
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


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m"))
def _plan(expert_ids: jax.Array, num_experts: int, block_m: int) -> DispatchPlan:
    t, k = expert_ids.shape
    p = t * k
    e = num_experts
    n_vis = max_tiles(p, e, block_m)
    with jax.named_scope("plan_dispatch"):
        flat = expert_ids.reshape(p).astype(jnp.int32)
        sort_idx = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [P]
        token_idx = sort_idx // k
        inv = jnp.zeros((p,), jnp.int32).at[sort_idx].set(jnp.arange(p, dtype=jnp.int32))
        sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1, mode="drop")  # [E]
        ends = jnp.cumsum(sizes, dtype=jnp.int32)  # [E]
        offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # [E+1]
        starts = offsets[:-1]
        first_tile = starts // block_m  # [E]
        last_tile = jnp.maximum(ends - 1, 0) // block_m
        n_tiles_e = jnp.where(sizes > 0, last_tile - first_tile + 1, 0)  # [E]
        vis_end = jnp.cumsum(n_tiles_e, dtype=jnp.int32)  # [E]
        num_tiles = vis_end[-1]
        i = jnp.minimum(jnp.arange(n_vis, dtype=jnp.int32), jnp.maximum(num_tiles - 1, 0))  # [V]
        grp = jnp.searchsorted(vis_end, i, side="right").astype(jnp.int32)  # experts fully before i
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
