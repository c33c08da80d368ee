"""``jaxmoe inspect FILE_OR_DIR``: the MoE layout of a checkpoint, without loading weights.

For a GGUF file: the architecture, the MoE config jaxmoe derives from its metadata (the
llama.cpp semantics of `jaxmoe.io.gguf`), and per layer whether it is MoE or dense and
each expert / router / shared-expert tensor's GGUF type, shape, bytes and the bytes
``jaxmoe.from_pretrained`` holds for it (`held_bytes`: the file's bytes for the types that
stay in their blocks, float32 for the rest).

For a Hugging Face or MLX checkpoint directory: ``model_type`` and the MoE fields of
``config.json`` (a nested ``text_config`` included), and per layer each MoE tensor's
dtype, shape and bytes read from the safetensors headers (``safe_open``, no tensor
data). Per-expert tensors (``experts.{j}.gate_proj.weight``) are folded into one row
``experts.*.gate_proj.weight`` with the expert count.

`inspect_path` returns a plain `Report`; `cli_main` prints it as rich tables (or JSON
with ``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from safetensors import safe_open

from jaxmoe.io import gguf as jg
from jaxmoe.io.errors import CheckpointError

#: config.json keys that describe the MoE layers (HF and mlx-lm spellings).
HF_MOE_KEYS = (
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "intermediate_size",
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
    "norm_topk_prob",
    "scoring_func",
    "topk_method",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "mlp_only_layers",
    "moe_layer_freq",
    "hidden_size",
    "num_hidden_layers",
    "swiglu_limit",
    "router_aux_loss_coef",
    "quantization",
)

_GGUF_MOE = re.compile(
    r"^blk\.(\d+)\.(ffn_gate_inp(_shexp)?|ffn_(gate|up|down|gate_up)_(exps|shexp|chexps)|"
    r"exp_probs_b|ffn_(gate|up|down))(\.\w+)?$"
)
_HF_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")
_HF_MOE_PART = re.compile(
    r"(^|\.)(experts|switch_mlp|shared_experts?|shared_expert_gate|block_sparse_moe|router)"
    r"(\.|$)|(^|\.)mlp\.gate\."
)
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")

_ST_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 0.5,
}


@dataclasses.dataclass(frozen=True)
class TensorRow:
    """One (possibly folded) tensor: ``count`` tensors of ``shape`` holding ``nbytes`` in all."""

    layer: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    count: int = 1
    held: int | None = None  # GGUF: the bytes from_pretrained holds (`held_bytes`)


@dataclasses.dataclass(frozen=True)
class Report:
    """What `cli_main` prints.

    Attributes:
      path: the file or directory.
      format: ``gguf``, ``hf`` or ``mlx``.
      arch: GGUF ``general.architecture`` or HF ``model_type``.
      fields: MoE fields (GGUF: the derived `MoEConfig`, flattened; HF: ``config.json``).
      layers: ``{layer: "moe" | "dense"}`` for every layer.
      tensors: the MoE tensor rows, by layer.
      note: a problem worth printing (e.g. a config jaxmoe cannot derive).
    """

    path: str
    format: str
    arch: str
    fields: dict[str, Any]
    layers: dict[int, str]
    tensors: tuple[TensorRow, ...]
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = {str(k): v for k, v in self.layers.items()}
        return d


def held_bytes(qtype, shape: tuple[int, ...], nbytes: int) -> int:
    """The bytes ``jaxmoe.from_pretrained`` (float32 dtype) holds for a GGUF tensor of
    ``qtype``, numpy ``shape`` and ``nbytes`` file bytes: the file's bytes for Q8_0 (int8
    codes and float16 scales: 34 bytes per 32 values, as the file) and the block types kept
    as their bytes (`jaxmoe.io.gguf_codec.BLOCK_TYPES`, Q4_0 among them); float32 for every
    other type."""
    from gguf import GGMLQuantizationType as QT

    from jaxmoe.io import gguf_codec as gc

    if qtype == QT.Q8_0 or qtype in gc.BLOCK_TYPES:
        return nbytes
    return 4 * int(np.prod(shape, dtype=np.int64))


def inspect_gguf(path: str | Path) -> Report:
    """The `Report` of a GGUF file (header only; no tensor data is read)."""
    reader = jg.open_reader(path)
    meta = jg.read_metadata(reader)
    arch = str(meta.get("general.architecture", "?"))
    note, fields, dense = "", {}, set()
    n_layers = None
    try:
        cfg = jg.config_from_reader(reader, path)
        fields = _flatten(cfg.to_dict())
        dense = set(cfg.dense_layers)
        n_layers = cfg.num_layers
    except CheckpointError as e:
        note = str(e)
        fields = {k: v for k, v in meta.items() if k.startswith(f"{arch}.") and not isinstance(v, list)}
    rows = []
    for t in reader.tensors:
        m = _GGUF_MOE.match(t.name)
        if not m:
            continue
        layer = int(m.group(1))
        rows.append(
            TensorRow(
                layer,
                t.name[len(f"blk.{layer}.") :],
                t.tensor_type.name,
                tuple(int(x) for x in reversed(t.shape.tolist())),
                int(t.n_bytes),
                held=held_bytes(t.tensor_type, tuple(int(x) for x in t.shape.tolist()), int(t.n_bytes)),
            )
        )
    if n_layers is None:
        n_layers = 1 + max((r.layer for r in rows), default=-1)
    layers = {i: ("dense" if i in dense else "moe") for i in range(n_layers)}
    return Report(str(path), "gguf", arch, fields, layers, tuple(sorted(rows, key=lambda r: (r.layer, r.name))), note)


def _flatten(d: dict[str, Any], pre: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{pre}{k}."))
        else:
            out[pre + k] = v
    return out


def _safetensors_files(p: Path) -> list[Path]:
    index = p / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({p / name for name in weight_map.values()})
        missing = [str(x.name) for x in files if not x.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard(s) {missing} named in the weight map are missing")
        return files
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{p}: no *.safetensors files")
    return files


def inspect_dir(path: str | Path) -> Report:
    """The `Report` of an HF / MLX checkpoint directory (config.json + safetensors headers)."""
    p = Path(path)
    cfgp = p / "config.json"
    if not cfgp.is_file():
        raise CheckpointError(f"{p}: a checkpoint directory needs a config.json")
    with open(cfgp) as f:
        raw = json.load(f)
    merged = {**raw, **raw.get("text_config", {})} if isinstance(raw.get("text_config"), dict) else raw
    fmt = "mlx" if "quantization" in raw else "hf"
    fields = {k: merged[k] for k in HF_MOE_KEYS if k in merged}
    n_layers = merged.get("num_hidden_layers")
    folded: dict[tuple[int, str, str, tuple[int, ...]], list[int]] = {}
    for fp in _safetensors_files(p):
        try:
            with safe_open(str(fp), framework="numpy") as st:
                for key in st.keys():
                    m = _HF_LAYER.match(key)
                    if not m or not _HF_MOE_PART.search("." + m.group(2)):
                        continue
                    sl = st.get_slice(key)
                    shape, dt = tuple(int(x) for x in sl.get_shape()), str(sl.get_dtype())
                    name = _PER_EXPERT.sub(".experts.*.", "." + m.group(2))[1:]
                    nbytes = int(np.prod(shape, dtype=np.int64) * _ST_DTYPE_BYTES.get(dt, 0))
                    acc = folded.setdefault((int(m.group(1)), name, dt, shape), [0, 0])
                    acc[0] += 1
                    acc[1] += nbytes
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError subclasses only Exception
            raise CheckpointError(f"{fp}: cannot read the safetensors header ({type(e).__name__}: {e})") from e
    rows = tuple(
        TensorRow(layer, name, dt, shape, acc[1], acc[0]) for (layer, name, dt, shape), acc in sorted(folded.items())
    )
    moe_layers = {r.layer for r in rows if "experts" in r.name or "switch_mlp" in r.name}
    if not isinstance(n_layers, int):
        n_layers = 1 + max((r.layer for r in rows), default=-1)
    layers = {i: ("moe" if i in moe_layers else "dense") for i in range(n_layers)}
    return Report(str(p), fmt, str(merged.get("model_type", raw.get("model_type", "?"))), fields, layers, rows)


def inspect_path(path: str | Path) -> Report:
    """A GGUF file or a checkpoint directory -> `Report`."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    if p.is_dir():
        return inspect_dir(p)
    return inspect_gguf(p)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(report: Report, console, layers: list[int] | None = None) -> None:
    """Prints ``report`` on a rich ``console`` (optionally only some layers)."""
    head = Table(title=f"{report.path}  [{report.format}]  arch={report.arch}", show_header=True)
    head.add_column("field")
    head.add_column("value", overflow="fold")
    for k, v in report.fields.items():
        head.add_row(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    n_moe = sum(v == "moe" for v in report.layers.values())
    head.add_row("layers", f"{len(report.layers)} ({n_moe} MoE, {len(report.layers) - n_moe} dense)")
    console.print(head)
    if report.note:
        console.print(f"note: {report.note}")
    shape_note = "numpy order (GGUF dims reversed)" if report.format == "gguf" else "as stored"
    tab = Table(title=f"MoE tensors per layer (shapes in {shape_note})", show_header=True)
    for col, kw in (
        ("layer", dict(justify="right")),
        ("kind", {}),
        ("tensor", dict(overflow="fold")),
        ("type", {}),
        ("shape", {}),
        ("count", dict(justify="right")),
        ("bytes", dict(justify="right")),
        ("size", dict(justify="right")),
        *([("held", dict(justify="right"))] if report.format == "gguf" else []),
    ):
        tab.add_column(col, **kw)
    by_layer: dict[int, list[TensorRow]] = {}
    for r in report.tensors:
        by_layer.setdefault(r.layer, []).append(r)
    total = held = 0
    empty = []
    for layer in sorted(set(report.layers) | set(by_layer)):
        if layers is not None and layer not in layers:
            continue
        kind = report.layers.get(layer, "?")
        rows = by_layer.get(layer, [])
        if not rows:
            empty.append(layer)
        for i, r in enumerate(rows):
            total += r.nbytes
            held += r.held or 0
            tab.add_row(
                str(layer) if i == 0 else "",
                kind if i == 0 else "",
                r.name,
                r.dtype,
                "x".join(map(str, r.shape)),
                str(r.count),
                str(r.nbytes),
                _human(r.nbytes),
                *([_human(r.held) if r.held is not None else "?"] if report.format == "gguf" else []),
            )
        tab.add_section()
    console.print(tab)
    if empty:
        console.print(f"layers without MoE tensors in this checkpoint: {_ranges(empty)}")
    console.print(f"MoE tensor bytes shown: {total} ({_human(total)})")
    if report.format == "gguf":
        console.print(f"bytes from_pretrained holds for them (float32 dtype): {held} ({_human(held)})")


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def cli_main(argv: list[str] | None = None) -> int:
    """``jaxmoe inspect FILE_OR_DIR [--layer N ...] [--json]``; returns the exit code."""
    ap = argparse.ArgumentParser(
        prog="jaxmoe inspect", description="Print the MoE layout of a GGUF file or an HF / MLX checkpoint dir."
    )
    ap.add_argument("path", help="a .gguf file or a directory with config.json and *.safetensors")
    ap.add_argument("--layer", type=int, action="append", help="only these layers (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    try:
        report = inspect_path(args.path)
    except (FileNotFoundError, ValueError) as e:
        print(f"jaxmoe inspect: {e}", file=sys.stderr)
        return 2
    if args.json:
        d = report.to_json()
        if args.layer is not None:
            d["tensors"] = [t for t in d["tensors"] if t["layer"] in args.layer]
        print(json.dumps(d, indent=1, default=str))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)
    render(report, console, args.layer)
    return 0
