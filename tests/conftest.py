"""Test setup: 8 forced host devices (expert-parallel tests), float64 off, hypothesis profile."""

import gc
import os
import zlib

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "jaxmoe",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("jaxmoe")


@pytest.fixture
def rng(request):
    """A fresh numpy Generator per test, seeded from the test's name (reproducible, never zeros)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module. Every XLA:CPU executable keeps
    memory mappings of its code; the whole suite in one process compiles enough programs to
    pass Linux's ``vm.max_map_count`` (65530), and XLA then crashes in a compile (a segfault
    at about test 850 of a single-process run)."""
    yield
    jax.clear_caches()
    gc.collect()
