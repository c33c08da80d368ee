"""The elementwise middle of a SwiGLU expert, shared by the kernels and by jaxmoe's experts.

``swiglu``: ``silu(g) * u``. ``swiglu_oai`` (gpt-oss): ``(clip(u, -L, L) + 1) * g *
sigmoid(alpha * g)`` with ``g = min(g, L)``. Plain jnp, so it runs inside a kernel body
and in XLA alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

ACTIVATIONS = ("swiglu", "swiglu_oai")


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
