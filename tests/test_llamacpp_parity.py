"""benchmarks/llamacpp_parity.py: its helpers (no llama.cpp build needed). `read_dump` is
checked against files written here with `struct` in the layout moe-dump.cpp writes (int32
ndims, int64 ne[4], float32 data, ne0 fastest)."""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("llamacpp_parity", ROOT / "benchmarks" / "llamacpp_parity.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["llamacpp_parity"] = mod
    spec.loader.exec_module(mod)
    return mod


lp = _module()


def _write(path: Path, ne: list[int], nd: int, data: np.ndarray) -> None:
    path.write_bytes(struct.pack("<i4q", nd, *ne) + data.astype("<f4").tobytes())


@pytest.mark.parametrize("ne,nd", [([6, 5, 1, 1], 2), ([7, 1, 1, 1], 1), ([4, 3, 2, 1], 3)])
def test_read_dump_layout(tmp_path, ne, nd):
    rng = np.random.default_rng(sum(ne) + nd)
    flat = rng.standard_normal(int(np.prod(ne))).astype(np.float32)
    p = tmp_path / "t.bin"
    _write(p, ne, nd, flat)
    got = lp.read_dump(p)
    assert got.shape == tuple(ne[:nd][::-1])
    # element (i1, i0) of a 2-D ggml tensor sits at i0 + ne0 * i1
    for idx in [(0,) * nd, tuple(n - 1 for n in ne[:nd][::-1])]:
        off = sum(i * int(np.prod(ne[:k])) for k, i in enumerate(idx[::-1]))
        assert got[idx] == flat[off]


def test_read_dump_errors(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="shorter than the 36-byte header"):
        lp.read_dump(p)
    _write(p, [4, 2, 1, 1], 2, np.zeros(7, np.float32) + 0.5)
    with pytest.raises(ValueError, match=r"holds 8 floats, the file 7"):
        lp.read_dump(p)
    _write(p, [4, 1, 1, 1], 5, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="ndims 5"):
        lp.read_dump(p)


def test_rel_err_and_names():
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((3, 8)).astype(np.float32)
    dy = rng.standard_normal((3, 8)) * 1e-3
    want = np.sqrt((dy**2).sum() / (ref.astype(np.float64) ** 2).sum())
    assert lp.rel_err(ref + dy, ref) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="shapes"):
        lp.rel_err(ref[:2], ref)
    assert lp.io_names("qwen3_5_moe") == ("attn_post_norm", "ffn_out")
    assert lp.io_names("deepseek_v3") == ("ffn_norm", "ffn_out")
    assert lp.io_names("mixtral") == ("ffn_norm", "ffn_moe_out")
    with pytest.raises(ValueError, match="unknown arch 'llama'"):
        lp.io_names("llama")
