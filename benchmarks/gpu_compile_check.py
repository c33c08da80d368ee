"""Compile every Pallas kernel configuration for an H200 (and an H100) on this CPU host.

No GPU and no driver: `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=<GpuTargetConfigProto>, topology="1x1x1")` gives compile-only devices, and
``.compile()`` on them runs XLA's own pipeline for the ``__gpu$xla.gpu.triton`` custom calls:
Triton to PTX, then ``ptxas`` for sm_90a, exactly what the GPU would load. It needs jax 0.11.2
with the CUDA 13 plugin, so the script re-executes itself in the cached Python 3.12 venv of
benchmarks/compile_venv.py (built on first use, ~2 minutes).

Where the numbers come from, per Triton kernel of each case:

- grid, threads, shared memory: XLA's thunk sequence (``--xla_dump_to``), what the launch uses;
- registers, spill stores / loads: ``ptxas -v`` (XLA is pointed at a wrapper ``ptxas`` that
  keeps each PTX input and adds ``-v``; ``--xla_gpu_enable_libnvptxcompiler=false``);
- MMA kind (``wgmma`` / ``mma.sync`` / ``FMA``) and pipelined loads (``TMA`` = cp.async.bulk.tensor,
  ``cp.async``, else ``no``): the instructions in that PTX;
- 32-bit offsets: the Triton IR each ``pallas_call`` lowered to (the custom call's ``ir``): every
  load / store pointer into an operand of >= 2^31 elements must have had a 64-bit offset added
  on its way from the kernel argument, else it wraps (issue 12).

A case fails on a compile error, any spill, shared memory over the per-block opt-in limit, or
such a 32-bit offset, unless it is listed in `KNOWN_FAILURES` with its reason (then the table
says KNOWN and the exit status stays 0). Usage::

    python benchmarks/gpu_compile_check.py [--ci] [--targets h200,h100] [--only REGEX] [--out FILE]

``--ci``: every kernel, weight kind and dtype path once (see `ci_subset`); the full set
additionally repeats the families for the H100 and runs every table / check case.
``JAXMOE_KEEP=1`` keeps the work directory (``/tmp/jaxmoe-gpucc-*``: each PTX, ``ptxas -v``
log and XLA dump) for reading a kernel's code.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # compile_venv, and the repo (jaxmoe, pallas_kernels)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# ------------------------------------------------------------------ targets (public specs)

_SM90 = """\
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bw}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {mem}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{name}"
"""
#: GpuTargetConfigProto text per target: SXM parts, 132 SMs, 50 MB L2, 227 KB opt-in shared
#: memory per block; H200 141 GB HBM3e at 4.8 TB/s, H100 80 GB HBM3 at 3.35 TB/s.
TARGETS = {
    "h200": _SM90.format(name="NVIDIA H200", bw=4_800_000_000_000, mem=150_754_820_096),
    "h100": _SM90.format(name="NVIDIA H100 80GB HBM3", bw=3_352_320_000_000, mem=84_978_434_048),
}
SMEM_LIMIT = 232448  #: bytes, shared_memory_per_block_optin of both targets
BIG = 2**31  #: operands with this many elements need 64-bit offsets

#: regex on ``case:kernel`` -> reason: compiled and reported, its failure is not fatal.
KNOWN_FAILURES: dict[str, str] = {
    # none at present (the float32 tile spills of issue 12 item 2.3 were the last: 3xTF32
    # dots and `tuning.for_dtype`'s float32 caps). Entry form:
    # r"^table/large-[^/]+/int4:moe_gmm$": "issue N: why it fails and what fixes it",
}


# ------------------------------------------------------------------ environment (before jax)


def _setup_env(work: Path) -> None:
    """XLA flags for the dumps and a logging ``ptxas`` wrapper; must run before importing jax."""
    real = os.environ.get("JAXMOE_PTXAS") or shutil.which("ptxas")
    cuda = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    if real is None:
        for c in cuda:
            if c and Path(c, "bin", "ptxas").exists():
                real = str(Path(c, "bin", "ptxas"))
                break
    if real is None:
        sys.exit("gpu_compile_check: ptxas not found (CUDA 13 nvcc/ptxas on PATH, $CUDA_HOME or $JAXMOE_PTXAS)")
    (work / "bin").mkdir(parents=True)
    (work / "log").mkdir()
    wrapper = work / "bin" / "ptxas"
    wrapper.write_text(
        "#!/bin/bash\n"
        f"log={work}/log/$(date +%s%N)-$$\n"
        'if [ "$1" = "--version" ]; then exec ' + real + ' "$@"; fi\n'
        'cp "$1" "$log.ptx" 2>/dev/null\n'
        f'{real} -v "$@" 2> >(tee "$log.err" >&2)\n'
        "rc=$?; wait; exit $rc\n"
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    for c in cuda:  # libdevice for XLA's own (non-Triton) kernels
        if c and Path(c, "nvvm", "libdevice").is_dir():
            (work / "nvvm").mkdir()
            (work / "nvvm" / "libdevice").symlink_to(Path(c, "nvvm", "libdevice"))
            break
    os.environ["PATH"] = f"{work / 'bin'}{os.pathsep}{os.environ['PATH']}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = [
        f"--xla_dump_to={work / 'dump'}",
        "--xla_dump_hlo_module_re=.*",
        "--xla_gpu_enable_libnvptxcompiler=false",
        f"--xla_gpu_cuda_data_dir={work}",
    ]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


# ------------------------------------------------------------------ cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One jitted function and its abstract arguments; ``family`` groups the rows."""

    name: str
    family: str
    build: object  # () -> (fn, args): called after jax is imported


def _cases() -> list[Case]:
    import dataclasses as dc

    import jax
    import jax.numpy as jnp
    from gpu_common import projection_kinds

    import jaxmoe
    from jaxmoe.dispatch import plan_dispatch
    from jaxmoe.execution import ExecConfig
    from jaxmoe.impls.pallas import experts_pallas, kernel_weight
    from jaxmoe.quant import GGUF_BLOCKS, QuantizedTensor
    from pallas_kernels import tuning
    from pallas_kernels.decode import decode_down, decode_gate_up
    from pallas_kernels.down import down_project
    from pallas_kernels.gmm import gmm
    from pallas_kernels.launch import DecodeLaunch, Launch, Plan
    from pallas_kernels.swiglu import gate_up_swiglu

    S = jax.ShapeDtypeStruct
    DT = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}

    def weight(e, n_in, n_out, kind, dt, gs):
        """Abstract logical ``[e, n_in, n_out]`` weight: an array or a QuantizedTensor."""
        if kind in ("int8", "q8_0"):
            return QuantizedTensor(
                S((e, n_out, n_in), jnp.int8), S((e, n_out, n_in // gs), jnp.float16), None, "int8", gs
            )
        if kind == "int4":
            sc = S((e, n_out, n_in // gs), jnp.float32)
            return QuantizedTensor(S((e, n_out, n_in // 2), jnp.uint8), sc, sc, "int4", gs)
        if kind in GGUF_BLOCKS:  # the file's block bytes, decoded in the kernels
            block, block_bytes = GGUF_BLOCKS[kind]
            return QuantizedTensor(S((e, n_out, n_in // block * block_bytes), jnp.uint8), None, None, kind, block)
        if kind == "fp8_e4m3":  # block-scaled FP8, 128 x 128 blocks (DeepSeek-V3), float32 scales
            sc = S((e, -(-n_out // 128), -(-n_in // 128)), jnp.float32)
            return QuantizedTensor(S((e, n_out, n_in), jnp.float8_e4m3fn), sc, None, "fp8_e4m3", 128)
        return S((e, n_in, n_out), dt)

    def experts(cfg, kind, dt, gs):
        e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
        bias = cfg.expert_bias
        kg, ku, kd = projection_kinds(kind)
        return jaxmoe.ExpertWeights(
            weight(e, d, f, kg, dt, gs),
            weight(e, d, f, ku, dt, gs),
            weight(e, f, d, kd, dt, gs),
            S((e, f), jnp.float32) if bias else None,
            S((e, f), jnp.float32) if bias else None,
            S((e, d), jnp.float32) if bias else None,
        )

    def routing(t, k):
        return jaxmoe.Routing(S((t, k), jnp.int32), S((t, k), jnp.float32))

    def layer(cfg, t, kind, dt, gs, config=None):
        f = functools.partial(experts_pallas, cfg=cfg, ex=ExecConfig(interpret=False, kernel_config=config))
        return f, (S((t, cfg.d_model), dt), routing(t, cfg.top_k), experts(cfg, kind, dt, gs))

    def small_cfg(preset, d, f, e, k, **kw):
        c = jaxmoe.load_config(preset)
        return dc.replace(c, d_model=d, expert_dim=f, router=dc.replace(c.router, num_experts=e, top_k=k), **kw)

    cases: list[Case] = []
    add = lambda name, fam, fn: cases.append(Case(name, fam, fn))

    # tests/test_pallas_lowering.py: every table entry, unfitted (capped for float32
    # activations as `tuning.choose` does), through the whole impl
    for key in sorted(tuning.TABLE):
        for kind in ("bf16", "int8", "int4"):
            dt = jnp.bfloat16 if kind == "bf16" else jnp.float32
            kc = tuning.for_dtype(tuning.TABLE[key], dt)
            t = 2 if kc.decode else 300
            add(
                f"table/{key[0]}-{key[1]}x{key[2]}/{kind}",
                "table",
                functools.partial(layer, small_cfg("qwen3-30b-a3b", 256, 384, 8, 2), t, kind, dt, 64, kc),
            )
        # GGUF Q4_K_M (widths multiples of the 256-element super-block), float32 activations
        kc = tuning.for_dtype(tuning.TABLE[key], jnp.float32)
        add(
            f"table/{key[0]}-{key[1]}x{key[2]}/q4_k_m",
            "table",
            functools.partial(
                layer, small_cfg("qwen3-30b-a3b", 256, 512, 8, 2), 2 if kc.decode else 300, "q4_k_m", jnp.float32, 0, kc
            ),
        )
    # tests/test_pallas_lowering.py: gpt-oss's activation with biases, weight on input
    for variant in ("oai_bias", "weight_on_input"):
        for t in (2, 40):
            kw = (
                dict(activation="swiglu_oai", expert_bias=True) if variant == "oai_bias" else dict(weight_on_input=True)
            )
            add(
                f"variant/{variant}/T{t}",
                "variant",
                functools.partial(layer, small_cfg("qwen3-30b-a3b", 128, 64, 8, 2, **kw), t, "bf16", jnp.bfloat16, 64),
            )

    # tests/test_pallas_lowering.py test_each_kernel_lowers (and tests/test_pallas_kernels.py's
    # kernel-level blocks): each kernel on its own, every weight kind and activation dtype
    def each_kernel(which, kind):
        d, f, e, t, k = 128, 64, 4, 20, 2
        if kind in GGUF_BLOCKS and GGUF_BLOCKS[kind][0] == 256:  # widths of whole super-blocks
            d, f = 256, 256
        dt = DT.get(kind, jnp.float32)
        w = [weight(e, d, f, kind, dt, 64), weight(e, d, f, kind, dt, 64), weight(e, f, d, kind, dt, 64)]

        def fn(x, h, lhs, ws, ids, wg, wu, wd):
            wg, wu, wd = (kernel_weight(a) for a in (wg, wu, wd))
            plan = plan_dispatch(ids, e, 16)
            kp = Plan(plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)
            grouped, dec = Launch(block_m=16, block_n=32, block_k=64), DecodeLaunch(block_n=32, block_k=64)
            if which == "gmm":
                return gmm(lhs, wg, kp, launch=grouped)
            if which == "gate_up_swiglu":
                return gate_up_swiglu(x, plan.token_idx, kp, wg, wu, launch=grouped)
            if which == "down_project":
                return down_project(h, kp, wd, row_scale=ws, launch=dataclasses.replace(grouped, block_n=64))
            if which == "decode_gate_up":
                return decode_gate_up(x, ids, wg, wu, launch=dec)
            return decode_down(h, ids, wd, row_scale=ws, launch=dec)

        args = (S((t, d), dt), S((t * k, f), dt), S((t * k, d), dt), S((t * k,), jnp.float32), S((t, k), jnp.int32))
        return fn, (*args, *w)

    for kind in ("f32", "bf16", "f16", "int8", "int4", *GGUF_BLOCKS, "fp8_e4m3"):
        for which in ("gmm", "gate_up_swiglu", "down_project", "decode_gate_up", "decode_down"):
            add(f"kernel/{which}/{kind}", "kernel", functools.partial(each_kernel, which, kind))

    # benchmarks/gpu_bench.py check(): 3 presets x 3 weight kinds x T {1, 5, 300}, d 512, F 256, E 16
    for preset in ("qwen3.6-35b-a3b", "gpt-oss-20b", "mixtral-8x7b"):
        c = jaxmoe.load_config(preset)
        c = dc.replace(
            c,
            d_model=512,
            expert_dim=256,
            shared_expert_dim=0,
            num_shared_experts=0,
            shared_expert_gate=False,
            router=dc.replace(c.router, num_experts=16, top_k=min(c.top_k, 4)),
        )
        for kind in ("bf16", "q8_0", "int4", "q4_k_m"):
            for t in (1, 5, 300):
                add(f"check/{preset}/{kind}/T{t}", "check", functools.partial(layer, c, t, kind, jnp.bfloat16, 32))

    # benchmarks/gpu_bench.py bench(): the real layers, T in {1, 16, 128, 2048, 16384}, bf16 and Q8_0
    for short, preset in (("qwen3.6", "qwen3.6-35b-a3b"), ("mixtral", "mixtral-8x7b")):
        c = jaxmoe.load_config(preset)
        for kind in ("bf16", "q8_0", "q4_k_m"):
            for t in (1, 16, 128, 2048, 16384):
                add(f"bench/{short}/{kind}/T{t}", "bench", functools.partial(layer, c, t, kind, jnp.bfloat16, 32))

    # DeepSeek-V3 in Q8_0: 256 x 2048 x 7168 = 3.76e9 int8 codes per projection (>= 2^31)
    # (bf16 weights of that size are over 2^32 bytes: Pallas uses 64-bit offsets, the control)
    # and in Q4_K_M (2.1e9 / 3.1e9 bytes of blocks: read as uint16 words, < 2^31 of them)
    # and in block-scaled FP8 as shipped (3.76e9 one-byte codes: int32 word loads)
    c = jaxmoe.load_config("deepseek-v3")
    for kind in ("q8_0", "bf16", "q4_k_m", "fp8_e4m3"):
        for t in (1, 2048):
            add(f"size/deepseek-v3/{kind}/T{t}", "size", functools.partial(layer, c, t, kind, jnp.bfloat16, 32))
    # gpt-oss-120b in MXFP4 as shipped: 128 experts x 2880 x 2880, 1530-byte rows, each expert's
    # 4.4e6 bytes one run of uint16 words (1.1e9 bytes per projection)
    c = jaxmoe.load_config("gpt-oss-20b")  # gpt-oss-120b's experts: the 20b's widths, 128 of them
    c = dc.replace(c, router=dc.replace(c.router, num_experts=128))
    for t in (1, 2048):
        add(f"size/gpt-oss-120b/mxfp4/T{t}", "size", functools.partial(layer, c, t, "mxfp4", jnp.bfloat16, 32))
    # Mixtral-8x7B with 4-bit experts (register pressure of the int4 dequant at the real widths)
    c = jaxmoe.load_config("mixtral-8x7b")
    for t in (1, 2048):
        add(f"size/mixtral-8x7b/int4/T{t}", "size", functools.partial(layer, c, t, "int4", jnp.bfloat16, 32))

    # tests/test_pallas_backward.py: the reverse mode (issue 13), the layer's gradient with the
    # backward kernels (pallas_kernels/backward.py). Float experts: input, routing-weight,
    # weight and bias gradients; quantized experts are frozen (input and routing weights only).
    # Family "kernel" so that --ci keeps them all.
    def backward(cfg, t, kind, dt, gs):
        def fn(x, ids, w, ew):
            def loss(x, w, ew):
                return jnp.sum(experts_pallas(x, jaxmoe.Routing(ids, w), ew, cfg, ExecConfig(interpret=False)))

            if kind in DT:
                return jax.grad(loss, argnums=(0, 1, 2))(x, w, ew)
            return jax.grad(lambda x, w: loss(x, w, ew), argnums=(0, 1))(x, w)

        k = cfg.top_k
        return fn, (S((t, cfg.d_model), dt), S((t, k), jnp.int32), S((t, k), jnp.float32), experts(cfg, kind, dt, gs))

    for variant, kw in (
        ("oai_bias", dict(activation="swiglu_oai", expert_bias=True)),
        ("weight_on_input", dict(weight_on_input=True)),
    ):
        for t in (2, 40):
            c = small_cfg("qwen3-30b-a3b", 128, 64, 8, 2, **kw)
            add(f"backward/{variant}/bf16/T{t}", "kernel", functools.partial(backward, c, t, "bf16", jnp.bfloat16, 64))
    for kind in ("f32", "q8_0", "int4", "q4_k_m", "mxfp4", "fp8_e4m3"):
        c = small_cfg("qwen3-30b-a3b", *((256, 256) if kind == "q4_k_m" else (128, 64)), 8, 2)
        add(
            f"backward/plain/{kind}/T40",
            "kernel",
            functools.partial(backward, c, 40, kind, DT.get(kind, jnp.bfloat16), 64),
        )
    for short, preset in (("qwen3.6", "qwen3.6-35b-a3b"), ("mixtral", "mixtral-8x7b")):
        c = jaxmoe.load_config(preset)
        for kind in ("bf16", "q8_0"):
            add(
                f"backward/{short}/{kind}/T2048", "kernel", functools.partial(backward, c, 2048, kind, jnp.bfloat16, 32)
            )
    return cases


def ci_subset(cases: list[Case]) -> list[Case]:
    """Every kernel x weight kind x activation dtype once (family ``kernel``), every table
    entry with every weight kind (the quantized ones with float32 activations: the
    float32 tile caps), both variants at both paths, the gpu_bench check at one preset per weight kind, the real Qwen3.6 /
    Mixtral layers at T = 1 and 2048 in bf16 and Q8_0, and the DeepSeek-V3 size cases."""
    keep = []
    for c in cases:
        parts = c.name.split("/")
        if c.family in ("kernel", "variant", "size", "table"):
            keep.append(c)
        elif c.family == "check":
            if (parts[1], parts[2]) in {
                ("qwen3.6-35b-a3b", "bf16"),
                ("gpt-oss-20b", "q8_0"),
                ("mixtral-8x7b", "int4"),
                ("qwen3.6-35b-a3b", "q4_k_m"),
            }:
                keep.append(c)
        elif c.family == "bench" and parts[3] in ("T1", "T2048"):
            keep.append(c)
    return keep


# ------------------------------------------------------------------ reading what XLA produced

_THUNK = re.compile(
    r"kCustomKernel .*?\s(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes"
)
_ENTRY = re.compile(r"\.entry\s+([\w$.]+)\s*\(")
_PTXAS_FN = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def read_thunks(dump: Path) -> list[dict]:
    rows = []
    for f in sorted(dump.glob("*thunk_sequence.txt")):
        for m in _THUNK.finditer(f.read_text()):
            g = tuple(int(v) for v in m.group(2, 3, 4))
            th = tuple(int(v) for v in m.group(5, 6, 7))
            rows.append(dict(name=m.group(1), grid=g, threads=th[0] * th[1] * th[2], smem=int(m.group(8))))
    return rows


def read_ptxas(log: Path) -> dict[str, dict]:
    """Kernel name -> registers, spills and the PTX features of its entry."""
    out: dict[str, dict] = {}
    for err in sorted(log.glob("*.err")):
        ptx_file = err.with_suffix(".ptx")
        ptx = ptx_file.read_text(errors="replace") if ptx_file.exists() else ""
        entries = _ENTRY.findall(ptx)
        cur = None
        for line in err.read_text(errors="replace").splitlines():
            if m := _PTXAS_FN.search(line):
                cur = m.group(1)
                out[cur] = dict(regs=None, spill_st=0, spill_ld=0, stack=0)
                if len(entries) <= 1 or cur in entries:
                    out[cur].update(ptx_features(ptx))
            elif cur and (m := _PTXAS_SPILL.search(line)):
                out[cur].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
            elif cur and (m := _PTXAS_REGS.search(line)):
                out[cur]["regs"] = int(m.group(1))
    return out


def ptx_features(ptx: str) -> dict:
    if "wgmma.mma_async" in ptx:
        mma = "wgmma"
    elif re.search(r"\bmma\.sync\b", ptx):
        mma = "mma.sync"
    else:
        mma = "FMA"
    if "cp.async.bulk.tensor" in ptx:
        loads = "TMA"
    elif re.search(r"\bcp\.async\.c[ag]\b", ptx):
        loads = "cp.async"
    else:
        loads = "no"
    return dict(mma=mma, pipelined=loads)


_SSA = re.compile(r"^\s*(%[\w#:]+)\s*=\s*([\w.]+)\s+(.*)$")
_OPND = re.compile(r"%[\w#]+")


def offsets_32bit(ttir: str, numels: list[int]) -> list[str]:
    """Operands of >= 2^31 elements that a load / store reaches with no 64-bit offset added.

    ``numels[i]`` is the element count of the kernel's i-th pointer argument (``%argi``);
    every value derived from an argument pointer (splat, broadcast, expand_dims, addptr,
    select, ...) keeps its root and whether an ``i64`` offset was added on the way."""
    root: dict[str, tuple[int, bool]] = {f"%arg{i}": (i, False) for i in range(len(numels))}
    bad: set[int] = set()
    for line in ttir.splitlines():
        s = line.strip()
        m = _SSA.match(s)
        opnds = _OPND.findall(s.split("=", 1)[1] if m else s)
        srcs = [root[o] for o in opnds if o in root]
        if m and "!tt.ptr" in s and srcs:
            r, op = m.group(1).split(":")[0], m.group(2)
            has64 = any(h for _, h in srcs)
            if op == "tt.addptr":
                types = s.rsplit(":", 1)[1]
                off_t = types.split(",")[-1].strip()
                has64 = has64 or bool(re.search(r"(^|x)i64>?$", off_t))
            root[r] = (srcs[0][0], has64)
        if re.match(r"^(%[\w#:]+\s*=\s*)?tt\.(load|store|atomic_\w+)\b", s) and srcs:
            i, has64 = srcs[0]
            if numels[i] >= BIG and not has64:
                bad.add(i)
    return [f"arg{i} ({numels[i]:.3g} elements)" for i in sorted(bad)]


def triton_calls(lowered) -> list[dict]:
    """The Triton custom calls of a lowered module: name, launch params, TTIR offset check."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context

    def numel(t):
        shape = ir.RankedTensorType(t).shape
        n = 1
        for v in shape:
            n *= v
        return n

    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    oo = o.operation
                    if oo.name == "stablehlo.custom_call" and "triton" in str(oo.attributes["call_target_name"]):
                        bc = oo.attributes["mhlo.backend_config"]
                        with _new_ir_context():
                            ttir = str(ir.Module.parse(ir.StringAttr(bc["ir"]).value_bytes))
                        numels = [numel(v.type) for v in oo.operands] + [numel(v.type) for v in oo.results]
                        calls.append(
                            dict(
                                name=ir.StringAttr(bc["name"]).value,
                                warps=ir.IntegerAttr(bc["num_warps"]).value,
                                stages=ir.IntegerAttr(bc["num_stages"]).value,
                                i32_big=offsets_32bit(ttir, numels),
                                big=[f"arg{i}" for i, n in enumerate(numels) if n >= BIG],
                            )
                        )
                    walk(oo)

    walk(lowered.compiler_ir("stablehlo").operation)
    return calls


# ------------------------------------------------------------------ running


def known(name: str) -> str | None:
    for pat, why in KNOWN_FAILURES.items():
        if re.search(pat, name):
            return why
    return None


def run_case(case: Case, target: str, mesh, work: Path) -> list[dict]:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    dump, log = work / "dump", work / "log"
    for d in (dump, log):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    sh = NamedSharding(mesh, PartitionSpec())
    base = dict(target=target, case=case.name, family=case.family)
    t0 = time.perf_counter()
    try:
        fn, args = case.build()
        args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), args)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            lowered = jax.jit(fn).trace(*args).lower()
        calls = triton_calls(lowered)
        lowered.compile()
    except Exception as e:  # noqa: BLE001 - every failure is a row
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        if os.environ.get("JAXMOE_COMPILE_CHECK_TRACEBACK"):
            traceback.print_exc()
        return [dict(base, kernel="-", errors=[f"compile error: {msg}"], seconds=time.perf_counter() - t0)]
    secs = time.perf_counter() - t0
    thunks = read_thunks(dump)
    ptxas = read_ptxas(log)
    rows = []
    if not calls:
        return [dict(base, kernel="-", errors=["no Triton kernel in the lowered program"], seconds=secs)]
    seen: dict[str, int] = {}
    for c in calls:
        # XLA names the n-th kernel of a repeated name ``name__n`` (thunks, PTX entries)
        n = seen[c["name"]] = seen.get(c["name"], -1) + 1
        name = c["name"] if n == 0 else f"{c['name']}__{n}"
        thunk = dict(next((t for t in thunks if t["name"] == name), {}))
        thunk.pop("name", None)
        px = ptxas.get(name, {})
        r = dict(base, kernel=name, warps=c["warps"], stages=c["stages"], seconds=secs, **thunk, **px)
        r["i32_big"] = c["i32_big"]
        errs = []
        if not px:
            errs.append("no ptxas report for this kernel")
        if px.get("spill_st") or px.get("spill_ld"):
            errs.append(f"spills {px['spill_st']} B stores / {px['spill_ld']} B loads at {px.get('regs')} registers")
        if thunk.get("smem", 0) > SMEM_LIMIT:
            errs.append(f"shared memory {thunk['smem']} B > {SMEM_LIMIT} B per block")
        if c["i32_big"]:
            errs.append("32-bit offsets into " + ", ".join(c["i32_big"]))
        r["errors"] = errs
        rows.append(r)
    return rows


def fmt_table(rows: list[dict]) -> str:
    head = "| target | case | kernel | grid | thr | st | smem KB | regs | spill B | MMA | pipelined loads | status |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        g = r.get("grid")
        grid = "x".join(map(str, g)) if g else "-"
        spill = f"{r['spill_st']}/{r['spill_ld']}" if "spill_st" in r else "-"
        smem = f"{r['smem'] / 1024:.1f}" if "smem" in r else "-"
        out.append(
            f"| {r['target']} | {r['case']} | {r['kernel']} | {grid} | {r.get('threads', '-')} | {r.get('stages', '-')} "
            f"| {smem} | {r.get('regs', '-')} | {spill} | {r.get('mma', '-')} | {r.get('pipelined', '-')} "
            f"| {status(r)} |"
        )
    return "\n".join(out)


def status(r: dict) -> str:
    if not r["errors"]:
        return "ok" if not r.get("known") else f"ok (listed as known: {r['known']}; remove it)"
    msg = "; ".join(r["errors"])
    return f"KNOWN: {r['known']} ({msg})" if r.get("known") else f"FAIL: {msg}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="every kernel / kind / dtype path once (ci_subset)")
    ap.add_argument(
        "--targets", default=None, help="comma list of " + ",".join(TARGETS) + " (default: all; --ci: h200)"
    )
    ap.add_argument("--only", default=None, help="regex on case names")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    a = ap.parse_args(argv)
    targets = (a.targets or ("h200" if a.ci else ",".join(TARGETS))).split(",")
    for t in targets:
        if t not in TARGETS:
            ap.error(f"--targets: unknown {t!r}; expected some of {sorted(TARGETS)}")

    with tempfile.TemporaryDirectory(prefix="jaxmoe-gpucc-", delete=not os.environ.get("JAXMOE_KEEP")) as tmp:
        work = Path(tmp)
        _setup_env(work)
        import jax
        from jax.experimental import topologies

        cases = _cases()
        if a.ci:
            cases = ci_subset(cases)
        if a.only:
            cases = [c for c in cases if re.search(a.only, c.name)]
        if a.list:
            print("\n".join(c.name for c in cases))
            return 0
        print(f"jax {jax.__version__}, {len(cases)} cases x {targets}", file=sys.stderr, flush=True)
        rows: list[dict] = []
        t_all = time.perf_counter()
        for target in targets:
            topo = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target], topology="1x1x1")
            mesh = topologies.make_mesh(topo, (1,), ("x",))
            for case in cases:
                with contextlib.redirect_stdout(sys.stderr):
                    rs = run_case(case, target, mesh, work)
                for r in rs:
                    r["known"] = known(f"{case.name}:{r['kernel']}")
                    print(
                        f"{target} {case.name:45s} {r['kernel']:16s} {r.get('seconds', 0):5.1f}s {status(r)}",
                        file=sys.stderr,
                        flush=True,
                    )
                rows += rs
        table = fmt_table(rows)
        print(table)
        fails = [r for r in rows if r["errors"] and not r["known"]]
        knowns = [r for r in rows if r["errors"] and r["known"]]
        summary = (
            f"\n{len(cases)} cases x {len(targets)} targets, {len(rows)} kernel rows in {time.perf_counter() - t_all:.0f} s "
            f"(jax {jax.__version__}): {len(fails)} failing, {len(knowns)} known failures"
        )
        print(summary)
        if a.out:
            Path(a.out).write_text(table + "\n" + summary + "\n")
        for r in fails:
            print(f"FAIL {r['target']} {r['case']} {r['kernel']}: {'; '.join(r['errors'])}", file=sys.stderr)
        return 1 if fails else 0


if __name__ == "__main__":
    from compile_venv import SetupError, reexec_in_venv

    try:
        reexec_in_venv(__file__)  # returns when already running in the venv
    except SetupError as e:
        sys.exit(f"gpu_compile_check: {e}")
    sys.exit(main())
