"""Scores (dot, additive) by hand and against numpy; score objects (Dot, Additive); heads: split/merge, matrix form."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import grad_tol, np_attention, qkv, tol

import attnlab
from attnlab import masks, scores
from attnlab.call import bind
from attnlab.impls.sparse import SPARSE


def test_dot_product_by_hand():
    q = jnp.array([[[1.0, 2.0]]])  # [T=1, N=1, H=2]
    k = jnp.array([[[3.0, 4.0]], [[-1.0, 0.5]]])  # [S=2, K=1, H=2]
    # (1*3 + 2*4) / sqrt(2) = 7.7782, (-1 + 1) / sqrt(2) = 0
    np.testing.assert_allclose(scores.dot_product(q, k)[0, 0], [11 / np.sqrt(2), 0.0], rtol=1e-6)
    np.testing.assert_allclose(scores.dot_product(q, k, scale=1.0)[0, 0], [11.0, 0.0])


def test_dot_product_gqa_matches_numpy():
    q, k, _ = qkv((2, 5, 6, 4), s=3, kv_heads=3)
    out = scores.dot_product(q, k)
    kk = np.repeat(np.asarray(k), 2, axis=-2)  # query head n uses key head n // 2
    expected = np.einsum("btnh,bsnh->bnts", np.asarray(q), kk) / 2.0
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_additive_by_hand():
    # One head, H = 2. q_0 = (0.5, -1), k_0 = (0, 1), k_1 = (1, 1), w = (2, 1).
    # s=0: 2 tanh(0.5) + tanh(0)  = 2 * 0.462117 = 0.924234
    # s=1: 2 tanh(1.5) + tanh(0)  = 2 * 0.905148 = 1.810296
    q = jnp.array([[[0.5, -1.0]]])
    k = jnp.array([[[0.0, 1.0]], [[1.0, 1.0]]])
    w = jnp.array([[2.0, 1.0]])
    np.testing.assert_allclose(scores.additive(q, k, w)[0, 0], [0.924234, 1.810296], atol=1e-6)
    # attention with it: softmax of those two logits
    v = jnp.array([[[1.0]], [[3.0]]])
    out = attnlab.attention(q, k, v, score=functools.partial(scores.additive, w=w))
    a1 = 1 / (1 + np.exp(0.924234 - 1.810296))  # weight of key 1
    np.testing.assert_allclose(out[0, 0, 0], (1 - a1) * 1.0 + a1 * 3.0, atol=1e-6)


@pytest.mark.parametrize("w_shape", ["per_head", "shared"])
def test_additive_matches_numpy_and_grads(w_shape):
    q, k, v = qkv((2, 4, 4, 3), s=5, kv_heads=2)
    w = jax.random.normal(jax.random.key(3), (4, 3) if w_shape == "per_head" else (3,))
    logits = scores.additive(q, k, w)
    qn, kn = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, axis=-2)
    wn = np.broadcast_to(np.asarray(w, np.float64), (4, 3))
    expected = np.einsum("btsnh,nh->bnts", np.tanh(qn[:, :, None] + kn[:, None]), wn)
    np.testing.assert_allclose(logits, expected, atol=1e-5)

    def loss(w):
        return jnp.sum(
            attnlab.attention(q, k, v, score=functools.partial(scores.additive, w=w), mask=masks.causal(1)) ** 2
        )

    g = jax.grad(loss)(w)
    eps = 1e-2
    e0 = jnp.zeros_like(w).reshape(-1).at[0].set(eps).reshape(w.shape)
    fd = (loss(w + e0) - loss(w - e0)) / (2 * eps)  # central difference along w[0]
    np.testing.assert_allclose(g.reshape(-1)[0], fd, rtol=2e-2, atol=1e-3)


def test_split_merge_roundtrip():
    x = jnp.arange(2 * 3 * 12.0).reshape(2, 3, 12)
    h = attnlab.split_heads(x, 4)
    assert h.shape == (2, 3, 4, 3)
    np.testing.assert_array_equal(h[1, 2, 3], x[1, 2, 9:12])  # head 3 = features 9..11
    np.testing.assert_array_equal(attnlab.merge_heads(h), x)


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_multi_head_attention_is_the_matrix_form(kv_heads):
    d, n = 12, 4
    p = attnlab.init_multi_head_params(jax.random.key(0), d, n, num_kv_heads=kv_heads)
    p = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(1), a.shape), p)  # non-zero biases
    x = jax.random.normal(jax.random.key(2), (2, 5, d))
    mask = masks.causal()
    y, w = attnlab.multi_head_attention(p, x, mask=mask, return_weights=True)
    # The note's matrix form in numpy: Q = X Wq + bq, K = X Wk + bk, V = X Wv + bv, per head.
    P = {key: np.asarray(val, np.float64) for key, val in p.items()}
    X = np.asarray(x, np.float64)
    kh = kv_heads or n
    Q = (X @ P["wq"].reshape(d, -1) + P["bq"].reshape(-1)).reshape(2, 5, n, -1)
    K = (X @ P["wk"].reshape(d, -1) + P["bk"].reshape(-1)).reshape(2, 5, kh, -1)
    V = (X @ P["wv"].reshape(d, -1) + P["bv"].reshape(-1)).reshape(2, 5, kh, -1)
    O, weights = np_attention(Q, K, V, mask=np.tril(np.ones((5, 5), bool)))
    Y = O.reshape(2, 5, -1) @ P["wo"].reshape(-1, d) + P["bo"]
    np.testing.assert_allclose(y, Y, atol=1e-4)
    np.testing.assert_allclose(w, weights, atol=1e-5)


def test_cross_attention_and_additive_params():
    p = attnlab.init_multi_head_params(jax.random.key(0), 8, 2, kv_dim=6, head_dim=3, score="additive")
    assert p["wk"].shape == (6, 2, 3) and p["w_score"].shape == (2, 3) and p["wo"].shape == (2, 3, 8)
    x_q = jax.random.normal(jax.random.key(1), (4, 8))  # unbatched [T, D]
    x_kv = jax.random.normal(jax.random.key(2), (7, 6))  # [S, Dkv]
    y = attnlab.multi_head_attention(p, x_q, x_kv, score="additive")
    assert y.shape == (4, 8)
    q = attnlab.split_heads(x_q @ p["wq"].reshape(8, 6), 2)
    k = attnlab.split_heads(x_kv @ p["wk"].reshape(6, 6), 2)
    v = attnlab.split_heads(x_kv @ p["wv"].reshape(6, 6), 2)
    o = attnlab.attention_reference(q, k, v, score=functools.partial(scores.additive, w=p["w_score"]))
    np.testing.assert_allclose(y, attnlab.merge_heads(o) @ p["wo"].reshape(6, 8), **tol(jnp.float32))


def test_multi_head_attention_takes_score_objects():
    # scores.Additive(w) and scores.Dot(scale) stand in for the strings. Expected: the matrix form in
    # numpy with the tanh score sum_h w[n, h] tanh(q[t, n, h] + k[s, n, h]) and the dot score scale * q . k.
    d, n, T = 8, 2, 5
    p = attnlab.init_multi_head_params(jax.random.key(0), d, n, score="additive")
    p = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(1), a.shape), p)  # non-zero biases
    x = jax.random.normal(jax.random.key(2), (2, T, d))
    P = {key: np.asarray(val, np.float64) for key, val in p.items()}
    X = np.asarray(x, np.float64)
    Q, K, V = (
        (X @ P[w].reshape(d, -1) + P[b].reshape(-1)).reshape(2, T, n, -1)
        for w, b in [("wq", "bq"), ("wk", "bk"), ("wv", "bv")]
    )
    logits = {
        "additive": np.einsum("btsnh,nh->bnts", np.tanh(Q[:, :, None] + K[:, None]), P["w_score"]),
        "dot": 0.3 * np.einsum("btnh,bsnh->bnts", Q, K),
    }

    def np_mha(lg):  # softmax over keys, then Y = merge(O) Wo + bo
        a = np.exp(lg - lg.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        o = np.einsum("bnts,bsnh->btnh", a, V)
        return o.reshape(2, T, -1) @ P["wo"].reshape(-1, d) + P["bo"], a

    w = p["w_score"]
    resolved = attnlab.heads.resolve_score("additive", p)  # the one place the string becomes an object
    assert isinstance(resolved, scores.Additive) and resolved.w is w
    assert attnlab.heads.resolve_score("dot", p) == "dot"
    for score, form in [("additive", "additive"), (scores.Additive(w), "additive"), (scores.Dot(0.3), "dot")]:
        y, weights = attnlab.multi_head_attention(p, x, score=score, return_weights=True)
        want_y, want_w = np_mha(logits[form])
        np.testing.assert_allclose(y, want_y, atol=1e-4)
        np.testing.assert_allclose(weights, want_w, atol=1e-5)
    # a score object carries its own weights: init adds no w_score, and the other params are the same draws
    q = attnlab.init_multi_head_params(jax.random.key(0), d, n, score=scores.Additive(w))
    assert "w_score" not in q
    raw = attnlab.init_multi_head_params(jax.random.key(0), d, n, score="additive")
    np.testing.assert_array_equal(q["wq"], raw["wq"])
    with pytest.raises(ValueError, match=r"score must be 'dot', 'additive' or an attnlab.scores.Score"):
        attnlab.init_multi_head_params(jax.random.key(0), d, n, score=3)
    with pytest.raises(ValueError, match=r"score='additive' needs params\['w_score'\]"):
        attnlab.multi_head_attention(q, x, score="additive")


def test_multi_head_attention_grad_and_jit():
    p = attnlab.init_multi_head_params(jax.random.key(0), 8, 2, use_bias=False)
    assert "bq" not in p
    x = jax.random.normal(jax.random.key(1), (3, 6, 8))
    lens = jnp.array([6, 2, 4])

    @jax.jit
    def loss(p, x, lens):
        return jnp.mean(attnlab.multi_head_attention(p, x, mask=masks.padding(lens, lens)) ** 2)

    g = jax.grad(loss)(p, x, lens)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(g))
    assert float(jnp.abs(g["wq"]).sum()) > 0


def test_project_qkv_is_the_matrix_form():
    p = attnlab.init_multi_head_params(jax.random.key(0), 8, 4, num_kv_heads=2, kv_dim=6, head_dim=3)
    p = jax.tree.map(lambda a: a + 0.1, p)  # non-zero biases
    x_q, x_kv = jax.random.normal(jax.random.key(1), (2, 5, 8)), jax.random.normal(jax.random.key(2), (2, 7, 6))
    q, k, v = attnlab.heads.project_qkv(p, x_q, x_kv)
    P = {key: np.asarray(val, np.float64) for key, val in p.items()}
    np.testing.assert_allclose(q, np.einsum("btd,dnh->btnh", x_q, P["wq"]) + P["bq"], atol=1e-5)
    np.testing.assert_allclose(k, np.einsum("bsd,dnh->bsnh", x_kv, P["wk"]) + P["bk"], atol=1e-5)
    np.testing.assert_allclose(v, np.einsum("bsd,dnh->bsnh", x_kv, P["wv"]) + P["bv"], atol=1e-5)
    with pytest.raises(ValueError, match="x_kv has width 8 but params expect 6"):
        attnlab.heads.project_qkv(p, x_q)  # self-attention with cross-attention params


# ------------------------------------------------------------------------------------------
# Score objects


def test_score_objects_match_strings_and_partials():
    q, k, v = qkv((2, 12, 4, 8), kv_heads=2)
    w = jax.random.normal(jax.random.key(5), (4, 8))
    # (score=Dot(0.3) against scale=0.3 in float64 on every implementation: tests/conformance.py, test_scale)
    a = attnlab.attention(q, k, v, mask=masks.causal(), score=scores.Dot(0.3))
    b = attnlab.attention(q, k, v, mask=masks.causal(), scale=0.3)
    np.testing.assert_allclose(a, b, **tol(jnp.float32))
    ref, _ = np_attention(q, k, v, scale=0.3)
    np.testing.assert_allclose(attnlab.attention(q, k, v, score=scores.Dot(0.3)), ref, **tol(jnp.float32))
    a = attnlab.attention(q, k, v, score=scores.Additive(w))
    b = attnlab.attention(q, k, v, score=functools.partial(scores.additive, w=w))
    np.testing.assert_allclose(a, b, **tol(jnp.float32))
    with pytest.raises(ValueError, match=r"scale=2.0 conflicts with score=Dot\(scale=0.3\)"):
        attnlab.attention(q, k, v, score=scores.Dot(0.3), scale=2.0)
    with pytest.raises(ValueError, match="scale applies to score='dot' only"):
        attnlab.attention(q, k, v, score=scores.Additive(w), scale=2.0)


def test_score_edge_form_matches_dense_and_reaches_w():
    """The sparse kernel asks the score for its edge form: Additive(w) along edges == dense + graph mask."""
    n = 10
    q, k, v = qkv((n, 4, 8), kv_heads=2)
    rng = np.random.default_rng(0)
    adj = rng.random((n, n)) < 0.3
    r, s = np.nonzero(adj)
    edges = masks.graph_edges(senders=s, receivers=r, num_nodes=n)
    w = jax.random.normal(jax.random.key(1), (8,))

    def loss(w, impl, mask):
        return jnp.sum(attnlab.attention(q, k, v, mask=mask, score=scores.Additive(w), implementation=impl) ** 2)

    call = bind(q, k, v, mask=edges, score=scores.Additive(w))
    assert SPARSE.supports(call, "cpu") is None  # it takes the score (10 nodes: dispatch picks dense work)
    # loss and gradient of each in one compiled program (op by op: ~150 small compiles)
    l_sparse, g_sparse = jax.jit(jax.value_and_grad(lambda w: loss(w, "sparse", edges)))(w)
    l_ref, g_ref = jax.jit(jax.value_and_grad(lambda w: loss(w, "reference", masks.graph(adj))))(w)
    np.testing.assert_allclose(l_sparse, l_ref, rtol=1e-5)
    np.testing.assert_allclose(g_sparse, g_ref, **grad_tol(jnp.float32))
    # a custom callable has no edge form: the reason says so
    ex = attnlab.explain(q, k, v, mask=edges, score=lambda q, k: scores.dot_product(q, k))
    assert "per-edge form" in ex.reason("sparse") and ex.implementation == "reference"


def test_score_objects_are_pytrees_under_jit():
    q, k, v = qkv((6, 2, 4))
    f = jax.jit(lambda q, k, v, s: attnlab.attention(q, k, v, score=s))
    w = jnp.ones((4,))
    np.testing.assert_allclose(
        f(q, k, v, scores.Additive(w)),
        attnlab.attention_reference(q, k, v, score=scores.Additive(w)),
        **tol(jnp.float32),  # the suite's fp32 tolerance: an output entry near 0 has no relative precision
    )
    assert jax.tree_util.tree_leaves(scores.Dot(0.5)) == []  # the scale is static: changing it recompiles
