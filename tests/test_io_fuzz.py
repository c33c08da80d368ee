"""Hostile checkpoint files: the GGUF and safetensors readers either load correctly or
raise a ValueError; never another exception, a hang, or a large allocation.

Also the loader hardening of issue 14 item 5: ``model.safetensors.index.json`` names
confined to the checkpoint directory, a per-layer GGUF array key with no entry for the
layer, and the FP8 reader parsing each file header once.
"""

import dataclasses
import json
import signal
import struct
import tracemalloc
from contextlib import contextmanager

import gguf
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxmoe
from jaxmoe.io import gguf as jgguf
from jaxmoe.io import safetensors_dir
from jaxmoe.io.errors import CheckpointError
from jaxmoe.io.safetensors_dir import SafetensorsDir

GIB = 1 << 30
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@contextmanager
def bounded(seconds: int = 30, max_bytes: int = GIB):
    """Fails the example on a hang (SIGALRM) or a Python/numpy allocation peak above ``max_bytes``."""

    def hang(*_):
        raise AssertionError(f"reader still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    tracemalloc.start()
    try:
        yield
        assert tracemalloc.get_traced_memory()[1] < max_bytes
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- safetensors


def _st_file(rng) -> tuple[bytes, dict[str, np.ndarray]]:
    """A safetensors file with an F32, a BF16 and two FP8 tensors (FP8 written by hand:
    safetensors' numpy API has no FP8 dtype)."""
    tensors = {
        "a.weight": rng.standard_normal((4, 6)).astype(np.float32),
        "b.weight": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "c.weight": rng.standard_normal((2, 8)).astype(ml_dtypes.float8_e4m3fn),
        "d.weight": rng.standard_normal((5,)).astype(ml_dtypes.float8_e5m2),
    }
    codes = {np.float32: "F32", ml_dtypes.bfloat16: "BF16", ml_dtypes.float8_e4m3fn: "F8_E4M3"}
    codes[ml_dtypes.float8_e5m2] = "F8_E5M2"
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        raw = a.tobytes()
        header[name] = {"dtype": codes[a.dtype.type], "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs), tensors


def _read_all(path) -> dict[str, np.ndarray]:
    with SafetensorsDir(path) as sd:
        return {name: sd.get(name) for name in sd.keys()}


_CODES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}
_CODES["F8_E5M2"] = ml_dtypes.float8_e5m2


def _as_declared(blob: bytes, got: dict) -> None:
    """Each loaded tensor is exactly what the file's header declares (parsed here independently)."""
    hlen = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + hlen])
    assert set(got) == {k for k in header if k != "__metadata__"}
    for name, a in got.items():
        info = header[name]
        b, e = info["data_offsets"]
        assert a.dtype == np.dtype(_CODES[info["dtype"]]) and list(a.shape) == info["shape"], name
        assert a.tobytes() == blob[8 + hlen + b : 8 + hlen + e], name


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name].view(np.uint8), a.view(np.uint8), err_msg=name)


@FUZZ
@given(data=st.data())
def test_safetensors_fuzz_load_or_value_error(tmp_path_factory, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    blob, tensors = _st_file(rng)
    buf = bytearray(blob)
    hlen = struct.unpack("<Q", blob[:8])[0]
    mode = data.draw(st.sampled_from(["truncate", "flip", "size", "offset", "shape"]), label="mode")
    if mode == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1), label="cut")]
    elif mode == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="n_flips")):
            i = data.draw(st.integers(0, 8 + hlen - 1), label="at")
            buf[i] ^= data.draw(st.integers(1, 255), label="mask")
    elif mode == "size":  # a huge or wrong declared header size
        buf[:8] = struct.pack("<Q", data.draw(st.sampled_from([0, 1, hlen + 1, 2**31, 2**40, 2**64 - 1])))
    else:  # a huge declared offset or shape, header otherwise valid
        header = json.loads(blob[8 : 8 + hlen])
        name = data.draw(st.sampled_from(sorted(header)), label="tensor")
        big = data.draw(st.sampled_from([2**31, 2**40, 2**62, 2**64 - 1, 10**30]), label="big")
        if mode == "offset":
            header[name]["data_offsets"][data.draw(st.integers(0, 1))] = big
        else:
            header[name]["shape"][0] = big
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        buf = bytearray(struct.pack("<Q", len(h)) + h + blob[8 + hlen :])
    d = tmp_path_factory.mktemp("st")
    (d / "model.safetensors").write_bytes(bytes(buf))
    with bounded():
        try:
            got = _read_all(d)
        except ValueError:
            return
    if mode in ("truncate", "size", "offset", "shape"):
        _same(got, tensors)  # none of these leaves a different valid file: the original tensors
    else:  # a flip may leave a valid file (a renamed tensor, FP8 E4M3 <-> E5M2): what it declares
        _as_declared(bytes(buf), got)


def test_safetensors_clean_file_round_trips(tmp_path, rng):
    blob, tensors = _st_file(rng)
    (tmp_path / "model.safetensors").write_bytes(blob)
    _same(_read_all(tmp_path), tensors)


def test_fp8_header_parsed_once_per_file(tmp_path, rng, monkeypatch):
    blob, tensors = _st_file(rng)
    (tmp_path / "model.safetensors").write_bytes(blob)
    calls = []
    real = json.loads
    monkeypatch.setattr(safetensors_dir.json, "loads", lambda s, *a, **k: calls.append(len(s)) or real(s, *a, **k))
    with SafetensorsDir(tmp_path) as sd:
        for _ in range(3):
            for name in ("c.weight", "d.weight"):
                np.testing.assert_array_equal(sd.get(name).view(np.uint8), tensors[name].view(np.uint8))
    assert len(calls) == 1


@pytest.mark.parametrize(
    "fname", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors", "", 7]
)
def test_index_names_confined_to_directory(tmp_path, rng, fname):
    ck = tmp_path / "ck"
    ck.mkdir()
    safetensors.numpy.save_file(
        {"w": rng.standard_normal((2, 2)).astype(np.float32)}, str(tmp_path / "outside.safetensors")
    )
    (ck / "sub").mkdir()
    index = {"weight_map": {"w": fname}}
    (ck / safetensors_dir.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: tensor 'w' is mapped to"):
        SafetensorsDir(ck)


def test_index_in_directory_names_and_symlinks_load(tmp_path, rng):
    ck = tmp_path / "ck"
    (ck / "sub").mkdir(parents=True)
    w = rng.standard_normal((2, 3)).astype(np.float32)
    blob = tmp_path / "blob"  # the Hugging Face cache links snapshot files to blobs outside
    safetensors.numpy.save_file({"w": w}, str(blob))
    (ck / "sub" / "model-1.safetensors").symlink_to(blob)
    (ck / safetensors_dir.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "sub/model-1.safetensors"}}))
    with SafetensorsDir(ck) as sd:
        np.testing.assert_array_equal(sd.get("w"), w)
    (ck / safetensors_dir.INDEX_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON index"):
        SafetensorsDir(ck)


# ----------------------------------------------------------------------------- GGUF


def _small_model(rng, layer_count=3):
    cfg = jaxmoe.load_config("qwen3-30b-a3b")
    d, e, f = 32, 8, 16
    cfg = dataclasses.replace(
        cfg,
        d_model=d,
        expert_dim=f,
        num_layers=layer_count,
        router=dataclasses.replace(cfg.router, num_experts=e, top_k=2),
    )

    def n(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(np.float32)

    ew = jaxmoe.ExpertWeights(n(e, d, f), n(e, d, f), n(e, f, d))
    return cfg, jaxmoe.MoEParams(n(d, e), ew)


def _copy_gguf(src, dst, replace_kv: dict) -> None:
    """``src`` rewritten to ``dst`` with the ``{arch}.`` keys of ``replace_kv`` replaced
    (a list value becomes a uint32 array)."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        short = name.removeprefix(f"{arch}.")
        if short in replace_kv:
            v = replace_kv[short]
            w.add_key_value(name, v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_per_layer_array_key_without_the_layer_is_an_error(tmp_path, rng):
    cfg, params = _small_model(rng)
    src = jaxmoe.save_gguf((cfg, params), tmp_path / "l2.gguf", layer=2, dtype="f32")
    ok = tmp_path / "ok.gguf"
    _copy_gguf(src, ok, {"expert_used_count": [4, 3, 2]})  # per layer: layer 2 has top-2
    cfg2, _ = jgguf.load_layer(ok, layer=2)
    assert cfg2.top_k == 2
    short = tmp_path / "short.gguf"
    _copy_gguf(src, short, {"expert_used_count": [2]})
    with pytest.raises(CheckpointError, match=r"expert_used_count has 1 entries, no entry for layer 2"):
        jgguf.load_layer(short, layer=2)


@pytest.mark.parametrize(
    "shift, msg",
    [
        (1, r"ffn_gate_inp.weight's data offset 1 is not a multiple of the file's alignment 32"),
        (32, r"tensors blk\.1\.ffn_gate_inp\.weight .* and blk\.1\.ffn_gate_exps\.weight .* overlap"),
    ],
)
def test_gguf_corrupt_tensor_offset_is_an_error(tmp_path, rng, shift, msg):
    """A tensor offset in the header moved by a bit flip (the fuzz test's example: one bit
    of the router's offset) would load shifted or foreign bytes: a misaligned offset or
    overlapping tensors is a CheckpointError naming the tensor(s)."""
    cfg, params = _small_model(rng)
    src = jaxmoe.save_gguf((cfg, params), tmp_path / "base.gguf", layer=1, dtype="f32")
    r = gguf.GGUFReader(src)
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_gate_inp.weight")
    at = t.field.offset + sum(part.nbytes for part in t.field.parts[:-1])  # its offset, a uint64
    buf = bytearray(src.read_bytes())
    (off,) = struct.unpack_from("<Q", buf, at)
    struct.pack_into("<Q", buf, at, off + shift)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(buf))
    with pytest.raises(CheckpointError, match=msg):
        jgguf.load_layer(bad, layer=1)


@FUZZ
@given(data=st.data())
def test_gguf_fuzz_load_or_value_error(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("gguf")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    cfg, params = _small_model(rng)
    src = jaxmoe.save_gguf((cfg, params), tmp / "base.gguf", layer=1, dtype="f32")
    blob = src.read_bytes()
    _, want = jgguf.load_layer(src, layer=1)
    r = gguf.GGUFReader(src)
    data_start = min(t.data_offset for t in r.tensors)
    buf = bytearray(blob)
    mode = data.draw(st.sampled_from(["truncate", "flip", "count", "u64"]), label="mode")
    if mode == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1), label="cut")]
    elif mode == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="n_flips")):
            i = data.draw(st.integers(0, data_start - 1), label="at")
            buf[i] ^= data.draw(st.integers(1, 255), label="mask")
    elif mode == "count":  # tensor / kv counts right after the magic and version
        at = data.draw(st.sampled_from([8, 16]), label="which")
        buf[at : at + 8] = struct.pack("<Q", data.draw(st.sampled_from([2**20, 2**40, 2**63, 2**64 - 1])))
    else:  # any aligned 8 bytes of the header set to a huge size / offset / length
        i = data.draw(st.integers(0, (data_start - 8) // 8), label="word") * 8
        buf[i : i + 8] = struct.pack("<Q", data.draw(st.sampled_from([2**31, 2**40, 2**62, 2**64 - 1])))
    path = tmp / "fuzzed.gguf"
    path.write_bytes(bytes(buf))
    with bounded():
        try:
            _, got = jgguf.load_layer(path, layer=1)
        except ValueError:
            return
    for a, b in zip(
        (np.asarray(x) for x in jaxmoe_leaves(want)), (np.asarray(x) for x in jaxmoe_leaves(got)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def jaxmoe_leaves(params):
    import jax

    return jax.tree_util.tree_leaves(params)
