"""Issue 47, load without a float copy: loading a GGUF layer whose experts stay quantized
peaks near the bytes the layer holds (benchmarks/load_peak.py measures the peak RSS of a
fresh process around `jaxmoe.from_pretrained`). Before, the loader copied each tensor from
the file's memory map into jax (the mapped pages and the copy both resident: about 1.7x),
and Q8_0 / Q4_0 made whole-tensor numpy copies on the way."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import jaxmoe

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def _load_peak():
    spec = importlib.util.spec_from_file_location("load_peak", ROOT / "benchmarks" / "load_peak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["load_peak"] = mod
    spec.loader.exec_module(mod)
    return mod


def _write(path: Path, rng, qtype: QT, e: int = 64, d: int = 1024, f: int = 512) -> None:
    """A two-layer qwen3moe file; layer 1's experts random blocks of ``qtype`` with small
    finite float16 scales (gguf_layer_load's generator)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gguf_layer_load import block_bytes
    finally:
        sys.path.pop(0)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for k, v in (
        ("block_count", 2),
        ("embedding_length", d),
        ("expert_count", e),
        ("expert_used_count", 4),
        ("expert_feed_forward_length", f),
    ):
        w.add_uint32(f"qwen3moe.{k}", v)
    for i in range(2):
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.standard_normal((e, d)).astype(np.float32))
        for n, s in (("gate_exps", (e, f, d)), ("up_exps", (e, f, d)), ("down_exps", (e, d, f))):
            w.add_tensor(f"blk.{i}.ffn_{n}.weight", block_bytes(rng, s, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_K])
def test_gguf_layer_load_peaks_near_its_held_bytes(qtype, tmp_path):
    """Q8_0 (codes and scales split), Q4_0 and Q4_K (bytes kept): a second load's peak (the
    first load's one-time costs left out) stays within 1.2x the held bytes + 8 MiB (the
    issue's bound is + 100 MiB; the layer here is 28-54 MiB, so the tight slack is what
    tells a copy apart), and the file's pages are not left mapped."""
    lp = _load_peak()
    path = tmp_path / "m.gguf"
    _write(path, np.random.default_rng(int(qtype)), qtype)
    m = lp.measure(path, layer=1, warm=True)
    file_bytes = sum(
        int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.1.") and "_exps" in t.name
    )
    assert m["experts"] == file_bytes  # Q4_0 too: its blocks kept as they are
    assert m["held"] > 25 * MIB
    assert m["peak"] <= 1.2 * m["held"] + 8 * MIB, lp.describe(m)
    assert m["file_pages_after"] < 4 * MIB, lp.describe(m)


def test_pread_rows_equal_the_memory_map(tmp_path):
    """The loader's pread of a merged tensor's row range (FileTensor) gives the mapped bytes."""
    from jaxmoe.io import gguf_codec as gc

    rng = np.random.default_rng(3)
    path = tmp_path / "m.gguf"
    _write(path, rng, QT.Q8_0, e=4, d=64, f=32)
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_gate_exps.weight")
    for rows in (None, (0, 16), (16, 32), (5, 6)):
        ft = gc.FileTensor(t.data, t.tensor_type, str(path), int(t.data_offset), rows)
        want = np.asarray(t.data)[..., slice(*(rows or (None,))), :]
        got = ft.read(t.name)
        assert got.ctypes.data % gc.HOST_ALIGN == 0
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(gc.FileTensor(t.data, t.tensor_type, None, 0, rows).read(t.name), want)
        q = gc.host_weight_from_file(ft, name=t.name)
        ref = gc.q8_0_to_quantized(want)
        np.testing.assert_array_equal(q.qdata, ref.qdata)
        np.testing.assert_array_equal(q.scales, ref.scales)
    cut = gc.FileTensor(t.data, t.tensor_type, str(path), path.stat().st_size - 10, None)
    with pytest.raises(ValueError, match="blk.1.ffn_gate_exps.weight: the file ends"):
        cut.read(t.name)
    block = jaxmoe.from_pretrained(path, layer=1)
    assert block.params().experts.w_gate.kind == "int8"


def _st_writers():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import safetensors_quantized_load as sq
    finally:
        sys.path.pop(0)
    return sq


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("model, experts", [("gpt-oss", 4), ("deepseek-v3", 2)])
def test_safetensors_layer_load_peaks_near_its_held_bytes(model, experts, tmp_path):
    """gpt-oss MXFP4 (re-packed expert by expert) and DeepSeek-V3 block-scaled FP8 (per-expert
    tensors stacked in place) at real widths: the load's peak stays within 1.2x the held
    bytes + 8 MiB. Before, MXFP4's whole-tensor re-pack peaked at 3.6x and FP8's list of
    experts stacked by np.stack at 1.8x."""
    lp, sq = _load_peak(), _st_writers()
    write = sq.write_gptoss if model == "gpt-oss" else sq.write_dsv3
    write(tmp_path, experts, np.random.default_rng(0))
    m = lp.measure(tmp_path, layer=0, warm=True)
    assert m["kinds"] == (["mxfp4"] if model == "gpt-oss" else ["fp8_e4m3"])
    assert m["held"] > 50 * MIB
    assert m["peak"] <= 1.2 * m["held"] + 8 * MIB, lp.describe(m)


def test_expert_stack_fills_in_place_and_falls_back_for_a_mix(tmp_path):
    """`_ExpertStack` (the HF per-expert loader): FP8 experts and float experts stack into one
    buffer equal to np.stack; a float expert after FP8 ones gives `_stack`'s dequantized mix;
    `SafetensorsDir.get_part` reads entry j (and a row range of it) as the whole tensor's [j]."""
    import ml_dtypes
    import safetensors.numpy

    from jaxmoe.io import hf
    from jaxmoe.io.safetensors_dir import SafetensorsDir
    from jaxmoe.quant import QuantizedTensor, fp8_block_tensor

    rng = np.random.default_rng(5)

    def fp8():
        codes = rng.integers(0, 0x7E, (8, 12), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        return fp8_block_tensor(codes, rng.uniform(0.5, 2, (2, 3)).astype(np.float32), 4)

    ws = [fp8() for _ in range(3)]
    s = hf._ExpertStack(3, "w")
    for j, w in enumerate(ws):
        s.add(j, w)
    got = s.result()
    assert isinstance(got, QuantizedTensor) and got.kind == "fp8_e4m3" and got.group_size == 4
    np.testing.assert_array_equal(got.qdata.view(np.uint8), np.stack([w.qdata for w in ws]).view(np.uint8))
    np.testing.assert_array_equal(got.scales, np.stack([w.scales for w in ws]))
    floats = [rng.standard_normal((8, 12)).astype(np.float32) for _ in range(3)]
    s = hf._ExpertStack(3, "w")
    for j, w in enumerate(floats):
        s.add(j, w)
    np.testing.assert_array_equal(s.result(), np.stack(floats))
    mix = [ws[0], ws[1], floats[2]]
    s = hf._ExpertStack(3, "w")
    for j, w in enumerate(mix):
        s.add(j, w)
    np.testing.assert_array_equal(s.result(), hf._stack(mix, "w"))
    t = {"a": rng.standard_normal((3, 5, 7)).astype(np.float32), "b": rng.integers(0, 255, (4, 6), dtype=np.uint8)}
    safetensors.numpy.save_file(t, str(tmp_path / "model.safetensors"))
    with SafetensorsDir(tmp_path) as st:
        for name, v in t.items():
            for j in range(v.shape[0]):
                np.testing.assert_array_equal(st.get_part(name, j), v[j])
                for rows in ((0, v.shape[1]), (1, 3), (2, 2), (v.shape[1] - 1, v.shape[1])):
                    np.testing.assert_array_equal(st.get_part(name, j, rows=rows), v[j, slice(*rows)])
        with pytest.raises(ValueError, match="tensor 'a' of shape \\(3, 5, 7\\) has no entry 3"):
            st.get_part("a", 3)
        with pytest.raises(ValueError, match="tensor 'a' of shape \\(3, 5, 7\\) has no rows \\[4, 6\\) in entry 1"):
            st.get_part("a", 1, rows=(4, 6))
