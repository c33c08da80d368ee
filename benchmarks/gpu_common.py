"""What the GPU check's phases share (benchmarks/gpu_check.sh; docs/gpu.md).

The layer shapes and token counts, random expert weights and rotating routings, the
implementations that are timed (``xla``, ``pallas``, ``pallas_fma``, ``ragged_dot`` and
tokamax's ``ragged_dot``), the row files (JSON lines, each row flushed as soon as it exists) and a
phase deadline. Phases import this module; it holds no state of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jaxmoe  # noqa: E402
from jaxmoe.dispatch import plan_dispatch  # noqa: E402
from jaxmoe.execution import ExecConfig  # noqa: E402
from jaxmoe.impls.common import combine, sorted_inputs  # noqa: E402
from jaxmoe.impls.pallas import experts_pallas  # noqa: E402
from jaxmoe.impls.registry import get_impl  # noqa: E402
from jaxmoe.quant import GGUF_BLOCKS, QuantizedTensor, gguf_block_tensor  # noqa: E402
from pallas_kernels import tuning  # noqa: E402

#: Timed layers: name -> preset (routed experts only; the shared expert is left out).
SHAPES = {"qwen3.6": "qwen3.6-35b-a3b", "mixtral": "mixtral-8x7b"}
#: Token counts timed on the GPU; decode (T * k <= 64) and grouped paths both appear.
TOKENS = (1, 16, 128, 2048, 16384)
KINDS = ("bf16", "q8_0")
#: The dry run's (layer, weights, T) groups at tiny sizes: a decode and a grouped call,
#: and the Q8_0 weights once (every code path of the timing phase, fewer compiles).
DRY_GROUPS = (("qwen3.6", "bf16", 1), ("qwen3.6", "bf16", 40), ("qwen3.6", "q8_0", 40))
#: Timed in this order for each (shape, weights, T); ``xla`` first: it is the reference
#: every later row's output is compared with. ``pallas_fma``: the pallas impl with the decode
#: kernels' float32 matvecs instead of their tensor-core dots (``decode_mma=False``), timed
#: on the decode path only (T k <= 64): the A/B of that choice.
IMPLS = ("xla", "pallas", "pallas_fma", "ragged_dot", "tokamax")
#: Relative error (max |a - b| / max |b|) allowed between two bf16 implementations.
BF16_TOL = 4e-2
#: The targets of issue 12 item 5: decode within this factor of the HBM floor, large T at
#: this fraction of the measured bf16 matmul rate (dry runs use their own token counts).
TARGETS = dict(hbm_max_t=16, hbm_factor=1.3, mm_min_t=2048, mm_fraction=0.6)
#: H200 L2 (PyTorch reported 60 MB on the lent machine); env.json records the measured one.
L2_BYTES_DEFAULT = 60 * 2**20


def log(*a) -> None:
    print(*a, flush=True)


# ------------------------------------------------------------------ files and time


class Rows:
    """A JSON-lines file written one flushed line per row, so a phase killed by its
    timeout keeps every row it finished."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.write_text("")

    def write(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())


@dataclasses.dataclass(frozen=True)
class Deadline:
    """Seconds left of a phase's own budget (kept under the shell's hard ``timeout``)."""

    seconds: float
    start: float = dataclasses.field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


def check_backend(dry_run: bool) -> bool:
    """Pallas interpret mode or not; exits with a clear message when a GPU run finds no GPU."""
    backend = jax.default_backend()
    if not dry_run and backend not in ("gpu", "cuda", "rocm"):
        sys.exit(f"error: JAX sees no GPU (backend {backend!r}); on a CPU use `bash benchmarks/gpu_check.sh --dry-run`")
    return dry_run


# ------------------------------------------------------------------ shapes and inputs


def shrink(cfg, d: int, f: int, e: int, k: int):
    """``cfg`` without shared experts, at width ``d``, expert width ``f``, ``e`` experts top-``k``."""
    return dataclasses.replace(
        cfg,
        d_model=d,
        expert_dim=f,
        shared_expert_dim=0,
        num_shared_experts=0,
        shared_expert_gate=False,
        router=dataclasses.replace(cfg.router, num_experts=e, top_k=min(k, e)),
    )


def layer_config(shape: str, dry_run: bool):
    """The routed experts of a timed layer; dry runs keep the family but tiny sizes."""
    cfg = jaxmoe.load_config(SHAPES[shape])
    if dry_run:
        return shrink(cfg, 64, 32, min(16, cfg.num_experts), min(cfg.top_k, 4))
    return shrink(cfg, cfg.d_model, cfg.expert_dim, cfg.num_experts, cfg.top_k)


@functools.partial(jax.jit, static_argnums=(0, 1))
def random_experts(cfg, kind: str, key) -> jaxmoe.ExpertWeights:
    """Random experts made on the device: bf16 ``[E, d, F]`` / ``[E, F, d]``, or Q8_0 (int8
    codes ``[E, n_out, n_in]`` with a float16 scale per 32 inputs)."""
    e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
    ks = jax.random.split(key, 6)
    if kind == "bf16":
        shapes = ((e, d, f), (e, d, f), (e, f, d))
        return jaxmoe.ExpertWeights(
            *(jax.random.normal(k_, s, jnp.bfloat16) * (1 / s[1] ** 0.5) for k_, s in zip(ks, shapes))
        )
    if kind != "q8_0":
        raise ValueError(f"random_experts: kind must be 'bf16' or 'q8_0', got {kind!r}")

    def q8(k1, k2, n_in, n_out):
        q = jax.random.randint(k1, (e, n_out, n_in), -127, 128, jnp.int32).astype(jnp.int8)
        s = jax.random.uniform(k2, (e, n_out, n_in // 32), jnp.float32, 0.5, 1.5) / (127 * n_in**0.5)
        return QuantizedTensor(q, s.astype(jnp.float16), None, "int8", 32)

    return jaxmoe.ExpertWeights(q8(ks[0], ks[1], d, f), q8(ks[2], ks[3], d, f), q8(ks[4], ks[5], f, d))


def bytes_per_expert(cfg, kind: str) -> float:
    """Stored bytes of one expert's three matrices (Q8_0: 1 byte + 2/32 of a scale each)."""
    return 3 * cfg.d_model * cfg.expert_dim * (2.0 if kind == "bf16" else 34 / 32)


def rotation(t: int, dry_run: bool) -> int:
    """How many input sets a timing loop cycles through: many for decode, where one call's
    experts would otherwise stay in L2 between iterations; two for large T."""
    if dry_run:
        return 2
    return 8 if t <= 16 else 4 if t <= 128 else 2


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def rotating_inputs(cfg, t: int, r: int, key):
    """``r`` input sets: ``x [r, T, d]`` bf16 and a `jaxmoe.Routing` of ``[r, T, k]``."""
    kx, kr = jax.random.split(key)
    xs = jax.random.normal(kx, (r, t, cfg.d_model), jnp.bfloat16)
    logits = jax.random.normal(kr, (r * t, cfg.num_experts), jnp.float32)
    rt = jaxmoe.route(logits, cfg.router)
    return xs, jaxmoe.Routing(rt.expert_ids.reshape(r, t, -1), rt.weights.reshape(r, t, -1))


def traffic(cfg, kind: str, ids: np.ndarray) -> dict:
    """Bytes one call must move at least, averaged over the rotation ``ids [r, T, k]``: the
    distinct selected experts in their stored format, ``x`` (bf16) read and ``y`` (f32)
    written; and ``reuse``, the mean fraction of a call's experts the previous call of the
    rotation also used (what L2 could still hold)."""
    used = [set(np.unique(a).tolist()) for a in ids]
    t = ids.shape[1]
    io = t * cfg.d_model * (2 + 4)
    per = bytes_per_expert(cfg, kind)
    reuse = [len(used[i] & used[i - 1]) / len(used[i]) for i in range(len(used))] if len(used) > 1 else [1.0]
    return dict(
        experts_used=float(np.mean([len(u) for u in used])),
        bytes=float(np.mean([len(u) * per for u in used])) + io,
        reuse_prev=float(np.mean(reuse)),
        working_set=float(len(set().union(*used)) * per),
        flops=float(2 * 3 * t * cfg.top_k * cfg.d_model * cfg.expert_dim),
    )


# ------------------------------------------------------------------ implementations


def _stub_xprof() -> bool:
    """tokamax imports ``xprof.cli.tools.get_kernel_stats_tool`` at load for its own
    profiler timings, which this script does not use; xprof itself (32 MB wheel, duckdb,
    google-cloud-storage) is not carried, so empty modules stand in when it is missing."""
    try:
        import xprof.cli.tools.get_kernel_stats_tool  # noqa: F401  # pyright: ignore[reportMissingImports]

        return False
    except ImportError:
        pass
    names = ("xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool")
    for name in names:
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so the submodule imports resolve
        sys.modules[name] = mod
    for parent, child in zip(names, names[1:]):
        setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])
    return True


def import_tokamax() -> tuple[types.ModuleType | None, str]:
    """``(tokamax, note)``, or ``(None, why not)``."""
    try:
        stubbed = _stub_xprof()
        import tokamax  # pyright: ignore[reportMissingImports]

        return tokamax, f"tokamax {tokamax.__version__}" + (" (xprof stubbed)" if stubbed else "")
    except Exception as e:  # not carried, or broken on this jax
        return None, f"tokamax not importable ({type(e).__name__}: {str(e)[:200]})"


def tokamax_experts(x, routing, ew, cfg, *, rd, w_gate_up):
    """Routed experts on a tokamax-style ``ragged_dot`` ``rd(lhs [P, K], rhs [E, K, N],
    group_sizes [E]) -> [P, N]``: one call over gate|up concatenated (``w_gate_up [E, d,
    2F]``, made once outside the timed loop), SwiGLU, one call for down. ``[T, d]`` f32."""
    plan = plan_dispatch(routing.expert_ids, cfg.num_experts, 1)
    xs = sorted_inputs(x, routing, plan, cfg)
    gu = rd(xs, w_gate_up, plan.group_sizes).astype(jnp.float32)  # [P, 2F]
    f = cfg.expert_dim
    h = (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(x.dtype)
    y = rd(h, ew.w_down, plan.group_sizes).astype(jnp.float32)  # [P, d]
    return combine(y, routing, plan, cfg)


def tokamax_rd(tokamax, implementation: str | None):
    """tokamax's ``ragged_dot`` with one implementation; ``None``: `jax.lax.ragged_dot`
    (the dry run's stand-in where tokamax is not installed)."""
    if tokamax is None or implementation is None:
        return functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32)
    return functools.partial(tokamax.ragged_dot, preferred_element_type=jnp.float32, implementation=implementation)


def impl_fn(name: str, interpret: bool):
    """``fn(x [T, d], routing, experts, cfg) -> [T, d]`` f32 for ``xla``, ``pallas``,
    ``pallas_fma`` and ``ragged_dot`` (tokamax takes extra arguments: `tokamax_experts`)."""
    if name == "pallas":
        return functools.partial(experts_pallas, ex=ExecConfig(interpret=interpret))
    if name == "pallas_fma":
        return functools.partial(pallas_fma, interpret=interpret)
    return get_impl(name)


def pallas_fma(x, routing, ew, cfg, interpret: bool):
    """The ``pallas`` impl with its decode kernels as float32 matvecs (``decode_mma=False``)."""
    kc = tuning.choose(x.shape[0] * cfg.top_k, cfg.d_model, cfg.expert_dim, x.dtype)
    kc = dataclasses.replace(kc, decode_mma=False)
    return experts_pallas(x, routing, ew, cfg, ExecConfig(interpret=interpret, kernel_config=kc))


def projection_kinds(fmt: str) -> tuple[str, str, str]:
    """Weight kinds of the gate, up and down projections for a format name: ``q4_k_m`` is
    llama.cpp's Q4_K_M mix (Q4_K gate / up, Q6_K down), any other name is all three."""
    return ("q4_k", "q4_k", "q6_k") if fmt == "q4_k_m" else (fmt, fmt, fmt)


def gguf_random_weight(kind: str, e: int, i: int, o: int, seed: int) -> QuantizedTensor:
    """Random valid GGUF blocks of ``kind`` for a logical ``[e, i, o]`` weight: random codes
    and packed scales, small finite float16 block scales (speed does not depend on values)."""
    block, size = GGUF_BLOCKS[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (e, o, i // block, size), dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.5, (e, o, i // block, 1)) * 0.02 / math.sqrt(i) / 16).astype(np.float16)
    at = {
        "q4_0": (0,),
        "q4_1": (0, 2),
        "q5_0": (0,),
        "q5_1": (0, 2),
        "q4_k": (0, 2),
        "q5_k": (0, 2),
        "q6_k": (size - 2,),
        "q2_k": (size - 4, size - 2),
        "q3_k": (size - 2,),
        "iq4_xs": (0,),
        "iq4_nl": (0,),
        "mxfp4": (),
        **dict.fromkeys(("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s"), (0,)),  # random grid rows
        "tq2_0": (size - 2,),
        "iq1_m": (),
    }[kind]
    for off in at:
        b[..., off : off + 2] = scale.view(np.uint8)
    if kind == "iq1_m":  # d's 4 nibbles are the top nibbles of the 4 u16 scale words at byte 48
        d16 = scale.view(np.uint16)[..., 0]
        for n in range(4):
            sw = b[..., 48 + 2 * n : 50 + 2 * n].copy().view(np.uint16)[..., 0]
            sw = (sw & 0x0FFF) | (((d16 >> (4 * n)) & 0xF) << 12)
            b[..., 48 + 2 * n : 50 + 2 * n] = sw.astype(np.uint16)[..., None].view(np.uint8)
    if kind == "mxfp4":  # the E8M0 exponent byte: scales 2^(e - 128) near the others'
        b[..., 0] = rng.integers(116, 120, b.shape[:-1], dtype=np.uint8)
    return gguf_block_tensor(jnp.asarray(b.reshape(e, o, -1)), kind, n_in=i)


def rel_err(a, b) -> float:
    """``max |a - b| / max |b|`` in float32; NaN when ``a`` holds a NaN."""
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.abs(a - b).max() / max(1e-30, float(np.abs(b).max())))
