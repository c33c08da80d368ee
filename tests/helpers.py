"""Shared test helpers: independent float64 numpy references (written from the model
references and docs/routing.md, not from jaxmoe's code), random inputs and shrunk configs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.params import init_params
from jaxmoe.quant import quantize_int4_affine, quantize_int8


def np_route(
    logits,
    *,
    k,
    score_fn="softmax",
    bias=None,
    n_group=1,
    topk_group=1,
    group_score="top2_sum",
    renorm="sum",
    eps=0.0,
    scale=1.0,
):
    """Per-token loop. Returns ids [T, k] (by descending selection score) and weights [T, k], float64."""
    z = np.asarray(logits, np.float64)
    t, e = z.shape
    ids = np.zeros((t, k), np.int64)
    ws = np.zeros((t, k), np.float64)
    for i in range(t):
        zi = z[i]
        if score_fn == "softmax":
            m = zi.max()
            s = np.exp(zi - m) / np.exp(zi - m).sum()
        elif score_fn == "sigmoid":
            s = 1.0 / (1.0 + np.exp(-zi))
        else:
            s = zi.copy()
        c = s + (0.0 if bias is None else np.asarray(bias, np.float64))
        if n_group > 1 and topk_group < n_group:
            per = e // n_group
            gs = []
            for g in range(n_group):
                grp = np.sort(c[g * per : (g + 1) * per])[::-1]
                gs.append(grp[0] if group_score == "max" else grp[0] + grp[1])
            keep = sorted(range(n_group), key=lambda g: (-gs[g], g))[:topk_group]
            c = np.array([c[j] if j // per in keep else -np.inf for j in range(e)])
        order = sorted(range(e), key=lambda j: (-c[j], j))[:k]
        sel = np.array(order)
        if score_fn == "softmax_topk":
            v = zi[sel]
            w = np.exp(v - v.max()) / np.exp(v - v.max()).sum()
        elif score_fn == "sigmoid_topk":
            w = 1.0 / (1.0 + np.exp(-zi[sel]))
        else:
            w = s[sel]
        if renorm == "sum":
            w = w / w.sum()
        elif renorm == "clamp":
            w = w / max(w.sum(), eps)
        elif renorm == "add":
            w = w / (w.sum() + eps)
        ids[i] = sel
        ws[i] = w * scale
    return ids, ws


def router_kwargs(rc):
    """np_route keyword arguments from a jaxmoe RouterConfig."""
    return dict(
        k=rc.top_k,
        score_fn=rc.score_fn,
        n_group=rc.n_group,
        topk_group=rc.topk_group,
        group_score=rc.group_score,
        renorm=rc.renorm,
        eps=rc.renorm_eps,
        scale=rc.routed_scaling_factor,
    )


def _silu(v):
    return v / (1.0 + np.exp(-v))


def np_act(g, u, activation="swiglu", alpha=1.702, limit=7.0):
    if activation == "swiglu":
        return _silu(g) * u
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))


def np_moe(x, p, cfg):
    """float64 MoE layer on numpy params (dict of arrays in the x @ W convention), per-token loop."""
    x = np.asarray(x, np.float64)
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    z = x @ f64(p["w_router"])
    if p.get("b_router") is not None:
        z = z + f64(p["b_router"])
    ids, ws = np_route(z, bias=f64(p.get("selection_bias")), **router_kwargs(cfg.router))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            xin = x[t] * ws[t, s] if cfg.weight_on_input else x[t]
            g = xin @ f64(p["w_gate"][e])
            u = xin @ f64(p["w_up"][e])
            if p.get("b_gate") is not None:
                g = g + f64(p["b_gate"][e])
                u = u + f64(p["b_up"][e])
            h = np_act(g, u, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
            o = h @ f64(p["w_down"][e])
            if p.get("b_down") is not None:
                o = o + f64(p["b_down"][e])
            y[t] += o if cfg.weight_on_input else ws[t, s] * o
    if p.get("s_gate") is not None:
        h = _silu(x @ f64(p["s_gate"])) * (x @ f64(p["s_up"]))
        o = h @ f64(p["s_down"])
        if p.get("s_sigmoid") is not None:
            o = o / (1.0 + np.exp(-(x @ f64(p["s_sigmoid"]))))[:, None]
        y += o
    return y, ids, ws


def params_to_numpy(mp):
    """A flat dict of numpy arrays from a jaxmoe MoEParams (quantized weights dequantized)."""
    from jaxmoe.quant import materialize

    def a(v):
        return None if v is None else np.asarray(materialize(v, np.float32) if hasattr(v, "qdata") else v)

    ew, sh = mp.experts, mp.shared
    d = dict(
        w_router=a(mp.w_router),
        b_router=a(mp.b_router),
        selection_bias=a(mp.selection_bias),
        w_gate=a(ew.w_gate),
        w_up=a(ew.w_up),
        w_down=a(ew.w_down),
        b_gate=a(ew.b_gate),
        b_up=a(ew.b_up),
        b_down=a(ew.b_down),
    )
    if sh is not None:
        d.update(s_gate=a(sh.w_gate), s_up=a(sh.w_up), s_down=a(sh.w_down), s_sigmoid=a(sh.gate))
    return d


def shrink(cfg, d=64, f=32, e=16):
    """``cfg`` at test widths (d, F, E), keeping its family's routing rule valid."""
    import dataclasses

    rc = cfg.router
    e = max(e, rc.n_group * 2) if rc.n_group > 1 else e
    k = min(rc.top_k, e // 2)
    if rc.n_group > 1:
        k = min(k, rc.topk_group * (e // rc.n_group))
    rc = dataclasses.replace(rc, num_experts=e, top_k=k)
    fs = (f * cfg.num_shared_experts) if cfg.shared_expert_dim else 0
    return dataclasses.replace(cfg, d_model=d, expert_dim=f, shared_expert_dim=fs, router=rc)


def random_params(cfg, rng, dtype=jnp.float32):
    return init_params(cfg, jax.random.key(int(rng.integers(1 << 30))), dtype=dtype)


def np_experts(x, ids, ws, p, cfg):
    """float64 routed-expert output for a given routing (per pair loop); a pair whose id is
    outside ``[0, E)`` adds nothing (docs/routing.md, "Invalid expert ids")."""
    x = np.asarray(x, np.float64)
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    n_experts = np.shape(p["w_gate"])[0]
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e, w = int(ids[t, s]), np.float64(ws[t, s])
            if not 0 <= e < n_experts:
                continue
            xin = x[t] * w if cfg.weight_on_input else x[t]
            g, u = xin @ f(p["w_gate"][e]), xin @ f(p["w_up"][e])
            if p.get("b_gate") is not None:
                g, u = g + f(p["b_gate"][e]), u + f(p["b_up"][e])
            o = np_act(g, u, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit) @ f(p["w_down"][e])
            if p.get("b_down") is not None:
                o = o + f(p["b_down"][e])
            y[t] += o if cfg.weight_on_input else w * o
    return y


def skewed_routing(rng, t, k, e, hot=None, share=0.8):
    """Distinct ids per token; expert ``hot`` in most tokens, several experts left empty."""
    hot = int(rng.integers(e)) if hot is None else hot
    pool = rng.permutation(e)[: max(k + 1, e // 2)]  # the other half of the experts stays empty
    pool = pool[pool != hot]
    ids = np.empty((t, k), np.int32)
    for i in range(t):
        if rng.random() < share:
            rest = rng.choice(pool, size=k - 1, replace=False)
            ids[i] = rng.permutation(np.concatenate([[hot], rest]))
        else:
            ids[i] = rng.choice(pool, size=k, replace=False)
    ws = rng.uniform(0.05, 1.0, size=(t, k)).astype(np.float32)
    return ids, ws


def assert_same_params(expected, *others):
    """Each of ``others`` has the pytree structure, dtypes and exact values of ``expected``."""
    leaves = jax.tree_util.tree_leaves_with_path(expected)
    for other in others:
        got = jax.tree_util.tree_leaves_with_path(other)
        assert [k for k, _ in got] == [k for k, _ in leaves]
        for (k, a), (_, b) in zip(leaves, got):
            assert a.dtype == b.dtype, jax.tree_util.keystr(k)
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(k))


def gguf_block_bytes(rng, qtype, shape, d_range=(1e-3, 4e-3)):
    """Random, valid GGUF block bytes for a logical numpy ``shape`` ``[..., out, in]`` of the
    block type ``qtype``: random codes and packed scales, finite float16 super-block scales
    drawn from ``d_range`` (Q4_1 / Q5_0 / Q5_1 through ``gguf.quants.quantize`` of random
    floats). Returns uint8 ``[..., out, in / block * block_bytes]``."""
    import gguf
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as QT

    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in (QT.Q4_1, QT.Q5_0, QT.Q5_1):
        return gguf.quants.quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), qtype)
    n_blocks = int(np.prod(shape)) // block
    b = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if qtype in (QT.Q4_K, QT.Q5_K):  # d, dmin at bytes 0:4
        b[:, 0:2] = rng.uniform(*d_range, (n_blocks, 1)).astype(np.float16).view(np.uint8)
        b[:, 2:4] = rng.uniform(*d_range, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    elif qtype == QT.Q6_K:  # d at the end
        b[:, size - 2 :] = (rng.uniform(*d_range, (n_blocks, 1)) / 10).astype(np.float16).view(np.uint8)
    else:
        raise ValueError(f"gguf_block_bytes: {qtype!r} is not a GGUF block type")
    return b.reshape(*shape[:-1], shape[-1] // block * size)


def quantize_experts(p, quant: str):
    """``p`` with its routed experts quantized: ``int8`` (Q8_0 rule, group 32) or ``int4``
    (MLX affine rule, group 32)."""
    q = quantize_int8 if quant == "int8" else (lambda w: quantize_int4_affine(w, 32))
    ew = p.experts
    return dataclasses.replace(
        p, experts=dataclasses.replace(ew, w_gate=q(ew.w_gate), w_up=q(ew.w_up), w_down=q(ew.w_down))
    )


#: The GPU the Triton lowering compiles for when the host has none (jax >= 0.11 asks:
#: "No supported GPU devices found, please specify an abstract GPU device").
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def gpu_target():
    """The context a CPU host lowers for CUDA in: an abstract mesh on an H200 (needed on
    jax 0.11, harmless on 0.10). Not for interpret-mode kernels (their updates would be
    explicitly sharded over the mesh on 0.11)."""
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200))


def gguf_block_weight(rng, kind: str, stored_shape):
    """A random GGUF block-kind weight (`gguf_block_bytes`) of ``stored_shape`` ``[E, out, in]``
    as a `QuantizedTensor`, and the float64 logical ``[E, in, out]`` that gguf.quants decodes
    from the same bytes (an independent reference)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants as gq

    from jaxmoe.quant import gguf_block_tensor

    raw = gguf_block_bytes(rng, QT[kind.upper()], stored_shape)
    qw = gguf_block_tensor(jnp.asarray(raw), kind, n_in=stored_shape[-1])
    return qw, np.swapaxes(gq.dequantize(raw, QT[kind.upper()]), -1, -2).astype(np.float64)


# ------------------------------------------------------------- the C++ kernel's one policy
# A test that needs ``impl="cpu"`` and finds its kernel unbuilt is SKIPPED with the
# compiler's message (never silently narrowed to the other impls); the one test that
# insists the kernel builds is tests/test_impls_cpu.py::test_kernel_is_built (and the
# backward's, tests/test_impls_cpu_backward.py::test_kernels_build), which fail with the
# same message. ``impl="auto"`` falling back to ``xla`` without the kernel is documented
# behaviour, checked as such (not skipped).


def cpu_kernel_skip_reason() -> str | None:
    """None when the C++ kernel built (building it on the first call), else the skip reason."""
    from jaxmoe.impls.cpu import cpu_kernel_status

    ok, msg = cpu_kernel_status()
    return None if ok else f"C++ kernel did not build: {msg}"


def needs_cpu_kernel():
    """A ``skipif`` mark for a test (or a parametrization) that runs ``impl="cpu"``."""
    reason = cpu_kernel_skip_reason()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def cpu_impls(impls):
    """``impls`` as ``parametrize`` values, ``"cpu"`` carrying `needs_cpu_kernel`."""
    return [pytest.param(i, marks=needs_cpu_kernel()) if i == "cpu" else i for i in impls]


def each_impl(impls):
    """Iterates ``impls`` inside a test; when ``"cpu"`` is among them and its kernel did not
    build, the others run first and the test then ends as skipped with the compiler's
    reason (a failure of the others still fails it)."""
    reason = cpu_kernel_skip_reason()
    yield from (i for i in impls if i != "cpu" or reason is None)
    if "cpu" in impls and reason is not None:
        pytest.skip(f"impl='cpu' not checked: {reason}")
