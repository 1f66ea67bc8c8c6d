"""O(N) attention: linear (vs its dense reference), Performer (error vs features), Linformer (vs numpy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import grad_tol, np_attention, qkv, tol

import attnlab
from attnlab import efficient


def test_elu_plus_one_by_hand():
    np.testing.assert_allclose(efficient.elu_plus_one(jnp.array([-1.0, 0.0, 2.0])), [np.exp(-1), 1.0, 3.0], rtol=1e-6)


def np_linear(q, k, v, causal, lengths):
    """Linear attention in numpy: weights phi(q).phi(k), masked, row-normalised (GQA by repeat)."""
    phi = lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))  # noqa: E731  elu(x) + 1
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[-2] // k.shape[-2]
    k, v = np.repeat(k, g, axis=-2), np.repeat(v, g, axis=-2)
    w = np.einsum("btnf,bsnf->bnts", phi(q), phi(k))
    t, s = q.shape[1], k.shape[1]
    if causal:
        w = w * np.tril(np.ones((t, s)))
    if lengths is not None:
        w = w * (np.arange(s)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]
    w = w / w.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", w, v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_linear_attention_matches_numpy_and_reference(padded, causal, chunk, dtype):
    q, k, v = qkv((2, 19, 4, 8), kv_heads=2, hv=5, dtype=dtype)  # odd length, not a multiple of the chunk
    lengths = jnp.array([19, 11]) if padded else None
    out = efficient.linear_attention(q, k, v, causal=causal, kv_lengths=lengths, chunk_size=chunk)
    assert out.shape == (2, 19, 4, 5) and out.dtype == dtype
    ref = efficient.linear_attention_reference(q, k, v, causal=causal, kv_lengths=lengths)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol(dtype))
    np.testing.assert_allclose(np.asarray(out, np.float32), np_linear(q, k, v, causal, lengths), **tol(dtype))


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_linear_attention_grads_match_reference(causal):
    q, k, v = qkv((2, 13, 2, 4), kv_heads=1)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, causal=causal)))

    g = jax.grad(loss(lambda *a, **kw: efficient.linear_attention(*a, chunk_size=4, **kw)), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(efficient.linear_attention_reference), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, **grad_tol(jnp.float32))


def test_linear_attention_is_linear_in_memory():
    # The causal form never builds [T, S]: its compiled temporaries grow ~linearly with T.
    def temp(t):
        q, k, v = (jax.ShapeDtypeStruct((t, 2, 16), jnp.float32) for _ in range(3))
        fn = jax.jit(lambda q, k, v: efficient.linear_attention(q, k, v, causal=True, chunk_size=64))
        return fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    small, big = temp(1024), temp(8192)
    assert big < 12 * small  # 8x the length; quadratic would be 64x


def _performer_error(num_features, seeds=4, causal=False):
    q, k, v = qkv((1, 64, 2, 16), seed=0)
    q, k = 0.6 * q, 0.6 * k
    mask = attnlab.masks.causal() if causal else None
    ref = attnlab.attention_reference(q, k, v, mask=mask)
    errs = [
        float(
            jnp.mean(
                jnp.abs(
                    efficient.performer_attention(
                        q, k, v, key=jax.random.key(s), num_features=num_features, causal=causal
                    )
                    - ref
                )
            )
        )
        for s in range(seeds)
    ]
    return float(np.mean(errs))


def test_performer_error_falls_with_more_features():
    errors = {m: _performer_error(m) for m in (16, 256, 1024)}
    assert errors[16] > errors[256] > errors[1024]
    assert errors[1024] < 0.6 * errors[16]
    assert errors[1024] < 0.03  # mean abs error of outputs whose entries are ~N(0, 1/sqrt(S))


def test_performer_causal_approximates_causal_softmax():
    assert _performer_error(1024, seeds=2, causal=True) < 0.04


def test_performer_features_estimate_the_softmax_kernel():
    # E_w[exp(w.x - |x|^2/2) exp(w.y - |y|^2/2)] = exp(x.y) for w ~ N(0, I): check the ratio of two kernel
    # values (the stabilisers cancel in ratios) against exp(q.(k1 - k2)/sqrt(H)).
    h = 8
    q = jnp.array([[[0.3] * h]])
    k = jnp.array([[[0.2] * h], [[-0.1] * h]])  # [S=2, K=1, H]
    proj = efficient.performer_projection(jax.random.key(0), 200_000, h, orthogonal=False)
    pq = efficient.favor_features(q, proj, is_query=True)
    pk = efficient.favor_features(k, proj, is_query=False)
    kern = jnp.einsum("tnm,snm->ts", pq, pk)[0]
    expected = np.exp(0.3 * (0.2 - (-0.1)) * h / np.sqrt(h))
    np.testing.assert_allclose(kern[0] / kern[1], expected, rtol=0.03)


def test_orthogonal_projection_rows_are_orthogonal_within_a_block():
    p = efficient.performer_projection(jax.random.key(1), 16, 8)
    block = p[:8] / jnp.linalg.norm(p[:8], axis=-1, keepdims=True)
    np.testing.assert_allclose(block @ block.T, np.eye(8), atol=1e-5)


def test_linformer_matches_numpy_and_identity_projection():
    q, k, v = qkv((2, 10, 2, 8), s=12, seed=3)
    params = efficient.init_linformer(jax.random.key(0), 12, 4)
    out = efficient.linformer_attention(q, k, v, params)
    e, f = np.asarray(params["e"], np.float64), np.asarray(params["f"], np.float64)
    k_proj = np.einsum("ps,bskh->bpkh", e, np.asarray(k, np.float64))
    v_proj = np.einsum("ps,bskh->bpkh", f, np.asarray(v, np.float64))
    np.testing.assert_allclose(out, np_attention(q, k_proj, v_proj)[0], atol=2e-5)
    eye = {"e": jnp.eye(12), "f": jnp.eye(12)}  # P = S, no compression: plain attention
    np.testing.assert_allclose(
        efficient.linformer_attention(q, k, v, eye), attnlab.attention_reference(q, k, v), atol=2e-5
    )
    lengths = jnp.array([12, 5])
    padded = efficient.linformer_attention(q, k, v, eye, kv_lengths=lengths)
    assert np.isfinite(np.asarray(padded)).all()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: efficient.linear_attention(*qkv((4, 2, 8), s=5), causal=True), "causal needs T == S"),
        (
            lambda: efficient.linear_attention(*qkv((2, 4, 2, 8)), kv_lengths=jnp.array([1, 2, 3])),
            r"kv_lengths must have the batch shape \(2,\)",
        ),
        (lambda: efficient.performer_attention(*qkv((4, 2, 8))), "exactly one of key"),
        (
            lambda: efficient.performer_attention(*qkv((4, 2, 8)), projection=jnp.ones((4, 3))),
            r"projection must be \[M, H=8\]",
        ),
        (
            lambda: efficient.linformer_attention(*qkv((4, 2, 8)), {"e": jnp.ones((2, 5)), "f": jnp.ones((2, 4))}),
            r"params\['e'\] must be \[P, S=4\]",
        ),
        (lambda: efficient.init_linformer(jax.random.key(0), 0, 2), "seq_len must be a positive int"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
