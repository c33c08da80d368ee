"""Bytes held for the experts of one layer of a quantized Hugging Face checkpoint, against the file's.

Writes a one-MoE-layer synthetic checkpoint at the real widths of ``--model`` (random valid
tensors under the Hub names): ``gpt-oss`` (gpt-oss-20b / 120b widths, d = F = 2880; MXFP4
``experts.{gate_up,down}_proj_{blocks,scales}``) or ``deepseek-v3`` (d = 7168, F = 2048, one
shared expert; F8_E4M3 ``weight`` + float32 ``weight_scale_inv`` per 128 x 128 block), with
``--experts`` routed experts. Loads the layer as jaxmoe keeps it (MXFP4 as GGUF ``mxfp4``
blocks, FP8 as ``fp8_e4m3``) or, with ``--dequantize``, as float32 (``quantized=False``, the
former behaviour), and prints the expert bytes held, the file's bytes of those tensors,
their ratio, the load time, the process's peak RSS and one token's forward time
(``impl="auto"``). Run each mode in its own process to compare peak RSS. ``--peak`` also
loads the layer in a fresh process and reports the load's own peak host memory against
the bytes it holds (`load_peak.measure`).

    python benchmarks/safetensors_quantized_load.py --model gpt-oss --experts 8
    python benchmarks/safetensors_quantized_load.py --model gpt-oss --experts 32 --peak
    python benchmarks/safetensors_quantized_load.py --model deepseek-v3 --experts 4 --dequantize
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import transformers as T
from load_peak import describe, measure
from safetensors.numpy import save_file

import jaxmoe
from jaxmoe import io as jio
from jaxmoe.quant import QuantizedTensor


def write_gptoss(path: Path, e: int, rng) -> dict[str, np.ndarray]:
    d = f = 2880
    cfg = T.GptOssConfig(
        hidden_size=d,
        intermediate_size=f,
        num_hidden_layers=1,
        num_local_experts=e,
        num_experts_per_tok=min(4, e),
        layer_types=["full_attention"],
    ).to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    p = "model.layers.0.mlp"
    t = {
        f"{p}.router.weight": rng.standard_normal((e, d)).astype(ml_dtypes.bfloat16),
        f"{p}.router.bias": rng.standard_normal(e).astype(ml_dtypes.bfloat16),
        f"{p}.experts.gate_up_proj_bias": rng.standard_normal((e, 2 * f)).astype(ml_dtypes.bfloat16),
        f"{p}.experts.down_proj_bias": rng.standard_normal((e, d)).astype(ml_dtypes.bfloat16),
    }
    for name, (out, n) in (("gate_up_proj", (2 * f, d)), ("down_proj", (d, f))):
        t[f"{p}.experts.{name}_blocks"] = rng.integers(0, 256, (e, out, n // 32, 16), dtype=np.uint8)
        t[f"{p}.experts.{name}_scales"] = rng.integers(118, 124, (e, out, n // 32), dtype=np.uint8)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return {k: v for k, v in t.items() if k.endswith(("_blocks", "_scales"))}


def write_dsv3(path: Path, e: int, rng) -> dict[str, np.ndarray]:
    d, f = 7168, 2048
    cfg = T.DeepseekV3Config(
        hidden_size=d,
        num_hidden_layers=1,
        moe_intermediate_size=f,
        n_routed_experts=e,
        num_experts_per_tok=min(8, e),
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=0,
    ).to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    p = "model.layers.0.mlp"
    t = {
        f"{p}.gate.weight": rng.standard_normal((e, d)).astype(ml_dtypes.bfloat16),
        f"{p}.gate.e_score_correction_bias": rng.standard_normal(e).astype(np.float32) * 0.01,
    }
    for m in [f"{p}.experts.{j}" for j in range(e)] + [f"{p}.shared_experts"]:
        for n, (out, k) in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            raw = rng.integers(0, 256, (out, k), dtype=np.uint8)
            t[f"{m}.{n}.weight"] = (
                np.where((raw & 0x7F) == 0x7F, raw ^ 1, raw).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
            )
            t[f"{m}.{n}.weight_scale_inv"] = rng.uniform(1e-4, 1e-3, (-(-out // 128), -(-k // 128))).astype(np.float32)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return {k: v for k, v in t.items() if k.endswith((".weight", ".weight_scale_inv")) and "experts" in k}


def held(w) -> int:
    if isinstance(w, QuantizedTensor):
        return w.nbytes
    return int(np.asarray(w).nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt-oss", "deepseek-v3"), default="gpt-oss")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--dequantize", action="store_true", help="load with quantized=False (float32 experts)")
    ap.add_argument("--peak", action="store_true", help="the load's peak host memory, in a fresh process")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        files = (write_gptoss if a.model == "gpt-oss" else write_dsv3)(Path(tmp), a.experts, rng)
        file_bytes = sum(v.nbytes for v in files.values())
        del files
        if a.peak:
            kw = {"quantized": False} if a.dequantize else {}
            print(f"from_pretrained(layer=0) in a fresh process: {describe(measure(tmp, 0, **kw))}")
        t0 = time.perf_counter()
        cfg, params = jio.load_layer(tmp, layer=0, quantized=False if a.dequantize else None)
        load_s = time.perf_counter() - t0
    ws = [params.experts.w_gate, params.experts.w_up, params.experts.w_down]
    if params.shared is not None:
        ws += [params.shared.w_gate, params.shared.w_up, params.shared.w_down]
    kinds = sorted({w.kind if isinstance(w, QuantizedTensor) else str(np.asarray(w).dtype) for w in ws})
    held_bytes = sum(held(w) for w in ws)
    dev = jax.tree.map(jnp.asarray, params)
    x = jnp.asarray(rng.standard_normal((1, cfg.d_model)).astype(np.float32))
    run = jax.jit(lambda p, x: jaxmoe.moe_apply(p, x, cfg, impl="auto"))
    run(dev, x).block_until_ready()
    t1 = time.perf_counter()
    for _ in range(5):
        run(dev, x).block_until_ready()
    fwd_ms = (time.perf_counter() - t1) / 5 * 1e3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"{a.model} E={a.experts} {'dequantized' if a.dequantize else 'kept'} ({', '.join(kinds)}): "
        f"expert bytes held {held_bytes} / file {file_bytes} = {held_bytes / file_bytes:.2f}; "
        f"load {load_s:.2f} s; peak RSS {rss:.2f} GiB; one-token forward (auto) {fwd_ms:.1f} ms"
    )


if __name__ == "__main__":
    main()
