"""The whole layer at another git revision against the working tree's, alternating call by
call: how a change to the Python around the kernels (dispatch, options, the shared expert)
is measured on a noisy machine. `bench_kernel_ab` swaps only the C++ kernel under the
working tree's Python; here each side is its own tree in its own worker process (the base
revision checked out in a temporary git worktree, ``PYTHONPATH`` pointing at it), both
building the same weights (`bench_block.expert_weights` of their own tree, same keys) and
compiling ``moe_apply(..., impl auto)`` once per case. The driver then asks the two
workers for one timed call each in turn, the order switching every repeat, each call on
new tokens made and ready before its clock starts (the same token sequence on both
sides), while the other worker waits idle.

Prints best / median ms of each and base / new (> 1: the new side is faster); the spread:
each side's interquartile range over its median, and the median and interquartile range
of the paired ratios (base / new of the two calls of one repeat, which shared the
machine's load of the moment); and whether the two sides' outputs of the first call are
bitwise equal. ``--new REV`` checks
out the new side too (default: the working tree, uncommitted changes included).

    python benchmarks/bench_tree_ab.py --base b1d689f --dtype bf16,q4_k_m --tokens 1,8,64
    python benchmarks/bench_tree_ab.py --base b1d689f --new HEAD --tokens 1,8,64 --repeats 21
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker() -> None:
    """Serves ``setup`` / ``time`` requests (one JSON line each) on stdin for the tree in
    the working directory; one JSON line of reply each on stdout."""
    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    import time

    import bench_block
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmoe

    try:  # trees from issue 45 on: execution options in ExecConfig
        from jaxmoe.execution import ExecConfig

        def layer(p, x, cfg):
            return jaxmoe.moe_apply(p, x, cfg, ExecConfig(impl="auto"))
    except ImportError:

        def layer(p, x, cfg):
            return jaxmoe.moe_apply(p, x, cfg, impl="auto")

    cfg = jaxmoe.load_config("qwen3.6-35b-a3b")
    state = None
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "setup":
            state = None  # the previous case's weights go before the next are made
            t, rng = int(req["tokens"]), np.random.default_rng(req["seed"])
            params = bench_block.expert_weights(
                jaxmoe.init_params(cfg, jax.random.key(0)), req["dtype"], jax.random.key(1)
            )
            x = jnp.asarray(rng.standard_normal((t, cfg.d_model), np.float32))
            fn = jax.jit(lambda p, x: layer(p, x, cfg)).lower(params, x).compile()
            first = hashlib.sha256(np.asarray(fn(params, x)).tobytes()).hexdigest()
            state = fn, params, rng, t
            reply = {"jaxmoe": jaxmoe.__file__, "first": first}
        else:
            assert state is not None, "a timed call before any setup"
            fn, params, rng, t = state
            x = jax.block_until_ready(jnp.asarray(rng.standard_normal((t, cfg.d_model), np.float32)))
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, x))
            reply = {"ms": (time.perf_counter() - t0) * 1e3}
        print(json.dumps(reply), flush=True)


class Worker:
    """A worker process serving the tree at ``tree``."""

    def __init__(self, tree: Path):
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, **req) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker exited (code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="git revision to compare with")
    ap.add_argument("--new", help="git revision of the new side (default: the working tree)")
    ap.add_argument("--dtype", default="bf16,q4_k_m")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker()
        return 0
    if not a.base:
        ap.error("--base is required")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np
    from interleave import ab_cells

    def iqr(v) -> float:
        lo, hi = np.percentile(v, [25, 75])
        return float(hi - lo)

    with tempfile.TemporaryDirectory() as tmp:
        trees = {n: Path(tmp) / n for n, rev in (("base", a.base), ("new", a.new)) if rev}
        for n, tree in trees.items():
            rev = a.base if n == "base" else a.new
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
        workers = {"base": Worker(trees["base"]), "new": Worker(trees.get("new", ROOT))}
        try:
            new = a.new or "the working tree"
            print(f"layer (impl auto, Qwen3.6-35B-A3B): {new} against {a.base}, one worker process each,")
            print("new tokens every call, A B alternating")
            print(
                "| format | T | base best / median ms | new best / median ms | base / new (best, median) "
                "| IQR / median (base, new) | paired base / new: median [IQR] | same bits |"
            )
            print("|---|---|---|---|---|---|---|---|")
            seen: dict[str, str] = {}
            for fmt in a.dtype.split(","):
                for t in (int(s) for s in a.tokens.split(",")):
                    setup = {n: w.ask(cmd="setup", dtype=fmt, tokens=t, seed=t) for n, w in workers.items()}
                    if not seen:
                        seen = {n: s["jaxmoe"] for n, s in setup.items()}
                        print(f"jaxmoe of each side: {seen}", file=sys.stderr)
                    ms: dict[str, list[float]] = {n: [] for n in workers}
                    for r in range(a.repeats):
                        for n in ("base", "new") if r % 2 == 0 else ("new", "base"):
                            ms[n].append(workers[n].ask(cmd="time")["ms"])
                    same = setup["base"]["first"] == setup["new"]["first"]
                    spread = ", ".join(f"{iqr(ms[n]) / np.median(ms[n]):.0%}" for n in ("base", "new"))
                    pairs = np.asarray(ms["base"]) / np.asarray(ms["new"])
                    lo, hi = np.percentile(pairs, [25, 75])
                    paired = f"{np.median(pairs):.2f} [{lo:.2f}, {hi:.2f}]"
                    print(
                        f"| {fmt} | {t} | {ab_cells(ms['base'], ms['new'])} | {spread} | {paired} | {same} |",
                        flush=True,
                    )
        finally:
            for w in workers.values():
                w.close()
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
