"""Block sizes of the Pallas/Triton MoE kernels: a small table keyed by shape.

Keys are ``(bucket, d, F)``: the token bucket (from the pair count ``P = T * k``),
the hidden width ``d`` and the expert width ``F``; ``(bucket, 0, 0)`` is the
fallback of a bucket. Every block size is a power of two; `fit` shrinks a block to
the (power-of-two padded) dimension, never below Triton's 16, and the kernels mask
the ragged edges, so no shape is ever refused for not being a multiple of a block.

The entries follow the usual Triton GEMM heuristics (tokamax's ragged_dot, vLLM's
fused_moe defaults: 64-128 row tiles, 64-128 column tiles, K steps of 64, 4-8 warps,
3-4 stages on Hopper). They have not been tuned on a GPU yet; benchmarks/gpu_bench.py
measures them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: Pair counts (``T * k``) at or below which the decode kernels run.
DECODE_MAX_PAIRS = 64
#: Programs a decode launch should have: two per SM of an H100 / H200 (132 SMs). Fewer
#: (pairs x column blocks) are made up by splitting K (`decode_splits`).
DECODE_MIN_PROGRAMS = 264
#: Pair counts at or below which the ``small`` grouped configuration runs.
SMALL_MAX_PAIRS = 4096

BUCKETS = ("decode", "small", "large")
MIN_BLOCK = 16


def is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def fit(block: int, dim: int, lo: int = MIN_BLOCK) -> int:
    """``block`` shrunk to the padded ``dim`` (power of two, at least ``lo``)."""
    return max(lo, min(block, next_pow2(dim)))


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tiles of one kernel launch.

    Attributes:
      block_m: rows (sorted pairs) per tile; unused by the decode kernels (one pair).
      block_n: output columns per program.
      block_k: reduction step.
      num_warps, num_stages: Triton launch parameters.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for f in ("block_m", "block_n", "block_k"):
            v = getattr(self, f)
            if not is_pow2(v) or v < MIN_BLOCK:
                raise ValueError(f"Blocks.{f} must be a power of two >= {MIN_BLOCK}, got {v!r}")
        if not is_pow2(self.num_warps) or self.num_warps > 32:
            raise ValueError(f"Blocks.num_warps must be a power of two <= 32, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"Blocks.num_stages must be a positive int, got {self.num_stages!r}")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Blocks of the gate/up (+SwiGLU) and the down (+weight) kernels of one shape.

    ``decode`` selects the one-program-per-pair kernels; otherwise the grouped kernels
    run over a dispatch plan built with ``gate_up.block_m`` (shared by both).
    ``decode_mma``: the decode kernels multiply on the tensor cores (the pair's row padded
    to 16, `pallas_kernels.decode`), else as float32 matvecs (kept for comparison on a GPU).
    """

    bucket: str
    gate_up: Blocks
    down: Blocks
    decode_mma: bool = True

    @property
    def decode(self) -> bool:
        return self.bucket == "decode"

    def __post_init__(self):
        if self.bucket not in BUCKETS:
            raise ValueError(f"KernelConfig.bucket: unknown {self.bucket!r}; expected one of {BUCKETS}")
        if not self.decode and self.gate_up.block_m != self.down.block_m:
            raise ValueError(
                f"KernelConfig: gate_up.block_m={self.gate_up.block_m} and down.block_m="
                f"{self.down.block_m} must match (one dispatch plan serves both)"
            )


_B = Blocks
TABLE: dict[tuple[str, int, int], KernelConfig] = {
    # fallbacks
    ("decode", 0, 0): KernelConfig("decode", _B(16, 64, 128, 4, 3), _B(16, 64, 128, 4, 3)),
    ("small", 0, 0): KernelConfig("small", _B(32, 64, 64, 4, 3), _B(32, 64, 64, 4, 3)),
    ("large", 0, 0): KernelConfig("large", _B(64, 128, 64, 8, 3), _B(64, 128, 64, 8, 3)),
    # Qwen3.5/3.6-35B-A3B, edge0: d 2048, F 512, 256 experts top-8 (few rows per expert)
    ("decode", 2048, 512): KernelConfig("decode", _B(16, 32, 256, 4, 3), _B(16, 64, 128, 4, 3)),
    ("small", 2048, 512): KernelConfig("small", _B(16, 64, 64, 4, 4), _B(16, 64, 64, 4, 4)),
    ("large", 2048, 512): KernelConfig("large", _B(64, 128, 64, 8, 3), _B(64, 128, 64, 8, 3)),
    # Mixtral-8x7B: d 4096, F 14336, 8 experts top-2 (many rows per expert)
    ("decode", 4096, 14336): KernelConfig("decode", _B(16, 128, 128, 4, 3), _B(16, 64, 256, 4, 3)),
    ("small", 4096, 14336): KernelConfig("small", _B(64, 128, 64, 8, 3), _B(64, 128, 64, 8, 3)),
    ("large", 4096, 14336): KernelConfig("large", _B(128, 128, 64, 8, 3), _B(128, 128, 64, 8, 3)),
}


def bucket_of(num_pairs: int) -> str:
    if num_pairs <= DECODE_MAX_PAIRS:
        return "decode"
    if num_pairs <= SMALL_MAX_PAIRS:
        return "small"
    return "large"


#: Caps on the grouped kernels' tiles for float32 activations: rows per tile, output
#: elements per tile (``block_m * block_n``), K step, warps, pipeline stages. Float32 tiles
#: are multiplied as 3xTF32 (three tensor-core dots on split operands,
#: `pallas_kernels.quant.tile_matmul`), which holds two more copies of each operand tile in
#: registers than a 16-bit dot: the 16-bit tiles (up to 128 x 128 x 64 at 8 warps) spilled
#: 60 B - 1 KB, 32 x 32 int4 gate/up 28 B and 16 x 64 int8 at 4 stages 4 B
#: (benchmarks/gpu_compile_check.py, with the GROUP_M launch order); these caps spill
#: nowhere in its cases. The decode kernels' tiles (a row padded to 16 for the dot) get the
#: same caps: the Mixtral decode entry's 128 x 128 float32 int8 / int4 tiles spilled 200 B -
#: 1 KB, the Qwen3.6 one's 32 x 256 int4 gate/up 2.4 KB.
F32_MAX_M, F32_MAX_TILE, F32_MAX_K, F32_MAX_WARPS, F32_MAX_STAGES = 16, 1024, 64, 4, 3


def for_dtype(kc: KernelConfig, dtype) -> KernelConfig:
    """``kc`` for activations of ``dtype``: unchanged for 16-bit ones (and for None); the
    blocks capped (`F32_MAX_M` ...) for float32 (and wider)."""
    if dtype is None or np.dtype(dtype).itemsize < 4:
        return kc
    bm = min(kc.gate_up.block_m, F32_MAX_M)  # one dispatch plan: gate/up and down share it

    def cap(b: Blocks) -> Blocks:
        return dataclasses.replace(
            b,
            block_m=bm,
            block_n=max(MIN_BLOCK, min(b.block_n, F32_MAX_TILE // bm)),
            block_k=min(b.block_k, F32_MAX_K),
            num_warps=min(b.num_warps, F32_MAX_WARPS),
            num_stages=min(b.num_stages, F32_MAX_STAGES),
        )

    return dataclasses.replace(kc, gate_up=cap(kc.gate_up), down=cap(kc.down))


def choose(num_pairs: int, d: int, f: int, dtype=None) -> KernelConfig:
    """The table's `KernelConfig` for ``P = T * k`` pairs of a ``d x F`` expert,
    with every block fitted to the shape (`fit`) and, given the activations' ``dtype``,
    capped for it (`for_dtype`)."""
    if num_pairs < 1 or d < 1 or f < 1:
        raise ValueError(f"tuning.choose: need positive num_pairs, d, F; got {num_pairs}, {d}, {f}")
    b = bucket_of(num_pairs)
    kc = TABLE.get((b, d, f)) or TABLE[(b, 0, 0)]
    return for_dtype(fit_config(kc, num_pairs, d, f), dtype)


def fixed(d: int, f: int, dtype=None) -> KernelConfig:
    """A grouped `KernelConfig` for a ``d x F`` expert that does not depend on the pair
    count: the ``small`` entry with ``block_m`` kept and the other blocks fitted to ``d``
    and ``F`` only. With it every output row is computed by the same tile program
    (same K steps, same accumulation order) whatever ``T`` is: batch invariance, at the
    cost of the decode kernels' speed for a handful of tokens."""
    if d < 1 or f < 1:
        raise ValueError(f"tuning.fixed: need positive d, F; got {d}, {f}")
    kc = TABLE.get(("small", d, f)) or TABLE[("small", 0, 0)]
    bm = kc.gate_up.block_m
    gu = dataclasses.replace(kc.gate_up, block_n=fit(kc.gate_up.block_n, f), block_k=fit(kc.gate_up.block_k, d))
    dn = dataclasses.replace(kc.down, block_m=bm, block_n=fit(kc.down.block_n, d), block_k=fit(kc.down.block_k, f))
    return for_dtype(KernelConfig("small", gu, dn), dtype)


def fit_config(kc: KernelConfig, num_pairs: int, d: int, f: int) -> KernelConfig:
    """``kc`` with blocks shrunk to the shape: gate/up is ``[P, d] x [d, F]``, down ``[P, F] x [F, d]``."""
    bm = fit(kc.gate_up.block_m, num_pairs)
    gu = dataclasses.replace(
        kc.gate_up, block_m=bm, block_n=fit(kc.gate_up.block_n, f), block_k=fit(kc.gate_up.block_k, d)
    )
    dn = dataclasses.replace(
        kc.down,
        block_m=bm if not kc.decode else fit(kc.down.block_m, num_pairs),
        block_n=fit(kc.down.block_n, d),
        block_k=fit(kc.down.block_k, f),
    )
    return dataclasses.replace(kc, gate_up=gu, down=dn)


def decode_splits(programs: int, steps: int) -> int:
    """K splits of a decode launch of ``programs`` (pairs x column blocks) over ``steps``
    K steps: the fewest that give `DECODE_MIN_PROGRAMS` programs, at most one per step
    (e.g. Qwen3.6 gate/up at T = 1: 8 pairs x 16 column blocks over 8 steps -> 3 splits),
    none of them empty (`whole_splits`)."""
    if programs <= 0 or steps <= 1:
        return 1
    return whole_splits(min(steps, -(-DECODE_MIN_PROGRAMS // programs)), steps)


def whole_splits(splits: int, steps: int) -> int:
    """``splits`` lowered so that none is empty: ``ceil(steps / s)`` steps per split leave
    ``ceil(steps / ceil(steps / s))`` splits with work (3 over 4 steps: 2 of 2)."""
    per = -(-steps // splits)
    return -(-steps // per)
