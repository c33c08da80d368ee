"""Redundant experts for expert parallelism: where each physical expert slot lives.

A `Placement` lays ``P >= E`` physical expert slots over ``D`` devices of the mesh's
``expert`` axis, ``P / D`` slots per device (slot ``p`` on device ``p // (P / D)``), with
``R = P - E`` replicas of the hottest experts. It is three plain integer arrays, so a new
placement between steps is new values of the same shapes (no recompile of
`jaxmoe.parallel.moe_apply_ep`):

- ``phy2log [P]``: the logical expert of each physical slot,
- ``replica_count [E]``: how many slots hold each logical expert (at least one),
- ``log2phy [E, R + 1]``: the slots of each logical expert in ascending order, padded
  with ``-1`` (width ``R + 1`` for every placement with ``P`` slots).

`rebalance` computes one from a load vector by the rule of DeepSeek's EPLB
(deepseek-ai/EPLB, ``rebalance_experts``; re-implemented in numpy here):

1. replicate: ``R`` times, give one more replica to the expert whose load per replica
   ``load[e] / replica_count[e]`` is largest (ties: the lower id);
2. pack: the ``P`` slots, each carrying ``load[e] / replica_count[e]``, onto the ``D``
   devices, ``P / D`` each: heaviest slot first into the lightest device that has room
   (ties: the lower device), then pairwise swaps between the heaviest device and
   another while a swap lowers the larger of the two (a local improvement EPLB does not
   make, so the result is never less balanced than EPLB's packing of the same slots);
3. hierarchical (``num_nodes > 1``): first pack the ``num_groups`` contiguous expert
   groups onto the nodes (equal group count per node, by the same packing), then
   replicate within each node to ``P / num_nodes`` slots and pack those onto the node's
   ``D / num_nodes`` devices. Replicas then stay in the node of their expert's group.

Replica rule (what `jaxmoe.parallel.moe_apply_ep` does with a placement, `replica_slots`
here): the pairs of the flattened batch are numbered per logical expert in (token, slot)
order, and the ``j``-th pair of expert ``e`` goes to replica ``j mod replica_count[e]``
(the slot ``log2phy[e, j mod replica_count[e]]``). Each replica of ``e`` thus gets
``floor`` or ``ceil`` of ``e``'s pairs over its replica count, whatever the mesh, and
the choice depends on the routing alone (`check_replica_balance` checks this of any rule).

`physical_experts` builds the ``[P, ...]`` weights the mesh path needs from the
``[E, ...]`` logical ones (float or `jaxmoe.quant.QuantizedTensor` leaves).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.dispatch import id_valid, is_concrete


class PlacementError(ValueError):
    """A placement that is inconsistent or cannot be built (names the array and the fault)."""


def _concrete(*arrays) -> bool:
    return all(isinstance(a, np.ndarray | jax.Array) and is_concrete(a) for a in arrays)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Placement:
    """``P`` physical expert slots of ``E`` logical experts over ``num_devices`` devices.

    Attributes:
      phy2log: ``[P]`` int32, the logical expert of physical slot ``p`` (on device
        ``p // (P / num_devices)``).
      log2phy: ``[E, P - E + 1]`` int32, the slots of each expert ascending, then ``-1``.
      replica_count: ``[E]`` int32, slots per logical expert (``>= 1``).
      num_devices: devices of the mesh's ``expert`` axis (static).

    Build one with `rebalance`, `static_placement` or `Placement.from_phy2log`. Concrete
    arrays are checked (a `PlacementError` names the fault); traced ones are not.
    """

    phy2log: jax.Array | np.ndarray
    log2phy: jax.Array | np.ndarray
    replica_count: jax.Array | np.ndarray
    num_devices: int = dataclasses.field(metadata=dict(static=True), default=1)

    def __post_init__(self):
        if not _concrete(self.phy2log, self.log2phy, self.replica_count):
            return  # traced or a pytree sentinel: shapes only, values unchecked
        check_placement(
            np.asarray(self.phy2log), np.asarray(self.log2phy), np.asarray(self.replica_count), self.num_devices
        )

    @property
    def num_slots(self) -> int:
        """``P``, physical slots."""
        return int(self.phy2log.shape[0])

    @property
    def num_experts(self) -> int:
        """``E``, logical experts."""
        return int(self.replica_count.shape[0])

    @property
    def slots_per_device(self) -> int:
        """``P / num_devices``."""
        return self.num_slots // self.num_devices

    @classmethod
    def from_phy2log(cls, phy2log, num_experts: int, num_devices: int) -> Placement:
        """The placement with this ``phy2log [P]`` (counts and ``log2phy`` derived from it)."""
        p2l = np.asarray(phy2log)
        if p2l.ndim != 1 or not np.issubdtype(p2l.dtype, np.integer):
            raise PlacementError(f"phy2log must be a 1-D integer array, got {p2l.dtype} of shape {p2l.shape}")
        if not isinstance(num_experts, int) or num_experts < 1:
            raise PlacementError(f"num_experts must be a positive int, got {num_experts!r}")
        if p2l.size < num_experts:
            raise PlacementError(f"phy2log has {p2l.size} slots, fewer than num_experts={num_experts}")
        if p2l.size and (p2l.min() < 0 or p2l.max() >= num_experts):
            raise PlacementError(f"phy2log holds ids outside [0, {num_experts}): min {p2l.min()}, max {p2l.max()}")
        counts = np.bincount(p2l, minlength=num_experts).astype(np.int32)
        log2phy = np.full((num_experts, p2l.size - num_experts + 1), -1, np.int32)
        for e in range(num_experts):
            slots = np.flatnonzero(p2l == e)
            log2phy[e, : min(slots.size, log2phy.shape[1])] = slots[: log2phy.shape[1]]
        return cls(p2l.astype(np.int32), log2phy, counts, num_devices)


def check_placement(phy2log: np.ndarray, log2phy: np.ndarray, replica_count: np.ndarray, num_devices: int) -> None:
    """`PlacementError` unless the three arrays describe one placement over ``num_devices``
    (shapes, every expert placed at least once, counts and ``log2phy`` matching ``phy2log``)."""
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise PlacementError(f"num_devices must be a positive int, got {num_devices!r}")
    for name, a, nd in (("phy2log", phy2log, 1), ("log2phy", log2phy, 2), ("replica_count", replica_count, 1)):
        if a.ndim != nd or not np.issubdtype(a.dtype, np.integer):
            raise PlacementError(f"{name} must be a {nd}-D integer array, got {a.dtype} of shape {a.shape}")
    p, e = phy2log.size, replica_count.size
    if p < e or e < 1:
        raise PlacementError(f"phy2log has {p} slots; it needs at least one per expert (replica_count has {e})")
    if p % num_devices:
        raise PlacementError(f"phy2log has {p} slots, not divisible by num_devices={num_devices}")
    if log2phy.shape != (e, p - e + 1):
        raise PlacementError(f"log2phy has shape {log2phy.shape}, expected {(e, p - e + 1)} (E, P - E + 1)")
    if phy2log.min() < 0 or phy2log.max() >= e:
        raise PlacementError(f"phy2log holds ids outside [0, {e}): min {phy2log.min()}, max {phy2log.max()}")
    counts = np.bincount(phy2log, minlength=e)
    missing = np.flatnonzero(counts == 0)
    if missing.size:
        raise PlacementError(f"phy2log places no slot for expert(s) {missing[:8].tolist()}: each needs one")
    if not np.array_equal(counts, replica_count):
        bad = int(np.flatnonzero(counts != replica_count)[0])
        raise PlacementError(
            f"replica_count[{bad}] = {replica_count[bad]} but phy2log has {counts[bad]} slots of expert {bad}"
        )
    for x in range(e):
        want = np.flatnonzero(phy2log == x)
        row = log2phy[x]
        if not (np.array_equal(row[: want.size], want) and (row[want.size :] == -1).all()):
            raise PlacementError(f"log2phy[{x}] = {row.tolist()} but expert {x} is in slots {want.tolist()} (then -1)")


def static_placement(num_experts: int, num_devices: int) -> Placement:
    """No replicas: expert ``e`` on device ``e // (E / D)`` (what the mesh does without a placement)."""
    return Placement.from_phy2log(np.arange(num_experts), num_experts, num_devices)


def replicate(load: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica counts ``[E]`` (sum ``num_slots``): ``num_slots - E`` times one more replica
    for the expert with the largest ``load / count`` (ties: the lower id)."""
    load = np.asarray(load, np.float64)
    counts = np.ones(load.size, np.int64)
    for _ in range(num_slots - load.size):
        counts[int(np.argmax(load / counts))] += 1
    return counts


def balanced_packing(weights: np.ndarray, num_packs: int) -> np.ndarray:
    """Pack index ``[n]`` of each item, ``n / num_packs`` items per pack: heaviest item
    first into the lightest pack with room (ties: lower item, lower pack), then swaps
    between the heaviest pack and another while one lowers the larger of the two."""
    w = np.asarray(weights, np.float64)
    n = w.size
    if n % num_packs:
        raise PlacementError(f"balanced_packing: {n} items do not split evenly into {num_packs} packs")
    per = n // num_packs
    pack = np.empty(n, np.int64)
    loads = np.zeros(num_packs)
    fill = np.zeros(num_packs, np.int64)
    for i in np.argsort(-w, kind="stable"):
        room = np.flatnonzero(fill < per)
        j = int(room[np.argmin(loads[room])])
        pack[i], loads[j], fill[j] = j, loads[j] + w[i], fill[j] + 1
    for _ in range(4 * n):  # each swap lowers the sorted load vector lexicographically
        h = int(np.argmax(loads))
        a = np.flatnonzero(pack == h)
        b = np.flatnonzero(pack != h)
        if not b.size:
            break
        d = w[a][:, None] - w[b][None, :]  # load moved from h to the other pack
        new = np.maximum(loads[h] - d, loads[pack[b]][None, :] + d)
        new = np.where(d > 0, new, np.inf)
        i, j = np.unravel_index(int(np.argmin(new)), new.shape)
        if not new[i, j] < loads[h] - 1e-12 * max(1.0, loads[h]):
            break
        g = pack[b[j]]
        loads[h] -= d[i, j]
        loads[g] += d[i, j]
        pack[a[i]], pack[b[j]] = g, h
    return pack


def _pack_slots(counts: np.ndarray, load: np.ndarray, num_packs: int) -> np.ndarray:
    """``phy2log`` of the slots of ``counts`` packed onto ``num_packs`` devices (device-major)."""
    slot_expert = np.repeat(np.arange(counts.size), counts)
    slot_w = (np.asarray(load, np.float64) / counts)[slot_expert]
    pack = balanced_packing(slot_w, num_packs)
    order = np.lexsort((np.arange(slot_expert.size), pack))  # by pack, then slot order
    return slot_expert[order]


def _check_load(load, num_slots: int, num_devices: int) -> np.ndarray:
    w = np.asarray(load, np.float64)
    if w.ndim != 1 or w.size < 1:
        raise PlacementError(f"load must be a non-empty 1-D array [E], got shape {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise PlacementError("load must be finite and non-negative")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise PlacementError(f"num_devices must be a positive int, got {num_devices!r}")
    if not isinstance(num_slots, int) or num_slots < w.size or num_slots % num_devices:
        raise PlacementError(
            f"num_slots={num_slots!r} must be an int >= num_experts={w.size} and divisible by num_devices={num_devices}"
        )
    return w


def rebalance(
    load, num_slots: int, num_devices: int, *, num_nodes: int = 1, num_groups: int | None = None
) -> Placement:
    """The EPLB placement of ``num_slots`` physical slots for ``load [E]`` (tokens or pairs
    per expert, any non-negative numbers) over ``num_devices`` devices (see the module
    docstring for the rule).

    Args:
      load: ``[E]`` load per logical expert.
      num_slots: ``P`` (``E`` plus replicas), a multiple of ``num_devices``.
      num_devices: devices of the ``expert`` axis.
      num_nodes: > 1 for the hierarchical form: devices ``[i D/N, (i+1) D/N)`` form node ``i``.
      num_groups: expert groups (contiguous, ``E / num_groups`` each) packed onto the
        nodes; required with ``num_nodes > 1``, a multiple of ``num_nodes``.
    """
    w = _check_load(load, num_slots, num_devices)
    e = w.size
    if num_nodes == 1:
        return Placement.from_phy2log(_pack_slots(replicate(w, num_slots), w, num_devices), e, num_devices)
    g = num_groups
    if not isinstance(num_nodes, int) or num_nodes < 1 or num_devices % num_nodes:
        raise PlacementError(f"num_nodes={num_nodes!r} must be a positive int dividing num_devices={num_devices}")
    if not isinstance(g, int) or g < 1 or e % g or g % num_nodes:
        raise PlacementError(f"num_groups={g!r} must divide num_experts={e} and be a multiple of num_nodes={num_nodes}")
    gs = e // g
    node_of_group = balanced_packing(w.reshape(g, gs).sum(1), num_nodes)
    slots_node, dev_node = num_slots // num_nodes, num_devices // num_nodes
    parts = []
    for node in range(num_nodes):
        experts = (np.flatnonzero(node_of_group == node)[:, None] * gs + np.arange(gs)).reshape(-1)
        wl = w[experts]
        parts.append(experts[_pack_slots(replicate(wl, slots_node), wl, dev_node)])
    return Placement.from_phy2log(np.concatenate(parts), e, num_devices)


def slot_loads(load, placement: Placement) -> np.ndarray:
    """``[P]`` expected load of each slot: ``load[e] / replica_count[e]`` (the replica rule's even spread)."""
    p2l, cnt = np.asarray(placement.phy2log), np.asarray(placement.replica_count)
    return np.asarray(load, np.float64)[p2l] / cnt[p2l]


def device_loads(load, placement: Placement) -> np.ndarray:
    """``[D]`` expected load of each device (`slot_loads` summed per device)."""
    return slot_loads(load, placement).reshape(placement.num_devices, -1).sum(1)


def replica_slots(expert_ids: jax.Array, log2phy: jax.Array, replica_count: jax.Array, start=None) -> jax.Array:
    """The physical slot of each pair by the replica rule (jittable).

    Args:
      expert_ids: ``[T, k]`` logical ids; ids outside ``[0, E)`` map to ``P`` (not sent).
      log2phy: ``[E, R + 1]``; replica_count: ``[E]`` (a `Placement`'s arrays).
      start: ``[E]`` pairs of each expert before this batch (default 0): the batch
        continues the numbering (the mesh passes the pairs of the devices before it).

    Returns ``[T, k]`` int32 slots: the ``j``-th pair of expert ``e`` in (token, slot)
    order, counting from ``start[e]``, goes to ``log2phy[e, j mod replica_count[e]]``.
    """
    e = replica_count.shape[0]
    p = log2phy.shape[1] + e - 1
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    ok = id_valid(flat, e)
    key = jnp.where(ok, flat, e)
    order = jnp.argsort(key, stable=True)
    sk = key[order]
    first = jnp.searchsorted(sk, jnp.arange(e + 1, dtype=jnp.int32), side="left")
    rank_sorted = jnp.arange(flat.size, dtype=jnp.int32) - first[sk].astype(jnp.int32)
    rank = jnp.zeros_like(flat).at[order].set(rank_sorted)
    safe = jnp.where(ok, flat, 0)
    j = rank + (0 if start is None else start.astype(jnp.int32)[safe])
    cnt = replica_count.astype(jnp.int32)[safe]
    slot = log2phy.astype(jnp.int32)[safe, j % cnt]
    return jnp.where(ok, slot, p).reshape(expert_ids.shape)


def replica_slots_np(expert_ids, placement: Placement) -> np.ndarray:
    """A numpy loop of the replica rule (the reference `replica_slots` is tested against);
    ids outside ``[0, E)`` map to ``P``."""
    ids = np.asarray(expert_ids)
    e, p = placement.num_experts, placement.num_slots
    l2p, cnt = np.asarray(placement.log2phy), np.asarray(placement.replica_count)
    seen = np.zeros(e, np.int64)
    out = np.full(ids.shape, p, np.int64)
    for idx in np.ndindex(*ids.shape):
        x = int(ids[idx])
        if 0 <= x < e:
            out[idx] = l2p[x, seen[x] % cnt[x]]
            seen[x] += 1
    return out


def check_replica_balance(expert_ids, slots, placement: Placement) -> None:
    """`AssertionError` unless ``slots`` (``[T, k]``, from any replica rule) sends each pair
    of ``expert_ids`` to a slot of its own expert and spreads each expert's pairs over its
    replicas evenly (replica pair counts differ by at most one)."""
    ids, slots = np.asarray(expert_ids).reshape(-1), np.asarray(slots).reshape(-1)
    p2l = np.asarray(placement.phy2log)
    ok = (ids >= 0) & (ids < placement.num_experts)
    if (slots[ok] < 0).any() or (slots[ok] >= placement.num_slots).any():
        raise AssertionError("replica rule: a slot outside [0, P)")
    wrong = ok & (p2l[np.clip(slots, 0, placement.num_slots - 1)] != ids)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise AssertionError(
            f"replica rule: pair {i} of expert {ids[i]} sent to slot {slots[i]} of expert {p2l[slots[i]]}"
        )
    per_slot = np.bincount(slots[ok], minlength=placement.num_slots)
    for x in range(placement.num_experts):
        c = per_slot[np.asarray(placement.log2phy)[x, : int(placement.replica_count[x])]]
        if c.max() - c.min() > 1:
            raise AssertionError(
                f"replica rule: expert {x}'s replicas got {c.tolist()} pairs (uneven by more than one)"
            )


def physical_experts(experts, placement: Placement):
    """The ``[P, ...]`` expert weights of ``placement`` from the logical ``[E, ...]`` ones:
    every leaf (float arrays and `jaxmoe.quant.QuantizedTensor` data, scales and biases,
    all with the expert axis first) gathered at ``phy2log``. Lay them out with
    `jaxmoe.parallel.shard_params` (slot ``p`` lands on device ``p // (P / D)``)."""
    n = experts.num_experts
    if n != placement.num_experts:
        raise PlacementError(f"physical_experts: experts hold {n} experts, the placement has {placement.num_experts}")
    idx = jnp.asarray(placement.phy2log, jnp.int32)
    return jax.tree.map(lambda a: jnp.take(a, idx, axis=0), experts)
