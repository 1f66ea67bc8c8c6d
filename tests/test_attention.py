"""attention / attention_reference / attention_weights against numpy and jax.nn."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import np_attention, qkv, tol
from jax.test_util import check_grads

import attnlab
from attnlab import masks

T, S = 7, 9

MASKS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(offset=S - T),
    "window": lambda: masks.window(2, 1),
    "padding": lambda: masks.padding(q_lengths=jnp.array([5, 7]), kv_lengths=jnp.array([9, 3])),
    "graph": lambda: masks.graph(np.random.default_rng(0).random((T, S)) < 0.4),
    "combined": lambda: (masks.causal(offset=S - T) & masks.padding(kv_lengths=jnp.array([6, 9]))) | masks.window(0, 0),
    "array": lambda: np.random.default_rng(1).random((2, 1, T, S)) < 0.5,
}


def _dense(mask):
    if mask is None:
        return None
    m = masks.as_mask(mask)
    return np.asarray(m.dense(T, S))


# The judge (attention_reference) and the default choice against float64 numpy; every registered
# implementation against both is tests/conformance.py.
FNS = {"reference": attnlab.attention_reference, "default": attnlab.attention}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fn_name", list(FNS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_matches_numpy(mask_kind, dtype, fn_name, jit):
    q, k, v = qkv((2, T, 4, 8), s=S, dtype=dtype)
    mask = MASKS[mask_kind]()
    fn = jax.jit(FNS[fn_name]) if jit else FNS[fn_name]
    out = fn(q, k, v, mask=mask)
    assert out.shape == (2, T, 4, 8) and out.dtype == dtype
    expected, _ = np_attention(q, k, v, mask=_dense(mask))
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, **tol(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "case",
    ["full", "causal", "window", "kv_lengths", "gqa", "bias"],
)
def test_matches_jax_nn(case, dtype):
    # jax.nn's own flags give an independent encoding of each mask (no fully-masked rows here,
    # where jax.nn's convention differs).
    kv_heads = 2 if case == "gqa" else 4
    q, k, v = qkv((2, 8, 4, 16), s=8, kv_heads=kv_heads, dtype=dtype, seed=3)
    kwargs, jnn = {}, {}
    if case == "causal":
        kwargs["mask"], jnn["is_causal"] = masks.causal(), True
    elif case == "window":
        kwargs["mask"], jnn["local_window_size"] = masks.window(3, 2), (3, 2)
    elif case == "kv_lengths":
        lens = jnp.array([5, 8])
        kwargs["mask"], jnn["key_value_seq_lengths"] = masks.padding(kv_lengths=lens), lens
    elif case == "bias":
        b = jax.random.normal(jax.random.key(9), (1, 4, 8, 8), jnp.float32).astype(dtype)
        kwargs["bias"], jnn["bias"] = b, b
    ours = attnlab.attention_reference(q, k, v, **kwargs)
    theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **jnn)
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), **tol(dtype))


# (GQA, leading batch dims and vmap of an unbatched call, for every implementation: tests/conformance.py)


def test_mask_passes_through_jit_without_recompiling():
    traces = []

    @jax.jit
    def f(q, k, v, mask):
        traces.append(1)
        return attnlab.attention(q, k, v, mask=mask)

    q, k, v = qkv((2, T, 2, 4), s=S)
    m1 = masks.padding(kv_lengths=jnp.array([3, 9])) & masks.window(2, 2)
    m2 = masks.padding(kv_lengths=jnp.array([8, 1])) & masks.window(2, 2)
    out1, out2 = f(q, k, v, m1), f(q, k, v, m2)
    assert len(traces) == 1  # lengths are data: a new value is not a new program
    np.testing.assert_allclose(out2, np_attention(q, k, v, mask=np.asarray(m2.dense(T, S)))[0], atol=2e-5)
    f(q, k, v, masks.padding(kv_lengths=jnp.array([8, 1])) & masks.window(3, 2))
    assert len(traces) == 2  # window sizes are structure: a new window is a new program
    assert not np.allclose(out1, out2)


def test_attention_weights_match_numpy():
    q, k, _ = qkv((2, T, 3, 8), s=S, seed=5)
    mask = masks.padding(q_lengths=jnp.array([7, 4])) & masks.causal(S - T)
    w = attnlab.attention_weights(q, k, mask=mask)
    assert w.shape == (2, 3, T, S) and w.dtype == jnp.float32
    _, expected = np_attention(q, k, k, mask=np.asarray(mask.dense(T, S)))  # v unused for weights
    np.testing.assert_allclose(w, expected, atol=1e-6)
    rows = np.asarray(w.sum(-1))
    np.testing.assert_allclose(rows[0], 1.0, atol=1e-6)  # every row of example 0 has keys
    np.testing.assert_allclose(rows[1, :, 4:], 0.0)  # padded queries of example 1: all zero


def test_bias_broadcasts_and_scale():
    q, k, v = qkv((2, 4, 2, 8), s=4, seed=6)
    bias = jnp.arange(4.0)[None, :] * -0.5  # [T=1.., S] broadcast over batch and heads
    out = attnlab.attention(q, k, v, bias=bias, scale=0.3)
    expected, _ = np_attention(q, k, v, bias=np.broadcast_to(bias, (2, 2, 4, 4)), scale=0.3)
    np.testing.assert_allclose(out, expected, atol=2e-5)
    # (a bias of every broadcast shape on every implementation that takes one: tests/conformance.py)


def test_value_head_dim_may_differ():
    q, k, v = qkv((2, 5, 2, 8), s=6, hv=3, seed=7)
    out = attnlab.attention(q, k, v, mask=masks.causal(1))
    assert out.shape == (2, 5, 2, 3)
    np.testing.assert_allclose(out, np_attention(q, k, v, mask=np.asarray(masks.causal(1).dense(5, 6)))[0], atol=2e-5)


def test_custom_score_callable():
    q, k, v = qkv((5, 2, 4), s=6, seed=8)

    def neg_l2(q, k):  # a score nobody ships: -|q_t - k_s|^2
        d = q[:, None, :, :] - k[None, :, :, :]  # [T, S, N, H]
        return -jnp.sum(d**2, -1).transpose(2, 0, 1)

    out = attnlab.attention(q, k, v, score=neg_l2)
    logits = -((np.asarray(q)[:, None] - np.asarray(k)[None]) ** 2).sum(-1).transpose(2, 0, 1)
    np.testing.assert_allclose(out, np_attention(q, k, v, logits=logits)[0], atol=2e-5)


# ------------------------------------------------------------------------------------------
# Gradients


def _loss(fn, **kw):
    def loss(q, k, v):
        out = fn(q, k, v, **kw)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)) * jnp.arange(out.shape[-1]))

    return loss


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "graph", "combined"])
def test_reference_grads_finite_differences(mask_kind):
    q, k, v = qkv((2, T, 2, 4), s=S, seed=10)
    mask = MASKS[mask_kind]()
    check_grads(
        _loss(attnlab.attention_reference, mask=mask),
        (q, k, v),
        order=1,
        modes=["rev"],
        atol=2e-2,
        rtol=2e-2,
        eps=1e-2,
    )


# (each implementation's gradients against the reference's, every mask: tests/conformance.py)


def test_reference_grads_match_numpy_formula():
    # dL/dv for L = sum(out * c) is weights^T @ c: hand-derived, numpy-checked.
    q, k, v = qkv((4, 1, 3), s=5, seed=12)
    mask = masks.causal(1)
    c = np.random.default_rng(0).standard_normal((4, 1, 3))
    gv = jax.grad(lambda v: jnp.sum(attnlab.attention(q, k, v, mask=mask) * c))(v)
    _, w = np_attention(q, k, v, mask=np.asarray(mask.dense(4, 5)))  # [N=1, T, S]
    np.testing.assert_allclose(gv[:, 0, :], w[0].T @ c[:, 0, :], atol=1e-5)


# ------------------------------------------------------------------------------------------
# Rows with nothing to attend to


# Rows with nothing to attend to, of every kind and dtype, on every implementation: tests/conformance.py
# (test_rows_with_nothing_to_attend_are_zero); NaN visibility on each implementation there too.


def test_nan_inputs_are_not_hidden_by_default():
    q, k, v = qkv((4, 1, 2), seed=14)
    q = q.at[1, 0, 0].set(jnp.nan)
    out = attnlab.attention(q, k, v)
    assert np.isnan(np.asarray(out[1])).all() and np.isfinite(np.asarray(out[0])).all()
