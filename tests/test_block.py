"""MoEBlock, the functional layer, configs and presets (the dense and gather references)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import np_moe, params_to_numpy, shrink

import jaxmoe
from jaxmoe import MoEBlock, MoEConfig, RouterConfig
from jaxmoe.quant import quantize_int4_affine, quantize_int8

PRESETS = jaxmoe.list_presets()


def test_presets_load_with_published_dims():
    assert {
        "qwen3.6-35b-a3b",
        "edge0-35b",
        "edge0-8b",
        "qwen3-30b-a3b",
        "qwen2-57b-a14b",
        "mixtral-8x7b",
        "deepseek-v3",
        "deepseek-v2-lite",
        "olmoe-1b-7b",
        "gpt-oss-20b",
    } <= set(PRESETS)
    q = jaxmoe.load_config("qwen3.6-35b-a3b")
    assert (q.d_model, q.num_experts, q.top_k, q.expert_dim, q.shared_expert_dim, q.num_layers) == (
        2048,
        256,
        8,
        512,
        512,
        40,
    )
    assert q.shared_expert_gate
    assert jaxmoe.load_config("edge0-35b").top_k == 4
    e8 = jaxmoe.load_config("edge0-8b")
    assert (
        e8.num_experts,
        e8.top_k,
        e8.router.n_group,
        e8.router.topk_group,
        e8.router.routed_scaling_factor,
        e8.router.score_fn,
        e8.dense_layers,
    ) == (128, 8, 8, 4, 2.5, "sigmoid", (0,))
    dv3 = jaxmoe.load_config("deepseek-v3")
    assert (dv3.d_model, dv3.num_experts, dv3.expert_dim, dv3.dense_layers) == (7168, 256, 2048, (0, 1, 2))


def test_unknown_preset_lists_available():
    with pytest.raises(ValueError, match="qwen3.6-35b-a3b"):
        jaxmoe.load_config("no-such-model")


def test_yaml_config_errors(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("d_model: 64\nexpert_dim: 32\nrouter: {num_experts: 8, top_k: 2}\nwidth: 3\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*width"):
        jaxmoe.load_config(p)
    p.write_text("d_model: 64\nexpert_dim: 32\nrouter: {num_experts: 8, top_k: 9}\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*top_k"):
        jaxmoe.load_config(p)
    p.write_text("d_model: 64\nexpert_dim: 32\nrouter: {num_experts: 8, top_k: 2, colour: red}\n")
    with pytest.raises(ValueError, match="colour"):
        jaxmoe.load_config(p)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(d_model=0), "d_model"),
        (dict(expert_dim=-1), "expert_dim"),
        (dict(shared_expert_dim=16, num_shared_experts=0), "num_shared_experts"),
        (dict(shared_expert_gate=True), "shared_expert_gate"),
        (dict(activation="gelu"), "activation"),
        (dict(num_layers=4, dense_layers=(4,)), "dense_layers"),
    ],
)
def test_bad_moe_config(kw, field):
    base = dict(d_model=64, expert_dim=32, router=RouterConfig(num_experts=8, top_k=2))
    with pytest.raises(ValueError, match=f"MoEConfig.{field}"):
        MoEConfig(**{**base, **kw})
    cfg = MoEConfig(**base)
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(cfg, **kw)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("impl", ["dense", "gather"])
@pytest.mark.slow
def test_block_matches_float64_numpy(preset, impl, rng):
    cfg = shrink(jaxmoe.load_config(preset))
    block = MoEBlock(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))), impl=impl)
    x = rng.normal(size=(2, 5, cfg.d_model)).astype(np.float32)
    y, r = block(jnp.asarray(x), return_routing=True)
    chex.assert_shape(y, x.shape)
    ref, ids, _ = np_moe(x.reshape(-1, cfg.d_model), params_to_numpy(block.params()), cfg)
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_ids), 1), np.sort(ids, 1))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, cfg.d_model), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_experts_match_dequantized_reference(quant, rng):
    cfg = shrink(jaxmoe.load_config("qwen3.6-35b-a3b"))
    p = jaxmoe.init_params(cfg, jax.random.key(int(rng.integers(1 << 30))))
    q = quantize_int8 if quant == "int8" else (lambda w: quantize_int4_affine(w, 32))
    ew = p.experts
    p = dataclasses.replace(
        p, experts=dataclasses.replace(ew, w_gate=q(ew.w_gate), w_up=q(ew.w_up), w_down=q(ew.w_down))
    )
    x = rng.normal(size=(7, cfg.d_model)).astype(np.float32)
    ref, _, _ = np_moe(x, params_to_numpy(p), cfg)
    for impl in ("dense", "gather"):
        y = jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl=impl)
        np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_weight_on_input_llama4(rng):
    cfg = MoEConfig(
        d_model=32,
        expert_dim=16,
        router=RouterConfig(num_experts=8, top_k=1, score_fn="sigmoid_topk", renorm="none"),
        shared_expert_dim=16,
        num_shared_experts=1,
        weight_on_input=True,
    )
    block = MoEBlock(cfg, rngs=nnx.Rngs(3))
    x = rng.normal(size=(9, 32)).astype(np.float32)
    ref, _, _ = np_moe(x, params_to_numpy(block.params()), cfg)
    for impl in ("dense", "gather"):
        np.testing.assert_allclose(np.asarray(block(jnp.asarray(x), impl=impl)), ref, rtol=2e-5, atol=2e-5)
    # and it differs from weighting the output (SwiGLU is not linear)
    out_cfg = dataclasses.replace(cfg, weight_on_input=False)
    ref2, _, _ = np_moe(x, params_to_numpy(block.params()), out_cfg)
    assert np.abs(ref - ref2).max() > 1e-3


@pytest.mark.slow
def test_tokens_are_independent(rng):
    cfg = shrink(jaxmoe.load_config("deepseek-v3"))
    block = MoEBlock(cfg, rngs=nnx.Rngs(5))
    x = jnp.asarray(rng.normal(size=(24, cfg.d_model)), jnp.float32)
    y = np.asarray(block(x))
    perm = rng.permutation(24)
    np.testing.assert_allclose(np.asarray(block(x[perm])), y[perm], rtol=1e-6, atol=1e-6)
    y_split = np.concatenate([np.asarray(block(x[:7])), np.asarray(block(x[7:]))])
    np.testing.assert_allclose(y_split, y, rtol=1e-6, atol=1e-6)


def test_nan_token_isolated(rng):
    cfg = shrink(jaxmoe.load_config("qwen3.6-35b-a3b"))
    block = MoEBlock(cfg, rngs=nnx.Rngs(1))
    x = rng.normal(size=(6, cfg.d_model)).astype(np.float32)
    x[4, 3] = np.nan
    for impl in ("dense", "gather"):
        y = np.asarray(block(jnp.asarray(x), impl=impl))
        assert np.isnan(y[4]).all()
        assert np.isfinite(np.delete(y, 4, axis=0)).all()


class JitParityTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        cfg = shrink(jaxmoe.load_config("gpt-oss-20b"))
        p = jaxmoe.init_params(cfg, jax.random.key(11))
        x = jax.random.normal(jax.random.key(12), (10, cfg.d_model))
        f = self.variant(lambda p, x: jaxmoe.moe_apply(p, x, cfg, impl="gather"))
        ref, _, _ = np_moe(np.asarray(x), params_to_numpy(p), cfg)
        chex.assert_trees_all_close(f(p, x), jnp.asarray(ref, jnp.float32), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_dense_equals_gather_bf16(rng):
    cfg = shrink(jaxmoe.load_config("mixtral-8x7b"))
    block = MoEBlock(cfg, rngs=nnx.Rngs(2), dtype=jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(12, cfg.d_model)), jnp.bfloat16)
    yd, yg = block(x, impl="dense"), block(x, impl="gather")
    assert yd.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(yd, np.float32), np.asarray(yg, np.float32), rtol=2e-2, atol=2e-2)


def test_block_bad_input(rng):
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"))
    block = MoEBlock(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_model"):
        block(jnp.ones((3, cfg.d_model + 1)))
    with pytest.raises(ValueError, match="impl"):
        block(jnp.asarray(rng.normal(size=(3, cfg.d_model)), jnp.float32), impl="warp-drive")
    p = block.params()
    bad = dataclasses.replace(p, experts=dataclasses.replace(p.experts, w_up=p.experts.w_up[:, :, :-1]))
    with pytest.raises(ValueError, match="w_up"):
        MoEBlock(cfg, params=bad)
    with pytest.raises(ValueError, match="rngs"):
        MoEBlock(cfg)


def test_return_aux_gives_the_router_losses(rng):
    """``return_aux``: logits and routing of the call, losses as numpy computes them from those."""
    cfg = shrink(jaxmoe.load_config("deepseek-v3"))  # sigmoid router: sigmoid sequence-balance scores
    block = MoEBlock(cfg, rngs=nnx.Rngs(3))
    b, s, d = 3, 5, cfg.d_model
    x = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
    y, aux = block(x, return_aux=True)
    y0, r0 = block(x, return_routing=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(aux.routing.expert_ids), np.asarray(r0.expert_ids))
    z = np.asarray(x, np.float64).reshape(-1, d) @ np.asarray(block.params().w_router, np.float64)
    np.testing.assert_allclose(np.asarray(aux.logits), z, rtol=1e-5, atol=1e-5)
    ids = np.asarray(aux.routing.expert_ids)
    e, k = cfg.num_experts, cfg.top_k
    counts = np.bincount(ids.reshape(-1), minlength=e)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(float(aux.load_balancing_loss), e * np.sum(counts / (b * s * k) * p.mean(0)), rtol=1e-5)
    lse = np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(float(aux.z_loss), np.mean(lse**2), rtol=1e-5)
    sig = 1 / (1 + np.exp(-z.reshape(b, s, e)))
    sig /= sig.sum(-1, keepdims=True)
    seq = [
        np.sum(e / (k * s) * np.bincount(ids.reshape(b, s, k)[i].reshape(-1), minlength=e) * sig[i].mean(0))
        for i in range(b)
    ]
    np.testing.assert_allclose(float(aux.sequence_balance_loss), np.mean(seq), rtol=1e-5)
    with pytest.raises(ValueError, match="return_routing or return_aux"):
        block(x, return_routing=True, return_aux=True)


@pytest.mark.slow
def test_router_losses_train_the_router_and_bias_is_state(rng):
    cfg = shrink(jaxmoe.load_config("deepseek-v3"))
    block = MoEBlock(cfg, rngs=nnx.Rngs(4))
    x = jnp.asarray(rng.normal(size=(16, cfg.d_model)), jnp.float32)
    assert "selection_bias" not in nnx.state(block, nnx.Param)  # kept out of the optimizer
    g = nnx.grad(lambda m: m(x, return_aux=True)[1].load_balancing_loss, argnums=nnx.DiffState(0, nnx.Param))(block)
    assert float(jnp.abs(g["w_router"].get_value()).max()) > 0
    assert float(jnp.abs(g["w_up"].get_value()).max()) == 0  # the losses see the router only
    bias0 = np.asarray(block.selection_bias.get_value())
    ids = block(x, return_routing=True)[1].expert_ids
    block.update_selection_bias(ids, gamma=0.01)
    want = bias0 + 0.01 * np.sign(
        np.bincount(np.asarray(ids).reshape(-1), minlength=cfg.num_experts).mean()
        - np.bincount(np.asarray(ids).reshape(-1), minlength=cfg.num_experts)
    )
    np.testing.assert_allclose(np.asarray(block.selection_bias.get_value()), want, rtol=1e-6, atol=1e-7)
    plain = MoEBlock(shrink(jaxmoe.load_config("qwen3-30b-a3b")), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no selection bias"):
        plain.update_selection_bias(ids, gamma=0.01)


@pytest.mark.slow
def test_docs_training_loop_runs():
    """docs/training.md's fine-tuning loop runs as written and its loss falls."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    code = re.search(r"# Training\n.*?```python\n(.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(compile(code, "docs/training.md", "exec"), ns)
    losses = ns["losses"]
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses
    bias = np.asarray(ns["block"].selection_bias.get_value())
    assert np.abs(bias - np.asarray(jaxmoe.MoEBlock(ns["cfg"], rngs=nnx.Rngs(0)).selection_bias.get_value())).max() > 0
