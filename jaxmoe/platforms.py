"""JAX platform names, grouped by what can run there (one place for the whole package)."""

from __future__ import annotations

#: Platforms of the OpenXLA Intel GPU plugin (jax-oneapi-pjrt) across its versions.
INTEL_PLATFORMS = ("oneapi", "sycl", "xpu")
#: Platforms whose XLA backend takes Pallas's Triton lowering.
PALLAS_PLATFORMS = ("cuda", "rocm", "gpu")
#: Platforms with a native `jax.lax.ragged_dot` (others expand it to a dense masked dot).
RAGGED_PLATFORMS = ("cuda", "rocm", "gpu", "tpu")
#: Platforms with their own branch of ``impl="auto"`` at lowering time (names that
#: `jax.lax.platform_dependent` takes; any other platform gets the default branch).
BRANCH_PLATFORMS = ("cpu", "cuda", "rocm", *INTEL_PLATFORMS)
