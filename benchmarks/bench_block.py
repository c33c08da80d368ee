"""Side-by-side CPU timing of one full Qwen3.6-35B-A3B MoE layer (router + 256 routed
experts top-8 + sigmoid-gated shared expert, d 2048, width 512, float32).

Times jaxmoe ``auto``, ``cpu``, ``xla``, ``gather``, ``ragged_dot``, ``dense`` and the Hugging Face
``Qwen3_5MoeSparseMoeBlock`` (torch CPU, 2 threads) on the same random weights (outputs
are checked to agree before timing), and prints ms per implementation, ratios against
HF and against ``xla``, and two floors measured on this machine:

- memory floor: bytes of the weights the layer must read (distinct experts the routing
  touched, the shared expert and the router) / stream bandwidth of a large array copy
  (read + write bytes, so the strictest floor); "read floor": the same bytes / the rate
  of a read-only stream (one numpy sum per core over 1 GiB), which on this VM is about
  half the copy figure (each core's reads are bound by its outstanding misses);
- arithmetic floor: the layer's FLOPs / the rate of a plain [2048,2048]@[2048,2048] dot.

Cold by default: every timed call gets new tokens (a fresh input, so a fresh routing
and other selected experts, read from DRAM as in real decode); ``--hot`` repeats one
input for every call (the selected experts stay in cache: up to 2x faster, not a
decode number). Within a repeat every implementation runs once, in a rotating order
(round robin), so load from other processes hits them alike. The table shows the best
of ``--repeats`` runs (the machine is shared); the log lines give medians too. The
GB/s columns divide the bytes of the experts each call actually selected (distinct
ids, in their stored format) plus the shared expert and router by the call's time.

``--dtype`` picks the experts' format, routed and shared (as in a GGUF file and in
``ggml_moe_layer``; ``--shared-f32`` keeps the shared expert float32), a comma list runs
each in turn: ``f32``,
``bf16``, ``q8_0`` (int8 codes, float16 scale per 32), ``q4_0_int4`` (Q4_0 held as int4,
float16 scale and bias per 32, as GGUF Q4_0 loaded before it was a block kind), ``mlx4_g64``
(MLX affine 4-bit, group 64), the GGUF block kinds ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q2_k``, ``q3_k``, ``q4_k``, ``q5_k``, ``q6_k``,
``iq4_xs``, ``iq4_nl``, ``mxfp4``, ``iq2_xxs``, ``iq2_xs``, ``iq2_s``, ``iq3_xxs``, ``iq3_s``,
``iq1_s``, ``iq1_m``, ``tq2_0`` (the file's block bytes; ggml times none of ``iq2_xxs``,
``iq2_xs``, ``iq1_s``, ``iq1_m``, which it quantizes only with an importance matrix) and
``q4_k_m`` (gate/up q4_k, down q6_k, as in a Q4_K_M file); quantized experts hold
random codes (speed does not depend on the values; the outputs are still checked against
``xla``). ``--ggml BIN`` also runs llama.cpp's MoE layer graph (``ggml_moe_layer`` from
``/work/shared/anchors``, built by its ``build_ggml_moe_layer.sh``) on the same layer
shape, type (``mlx4_g64`` against ``q4_0``), T, thread count and cold/hot mode in the
same run, and prints ggml ms / jaxmoe ms per type (> 1: jaxmoe faster), best against best
and median against median. ``--rounds R`` times each cell R times, jaxmoe's repeats and a
ggml process taking turns (new tokens every call throughout): on a VM whose speed drifts
over minutes one round can catch either side in a slow spell; the table then gives
jaxmoe's best and median over all its calls and ggml's best and the median of its runs'
medians. ``--warmup W`` makes W untimed calls of each implementation (new tokens too)
before each round's timed ones: on a VM whose second vCPU has idled (as while a ggml
process ran), the first calls find the intra-op pool's thread slow to wake and run about
as fast as one thread, for about ten calls at T = 1 (docs/log/2026-12-07-pool-wake.md); a
model's decode calls its layers back to back, as ggml times its repeats after one warm-up
graph run. ``--dispatch sync`` sets ``jax_cpu_enable_async_dispatch`` off (the layer
runs on the calling thread instead of a runtime thread the caller waits for; ggml's time is
its graph compute alone). ``--scan L`` makes each timed call one jitted `jax.lax.scan` of the
layer over L inputs (new tokens each, so new experts), as a model's jitted decode step runs
its layers, and divides its time by L: jax's per-call dispatch (flattening the parameters,
launching the executable, waiting for it) is paid once per L layers, as ggml builds its graph
once and times its compute. A single jitted layer per call (the default) adds that dispatch
to every layer: about 0.1-0.2 ms at T = 1 on the 2-core VM (docs/log/2026-12-07-dispatch-per-layer.md).

    python benchmarks/bench_block.py                      # full layer, ~3.2 GB of f32 weights (+3.2 GB for HF)
    python benchmarks/bench_block.py --tokens 1,8 --impls xla,gather,hf
    python benchmarks/bench_block.py --quick              # 32 experts, T in {1, 8, 64}: a smoke run
    python benchmarks/bench_block.py --dtype f32,bf16,q8_0,q4_0,mlx4_g64 --tokens 1,8,64,256 \
        --impls auto --ggml $BIN                          # the ggml comparison table
    XLA_FLAGS=--xla_cpu_use_onednn=true python benchmarks/bench_block.py --impls xla
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxmoe
from jaxmoe.evaluation.hf_block import qwen35_moe_block
from jaxmoe.evaluation.schema import exec_of_label

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import gguf_random_weight, projection_kinds  # noqa: E402  (shared with the GPU check)

#: The impls ``--impls`` takes (besides ``hf``). Each entry is an `ExecConfig.label`: the impl
#: name, then any ``field=value`` (``cpu,activations=int8``: int8 / int4 experts multiply
#: activations quantized to int8 per 32, as ggml does; its error is that of Q8(x);
#: ``cpu,activations=ggml`` / ``xla,activations=ggml``: llama.cpp's activation arithmetic).
JAX_IMPLS = ("auto", "cpu", "xla", "gather", "ragged_dot", "dense")


def parse_labels(text: str) -> list[str]:
    """``--impls``: comma-separated `ExecConfig.label`s, a ``field=value`` token belonging to
    the label before it (``hf,cpu,cpu,activations=int8`` -> ``hf``, ``cpu``,
    ``cpu,activations=int8``)."""
    labels: list[str] = []
    for tok in (t.strip() for t in text.split(",")):
        if "=" in tok and labels:
            labels[-1] += "," + tok
        elif tok:
            labels.append(tok)
    return labels


#: GGUF block kinds kept as the file's block bytes (``q4_k_m``: gate/up q4_k, down q6_k, as a
#: Q4_K_M file stores the experts).
BLOCK_DTYPES = (
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "iq4_xs",
    "iq4_nl",
    "mxfp4",
    "iq2_xxs",
    "iq2_xs",
    "iq2_s",
    "iq3_xxs",
    "iq3_s",
    "iq1_s",
    "iq1_m",
    "tq2_0",
    "q4_k_m",
)
DTYPES = ("f32", "bf16", "q8_0", "q4_0_int4", "mlx4_g64", *BLOCK_DTYPES)
#: The ggml type each expert format is compared with (ggml_moe_layer takes one type for all
#: three matrices: q4_k_m is compared with q4_K, whose down projection reads fewer bytes).
GGML_TYPE = {
    "f32": "f32",
    "bf16": "bf16",
    "q8_0": "q8_0",
    "q4_0": "q4_0",
    "q4_0_int4": "q4_0",
    "mlx4_g64": "q4_0",
    "q4_1": "q4_1",
    "q5_0": "q5_0",
    "q5_1": "q5_1",
    "q2_k": "q2_K",
    "q3_k": "q3_K",
    "q4_k": "q4_K",
    "q5_k": "q5_K",
    "iq4_xs": "iq4_xs",
    "iq4_nl": "iq4_nl",
    "mxfp4": "mxfp4",
    "q6_k": "q6_K",
    "q4_k_m": "q4_K",
    # (iq2_xxs, iq2_xs, iq1_s, iq1_m: ggml quantizes them only with an importance matrix,
    # which ggml_moe_layer's random weights have not: no ggml column)
    "iq2_s": "iq2_s",
    "iq3_xxs": "iq3_xxs",
    "iq3_s": "iq3_s",
    "tq2_0": "tq2_0",
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64,256,1024", help="comma-separated token counts T")
    ap.add_argument(
        "--impls",
        default="hf,auto,cpu,xla,gather,ragged_dot,dense",
        help="comma-separated: hf and any of " + ",".join(JAX_IMPLS) + ", each with field=value "
        "options of ExecConfig (cpu,activations=int8)",
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cell (best is shown)")
    ap.add_argument("--quick", action="store_true", help="32 experts, T in {1, 8, 64}, 2 repeats")
    ap.add_argument("--experts", type=int, default=None, help="override the number of experts")
    ap.add_argument(
        "--ragged-max-tokens",
        type=int,
        default=256,
        help="skip ragged_dot above this T (39 s at T=256 on a 2-core CPU)",
    )
    ap.add_argument("--gather-max-tokens", type=int, default=64, help="skip gather above this T")
    ap.add_argument("--dense-max-bytes", type=float, default=2e9, help="skip dense if its [T,E,*] buffers exceed this")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the HF block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="f32", help="comma-separated expert formats: " + ",".join(DTYPES))
    ap.add_argument("--hot", action="store_true", help="repeat one input for every call (experts stay cached)")
    ap.add_argument("--ggml", default=None, metavar="BIN", help="ggml_moe_layer binary to time in the same run")
    ap.add_argument(
        "--rounds", type=int, default=1, help="time each cell this many times, jaxmoe and ggml taking turns"
    )
    ap.add_argument(
        "--warmup", type=int, default=0, help="untimed calls of each impl (new tokens) before each round's timed ones"
    )
    ap.add_argument(
        "--dispatch",
        choices=("async", "sync"),
        default="async",
        help="jax's CPU dispatch: async (jax's default: the call runs on a runtime thread and the caller "
        "waits for it) or sync (jax_cpu_enable_async_dispatch off: the call runs on the calling thread)",
    )
    ap.add_argument(
        "--scan",
        type=int,
        default=1,
        metavar="L",
        help="each timed call runs the layer on L inputs in turn inside one jitted lax.scan (new tokens "
        "each), as a model's jitted decode step runs its layers: one dispatch per L layers; times per layer",
    )
    ap.add_argument(
        "--shared-f32",
        action="store_true",
        help="keep the shared expert float32 (default: in --dtype, as in a GGUF file and in ggml_moe_layer)",
    )
    a = ap.parse_args(argv)
    if a.quick:
        a.experts = a.experts or 32
        a.tokens = "1,8,64" if a.tokens == ap.get_default("tokens") else a.tokens
        a.repeats = min(a.repeats, 2)
    a.tokens = [int(t) for t in a.tokens.split(",")]
    a.impls = parse_labels(a.impls)
    bad = [i for i in a.impls if i != "hf" and i.split(",")[0] not in JAX_IMPLS]
    if bad:
        ap.error(f"--impls: unknown {bad}; choose from hf,{','.join(JAX_IMPLS)}")
    try:
        a.execs = {i: exec_of_label(i) for i in a.impls if i != "hf"}
    except ValueError as e:
        ap.error(f"--impls: {e}")
    if a.scan < 1 or (a.scan > 1 and "hf" in a.impls):
        ap.error("--scan: a positive count, and only with jaxmoe impls (not hf)")
    a.dtype = [t.strip() for t in a.dtype.split(",") if t.strip()]
    bad = [t for t in a.dtype if t not in DTYPES]
    if bad:
        ap.error(f"--dtype: unknown {bad}; choose from {','.join(DTYPES)}")
    return a


def expert_weights(p: jaxmoe.MoEParams, fmt: str, key, shared: bool = True) -> jaxmoe.MoEParams:
    """``p`` with its routed experts, and with ``shared`` its shared expert too (as in a
    GGUF file's ``ffn_*_shexp`` tensors and in ``ggml_moe_layer``), in ``fmt`` (quantized
    ones hold random codes)."""
    from jaxmoe.quant import QuantizedTensor

    if fmt == "f32":
        return p

    def conv(w, k, which):
        e, i, o = w.shape
        if fmt == "bf16":
            return w.astype(jnp.bfloat16)
        if fmt in BLOCK_DTYPES:
            return gguf_random_weight(projection_kinds(fmt)[which], e, i, o, seed=which)
        g = 64 if fmt == "mlx4_g64" else 32
        s = (jax.random.uniform(k, (e, o, i // g), jnp.float32, 0.5, 1.5) * 0.02 / math.sqrt(i)).astype(jnp.float16)
        if fmt == "q8_0":
            return QuantizedTensor(jax.random.randint(k, (e, o, i), -127, 128, jnp.int8), s, None, "int8", g)
        codes = jax.random.randint(k, (e, o, i // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        return QuantizedTensor(codes, s, (-8 * s.astype(jnp.float32)).astype(jnp.float16), "int4", g)

    ks = jax.random.split(key, 6)
    ew = p.experts
    ew = dataclasses.replace(
        ew, w_gate=conv(ew.w_gate, ks[0], 0), w_up=conv(ew.w_up, ks[1], 1), w_down=conv(ew.w_down, ks[2], 2)
    )
    sw = p.shared
    if shared and sw is not None:  # 2-D: convert as one expert, then drop the expert axis
        one = lambda w, k, which: jax.tree.map(lambda a: a[0], conv(w[None], k, which))  # noqa: E731
        sw = dataclasses.replace(
            sw, w_gate=one(sw.w_gate, ks[3], 0), w_up=one(sw.w_up, ks[4], 1), w_down=one(sw.w_down, ks[5], 2)
        )
    return dataclasses.replace(p, experts=ew, shared=sw)


def nbytes(w) -> int:
    return int(w.nbytes) if hasattr(w, "qdata") else int(w.size * w.dtype.itemsize)


def run_ggml(
    binary: str, cfg, ggml_type: str, t: int, threads: int, reps: int, hot: bool
) -> tuple[float, float] | None:
    """(best, median) ms of ``ggml_moe_layer`` on this layer shape, or None (printed why)."""
    import re
    import subprocess

    cmd = [binary, *map(str, (cfg.d_model, cfg.expert_dim, cfg.num_experts, cfg.top_k, t)), ggml_type]
    cmd += [str(threads), str(reps), "hot" if hot else "cold"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"ggml: {' '.join(cmd)} failed: {e}", flush=True)
        return None
    m = re.search(r"median_ms=([0-9.]+) min_ms=([0-9.]+)", r.stdout)
    if r.returncode or not m:
        print(f"ggml: {' '.join(cmd)} exited {r.returncode}: {(r.stdout + r.stderr)[-400:]}", flush=True)
        return None
    print(f"ggml: {r.stdout.strip().splitlines()[-1]}", flush=True)
    return float(m.group(2)), float(m.group(1))


def best_ms(fn, inputs, repeats):
    """Best and median wall time (ms) of ``fn(x)`` over fresh inputs; the first input warms up."""
    jax.block_until_ready(fn(inputs[0]))
    ts = []
    for x in inputs[1 : repeats + 1]:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        ts.append((time.perf_counter() - t0) * 1e3)
    return min(ts), float(np.median(ts))


def copy_bandwidth(nbytes=1 << 30, repeats=5) -> float:
    """Stream bandwidth (bytes/s): read + write of a large float32 array copy.

    The buffer is donated and fed back, so no call pays first-touch page faults on a
    freshly allocated output (which would measure the kernel, not the memory)."""
    f = jax.jit(lambda v: v * 1.0001, donate_argnums=0)
    a = f(jnp.arange(nbytes // 4, dtype=jnp.float32))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = jax.block_until_ready(f(a))
        ts.append(time.perf_counter() - t0)
    del a
    return 2 * nbytes / min(ts)


def read_bandwidth(nbytes=1 << 30, repeats=5) -> float:
    """Read-only stream bandwidth (bytes/s): one thread per core sums its own slice of a
    large float32 array (numpy releases the GIL in the reduction)."""
    from concurrent.futures import ThreadPoolExecutor

    n = os.cpu_count() or 1
    parts = np.array_split(np.arange(nbytes // 4, dtype=np.float32), n)
    best = math.inf
    with ThreadPoolExecutor(n) as ex:
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            list(ex.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return nbytes / best


def matmul_rate(n=2048, repeats=5) -> float:
    """FLOP/s of a plain ``[n, n] @ [n, n]`` float32 dot."""
    a = jax.random.normal(jax.random.key(0), (n, n))
    b = jax.random.normal(jax.random.key(1), (n, n))
    f = jax.jit(jnp.dot)
    ms, _ = best_ms(lambda _: f(a, b), [None] * (repeats + 1), repeats)
    return 2 * n**3 / (ms * 1e-3)


def make_hf_block(p: jaxmoe.MoEParams, cfg: jaxmoe.MoEConfig, threads: int):
    """``run(x [T, d]) -> [T, d]``: the HF ``Qwen3_5MoeSparseMoeBlock`` holding ``p`` (no grad)."""
    import torch

    blk = qwen35_moe_block(p, cfg, threads).eval()

    def run(x):
        with torch.no_grad():
            return blk(torch.from_numpy(np.asarray(x))[None])[0].numpy()

    return run


def main(argv=None) -> int:
    a = parse_args(argv)
    # read when jax creates its CPU client: before the first computation
    jax.config.update("jax_cpu_enable_async_dispatch", a.dispatch == "async")
    cfg = jaxmoe.load_config("qwen3.6-35b-a3b")
    if a.experts:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, num_experts=a.experts))
    d, e, k, f, fs = cfg.d_model, cfg.num_experts, cfg.top_k, cfg.expert_dim, cfg.shared_expert_dim
    mode = "hot (one input repeated)" if a.hot else "cold (new tokens every call)"
    if a.scan > 1:
        mode += f", {a.scan} layers per jitted call (lax.scan), times per layer"
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; layer d={d} E={e} k={k} F={f} Fs={fs}; {mode}, {a.dispatch} dispatch"
    )
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start")
    bw = copy_bandwidth()
    rbw = read_bandwidth()
    rate = matmul_rate()
    print(
        f"measured: copy bandwidth {bw / 1e9:.1f} GB/s, read stream {rbw / 1e9:.1f} GB/s, "
        f"matmul {rate / 1e9:.0f} GFLOP/s"
    )
    p32 = jaxmoe.init_params(cfg, jax.random.key(a.seed))
    jax.block_until_ready(p32)
    status = 0
    for fmt in a.dtype:
        p = expert_weights(p32, fmt, jax.random.key(a.seed + 1), shared=not a.shared_f32)
        impls = [i for i in a.impls if fmt == "f32" or i not in ("hf", "dense", "ragged_dot")]
        print(f"\n=== experts {fmt}: impls {','.join(impls)}", flush=True)
        rows = run_format(a, cfg, p, impls, bw, rbw, rate, fmt)
        if rows is None:
            status = 1
            continue
        print_table(rows, impls, fmt)
        del p
        gc.collect()
    return status


def run_format(a, cfg, p, impls, bw, rbw, rate, fmt):
    d, e, k, f, fs = cfg.d_model, cfg.num_experts, cfg.top_k, cfg.expert_dim, cfg.shared_expert_dim
    ew = p.experts
    expert_bytes = sum(nbytes(w) for w in (ew.w_gate, ew.w_up, ew.w_down)) / e
    sw = p.shared
    shared_bytes = sum(nbytes(w) for w in (sw.w_gate, sw.w_up, sw.w_down)) if sw is not None else 0
    fixed_bytes = shared_bytes + d * e * 4  # shared expert (stored format) and router (float32)
    print(
        f"weights: {e * expert_bytes / 1e9:.2f} GB routed experts; {k} experts = {k * expert_bytes / 1e6:.1f} MB "
        f"-> read floor of one token's experts {k * expert_bytes / rbw * 1e3:.2f} ms"
    )
    hf_run = make_hf_block(p, cfg, a.threads) if "hf" in impls else None
    jitted = {i: jax.jit(lambda p, x, ex=a.execs[i]: jaxmoe.moe_apply(p, x, cfg, ex)) for i in impls if i != "hf"}
    route = jax.jit(lambda p, x: jaxmoe.layer.compute_routing(p, x, cfg).expert_ids)
    scanned = {
        i: jax.jit(lambda p, xs, j=jitted[i]: jax.lax.scan(lambda c, x: (c, j(p, x)), 0, xs)[1])
        for i in jitted
        if a.scan > 1
    }

    rows = []
    for t in a.tokens:
        # cold: new tokens for every call, warm-up calls included
        n_inputs = 1 if a.hot else 1 + (a.repeats + a.warmup) * len(impls) * a.rounds
        shape = (t, d) if a.scan == 1 else (a.scan, t, d)  # --scan: L layers' inputs per call
        inputs = [jax.random.normal(jax.random.key(1000 * t + r), shape, jnp.float32) for r in range(n_inputs)]
        touched = [
            float(np.mean([len(np.unique(np.asarray(route(p, s)))) for s in x.reshape(-1, t, d)])) for x in inputs
        ]
        read = [n * expert_bytes + fixed_bytes for n in touched]  # per layer
        flops = 2 * t * (k * 3 * d * f + 3 * d * fs + d * e)
        mean_read = float(np.mean(read[1:] if len(read) > 1 else read))
        row = dict(
            T=t,
            mem_floor=mean_read / bw * 1e3,
            read_floor=mean_read / rbw * 1e3,
            arith_floor=flops / rate * 1e3,
            touched=float(np.mean(touched)),
        )
        first = inputs[0].reshape(-1, t, d)[0]  # the outputs are checked on one layer's input
        ref = np.asarray(jitted["xla"](p, first)) if "xla" in jitted else None
        fns = {}
        for impl in impls:
            note = None
            if impl == "ragged_dot" and t > a.ragged_max_tokens:
                note = f"skipped (T > {a.ragged_max_tokens}: masked dense over all experts, > 60 s)"
            elif impl == "gather" and t > a.gather_max_tokens:
                note = f"skipped (T > {a.gather_max_tokens}: one pair at a time)"
            elif impl == "dense" and t * e * (2 * f + d) * 4 * 2 > a.dense_max_bytes:
                note = f"skipped ([T,E,*] buffers over {a.dense_max_bytes / 1e9:.0f} GB)"
            if note:
                print(f"T={t:5d} {impl:10s} {note}", flush=True)
                continue
            fn = hf_run if impl == "hf" else (lambda x, j=jitted[impl]: j(p, x))  # noqa: E731
            out = np.asarray(fn(first))  # compiles; warms up
            if ref is not None:
                err = np.abs(out - ref).max() / (np.abs(ref).max() + 1e-30)
                # int8 / ggml activations: Q8(x)'s error (the reference has float activations)
                if not err < (5e-2 if a.execs[impl].activations in ("int8", "ggml") else 1e-3):
                    print(f"T={t} {impl}: output differs from xla (max rel err {err:.2e})", file=sys.stderr)
                    return None
            if a.scan > 1:
                fn = lambda x, j=scanned[impl]: j(p, x)  # noqa: E731
                jax.block_until_ready(fn(inputs[0]))  # compiles
            fns[impl] = fn
        # Round robin: every repeat times each impl once, in a rotating order: torch's
        # OpenMP threads keep spinning for a while after a call and slow whichever impl
        # runs next (measured: up to 1.9x at T=1), so no impl always follows HF. Cold:
        # every call takes the next unused input, so no impl reuses experts another just read.
        times = {impl: [] for impl in fns}
        gbps = {impl: [] for impl in fns}
        names = list(fns)
        nxt = 1
        ggml_runs = []
        for rnd in range(a.rounds):
            for impl in names:
                for _ in range(a.warmup if impl != "ragged_dot" or t < 64 else 0):
                    jax.block_until_ready(fns[impl](inputs[0 if a.hot else nxt]))
                    nxt += 0 if a.hot else 1
            for r in range(a.repeats):
                for impl in names[r % len(names) :] + names[: r % len(names)]:
                    if r >= (1 if impl == "ragged_dot" and t >= 64 else a.repeats) or (impl == "ragged_dot" and rnd):
                        continue
                    i = 0 if a.hot else nxt
                    nxt += 1
                    fn = fns[impl]
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(inputs[i]))
                    dt = (time.perf_counter() - t0) / a.scan  # per layer
                    times[impl].append(dt * 1e3)
                    gbps[impl].append(read[i] / dt / 1e9)
            if a.ggml and fmt in GGML_TYPE:
                g = run_ggml(a.ggml, cfg, GGML_TYPE[fmt], t, a.threads, max(a.repeats, 3), a.hot)
                if g is not None:
                    ggml_runs.append(g)
        for impl, ts in times.items():
            row[impl] = min(ts)
            row[impl + " median"] = float(np.median(ts))
            row[impl + " GB/s"] = float(np.median(gbps[impl]))
            print(
                f"T={t:5d} {impl:10s} best {min(ts):10.2f} ms  median {np.median(ts):10.2f} ms  "
                f"{np.median(gbps[impl]):6.1f} GB/s of selected weights  ({len(ts)} runs)",
                flush=True,
            )
        if ggml_runs:  # best against best, median against median (of its runs' medians)
            row["ggml"] = min(b for b, _ in ggml_runs)
            row["ggml median"] = float(np.median([m for _, m in ggml_runs]))
        rows.append(row)
        del inputs
        gc.collect()
    return rows


def print_table(rows, impls, fmt="f32"):
    cols = [i for i in impls if any(i in r for r in rows)]
    if any(r.get("ggml") for r in rows):
        cols.append("ggml")
    head = f"{'T':>5} " + "".join(f"{c:>11}" for c in cols) + f"{'mem floor':>11}{'read fl.':>11}{'arith fl.':>11}"
    print(f"\n[{fmt}] ms per layer call (best of the repeats; '-' = skipped)")
    print(head)
    for r in rows:
        cells = "".join(f"{r[c]:11.2f}" if r.get(c) is not None else f"{'-':>11}" for c in cols)
        print(f"{r['T']:5d} " + cells + f"{r['mem_floor']:11.2f}{r['read_floor']:11.2f}{r['arith_floor']:11.2f}")
    gb = [c for c in cols if any(c + " GB/s" in r for r in rows)]
    print(f"\n[{fmt}] GB/s of the selected experts' bytes (median)")
    print(f"{'T':>5} " + "".join(f"{c:>11}" for c in gb))
    for r in rows:
        print(f"{r['T']:5d} " + "".join(f"{r[c + ' GB/s']:11.1f}" if c + " GB/s" in r else f"{'-':>11}" for c in gb))
    if "ggml" in cols:
        for stat, sfx in (("best", ""), ("median", " median")):
            print(f"\n[{fmt}] ggml ms / jaxmoe ms, {stat} against {stat} (> 1: jaxmoe faster)")
            print(f"{'T':>5} " + "".join(f"{c:>11}" for c in cols if c not in ("ggml", "hf")))
            for r in rows:
                cells = [
                    f"{r['ggml' + sfx] / r[c + sfx]:11.2f}" if r.get("ggml") and c + sfx in r else f"{'-':>11}"
                    for c in cols
                    if c not in ("ggml", "hf")
                ]
                print(f"{r['T']:5d} " + "".join(cells))
    for base in ("hf", "xla"):
        if base not in cols:
            continue
        what = "HF ms / impl ms (>1: faster than HF)" if base == "hf" else "impl ms / xla ms (>1: slower than xla)"
        print(f"\n{what}")
        print(f"{'T':>5} " + "".join(f"{c:>11}" for c in cols if c not in (base, "ggml")))
        for r in rows:
            cells = []
            for c in cols:
                if c in (base, "ggml"):
                    continue
                if c in r and base in r:
                    cells.append(f"{(r[base] / r[c] if base == 'hf' else r[c] / r[base]):11.2f}")
                else:
                    cells.append(f"{'-':>11}")
            print(f"{r['T']:5d} " + "".join(cells))
    for c in ("cpu", "xla"):
        if c in cols:
            print(
                f"\n{c} / max(mem floor, arith floor): "
                + ", ".join(f"T={r['T']}: {r[c] / max(r['mem_floor'], r['arith_floor']):.2f}x" for r in rows if c in r)
            )
            print(
                f"{c} / max(read floor, arith floor): "
                + ", ".join(f"T={r['T']}: {r[c] / max(r['read_floor'], r['arith_floor']):.2f}x" for r in rows if c in r)
            )


if __name__ == "__main__":
    sys.exit(main())
