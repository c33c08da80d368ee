"""Building and loading the C++ kernel of ``impl="cpu"`` (`grouped_swiglu.cc` beside this file).

The source is compiled on first use with the system C++ compiler (``$CXX``, else
``c++`` / ``g++`` / ``clang++``) against the FFI headers of the installed jaxlib, with
``-O3 -march=native`` (the machine that runs it compiles it), and cached under
``$JAXMOE_CACHE_DIR`` (default ``~/.cache/jaxmoe``) keyed by the source, the jaxlib
version, the compiler and the CPU flags; the library is written under a temporary name
and renamed, so concurrent builders (test workers) are safe. `cpu_kernel_status` builds,
loads and registers it once per process and says whether that worked.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

TARGET = "jaxmoe_grouped_swiglu"
SOURCE = Path(__file__).parent / "grouped_swiglu.cc"
CXXFLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")

_lock = threading.Lock()
_status: tuple[bool, str] | None = None


def cache_dir() -> Path:
    return Path(os.environ.get("JAXMOE_CACHE_DIR") or Path.home() / ".cache" / "jaxmoe")


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cxx: str) -> Path:
    """Compiles the kernel (or finds it in the cache); returns the shared library path."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(
        "\0".join(
            [SOURCE.read_text(), importlib.metadata.version("jaxlib"), cxx, *version, *CXXFLAGS, _cpu_flags()]
        ).encode()
    ).hexdigest()[:16]
    lib = cache_dir() / f"grouped_swiglu-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, *CXXFLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
        os.replace(out, lib)  # atomic: concurrent builders each write their own temp file
    return lib


def cpu_kernel_status() -> tuple[bool, str]:
    """``(available, message)``: builds and registers the kernel on the first call."""
    global _status
    with _lock:
        if _status is None:
            cxx = _compiler()
            if cxx is None:
                _status = (False, "no C++ compiler found ($CXX, c++, g++, clang++); impl='cpu' needs one")
            else:
                try:
                    lib = ctypes.CDLL(str(_build(cxx)))
                    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxmoeGroupedSwiglu), platform="cpu")
                    _status = (True, f"built with {cxx}")
                except (RuntimeError, OSError, AttributeError) as e:
                    _status = (False, str(e))
        return _status


def cpu_kernel_available() -> bool:
    return cpu_kernel_status()[0]
