"""Peak host memory of loading one checkpoint layer, measured in a fresh process.

`measure` runs the load in a new Python process: after ``import jax, jaxmoe`` and one small
jax computation (so that neither counts), it resets the kernel's peak-RSS mark (writing
``5`` to ``/proc/self/clear_refs``), reads ``VmRSS``, loads layer ``--layer`` of the
checkpoint (`jaxmoe.from_pretrained`, or `jaxmoe.io.load_layer` with ``--loader io``) and
reads ``VmHWM``. The load's peak is ``VmHWM`` minus the ``VmRSS`` before it: every byte the
load made resident, mapped file pages included. With ``--warm`` the child loads the layer
once before, drops it and hands freed heap back to the system (``malloc_trim``), so the
peak leaves out what only a process's first load pays (lazy imports, the first XLA
compilations: a few MiB) and shows the loader's own copies. It prints that peak beside the bytes the
loaded layer holds (every parameter leaf; the routed experts alone as well) and whether
the peak stays within ``1.2 x held + 100 MiB`` (issue 47's bound). Linux only.

    python benchmarks/load_peak.py model.gguf --layer 1
    python benchmarks/load_peak.py gpt-oss-dir --layer 0 --dequantize
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
#: Issue 47's bound on a layer load's peak: ``RATIO * held + SLACK`` bytes.
RATIO, SLACK = 1.2, 100 * MIB

_CHILD = r"""
import ctypes, json, sys, time
import jax, jax.numpy as jnp
import jaxmoe
from jaxmoe import io as jio

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out

path, layer, loader, kw, warm = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
(jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()

def load():
    if loader == "io":
        return jio.load_layer(path, layer=layer, **kw)[1]
    return jaxmoe.from_pretrained(path, layer=layer, **kw).params()

if warm == "1":
    jax.block_until_ready(load())
    ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status()
t0 = time.perf_counter()
params = load()
seconds = time.perf_counter() - t0
after = status()
ew = params.experts
experts = sum(int(w.nbytes) for w in (ew.w_gate, ew.w_up, ew.w_down))
held = sum(int(x.nbytes) for x in jax.tree.leaves(params))
kinds = sorted({str(getattr(w, "kind", getattr(w, "dtype", "?"))) for w in (ew.w_gate, ew.w_up, ew.w_down)})
print(json.dumps(dict(
    seconds=seconds, held=held, experts=experts, kinds=kinds,
    peak=after["VmHWM"] - before["VmRSS"], rss_after=after["VmRSS"] - before["VmRSS"],
    file_pages_after=after["RssFile"] - before["RssFile"],
)))
"""


def measure(
    path, layer: int = 0, loader: str = "from_pretrained", timeout: float = 900, warm: bool = False, **kwargs
) -> dict:
    """The load's peak and held bytes (see the module doc) as a dict: ``peak``, ``held`` (every
    parameter leaf), ``experts`` (the routed experts), ``rss_after``, ``file_pages_after``
    (mapped file bytes still resident after the load), ``seconds``, ``kinds``, ``ratio``
    (peak / held) and ``meets`` (peak within ``RATIO * held + SLACK``). ``warm``: measure a
    second load (see the module doc). ``kwargs`` go to the loader (JSON values)."""
    if loader not in ("from_pretrained", "io"):
        raise ValueError(f"loader must be 'from_pretrained' or 'io', got {loader!r}")
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(layer), loader, json.dumps(kwargs), "1" if warm else "0"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if r.returncode:
        raise RuntimeError(f"loading layer {layer} of {path} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["ratio"] = out["peak"] / out["held"] if out["held"] else float("inf")
    out["meets"] = out["peak"] <= RATIO * out["held"] + SLACK
    return out


def describe(m: dict) -> str:
    return (
        f"held {m['held'] / MIB:.1f} MiB (routed experts {m['experts'] / MIB:.1f} MiB, {', '.join(m['kinds'])}); "
        f"load peak {m['peak'] / MIB:.1f} MiB = {m['ratio']:.2f} x held "
        f"({'within' if m['meets'] else 'NOT within'} {RATIO} x held + {SLACK // MIB} MiB); "
        f"file pages still mapped {m['file_pages_after'] / MIB:.1f} MiB; {m['seconds']:.2f} s"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="a .gguf file or an HF / MLX checkpoint directory")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--loader", choices=("from_pretrained", "io"), default="from_pretrained")
    ap.add_argument("--dequantize", action="store_true", help="quantized=False (HF: float32 experts)")
    ap.add_argument("--warm", action="store_true", help="measure a second load (leaves out first-load costs)")
    a = ap.parse_args(argv)
    kw = {"quantized": False} if a.dequantize else {}
    m = measure(a.path, a.layer, a.loader, warm=a.warm, **kw)
    print(describe(m))
    return 0 if m["meets"] else 1


if __name__ == "__main__":
    sys.exit(main())
