"""Forward + backward on the CPU: one Qwen3.6-35B-A3B MoE layer (router, routed experts
top-8 of width 512, sigmoid-gated shared expert, d 2048, float32), per impl and T, against
the Hugging Face ``Qwen3_5MoeSparseMoeBlock`` (torch CPU, ``loss.backward()``) in the same run.

For each impl: ``fwd`` = the jitted forward ``moe_apply``; ``fwd+bwd`` = the jitted
``jax.grad`` of ``<moe_apply(p, x), ct>`` w.r.t. every parameter and ``x`` (router, routed
experts, shared expert: the gradients a training step needs); ``bwd/fwd`` = (fwd+bwd -
fwd) / fwd; ``sys s`` = the process's kernel CPU seconds during that best step (mostly
first-touch page zeroing of the fresh result memory XLA allocates every call: 3.2 GB of
weight gradients at 256 experts; on this VM that costs ~0.5 s per GB of CPU time). HF:
the same loss through the torch block with every parameter and ``x`` requiring grad,
``loss.backward()`` (parameter grads cleared to None first). Every call gets new tokens
(cold); each repeat runs every impl once in a rotating order; the table shows the best of
``--repeats``. Gradients are checked against HF's before timing (x and
the routed experts' weights, max error relative to the largest entry).

    python benchmarks/bench_train.py                        # 256 experts, T 64,256,1024 (~14 GB peak)
    python benchmarks/bench_train.py --experts 64 --tokens 64,256 --impls hf,cpu
    python benchmarks/bench_train.py --dtype q4_k_m --tokens 8,64 --impls auto,gather --gather-max-tokens 64
    python benchmarks/bench_train.py --tokens 64,256 --impls auto --keep-freed    # freed memory kept (README)
    python benchmarks/bench_train.py --tokens 64,256 --impls auto --glibc-reuse   # plain / env / keep-freed

``--dtype`` stores the experts (routed and shared) in one of bench_block.py's formats;
quantized experts are frozen (adapter-style fine-tuning: gradients of ``x``, the router and
the other float parameters), and ``hf`` is skipped (its block holds float experts).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxmoe
from jaxmoe.evaluation.hf_block import qwen35_moe_block
from jaxmoe.host_memory import GLIBC_TUNABLES, keep_freed_host_memory


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,256,1024")
    ap.add_argument("--impls", default="hf,auto,cpu,xla", help="comma-separated: hf and jaxmoe impls (gather: slow)")
    ap.add_argument("--experts", type=int, default=None, help="override the number of experts (default 256)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--gather-max-tokens", type=int, default=8, help="skip gather above this T (158 s at T=64)")
    ap.add_argument(
        "--dtype",
        default="f32",
        help="experts' format (bench_block.py's --dtype: f32, bf16, q8_0, q4_0, mlx4_g64, q4_k_m, ...); "
        "quantized experts are frozen (gradients of x, router and what else is float) and hf is skipped",
    )
    ap.add_argument(
        "--glibc-reuse",
        action="store_true",
        help="run the benchmark in three child processes: plain, with GLIBC_TUNABLES that keep freed "
        "memory in the process, and with jaxmoe.keep_freed_host_memory() (README, Training); print "
        "all three and the step ratios",
    )
    ap.add_argument(
        "--keep-freed",
        action="store_true",
        help="call jaxmoe.keep_freed_host_memory() before JAX starts (freed memory reused; README, Training)",
    )
    ap.add_argument("--json-out", default=None, help=argparse.SUPPRESS)  # a child's rows, for --glibc-reuse
    a = ap.parse_args(argv)
    a.tokens = [int(t) for t in a.tokens.split(",")]
    a.impls = [i.strip() for i in a.impls.split(",") if i.strip()]
    return a


def make_hf_train(p: jaxmoe.MoEParams, cfg: jaxmoe.MoEConfig, threads: int):
    """``step(x, ct) -> (dx, d w_gate [E, d, F])`` through the HF block holding ``p``."""
    import torch

    blk = qwen35_moe_block(p, cfg, threads)
    f = cfg.expert_dim

    def step(x, ct):
        for q in blk.parameters():
            q.grad = None
        xt = torch.from_numpy(np.array(x)).requires_grad_(True)
        out = blk(xt[None])
        out = out[0] if isinstance(out, tuple) else out
        loss = (out[0] * torch.from_numpy(np.asarray(ct))).sum()
        loss.backward()
        gate_grad = blk.experts.gate_up_proj.grad
        return xt.grad.numpy(), None if gate_grad is None else gate_grad[:, :f, :].transpose(1, 2).numpy()

    return step


def trainable_grad(loss, p):
    """``(p, x, ct) -> (dp, dx)``: the gradient of ``loss(p, x, ct)`` w.r.t. ``x`` and every
    float leaf of ``p`` (the loss computed too); a `QuantizedTensor` (frozen) gets None in ``dp``."""
    from jaxmoe.quant import QuantizedTensor

    def is_q(leaf):
        return isinstance(leaf, QuantizedTensor)

    treedef = jax.tree.structure(p, is_leaf=is_q)
    frozen = [is_q(leaf) for leaf in jax.tree.leaves(p, is_leaf=is_q)]

    def merge(train, fixed):
        it, fx = iter(train), iter(fixed)
        return treedef.unflatten([next(fx) if f else next(it) for f in frozen])

    def split_loss(train, fixed, x, ct):
        return loss(merge(train, fixed), x, ct)

    # value_and_grad, as a training step: with grad alone the loss is linear in the layer's
    # output, which the backward then never reads, and XLA drops the forward pass
    g = jax.value_and_grad(split_loss, argnums=(0, 2))

    def step(p, x, ct):
        leaves = jax.tree.leaves(p, is_leaf=is_q)
        train = [leaf for leaf, f in zip(leaves, frozen) if not f]
        fixed = [leaf for leaf, f in zip(leaves, frozen) if f]
        _, (dtrain, dx) = g(train, fixed, x, ct)
        return merge(dtrain, [None] * len(fixed)), dx

    return step


def glibc_reuse(argv: list[str]) -> int:
    """The benchmark in three child processes: plain, with `GLIBC_TUNABLES` in the environment,
    and with ``--keep-freed`` (the same options set at run time); prints each one's output
    and, per T and impl, the step times and plain / other (> 1: the other faster)."""
    import json
    import subprocess
    import tempfile

    argv = [x for x in argv if x not in ("--glibc-reuse", "--keep-freed")]
    runs = (("plain", None, []), ("env", GLIBC_TUNABLES, []), ("keep", None, ["--keep-freed"]))
    rows = {}
    for name, tunables, extra in runs:
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            print(f"== {name}: GLIBC_TUNABLES={tunables or '(unset)'} {' '.join(extra)}", flush=True)
            cmd = [sys.executable, os.path.abspath(__file__), *argv, *extra, "--json-out", out.name]
            r = subprocess.run(cmd, env=env)
            if r.returncode:
                return r.returncode
            with open(out.name) as f:
                rows[name] = {(x["T"], x["impl"]): x for x in json.load(f)}
    print("\nfwd+bwd ms (bwd/fwd); env = GLIBC_TUNABLES, keep = jaxmoe.keep_freed_host_memory()")
    print("|    T | impl     | plain          | env            | keep           | plain / env | plain / keep |")
    print("|-----:|:---------|---------------:|---------------:|---------------:|------------:|-------------:|")
    for key, p0 in rows["plain"].items():
        p1, p2 = rows["env"].get(key), rows["keep"].get(key)
        if p1 is None or p2 is None:
            continue
        cells = " | ".join(f"{r['step']:7.1f} ({bwd_fwd(r, 4)})" for r in (p0, p1, p2))
        print(
            f"| {key[0]:4d} | {key[1]:8s} | {cells} | {p0['step'] / p1['step']:11.2f} | "
            f"{p0['step'] / p2['step']:12.2f} |"
        )
    return 0


def bwd_fwd(row: dict, width: int) -> str:
    """(fwd+bwd - fwd) / fwd of a result row, right-aligned in ``width``; '-' without a forward."""
    return f"{(row['step'] - row['fwd']) / row['fwd']:{width}.2f}" if row["fwd"] else "-".rjust(width)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.glibc_reuse:
        return glibc_reuse(argv)
    if a.keep_freed and not keep_freed_host_memory():
        print("--keep-freed: not glibc, nothing changed", flush=True)
    cfg = jaxmoe.load_config("qwen3.6-35b-a3b")
    if a.experts:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, num_experts=a.experts))
    d, e, k, f = cfg.d_model, cfg.num_experts, cfg.top_k, cfg.expert_dim
    print(f"jax {jax.__version__}; layer d={d} E={e} k={k} F={f} Fs={cfg.shared_expert_dim}; {a.dtype}; cold")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start", flush=True)
    p = jaxmoe.init_params(cfg, jax.random.key(0))
    if a.dtype != "f32":
        from bench_block import DTYPES, expert_weights

        if a.dtype not in DTYPES:
            sys.exit(f"bench_train: --dtype {a.dtype!r} unknown; choose from {','.join(DTYPES)}")
        p = expert_weights(p, a.dtype, jax.random.key(1))  # routed and shared experts
        if "hf" in a.impls:
            print("hf skipped: the Hugging Face block holds float experts only", flush=True)
            a.impls = [i for i in a.impls if i != "hf"]
    jax.block_until_ready(p)
    hf_step = make_hf_train(p, cfg, a.threads) if "hf" in a.impls else None

    def loss(impl):
        return lambda p, x, ct: jnp.vdot(jaxmoe.moe_apply(p, x, cfg, impl=impl), ct)

    fwd = {i: jax.jit(lambda p, x, i=i: jaxmoe.moe_apply(p, x, cfg, impl=i)) for i in a.impls if i != "hf"}
    # quantized weights are frozen: differentiate the float leaves only, as an adapter
    # fine-tune does (jax.grad over the whole tree with allow_int would return float0
    # zeros for the codes, which jit materializes as full-size bool arrays every step)
    grad = {i: jax.jit(trainable_grad(loss(i), p)) for i in a.impls if i != "hf"}
    rows = []
    for t in a.tokens:
        n = 1 + a.repeats * len(a.impls)
        xs = [jax.random.normal(jax.random.key(100 * t + r), (t, d), jnp.float32) for r in range(n)]
        cts = [jax.random.normal(jax.random.key(100 * t + r + 50), (t, d), jnp.float32) for r in range(n)]
        ref = hf_step(xs[0], cts[0]) if hf_step else None
        fns = {}
        for impl in a.impls:
            if impl == "gather" and t > a.gather_max_tokens:
                print(f"T={t:5d} {impl:8s} skipped (T > {a.gather_max_tokens})", flush=True)
                continue
            if impl == "hf":
                fns[impl] = (hf_step, None)
                continue
            try:
                gp, gx = grad[impl](p, xs[0], cts[0])
                jax.block_until_ready(fwd[impl](p, xs[0]))
            except Exception as err:  # e.g. a strategy without reverse mode
                print(f"T={t:5d} {impl:8s} fails: {type(err).__name__}: {str(err).splitlines()[0][:120]}", flush=True)
                continue
            if ref is not None:
                ex = float(np.abs(np.asarray(gx) - ref[0]).max() / np.abs(ref[0]).max())
                ew = float(np.abs(np.asarray(gp.experts.w_gate) - ref[1]).max() / np.abs(ref[1]).max())
                print(f"T={t:5d} {impl:8s} grad vs HF: dx rel {ex:.1e}, dW_gate rel {ew:.1e}", flush=True)
                if not (ex < 1e-3 and ew < 1e-3):
                    print(f"T={t} {impl}: gradients differ from HF", file=sys.stderr)
                    return 1
            fns[impl] = (lambda x, c, g=grad[impl]: g(p, x, c), lambda x, j=fwd[impl]: j(p, x))
        times = {i: ([], []) for i in fns}
        sys_s = {i: [] for i in fns}  # kernel CPU seconds per step (first touch of fresh result memory)
        order = list(fns)
        for r in range(a.repeats):
            for j, impl in enumerate(order[r % len(order) :] + order[: r % len(order)]):
                x, c = xs[1 + r * len(order) + j], cts[1 + r * len(order) + j]
                step, fw = fns[impl]
                s0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
                jax.block_until_ready(step(x, c))
                times[impl][0].append((time.perf_counter() - t0) * 1e3)
                sys_s[impl].append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - s0)
                if fw is not None:
                    t0 = time.perf_counter()
                    jax.block_until_ready(fw(x))
                    times[impl][1].append((time.perf_counter() - t0) * 1e3)
        hf_ms = min(times["hf"][0]) if "hf" in times else None
        for impl, (tb, tf) in times.items():
            best = int(np.argmin(tb))
            row = dict(T=t, impl=impl, step=tb[best], fwd=min(tf) if tf else None, sys=sys_s[impl][best])
            row["vs_hf"] = hf_ms / row["step"] if hf_ms else None
            rows.append(row)
            print(f"T={t:5d} {impl:8s} fwd+bwd {row['step']:9.1f} ms (median {np.median(tb):.1f})", flush=True)
    print("\n|    T | impl     |  fwd ms | fwd+bwd ms | bwd/fwd | sys s | HF ms / impl ms |")
    print("|-----:|:---------|--------:|-----------:|--------:|------:|----------------:|")
    for r in rows:
        fw = f"{r['fwd']:7.1f}" if r["fwd"] else "      -"
        vs = f"{r['vs_hf']:15.2f}" if r["vs_hf"] else "              -"
        print(f"| {r['T']:4d} | {r['impl']:8s} | {fw} | {r['step']:10.1f} | {bwd_fwd(r, 7)} | {r['sys']:5.2f} | {vs} |")
    if a.json_out:
        import json

        with open(a.json_out, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
