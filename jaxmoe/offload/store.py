"""Expert stores: routed experts of every layer stay on storage, read one expert at a time.

A store holds a model's layer stack split in two:

- the *resident* part of each layer (`ResidentLayer`: pre-MoE RMSNorm weight, router,
  selection bias, shared expert), small, loaded once and kept on device;
- the *routed experts*, read from a memory-mapped file one ``(layer, expert)`` at a time
  by `ExpertStore.load_expert`, quantized as stored (an int8 / int4 expert comes back as
  `jaxmoe.quant.QuantizedTensor` leaves, never dequantized on the way).

Two backends:

- `SafetensorsStore`: a directory written by `write_safetensors_store`; one
  ``layer_{l:04d}.safetensors`` file per layer with one tensor per expert per projection
  (``experts.{e}.w_gate`` or ``experts.{e}.w_gate.qdata/.scales/.biases``), a 64-bit
  checksum of every tensor in the file's header metadata, ``resident.safetensors`` and
  ``store.json`` (config, layer count, storage kind). Tensors are read through
  ``safetensors.safe_open(...).get_slice`` (memory-mapped). ``kind="keep"`` writes
  the experts as they are held (a checkpoint's MXFP4 or FP8 experts in their bytes) and
  records each projection's kind and part shapes in ``store.json``.
- `GGUFStore`: a GGUF file read with ``gguf.GGUFReader`` (memory-mapped): llama.cpp's
  ``blk.{l}.ffn_{gate,up,down}_exps.weight`` ``(E, F, d)`` / ``(E, d, F)``, sliced per
  expert and turned to the ``x @ W`` convention by the GGUF block codec the loader uses
  (`jaxmoe.io.gguf_codec`). F32 / F16 stay float; Q8_0 becomes an ``int8``
  `QuantizedTensor`, Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K (and the other
  `jaxmoe.quant.GGUF_BLOCKS` types) a GGUF block one (the raw block bytes), all bit-exact against ``gguf.quants.dequantize``; other
  types are dequantized with gguf-py.
  `write_gguf_store` writes such a file (with the jaxmoe config as JSON metadata).

Every failure to produce an expert raises `ExpertStoreError` (a ``ValueError``) naming
the layer, the expert, the tensor and the file: a missing file or tensor, a tensor of the
wrong shape, an unreadable or truncated file, a checksum mismatch, non-finite scales.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import gguf
import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxmoe.config import MoEConfig, config_from_dict
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.io import gguf_codec
from jaxmoe.io.gguf import load_config as load_gguf_config
from jaxmoe.params import params_from_sampler
from jaxmoe.quant import QuantizedTensor, quantize_int4_affine, quantize_int8

PROJS = ("w_gate", "w_up", "w_down")
BIASES = ("b_gate", "b_up", "b_down")
STORE_KINDS = ("float32", "float16", "int8", "int4")
#: `write_safetensors_store`'s kind that writes every projection as it is held: a
#: `QuantizedTensor` of any kind (GGUF block bytes, MXFP4, block-scaled FP8, ...) part by
#: part, a float array in its dtype.
KEEP = "keep"
FORMAT = "jaxmoe-offload-v1"


class ExpertStoreError(ValueError):
    """An expert (or resident tensor) could not be read; the message names layer and expert."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResidentLayer:
    """The always-resident part of one layer.

    Attributes:
      norm: ``[d]`` RMSNorm weight applied to the residual stream before the MoE layer.
      w_router: ``[d, E]``.
      b_router: ``[E]`` or None.
      selection_bias: ``[E]`` or None.
      shared: `SharedWeights` or None.
    """

    norm: Any
    w_router: Any
    b_router: Any = None
    selection_bias: Any = None
    shared: SharedWeights | None = None


def expert_nbytes(ew: ExpertWeights) -> int:
    """Bytes of one expert's (or a stack's) arrays as stored: quantized size for quantized leaves."""
    total = 0
    for a in jax.tree.leaves(ew):
        total += int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
    return total


class ExpertStore:
    """Base class: ``cfg``, ``num_layers``, `resident`, `load_expert`, `expert_nbytes`."""

    cfg: MoEConfig
    num_layers: int
    kind: str
    path: Path

    def resident(self, layer: int) -> ResidentLayer:
        raise ExpertStoreError(f"{type(self).__name__} does not define resident()")

    def load_expert(self, layer: int, expert: int) -> ExpertWeights:
        """One expert as host (numpy) arrays: ``w_gate, w_up [d, F]``, ``w_down [F, d]`` (or
        `QuantizedTensor` leaves with numpy data), biases ``[F]`` / ``[d]`` when the config has them."""
        raise ExpertStoreError(f"{type(self).__name__} does not define load_expert()")

    def expert_nbytes(self, layer: int = 0) -> int:
        """Bytes one expert of ``layer`` occupies once loaded (as stored; measured once per layer)."""
        cache = self.__dict__.setdefault("_nbytes", {})
        if layer not in cache:
            cache[layer] = expert_nbytes(self.load_expert(layer, 0))
        return cache[layer]

    def total_expert_bytes(self) -> int:
        return sum(self.expert_nbytes(l) * self.cfg.num_experts for l in range(self.num_layers))

    def _check_index(self, layer: int, expert: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ExpertStoreError(
                f"layer {layer}, expert {expert}: layer outside [0, {self.num_layers}) in {self.path}"
            )
        if not 0 <= expert < self.cfg.num_experts:
            raise ExpertStoreError(
                f"layer {layer}, expert {expert}: expert outside [0, {self.cfg.num_experts}) in {self.path}"
            )

    def load_stack(self, layer: int) -> ExpertWeights:
        """All experts of ``layer`` stacked ``[E, ...]`` (host arrays): the fully resident reference."""
        return stack_experts([self.load_expert(layer, e) for e in range(self.cfg.num_experts)], np)


def stack_experts(experts: list[ExpertWeights], xp=np) -> ExpertWeights:
    """Stacks per-expert weights into ``[n, ...]`` leaves (``xp`` = numpy or jax.numpy)."""
    if not experts:
        raise ValueError("stack_experts: no experts given")
    return jax.tree.map(lambda *xs: xp.stack(xs), *experts)


# --------------------------------------------------------------------------- safetensors


def _layer_file(root: Path, layer: int) -> Path:
    return root / f"layer_{layer:04d}.safetensors"


def _checksum(a: np.ndarray) -> int:
    """64-bit checksum of ``a``'s bytes at memory speed: the wrapping sum of its 64-bit words
    (any single flipped bit changes it) mixed with a block-position-weighted sum of 512-byte
    block sums (moved blocks change it) and the byte length (truncation). zlib.crc32 was
    measured at 1-3.4 ms per MB here, on the decode path's critical section."""
    b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    n = b.size
    pad = (-n) % 512
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    blocks = np.add.reduce(b.view(np.uint64).reshape(-1, 64), axis=1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        s1 = np.add.reduce(blocks, dtype=np.uint64)
        s2 = np.add.reduce(blocks * np.arange(1, 2 * blocks.size, 2, dtype=np.uint64), dtype=np.uint64)
        return int(s1 ^ (s2 * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(n))


def _quantize(w: np.ndarray, kind: str, group_size: int):
    if kind == "float32":
        return np.asarray(w, np.float32)
    if kind == "float16":
        return np.asarray(w, np.float16)
    if kind == "int8":
        return quantize_int8(w, group_size)
    return quantize_int4_affine(w, group_size)


def _stored(a: np.ndarray) -> np.ndarray:
    """``a`` as safetensors' numpy writer takes it: a dtype numpy lacks (``ml_dtypes``'
    float8 / bfloat16) as unsigned integers of its width, the bytes unchanged."""
    a = np.ascontiguousarray(a)
    return a if a.dtype.isbuiltin == 1 else a.view(f"u{a.dtype.itemsize}")


def _dtype(name: str) -> np.dtype:
    """The dtype named ``name`` (numpy's or ``ml_dtypes``')."""
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _parts(w) -> dict[str, Any]:
    """A kept projection's parts, as held (numpy or jax arrays): ``qdata`` / ``scales`` /
    ``biases`` of a `QuantizedTensor` (the ones it has), ``value`` of a float array."""
    if not isinstance(w, QuantizedTensor):
        return {"value": w}
    parts = {"qdata": w.qdata, "scales": w.scales, "biases": w.biases}
    return {k: v for k, v in parts.items() if v is not None}


def _keep_spec(ew: ExpertWeights) -> dict:
    """``store.json``'s record of kept projections: per projection its kind (``float`` for
    an array), group size and each part's per-expert shape and dtype."""
    spec = {}
    for name in PROJS:
        w = getattr(ew, name)
        parts = {k: [list(v.shape[1:]), np.dtype(v.dtype).name] for k, v in _parts(w).items()}
        q = isinstance(w, QuantizedTensor)
        spec[name] = {"kind": w.kind if q else "float", "group_size": w.group_size if q else 0, "parts": parts}
    return spec


def write_safetensors_store(
    root, cfg: MoEConfig, layers: list, *, kind: str = "float32", group_size: int = 32
) -> SafetensorsStore:
    """Writes a layer stack to ``root`` and returns the opened `SafetensorsStore`.

    Args:
      root: directory (created).
      cfg: the per-layer `MoEConfig` (every layer shares it).
      layers: one ``(ResidentLayer, ExpertWeights)`` per layer (a list, or any iterable,
        e.g. a generator that loads one layer at a time); float weights ``[E, d, F]``
        etc., or already `QuantizedTensor` leaves (then ``kind`` must name their kind, or
        be ``keep``).
      kind: ``float32``, ``float16``, ``int8`` (Q8_0 rule), ``int4`` (MLX affine rule), or
        ``keep``: every projection as it is held, its bytes unchanged (each `QuantizedTensor`
        of any kind, e.g. gpt-oss MXFP4 or DeepSeek-V3 FP8 from `jaxmoe.from_pretrained`,
        and float arrays in their dtype); every layer must hold the same kinds and shapes.
      group_size: quantization group along the input dimension (not used by ``keep``).
    """
    if kind not in (*STORE_KINDS, KEEP):
        raise ValueError(f"write_safetensors_store: unknown kind {kind!r}; expected one of {(*STORE_KINDS, KEEP)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    resident: dict[str, np.ndarray] = {}
    spec = None
    num_layers = 0
    for l, (res, ew) in enumerate(layers):  # any iterable: one layer held at a time
        num_layers += 1
        ew.check(cfg)
        tensors: dict[str, np.ndarray] = {}
        if kind == KEEP:
            mine = _keep_spec(ew)
            spec = spec or mine
            if mine != spec:
                raise ValueError(
                    f"write_safetensors_store(kind='keep'): layer {l}'s experts {mine} differ from layer 0's {spec}"
                )
        for name in PROJS:
            w = getattr(ew, name)
            if kind == KEEP:
                for part, v in _parts(w).items():
                    for e in range(cfg.num_experts):
                        tensors[f"experts.{e}.{name}.{part}"] = _stored(np.asarray(v[e]))
                continue
            if isinstance(w, QuantizedTensor):
                if w.kind != kind:
                    raise ValueError(
                        f"layer {l}: ExpertWeights.{name} is quantized {w.kind!r} but kind={kind!r} "
                        "(kind='keep' writes it as it is)"
                    )
                q = w
            else:
                q = _quantize(np.asarray(w, np.float32), kind, group_size)
            for e in range(cfg.num_experts):
                key = f"experts.{e}.{name}"
                if isinstance(q, QuantizedTensor):
                    tensors[key + ".qdata"] = np.asarray(q.qdata[e])
                    tensors[key + ".scales"] = np.asarray(q.scales[e])
                    if q.biases is not None:
                        tensors[key + ".biases"] = np.asarray(q.biases[e])
                else:
                    tensors[key] = np.ascontiguousarray(q[e])
        for name in BIASES:
            b = getattr(ew, name)
            if b is not None:
                for e in range(cfg.num_experts):
                    tensors[f"experts.{e}.{name}"] = np.asarray(b[e], np.float32)
        meta = {
            "format": FORMAT,
            "layer": str(l),
            "kind": kind,
            "checksum64": json.dumps({k: _checksum(v) for k, v in tensors.items()}),
        }
        save_file(tensors, str(_layer_file(root, l)), metadata=meta)
        pre = f"layers.{l}."
        resident[pre + "norm"] = np.asarray(res.norm, np.float32)
        resident[pre + "w_router"] = np.asarray(res.w_router, np.float32)
        for name in ("b_router", "selection_bias"):
            if getattr(res, name) is not None:
                resident[pre + name] = np.asarray(getattr(res, name), np.float32)
        if res.shared is not None:
            for name in ("w_gate", "w_up", "w_down", "gate"):
                v = getattr(res.shared, name)
                if v is not None:
                    resident[pre + "shared." + name] = np.asarray(v, np.float32)
    save_file(resident, str(root / "resident.safetensors"), metadata={"format": FORMAT})
    info = {
        "format": FORMAT,
        "kind": kind,
        "group_size": group_size,
        "num_layers": num_layers,
        "config": cfg.to_dict(),
    }
    if spec is not None:
        info["projections"] = spec
    (root / "store.json").write_text(json.dumps(info, indent=1))
    return SafetensorsStore(root)


def write_checkpoint_store(checkpoint, root, layers=None) -> SafetensorsStore:
    """A checkpoint's MoE layers as a ``keep`` `SafetensorsStore` at ``root``, loaded one
    layer at a time by `jaxmoe.io.load_layer` (GGUF, Hugging Face safetensors, MLX): each
    layer's routed experts in the bytes the loader holds (gpt-oss MXFP4, block-scaled FP8,
    GGUF blocks, ...), its router and shared expert resident. Store layer ``i`` is the
    checkpoint's MoE layer ``layers[i]`` (default: every MoE layer of the checkpoint's
    config, dense ones left out). The loaders read the MoE block only, not the norm before
    it: the store's norm weights are ones (the GGUF store does the same).

    Raises ValueError naming the layer for a dense layer index or a layer whose config or
    expert kinds differ from the first one's."""
    from jaxmoe.io import load_config, load_layer

    whole = load_config(checkpoint)
    layers = [l for l in range(whole.num_layers) if whole.is_moe_layer(l)] if layers is None else list(layers)
    if not layers:
        raise ValueError(f"write_checkpoint_store: {checkpoint} has no MoE layer to store")
    for l in layers:
        if not whole.is_moe_layer(int(l)):
            raise ValueError(f"write_checkpoint_store: layer {l} of {checkpoint} is dense, not MoE")
    loaded = [load_layer(checkpoint, layer=int(layers[0]))]  # popped when written: one layer held at a time
    first_cfg = loaded[0][0]

    def stack():
        for i, l in enumerate(layers):
            cfg, p = loaded.pop() if i == 0 else load_layer(checkpoint, layer=int(l))
            if cfg != first_cfg:
                raise ValueError(
                    f"write_checkpoint_store: layer {l} of {checkpoint} has config {cfg}, unlike layer "
                    f"{layers[0]}'s {first_cfg}"
                )
            yield (
                ResidentLayer(np.ones(cfg.d_model, np.float32), p.w_router, p.b_router, p.selection_bias, p.shared),
                p.experts,
            )

    return write_safetensors_store(root, first_cfg, stack(), kind=KEEP)


class SafetensorsStore(ExpertStore):
    """Experts in a directory of per-layer safetensors files (see `write_safetensors_store`).

    Args:
      root: the store directory.
      verify: check every expert tensor's checksum against the file header on load.
    """

    def __init__(self, root, *, verify: bool = True):
        self.path = Path(root)
        info_p = self.path / "store.json"
        if not info_p.is_file():
            raise ExpertStoreError(f"expert store {self.path}: store.json not found")
        try:
            info = json.loads(info_p.read_text())
            self.cfg = config_from_dict(info["config"], source=str(info_p))
            self.num_layers = int(info["num_layers"])
            self.kind = info["kind"]
            self.group_size = int(info["group_size"])
            self.projections = info["projections"] if self.kind == KEEP else None
            if self.projections is not None:
                for name in PROJS:
                    for shape, dt in self.projections[name]["parts"].values():
                        _dtype(dt)
                        tuple(int(v) for v in shape)
        except (KeyError, TypeError, ValueError, AttributeError, json.JSONDecodeError) as e:
            raise ExpertStoreError(f"expert store {self.path}: store.json is malformed ({e!r})") from None
        if self.kind not in (*STORE_KINDS, KEEP):
            raise ExpertStoreError(f"expert store {self.path}: unknown kind {self.kind!r}")
        self.verify = verify
        self._handles: dict[int, tuple[Any, dict[str, int]]] = {}
        self._lock = threading.Lock()

    def _handle(self, layer: int, expert: int):
        with self._lock:
            if layer in self._handles:
                return self._handles[layer]
            p = _layer_file(self.path, layer)
            if not p.is_file():
                raise ExpertStoreError(f"layer {layer}, expert {expert}: store file {p} not found")
            try:
                h = safe_open(str(p), framework="numpy")
                meta = h.metadata() or {}
                crcs = json.loads(meta.get("checksum64", "{}"))
            except Exception as e:  # safetensors raises its own error type on bad headers / sizes
                raise ExpertStoreError(
                    f"layer {layer}, expert {expert}: store file {p} is unreadable or truncated ({e})"
                ) from None
            self._handles[layer] = (h, crcs)
            return self._handles[layer]

    def _tensor(self, layer: int, expert: int, key: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        h, crcs = self._handle(layer, expert)
        p = _layer_file(self.path, layer)
        try:
            a = h.get_slice(key)[:]  # copied out of the memory map (get_tensor measured ~30x slower here)
        except Exception as e:
            if key not in h.keys():
                raise ExpertStoreError(f"layer {layer}, expert {expert}: tensor {key} is missing from {p}") from None
            raise ExpertStoreError(f"layer {layer}, expert {expert}: tensor {key} in {p} is unreadable ({e})") from None
        if tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(dtype):
            raise ExpertStoreError(
                f"layer {layer}, expert {expert}: tensor {key} in {p} has shape {a.shape} "
                f"{a.dtype}, expected {tuple(shape)} {np.dtype(dtype)} (wrong size)"
            )
        if self.verify:
            want = crcs.get(key)
            if want is None:
                raise ExpertStoreError(
                    f"layer {layer}, expert {expert}: tensor {key} in {p} has no checksum in the header"
                )
            got = _checksum(a)
            if got != want:
                raise ExpertStoreError(
                    f"layer {layer}, expert {expert}: tensor {key} in {p} is corrupt "
                    f"(checksum {got:016x} != {want:016x})"
                )
        return a

    def _proj(self, layer: int, expert: int, name: str):
        d, f = self.cfg.d_model, self.cfg.expert_dim
        n_in, n_out = (f, d) if name == "w_down" else (d, f)
        key = f"experts.{expert}.{name}"
        if self.projections is not None:
            return self._kept(layer, expert, name, (n_in, n_out))
        if self.kind in ("float32", "float16"):
            return self._tensor(layer, expert, key, (n_in, n_out), self.kind)
        g = self.group_size
        if self.kind == "int8":
            q = self._tensor(layer, expert, key + ".qdata", (n_out, n_in), np.int8)
            s = self._tensor(layer, expert, key + ".scales", (n_out, n_in // g), np.float16)
            return QuantizedTensor(q, s, None, "int8", g)
        q = self._tensor(layer, expert, key + ".qdata", (n_out, n_in // 2), np.uint8)
        s = self._tensor(layer, expert, key + ".scales", (n_out, n_in // g), np.float32)
        b = self._tensor(layer, expert, key + ".biases", (n_out, n_in // g), np.float32)
        return QuantizedTensor(q, s, b, "int4", g)

    def _kept(self, layer: int, expert: int, name: str, shape: tuple[int, int]):
        """Projection ``name`` of a ``keep`` store: its parts as `store.json` records them,
        viewed back as their dtypes, then checked as a `QuantizedTensor` of ``shape``."""
        assert self.projections is not None
        spec = self.projections[name]
        key = f"experts.{expert}.{name}"
        parts = {}
        for part, (pshape, dt) in spec["parts"].items():
            want = _dtype(dt)
            stored = want if want.isbuiltin == 1 else np.dtype(f"u{want.itemsize}")
            parts[part] = self._tensor(layer, expert, f"{key}.{part}", tuple(pshape), stored).view(want)
        try:
            if spec["kind"] == "float":
                w = parts["value"]
            else:
                w = QuantizedTensor(
                    parts["qdata"], parts.get("scales"), parts.get("biases"), spec["kind"], int(spec["group_size"])
                )
        except (KeyError, ValueError) as e:
            raise ExpertStoreError(f"layer {layer}, expert {expert}: {key} in {self.path} is malformed ({e})") from None
        if tuple(w.shape) != shape:
            raise ExpertStoreError(
                f"layer {layer}, expert {expert}: {key} in {self.path} has logical shape {tuple(w.shape)}, "
                f"expected {shape}"
            )
        return w

    def load_expert(self, layer: int, expert: int) -> ExpertWeights:
        self._check_index(layer, expert)
        ws = [self._proj(layer, expert, n) for n in PROJS]
        bs = [None, None, None]
        if self.cfg.expert_bias:
            d, f = self.cfg.d_model, self.cfg.expert_dim
            bs = [
                self._tensor(layer, expert, f"experts.{expert}.{n}", (s,), np.float32)
                for n, s in zip(BIASES, (f, f, d))
            ]
        return ExpertWeights(*ws, *bs)

    def resident(self, layer: int) -> ResidentLayer:
        p = self.path / "resident.safetensors"
        if not 0 <= layer < self.num_layers:
            raise ExpertStoreError(f"layer {layer}: outside [0, {self.num_layers}) in {self.path}")
        try:
            h = safe_open(str(p), framework="numpy")
            keys = set(h.keys())
        except Exception as e:
            raise ExpertStoreError(f"layer {layer}: resident file {p} is unreadable ({e})") from None
        pre = f"layers.{layer}."

        def get(name, required=True):
            if pre + name not in keys:
                if required:
                    raise ExpertStoreError(f"layer {layer}: resident tensor {pre + name} is missing from {p}")
                return None
            return h.get_tensor(pre + name)

        cfg = self.cfg
        shared = None
        if cfg.shared_expert_dim:
            shared = SharedWeights(
                get("shared.w_gate"),
                get("shared.w_up"),
                get("shared.w_down"),
                get("shared.gate", cfg.shared_expert_gate),
            )
        return ResidentLayer(
            get("norm"),
            get("w_router"),
            get("b_router", cfg.router.router_bias),
            get("selection_bias", cfg.router.use_selection_bias),
            shared,
        )


# --------------------------------------------------------------------------- GGUF

_GGUF_PROJ = {"w_gate": "ffn_gate_exps", "w_up": "ffn_up_exps", "w_down": "ffn_down_exps"}
_GGUF_BIAS = {"b_gate": "ffn_gate_exps.bias", "b_up": "ffn_up_exps.bias", "b_down": "ffn_down_exps.bias"}
GGUF_CONFIG_KEY = "jaxmoe.config"


def write_gguf_store(path, cfg: MoEConfig, layers: list, *, qtype: str = "Q8_0", arch: str = "jaxmoe"):
    """Writes a layer stack as a GGUF file with llama.cpp tensor names; returns a `GGUFStore`.

    Args:
      path: the ``.gguf`` file.
      cfg: the per-layer config (also stored as JSON under ``jaxmoe.config``).
      layers: one ``(ResidentLayer, ExpertWeights)`` per layer, float weights.
      qtype: the expert tensors' GGML type: ``F32``, ``F16``, ``Q8_0`` or ``Q4_0``
        (quantized with ``gguf.quants.quantize``). Resident tensors are F32.
    """
    qt = getattr(gguf.GGMLQuantizationType, qtype, None)
    if qt is None or qtype not in ("F32", "F16", "Q8_0", "Q4_0"):
        raise ValueError(f"write_gguf_store: qtype must be F32, F16, Q8_0 or Q4_0, got {qtype!r}")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(len(layers))
    w.add_embedding_length(cfg.d_model)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.top_k)
    w.add_expert_feed_forward_length(cfg.expert_dim)
    w.add_string(GGUF_CONFIG_KEY, json.dumps(cfg.to_dict()))
    for l, (res, ew) in enumerate(layers):
        ew.check(cfg)
        pre = f"blk.{l}."
        for name, gname in _GGUF_PROJ.items():
            a = np.swapaxes(np.asarray(getattr(ew, name), np.float32), -1, -2)  # [E, out, in]
            a = np.ascontiguousarray(a)
            if qtype == "F32":
                w.add_tensor(pre + gname + ".weight", a)
            elif qtype == "F16":
                w.add_tensor(pre + gname + ".weight", a.astype(np.float16))
            else:
                w.add_tensor(pre + gname + ".weight", gguf.quants.quantize(a, qt), raw_dtype=qt)
        for name, gname in _GGUF_BIAS.items():
            b = getattr(ew, name)
            if b is not None:
                w.add_tensor(pre + gname, np.asarray(b, np.float32))
        w.add_tensor(pre + "ffn_norm.weight", np.asarray(res.norm, np.float32))
        w.add_tensor(pre + "ffn_gate_inp.weight", np.ascontiguousarray(np.asarray(res.w_router, np.float32).T))
        if res.b_router is not None:
            w.add_tensor(pre + "ffn_gate_inp.bias", np.asarray(res.b_router, np.float32))
        if res.selection_bias is not None:
            w.add_tensor(pre + "exp_probs_b.bias", np.asarray(res.selection_bias, np.float32))
        if res.shared is not None:
            sh = res.shared
            w.add_tensor(pre + "ffn_gate_shexp.weight", np.ascontiguousarray(np.asarray(sh.w_gate, np.float32).T))
            w.add_tensor(pre + "ffn_up_shexp.weight", np.ascontiguousarray(np.asarray(sh.w_up, np.float32).T))
            w.add_tensor(pre + "ffn_down_shexp.weight", np.ascontiguousarray(np.asarray(sh.w_down, np.float32).T))
            if sh.gate is not None:
                w.add_tensor(pre + "ffn_gate_inp_shexp.weight", np.asarray(sh.gate, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFStore(path)


class GGUFStore(ExpertStore):
    """Experts sliced from a memory-mapped GGUF file (llama.cpp names).

    Store layer ``l`` is the ``l``-th block that has a router (``blocks[l]``), so leading
    dense blocks are skipped; error messages name the store layer and the ``blk.N`` tensor.

    Args:
      path: the ``.gguf`` file.
      cfg: the layer config; when None it is read from the ``jaxmoe.config`` metadata
        (files written by `write_gguf_store`), else from the llama.cpp metadata
        (`jaxmoe.io.gguf.load_config`).
      check_finite: reject an expert whose float data or quantization scales / biases hold NaN/Inf.
    """

    def __init__(self, path, cfg: MoEConfig | None = None, *, check_finite: bool = True):
        self.path = Path(path)
        if not self.path.is_file():
            raise ExpertStoreError(f"GGUF expert store {self.path} not found")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:
            raise ExpertStoreError(f"GGUF expert store {self.path} is unreadable or truncated ({e})") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        if cfg is None:
            fld = self._reader.fields.get(GGUF_CONFIG_KEY)
            if fld is not None:
                cfg = config_from_dict(json.loads(bytes(fld.parts[fld.data[0]]).decode()), source=str(self.path))
            else:
                cfg = load_gguf_config(self.path)
        self.cfg = cfg
        # the MoE layers: blocks with a router (leading dense blocks, e.g. DeepSeek's, have none)
        self.blocks = sorted(
            int(n.split(".")[1]) for n in self._tensors if n.startswith("blk.") and n.endswith(".ffn_gate_inp.weight")
        )
        self.num_layers = len(self.blocks)
        if self.num_layers == 0:
            raise ExpertStoreError(f"GGUF expert store {self.path}: no blk.0.ffn_gate_inp.weight (not an MoE file)")
        self.kind = "gguf"
        self.check_finite = check_finite

    def _get(self, layer: int, expert: int, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise ExpertStoreError(f"layer {layer}, expert {expert}: tensor {name} is missing from {self.path}")
        return t

    def _proj(self, layer: int, expert: int, name: str):
        cfg = self.cfg
        e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
        tname = f"blk.{self.blocks[layer]}.{_GGUF_PROJ[name]}.weight"
        t = self._get(layer, expert, tname)
        n_out, n_in = (d, f) if name == "w_down" else (f, d)
        logical = (e, n_out, n_in)
        got = tuple(int(x) for x in reversed(t.shape.tolist()))
        if got != logical:
            raise ExpertStoreError(
                f"layer {layer}, expert {expert}: tensor {tname} in {self.path} has shape "
                f"{got}, expected {logical} (wrong size)"
            )
        try:
            raw = np.array(t.data[expert])  # copy one expert's bytes out of the memory map
        except Exception as e:
            raise ExpertStoreError(
                f"layer {layer}, expert {expert}: tensor {tname} in {self.path} is unreadable ({e})"
            ) from None
        out = gguf_codec.matrix_from_gguf(raw, t.tensor_type)  # [in, out]: float, or quantized as stored
        if isinstance(out, QuantizedTensor):  # the GGUF block kinds keep their scales inside the bytes
            vals = [out.scales, out.biases] if out.scales is not None else [gguf_codec.to_numpy_f32(out)]
        else:
            vals = [out]
        if self.check_finite and not all(np.isfinite(v).all() for v in vals if v is not None):
            raise ExpertStoreError(
                f"layer {layer}, expert {expert}: tensor {tname} in {self.path} holds "
                "non-finite values or scales (corrupt data)"
            )
        return out

    def load_expert(self, layer: int, expert: int) -> ExpertWeights:
        self._check_index(layer, expert)
        ws = [self._proj(layer, expert, n) for n in PROJS]
        bs = [None, None, None]
        if self.cfg.expert_bias:
            bs = []
            for gname in _GGUF_BIAS.values():
                t = self._get(layer, expert, f"blk.{self.blocks[layer]}.{gname}")
                bs.append(np.array(t.data[expert], np.float32))
        return ExpertWeights(*ws, *bs)

    def resident(self, layer: int) -> ResidentLayer:
        cfg = self.cfg
        if not 0 <= layer < self.num_layers:
            raise ExpertStoreError(f"layer {layer}: outside [0, {self.num_layers}) MoE layers in {self.path}")
        pre = f"blk.{self.blocks[layer]}."

        def get(name, required=True, transpose=False):
            t = self._tensors.get(pre + name)
            if t is None:
                if required:
                    raise ExpertStoreError(f"layer {layer}: resident tensor {pre + name} is missing from {self.path}")
                return None
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                a = np.array(t.data, np.float32)
            else:  # a quantized resident tensor (e.g. a Q8_0 shared expert): float32 on device
                a = gguf_codec.dequantize_raw(np.array(t.data), t.tensor_type)
            return np.ascontiguousarray(a.T) if transpose else a

        shared = None
        if cfg.shared_expert_dim:
            shared = SharedWeights(
                get("ffn_gate_shexp.weight", transpose=True),
                get("ffn_up_shexp.weight", transpose=True),
                get("ffn_down_shexp.weight", transpose=True),
                get("ffn_gate_inp_shexp.weight", cfg.shared_expert_gate),
            )
        norm = get("ffn_norm.weight", False)
        if norm is None:
            norm = np.ones((cfg.d_model,), np.float32)
        return ResidentLayer(
            norm,
            get("ffn_gate_inp.weight", transpose=True),
            get("ffn_gate_inp.bias", cfg.router.router_bias),
            get("exp_probs_b.bias", cfg.router.use_selection_bias),
            shared,
        )


def open_store(path, cfg: MoEConfig | None = None, **kw) -> ExpertStore:
    """A `GGUFStore` for a ``.gguf`` file, a `SafetensorsStore` for a store directory."""
    p = Path(path)
    if p.suffix == ".gguf" or (p.is_file() and open(p, "rb").read(4) == b"GGUF"):
        return GGUFStore(p, cfg, **kw)
    if p.is_dir():
        return SafetensorsStore(p, **kw)
    raise ExpertStoreError(f"expert store {p}: neither a .gguf file nor a store directory")


def random_layers(cfg: MoEConfig, num_layers: int, seed: int = 0) -> list:
    """``num_layers`` random ``(ResidentLayer, ExpertWeights)`` pairs (float32 numpy, normal, fan-in
    scaled; RMSNorm weights ``1 + 0.1 N(0, 1)``) for ``cfg``."""
    rng = np.random.default_rng(seed)
    d = cfg.d_model

    def nrm(shape, fan_in):
        return (rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(fan_in))).astype(np.float32)

    out = []
    for _ in range(num_layers):
        p = params_from_sampler(cfg, nrm)
        norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        out.append((ResidentLayer(norm, p.w_router, p.b_router, p.selection_bias, p.shared), p.experts))
    return out


__all__ = [
    "ExpertStore",
    "ExpertStoreError",
    "GGUFStore",
    "ResidentLayer",
    "SafetensorsStore",
    "expert_nbytes",
    "open_store",
    "random_layers",
    "stack_experts",
    "write_checkpoint_store",
    "write_gguf_store",
    "write_safetensors_store",
]
