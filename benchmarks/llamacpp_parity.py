"""How close jaxmoe's MoE layer comes to llama.cpp's on llama.cpp's own files, with float
activations and with ``ExecConfig(activations="ggml")`` (issue 46).

For each architecture the llama.cpp anchor's tools (``../shared/anchors/llamacpp/``, see
its README) make a tiny random Hugging Face MoE checkpoint (``make_tiny.py``), convert it
to an f32 GGUF with llama.cpp's own ``convert_hf_to_gguf.py`` (``convert.py``), quantize
that to each llama.cpp file type (``llama-quantize``), and run llama.cpp on each prompt
(``llama-moe-dump``, CPU, 2 threads), which writes every layer's MoE input and output.
Then for every MoE layer ``L`` jaxmoe loads layer ``L`` of the same file
(`jaxmoe.io.load_layer`), runs the dumped input through `jaxmoe.moe_apply` with
``ExecConfig(activations="float")`` and with ``activations="ggml"`` (``--impl``, default
``auto``), and compares each output with llama.cpp's: relative Frobenius error
``||y - y_llama||_F / ||y_llama||_F`` over the prompt's tokens.

Prints one row per architecture and file type (``F32`` is the unquantized file, the
sanity baseline): the largest error over layers and prompts of each mode, their ratio, and
whether the ggml mode meets the issue's bar (``--tol`` relative and ``--min-ratio`` times
closer than float mode; F32 rows have no ratio to meet). ``--per-layer`` prints every
layer. Three prompts by default: a one-token one, a short one and one of more than 32
tokens (ggml's matrix products take other paths for one row and for more rows); llama.cpp
runs the last layer on the last token only (the only one it needs logits for). Files are cached in ``--work``; a rerun
reuses them (``--fresh`` rebuilds). ``--json`` writes every number.

    B=$(../shared/anchors/llamacpp/setup.sh | tail -1)    # llama.cpp's bin dir, built once
    python benchmarks/llamacpp_parity.py $B                                  # the full table
    python benchmarks/llamacpp_parity.py $B --archs mixtral --types Q4_0,Q4_K_M --per-layer

Needs torch, transformers (the test extra) and sentencepiece, which llama.cpp's converter
imports for Mixtral (a stand-in module is put on the converter's path when it is absent).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ARCHS = ("qwen3_5_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3")
TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "MXFP4_MOE")
PROMPTS = (
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "mixture of experts routes every token to a few experts; hello world, this is a tiny "
    "tokenizer for a tiny model 0123456789, and the quick brown fox jumps over the lazy dog "
    "once more while the experts of every layer take their share of the tokens",
)
DUMP_RE = r"^(ffn_norm|attn_post_norm|ffn_moe_out|ffn_out)-\d+$"


def io_names(arch: str) -> tuple[str, str]:
    """The dumped tensor names (without ``-L``) of a MoE layer's input and output: the input
    is the FFN norm's output (``attn_post_norm`` in qwen3_5_moe), the output the routed
    experts' sum (``ffn_moe_out``) or, with a shared expert, the FFN's output (``ffn_out``)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    inp = "attn_post_norm" if arch == "qwen3_5_moe" else "ffn_norm"
    out = "ffn_out" if arch in ("qwen3_5_moe", "deepseek_v3") else "ffn_moe_out"
    return inp, out


def read_dump(path: str | os.PathLike) -> np.ndarray:
    """A tensor written by ``llama-moe-dump``: int32 ndims, int64 ne[4], float32 data in
    ggml order (ne0 fastest) -> a float32 array of shape ``(ne[n-1], ..., ne[0])``."""
    raw = Path(path).read_bytes()
    if len(raw) < 36:
        raise ValueError(f"{path}: {len(raw)} bytes, shorter than the 36-byte header")
    nd = int(np.frombuffer(raw[:4], np.int32)[0])
    ne = np.frombuffer(raw[4:36], np.int64)
    if not 1 <= nd <= 4:
        raise ValueError(f"{path}: ndims {nd} not in 1..4")
    n = int(np.prod(ne))
    data = np.frombuffer(raw[36:], np.float32)
    if data.size != n:
        raise ValueError(f"{path}: header ne={ne.tolist()} holds {n} floats, the file {data.size}")
    return data.reshape(tuple(int(v) for v in ne[:nd][::-1]))


def rel_err(y, ref) -> float:
    """Relative Frobenius error ``||y - ref|| / ||ref||`` in float64."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    if y.shape != ref.shape:
        raise ValueError(f"rel_err: shapes {y.shape} and {ref.shape} differ")
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _run(cmd, log: Path, env=None) -> None:
    with open(log, "w") as f:
        r = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({r.returncode}); {log}:\n{tail}")


def _converter_env(work: Path) -> dict:
    env = dict(os.environ)
    try:
        import sentencepiece  # noqa: F401
    except ImportError:  # the converter imports it before looking for tokenizer.model
        stub = work / "stub"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
        env["PYTHONPATH"] = os.pathsep.join([str(stub), env.get("PYTHONPATH", "")])
    return env


def build_files(arch, types, bin_dir: Path, anchor: Path, work: Path, fresh: bool) -> dict[str, Path]:
    """The f32 GGUF of ``arch`` and one file per llama.cpp type: ``{"F32": path, TYPE: path}``."""
    d = work / arch
    hf = d / "hf"
    if fresh or not (hf / "config.json").is_file():
        d.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, anchor / "make_tiny.py", work, arch], d / "make_tiny.log")
    f32 = d / "F32.gguf"
    if fresh or not f32.is_file():
        extra = ["--no-mtp"] if arch == "qwen3_5_moe" else []
        src = (bin_dir / ".." / "..").resolve()
        _run(
            [sys.executable, anchor / "convert.py", src, hf, f32, "f32", *extra],
            d / "convert.log",
            _converter_env(work),
        )
    files = {"F32": f32}
    for t in types:
        p = d / f"{t}.gguf"
        if fresh or not p.is_file():
            _run([bin_dir / "llama-quantize", f32, p, t], d / f"quantize-{t}.log")
        files[t] = p
    return files


def dump(bin_dir: Path, gguf: Path, prompt: str, out: Path, fresh: bool, threads: int) -> Path:
    """Runs ``llama-moe-dump`` on ``prompt`` (once; cached in ``out``)."""
    done = out / "done"
    if fresh or not done.is_file():
        out.mkdir(parents=True, exist_ok=True)
        for f in out.glob("*.bin"):
            f.unlink()
        env = dict(os.environ, MOE_DUMP_DIR=str(out), MOE_DUMP_RE=DUMP_RE)
        cmd = [bin_dir / "llama-moe-dump", "-m", gguf, "-p", prompt, "-t", threads, "-ngl", "0", "-c", "512"]
        _run(cmd, out / "dump.log", env)
        done.write_text(prompt)
    return out


def moe_layers(gguf: Path) -> list[int]:
    """The MoE layers of a GGUF file: every layer but its config's ``dense_layers``."""
    from jaxmoe.io import load_layer

    for first in range(64):
        try:
            cfg, _ = load_layer(gguf, layer=first)
        except ValueError:  # a dense layer
            continue
        return [i for i in range(cfg.num_layers) if i not in set(cfg.dense_layers)]
    raise ValueError(f"{gguf}: no MoE layer among the first 64")


def compare(gguf: Path, arch: str, dumps: list[Path], impl: str) -> list[dict]:
    """For every MoE layer and dump: the float-mode and ggml-mode errors against llama.cpp."""
    import jax
    import jax.numpy as jnp

    from jaxmoe import ExecConfig, moe_apply
    from jaxmoe.io import load_layer

    fn = jax.jit(moe_apply, static_argnums=(2, 3))  # one compile per config, kinds and shape
    inp, out = io_names(arch)
    rows = []
    for layer in moe_layers(gguf):
        cfg, params = load_layer(gguf, layer=layer, dtype=jnp.float32)
        for dd in dumps:
            x = read_dump(dd / f"{inp}-{layer}.bin").reshape(-1, cfg.d_model)  # [d]: one row
            ref = read_dump(dd / f"{out}-{layer}.bin").reshape(-1, cfg.d_model)
            err = {
                m: rel_err(np.asarray(fn(params, jnp.asarray(x), cfg, ExecConfig(impl=impl, activations=m))), ref)
                for m in ("float", "ggml")
            }
            rows.append({"layer": layer, "tokens": int(x.shape[0]), **err})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bin", type=Path, help="llama.cpp's bin dir (llama-quantize, llama-moe-dump)")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--types", default=",".join(TYPES), help="llama-quantize types; F32 is always added")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "llamacpp_parity")
    ap.add_argument("--anchor", type=Path, default=Path(__file__).resolve().parents[2] / "shared/anchors/llamacpp")
    ap.add_argument("--prompts", nargs="*", default=list(PROMPTS))
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tol", type=float, default=2e-4)
    ap.add_argument("--min-ratio", type=float, default=50.0)
    ap.add_argument("--per-layer", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="rebuild the cached files and dumps")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    archs = [s for s in a.archs.split(",") if s]
    types = [s for s in a.types.split(",") if s and s.upper() != "F32"]
    for arch in archs:
        io_names(arch)
    for tool in ("llama-quantize", "llama-moe-dump"):
        if not (a.bin / tool).is_file():
            raise SystemExit(
                f"{a.bin / tool} not found: pass llama.cpp's bin dir (../shared/anchors/llamacpp/setup.sh)"
            )
    if not (a.anchor / "make_tiny.py").is_file():
        raise SystemExit(f"{a.anchor}/make_tiny.py not found: pass --anchor")

    results = []
    print(f"# {len(a.prompts)} prompts, impl={a.impl}, bar: ggml <= {a.tol:g} and float / ggml >= {a.min_ratio:g}")
    print("| arch | type | tokens | float mode | ggml mode | float / ggml | meets |")
    print("|---|---|---|---|---|---|---|")
    for arch in archs:
        files = build_files(arch, types, a.bin, a.anchor, a.work, a.fresh)
        for t, gguf in files.items():
            dumps = [
                dump(a.bin, gguf, p, a.work / arch / "dump" / f"{t}-p{i}", a.fresh, a.threads)
                for i, p in enumerate(a.prompts)
            ]
            rows = compare(gguf, arch, dumps, a.impl)
            ef, eg = max(r["float"] for r in rows), max(r["ggml"] for r in rows)
            ratio = ef / eg if eg > 0 else float("inf")
            ok = eg <= a.tol and (t == "F32" or ratio >= a.min_ratio)
            tokens = "/".join(str(n) for n in sorted({r["tokens"] for r in rows}))
            results.append(dict(arch=arch, type=t, tokens=tokens, float=ef, ggml=eg, ratio=ratio, ok=ok, layers=rows))
            mark = "yes" if ok else "**no**"
            print(f"| {arch} | {t} | {tokens} | {ef:.2e} | {eg:.2e} | {ratio:.0f} | {mark} |", flush=True)
            if a.per_layer:
                for r in rows:
                    print(f"|  | layer {r['layer']} | {r['tokens']} | {r['float']:.2e} | {r['ggml']:.2e} | | |")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    bad = [f"{r['arch']} {r['type']}" for r in results if not r["ok"]]
    print(
        f"\n{len(results) - len(bad)} of {len(results)} rows meet the bar" + (f"; not: {', '.join(bad)}" if bad else "")
    )
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
