"""The C++ forward kernel of ``impl="cpu"`` at another git revision against the working
tree's, side by side in one process: how a kernel change is measured on a noisy machine.

The base revision's ``grouped_swiglu.cc`` and ``kernel_common.h`` are built into their own
library (the same cache and flags as `jaxmoe.impls.cpu.build`) and registered under
another FFI target; each case is compiled ahead of time once per library (the jit caches
cleared between, so nested jitted functions are traced again for the second target) and
the two are called alternately (order switching every repeat) with new tokens every call.
The base must take the same custom-call operands and attributes as the working tree.

``--what kernel``: the routed-expert custom call alone (`jaxmoe.impls.cpu.grouped_swiglu`,
all ``--experts`` experts of the Qwen3.6-35B-A3B shape, random routing); ``--what layer``:
the whole layer ``moe_apply(..., impl="auto")`` (router, routed and shared expert). Formats
as in bench_block.py (f32, bf16, q8_0, q4_0, mlx4_g64, the GGUF block kinds, q4_k_m).
Prints best / median ms of each and base / new (> 1: the working tree is faster), and
whether the two outputs of the first call are bitwise equal.

    python benchmarks/bench_kernel_ab.py --base 30a87dc --dtype bf16,q8_0 --tokens 1,8
    python benchmarks/bench_kernel_ab.py --base HEAD~1 --what layer --dtype q8_0 --tokens 1
    python benchmarks/bench_kernel_ab.py --base HEAD --int8 --dtype q4_k,q4_0 --tokens 1,8
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_block  # noqa: E402
from interleave import ab_cells, interleaved_ms  # noqa: E402

import jaxmoe  # noqa: E402
from jaxmoe.execution import ExecConfig  # noqa: E402
from jaxmoe.impls.cpu import build, kernel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASE_TARGET = "jaxmoe_grouped_swiglu_base"
#: The base's routed + shared handler (revisions from 4 Dec 2026 on), for ``--what layer``.
BASE_TARGET_SHARED = "jaxmoe_grouped_swiglu_shared_base"


def load_base(rev: str, tmp: Path) -> bool:
    """Builds the kernel sources of ``rev`` (its ``grouped_swiglu.cc`` and every header beside
    it: ``kernel_common.h``, ``int_dot.h``, ...) and registers them as `BASE_TARGET` (and its
    routed + shared handler as `BASE_TARGET_SHARED`; returns whether it has one)."""
    ls = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:jaxmoe/impls/cpu/"], capture_output=True, text=True
    )
    if ls.returncode != 0:
        raise SystemExit(f"git ls-tree {rev}:jaxmoe/impls/cpu/ failed: {ls.stderr.strip()}")
    headers = [n for n in ls.stdout.split() if n.endswith(".h")]
    for name in ("grouped_swiglu.cc", *headers):
        src = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:jaxmoe/impls/cpu/{name}"], capture_output=True, text=True
        )
        if src.returncode != 0:
            raise SystemExit(f"git show {rev}:jaxmoe/impls/cpu/{name} failed: {src.stderr.strip()}")
        (tmp / name).write_text(src.stdout)
    ok, msg, capsule = build.load_handler(tmp / "grouped_swiglu.cc")
    if not ok:
        raise SystemExit(f"the kernel of {rev} did not build: {msg}")
    jax.ffi.register_ffi_target(BASE_TARGET, capsule, platform="cpu")
    ok, _, shared = build.load_handler(tmp / "grouped_swiglu.cc", "JaxmoeGroupedSwigluShared")
    if ok:
        jax.ffi.register_ffi_target(BASE_TARGET_SHARED, shared, platform="cpu")
    return ok


def compiled(fn, target: str, *args):
    """``fn(*args)`` compiled with the custom call of ``target``."""

    def with_target(*a):
        old = kernel.TARGET, kernel.TARGET_SHARED
        kernel.TARGET = target
        kernel.TARGET_SHARED = BASE_TARGET_SHARED if target == BASE_TARGET else old[1]
        try:
            return fn(*a)
        finally:
            kernel.TARGET, kernel.TARGET_SHARED = old

    jax.clear_caches()  # nested jitted functions trace again, for this target
    return jax.jit(with_target).lower(*args).compile()


def case(a, cfg, fmt: str, t: int, rng):
    """``(fn, weights, new_inputs)`` of one format and T."""
    p = bench_block.expert_weights(jaxmoe.init_params(cfg, jax.random.key(0)), fmt, jax.random.key(1))
    d, e, k = cfg.d_model, cfg.num_experts, cfg.top_k
    if a.what == "layer":
        return (
            lambda p, x: jaxmoe.moe_apply(p, x, cfg, ExecConfig(activations=a.activations)),
            p,
            lambda: (jnp.asarray(rng.standard_normal((t, d), np.float32)),),
        )

    def inputs():
        ids = np.sort(rng.integers(0, e, t * k))
        sizes = np.bincount(ids, minlength=e).astype(np.int32)
        offsets = (np.cumsum(sizes) - sizes).astype(np.int32)
        xs = jnp.asarray(rng.standard_normal((t * k, d), np.float32))
        return xs, jnp.asarray(offsets), jnp.asarray(sizes)

    return (lambda ew, xs, o, s: kernel.grouped_swiglu(xs, o, s, ew, cfg, int_dot=a.int8)), p.experts, inputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of the kernel to compare with")
    ap.add_argument("--what", choices=["kernel", "layer"], default="kernel")
    ap.add_argument("--dtype", default="bf16,q8_0")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default the preset's 256)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--int8",
        action="store_true",
        help="ExecConfig(activations='int8') (integer dot products; the base must take the int_dot attribute)",
    )
    ap.add_argument(
        "--activations",
        choices=["float", "int8", "ggml"],
        default=None,
        help="the layer's ExecConfig.activations (--what layer; default float, int8 with --int8)",
    )
    a = ap.parse_args(argv)
    if a.activations is None:
        a.activations = "int8" if a.int8 else "float"
    elif a.activations == "ggml" and a.what != "layer":
        ap.error("--activations ggml: with --what layer (the kernel call alone takes float or int8 rows)")
    a.int8 = a.activations == "int8"
    ok, msg = build.cpu_kernel_status()
    if not ok:
        raise SystemExit(f"the C++ kernel did not build: {msg}")
    cfg = jaxmoe.load_config("qwen3.6-35b-a3b")
    if a.experts:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, num_experts=a.experts))
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        if not load_base(a.base, Path(tmp)) and a.what == "layer":
            raise SystemExit(
                f"{a.base} has no routed + shared handler (the layer's shared expert now runs in the "
                "routed call); compare --what kernel, or a base from 4 Dec 2026 on"
            )
    acts = f"{a.activations} activations"
    print(
        f"{a.what}: working tree against {a.base}; E={cfg.num_experts}, {acts}, new tokens every call, A B alternating"
    )
    print("| format | T | base best / median ms | new best / median ms | base / new (best, median) | same bits |")
    print("|---|---|---|---|---|---|")
    for fmt in a.dtype.split(","):
        for t in (int(s) for s in a.tokens.split(",")):
            fn, w, inputs = case(a, cfg, fmt, t, rng)
            first = inputs()
            fns = {"new": compiled(fn, kernel.TARGET, w, *first), "base": compiled(fn, BASE_TARGET, w, *first)}
            try:
                base_out = jax.block_until_ready(fns["base"](w, *first))
            except jax.errors.JaxRuntimeError as err:
                if "Wrong number of arguments" not in str(err):
                    raise
                raise SystemExit(
                    f"{a.base}'s kernel takes other operands than the working tree's ({err}); the in-call "
                    "combine (7 Dec 2026) added two: compare against a base from that commit on"
                ) from None
            same = all(
                np.array_equal(np.asarray(u), np.asarray(v))
                for u, v in zip(jax.tree.leaves(fns["new"](w, *first)), jax.tree.leaves(base_out))
            )
            ms = interleaved_ms({n: functools.partial(f, w) for n, f in fns.items()}, inputs, a.repeats)
            print(f"| {fmt} | {t} | {ab_cells(ms['base'], ms['new'])} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
