"""Keep freed host memory in the process (glibc), so XLA:CPU reuses it between calls.

XLA:CPU allocates a call's results and temporaries afresh every call. glibc serves an
allocation that large with its own ``mmap`` (or, from a worker thread's arena, a fresh
heap) and hands it back to the system when it is freed, so the next call's buffers land
in new pages that the kernel must zero on first touch. A training step of a Qwen3.6 layer
allocates 3.2 GB of expert-weight gradients per step, and that zeroing was half of a
``T = 64`` step (docs/training.md).

`keep_freed_host_memory` sets three glibc malloc options through ``mallopt`` at run time
(the same as ``GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:
glibc.malloc.trim_threshold=...`` in the environment): one heap for every thread
(``M_ARENA_MAX = 1``), no per-allocation maps (``M_MMAP_MAX = 0``) and no trimming
(``M_TRIM_THRESHOLD = SIZE_MAX``: ``mallopt`` takes an ``int``, and ``-1`` is the only value
above 2 GiB it can pass). Freed memory then stays in the process and the next call
reuses it. The cost: the process keeps its peak heap until it exits. It is process-wide
and opt-in; jaxmoe never calls it by itself.

The heap settles after a few calls (a large freed block may be split by small
allocations and the next large one placed above it), then steady steps fault no pages
(``getrusage``'s minor faults; tests/test_host_memory.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: Whether `keep_freed_host_memory` has set the options in this process.
_kept = False

#: The same three options as a ``GLIBC_TUNABLES`` value, for a process started with them.
GLIBC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=100000000000"

#: ``mallopt`` parameters (glibc ``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def _jax_backends_started() -> bool:
    """Whether JAX has created its backends (and with them XLA:CPU's worker threads)."""
    mod = sys.modules.get("jax._src.xla_bridge")
    if mod is None:
        return False
    started = getattr(mod, "backends_are_initialized", None)
    return bool(started()) if callable(started) else False


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def glibc_malloc_available() -> bool:
    """Whether this process's C library is glibc with ``mallopt`` (Linux, not musl)."""
    return _glibc() is not None


def keep_freed_host_memory() -> bool:
    """Make glibc keep freed memory in the process for reuse (see the module docstring).

    Call it once, at the top of a CPU training or benchmark script, before JAX runs
    anything: XLA:CPU's worker threads take their malloc arenas when JAX creates its CPU
    backend, and one arena for all threads cannot be set for threads that already have
    one. Returns True when the options were set, False on a C library other than glibc
    (macOS, musl), where nothing is changed.

    Raises:
      RuntimeError: JAX's backends already exist (the arena setting would not reach
        XLA's threads), or glibc refused an option.
    """
    libc = _glibc()
    if libc is None:
        return False
    if _jax_backends_started():
        raise RuntimeError(
            "keep_freed_host_memory: JAX's backends are already initialized; call it before the first "
            f"JAX computation (or set GLIBC_TUNABLES={GLIBC_TUNABLES} in the environment)"
        )
    for name, param, value in (
        ("M_ARENA_MAX", M_ARENA_MAX, 1),
        ("M_MMAP_MAX", M_MMAP_MAX, 0),
        ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, -1),
    ):
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"keep_freed_host_memory: glibc mallopt({name}, {value}) failed")
    global _kept
    _kept = True
    return True


def host_memory_mode() -> str:
    """How this process's freed host memory is handled, for run records: ``"kept (jaxmoe.
    keep_freed_host_memory)"``, ``"GLIBC_TUNABLES=..."`` when the environment sets glibc
    malloc tunables, else ``"default"``."""
    if _kept:
        return "kept (jaxmoe.keep_freed_host_memory)"
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return f"GLIBC_TUNABLES={tunables}" if "glibc.malloc" in tunables else "default"


__all__ = ["GLIBC_TUNABLES", "glibc_malloc_available", "host_memory_mode", "keep_freed_host_memory"]
