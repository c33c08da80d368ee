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
layer. Where a token's ggml-mode residual stands out (``--explain``), it looks for the
rounding ties behind it: a SwiGLU output code, a Q8_0 / Q8_1 block scale or a Q8_1 block
sum that lies within a hair of a rounding boundary, where float32 summation order decides
the side. It prints each one that llama.cpp's output says went the other way (``tie
flips``) and the layer's error with them undone. Three prompts by default: a one-token one, a short one and one of more than 32
tokens (ggml's matrix products take other paths for one row and for more rows); llama.cpp
runs the last layer on the last token only (the only one it needs logits for). Files are cached in ``--work``; a rerun
reuses them (``--fresh`` rebuilds). ``--json`` writes every number.

``--residency`` prints another table instead, with no llama.cpp run (only llama-quantize /
llama-imatrix for files not cached yet): per arch and file type, the routed experts'
bytes in the file against what ``jaxmoe.from_pretrained(file, layer=L)`` holds for them
over every MoE layer (target <= ``RESIDENT_MAX``), and the first MoE layer's load peak in
a fresh process (``load_peak.py``). The ``IMATRIX_TYPES`` (IQ2_XXS, IQ3_XXS, ...) are
quantized with an importance matrix of the F32 file over the prompts' text, made by
``llama-imatrix`` (``cmake --build BUILD --target llama-imatrix`` in llama.cpp's build dir).

    B=$(../shared/anchors/llamacpp/setup.sh | tail -1)    # llama.cpp's bin dir, built once
    python benchmarks/llamacpp_parity.py $B                                  # the full table
    python benchmarks/llamacpp_parity.py $B --archs mixtral --types Q4_0,Q4_K_M --per-layer
    python benchmarks/llamacpp_parity.py $B --residency --types Q8_0,Q4_K_M,Q2_K,IQ2_XXS,IQ3_XXS

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
#: llama-quantize types that need an importance matrix (``llama-imatrix`` in the bin dir).
IMATRIX_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ1_S", "IQ1_M")
PROMPTS = (
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "mixture of experts routes every token to a few experts; hello world, this is a tiny "
    "tokenizer for a tiny model 0123456789, and the quick brown fox jumps over the lazy dog "
    "once more while the experts of every layer take their share of the tokens",
)
DUMP_RE = r"^(ffn_norm|attn_post_norm|ffn_moe_out|ffn_out)-\d+$"
#: ``--residency``: the largest held / file bytes of a quantized file's routed experts (issue 47).
RESIDENT_MAX = 1.02


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


def imatrix(bin_dir: Path, f32: Path, out: Path, fresh: bool, threads: int) -> Path:
    """An importance matrix of ``f32`` from ``llama-imatrix`` over the `PROMPTS` text (once;
    cached), for the types llama-quantize refuses without one (`IMATRIX_TYPES`)."""
    if fresh or not out.is_file():
        text = out.with_suffix(".txt")
        text.write_text("\n".join(PROMPTS * 8))
        cmd = [bin_dir / "llama-imatrix", "-m", f32, "-f", text, "-o", out, "-c", 64, "-t", threads, "-ngl", 0]
        _run(cmd, out.with_suffix(".log"))
    return out


def build_files(arch, types, bin_dir: Path, anchor: Path, work: Path, fresh: bool, threads: int = 2) -> dict[str, Path]:
    """The f32 GGUF of ``arch`` and one file per llama.cpp type: ``{"F32": path, TYPE: path}``
    (the `IMATRIX_TYPES` quantized with an importance matrix from ``llama-imatrix``)."""
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
            im = []
            if t in IMATRIX_TYPES:
                im = ["--imatrix", imatrix(bin_dir, f32, d / "imatrix.gguf", fresh, threads)]
            _run([bin_dir / "llama-quantize", *im, f32, p, t], d / f"quantize-{t}.log")
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


def _load_peak():
    """benchmarks/load_peak.py (beside this script)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import load_peak
    finally:
        sys.path.pop(0)
    return load_peak


def residency(gguf: Path) -> dict:
    """Bytes of the routed experts (``ffn_{gate,up,down,gate_up}_exps``) in the file against
    what ``jaxmoe.from_pretrained(file, layer=L)`` holds for them, summed over every MoE
    layer, the file's expert tensor types, and the load peak of the first MoE layer in a
    fresh process (`load_peak.measure`)."""
    import re

    import gguf as gg

    import jaxmoe

    measure = _load_peak().measure
    pat = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
    file_bytes, types = 0, set()
    layers = moe_layers(gguf)
    for t in gg.GGUFReader(gguf).tensors:
        m = pat.match(t.name)
        if m and int(m[1]) in layers:
            file_bytes += int(t.n_bytes)
            types.add(t.tensor_type.name)
    held, kinds = 0, set()
    for layer in layers:
        ew = jaxmoe.from_pretrained(gguf, layer=layer).params().experts
        for w in (ew.w_gate, ew.w_up, ew.w_down):
            held += int(w.nbytes)
            kinds.add(str(getattr(w, "kind", getattr(w, "dtype", "?"))))
    peak = measure(gguf, layer=layers[0])
    return dict(
        file=file_bytes,
        held=held,
        ratio=held / file_bytes,
        types=sorted(types),
        kinds=sorted(kinds),
        peak_layer=layers[0],
        peak=peak["peak"],
        peak_held=peak["held"],
        peak_ok=peak["meets"],
    )


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


def _tie_flips(params, cfg, x_t, ids, weights, r, margin: float, max_flips: int = 4):
    """The hidden-activation codes at rounding ties that explain one token's residual
    ``r = y_llama - y_jaxmoe``: every SwiGLU output (routed slots and shared expert,
    computed in float64 from the converted input and rounded to float32) whose scaled
    value lies within ``margin`` of a half step is a candidate; a candidate's effect is
    its code moved by one (for Q8_1 with the stored block sum ``s`` moving too), times
    the down projection row and the slot's weight (the shared expert's gate). So are a
    Q8_0 / Q8_1 block scale ``amax / 127`` and a Q8_1 block sum ``d sum(q)`` within
    ``100 margin`` of a float16 half step: their effect is the float16 value one step away
    (times the block's codes and rows, or the weight's block minimums). Greedily
    takes the candidate that shrinks the residual most while it halves it. Returns
    ``(flips, delta)``: descriptions and the summed effect."""
    from jaxmoe.evaluation.reference import block_minimums_np, ggml_blocks_np, ggml_format, ggml_quantize_np, to_f64

    cands = []

    def ffn(name, wg, wu, wd, idx, scale):
        v, _ = ggml_quantize_np(x_t[None], ggml_format(wg))
        g, u = v @ to_f64(wg, idx), v @ to_f64(wu, idx)
        h = (g / (1 + np.exp(-g)) * u).astype(np.float32)[0]
        fd = ggml_format(wd)
        if fd not in ("q8_0", "q8_1", "q8_K"):
            return
        qk = 256 if fd == "q8_K" else 32
        q, d, _ = ggml_blocks_np(h[None], fd)
        q, d = q[0], d[0].astype(np.float64)
        b = h.reshape(-1, qk)
        if fd == "q8_K":  # the scaled values before rounding, as the port forms them
            mx = b[np.arange(len(b)), np.argmax(np.abs(b), axis=-1)]
            sc = (b * (np.float32(-127.0) / mx)[:, None].astype(np.float32)).astype(np.float32).reshape(-1)
        else:
            sc = (
                (b * (np.float32(127.0) / np.abs(b).max(-1))[:, None].astype(np.float32)).astype(np.float32).reshape(-1)
            )
        wdf = to_f64(wd, idx)
        mins = block_minimums_np(wd, idx) if fd == "q8_1" else None
        if fd != "q8_K":  # Q8_0 / Q8_1's scale d = f16(amax / 127) on an f16 rounding tie
            for blk in range(len(b)):
                d32 = np.float32(np.abs(b[blk]).max() / np.float32(127.0))
                d16 = np.float16(d32)
                other = np.nextafter(d16, np.float16(np.inf if d32 > d16 else -np.inf))
                if abs(abs(float(d32) - float(d16)) / abs(float(other) - float(d16)) - 0.5) < 100 * margin:
                    rows = wdf[blk * qk : (blk + 1) * qk] - (0 if mins is None else mins[blk])
                    delta = (float(other) - float(d16)) * (q[blk * qk : (blk + 1) * qk] @ rows)
                    cands.append(
                        (f"{name} block {blk} ({fd} scale d = {float(d32):.8g}: f16 {d16} or {other})", delta * scale)
                    )
        if mins is not None:  # Q8_1's block sum s = f16(d32 sum(q)) on an f16 rounding tie
            for blk in range(len(b)):
                s32 = np.float32(np.abs(b[blk]).max() / np.float32(127.0)) * np.float32(
                    q[blk * qk : (blk + 1) * qk].sum()
                )
                s16 = np.float16(s32)
                other = np.nextafter(s16, np.float16(np.inf if s32 > s16 else -np.inf))
                frac = abs(float(s32) - float(s16)) / abs(float(other) - float(s16))
                if abs(frac - 0.5) < 100 * margin:
                    delta = (float(other) - float(s16)) * mins[blk]
                    cands.append(
                        (f"{name} block {blk} (q8_1 sum s = {float(s32):.8g}: f16 {s16} or {other})", delta * scale)
                    )
        for j in np.nonzero(np.abs(np.abs(sc - np.trunc(sc)) - 0.5) < margin)[0]:
            sgn = 1.0 if sc[j] > q[j] else -1.0  # the code on the tie's other side
            blk = j // qk
            if mins is None:
                delta = sgn * d[blk] * wdf[j]
            else:
                d32 = np.float32(np.abs(b[blk]).max() / np.float32(127.0))
                sq = int(q[blk * qk : (blk + 1) * qk].sum())
                ds = float(np.float16(d32 * np.float32(sq + sgn))) - float(np.float16(d32 * np.float32(sq)))
                delta = sgn * d[blk] * (wdf[j] - mins[blk]) + ds * mins[blk]
            cands.append(
                (f"{name} h[{j}] ({fd}, scaled {sc[j]:.7f}, code {int(q[j])} or {int(q[j] + sgn)})", delta * scale)
            )

    ew = params.experts
    for slot, e in enumerate(ids):
        ffn(f"expert {int(e)} (slot {slot})", ew.w_gate, ew.w_up, ew.w_down, int(e), float(weights[slot]))
    if params.shared is not None:
        sh, gate = params.shared, 1.0
        if sh.gate is not None:
            gate = float(1 / (1 + np.exp(-(x_t.astype(np.float64) @ to_f64(sh.gate)).reshape(-1)[0])))
        ffn("shared expert", sh.w_gate, sh.w_up, sh.w_down, None, gate)
    flips, total = [], np.zeros_like(r)
    for _ in range(max_flips):
        left = r - total
        best = None
        for name, dl in cands:
            c = float(np.sign(left @ dl)) or 1.0
            rest = np.linalg.norm(left - c * dl)
            if best is None or rest < best[0]:
                best = (rest, name, c * dl)
        if best is None or best[0] > 0.5 * np.linalg.norm(left):
            break
        flips.append(best[1])
        total = total + best[2]
    return flips, total


def compare(gguf: Path, arch: str, dumps: list[Path], impl: str, explain: float | None = None) -> list[dict]:
    """For every MoE layer and dump: the float-mode and ggml-mode errors against llama.cpp;
    with ``explain``, for every token whose ggml-mode residual exceeds ``explain`` (relative
    to the layer's output norm), the tie flips that explain it (`_tie_flips`) and the
    layer's error once they are applied (``ggml_ties``)."""
    import jax
    import jax.numpy as jnp

    from jaxmoe import ExecConfig, moe_apply
    from jaxmoe.io import load_layer

    fn = jax.jit(moe_apply, static_argnums=(2, 3), static_argnames=("return_routing",))
    inp, out = io_names(arch)
    rows = []
    for layer in moe_layers(gguf):
        cfg, params = load_layer(gguf, layer=layer, dtype=jnp.float32)
        for dd in dumps:
            x = read_dump(dd / f"{inp}-{layer}.bin").reshape(-1, cfg.d_model)  # [d]: one row
            ref = read_dump(dd / f"{out}-{layer}.bin").reshape(-1, cfg.d_model)
            yf = fn(params, jnp.asarray(x), cfg, ExecConfig(impl=impl, activations="float"))
            yg, rt = fn(params, jnp.asarray(x), cfg, ExecConfig(impl=impl, activations="ggml"), return_routing=True)
            yg = np.asarray(yg, np.float64)
            row = {
                "layer": layer,
                "tokens": int(x.shape[0]),
                "float": rel_err(np.asarray(yf), ref),
                "ggml": rel_err(yg, ref),
            }
            if explain is not None:
                norm = np.linalg.norm(np.asarray(ref, np.float64))
                fixed, flips = yg.copy(), []
                for t in np.nonzero(np.linalg.norm(yg - ref, axis=1) > explain * norm)[0]:
                    ids, w = np.asarray(rt.expert_ids)[t], np.asarray(rt.weights, np.float64)[t]
                    f, delta = _tie_flips(params, cfg, x[t], ids, w, ref[t] - yg[t], margin=1e-3)
                    fixed[t] += delta
                    flips += [f"token {t}: {n}" for n in f]
                row.update(ggml_ties=rel_err(fixed, ref), flips=flips)
            rows.append(row)
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
    ap.add_argument(
        "--explain",
        type=float,
        default=1e-6,
        help="find the tie flips behind every token residual above this (relative to the layer); 0: off",
    )
    ap.add_argument("--fresh", action="store_true", help="rebuild the cached files and dumps")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--residency",
        action="store_true",
        help="instead of the parity table (no llama.cpp runs but llama-quantize / llama-imatrix for missing "
        "files): held / file bytes of the routed experts over every MoE layer and the first MoE layer's load peak",
    )
    a = ap.parse_args(argv)
    archs = [s for s in a.archs.split(",") if s]
    types = [s for s in a.types.split(",") if s and s.upper() != "F32"]
    for arch in archs:
        io_names(arch)
    tools = ["llama-quantize"] + ([] if a.residency else ["llama-moe-dump"])
    tools += ["llama-imatrix"] if any(t in IMATRIX_TYPES for t in types) else []
    for tool in tools:
        if not (a.bin / tool).is_file():
            raise SystemExit(
                f"{a.bin / tool} not found: pass llama.cpp's bin dir (../shared/anchors/llamacpp/setup.sh)"
            )
    if not (a.anchor / "make_tiny.py").is_file():
        raise SystemExit(f"{a.anchor}/make_tiny.py not found: pass --anchor")

    if a.residency:
        return residency_table(a, archs, types)
    results, notes = [], []
    explain = a.explain or None
    print(f"# {len(a.prompts)} prompts, impl={a.impl}, bar: ggml <= {a.tol:g} and float / ggml >= {a.min_ratio:g}")
    print("| arch | type | tokens | float mode | ggml mode | float / ggml | meets | tie flips | ggml, flips undone |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch in archs:
        files = build_files(arch, types, a.bin, a.anchor, a.work, a.fresh, a.threads)
        for t, gguf in files.items():
            dumps = [
                dump(a.bin, gguf, p, a.work / arch / "dump" / f"{t}-p{i}", a.fresh, a.threads)
                for i, p in enumerate(a.prompts)
            ]
            rows = compare(gguf, arch, dumps, a.impl, explain)
            ef, eg = max(r["float"] for r in rows), max(r["ggml"] for r in rows)
            ratio = ef / eg if eg > 0 else float("inf")
            ok = eg <= a.tol and (t == "F32" or ratio >= a.min_ratio)
            tokens = "/".join(str(n) for n in sorted({r["tokens"] for r in rows}))
            nflip = sum(len(r.get("flips", [])) for r in rows)
            et = max(r.get("ggml_ties", r["ggml"]) for r in rows)
            res = dict(
                arch=arch, type=t, tokens=tokens, float=ef, ggml=eg, ratio=ratio, ok=ok, flips=nflip, ggml_ties=et
            )
            results.append({**res, "layers": rows})
            mark = "yes" if ok else "**no**"
            tie = f"{nflip} | {et:.2e}" if explain else "- | -"
            print(f"| {arch} | {t} | {tokens} | {ef:.2e} | {eg:.2e} | {ratio:.0f} | {mark} | {tie} |", flush=True)
            for r in rows:
                if a.per_layer:
                    ties = f"{len(r['flips'])} | {r['ggml_ties']:.2e}" if explain else "- | -"
                    print(
                        f"|  | layer {r['layer']} | {r['tokens']} | {r['float']:.2e} | {r['ggml']:.2e} | | | {ties} |"
                    )
                notes += [f"{arch} {t} layer {r['layer']} ({r['tokens']} tokens): {f}" for f in r.get("flips", [])]
    if notes:
        print("\nhidden-activation codes and block scales on a rounding tie that llama.cpp rounded the other way:")
        print("\n".join(f"- {n}" for n in notes))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    bad = [f"{r['arch']} {r['type']}" for r in results if not r["ok"]]
    print(
        f"\n{len(results) - len(bad)} of {len(results)} rows meet the bar" + (f"; not: {', '.join(bad)}" if bad else "")
    )
    return 0 if not bad else 1


def residency_table(a, archs: list[str], types: list[str]) -> int:
    """``--residency``: one row per arch and file type (`residency`); exit status 1 when a
    quantized row's held / file exceeds ``RESIDENT_MAX`` or a load peak its bound."""
    lp = _load_peak()
    RATIO, SLACK = lp.RATIO, lp.SLACK  # noqa: N806

    print("# held / file: the routed experts of every MoE layer; load peak: the first MoE layer, fresh process")
    print(
        "| arch | type | expert tensor types | file KiB | held KiB | held / file | kept as | load peak MiB (layer) | peak within bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for arch in archs:
        files = build_files(arch, types, a.bin, a.anchor, a.work, a.fresh, a.threads)
        for t, gguf in files.items():
            r = dict(arch=arch, type=t, **residency(gguf))
            results.append(r)
            print(
                f"| {arch} | {t} | {' + '.join(r['types'])} | {r['file'] / 1024:.0f} | {r['held'] / 1024:.0f} | "
                f"{r['ratio']:.2f} | {', '.join(r['kinds'])} | {r['peak'] / 2**20:.1f} ({r['peak_layer']}) | "
                f"{'yes' if r['peak_ok'] else '**no**'} |",
                flush=True,
            )
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    bad = [
        f"{r['arch']} {r['type']}"
        for r in results
        if (r["type"] != "F32" and r["ratio"] > RESIDENT_MAX) or not r["peak_ok"]
    ]
    print(
        f"\n{len(results) - len(bad)} of {len(results)} rows: held / file <= {RESIDENT_MAX} (quantized files) and "
        f"load peak <= {RATIO} x held + {SLACK >> 20} MiB" + (f"; not: {', '.join(bad)}" if bad else "")
    )
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
