"""One batched expert dot ``[E, C, K] x [E, K, N] -> [E, C, N]`` (float32 out) on this CPU,
in each operand form side by side: why `jaxmoe.impls.xla_tiled.batched_mm` gives XLA:CPU
the operands it does (docs/intel.md, "xla_tiled on the CPU").

Forms, per dtype and rows per expert ``C``:

- ``stored``: ``einsum("vmk,vkn->vmn")`` on the operands as stored, float32 out (what
  other platforms get; on the CPU a YNNPACK fusion);
- ``upcast``: both operands converted to float32 first, then ``stored`` (bf16 only; what
  `jaxmoe.experts.mm` does on the CPU);
- ``batched_mm``: the shipped CPU form (float32 with ``C > 1``: the rows transposed behind
  an optimization barrier; bf16 with ``C > 1``: as stored; ``C = 1``: upcast).

New rows every call; the weights (512 MiB per matrix at the default f32 sizes) are far
past the L3, so no call finds them hot. Prints ms (best of ``--repeats``, round robin)
and each form's time over ``batched_mm``'s.

    python benchmarks/bench_batched_dot.py                       # E 256, K 2048, N 512: Qwen3.6's gate
    python benchmarks/bench_batched_dot.py --rows 1,8,16 --dtype bf16 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from interleave import interleaved_ms  # noqa: E402

import jaxmoe  # noqa: E402
from jaxmoe.experts import mm  # noqa: E402
from jaxmoe.impls.xla_tiled import batched_mm  # noqa: E402

_HI = jax.lax.Precision.HIGHEST


def stored(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum("vmk,vkn->vmn", a, b, preferred_element_type=jnp.float32, precision=_HI)


def upcast(a: jax.Array, b: jax.Array) -> jax.Array:
    return mm("vmk,vkn->vmn", a, b)  # on the CPU: both operands to float32 first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--k", type=int, default=2048, help="contracted size (d_model for gate / up)")
    ap.add_argument("--n", type=int, default=512, help="output size (expert_dim for gate / up)")
    ap.add_argument("--rows", default="1,8,16", help="rows per expert C, comma separated")
    ap.add_argument("--dtype", default="f32,bf16")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    jaxmoe.keep_freed_host_memory()
    rng = np.random.default_rng(0)
    e, k, n = a.experts, a.k, a.n
    print(f"[{e}, C, {k}] x [{e}, {k}, {n}] -> f32, backend {jax.default_backend()}")
    print("| dtype | C | stored ms | upcast ms | batched_mm ms | stored / batched_mm | upcast / batched_mm |")
    print("|---|---|---|---|---|---|---|")
    for name in a.dtype.split(","):
        dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[name]
        w = jnp.asarray(rng.standard_normal((e, k, n), np.float32) / 16, dt)
        forms = {"stored": stored, "batched_mm": batched_mm}
        if dt != jnp.float32:
            forms["upcast"] = upcast
        for c in (int(s) for s in a.rows.split(",")):
            fns = {f: jax.jit(fn) for f, fn in forms.items()}

            def rows(c=c, dt=dt):
                return (jnp.asarray(rng.standard_normal((e, c, k), np.float32), dt),)

            (x0,) = rows()
            ref = np.asarray(fns["stored"](x0, w))
            for f, fn in fns.items():  # the forms agree (float32 sums in another order)
                err = float(np.abs(np.asarray(fn(x0, w)) - ref).max())
                if err > 1e-4 * max(float(np.abs(ref).max()), 1.0):
                    print(f"{name} C={c}: {f} differs from stored by {err}", file=sys.stderr)
                    return 1
            ms = interleaved_ms({f: (lambda x, fn=fn, w=w: fn(x, w)) for f, fn in fns.items()}, rows, a.repeats)
            best = {f: min(v) for f, v in ms.items()}
            up = best.get("upcast")
            cells = [
                f"{best['stored']:.1f}",
                f"{up:.1f}" if up else "",
                f"{best['batched_mm']:.1f}",
                f"{best['stored'] / best['batched_mm']:.2f}",
                f"{up / best['batched_mm']:.2f}" if up else "",
            ]
            print(f"| {name} | {c} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
