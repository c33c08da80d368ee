"""Shared test helpers: the float64 numpy oracle (the eval's, `jaxmoe.evaluation.reference`:
written from the model references and docs/routing.md, not from jaxmoe's kernels), random
inputs and shrunk configs (`jaxmoe.evaluation.presets.shrink_config`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.evaluation.presets import shrink_config
from jaxmoe.evaluation.reference import act_f64, reference_forward, route_f64, routed_f64
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.params import MoEParams, init_params
from jaxmoe.quant import quantize_int4_affine, quantize_int8
from jaxmoe.routing import Routing


def np_route(logits, rc, bias=None):
    """float64 routing of ``logits [T, E]`` under the `RouterConfig` ``rc`` (the eval's oracle,
    `jaxmoe.evaluation.reference.route_f64`): ids [T, k] by descending selection score,
    weights [T, k]."""
    r = route_f64(logits, rc, None if bias is None else np.asarray(bias, np.float64))
    return r.expert_ids, r.weights


#: The expert activation of the oracle, for tests that loop over experts themselves.
np_act = act_f64


def np_params(p):
    """A numpy parameter dict (`params_to_numpy`) as the `MoEParams` the oracle reads."""
    ew = ExpertWeights(p["w_gate"], p["w_up"], p["w_down"], p.get("b_gate"), p.get("b_up"), p.get("b_down"))
    sh = None if p.get("s_gate") is None else SharedWeights(p["s_gate"], p["s_up"], p["s_down"], p.get("s_sigmoid"))
    return MoEParams(p.get("w_router"), ew, p.get("b_router"), p.get("selection_bias"), sh)


def np_moe(x, p, cfg):
    """float64 MoE layer on numpy params (dict of arrays in the x @ W convention): the eval's
    oracle, `jaxmoe.evaluation.reference.reference_forward`. Returns (y, ids, weights)."""
    y, r = reference_forward(np_params(p), x, cfg)
    return y, r.expert_ids, r.weights


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
    """``cfg`` at test widths (`shrink_config`): d_model ``d``, experts of width ``f``, ``e``
    experts (at least two per group of a group limit), top-k at most ``e // 2`` (so routing
    chooses), each shared expert of width ``f``."""
    rc = cfg.router
    e = max(e, rc.n_group * 2) if rc.n_group > 1 else e
    return shrink_config(
        cfg, d_model=d, expert_dim=f, shared_expert_dim=f * cfg.num_shared_experts, num_experts=e, top_k=e // 2
    )


def random_params(cfg, rng, dtype=jnp.float32):
    return init_params(cfg, jax.random.key(int(rng.integers(1 << 30))), dtype=dtype)


def np_experts(x, ids, ws, p, cfg):
    """float64 routed-expert output for a given routing (`jaxmoe.evaluation.reference.routed_f64`);
    a pair whose id is outside ``[0, E)`` adds nothing (docs/routing.md, "Invalid expert ids")."""
    return routed_f64(np_params(p), x, Routing(np.asarray(ids), np.asarray(ws)), cfg)


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
    drawn from ``d_range`` (Q4_0 / Q4_1 / Q5_0 / Q5_1 / MXFP4 through ``gguf.quants.quantize`` of
    random floats; the IQ1-3 / TQ kinds: random bytes with that scale). Returns uint8 ``[..., out, in / block * block_bytes]``."""
    import gguf
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as QT

    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.MXFP4):
        return gguf.quants.quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), qtype)
    n_blocks = int(np.prod(shape)) // block
    b = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)

    def f16(at: int, div: float = 1.0) -> None:
        b[:, at : at + 2] = (rng.uniform(*d_range, (n_blocks, 1)) / div).astype(np.float16).view(np.uint8)

    if qtype in (QT.Q4_K, QT.Q5_K):  # d, dmin at bytes 0:4
        f16(0)
        f16(2)
    elif qtype == QT.Q6_K:  # d at the end
        f16(size - 2, 10)
    elif qtype == QT.Q2_K:  # d, dmin at the end
        f16(size - 4, 0.5)
        f16(size - 2, 0.5)
    elif qtype == QT.Q3_K:  # d at the end
        f16(size - 2)
    elif qtype == QT.IQ4_NL:  # d first
        f16(0, 10)
    elif qtype == QT.IQ4_XS:  # d first, then 6-bit signed sub-block scales
        f16(0, 100)
    elif qtype in (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS):  # d first; grid values up to 62, scales to 15.5
        f16(0, 100)
    elif qtype == QT.IQ3_S:  # d first; grid values up to 15, scales 1 + 2 s up to 31
        f16(0, 100)
    elif qtype == QT.IQ1_S:  # d first; values (2 s + 1)(+-1 +- 1/8)
        f16(0, 10)
    elif qtype == QT.IQ1_M:  # d's 16 bits in the top nibbles of the 4 scale words (bytes 48:56)
        d = (rng.uniform(*d_range, n_blocks) / 10).astype(np.float16).view(np.uint16)
        sw = b[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for i, sh in enumerate((0, 4, 8, 12)):  # word i: bits 4 i .. 4 i + 3 of d
            sw[:, i] |= ((d >> np.uint16(sh)) & np.uint16(0xF)) << np.uint16(12)
        b[:, 48:56] = sw.view(np.uint8)
    elif qtype in (QT.TQ1_0, QT.TQ2_0):  # d last; values -d, 0, d
        f16(size - 2)
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


#: A code byte of the first block of each IQ1-3 / TQ kind (flipping it changes the decode).
IQ_CODE_AT = {
    "iq2_xxs": 3,
    "iq2_xs": 4,
    "iq2_s": 5,
    "iq3_xxs": 4,
    "iq3_s": 5,
    "iq1_s": 4,
    "iq1_m": 3,
    "tq1_0": 3,
    "tq2_0": 3,
}


def same_bits(got, want) -> None:
    """Equal as float32 bit patterns, any NaN equal to any NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
