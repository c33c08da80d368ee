"""Expert parallelism: one MoE layer run over a JAX device mesh.

The mesh has an ``expert`` axis (size ``n``) and optionally a ``data`` axis. Routed
experts are sharded over ``expert`` (device ``i`` holds experts ``[i*E/n, (i+1)*E/n)``,
replicated over ``data``); tokens are sharded over all devices; the router, the
selection bias and the shared expert are replicated. Inside `jax.shard_map` each
device:

1. routes its tokens exactly as `jaxmoe.moe_apply` does (`jaxmoe.params.compute_routing`:
   float32, replicated router, fixed row blocks with batch invariance),
2. writes each (token, slot) pair into a send buffer ``[n, C, d]``: row ``dest*C + pos``
   where ``dest = id // (E/n)`` and ``pos`` is the pair's rank among this device's
   pairs for ``dest`` (token order, then slot order),
3. exchanges the buffers along ``expert`` (``all_to_all``, or ``ragged_all_to_all``
   where XLA lowers it, which moves only the filled rows),
4. runs its local experts on the received rows through `jaxmoe.impls.policy.run_experts`,
   the same expert dispatch as `jaxmoe.moe_apply` (so every `jaxmoe.ExecConfig` option
   holds: ``impl`` resolved per lowering platform, batch invariance, activations; one
   slot per row, local expert ids, the routing weight sent along). The unused rows of
   the ``[n, C]`` buffers carry the local id ``E/n``, which the dispatch plan drops
   (`jaxmoe.dispatch`): only the received pairs are computed, never the padding,
5. sends the weighted rows back the same way and sums each token's k slots in slot
   order (`jaxmoe.invariance.slot_sum`),
6. adds the (replicated) shared expert (`jaxmoe.experts.shared_expert`; row blocks with
   batch invariance).

Capacity ``C`` (rows per sender -> receiver): with ``capacity_factor=None`` it is the
no-drop worst case ``T_local * min(k, E/n)`` (every local pair to one device), so no
token is ever dropped. With ``capacity_factor=c`` it is
``ceil(c * T_local * k / n)`` (at most the worst case); pairs past it are dropped and
counted: `moe_apply_ep` then always returns an `EPStats` with the exact count.

Expert ids of a given ``routing`` outside ``[0, E)`` are a ValueError when concrete;
under ``jit`` such a pair is not sent and adds exactly zero (not counted as dropped;
its ``kept`` entry is False), as in `jaxmoe.moe_apply` (docs/routing.md, "Invalid
expert ids").

Redundant experts (``placement=``, a `jaxmoe.placement.Placement` of ``P`` slots): the
experts are then the ``[P, ...]`` physical weights (`jaxmoe.placement.physical_experts`),
device ``i`` holds slots ``[i*P/n, (i+1)*P/n)``, and in step 2 each pair of logical
expert ``e`` goes to slot ``log2phy[e, j mod replica_count[e]]``, ``j`` its rank among
the pairs of ``e`` in the flattened batch (token order, then slot order; the devices
before this one in token order count first: an ``all_gather`` of ``[E]`` counts), then
``dest = slot // (P/n)`` and the local id ``slot % (P/n)``. The placement's arrays are
traced arguments: a new placement with the same ``P`` does not recompile.

Exchange: XLA:CPU has no ``ragged-all-to-all`` thunk (jax 0.10.2: "HLO opcode
`ragged-all-to-all` is not supported by XLA:CPU"), so ``exchange="auto"`` takes the
padded ``all_to_all`` on CPU and ``ragged_all_to_all`` on GPU / TPU. Both use the same
``[n, C]`` buffer layout on both sides, so they give identical results.

Across processes: call ``jax.distributed.initialize()`` in every process (one per
host; on CPU also set ``jax_cpu_collectives_implementation="gloo"``), build the mesh
over ``jax.devices()`` (all processes' devices) with `make_mesh`, and call the same
code with the same inputs in every process; JAX's SPMD runtime does the transport.
`global_input` places a host array every process holds on the mesh, and
`replicated_output` makes a result readable in every process.
``tests/test_parallel_multiprocess.py`` and ``jaxmoe eval expert-parallel --set
processes=2`` run two processes with 4 CPU devices each on an 8-device mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.config import MoEConfig, RouterConfig
from jaxmoe.dispatch import check_expert_ids, id_valid, replace_invalid
from jaxmoe.execution import ExecConfig, exec_config
from jaxmoe.experts import shared_expert
from jaxmoe.impls.policy import resolve_impl, run_experts
from jaxmoe.invariance import slot_sum
from jaxmoe.params import MoEParams, compute_routing
from jaxmoe.placement import Placement, PlacementError, replica_slots
from jaxmoe.platforms import RAGGED_PLATFORMS, default_platform
from jaxmoe.routing import Routing

EXPERT_AXIS = "expert"
DATA_AXIS = "data"
EXCHANGES = ("auto", "padded", "ragged")
#: Platforms where ``exchange="auto"`` uses ``jax.lax.ragged_all_to_all``.
_ragged_all_to_all = jax.lax.ragged_all_to_all  # a module name, so tests can emulate it on CPU


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EPStats:
    """What the expert-parallel exchange did.

    Attributes:
      dropped_pairs: ``[]`` int32, (token, slot) pairs dropped for lack of capacity,
        summed over the mesh (always 0 with ``capacity_factor=None``).
      kept: ``[T, k]`` bool over the flattened tokens: the pair reached its expert.
      expert_load: ``[E]`` int32, pairs each expert computed (kept pairs only); with a
        placement ``[P]``, pairs each physical slot computed.
      capacity: ``C``, rows per (sender, receiver) device pair.
      exchange: ``padded`` or ``ragged``.
    """

    dropped_pairs: jax.Array
    kept: jax.Array
    expert_load: jax.Array
    capacity: int = dataclasses.field(metadata=dict(static=True), default=0)
    exchange: str = dataclasses.field(metadata=dict(static=True), default="padded")


def make_mesh(expert: int, data: int = 1, devices=None) -> Mesh:
    """A mesh ``(expert, data)`` over the first ``expert * data`` devices.

    Args:
      expert: size of the ``expert`` axis (experts are sharded over it).
      data: size of the ``data`` axis (tokens are sharded over both axes).
      devices: devices to use (default ``jax.devices()``, all hosts' devices after
        ``jax.distributed.initialize``).
    """
    for name, v in (("expert", expert), ("data", data)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"make_mesh: {name} must be a positive int, got {v!r}")
    devs = list(jax.devices() if devices is None else devices)
    if expert * data > len(devs):
        raise ValueError(
            f"make_mesh: expert={expert} x data={data} needs {expert * data} devices, only {len(devs)} available"
        )
    arr = np.array(devs[: expert * data], dtype=object).reshape(expert, data)
    return Mesh(arr, (EXPERT_AXIS, DATA_AXIS))


def _axes(mesh: Mesh) -> tuple[int, tuple[str, ...]]:
    """(expert axis size, token axes) of ``mesh``; ValueError for unknown axes."""
    names = tuple(mesh.axis_names)
    if EXPERT_AXIS not in names:
        raise ValueError(f"expert parallelism needs a mesh axis named {EXPERT_AXIS!r}; mesh axes are {names}")
    bad = [a for a in names if a not in (EXPERT_AXIS, DATA_AXIS)]
    if bad:
        raise ValueError(f"unsupported mesh axis {bad}; expert parallelism uses {EXPERT_AXIS!r} and {DATA_AXIS!r}")
    tok = tuple(a for a in (DATA_AXIS, EXPERT_AXIS) if a in names)
    return int(mesh.shape[EXPERT_AXIS]), tok


def check_divisible(cfg: MoEConfig, mesh: Mesh) -> int:
    """Experts per device ``E / n``; ValueError naming both numbers if ``n`` does not divide ``E``."""
    n, _ = _axes(mesh)
    e = cfg.num_experts
    if e % n:
        raise ValueError(f"num_experts={e} is not divisible by the mesh's {EXPERT_AXIS!r} axis size {n}")
    return e // n


def param_specs(params: MoEParams) -> MoEParams:
    """PartitionSpecs of ``params``: every expert leaf (quantized ones included) sharded on
    its leading expert axis over ``expert``; router, biases and shared expert replicated."""
    ex = jax.tree.map(lambda _: P(EXPERT_AXIS), params.experts)
    rest = jax.tree.map(lambda _: P(), dataclasses.replace(params, experts=None))
    return dataclasses.replace(rest, experts=ex)


def shard_params(params: MoEParams, mesh: Mesh) -> MoEParams:
    """``params`` placed on ``mesh`` (experts split over ``expert``, the rest replicated).

    On a mesh spanning several processes every process must pass the same values (see
    `global_input`)."""
    _axes(mesh)
    n = int(mesh.shape[EXPERT_AXIS])
    e = params.experts.num_experts
    if e % n:
        raise ValueError(f"num_experts={e} is not divisible by the mesh's {EXPERT_AXIS!r} axis size {n}")
    return global_input(params, mesh, param_specs(params))


def _is_spec(a) -> bool:
    return isinstance(a, P)


def global_input(tree, mesh: Mesh, specs=None):
    """Every array leaf of ``tree`` placed on ``mesh`` with ``specs`` (a tree of
    PartitionSpecs like ``tree``; default: replicated).

    On one process this is `jax.device_put`. On a mesh spanning several processes
    (``jax.distributed``), every process must call it with the same host values; each
    process then fills only its own devices' shards (`jax.make_array_from_callback`).
    """
    if specs is None:
        specs = jax.tree.map(lambda _: P(), tree)
    multi = mesh.is_multi_process

    def put(a, s):
        if not multi:
            return jax.device_put(a, NamedSharding(mesh, s))
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, s), lambda idx: host[idx])

    return jax.tree.map(put, tree, specs, is_leaf=_is_spec)


def gather_output(a) -> np.ndarray:
    """The full value of a result of `moe_apply_ep` as numpy, in every process (an
    all-gather across processes when the mesh spans several)."""
    if getattr(a, "is_fully_addressable", True):
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def capacity(
    tokens_per_device: int,
    cfg: MoEConfig,
    n_expert: int,
    capacity_factor: float | None = None,
    num_slots: int | None = None,
) -> int:
    """Rows ``C`` per (sender, receiver) device pair.

    ``None``: the no-drop worst case ``T_local * min(k, E/n)`` (``P/n`` for ``num_slots=P``
    physical slots); else ``min(worst, max(1, ceil(capacity_factor * T_local * k / n)))``.
    """
    k, el = cfg.top_k, (num_slots or cfg.num_experts) // n_expert
    worst = tokens_per_device * min(k, el)
    if capacity_factor is None:
        return max(1, worst)
    if not (
        isinstance(capacity_factor, (int, float))
        and not isinstance(capacity_factor, bool)
        and math.isfinite(capacity_factor)
        and capacity_factor > 0
    ):
        raise ValueError(f"capacity_factor must be a finite positive number or None, got {capacity_factor!r}")
    return max(1, min(worst, math.ceil(capacity_factor * tokens_per_device * k / n_expert)))


def resolve_exchange(exchange: str, platform: str | None = None) -> str:
    """``padded`` or ``ragged`` for ``exchange`` (``auto``: ragged on GPU / TPU, else padded)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"unknown exchange {exchange!r}; expected one of {EXCHANGES}")
    if exchange != "auto":
        return exchange
    platform = platform or default_platform()
    return "ragged" if platform in RAGGED_PLATFORMS else "padded"


def local_config(cfg: MoEConfig, experts_per_device: int) -> MoEConfig:
    """The config the grouped path sees on one device: ``E/n`` experts, one slot per row."""
    return dataclasses.replace(cfg, router=RouterConfig(num_experts=experts_per_device, top_k=1))


def exchange_rows(
    buf: jax.Array, sizes: jax.Array, recv_sizes: jax.Array, n: int, c: int, kind: str, fill=0
) -> jax.Array:
    """Moves ``buf [n*C, ...]`` (chunk ``j`` = rows ``[j*C, j*C + sizes[j])`` for device ``j``
    along ``expert``) to the same layout on the receivers (chunk ``i`` from device ``i``).
    Rows past each chunk's size hold the sender's padding (``padded``) or ``fill``
    (``ragged``); callers fill their padding with ``fill`` too, so both agree."""
    if kind == "padded":
        out = jax.lax.all_to_all(buf.reshape(n, c, *buf.shape[1:]), EXPERT_AXIS, 0, 0, tiled=True)
        return out.reshape(buf.shape)
    me = jax.lax.axis_index(EXPERT_AXIS).astype(jnp.int32)
    offs = jnp.arange(n, dtype=jnp.int32) * c
    return _ragged_all_to_all(
        buf, jnp.full_like(buf, fill), offs, sizes, jnp.full((n,), me * c, jnp.int32), recv_sizes, axis_name=EXPERT_AXIS
    )


def _plan(ids: jax.Array, valid: jax.Array, n: int, el: int, c: int):
    """Where each local pair goes. ``ids [T, k]``, ``valid [T]`` ->
    ``slot [T*k]`` (row in the send buffer, ``n*C`` when not sent), ``kept [T*k]``,
    ``sizes [n]`` rows sent to each device, ``dropped []`` (capacity drops only: a pair
    of a padding token or with an id outside ``[0, E)`` is not sent and not counted)."""
    t, k = ids.shape
    ok = id_valid(ids, n * el).reshape(-1)  # [P]
    dest = jnp.where(ok, ids.reshape(-1), 0) // el  # [P], in [0, n)
    pv = jnp.repeat(valid, k) & ok  # [P]
    oh = (dest[:, None] == jnp.arange(n)[None, :]) & pv[:, None]  # [P, n]
    rank = jnp.cumsum(oh.astype(jnp.int32), axis=0) - 1  # [P, n]
    pos = jnp.take_along_axis(rank, dest[:, None], axis=1)[:, 0]  # [P]
    kept = pv & (pos < c)
    slot = jnp.where(kept, dest * c + pos, n * c)
    sizes = jnp.minimum(oh.sum(axis=0), c).astype(jnp.int32)  # [n]
    dropped = (pv & ~kept).sum().astype(jnp.int32)
    return slot, kept, sizes, dropped


def _ep_body(
    x,
    valid,
    ids,
    w,
    router,
    experts,
    shared,
    placement,
    *,
    cfg: MoEConfig,
    n: int,
    c: int,
    ex: ExecConfig,
    kind: str,
    tok_axes: tuple[str, ...],
    all_axes: tuple[str, ...],
):
    """One device. ``x [Tl, d]``, ``valid [Tl]``, ``ids, w [Tl, k]`` or None (routed here);
    ``placement`` None or ``(log2phy, replica_count)`` (replicated)."""
    el = (cfg.num_experts if placement is None else placement[0].shape[1] + cfg.num_experts - 1) // n
    tl, d = x.shape
    k = cfg.top_k
    if ids is None:
        with jax.named_scope("ep_route"):
            r = compute_routing(router, x, cfg, invariant=ex.batch_invariant)
        ids, w = r.expert_ids, r.weights
    pids = ids  # the slot ids the exchange plans by: logical ids, or physical slots
    if placement is not None:
        with jax.named_scope("ep_replicas"):
            pids = _replica_ids(ids, valid, placement, tok_axes, cfg.num_experts)
    with jax.named_scope("ep_dispatch"):
        slot, kept, sizes, dropped = _plan(pids, valid, n, el, c)
        tok = jnp.repeat(jnp.arange(tl), k)
        send_x = jnp.zeros((n * c, d), x.dtype).at[slot].set(x[tok], mode="drop")
        # unused rows carry the local id ``el``, which the dispatch plan drops: never computed
        send_id = jnp.full((n * c,), el, jnp.int32).at[slot].set((pids % el).reshape(-1).astype(jnp.int32), mode="drop")
        send_w = jnp.zeros((n * c,), jnp.float32).at[slot].set(w.reshape(-1).astype(jnp.float32), mode="drop")
    with jax.named_scope("ep_exchange"):
        recv_sizes = jax.lax.all_to_all(sizes, EXPERT_AXIS, 0, 0, tiled=True)
        recv_x = exchange_rows(send_x, sizes, recv_sizes, n, c, kind)
        recv_id = exchange_rows(send_id, sizes, recv_sizes, n, c, kind, fill=el)
        recv_w = exchange_rows(send_w, sizes, recv_sizes, n, c, kind)
    lcfg = local_config(cfg, el)
    with jax.named_scope("ep_experts"):
        out = run_experts(recv_x, Routing(recv_id[:, None], recv_w[:, None]), experts, None, lcfg, ex)
    with jax.named_scope("ep_return"):
        back = exchange_rows(out.astype(jnp.float32), recv_sizes, sizes, n, c, kind)
    with jax.named_scope("ep_combine"):
        y = jnp.take(back, jnp.minimum(slot, n * c - 1), axis=0).reshape(tl, k, d)
        y = slot_sum(y, None, kept.reshape(tl, k), invariant=ex.batch_invariant)
        y = y + shared_expert(x, shared, cfg, invariant=ex.batch_invariant, activations=ex.activations)
    load = (
        jnp.zeros((el,), jnp.int32)
        .at[recv_id]
        .add((jnp.arange(n * c) % c < jnp.repeat(recv_sizes, c)).astype(jnp.int32), mode="drop")
    )
    load = jax.lax.psum(load, tuple(a for a in all_axes if a != EXPERT_AXIS)) if len(all_axes) > 1 else load
    dropped = jax.lax.psum(dropped, all_axes)
    return y.astype(x.dtype), ids, w, kept.reshape(tl, k), dropped, load


def _replica_ids(ids, valid, placement, tok_axes, num_experts):
    """Physical slot ``[Tl, k]`` of each local pair by the replica rule, numbered over the
    whole flattened batch (the earlier devices' pairs of each expert come first)."""
    log2phy, count = placement
    live = jnp.where(valid[:, None], ids, num_experts)  # padding tokens: not counted, not sent
    mine = jnp.zeros((num_experts,), jnp.int32).at[live.reshape(-1)].add(1, mode="drop")
    every = jax.lax.all_gather(mine, tok_axes)  # [n_tok, E] in token-shard order
    me = jax.lax.axis_index(tok_axes)
    start = jnp.where((jnp.arange(every.shape[0]) < me)[:, None], every, 0).sum(0)
    return replica_slots(live, log2phy, count, start)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "ex", "c", "kind", "given"))
def _ep_jit(params: MoEParams, x2: jax.Array, ids, w, placement=None, *, cfg, mesh, ex, c, kind, given):
    n, tok_axes = _axes(mesh)
    all_axes = tuple(mesh.axis_names)
    n_tok = math.prod(int(mesh.shape[a]) for a in tok_axes)
    t = x2.shape[0]
    tp = -(-t // n_tok) * n_tok
    pad = tp - t
    valid = jnp.arange(tp) < t
    x2 = jnp.pad(x2, ((0, pad), (0, 0)))
    if given:
        ids = jnp.pad(ids, ((0, pad), (0, 0)))
        w = jnp.pad(w, ((0, pad), (0, 0)))
    router = dataclasses.replace(params, experts=None, shared=None)  # the routing's parameters

    tspec = P(tok_axes)
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    ex_spec = jax.tree.map(lambda _: P(EXPERT_AXIS), params.experts)

    explicit = all(a == jax.sharding.AxisType.Explicit for a in mesh.axis_types)
    move = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint

    def put(tree, spec):
        """Reshards every leaf of ``tree`` (spec: one PartitionSpec, or a tree of them)."""
        if isinstance(spec, P):
            spec = jax.tree.map(lambda _: spec, tree)
        return jax.tree.map(
            lambda a, s: move(a, NamedSharding(mesh, s)), tree, spec, is_leaf=lambda z: isinstance(z, P)
        )

    args = (x2, valid, ids, w, router, params.experts, params.shared, placement)
    specs = (tspec, tspec, tspec, tspec, rep(router), ex_spec, P(), P())
    args = tuple(put(a, s) for a, s in zip(args, specs))
    body = functools.partial(_ep_body, cfg=cfg, n=n, c=c, ex=ex, kind=kind, tok_axes=tok_axes, all_axes=all_axes)
    out_specs = (tspec, tspec, tspec, tspec, P(), P(EXPERT_AXIS))
    # check_vma=False: the grouped paths (e.g. ``xla``'s fori_loop over a zeros carry) are
    # written for one device and need not annotate which values vary across the mesh.
    y, ids_o, w_o, kept, dropped, load = jax.shard_map(
        body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False
    )(*args)

    def unpad(a):  # explicit meshes cannot slice a sharded axis unevenly: gather it first
        if not pad:
            return a
        if explicit:
            a = jax.sharding.reshard(a, NamedSharding(mesh, P()))
        return a[:t]

    return unpad(y), Routing(unpad(ids_o), unpad(w_o)), EPStats(dropped, unpad(kept), load, c, kind)


def moe_apply_ep(
    params: MoEParams,
    x: jax.Array,
    cfg: MoEConfig,
    mesh: Mesh,
    ex: ExecConfig | None = None,
    *,
    impl: str | None = None,
    return_routing: bool = False,
    capacity_factor: float | None = None,
    routing: Routing | None = None,
    exchange: str = "auto",
    return_stats: bool = False,
    placement: Placement | None = None,
    **removed,
):
    """One MoE layer, expert-parallel over ``mesh``. ``x [..., d]`` -> ``y [..., d]`` in ``x.dtype``.

    Equals `jaxmoe.moe_apply` up to float rounding (same routing, same expert dispatch,
    sums in float32 in slot order) whenever no pair is dropped; with
    ``ExecConfig(batch_invariant=True)`` a token's output is bitwise independent of the
    batch and of how the tokens fall on the mesh.

    Args:
      params: the layer's `MoEParams` (any placement; `shard_params` avoids a reshard).
      x: activations ``[..., d]``; tokens are padded to a multiple of the device count.
      cfg: the layer's `MoEConfig`.
      mesh: a `jax.sharding.Mesh` with an ``expert`` axis and optionally ``data``.
      ex: how each device runs its share (`jaxmoe.ExecConfig`; every option holds: the
        same `jaxmoe.impls.policy.run_experts` as `jaxmoe.moe_apply`).
      impl: shorthand for ``ExecConfig(impl=...)``.
      return_routing: also return the `Routing` ``[T, k]`` used (flattened tokens).
      capacity_factor: None (no drops, worst-case buffers) or ``c > 0``: rows per device
        pair ``ceil(c * T_local * k / n)``. When set, an `EPStats` is always returned,
        so dropped pairs are never silent.
      routing: use this routing (``[T, k]`` over the flattened tokens) instead of routing.
      exchange: ``auto``, ``padded`` (``all_to_all``) or ``ragged`` (``ragged_all_to_all``).
      return_stats: also return the `EPStats`.
      placement: redundant experts (`jaxmoe.placement.Placement` over the ``expert``
        axis): ``params.experts`` then holds its ``P`` physical slots
        (`jaxmoe.placement.physical_experts`); see the module docstring for the replica
        rule. Its arrays are traced: another placement of the same ``P`` reuses the compile.

    Returns:
      ``y``, followed by the `Routing` if ``return_routing`` and the `EPStats` if
      ``return_stats`` or ``capacity_factor`` is set, in that order.
    """
    ex = exec_config(ex, impl, **removed)
    x = jnp.asarray(x)
    if x.shape[-1] != cfg.d_model:
        raise ValueError(f"moe_apply_ep: x has width {x.shape[-1]} but d_model is {cfg.d_model} (shape {x.shape})")
    n, tok_axes = _axes(mesh)
    if placement is None:
        check_divisible(cfg, mesh)
        if params.experts.num_experts != cfg.num_experts:
            raise ValueError(
                f"moe_apply_ep: params hold {params.experts.num_experts} experts, cfg.num_experts is {cfg.num_experts}"
            )
    else:
        _check_placement_args(params, cfg, placement, n)
    kind = resolve_exchange(exchange, mesh.devices.flat[0].platform)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cfg.d_model)
    t = x2.shape[0]
    n_tok = math.prod(int(mesh.shape[a]) for a in tok_axes)
    c = capacity(-(-t // n_tok), cfg, n, capacity_factor, None if placement is None else placement.num_slots)
    given = routing is not None
    ids = w = None
    if given:
        ids, w = jnp.asarray(routing.expert_ids), jnp.asarray(routing.weights)
        check_expert_ids(ids, cfg.num_experts, "moe_apply_ep", shape=(t, cfg.top_k), weights=w)
        ids = replace_invalid(ids, cfg.num_experts, cfg.num_experts)  # before the int32 cast
        ids, w = ids.astype(jnp.int32), w.astype(jnp.float32)
    resolve_impl(ex.impl, n * c, experts=params.experts, dtype=x2.dtype)  # ValueError for unknown names, before tracing
    pl = None if placement is None else (jnp.asarray(placement.log2phy), jnp.asarray(placement.replica_count))
    y, r, stats = _ep_jit(params, x2, ids, w, pl, cfg=cfg, mesh=mesh, ex=ex, c=c, kind=kind, given=given)
    out = [y.reshape(*lead, cfg.d_model)]
    if return_routing:
        out.append(r)
    if return_stats or capacity_factor is not None:
        out.append(stats)
    return out[0] if len(out) == 1 else tuple(out)


def _check_placement_args(params: MoEParams, cfg: MoEConfig, placement: Placement, n: int) -> None:
    """PlacementError unless ``placement`` fits ``cfg``, the ``expert`` axis and ``params.experts``."""
    if not isinstance(placement, Placement):
        raise PlacementError(f"moe_apply_ep: placement must be a jaxmoe.placement.Placement, got {type(placement)}")
    if placement.num_experts != cfg.num_experts:
        raise PlacementError(
            f"moe_apply_ep: the placement has {placement.num_experts} logical experts, cfg.num_experts is {cfg.num_experts}"
        )
    if placement.num_devices != n:
        raise PlacementError(
            f"moe_apply_ep: the placement is for {placement.num_devices} devices, the mesh's {EXPERT_AXIS!r} axis has {n}"
        )
    if params.experts.num_experts != placement.num_slots:
        raise PlacementError(
            f"moe_apply_ep: params hold {params.experts.num_experts} experts but the placement has "
            f"{placement.num_slots} physical slots (build them with jaxmoe.placement.physical_experts)"
        )
