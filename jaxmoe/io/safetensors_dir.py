"""Lazy access to the tensors of a checkpoint directory of ``*.safetensors`` files.

One `SafetensorsDir` opens each file's header once (``safetensors.safe_open``, memory
mapped) and reads a tensor only when `get` asks for it, so loading one layer of a
sharded 20 GB checkpoint touches that layer's bytes only. Sharded checkpoints list
their files in ``model.safetensors.index.json`` (``weight_map``: tensor name -> file).

Hostile input: a file name of the index must be a plain relative name inside the
directory (no absolute path, no ``..``; a symlink in the directory is followed, as the
Hugging Face cache's snapshot links are); a header (read by ``safetensors``, or here for
the FP8 dtypes numpy lacks) that is cut, malformed, or declares sizes or offsets past
the file is a ValueError naming the file; nothing is allocated beyond the bytes a tensor
really has in the file.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxmoe.io.gguf_codec import aligned_empty, pread_into

INDEX_NAME = "model.safetensors.index.json"

#: Stored dtypes numpy has no type for, read through `ml_dtypes` from the memory-mapped file.
_ML_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
#: Every stored dtype `SafetensorsDir.get_part` reads.
_NP_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
    **_ML_DTYPES,
}


class SafetensorsDir:
    """Name -> tensor access over the ``*.safetensors`` files of ``path``.

    Tensors come back as numpy arrays in their stored dtype (``bfloat16`` as
    ``ml_dtypes.bfloat16``). Use as a context manager, or call `close`.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"{self.path}: not a checkpoint directory")
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        self._where: dict[str, str] = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (data start, parsed header), raw reads only
        self.reads: list[str] = []  # names read through `get`, in order (for inspection / tests)
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                with open(index, "rb") as f:
                    doc = json.loads(f.read())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{index}: not a readable JSON index ({e})") from None
            wm = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wm, dict):
                raise ValueError(f"{index}: no 'weight_map' object")
            for name, fname in wm.items():
                self._check_name(index, name, fname)
                if not (self.path / fname).is_file():
                    raise ValueError(f"{index}: tensor {name!r} is mapped to missing file {fname!r}")
            self._where = dict(wm)
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{self.path}: no *.safetensors files (and no {INDEX_NAME})")
            for fname in files:
                for name in self._open(fname).keys():
                    if name in self._where:
                        raise ValueError(
                            f"{self.path}: tensor {name!r} appears in both {self._where[name]} and {fname}"
                        )
                    self._where[name] = fname

    def _check_name(self, index: Path, name, fname) -> None:
        """ValueError unless ``fname`` is a plain relative file name inside the directory."""
        if not isinstance(fname, str) or not fname:
            raise ValueError(f"{index}: tensor {name!r} is mapped to {fname!r}, not a file name")
        rel = Path(fname)
        if rel.is_absolute() or rel.drive or ".." in rel.parts or "\\" in fname or "\x00" in fname:
            raise ValueError(
                f"{index}: tensor {name!r} is mapped to {fname!r}, outside the checkpoint directory "
                "(file names must be relative, without '..')"
            )

    def _open(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            try:
                h = self._stack.enter_context(safe_open(str(self.path / fname), framework="numpy"))
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"{self.path / fname}: cannot read safetensors header ({e})") from None
            self._handles[fname] = h
        return h

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _require(self, name: str) -> str:
        if name not in self._where:
            raise ValueError(f"{self.path}: missing tensor {name!r}")
        return self._where[name]

    def _slice(self, name: str):
        fname = self._require(name)
        try:
            return self._open(fname).get_slice(name)
        except ValueError:
            raise
        except Exception as e:  # safetensors' own error types (e.g. a name the index maps to the wrong file)
            raise ValueError(f"{self.path / fname}: cannot read tensor {name!r} ({e})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string (``F32``, ``BF16``, ``U32``, ...)."""
        return self._slice(name).get_dtype()

    def _header(self, fname: str) -> tuple[int, dict]:
        """``(data start, header)`` of ``fname``, parsed once per file and validated
        against the file size."""
        got = self._headers.get(fname)
        if got is not None:
            return got
        path = self.path / fname
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                raise ValueError(f"{path}: safetensors header size {n} does not fit the file ({size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: safetensors header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: safetensors header is not a JSON object")
        got = (8 + n, header)
        self._headers[fname] = got
        return got

    def _span(self, fname: str, name: str) -> tuple[Path, int, np.dtype, tuple[int, ...]]:
        """``(file, byte offset, dtype, shape)`` of tensor ``name`` from the file's header,
        checked against the file's size."""
        path = self.path / fname
        start, header = self._header(fname)
        info = header.get(name)
        try:
            dt = np.dtype(_NP_DTYPES[info["dtype"]])
            begin, end = (int(v) for v in info["data_offsets"])
            shape = tuple(int(v) for v in info["shape"])
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        size = path.stat().st_size - start
        if not 0 <= begin <= end <= size or any(v < 0 for v in shape):
            raise ValueError(
                f"{path}: tensor {name!r} byte range [{begin}, {end}) or shape {shape} does not fit the "
                f"{size} data bytes of the file"
            )
        if end - begin != int(np.prod(shape, dtype=object)) * dt.itemsize:
            raise ValueError(f"{path}: tensor {name!r} byte range {end - begin} does not match shape {shape} {dt}")
        return path, start + begin, dt, shape

    def _read_raw(self, fname: str, name: str) -> np.ndarray:
        """A tensor of a dtype the numpy framework lacks, from its byte range in the file."""
        path, offset, dt, shape = self._span(fname, name)
        if not int(np.prod(shape, dtype=object)):
            return np.zeros(shape, dt)
        return np.array(np.memmap(path, dtype=dt, mode="r", offset=offset, shape=shape))

    def get_part(
        self, name: str, j: int, shape: tuple[int, ...] | None = None, rows: tuple[int, int] | None = None
    ) -> np.ndarray:
        """``tensor[j]`` (entry ``j`` of the first axis, e.g. one expert of a stacked tensor), or
        with ``rows = (start, stop)`` only ``tensor[j, start:stop]``, read from the file with
        ``pread`` into a fresh 64-byte-aligned array: the file's pages are never mapped, so a
        loader that reads a tensor piece by piece holds no more than what it keeps. ``shape``,
        when given, is checked as in `get`."""
        fname = self._require(name)
        path, offset, dt, full = self._span(fname, name)
        if shape is not None and full != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {full}, expected {tuple(shape)}")
        if not full or not 0 <= j < full[0]:
            raise ValueError(f"{path}: tensor {name!r} of shape {full} has no entry {j} along its first axis")
        entry = full[1:]
        entry_bytes = int(np.prod(entry, dtype=np.int64)) * dt.itemsize
        shape, skip = entry, 0
        if rows is not None:
            start, stop = rows
            if not entry or not 0 <= start <= stop <= entry[0]:
                raise ValueError(f"{path}: tensor {name!r} of shape {full} has no rows [{start}, {stop}) in entry {j}")
            shape, skip = (stop - start, *entry[1:]), start * (entry_bytes // entry[0] if entry[0] else 0)
        if j == 0 and skip == 0:
            self.reads.append(name)
        part = aligned_empty(shape, dt)
        fd = os.open(path, os.O_RDONLY)
        try:
            pread_into(fd, part, offset + j * entry_bytes + skip, f"{path}: tensor {name!r}")
        finally:
            os.close(fd)
        return part

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor ``name``; when ``shape`` is given, a mismatch is a ValueError naming both shapes."""
        fname = self._require(name)
        if shape is not None:
            got = self.shape(name)
            if got != tuple(shape):
                raise ValueError(f"{self.path}: tensor {name!r} has shape {got}, expected {tuple(shape)}")
        self.reads.append(name)
        if self.dtype(name) in _ML_DTYPES:
            return self._read_raw(fname, name)
        try:
            return self._open(fname).get_tensor(name)
        except Exception as e:
            raise ValueError(f"{self.path / fname}: cannot read tensor {name!r} ({e})") from None
