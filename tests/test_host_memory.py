"""`jaxmoe.host_memory.keep_freed_host_memory`: with it, a jitted call's fresh 128 MB result
reuses freed heap memory (no page faults once the heap has settled); without it every call
faults the result's pages anew. Counted with ``getrusage`` minor faults in child processes
(the option is process-wide and must be set before JAX starts its backends)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from jaxmoe.host_memory import glibc_malloc_available, keep_freed_host_memory

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import jax, jax.numpy as jnp
    from jaxmoe.host_memory import keep_freed_host_memory
    applied = keep_freed_host_memory() if sys.argv[1] == "keep" else None
    f = jax.jit(lambda w, s: w * s + 1.0)  # a fresh [32, 2048, 512] float32 result: 128 MiB
    w = jax.random.normal(jax.random.key(0), (32, 2048, 512))
    faults = []
    for i in range(24):
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        y = f(w, jnp.float32(1.5 + i))
        y.block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
        del y
    print(json.dumps({"applied": applied, "faults": faults}))
    """
)
PAGES = 32 * 2048 * 512 * 4 // 4096  # 4 KiB pages of one result


def child(mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_freed_memory_is_reused():
    if not glibc_malloc_available():  # macOS, musl: the call changes nothing and says so
        assert child("keep")["applied"] is False
        return
    plain, keep = child("plain"), child("keep")
    assert keep["applied"] is True
    tail_plain, tail_keep = plain["faults"][-8:], keep["faults"][-8:]
    # without it: every call's result lands in fresh pages (its own mmap)
    assert all(n >= PAGES // 2 for n in tail_plain), tail_plain
    # with it: once the heap has settled, calls reuse freed memory and fault (almost) nothing
    assert sum(n < PAGES // 100 for n in tail_keep) >= 4, keep["faults"]


def test_refused_after_jax_started():
    import jax.numpy as jnp

    jnp.arange(3).block_until_ready()  # this process's backends exist
    if not glibc_malloc_available():
        assert keep_freed_host_memory() is False
        return
    with pytest.raises(RuntimeError, match="before the first JAX computation"):
        keep_freed_host_memory()
