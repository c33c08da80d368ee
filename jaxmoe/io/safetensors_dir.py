"""Lazy access to the tensors of a checkpoint directory of ``*.safetensors`` files.

One `SafetensorsDir` opens each file's header once (``safetensors.safe_open``, memory
mapped) and reads a tensor only when `get` asks for it, so loading one layer of a
sharded 20 GB checkpoint touches that layer's bytes only. Sharded checkpoints list
their files in ``model.safetensors.index.json`` (``weight_map``: tensor name -> file).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"

#: Stored dtypes numpy has no type for, read through `ml_dtypes` from the memory-mapped file.
_ML_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


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
        self.reads: list[str] = []  # names read through `get`, in order (for inspection / tests)
        index = self.path / INDEX_NAME
        if index.is_file():
            with open(index) as f:
                wm = json.load(f).get("weight_map")
            if not isinstance(wm, dict):
                raise ValueError(f"{index}: no 'weight_map' object")
            for name, fname in wm.items():
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

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._require(name)).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string (``F32``, ``BF16``, ``U32``, ...)."""
        return self._open(self._require(name)).get_slice(name).get_dtype()

    def _read_raw(self, fname: str, name: str) -> np.ndarray:
        """A tensor of a dtype the numpy framework lacks, from its byte range in the file."""
        path = self.path / fname
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            info = json.loads(f.read(n))[name]
        dt = np.dtype(_ML_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape)) * dt.itemsize:
            raise ValueError(f"{path}: tensor {name!r} byte range {end - begin} does not match shape {shape} {dt}")
        return np.array(np.memmap(path, dtype=dt, mode="r", offset=8 + n + begin, shape=shape))

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
