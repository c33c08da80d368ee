"""Pieces every kernel shares: Triton compiler params, the SwiGLU epilogue, the
interpret switch and argument checks."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

ACTIVATIONS = ("swiglu", "swiglu_oai")
#: Set to 1 to run the kernels in Pallas interpret mode (0 forces compiled mode).
INTERPRET_ENV = "JAXMOE_PALLAS_INTERPRET"


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Triton compiler params: passing them is what selects the Triton backend
    (without them JAX >= 0.9 lowers a GPU `pallas_call` with Mosaic GPU)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def default_interpret() -> bool:
    """Interpret mode from ``JAXMOE_PALLAS_INTERPRET``, else on whenever the default
    backend is not a GPU (so the same kernels run, slowly, on CPU)."""
    env = os.environ.get(INTERPRET_ENV, "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class Activation:
    """The elementwise middle of an expert (static): ``silu(g) * u`` or gpt-oss's
    ``(clip(u, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = min(g, L)``."""

    kind: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"Activation.kind: unknown {self.kind!r}; expected one of {ACTIVATIONS}")

    def __call__(self, g: jax.Array, u: jax.Array) -> jax.Array:
        if self.kind == "swiglu":
            return g * jax.nn.sigmoid(g) * u
        g = jnp.minimum(g, self.limit)
        u = jnp.clip(u, -self.limit, self.limit)
        return (u + 1) * (g * jax.nn.sigmoid(self.alpha * g))


def activation_of(cfg) -> Activation:
    """The `Activation` of a `jaxmoe.MoEConfig`."""
    return Activation(cfg.activation, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))


def check_array(name: str, a, shape: tuple, dtype=None, kinds: str | None = None) -> None:
    """ValueError naming ``name`` unless ``a`` has ``shape`` (None entries free) and dtype."""
    if a is None:
        raise ValueError(f"{name}: missing; expected shape {shape}")
    got = tuple(a.shape)
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
        raise ValueError(f"{name}: shape {got}, expected {shape}")
    if dtype is not None and a.dtype != jnp.dtype(dtype):
        raise ValueError(f"{name}: dtype {a.dtype}, expected {jnp.dtype(dtype)}")
    if kinds == "int" and not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"{name}: must be an integer array, got {a.dtype}")
    if kinds == "float" and not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"{name}: must be a floating-point array, got {a.dtype}")


def check_blocks(where: str, **blocks: int) -> None:
    for k, v in blocks.items():
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{where}: {k} must be a power of two >= 16, got {v!r}")


def check_out(where: str, out, shape: tuple, dtype) -> None:
    """The optional aliased output buffer must match the kernel's output exactly."""
    if out is None:
        return
    if tuple(out.shape) != tuple(shape) or out.dtype != jnp.dtype(dtype):
        raise ValueError(
            f"{where}: out buffer {tuple(out.shape)} {out.dtype} must be {tuple(shape)} {jnp.dtype(dtype)}"
        )
