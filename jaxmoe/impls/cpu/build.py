"""Building and loading the C++ kernel of ``impl="cpu"`` (`grouped_swiglu.cc` beside this file).

The source is compiled on first use with the system C++ compiler (``$CXX``, else
``c++`` / ``g++`` / ``clang++``) against the FFI headers of the installed jaxlib, with
``-O3 -march=native`` (the machine that runs it compiles it), and cached under
``$JAXMOE_CACHE_DIR`` (default ``~/.cache/jaxmoe``) keyed by the source and the headers
beside it (``kernel_common.h``, shared by the forward and backward kernels), the jaxlib
version, the compiler and the CPU flags, with the SHA-256 of the library's bytes
recorded beside it (``.sha256``) and checked before every load (a mismatch rebuilds).
The library is written under a temporary name and renamed, so concurrent builders
(test workers) are safe; compiler calls time out (``$JAXMOE_CXX_TIMEOUT``, default
600 s); the compile holds no lock, so tracing in other threads never waits on it.
`cpu_kernel_status` builds, loads and registers it once per process and says whether
that worked. The vector width follows what the compiler targets (AVX-512: 16 lanes,
else 8).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir

TARGET = "jaxmoe_grouped_swiglu"
#: The same kernel with the shared expert in the call (`jaxmoe.impls.cpu.experts_shared_cpu`).
TARGET_SHARED = "jaxmoe_grouped_swiglu_shared"
SOURCE = Path(__file__).parent / "grouped_swiglu.cc"
CXXFLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-Wno-psabi",
)

_lock = threading.Lock()
_status: tuple[bool, str] | None = None


def cache_dir() -> Path:
    return Path(os.environ.get("JAXMOE_CACHE_DIR") or Path.home() / ".cache" / "jaxmoe")


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def extra_flags() -> list[str]:
    """``$JAXMOE_CXXFLAGS`` split on whitespace: flags added after `CXXFLAGS` (part of the
    cache key), e.g. ``-fsanitize=address -g`` to check the kernels for out-of-bounds
    accesses (run Python with the sanitizer's runtime in ``LD_PRELOAD``)."""
    return shlex.split(os.environ.get("JAXMOE_CXXFLAGS", ""))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: Seconds a compiler call may take before it is abandoned ($JAXMOE_CXX_TIMEOUT).
COMPILE_TIMEOUT_S = 600.0


def _timeout() -> float:
    return float(os.environ.get("JAXMOE_CXX_TIMEOUT") or COMPILE_TIMEOUT_S)


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=_timeout())
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd[:1])} did not finish within {_timeout():.0f} s ($JAXMOE_CXX_TIMEOUT)") from e


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(lib: Path) -> bool:
    """Whether ``lib`` and its recorded hash (``lib.sha256``, written at build) agree."""
    try:
        return lib.with_suffix(".sha256").read_text().strip() == _digest(lib)
    except OSError:
        return False


def build_library(cxx: str, source: Path = SOURCE) -> Path:
    """Compiles ``source`` (default: the forward kernel; the backward kernel is its own
    library, `jaxmoe.impls.cpu.backward`) or finds it in the cache; returns the shared
    library path.

    A cached library is used only when the SHA-256 of its bytes equals the one recorded
    beside it when it was built; otherwise it is rebuilt. Compiler calls time out after
    `COMPILE_TIMEOUT_S` (``$JAXMOE_CXX_TIMEOUT``).
    """
    version = _run([cxx, "--version"]).stdout.splitlines()[:1]
    flags = [*CXXFLAGS, *extra_flags()]
    key = hashlib.sha256(
        "\0".join(
            [
                source.read_text(),
                *(h.read_text() for h in sorted(source.parent.glob("*.h"))),  # included headers
                importlib.metadata.version("jaxlib"),
                cxx,
                *version,
                *flags,
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    lib = cache_dir() / f"{source.stem}-{key}.so"
    if _verified(lib):
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(out)]
        r = _run(cmd)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
        sidecar = Path(tmp) / (lib.stem + ".sha256")
        sidecar.write_text(_digest(out) + "\n")
        # Atomic renames: concurrent builders each write their own temp files; the library
        # lands first, so a reader that sees a hash sees a complete library (or a
        # mismatch, then it rebuilds).
        os.replace(out, lib)
        os.replace(sidecar, lib.with_suffix(".sha256"))
    if not _verified(lib):
        raise RuntimeError(f"{lib} does not match the hash recorded when it was built")
    return lib


def load_handler(source: Path = SOURCE, symbol: str = "JaxmoeGroupedSwiglu") -> tuple[bool, str, object]:
    """Builds ``source`` (no lock held) and loads its library: ``(ok, message, capsule of
    the FFI handler ``symbol``)``; registering it is the caller's (once per process)."""
    cxx = _compiler()
    if cxx is None:
        return False, "no C++ compiler found ($CXX, c++, g++, clang++); impl='cpu' needs one", None
    try:
        lib = ctypes.CDLL(str(build_library(cxx, source)))
        return True, f"built with {cxx}", jax.ffi.pycapsule(getattr(lib, symbol))
    except (RuntimeError, OSError, AttributeError) as e:
        return False, str(e), None


def cpu_kernel_status() -> tuple[bool, str]:
    """``(available, message)``: builds and registers the kernel on the first call.

    The compile runs without holding a lock (concurrent first callers may each compile;
    the cache's atomic renames make that safe); only recording the status and
    registering the FFI target happen under the lock, once.
    """
    global _status
    if _status is not None:
        return _status
    ok, msg, capsule = load_handler()
    shared = None
    if ok:  # the same library's second handler
        ok, why, shared = load_handler(symbol="JaxmoeGroupedSwigluShared")
        msg = msg if ok else why
    with _lock:
        if _status is None:
            if ok:
                jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
                jax.ffi.register_ffi_target(TARGET_SHARED, shared, platform="cpu")
            _status = (ok, msg)
        return _status


def cpu_kernel_available() -> bool:
    """`cpu_kernel_status`'s first half (builds on the first call)."""
    return cpu_kernel_status()[0]


#: A bool scalar whose value is decided when the program is lowered (`kernel_ready`).
kernel_ready_p = Primitive("jaxmoe_cpu_kernel_ready")
kernel_ready_p.def_impl(lambda: np.bool_(cpu_kernel_available()))
kernel_ready_p.def_abstract_eval(lambda: ShapedArray((), np.bool_))


def _kernel_ready_lowering(ctx: mlir.LoweringRuleContext):
    ok = "cpu" in ctx.module_context.platforms and cpu_kernel_available()
    return [mlir.ir_constant(np.bool_(ok))]


mlir.register_lowering(kernel_ready_p, _kernel_ready_lowering)


def kernel_ready() -> jax.Array:
    """Whether the kernel built, as a bool scalar decided at lowering time: a program
    lowered for the CPU builds (once per process) and asks then, so ``impl="auto"`` can
    trace the kernel and its fallback behind a `jax.lax.cond` on it; a program lowered
    for any other platform gets False and never builds, loads or checks the kernel. XLA
    folds the constant and keeps one branch."""
    return kernel_ready_p.bind()
