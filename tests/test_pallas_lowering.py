"""Every kernel configuration lowers for CUDA from this CPU host, through Triton.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs the Pallas Triton
lowering (kernel body to Triton IR) without a GPU. With jaxlib <= 0.10.2 the kernel is
emitted as the ``__gpu$xla.gpu.triton`` custom call (XLA compiles the Triton IR); newer
jaxlibs compile it at lowering time and emit ``triton_kernel_call_ffi``. Either one
counts; a Mosaic GPU custom call (what JAX picks when no Triton compiler params are
passed) or a missing call fails.

jax >= 0.11 reads the GPU's compute capability during the Triton lowering and, on a host
without a GPU, raises "No supported GPU devices found" unless an abstract GPU device is in
scope: every lowering here runs inside ``use_abstract_mesh`` with an H200 `AbstractDevice`
(harmless on jax 0.10.2). benchmarks/gpu_compile_check.py runs this file under jax 0.11.2.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import gguf_block_weight, gpu_target

import jaxmoe
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.execution import ExecConfig
from jaxmoe.impls.pallas import experts_pallas, kernel_weight
from jaxmoe.quant import QuantizedTensor, fp8_block_tensor, quantize_int4_affine, quantize_int8
from pallas_kernels import tuning
from pallas_kernels.decode import decode_down, decode_gate_up
from pallas_kernels.down import down_project
from pallas_kernels.gmm import gmm
from pallas_kernels.launch import DecodeLaunch, Launch, Plan
from pallas_kernels.quant import QuantWeight
from pallas_kernels.swiglu import gate_up_swiglu

TRITON_CALL = re.compile(r"__gpu\$xla\.gpu\.triton|triton_kernel_call")


def lower_text(f, *args) -> str:
    with gpu_target():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def assert_triton(txt: str, n: int):
    assert "mosaic" not in txt.lower(), "lowered through Mosaic GPU, not Triton"
    found = len(TRITON_CALL.findall(txt))
    assert found == n, f"expected {n} Triton custom calls, found {found}"


#: GGUF mixes of super-block kinds (widths of whole super-blocks), and IQ4_NL, MXFP4 (blocks of 32).
GGUF_MIXES = {
    "q4_k_m": ("q4_k", "q4_k", "q6_k"),
    "q2_q3_iq4xs": ("q2_k", "q3_k", "iq4_xs"),
    "iq4_nl": ("iq4_nl",) * 3,
    "mxfp4": ("mxfp4",) * 3,
}


def weights(rng, e, d, f, kind, dtype=jnp.float32):
    if kind in GGUF_MIXES or kind.startswith("q5"):  # GGUF block bytes (Q4_K_M: Q4_K gate / up, Q6_K down)
        kinds = GGUF_MIXES.get(kind, (kind,) * 3)
        return [gguf_block_weight(rng, kk, s)[0] for kk, s in zip(kinds, ((e, f, d), (e, f, d), (e, d, f)))]
    ws = [rng.standard_normal(s).astype(np.float32) / 8 for s in ((e, d, f), (e, d, f), (e, f, d))]
    if kind == "fp8_e4m3":  # block-scaled FP8, 32 x 32 blocks (partial ones past f = 64's edge do not occur)
        return [
            fp8_block_tensor(
                jnp.asarray(np.swapaxes(w, 1, 2).astype(ml_dtypes.float8_e4m3fn)),
                jnp.asarray(
                    np.exp2(rng.uniform(-4, 0, (w.shape[0], -(-w.shape[2] // 32), -(-w.shape[1] // 32)))), jnp.float32
                ),
                32,
            )
            for w in ws
        ]
    if kind == "int8":
        return [quantize_int8(w) for w in ws]
    if kind == "int4":
        return [quantize_int4_affine(w, group_size=64) for w in ws]
    return [jnp.asarray(w, dtype) for w in ws]


def _cfg(d, f, e, k, **kw):
    cfg = jaxmoe.load_config("qwen3-30b-a3b")
    return dataclasses.replace(
        cfg, d_model=d, expert_dim=f, router=dataclasses.replace(cfg.router, num_experts=e, top_k=k), **kw
    )


@pytest.mark.parametrize("key", sorted(tuning.TABLE), ids=lambda k: f"{k[0]}-{k[1]}x{k[2]}")
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_table_config_lowers(rng, key, kind):
    """Each table entry, unfitted (its real block sizes, capped for float32 activations
    as `tuning.choose` does), through the whole pallas impl."""
    dt = jnp.bfloat16 if kind == "bf16" else jnp.float32
    kc = tuning.for_dtype(tuning.TABLE[key], dt)
    d, f, e, k = 256, 384, 8, 2
    t = 2 if kc.decode else 300
    wg, wu, wd = weights(rng, e, d, f, kind, dt)
    ew = jaxmoe.ExpertWeights(wg, wu, wd)
    x = jnp.asarray(rng.standard_normal((t, d)), dt)
    r = jaxmoe.Routing(jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32), jnp.ones((t, k), jnp.float32))
    f_ = functools.partial(experts_pallas, cfg=_cfg(d, f, e, k), ex=ExecConfig(interpret=False, kernel_config=kc))
    assert_triton(lower_text(f_, x, r, ew), 2)


@pytest.mark.parametrize("variant", ["oai_bias", "weight_on_input"])
@pytest.mark.parametrize("t", [2, 40])
def test_impl_variants_lower(rng, variant, t):
    d, f, e, k = 128, 64, 8, 2
    kw = dict(activation="swiglu_oai", expert_bias=True) if variant == "oai_bias" else dict(weight_on_input=True)
    cfg = _cfg(d, f, e, k, **kw)
    ew = jaxmoe.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16).experts
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    r = jaxmoe.Routing(jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32), jnp.ones((t, k), jnp.float32))
    assert_triton(lower_text(functools.partial(experts_pallas, cfg=cfg, ex=ExecConfig(interpret=False)), x, r, ew), 2)


@pytest.mark.parametrize(
    "kind", ["f32", "bf16", "f16", "int8", "int4", "q5_1", "q4_k_m", "q2_q3_iq4xs", "iq4_nl", "mxfp4", "fp8_e4m3"]
)
@pytest.mark.slow
def test_each_kernel_lowers(rng, kind):
    """gmm, gate_up_swiglu, down_project, decode_gate_up, decode_down, one call each (GGUF
    block kinds: Q5_1, IQ4_NL, MXFP4, and Q4_K_M's Q4_K / Q6_K or Q2_K / Q3_K / IQ4_XS at widths of
    whole super-blocks; block-scaled FP8: decoded in the kernels, no XLA decode before)."""
    d, f, e, t, k = (256, 256, 4, 20, 2) if kind in ("q4_k_m", "q2_q3_iq4xs") else (128, 64, 4, 20, 2)
    dt = {"bf16": jnp.bfloat16, "f16": jnp.float16}.get(kind, jnp.float32)
    wg, wu, wd = (kernel_weight(w) for w in weights(rng, e, d, f, kind, dt))
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    plan = plan_dispatch(ids, e, 16)
    kp = Plan(plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)
    x = jnp.asarray(rng.standard_normal((t, d)), dt)
    h = jnp.asarray(rng.standard_normal((t * k, f)), dt)
    lhs = jnp.asarray(rng.standard_normal((t * k, d)), dt)
    ws = jnp.ones((t * k,), jnp.float32)
    lc, dc = Launch(block_m=16, block_n=32, block_k=64), DecodeLaunch(block_n=32, block_k=64)
    calls = [
        (lambda a, w: gmm(a, w, kp, launch=lc), (lhs, wg)),
        (lambda a, w1, w2: gate_up_swiglu(a, plan.token_idx, kp, w1, w2, launch=lc), (x, wg, wu)),
        (lambda a, w, s: down_project(a, kp, w, row_scale=s, launch=dataclasses.replace(lc, block_n=64)), (h, wd, ws)),
        (lambda a, w1, w2: decode_gate_up(a, ids, w1, w2, launch=dc), (x, wg, wu)),
        (lambda a, w, s: decode_down(a, ids, w, row_scale=s, launch=dc), (h, wd, ws)),
    ]
    if kind in ("mxfp4", "fp8_e4m3"):  # the weights reach the kernels as their bytes
        assert all(isinstance(w, QuantWeight) and w.kind == kind for w in (wg, wu, wd))
    for fn, args in calls:
        assert_triton(lower_text(fn, *args), 1)


def test_aliased_output_lowers(rng):
    d, f, e, t, k = 64, 32, 4, 9, 2
    wg, wu, _ = weights(rng, e, d, f, "f32")
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    out = jnp.zeros((t * k, f), jnp.float32)
    dc = DecodeLaunch(block_n=32, block_k=64)
    txt = lower_text(lambda a, o: decode_gate_up(a, ids, wg, wu, out=o, launch=dc), x, out)
    assert_triton(txt, 1)
    assert "output_operand_alias" in txt or "operand_output_aliases" in txt or "tf.aliasing_output" in txt


_TENSOR = re.compile(r"tensor<([0-9x]+)x[a-z]+[0-9]*>")


def triton_operand_sizes(txt: str) -> list[list[int]]:
    """Element counts of the operands and results of each Triton custom call in ``txt``."""
    calls = []
    for line in txt.splitlines():
        if TRITON_CALL.search(line) and "custom_call" in line:
            types = line.rsplit(" : ", 1)[-1]
            calls.append([int(np.prod([int(v) for v in m.split("x")])) for m in _TENSOR.findall(types)])
    return calls


@pytest.mark.parametrize("t", [1, 2048])
def test_deepseek_v3_q8_0_operands_fit_32_bit_offsets(t):
    """DeepSeek-V3 in Q8_0 at its real size (abstract arrays): 256 x 2048 x 7168 = 3.76e9 int8
    codes per projection, over 2^31 elements but under the 2^32 bytes at which Pallas's
    Triton lowering switches to 64-bit offsets. Every operand each kernel receives must
    have < 2^31 elements (the codes go in as int32 words), and the whole stack must be
    passed (no per-call copy or slice: an operand holds all 3.76e9 / 4 words)."""
    cfg = jaxmoe.load_config("deepseek-v3")
    e, d, f, k, g = cfg.num_experts, cfg.d_model, cfg.expert_dim, cfg.top_k, 32
    S = jax.ShapeDtypeStruct

    def q8(n_in, n_out):
        return QuantizedTensor(S((e, n_out, n_in), jnp.int8), S((e, n_out, n_in // g), jnp.float16), None, "int8", g)

    ew = jaxmoe.ExpertWeights(q8(d, f), q8(d, f), q8(f, d))
    assert e * d * f >= 2**31 and e * d * f <= 2**32  # the range the fix is for
    r = jaxmoe.Routing(S((t, k), jnp.int32), S((t, k), jnp.float32))
    fn = functools.partial(experts_pallas, cfg=cfg, ex=ExecConfig(interpret=False))
    calls = triton_operand_sizes(lower_text(fn, S((t, d), jnp.bfloat16), r, ew))
    assert len(calls) == 2, calls
    for sizes in calls:
        assert max(sizes) < 2**31, f"a Triton kernel operand has {max(sizes):.3g} >= 2^31 elements: {sizes}"
        assert e * d * f // 4 in sizes, f"the codes are not passed whole as int32 words: {sizes}"


def triton_ir(f, *args) -> list[str]:
    """The Triton IR text of each Triton custom call of ``f`` lowered for CUDA (the
    ``ir`` of the custom call's backend config, MLIR bytecode, parsed back)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context

    with gpu_target():
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    out = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    oo = o.operation
                    if oo.name == "stablehlo.custom_call" and TRITON_CALL.search(
                        str(oo.attributes["call_target_name"])
                    ):
                        bc = oo.attributes["mhlo.backend_config"]
                        with _new_ir_context():
                            out.append(str(ir.Module.parse(ir.StringAttr(bc["ir"]).value_bytes)))
                    walk(oo)

    walk(lowered.compiler_ir("stablehlo").operation)
    return out


def test_float32_dots_are_three_tf32_unless_tf32(rng):
    """float32 tiles are multiplied as 3xTF32 (three tensor-core dots on operands split at
    the TF32 mantissa by a bit mask), as one TF32 dot only when asked; never Triton's
    ``ieee`` FMA dot (which spilled registers, benchmarks/gpu_compile_check.py)."""
    d, f, e, t, k = 128, 64, 4, 20, 2
    wg, wu, wd = weights(rng, e, d, f, "f32")
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    plan = plan_dispatch(ids, e, 16)
    kp = Plan(plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((t * k, f)), jnp.float32)

    def kernels(tf32):
        lc = Launch(block_m=16, block_n=32, block_k=64, tf32=tf32)
        irs = triton_ir(lambda a, w1, w2: gate_up_swiglu(a, plan.token_idx, kp, w1, w2, launch=lc), x, wg, wu)
        irs += triton_ir(lambda a, w: down_project(a, kp, w, launch=lc), h, wd)
        irs += triton_ir(lambda a, w: gmm(a, w, kp, launch=lc), h, wd)
        assert len(irs) == 3
        return irs

    for one, three in zip(kernels(True), kernels(False)):
        dots1 = [ln for ln in one.splitlines() if "tt.dot" in ln]
        dots3 = [ln for ln in three.splitlines() if "tt.dot" in ln]
        assert dots1 and len(dots3) == 3 * len(dots1), (len(dots1), len(dots3))
        for ln in dots1 + dots3:
            assert "tf32" in ln and "ieee" not in ln, ln.strip()[:300]
        assert "-8192" in three and "-8192" not in one  # the 0xFFFFE000 mask of the split
