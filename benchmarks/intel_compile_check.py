"""Compile the MoE layer for Intel GPUs (Arc B580 / BMG, Data Center GPU Max 1100 / PVC) on this CPU.

No Intel GPU and no driver: the OpenXLA oneAPI PJRT plugin 0.11.2 (jax 0.11.2, in the
Python 3.12 venv of benchmarks/compile_venv.py, plus the Intel runtime libraries, Debian's
Level Zero loader and a 3-function shim, all cached under ``~/.cache/jaxmoe``) gives a
compile-only topology from a ``GpuTargetConfigProto`` written here from each GPU's public
specification; ``.compile()`` on it runs XLA's SYCL pipeline to SPIR-V. Workarounds and what
differs from real hardware: docs/intel.md.

For ``moe_apply`` of the Qwen3.6-35B-A3B layer (256 experts, d 2048, F 512, top-8; the real
sizes, abstract weights) with ``impl="auto"`` and each impl that can run there (``xla``,
``xla_tiled``, ``gather``, ``ragged_dot``, ``dense``; ``auto`` also as a whole ``MoEBlock``), at
T in {1, 16, 32, 64, 256}, bfloat16 and float32, it reports: compiled or the error, kernels at top
level, kernels inside loops with each loop's trip count (``?`` = data dependent) and kernel
launches per call (benchmarks/hlo_kernels.py on the optimized HLO). It fails (exit 1) when
``auto`` does not compile, and with ``--max-launches N`` when ``auto``, ``xla`` or
``xla_tiled`` (the Intel formulation) launches more than N kernels per call. Usage::

    python benchmarks/intel_compile_check.py [--ci] [--targets bmg,pvc] [--only REGEX] [--out FILE] [--dump-hlo DIR]
        [--max-launches N]

``--ci``: both targets, ``auto`` (moe_apply and MoEBlock) in both dtypes at every T, the other
impls in bfloat16 on BMG only.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

#: GpuTargetConfigProto text per target (public specifications; core_count = vector engines).
#: Arc B580: Xe2 (BMG-G21), 20 Xe-cores x 8 XVE, 2.67 GHz, 12 GB GDDR6 at 456 GB/s, 18 MB L2.
#: Max 1100: Xe-HPC (PVC), 56 Xe-cores x 8 XVE, 1.55 GHz, 48 GB HBM2e at 1.2288 TB/s, 108 MB L2.
_TEMPLATE = """\
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: {warp}
  shared_memory_per_block: 65536
  shared_memory_per_core: {slm_core}
  threads_per_core_limit: {threads_core}
  core_count: {cores}
  fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bw}
  l2_cache_size: {l2}
  clock_rate_ghz: {ghz}
  device_memory_size: {mem}
  shared_memory_per_block_optin: 65536
  oneapi_compute_capability {{ architecture: "{arch}" }}
  registers_per_core_limit: {regs}
  registers_per_block_limit: {regs}
}}
platform_name: "SYCL"
device_description_str: "{name}"
"""
TARGETS = {
    "bmg": _TEMPLATE.format(
        name="Intel(R) Arc(TM) B580 Graphics",
        arch="BMG",
        warp=32,
        slm_core=131072,
        threads_core=128,
        cores=160,
        fpus=16,
        bw=456_000_000_000,
        l2=18 * 2**20,
        ghz=2.67,
        mem=12 * 2**30,
        regs=65536,
    ),
    "pvc": _TEMPLATE.format(
        name="Intel(R) Data Center GPU Max 1100",
        arch="PVC",
        warp=32,
        slm_core=131072,
        threads_core=128,
        cores=448,
        fpus=16,
        bw=1_228_800_000_000,
        l2=108 * 2**20,
        ghz=1.55,
        mem=48 * 2**30,
        regs=65536,
    ),
}
IMPLS = ("auto", "block-auto", "xla", "xla_tiled", "gather", "ragged_dot", "dense")
TOKENS = (1, 16, 32, 64, 256)  # 32: the first capacity T at E = 256 (P = E), 64: C = 8
DTYPES = ("bf16", "f32")
PRESET = "qwen3.6-35b-a3b"
#: Without a device oneDNN cannot create an engine for library matmuls: every dot is left to
#: XLA's own emitter (real hardware would call oneDNN for most of them; docs/intel.md).
XLA_FLAGS = "--xla_gpu_gemm_rewrite_size_threshold=1000000000000"


def cases(ci: bool, targets: list[str]) -> list[tuple[str, str, str, int]]:
    out = []
    for target in targets:
        for impl in IMPLS:
            for dt in DTYPES:
                for t in TOKENS:
                    if ci and impl not in ("auto", "block-auto") and (dt != "bf16" or target != "bmg"):
                        continue
                    out.append((target, impl, dt, t))
    return out


def compile_case(mesh, cfg, impl: str, dt: str, t: int):
    """The compiled program, or raises."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxmoe

    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dt]
    sh = NamedSharding(mesh, PartitionSpec())
    put = lambda tree: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree)
    x = put(jax.ShapeDtypeStruct((t, cfg.d_model), dtype))
    if impl == "block-auto":
        abstract = nnx.eval_shape(lambda: jaxmoe.MoEBlock(cfg, rngs=nnx.Rngs(0), dtype=dtype))
        graphdef, state = nnx.split(abstract)

        def fn(state, x):
            return nnx.merge(graphdef, state)(x)

        args = (put(state), x)
    else:
        params = put(jax.eval_shape(lambda: jaxmoe.init_params(cfg, jax.random.key(0), dtype=dtype)))

        def fn(params, x):
            return jaxmoe.moe_apply(params, x, cfg, impl=impl)

        args = (params, x)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(fn).trace(*args).lower()
    return lowered.compile()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="auto everywhere, the other impls in bf16 on BMG")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--only", default=None, help="regex on 'target/impl/dtype/T'")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--dump-hlo", default=None, metavar="DIR", help="write each case's optimized HLO into DIR")
    ap.add_argument(
        "--max-launches",
        type=int,
        default=None,
        metavar="N",
        help="also fail when a case of the Intel formulation (auto, block-auto, xla, xla_tiled) launches more "
        "than N kernels per call or a data-dependent number (CI: 40, the bound docs/intel.md promises)",
    )
    a = ap.parse_args(argv)
    if a.dump_hlo:
        Path(a.dump_hlo).mkdir(parents=True, exist_ok=True)
    targets = a.targets.split(",")
    for t in targets:
        if t not in TARGETS:
            ap.error(f"--targets: unknown {t!r}; expected some of {sorted(TARGETS)}")

    from compile_venv import ensure_intel

    ctypes.CDLL(str(ensure_intel()["shim"]), mode=ctypes.RTLD_GLOBAL)  # before jax loads the plugin
    import jax
    from hlo_kernels import count_kernels
    from jax.experimental import topologies

    import jaxmoe

    cfg = jaxmoe.load_config(PRESET)
    todo = cases(a.ci, targets)
    if a.only:
        todo = [c for c in todo if re.search(a.only, "/".join(map(str, c)))]
    meshes = {}
    for target in targets:
        topo = topologies.get_topology_desc(platform="oneapi", target_config=TARGETS[target], topology="1x1x1")
        meshes[target] = topologies.make_mesh(topo, (1,), ("x",))
    dev = meshes[targets[0]].devices.flat[0]
    print(f"jax {jax.__version__}, platform {dev.platform}, {dev.device_kind}, {len(todo)} cases", file=sys.stderr)
    rows = []
    t_all = time.perf_counter()
    for target, impl, dt, t in todo:
        t0 = time.perf_counter()
        row = dict(target=target, impl=impl, dtype=dt, T=t)
        try:
            compiled = compile_case(meshes[target], cfg, impl, dt, t)
            text = compiled.as_text() or ""
            row.update(compiled=True, **count_kernels(text).row())
            if a.dump_hlo:
                (Path(a.dump_hlo) / f"{target}-{impl}-{dt}-T{t}.hlo.txt").write_text(text)
        except Exception as e:  # noqa: BLE001 - every failure is a row
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            row.update(compiled=False, error=f"{type(e).__name__}: {msg}")
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"{target} {impl:10s} {dt:4s} T={t:<4d} {row['seconds']:5.1f}s {_status(row)}", file=sys.stderr, flush=True
        )
    head = "| target | impl | dtype | T | compiled | kernels top | kernels in loops | loops (kernels x trips) | launches/call |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["compiled"]:
            launches = r["launches"] if r["launches"] is not None else "data dependent"
            lines.append(
                f"| {r['target']} | {r['impl']} | {r['dtype']} | {r['T']} | yes | {r['kernels_top']} "
                f"| {r['kernels_in_loops']} | {r['loops'] or '-'} | {launches} |"
            )
        else:
            lines.append(f"| {r['target']} | {r['impl']} | {r['dtype']} | {r['T']} | no: {r['error']} | | | | |")
    bad = [r for r in rows if r["impl"] in ("auto", "block-auto") and not r["compiled"]]
    over = [r for r in rows if a.max_launches is not None and _over(r, a.max_launches)]
    summary = (
        f"\n{len(rows)} cases in {time.perf_counter() - t_all:.0f} s (jax {jax.__version__}, {PRESET} layer): "
        f"{sum(r['compiled'] for r in rows)} compiled; auto failing: {len(bad)}"
        + (f"; over {a.max_launches} launches: {len(over)}" if a.max_launches is not None else "")
    )
    table = "\n".join(lines)
    print(table + summary)
    if a.out:
        Path(a.out).write_text(table + "\n" + summary + "\n")
    for r in bad:
        print(f"FAIL {r['target']} {r['impl']} {r['dtype']} T={r['T']}: {r['error']}", file=sys.stderr)
    for r in over:
        n = r["launches"] if r["launches"] is not None else "a data-dependent number of"
        print(
            f"FAIL {r['target']} {r['impl']} {r['dtype']} T={r['T']}: {n} launches > {a.max_launches}", file=sys.stderr
        )
    return 1 if bad or over else 0


def _over(r: dict, limit: int) -> bool:
    """A compiled case of the Intel formulation above ``limit`` launches per call (or data dependent)."""
    intel = r["impl"] in ("auto", "block-auto", "xla", "xla_tiled")
    return intel and r["compiled"] and (r["launches"] is None or r["launches"] > limit)


def _status(r: dict) -> str:
    if not r["compiled"]:
        return "no: " + r["error"]
    return f"launches={r['launches']} loops={r['loops'] or '-'}"


if __name__ == "__main__":
    from compile_venv import SetupError, ensure_intel, reexec_in_venv

    try:
        pieces = ensure_intel()
        reexec_in_venv(
            __file__,
            env=dict(
                LD_LIBRARY_PATH=str(pieces["lib"]),
                PYTHONPATH=str(pieces["site"]),
                JAX_PLATFORMS="cpu",
                XLA_FLAGS=XLA_FLAGS,
            ),
        )
    except SetupError as e:
        sys.exit(f"intel_compile_check: {e}")
    sys.exit(main())
