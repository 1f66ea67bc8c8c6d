"""Issue #20, item 12: attention dropout with an explicit key, the log-sum-exp output, and an
array bias in the blockwise kernel, each against the dense reference / float64 numpy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import grad_tol, np_attention, qkv, tol

import attnlab
from attnlab import kernels, masks

T, S = 10, 9
MASKS = {"none": lambda: None, "causal": lambda: masks.causal(offset=S - T), "window": lambda: masks.window(2, 1)}


def _np_lse(q, k, mask=None, bias=None):
    """float64 log-sum-exp [..., T, N] of the allowed logits (-inf on an empty row)."""
    qf, kf = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k))
    kf = np.repeat(kf, qf.shape[-2] // kf.shape[-2], axis=-2)
    logits = np.einsum("...tnh,...snh->...nts", qf, kf) / np.sqrt(qf.shape[-1])
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if mask is not None:
        logits = np.where(np.broadcast_to(mask, logits.shape), logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = (
            np.where(np.isfinite(m), m, 0)
            + np.log(np.exp(logits - np.where(np.isfinite(m), m, 0)).sum(-1, keepdims=True))
        )[..., 0]
    return np.swapaxes(lse, -1, -2)


def _blockwise(**kw):
    return functools.partial(kernels.blockwise_attention, block_sizes=kernels.BlockSizes(4, 3), **kw)


# ------------------------------------------------------------------------------------------
# dropout


def test_reference_dropout_matches_a_hand_applied_mask():
    """out = (P * keep / (1 - r)) v, with keep drawn densely by dropout_keep (b, n, t, s)."""
    q, k, v = qkv((2, T, 2, 8), s=S, seed=1)
    key, rate = jax.random.key(7), 0.4
    out = attnlab.attention_reference(q, k, v, dropout_rate=rate, dropout_key=key)
    _, w = np_attention(q, k, v)  # float64 [B, N, T, S]
    seed = jax.random.bits(key, (2,), jnp.uint32)
    b, n, t = np.meshgrid(np.arange(2), np.arange(2), np.arange(T), indexing="ij")
    rows = ((b * 2 + n) * T + t)[..., None]
    keep = np.asarray(kernels.blockwise.dropout_keep(seed, rate, rows, np.arange(S)))
    vf = np.asarray(v, np.float64)
    expected = np.einsum("bnts,bsnh->btnh", w * keep / (1 - rate), vf)
    np.testing.assert_allclose(np.asarray(out), expected, **tol(jnp.float32))
    assert 0 < keep.mean() < 1


def test_keep_rate_and_unbiased():
    """Over 2**18 decisions the kept fraction is 1 - rate within 5 sigma; E[dropped out] = out."""
    rate = 0.3
    seed = jax.random.bits(jax.random.key(0), (2,), jnp.uint32)
    keep = kernels.blockwise.dropout_keep(seed, rate, jnp.arange(512)[:, None], jnp.arange(512))
    frac = float(keep.mean())
    sigma = np.sqrt(rate * (1 - rate) / keep.size)
    assert abs(frac - (1 - rate)) < 5 * sigma, frac
    # neighbours are not correlated: P(keep[t, s] and keep[t, s+1]) ~ (1 - rate)^2
    both = float((keep[:, :-1] & keep[:, 1:]).mean())
    assert abs(both - (1 - rate) ** 2) < 0.01, both
    # the average over many keys of the dropped output is the undropped output
    q, k, v = qkv((1, 4, 1, 8), s=6, seed=2)
    outs = jax.vmap(lambda kk: attnlab.attention_reference(q, k, v, dropout_rate=rate, dropout_key=kk))(
        jax.random.split(jax.random.key(1), 4000)
    )
    np.testing.assert_allclose(np.asarray(outs.mean(0)), np_attention(q, k, v)[0], atol=0.05)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "window"])
def test_blockwise_dropout_equals_reference_forward_and_backward(mask_kind):
    q, k, v = qkv((2, T, 4, 8), s=S, kv_heads=2, seed=3)
    kw = dict(mask=MASKS[mask_kind](), dropout_rate=0.25, dropout_key=jax.random.key(11))
    ref = functools.partial(attnlab.attention_reference, **kw)
    blk = jax.jit(_blockwise(**kw))
    np.testing.assert_allclose(np.asarray(blk(q, k, v)), np.asarray(ref(q, k, v)), **tol(jnp.float32))
    ct = jax.random.normal(jax.random.key(4), (2, T, 4, 8))
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * ct)  # noqa: E731
    for g, r in zip(jax.grad(loss(blk), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), **grad_tol(jnp.float32))


def test_dropout_through_attention_and_its_errors():
    q, k, v = qkv((1, T, 2, 8), s=S)
    key = jax.random.key(5)
    a = attnlab.attention(q, k, v, dropout_rate=0.5, dropout_key=key)  # small: the reference
    b = attnlab.attention(q, k, v, dropout_rate=0.5, dropout_key=key, implementation="blockwise")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol(jnp.float32))
    c = attnlab.attention(q, k, v, dropout_rate=0.5, dropout_key=jax.random.key(6))
    assert not np.allclose(np.asarray(a), np.asarray(c))  # another key, another mask
    with pytest.raises(ValueError, match=r"dropout_rate=0.5 needs an explicit dropout_key"):
        attnlab.attention(q, k, v, dropout_rate=0.5)
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\), got 1.0"):
        attnlab.attention(q, k, v, dropout_rate=1.0, dropout_key=key)
    with pytest.raises(ValueError, match=r"dropout_rate > 0 needs implementation 'reference' or 'blockwise'"):
        attnlab.attention(q, k, v, dropout_rate=0.1, dropout_key=key, implementation="xla")
    with pytest.raises(ValueError, match=r"dropout_key must be a jax.random.key"):
        attnlab.attention(q, k, v, dropout_rate=0.1, dropout_key=np.zeros(3, np.uint32))
    # rate 0 is exactly no dropout
    np.testing.assert_array_equal(
        np.asarray(attnlab.attention_reference(q, k, v, dropout_rate=0.0, dropout_key=key)),
        np.asarray(attnlab.attention_reference(q, k, v)),
    )


# ------------------------------------------------------------------------------------------
# log-sum-exp


@pytest.mark.parametrize(
    "implementation, mask_kind",
    [  # the judge, and the blockwise kernel across several tiles (every implementation: tests/conformance.py)
        ("reference", "none"),
        ("reference", "with_empty_rows"),
        ("blockwise_small", "none"),
        ("blockwise_small", "causal"),
        ("blockwise_small", "with_empty_rows"),
    ],
)
def test_lse_matches_float64_and_jax_nn(implementation, mask_kind):
    q, k, v = qkv((2, T, 4, 8), s=S, kv_heads=2, seed=8)
    # causal(offset=-1): query 0 sees no key, an empty row
    mask = {"none": None, "causal": masks.causal(), "with_empty_rows": masks.causal(offset=-1)}[mask_kind]
    if implementation == "blockwise_small":
        out, lse = _blockwise(mask=mask, return_lse=True)(q, k, v)
    else:
        out, lse = attnlab.attention(q, k, v, mask=mask, implementation=implementation, return_lse=True)
    dense = None if mask is None else np.asarray(mask.dense(T, S))
    expected = _np_lse(q, k, dense)
    assert lse.shape == (2, T, 4) and lse.dtype == jnp.float32
    if mask_kind == "with_empty_rows":
        assert np.isneginf(expected[:, 0]).all() and np.isneginf(np.asarray(lse[:, 0])).all()
    np.testing.assert_allclose(np.asarray(lse), expected, **tol(jnp.float32))
    np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v, mask=dense)[0], **tol(jnp.float32))
    if mask_kind == "none":  # jax.nn's residual is the same quantity, [B, T, N]
        _, theirs = jax.nn.dot_product_attention(q, k, v, return_residual=True)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(theirs), **tol(jnp.float32))


def test_lse_gradient_matches_reference():
    q, k, v = qkv((1, T, 2, 8), s=S, seed=9)
    mask = masks.causal(offset=-1)  # an empty first row: its -inf lse must not poison the gradient
    ct_o = jax.random.normal(jax.random.key(1), (1, T, 2, 8))
    ct_l = jax.random.normal(jax.random.key(2), (1, T, 2))

    def loss(f):
        def g(q, k, v):
            out, lse = f(q, k, v, mask=mask, return_lse=True)
            return jnp.sum(out * ct_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * ct_l)

        return jax.grad(g, (0, 1, 2))

    for g, r in zip(loss(_blockwise())(q, k, v), loss(attnlab.attention_reference)(q, k, v), strict=True):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), **grad_tol(jnp.float32))


def test_lse_merges_two_halves_of_the_keys():
    """What ring attention needs: attention over S = attention over two key halves, merged by lse."""
    q, k, v = qkv((1, T, 2, 8), s=S, seed=10)
    o1, l1 = attnlab.attention_reference(q, k[:, :4], v[:, :4], return_lse=True)
    o2, l2 = _blockwise(return_lse=True)(q, k[:, 4:], v[:, 4:])
    lse = jnp.logaddexp(l1, l2)
    merged = o1 * jnp.exp(l1 - lse)[..., None] + o2 * jnp.exp(l2 - lse)[..., None]
    np.testing.assert_allclose(np.asarray(merged), np_attention(q, k, v)[0], **tol(jnp.float32))
    np.testing.assert_allclose(np.asarray(lse), _np_lse(q, k), **tol(jnp.float32))


# ------------------------------------------------------------------------------------------
# array bias in the blockwise kernel


@pytest.mark.parametrize(
    "bias_shape",
    [(2, 4, T, S), (1, 4, 1, S), (T, S), (S,)],
)
def test_blockwise_array_bias_forward_and_gradient(bias_shape):
    q, k, v = qkv((2, T, 4, 8), s=S, kv_heads=2, seed=12)
    bias = jax.random.normal(jax.random.key(3), bias_shape, jnp.float32) * 2
    mask = masks.window(3, 2)
    blk = jax.jit(lambda q, k, v, b: _blockwise(mask=mask, bias=b)(q, k, v))
    out = blk(q, k, v, bias)
    dense = np.asarray(mask.dense(T, S))
    np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v, mask=dense, bias=bias)[0], **tol(jnp.float32))
    ct = jax.random.normal(jax.random.key(4), out.shape)
    ref = lambda q, k, v, b: attnlab.attention_reference(q, k, v, mask=mask, bias=b)  # noqa: E731
    got = jax.grad(lambda *a: jnp.sum(blk(*a) * ct), (0, 1, 2, 3))(q, k, v, bias)
    want = jax.grad(lambda *a: jnp.sum(ref(*a) * ct), (0, 1, 2, 3))(q, k, v, bias)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **grad_tol(jnp.float32))


def test_blockwise_array_bias_stays_fp32_with_bf16_inputs_and_errors():
    q, k, v = qkv((1, T, 2, 8), s=S, dtype=jnp.bfloat16, seed=13)
    bias = jnp.asarray(np.random.default_rng(0).uniform(295, 305, (2, T, S)), jnp.float32)
    out = attnlab.attention(q, k, v, bias=bias, implementation="blockwise")
    np.testing.assert_allclose(np.asarray(out, np.float32), np_attention(q, k, v, bias=bias)[0], **tol(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"bias of shape \(3, 9\) does not broadcast"):
        kernels.blockwise_attention(q, k, v, bias=jnp.zeros((3, S)))
    with pytest.raises(ValueError, match=r"bias must be floating point"):
        kernels.blockwise_attention(q, k, v, bias=jnp.zeros((T, S), jnp.int32))
