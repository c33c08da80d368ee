"""``impl="auto"`` and the Pallas interpret switch are resolved for the lowering platform,
not the host: a whole `MoEBlock` lowered from this CPU host for CUDA holds the Triton
kernels, lowered for Intel (``oneapi`` / ``sycl`` / ``xpu``) holds no custom call at all
(no XLA:CPU kernel, no Triton: the loop-free ``xla_tiled`` path), and the same jitted
function still runs here on the CPU, matching the float64 reference."""

import dataclasses
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import gpu_target, np_moe, params_to_numpy
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

import jaxmoe
from jaxmoe.block import MoEBlock
from jaxmoe.execution import ExecConfig
from jaxmoe.impls.cpu import cpu_kernel_available
from jaxmoe.impls.cpu.build import TARGET as CPU_TARGET
from jaxmoe.impls.pallas import experts_pallas
from jaxmoe.platforms import INTEL_PLATFORMS

TRITON_CALL = re.compile(r"__gpu\$xla\.gpu\.triton|triton_kernel_call")
CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)|call_target_name = \"([^\"]+)\"")
TRITON_TARGET = "__gpu$xla.gpu.triton"


def _cfg(t_preset="qwen3-30b-a3b", d=128, f=64, e=8, k=2):
    cfg = jaxmoe.load_config(t_preset)
    return dataclasses.replace(
        cfg, d_model=d, expert_dim=f, router=dataclasses.replace(cfg.router, num_experts=e, top_k=k)
    )


def custom_calls(txt: str) -> set[str]:
    return {a or b for a, b in CUSTOM_CALL.findall(txt)}


def platform_switches(txt: str) -> list[int]:
    """The branch count of every platform switch in a StableHLO module's text: the
    ``stablehlo.case`` ops of `jax.lax.platform_dependent` that return data, indexed by the
    ``case`` that maps the platform index to the branches kept for the lowering platforms."""
    counts = []

    def visit(op):
        op = op.operation
        idx = op.operands[0].owner if op.name == "stablehlo.case" else None  # an op or a block
        if getattr(idx, "name", None) == "stablehlo.case":
            if [str(r.type) for r in op.results] != ["tensor<i32>"]:  # not an index remap itself
                counts.append(len(op.regions))
        return ir.WalkResult.ADVANCE

    with mlir.make_ir_context():
        ir.Module.parse(txt).operation.walk(visit)
    return counts


@pytest.fixture(scope="module")
def block():
    return MoEBlock(_cfg(), rngs=nnx.Rngs(3), dtype=jnp.float32)


@pytest.fixture(scope="module")
def x():
    return jnp.asarray(np.random.default_rng(11).normal(size=(40, 128)), jnp.float32)


def lower(f, x, *platforms) -> str:
    if "cuda" in platforms:
        with gpu_target():
            return f.trace(x).lower(lowering_platforms=platforms).as_text()
    return f.trace(x).lower(lowering_platforms=platforms).as_text()


def test_block_lowered_for_cuda_holds_triton_and_runs_on_cpu(block, x):
    f = jax.jit(lambda x: block(x))
    txt = lower(f, x, "cuda")
    assert "mosaic" not in txt.lower()
    assert len(TRITON_CALL.findall(txt)) == 2, custom_calls(txt)  # fused gate/up + down
    assert CPU_TARGET not in txt
    switches = platform_switches(txt)  # auto's and the Pallas interpret switch: the CUDA branch alone
    assert switches and set(switches) == {1}, switches
    y = f(x)  # the same jitted function, on this CPU
    ref, _, _ = np_moe(np.asarray(x), params_to_numpy(block.params()), block.cfg)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)
    cpu_txt = lower(f, x, "cpu")
    assert not TRITON_CALL.search(cpu_txt)
    # without the C++ kernel auto's CPU branch is xla (tests/test_impls.py::test_lowering_impls_per_platform)
    assert custom_calls(cpu_txt) == ({CPU_TARGET} if cpu_kernel_available() else set())


@pytest.mark.parametrize("platform", INTEL_PLATFORMS)
def test_block_lowered_for_intel_has_no_custom_call(block, x, platform):
    txt = lower(jax.jit(lambda x: block(x)), x, platform)
    assert not custom_calls(txt), custom_calls(txt)
    assert "stablehlo.while" not in txt  # xla_tiled: no loop over experts


def test_decode_block_for_intel_has_no_loop(block, x):
    """T = 1 (the pairs layout of xla_tiled, not the per-pair gather loop)."""
    txt = lower(jax.jit(lambda x: block(x)), x[:1], "oneapi")
    assert not custom_calls(txt) and "stablehlo.while" not in txt


def test_export_for_cuda_and_multiplatform_cpu_intel(block, x):
    f = jax.jit(lambda x: block(x))
    with gpu_target():
        exp = jax.export.export(
            f, platforms=("cuda",), disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)]
        )(x)
    assert len(TRITON_CALL.findall(exp.mlir_module())) == 2
    ref, _, _ = np_moe(np.asarray(x), params_to_numpy(block.params()), block.cfg)
    # one artifact for the CPU and Intel GPUs: a switch on the platform, resolved at compile time
    exp2 = jax.export.export(
        f, platforms=("cpu", "oneapi"), disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(CPU_TARGET)]
    )(x)
    assert 2 in platform_switches(exp2.mlir_module())  # both branches are in the artifact
    np.testing.assert_allclose(np.asarray(exp2.call(x)), ref, rtol=2e-5, atol=2e-5)  # the CPU branch
    # the Intel branch, run here: its own artifact (no custom call, so XLA:CPU compiles it)
    intel = jax.export.export(f, platforms=("oneapi",), disabled_checks=[jax.export.DisabledSafetyCheck.platform()])(x)
    assert not custom_calls(intel.mlir_module())
    # XLA:CPU of jax 0.11.2 aborts compiling this Intel-shaped program (a fusion emitter
    # check, "computation_partitioner.cc:269 Check failed: operand_maps.size() == 1"); the
    # CI's main jax (0.10) runs it, so the numbers are checked there
    if tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11):
        np.testing.assert_allclose(np.asarray(intel.call(x)), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_grad_through_auto_on_cpu(block, x):
    """auto's gradient on the CPU (its platform switch differentiated through the CPU branch's
    own reverse mode) equals dense's."""
    p = block.params()
    cfg = block.cfg

    def loss(impl):
        return lambda p, x: jnp.sum(jnp.sin(jaxmoe.moe_apply(p, x, cfg, impl=impl)))

    ga = jax.grad(loss("auto"), argnums=(0, 1))(p, x[:9])
    gd = jax.grad(loss("dense"), argnums=(0, 1))(p, x[:9])
    np.testing.assert_allclose(np.asarray(ga[1]), np.asarray(gd[1]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ga[0].experts.w_up), np.asarray(gd[0].experts.w_up), rtol=1e-4, atol=1e-5)


def _pallas_inputs(rng, t=24):
    cfg = _cfg(d=64, f=32, e=4, k=2)
    ew = jaxmoe.init_params(cfg, jax.random.key(1)).experts
    x = jnp.asarray(rng.normal(size=(t, 64)), jnp.float32)
    r = jaxmoe.Routing(
        jnp.asarray(rng.integers(0, 4, (t, 2)), jnp.int32), jnp.asarray(rng.uniform(0.1, 1, (t, 2)), jnp.float32)
    )
    return cfg, ew, x, r


@pytest.mark.slow
def test_pallas_interpret_follows_the_lowering_platform(rng):
    """impl="pallas" through the one platform switch: compiled in the CUDA branch,
    interpreted in the CPU one (the branch's static platform decides, nothing below it)."""
    cfg, ew, x, r = _pallas_inputs(rng)
    p = jaxmoe.MoEParams(jnp.asarray(rng.normal(size=(64, 4)), jnp.float32), ew)
    f = jax.jit(lambda x, r, ew: jaxmoe.moe_apply(dataclasses.replace(p, experts=ew), x, cfg, impl="pallas", routing=r))
    with gpu_target():
        cuda = f.trace(x, r, ew).lower(lowering_platforms=("cuda",)).as_text()
    assert len(TRITON_CALL.findall(cuda)) == 2
    cpu = f.trace(x, r, ew).lower(lowering_platforms=("cpu",)).as_text()
    assert not TRITON_CALL.search(cpu)  # interpret mode: plain HLO
    y = f(x, r, ew)  # runs here, interpreted
    yd = jaxmoe.experts.experts_dense(x, r, ew, cfg)
    np.testing.assert_allclose(np.asarray(y), np.asarray(yd), rtol=2e-5, atol=2e-5)


def test_exec_config_interpret_forces_the_mode(rng):
    cfg, ew, x, r = _pallas_inputs(rng, t=20)
    f = jax.jit(lambda x, r, ew: experts_pallas(x, r, ew, cfg, ExecConfig(interpret=True, platform="triton")))
    # interpret mode: no GPU target needed (and none wanted: an abstract mesh makes the
    # interpreted kernel's updates explicitly sharded on jax 0.11)
    assert not TRITON_CALL.search(f.trace(x, r, ew).lower(lowering_platforms=("cuda",)).as_text())
    g = jax.jit(lambda x, r, ew: experts_pallas(x, r, ew, cfg, ExecConfig(interpret=False, platform="cpu")))
    with pytest.raises(Exception, match="interpret"):  # compiled kernels do not lower for the CPU
        g.trace(x, r, ew).lower(lowering_platforms=("cpu",))


def test_the_removed_interpret_variable_is_named(rng, monkeypatch):
    cfg, ew, x, r = _pallas_inputs(rng, t=4)
    with pytest.raises(TypeError, match=r"'interpret' was removed; use ExecConfig\(interpret=...\)"):
        jaxmoe.moe_apply(jaxmoe.init_params(cfg, jax.random.key(0)), x, cfg, interpret=True)


def _platform_indices(jaxpr) -> int:
    """How many `jax.lax.platform_dependent` switches a jaxpr holds: each binds one
    ``platform_index``, the primitive the switch lowers to a per-platform constant."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "platform_index"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _platform_indices(sub)
    return n


@pytest.mark.parametrize("impl", ["auto", "xla", "pallas"])
def test_one_platform_switch_for_the_whole_layer(block, x, impl):
    """moe_apply makes exactly one platform switch (run_experts'), with a branch per
    distinct (strategy, platform) pair: nothing below it (dots, Pallas interpret mode,
    the shared expert) switches on the platform again."""
    jaxpr = jax.make_jaxpr(lambda x: block(x, impl=impl))(x[:9]).jaxpr
    assert _platform_indices(jaxpr) == 1
    # the table's branches for auto: cpu, pallas (CUDA / ROCm), xla_tiled (Intel), xla
    txt = jax.jit(lambda x: block(x)).trace(x).lower(lowering_platforms=("cpu", "oneapi", "tpu")).as_text()
    assert "jaxmoe_grouped_swiglu" in txt and "stablehlo.while" in txt  # the CPU kernel, the TPU's loop


def test_without_a_compiler_auto_lowers_everywhere_and_builds_only_for_the_cpu(rng, monkeypatch):
    """The C++ compiler made unavailable: a whole MoEBlock (auto) lowers for CUDA and for
    Intel without building, loading or checking the kernel (no build attempt at all);
    lowered for the CPU it tries once, finds no compiler, and the CPU branch falls back
    to XLA (no custom call) and still matches the float64 reference."""
    import jaxmoe.impls.cpu.build as build

    tries = []
    real = build.load_handler

    def load_handler(*a, **k):
        tries.append(a)
        return real(*a, **k)

    monkeypatch.setattr(build, "_compiler", lambda: None)
    monkeypatch.setattr(build, "_status", None)
    monkeypatch.setattr(build, "load_handler", load_handler)
    cfg = _cfg(d=96, f=48, e=8, k=2)  # shapes of its own: no cached executable of another test
    blk = MoEBlock(cfg, rngs=nnx.Rngs(5), dtype=jnp.float32)
    xs = jnp.asarray(rng.normal(size=(12, 96)), jnp.float32)
    f = jax.jit(lambda x: blk(x))
    assert len(TRITON_CALL.findall(lower(f, xs, "cuda"))) == 2
    for plat in INTEL_PLATFORMS:
        assert not custom_calls(lower(f, xs, plat))
    assert tries == []  # nothing built, loaded or checked for the GPUs
    cpu_txt = f.trace(xs).lower(lowering_platforms=("cpu",)).compile().as_text()
    assert tries and CPU_TARGET not in cpu_txt
    ref, _, _ = np_moe(np.asarray(xs), params_to_numpy(blk.params()), cfg)
    np.testing.assert_allclose(np.asarray(f(xs)), ref, rtol=2e-5, atol=2e-5)
