"""``impl="auto"`` and the Pallas interpret switch are resolved for the lowering platform,
not the host: a whole `MoEBlock` lowered from this CPU host for CUDA holds the Triton
kernels, lowered for Intel (``oneapi`` / ``sycl`` / ``xpu``) holds no custom call at all
(no XLA:CPU kernel, no Triton: the loop-free ``xla_tiled`` path), and the same jitted
function still runs here on the CPU, matching the float64 reference."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import gpu_target, np_moe, params_to_numpy

import jaxmoe
from jaxmoe.block import MoEBlock
from jaxmoe.impls.cpu import cpu_kernel_available
from jaxmoe.impls.cpu.build import TARGET as CPU_TARGET
from jaxmoe.impls.pallas import experts_pallas
from jaxmoe.platforms import INTEL_PLATFORMS
from pallas_kernels.common import INTERPRET_ENV

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
    assert "stablehlo.case" not in txt or "cosine" not in txt  # one branch kept (sanity of the regex below)
    y = f(x)  # the same jitted function, on this CPU
    ref, _, _ = np_moe(np.asarray(x), params_to_numpy(block.params()), block.cfg)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)
    cpu_txt = lower(f, x, "cpu")
    assert not TRITON_CALL.search(cpu_txt)
    if cpu_kernel_available():
        assert custom_calls(cpu_txt) == {CPU_TARGET}


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
    # one artifact for the CPU and Intel GPUs: a switch on the platform, resolved at compile time
    exp2 = jax.export.export(
        f, platforms=("cpu", "oneapi"), disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(CPU_TARGET)]
    )(x)
    np.testing.assert_array_equal(np.asarray(exp2.call(x)), np.asarray(f(x)))


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


def test_pallas_interpret_switch_follows_the_lowering_platform(rng, monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    cfg, ew, x, r = _pallas_inputs(rng)
    f = jax.jit(lambda x, r, ew: experts_pallas(x, r, ew, cfg))
    with gpu_target():
        cuda = f.trace(x, r, ew).lower(lowering_platforms=("cuda",)).as_text()
    assert len(TRITON_CALL.findall(cuda)) == 2
    cpu = f.trace(x, r, ew).lower(lowering_platforms=("cpu",)).as_text()
    assert not TRITON_CALL.search(cpu)  # interpret mode: plain HLO
    y = f(x, r, ew)  # runs here, interpreted
    yd = jaxmoe.experts.experts_dense(x, r, ew, cfg)
    np.testing.assert_allclose(np.asarray(y), np.asarray(yd), rtol=2e-5, atol=2e-5)


def test_interpret_env_forces_the_mode(rng, monkeypatch):
    cfg, ew, x, r = _pallas_inputs(rng, t=20)
    monkeypatch.setenv(INTERPRET_ENV, "1")
    f = jax.jit(lambda x, r, ew: experts_pallas(x, r, ew, cfg))
    # interpret mode: no GPU target needed (and none wanted: an abstract mesh makes the
    # interpreted kernel's updates explicitly sharded on jax 0.11)
    assert not TRITON_CALL.search(f.trace(x, r, ew).lower(lowering_platforms=("cuda",)).as_text())
    monkeypatch.setenv(INTERPRET_ENV, "0")
    g = jax.jit(lambda x, r, ew: experts_pallas(x, r, ew, cfg))
    with pytest.raises(Exception, match="interpret"):  # compiled kernels do not lower for the CPU
        g.trace(x, r, ew).lower(lowering_platforms=("cpu",))
