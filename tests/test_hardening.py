"""Issue #20, items 1-7: edge cases a peer handles, each held to float64 numpy or the reference.

Every test here failed before its fix (wrong numbers, NaN, a crash, or an unnamed error). What every
implementation must do at these edges is a case of the conformance base (tests/conformance.py, run
for each registered implementation); this file keeps the default choice, the blockwise kernel across
several tiles, the checks of the public boundary and the named errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import grad_tol, np_attention, qkv, tol

import attnlab
from attnlab import heads, kernels, masks

FMIN = float(np.finfo(np.float32).min)


def _loss(fn, ct):
    """A scalar of the output against a fixed cotangent (so every output entry matters)."""
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)


def _grads(fn, q, k, v, ct):
    return jax.grad(_loss(fn, ct), argnums=(0, 1, 2))(q, k, v)


# ------------------------------------------------------------------------------------------
# 1-2. half precision with fp32 biases, finfo.min and -inf logits: every implementation, in
# tests/conformance.py (test_fp32_bias_is_not_rounded_to_half, test_bias_row_of_finfo_min_..., test_huge_negative_
# finite_logits_are_a_softmax, test_minus_inf_bias_empties_a_row); here the default choice and the blockwise
# kernel with several tiles per row.


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_fp32_bias_is_not_rounded_to_half_by_default(dtype):
    q, k, v = qkv((2, 6, 2, 8), s=7, dtype=dtype, seed=1)
    # biases near 300: bf16 has steps of 2 there, fp16 of 0.25 (both far above the tolerance)
    bias = jnp.asarray(np.random.default_rng(0).uniform(295.0, 305.0, (2, 2, 6, 7)), jnp.float32)
    out = attnlab.attention(q, k, v, bias=bias)
    expected, _ = np_attention(q, k, v, bias=bias)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, **tol(dtype))
    ct = jax.random.normal(jax.random.key(2), out.shape)
    got = _grads(functools.partial(attnlab.attention, bias=bias), q, k, v, ct)
    # the reference in fp32 on the same (half-precision) values
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    want = _grads(functools.partial(attnlab.attention_reference, bias=bias), q32, k32, v32, ct)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), **grad_tol(dtype))


def _huge_negative_bias(q_idx, k_idx):
    """finfo.min on every entry of odd query rows, 0.5 * (k - q) elsewhere: [T', S']."""
    rel = 0.5 * (k_idx[None, :] - q_idx[:, None]).astype(jnp.float32)
    return jnp.where((q_idx % 2 == 1)[:, None], jnp.float32(FMIN), rel)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "window"])
def test_huge_negative_finite_logits_across_blockwise_tiles(mask_kind):
    """The blockwise kernel with several tiles per row (PARTIAL and FULL ones): rows of finfo.min logits are
    a softmax; a masked entry beside allowed finfo.min ones never wins the running max."""
    T = S = 10
    q, k, v = qkv((2, T, 2, 8), s=S, seed=4)
    mask = {"none": None, "causal": masks.causal(), "window": masks.window(3, 1)}[mask_kind]
    fn = functools.partial(
        kernels.blockwise_attention, mask=mask, bias=_huge_negative_bias, block_sizes=kernels.BlockSizes(4, 3)
    )
    out = jax.jit(fn)(q, k, v)
    dense_bias = np.asarray(_huge_negative_bias(jnp.arange(T), jnp.arange(S)))
    dense_mask = None if mask is None else np.asarray(mask.dense(T, S))
    expected, w = np_attention(q, k, v, mask=dense_mask, bias=dense_bias)
    assert (w[..., 1, :].sum(-1) > 0.99).all()  # the finfo.min row is a real softmax in float64
    np.testing.assert_allclose(np.asarray(out), expected, **tol(jnp.float32))
    ct = jax.random.normal(jax.random.key(5), out.shape)
    got = _grads(fn, q, k, v, ct)
    ref = functools.partial(attnlab.attention_reference, mask=mask, bias=_huge_negative_bias)
    for g, r in zip(got, _grads(ref, q, k, v, ct), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), **grad_tol(jnp.float32))


def test_masked_softmax_huge_negative_next_to_masked():
    logits = jnp.array([[FMIN, FMIN, 0.0], [FMIN, FMIN + 1e32, 5.0]])
    mask = jnp.array([[True, True, False], [True, True, False]])
    # row 0: two equal allowed logits -> [1/2, 1/2, 0]; row 1: FMIN + 1e32 exceeds FMIN by 1e32 -> [0, 1, 0]
    np.testing.assert_allclose(attnlab.masked_softmax(logits, mask), [[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])


# ------------------------------------------------------------------------------------------
# 3. out-of-range edges: dropped by every implementation when traced (tests/conformance.py), named when concrete


def test_out_of_range_edges_raise_when_concrete():
    with pytest.raises(ValueError, match=r"senders has node indices outside \[0, 3\)"):
        masks.graph_edges([0, 3], [1, 2], 3)
    q, k, v = qkv((3, 1, 4))
    hand_made = masks.GraphEdges(np.array([0, 1]), np.array([1, 5]), 3)  # the class does not validate
    with pytest.raises(ValueError, match=r"receivers has node indices outside \[0, 3\)"):
        attnlab.attention(q, k, v, mask=hand_made, implementation="sparse")


# ------------------------------------------------------------------------------------------
# 4. zero-length sequences


@pytest.mark.parametrize("t, s", [(0, 5), (4, 0), (0, 0)])
@pytest.mark.parametrize("mask_kind", ["none", "causal"])
def test_zero_length_sequences_by_default(t, s, mask_kind):
    """The default choice (every implementation: tests/conformance.py)."""
    q, k, v = qkv((2, t, 2, 8), s=s)
    mask = masks.causal() if mask_kind == "causal" else None
    fn = jax.jit(functools.partial(attnlab.attention, mask=mask))
    out = fn(q, k, v)
    assert out.shape == (2, t, 2, 8) and out.dtype == q.dtype
    np.testing.assert_array_equal(np.asarray(out), np.zeros((2, t, 2, 8)))  # S = 0 -> zeros
    grads = _grads(fn, q, k, v, jnp.ones(out.shape))
    for g, x in zip(grads, (q, k, v), strict=True):
        assert g.shape == x.shape and not np.asarray(g).any()


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((4, 2, 8), (5, 0, 8), (5, 0, 8)), r"number of key heads K must be >= 1"),
        (((4, 2, 0), (5, 2, 0), (5, 2, 8)), r"head dim H must be >= 1"),
    ],
)
def test_zero_heads_or_head_dim_are_named(shapes, match):
    q, k, v = (jnp.zeros(sh) for sh in shapes)
    with pytest.raises(ValueError, match=match):
        attnlab.attention(q, k, v)


def test_masked_softmax_of_zero_keys():
    out = attnlab.masked_softmax(jnp.zeros((3, 0)), None)
    assert out.shape == (3, 0)


# ------------------------------------------------------------------------------------------
# 5. rank-1 (and rank-0) masks broadcast like biases


def test_rank1_mask_broadcasts_like_a_bias_by_default():
    """The default choice (every implementation: tests/conformance.py)."""
    q, k, v = qkv((2, 4, 2, 8), s=6, seed=8)
    mask = np.arange(6) <= 3  # [S]
    out = attnlab.attention(q, k, v, mask=mask)
    expected, _ = np_attention(q, k, v, mask=np.broadcast_to(mask, (2, 2, 4, 6)))
    np.testing.assert_allclose(np.asarray(out), expected, **tol(jnp.float32))
    # jax.nn accepts the same mask (it broadcasts [S] itself)
    theirs = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(out), np.asarray(theirs), **tol(jnp.float32))
    out0 = attnlab.attention(q, k, v, mask=np.bool_(False))  # rank 0
    np.testing.assert_array_equal(np.asarray(out0), 0.0)


# ------------------------------------------------------------------------------------------
# 6. bf16 under jit on CPU with tiny shapes (XLA:CPU's ALG_DOT_BF16_BF16_F32)


@pytest.mark.parametrize("s", [1, 2])
def test_bf16_tiny_shapes_under_jit_by_default(s):
    """The default choice (every implementation: tests/conformance.py)."""
    q, k, v = qkv((1, 1, 1, 8), s=s, dtype=jnp.bfloat16, seed=9)
    fn = jax.jit(attnlab.attention)
    out = fn(q, k, v)
    expected, _ = np_attention(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, **tol(jnp.bfloat16))
    ct = jnp.ones(out.shape)
    got = jax.jit(functools.partial(_grads, fn))(q, k, v, ct)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    want = _grads(attnlab.attention_reference, q32, k32, v32, ct)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), **grad_tol(jnp.bfloat16))


# ------------------------------------------------------------------------------------------
# 7. bad input named


q7, k7, v7 = qkv((1, 4, 2, 8), s=5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: attnlab.attention(q7, k7, v7, scale=jnp.ones(5)), r"scale must be a scalar.*shape \(5,\)"),
        *[  # checked once, when the call is bound: the same error whichever implementation is asked for
            (functools.partial(attnlab.attention, q7, k7, v7, scale=np.ones(5), implementation=name), "scale must be")
            for name in attnlab.IMPLEMENTATIONS
        ],
        (lambda: attnlab.scores.dot_product(q7, k7, scale=jnp.ones((4, 5))), r"dot_product: scale must be a scalar"),
        (lambda: kernels.blockwise_attention(q7, k7, v7, scale=jnp.ones(5)), r"scale must be a scalar"),
        (lambda: attnlab.attention(q7, k7, v7, scale="2"), r"scale must be a real number"),
        (
            lambda: attnlab.masked_softmax(jnp.zeros((2, 3)), jnp.array([[1, 2, 0], [0, 0, 1]])),
            r"mask must be a bool array.*int32",
        ),
        (lambda: masks.window(2**40, 0), r"left must be in \[-2\*\*30, 2\*\*30\].*1099511627776"),
        (lambda: masks.causal(offset=-(2**40)), r"offset must be in \[-2\*\*30"),
        (lambda: masks.chunks(2**31), r"size must be in"),
    ],
)
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "x, hint",
    [
        (np.array([[0.0, -np.inf], [0.0, 0.0]]), r"additive mask: pass it as `bias=x`, or use `mask=\(x == 0\)`"),
        (np.array([[1.0, 0.0], [1.0, 1.0]]), r"use `mask=\(x != 0\)` \(1 = attend\)"),
        (np.array([[1, 0], [1, 1]]), r"use `mask=\(x != 0\)` \(1 = attend\)"),
        (np.array([[3, 0], [1, 2]]), r"use `mask=\(x != 0\)` \(nonzero = attend\)"),
        (np.array([[0.5, -2.0], [0.0, 1.0]]), r"not a mask: pass it as `bias=x`"),
    ],
    ids=["zero_minus_inf", "float_zero_one", "int_zero_one", "int_other", "float_other"],
)
def test_non_bool_mask_hint_fits_its_values(x, hint):
    """The hint reads the values: `x != 0` would invert an additive 0 / -inf mask."""
    q, k, v = qkv((2, 1, 4), s=2)
    with pytest.raises(ValueError, match=r"mask must be a bool array \(True = attend\).*" + hint):
        attnlab.attention(q, k, v, mask=x)
    traced = r"`x != 0` for a 0/1 mask \(1 = attend\), `x == 0` for an additive 0/-inf mask"
    with pytest.raises(ValueError, match=traced):  # values unknown under jit: both readings
        jax.jit(lambda m: attnlab.attention(q, k, v, mask=m))(x)


def test_wrong_wo_is_named():
    p = heads.init_multi_head_params(jax.random.key(0), 16, 4)
    x = jnp.ones((2, 7, 16))
    bad = dict(p, wo=p["wo"][:, :3])  # [N, Hv - 1, D]
    with pytest.raises(ValueError, match=r"params\['wo'\] must have shape \[N, Hv, D\] = \[4, 4, D\].*\(4, 3, 16\)"):
        heads.multi_head_attention(bad, x)
    with pytest.raises(ValueError, match=r"params\['wo'\] must have shape \[N, Hv, D\], got shape \(16, 16\)"):
        heads.multi_head_attention(dict(p, wo=p["wo"].reshape(16, 16)), x)
