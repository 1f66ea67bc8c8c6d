"""attnlab.flax.attention_fn in stock Flax modules (nnx.MultiHeadAttention, linen's
MultiHeadDotProductAttention) against the same modules with Flax's own attention.

Outputs and gradients (of the parameters and the inputs) agree to max |diff| <= 1e-5 in fp32 on the
rows that have a key; rows with no key are zeros (attnlab) or, with empty_rows="mean", stock Flax's
mean of the values (then every row agrees). Dropout is compared statistically (the same distribution
per weight; attnlab's masks are independent across batch and heads where broadcast_dropout shares one).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab.flax as af
from attnlab import masks, scores, testing

B, T, D, N = 2, 12, 16, 4
TARGET = dict(atol=1e-5, rtol=0)  # the target: max |diff| <= 1e-5 in fp32
LENGTHS = jnp.array([12, 7])


def _inputs(seed=1, t=T):
    return jax.random.normal(jax.random.key(seed), (B, t, D))


def _masks(kind):
    """(module call kwargs, bool [B, T]: the rows that have a key)."""
    tokens = (jnp.arange(T)[None] < LENGTHS[:, None]).astype(jnp.float32)
    causal = nnx.make_causal_mask(jnp.ones((B, T)))
    padding = nnx.make_attention_mask(tokens, tokens)
    every = jnp.ones((B, T), bool)
    valid = tokens.astype(bool)
    return {
        "none": ({}, every),
        "causal_mask": (dict(mask=causal), every),
        "is_causal": (dict(is_causal=True), every),
        "padding": (dict(mask=padding), valid),
        "causal_and_padding": (dict(mask=nnx.combine_masks(causal, padding)), valid),
        "bool_padding": (dict(mask=padding.astype(bool)), valid),
    }[kind]


def _assert_close_on_rows(a, b, rows, tolerance=TARGET):
    rows = np.broadcast_to(np.asarray(rows)[..., None], np.shape(a))
    np.testing.assert_allclose(np.where(rows, np.asarray(a), 0), np.where(rows, np.asarray(b), 0), **tolerance)


def _nnx_pair(attention_fn, **kw):
    stock = nnx.MultiHeadAttention(N, D, decode=False, rngs=nnx.Rngs(0), **kw)
    ours = nnx.MultiHeadAttention(N, D, decode=False, rngs=nnx.Rngs(0), attention_fn=attention_fn, **kw)
    return stock, ours


def _nnx_value_and_grads(layer, x, rows, call_kw):
    """out, and the gradients of sum(out * ct) over the rows with a key w.r.t. the parameters and x (jitted)."""
    ct = jax.random.normal(jax.random.key(9), (B, x.shape[1], D)) * jnp.asarray(rows)[..., None]

    @nnx.jit
    def run(layer, x):
        def loss(layer, x):
            out = layer(x, **call_kw)
            return jnp.sum(out * ct), out

        (_, out), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)
        return out, grads

    return run(layer, x)


NNX_CASES = [
    (kind, None) for kind in ("none", "causal_mask", "is_causal", "padding", "causal_and_padding", "bool_padding")
]
NNX_CASES += [("is_causal", 2), ("causal_and_padding", 2)]  # GQA: 2 key/value heads for 4 query heads


@pytest.mark.parametrize("kind, num_kv_heads", NNX_CASES)
@pytest.mark.parametrize("empty_rows", ["zeros", "mean"])
def test_nnx_module_equals_stock(kind, num_kv_heads, empty_rows):
    """nnx.MultiHeadAttention with attnlab's attention_fn: outputs and gradients as stock (GQA too)."""
    call_kw, rows = _masks(kind)
    stock, ours = _nnx_pair(af.make_attention_fn(empty_rows=empty_rows), num_kv_heads=num_kv_heads)
    x = _inputs()
    compare_rows = jnp.ones_like(rows) if empty_rows == "mean" else rows
    out_s, (g_s, gx_s) = _nnx_value_and_grads(stock, x, compare_rows, call_kw)
    out_o, (g_o, gx_o) = _nnx_value_and_grads(ours, x, compare_rows, call_kw)
    _assert_close_on_rows(out_o, out_s, compare_rows)
    if empty_rows == "zeros":
        assert np.all(np.asarray(out_o)[~np.asarray(rows)] == np.asarray(ours.out.bias[...]))  # zeros -> bias
    np.testing.assert_allclose(np.asarray(gx_o), np.asarray(gx_s), **TARGET)
    for a, b in zip(jax.tree.leaves(nnx.state(g_o)), jax.tree.leaves(nnx.state(g_s)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TARGET)


def _linen_pair(attention_fn, **kw):
    stock = nn.MultiHeadDotProductAttention(N, qkv_features=D, **kw)
    ours = nn.MultiHeadDotProductAttention(N, qkv_features=D, attention_fn=attention_fn, **kw)
    return stock, ours


@pytest.mark.parametrize("kind", ["none", "causal_mask", "padding", "causal_and_padding"])
@pytest.mark.parametrize("empty_rows", ["zeros", "mean"])
def test_linen_module_equals_stock(kind, empty_rows):
    """linen.MultiHeadDotProductAttention with attnlab's attention_fn: outputs and gradients as stock."""
    call_kw, rows = _masks(kind)
    stock, ours = _linen_pair(af.make_attention_fn(empty_rows=empty_rows))
    x = _inputs()
    params = stock.init(jax.random.key(0), x)
    compare_rows = jnp.ones_like(rows) if empty_rows == "mean" else rows
    ct = jax.random.normal(jax.random.key(9), (B, T, D)) * compare_rows[..., None]

    def run(module):
        def loss(p, x):
            out = module.apply(p, x, **call_kw)
            return jnp.sum(out * ct), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (_, out_s), (g_s, gx_s) = run(stock)
    (_, out_o), (g_o, gx_o) = run(ours)
    _assert_close_on_rows(out_o, out_s, compare_rows)
    np.testing.assert_allclose(np.asarray(gx_o), np.asarray(gx_s), **TARGET)
    for a, b in zip(jax.tree.leaves(g_o), jax.tree.leaves(g_s), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TARGET)


def test_cross_attention_and_module_dtype():
    """inputs_k of another length with make_attention_mask; dtype=bfloat16 follows the module's promotion."""
    xq, xkv = _inputs(1), _inputs(2, t=9)
    mask = nnx.make_attention_mask(jnp.ones((B, T)), (jnp.arange(9)[None] < jnp.array([[9], [4]])).astype(jnp.float32))
    stock, ours = _nnx_pair(af.attention_fn)
    np.testing.assert_allclose(np.asarray(ours(xq, xkv, mask=mask)), np.asarray(stock(xq, xkv, mask=mask)), **TARGET)
    stock, ours = _nnx_pair(af.attention_fn, dtype=jnp.bfloat16)
    out_o, out_s = ours(xq, xkv, mask=mask), stock(xq, xkv, mask=mask)
    assert out_o.dtype == out_s.dtype == jnp.bfloat16
    testing.assert_close(out_o, out_s, jnp.bfloat16)


def test_attnlab_mask_through_the_module_call_under_jit():
    """mask= of the module call takes an attnlab mask (documents & causal): as stock given its dense form;
    new document ids reuse the compiled program."""
    stock, ours = _nnx_pair(af.attention_fn)
    x = _inputs()
    traces = []

    @nnx.jit
    def run(layer, x, m):
        traces.append(1)
        return layer(x, mask=m)

    for cut in (5, 9):
        ids = jnp.where(jnp.arange(T) < cut, 0, 1)[None].repeat(B, 0)  # two documents per row
        m = masks.document(ids) & masks.causal()
        dense = jnp.broadcast_to(m.dense(T, T), (B, 1, T, T)).astype(jnp.float32)
        np.testing.assert_allclose(np.asarray(run(ours, x, m)), np.asarray(stock(x, mask=dense)), **TARGET)
    assert len(traces) == 1
    stock_l, ours_l = _linen_pair(af.attention_fn)
    params = stock_l.init(jax.random.key(0), x)
    out = ours_l.apply(params, x, mask=masks.causal())
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(stock_l.apply(params, x, mask=nn.make_causal_mask(x[..., 0]))), **TARGET
    )


def _softcap_attention(query, key, value, mask=None, **_):
    """Soft-capped attention written out in jnp (independent of attnlab): cap * tanh(q·k / sqrt(H) / cap)."""
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key) / jnp.sqrt(query.shape[-1])
    logits = 3.0 * jnp.tanh(logits / 3.0)
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    return jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits, axis=-1), value)


def test_make_attention_fn_window_and_score():
    """make_attention_fn(mask=window) is stock with the window's dense mask; score=SoftCap is the soft cap
    written out (a stock module whose attention_fn computes it in jnp)."""
    x = _inputs() * 3
    stock, ours = _nnx_pair(af.make_attention_fn(mask=masks.window(2, 1)))
    window = jnp.broadcast_to(masks.window(2, 1).dense(T, T), (B, 1, T, T)).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(stock(x, mask=window)), **TARGET)
    written, ours = _nnx_pair(af.make_attention_fn(score=scores.SoftCap(3.0)))
    written.attention_fn = _softcap_attention
    np.testing.assert_allclose(
        np.asarray(ours(x, is_causal=True)), np.asarray(written(x, mask=nnx.make_causal_mask(x[..., 0]))), **TARGET
    )


def test_autoregressive_decode_equals_stock():
    """decode=True: the module's cache mask (a float array it builds) goes through attnlab; step by step as stock."""
    x = _inputs()
    layers = _nnx_pair(af.attention_fn)
    outs = []
    for layer in layers:
        layer.init_cache(x.shape)
        outs.append(jnp.concatenate([layer(x[:, t : t + 1], decode=True) for t in range(T)], axis=1))
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), **TARGET)
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(layers[1](x, is_causal=True)), atol=1e-5)


@pytest.mark.parametrize("empty_rows", ["zeros", "mean"])
def test_sow_weights(empty_rows):
    """sow_weights=True: attnlab sows the weights [B, N, T, S] where stock does (NNX Intermediate, linen
    'intermediates'); equal to stock's on the rows with a key (all rows with empty_rows="mean")."""
    call_kw, rows = _masks("causal_and_padding")
    compare_rows = np.ones((B, N, T, 1), bool) if empty_rows == "mean" else np.asarray(rows)[:, None, :, None]
    x = _inputs()
    stock, ours = _nnx_pair(af.make_attention_fn(empty_rows=empty_rows))
    got = []
    for layer in (stock, ours):
        _, sown = nnx.capture(layer, nnx.Intermediate)(x, sow_weights=True, **call_kw)
        (w,) = jax.tree.leaves(sown)
        got.append(np.asarray(w))
    assert got[0].shape == got[1].shape == (B, N, T, T)
    np.testing.assert_allclose(np.where(compare_rows, got[1], 0), np.where(compare_rows, got[0], 0), **TARGET)
    stock_l, ours_l = _linen_pair(af.make_attention_fn(empty_rows=empty_rows))
    params = stock_l.init(jax.random.key(0), x)
    got = [
        jax.tree.leaves(m.apply(params, x, sow_weights=True, mutable=["intermediates"], **call_kw)[1])[0]
        for m in (stock_l, ours_l)
    ]
    np.testing.assert_allclose(np.where(compare_rows, got[1], 0), np.where(compare_rows, got[0], 0), **TARGET)


# ------------------------------------------------------------------------------------------
# dropout: the same statistics


def _dropout_samples(fn, q, k, v, rate, broadcast, draws=2000):
    keys = jax.random.split(jax.random.key(4), draws)
    run = jax.jit(
        jax.vmap(
            lambda key: fn(
                q, k, v, dropout_rng=key, dropout_rate=rate, deterministic=False, broadcast_dropout=broadcast
            )
        )
    )
    return np.asarray(run(keys), np.float64)  # [draws, B, T, N, H]


@pytest.mark.parametrize("broadcast", [False, True])
def test_dropout_has_stock_flax_statistics(broadcast):
    """Each weight is kept with probability 1 - rate and scaled by 1/(1 - rate) in both, so every output
    element has the same distribution: over 2000 keys the per-element means agree within 5 standard errors
    (and equal the undropped output), the variances within sampling error. broadcast_dropout=True changes
    only how stock's masks correlate across batch and heads, not these marginals."""
    rate = 0.3
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (2, 6, 2, 4)) for kk in ks)  # [B, T, N, H]
    ours = _dropout_samples(af.attention_fn, q, k, v, rate, broadcast)
    stock = _dropout_samples(nnx.dot_product_attention, q, k, v, rate, broadcast)
    draws = ours.shape[0]
    m_o, m_s, v_o, v_s = ours.mean(0), stock.mean(0), ours.var(0), stock.var(0)
    z = (m_o - m_s) / np.sqrt((v_o + v_s) / draws)
    assert np.abs(z).max() < 5, np.abs(z).max()
    undropped = np.asarray(nnx.dot_product_attention(q, k, v))
    assert np.abs((m_o - undropped) / np.sqrt(v_o / draws)).max() < 5
    ratio = v_o / v_s
    assert 0.75 < ratio.min() and ratio.max() < 1.33, (ratio.min(), ratio.max())
    assert 0.95 < ratio.mean() < 1.05, ratio.mean()


def test_dropout_masks_are_independent_across_heads():
    """What broadcast_dropout=True does differently, shown: with two identical heads, stock's shared mask
    gives identical head outputs; attnlab's per-head masks do not (the documented difference)."""
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jnp.repeat(jax.random.normal(kk, (1, 6, 1, 4)), 2, axis=2) for kk in ks)  # head 1 = head 0
    kw = dict(dropout_rng=jax.random.key(3), dropout_rate=0.5, deterministic=False, broadcast_dropout=True)
    stock = np.asarray(nnx.dot_product_attention(q, k, v, **kw))
    ours = np.asarray(af.attention_fn(q, k, v, **kw))
    np.testing.assert_array_equal(stock[:, :, 0], stock[:, :, 1])
    assert np.abs(ours[:, :, 0] - ours[:, :, 1]).max() > 0.1


def test_module_dropout_on_and_off():
    """In the modules: deterministic=True (or rate 0) is the undropped output; deterministic=False drops."""
    x = _inputs()
    ours = nnx.MultiHeadAttention(
        N, D, decode=False, dropout_rate=0.5, attention_fn=af.attention_fn, rngs=nnx.Rngs(0, dropout=1)
    )
    plain = nnx.MultiHeadAttention(N, D, decode=False, attention_fn=af.attention_fn, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(ours(x, deterministic=True)), np.asarray(plain(x)), **TARGET)
    dropped = ours(x, deterministic=False)
    assert np.abs(np.asarray(dropped) - np.asarray(plain(x))).max() > 0.01
    assert np.abs(np.asarray(ours(x, deterministic=False)) - np.asarray(dropped)).max() > 0.01  # a new key each call
    stock_l, ours_l = _linen_pair(af.attention_fn, dropout_rate=0.5)
    params = stock_l.init(jax.random.key(0), x, deterministic=True)
    out = ours_l.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert np.abs(np.asarray(out) - np.asarray(stock_l.apply(params, x, deterministic=True))).max() > 0.01


# ------------------------------------------------------------------------------------------
# precision, and what is rejected


def test_precision():
    """HIGHEST in a module on the CPU: stock's result; elsewhere the dense implementations under
    jax.default_matmul_precision (forward and backward traced inside it)."""
    stock, ours = _nnx_pair(af.attention_fn, precision=jax.lax.Precision.HIGHEST)
    x = _inputs()
    kw, _ = _masks("causal_mask")
    np.testing.assert_allclose(np.asarray(ours(x, **kw)), np.asarray(stock(x, **kw)), **TARGET)
    for p in (jax.lax.Precision.HIGHEST, "highest", "float32", (jax.lax.Precision.HIGH,) * 2):
        impl, ctx = af.precision_plan(p, None, backend="gpu")
        assert impl == ("xla", "reference") and ctx is not None
        assert af.precision_plan(p, "blockwise", backend="tpu")[0] == "blockwise"  # an explicit choice stays
        assert af.precision_plan(p, None, backend="cpu")[0] is None
    for p in (None, jax.lax.Precision.DEFAULT, "default"):
        assert af.precision_plan(p, None, backend="gpu")[0] is None
    for bad in ("bogus", (jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST), 3):
        with pytest.raises(ValueError, match="precision"):
            af.precision_plan(bad, None, backend="gpu")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(dropout_rate=0.1, deterministic=False), "dropout_rng"),
        (dict(qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum), "einsum"),
        (dict(empty_rows="nan"), "empty_rows"),
        (dict(implementation="triton"), "implementation"),
        (dict(mask=jnp.ones((1, 1, 4, 5), bool)), "mask"),
    ],
)
def test_rejected_arguments_name_themselves(kwargs, name):
    x = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match=name):
        af.attention_fn(x, x, x, **kwargs)


def test_make_attention_fn_rejects_a_mask_array():
    with pytest.raises(ValueError, match="mask"):
        af.make_attention_fn(mask=jnp.ones((4, 4), bool))
