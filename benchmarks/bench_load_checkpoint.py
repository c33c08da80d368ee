"""Load time of one MoE layer from a synthetic mlx-lm 4-bit checkpoint at Qwen3.6 width.

Writes a 2-layer checkpoint (d=2048, F=512, E=256, shared expert 512; random uint32 code
words and bf16 scales/biases, the layout mlx-lm writes) to a temporary directory, then
times ``jaxmoe.from_pretrained(dir, layer=1)`` and the first / steady decode call.

    python benchmarks/bench_load_checkpoint.py [--experts 256] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

import jaxmoe
from jaxmoe.io.safetensors_dir import SafetensorsDir


def write(path: Path, layers: int, e: int, d: int, f: int, fs: int, rng) -> int:
    t = {}

    def q(name, shape):
        *lead, out, n = shape
        t[f"{name}.weight"] = rng.integers(0, 2**32, (*lead, out, n // 8), dtype=np.uint32)
        t[f"{name}.scales"] = (rng.random((*lead, out, n // 64)) * 0.01).astype(ml_dtypes.bfloat16)
        t[f"{name}.biases"] = (-rng.random((*lead, out, n // 64)) * 0.08).astype(ml_dtypes.bfloat16)

    for i in range(layers):
        p = f"language_model.model.layers.{i}.mlp"
        q(f"{p}.switch_mlp.gate_proj", (e, f, d))
        q(f"{p}.switch_mlp.up_proj", (e, f, d))
        q(f"{p}.switch_mlp.down_proj", (e, d, f))
        q(f"{p}.gate", (e, d))
        q(f"{p}.shared_expert.gate_proj", (fs, d))
        q(f"{p}.shared_expert.up_proj", (fs, d))
        q(f"{p}.shared_expert.down_proj", (d, fs))
        t[f"{p}.shared_expert_gate.weight"] = rng.standard_normal((1, d)).astype(ml_dtypes.bfloat16)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "mlx"})
    qc = {"group_size": 64, "bits": 4}
    cfg = {
        "model_type": "qwen3_5_moe",
        "quantization": qc,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": d,
            "num_hidden_layers": layers,
            "num_experts": e,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": f,
            "shared_expert_intermediate_size": fs,
        },
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return (path / "model.safetensors").stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        size = write(Path(tmp), a.layers, a.experts, 2048, 512, 512, rng)
        orig = SafetensorsDir.get
        read = []

        def spy(self, name, shape=None):
            arr = orig(self, name, shape)
            read.append(arr.nbytes)
            return arr

        SafetensorsDir.get = spy
        t0 = time.perf_counter()
        block = jaxmoe.from_pretrained(tmp, layer=a.layers - 1, impl="gather")
        t1 = time.perf_counter()
        x = jnp.asarray(rng.standard_normal((1, 2048)), jnp.float32)
        block(x).block_until_ready()
        t2 = time.perf_counter()
        n = 20
        for _ in range(n):
            y = block(x)
        y.block_until_ready()
        t3 = time.perf_counter()
        ew = block.params().experts
        print(f"checkpoint {size / 2**20:.0f} MiB on disk, {a.layers} layers, E={a.experts}")
        print(
            f"from_pretrained(layer={a.layers - 1}): {t1 - t0:.2f} s, read {sum(read) / 2**20:.0f} MiB "
            f"in {len(read)} tensors; experts kept {type(ew.w_gate).__name__} "
            f"({sum(w.nbytes for w in (ew.w_gate, ew.w_up, ew.w_down)) / 2**20:.0f} MiB)"
        )
        print(f"first call (T=1, gather, compile included): {t2 - t1:.2f} s; steady: {(t3 - t2) / n * 1e3:.1f} ms/call")


if __name__ == "__main__":
    main()
