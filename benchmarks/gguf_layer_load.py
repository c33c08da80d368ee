"""How much of a GGUF file `jaxmoe.from_pretrained(path, layer=i)` reads, and how fast.

Writes a qwen35moe file with ``--layers`` MoE layers of random (valid) experts of GGML type
``--type`` (default Q8_0; e.g. Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4, IQ2_XXS ... IQ1_M, TQ1_0,
TQ2_0) at Qwen3.6 widths (d=2048,
F=512 or ``--ffn``, shared 512) with ``--experts`` experts, evicts it from the page cache
(``posix_fadvise(DONTNEED)``), loads one layer, and reports with ``mincore`` how many bytes
of each layer became resident (only the requested layer's should), and the bytes jaxmoe
holds for the routed experts against the file's ``ffn_{gate,up,down}_exps`` bytes
(held / file: 1.00 when the experts stay in their file bytes). ``--peak`` also loads the
layer in a fresh process and reports its peak host memory against the bytes it holds
(`load_peak.measure`). ``--ffn`` sets the expert width.

    python benchmarks/gguf_layer_load.py --experts 64 --layers 4 --layer 2 --type mxfp4
    python benchmarks/gguf_layer_load.py --experts 128 --ffn 768 --layers 2 --layer 1 --type q8_0 --peak
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import tempfile
import time

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from load_peak import describe, measure

import jaxmoe

#: Byte offsets of the float16 scale fields inside a block, per type (ggml's block layouts);
#: MXFP4's scale is the E8M0 exponent in byte 0.
F16_AT = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
    QT.IQ4_NL: (0,),
    QT.IQ4_XS: (0,),
    QT.IQ2_XXS: (0,),
    QT.IQ2_XS: (0,),
    QT.IQ2_S: (0,),
    QT.IQ3_XXS: (0,),
    QT.IQ3_S: (0,),
    QT.IQ1_S: (0,),
    QT.IQ1_M: (),  # its d is spread over the top nibbles of the 4 scale words (block_bytes)
    QT.TQ1_0: (52,),
    QT.TQ2_0: (64,),
}


def block_bytes(rng, shape, qtype=QT.Q8_0):
    """Random valid blocks of ``qtype`` for a logical ``shape`` ``[..., out, n]``: random codes,
    small finite scales."""
    *lead, out, n = shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = n // block
    b = rng.integers(0, 256, (*lead, out, nb, size), dtype=np.uint8)
    if qtype == QT.MXFP4:
        b[..., 0] = rng.integers(118, 122, (*lead, out, nb), dtype=np.uint8)
    if qtype == QT.IQ1_M:  # word i of bytes 48:56 holds bits 4 i .. 4 i + 3 of d in its top nibble
        d = rng.uniform(1e-4, 1e-3, (*lead, out, nb)).astype(np.float16).view(np.uint16)
        sw = b[..., 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for i in range(4):
            sw[..., i] |= ((d >> np.uint16(4 * i)) & np.uint16(0xF)) << np.uint16(12)
        b[..., 48:56] = sw.view(np.uint8)
    for o in F16_AT.get(qtype, ()):
        b[..., o : o + 2] = rng.uniform(1e-4, 1e-3, (*lead, out, nb, 1)).astype(np.float16).view(np.uint8)
    return b.reshape(*lead, out, nb * size)


def write(path, e, n_layers, d=2048, f=512, fs=512, seed=0, qtype=QT.Q8_0):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "qwen35moe")
    for k, v in (
        ("block_count", n_layers),
        ("embedding_length", d),
        ("expert_count", e),
        ("expert_used_count", 8),
        ("expert_feed_forward_length", f),
        ("expert_shared_feed_forward_length", fs),
    ):
        w.add_uint32(f"qwen35moe.{k}", v)
    for i in range(n_layers):
        pre = f"blk.{i}."
        w.add_tensor(pre + "ffn_gate_inp.weight", rng.standard_normal((e, d)).astype(np.float32))
        for n, s in (
            ("gate_exps", (e, f, d)),
            ("up_exps", (e, f, d)),
            ("down_exps", (e, d, f)),
            ("gate_shexp", (fs, d)),
            ("up_shexp", (fs, d)),
            ("down_shexp", (d, fs)),
        ):
            qt = qtype if n.endswith("exps") else QT.Q8_0
            w.add_tensor(pre + f"ffn_{n}.weight", block_bytes(rng, s, qt), raw_dtype=qt)
        w.add_tensor(pre + "ffn_gate_inp_shexp.weight", rng.standard_normal(d).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def resident_bytes_by_layer(path):
    """{layer: resident bytes of that layer's tensor data} via mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    size = os.path.getsize(path)
    mm = np.memmap(path, mode="r")  # a fresh read-only mapping; mincore reports the page cache
    arr = (ctypes.c_ubyte * ((size + page - 1) // page))()
    if libc.mincore(ctypes.c_void_p(mm.ctypes.data), ctypes.c_size_t(size), arr) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    vec = np.frombuffer(arr, np.uint8) & 1
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        layer = int(t.name.split(".")[1])
        lo, hi = t.data_offset // page, (t.data_offset + t.n_bytes + page - 1) // page
        out[layer] = out.get(layer, 0) + int(vec[lo:hi].sum()) * page
    del mm
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512, help="expert width F")
    ap.add_argument("--peak", action="store_true", help="the load's peak host memory, in a fresh process")
    ap.add_argument(
        "--type",
        default="q8_0",
        help="GGML type of the routed experts: " + ", ".join(t.name.lower() for t in F16_AT) + ", mxfp4",
    )
    args = ap.parse_args()
    qtype = QT[args.type.upper()]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.gguf")
        t0 = time.perf_counter()
        write(path, args.experts, args.layers, f=args.ffn, qtype=qtype)
        print(
            f"wrote {os.path.getsize(path) / 2**20:.0f} MiB ({args.layers} layers) in {time.perf_counter() - t0:.1f} s"
        )
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        before = resident_bytes_by_layer(path)
        t0 = time.perf_counter()
        block = jaxmoe.from_pretrained(path, layer=args.layer)
        t_load = time.perf_counter() - t0
        after = resident_bytes_by_layer(path)
        tensors = [t for t in gguf.GGUFReader(path).tensors if t.name.startswith(f"blk.{args.layer}.")]
        per_layer = sum(int(t.n_bytes) for t in tensors)
        file_exps = sum(int(t.n_bytes) for t in tensors if t.name.endswith("_exps.weight"))
        ew = block.params().experts
        held = sum(int(w.nbytes) for w in (ew.w_gate, ew.w_up, ew.w_down))
        print(
            f"from_pretrained(layer={args.layer}): {t_load:.2f} s, layer tensors {per_layer / 2**20:.1f} MiB, "
            f"experts kept as {type(ew.w_gate).__name__} ({getattr(ew.w_gate, 'kind', ew.w_gate.dtype)})"
        )
        print(
            f"routed experts ({qtype.name}): held {held / 2**20:.2f} MiB, file {file_exps / 2**20:.2f} MiB, "
            f"held / file {held / file_exps:.2f}"
        )
        for i in range(args.layers):
            print(
                f"  layer {i}: resident {before.get(i, 0) / 2**20:6.1f} MiB before -> {after.get(i, 0) / 2**20:6.1f} MiB after"
            )
        x = np.random.default_rng(1).standard_normal((1, 2048)).astype(np.float32)
        block(x).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(5):
            block(x).block_until_ready()
        print(f"one-token forward (impl=auto, {qtype.name} experts): {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms")
        if args.peak:
            print(f"from_pretrained(layer={args.layer}) in a fresh process: {describe(measure(path, args.layer))}")


if __name__ == "__main__":
    main()
