"""attnlab.nn with the efficient kinds: linear / Performer attention and sparse masks inside the encoder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import efficient, masks, nn, positional


def _projections(p, x):
    """q, k, v of the matrix form, written out: [B, T, D] -> [B, T, N, H]."""
    q = jnp.einsum("btd,dnh->btnh", x, p["wq"]) + p["bq"]
    k = jnp.einsum("btd,dnh->btnh", x, p["wk"]) + p["bk"]
    v = jnp.einsum("btd,dnh->btnh", x, p["wv"]) + p["bv"]
    return q, k, v


def _output(p, o):
    return jnp.einsum("btnh,nhd->btd", o, p["wo"]) + p["bo"]


def test_linear_mha_matches_dense_reference():
    mha = nn.MultiHeadAttention(16, 4, num_kv_heads=2, kind="linear", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 9, 16))
    lengths = jnp.array([9, 5])
    p = mha.params()
    q, k, v = _projections(p, x)
    want = _output(p, efficient.linear_attention_reference(q, k, v, kv_lengths=lengths))
    np.testing.assert_allclose(mha(x, kv_lengths=lengths), want, atol=2e-5)


def test_performer_mha_uses_its_fixed_projection_and_approximates_softmax():
    mha = nn.MultiHeadAttention(16, 2, kind="performer", num_features=2048, rngs=nnx.Rngs(0))
    assert mha.projection.shape == (2048, 8)
    assert "projection" not in nnx.state(mha, nnx.Param)  # drawn once, not trained
    x = 0.5 * jax.random.normal(jax.random.key(1), (1, 32, 16))
    p = mha.params()
    q, k, v = _projections(p, x)
    want = _output(p, efficient.performer_attention(q, k, v, projection=mha.projection[...]))
    got = mha(x)
    np.testing.assert_allclose(got, want, atol=2e-5)
    # FAVOR+ estimates softmax attention: with 2048 features the layer is much closer to the exact
    # softmax layer than that layer is to uniform attention (every weight 1/S, the mean of v).
    exact = _output(p, attnlab.attention_reference(q, k, v))
    uniform = _output(p, jnp.broadcast_to(v.mean(axis=1, keepdims=True), v.shape))
    err = float(jnp.mean(jnp.abs(got - exact)))
    assert err < 0.25 * float(jnp.mean(jnp.abs(exact)))
    assert err < 0.5 * float(jnp.mean(jnp.abs(uniform - exact)))  # measured 0.32


def _encoder(**kw):
    kw = dict(vocab_sizes=12, d_model=16, num_layers=1, num_heads=2, posenc=positional.Sinusoidal(40)) | kw
    return nn.Encoder(rngs=nnx.Rngs(0), **kw)


def test_encoder_chunks_of_one_equal_window_zero():
    # Same seed, same params: attention_mask=chunks(1) must give exactly the window(0, 0) model.
    ids = jax.random.randint(jax.random.key(2), (2, 12), 0, 12)
    lengths = jnp.array([12, 7])
    np.testing.assert_allclose(
        _encoder(attention_mask=masks.chunks(1))(ids, lengths),
        _encoder(attention_mask=masks.window(0, 0))(ids, lengths),
        atol=1e-5,
    )


def test_encoder_bigbird_blockwise_matches_dense_reference():
    # The block-sparse kernel (skips the EMPTY tiles of BigBird's layout) against the dense fp32 reference.
    t = 40
    bigbird = masks.bigbird(t, block_size=8, num_global=1, num_random=1, seed=3)
    ids = jax.random.randint(jax.random.key(3), (2, t), 0, 12)
    lengths = jnp.array([t, 29])
    fast = _encoder(attention_mask=bigbird, attention=nn.Softmax("blockwise"))(ids, lengths)
    ref = _encoder(attention_mask=bigbird, attention=nn.Softmax("reference"))(ids, lengths)
    np.testing.assert_allclose(fast, ref, atol=2e-5)


@pytest.mark.parametrize("kind", ["linear", "performer"])
def test_padding_never_changes_real_positions(kind):
    enc = _encoder(attention=nn.Linear() if kind == "linear" else nn.Performer(32))
    ids = jax.random.randint(jax.random.key(4), (1, 16), 0, 12)
    other = ids.at[:, 10:].set(5)
    lengths = jnp.array([10])
    # Performer's key stabiliser is one max over all keys (padding included); it cancels in the
    # normalisation except against favor_features' 1e-6 floor, so padding moves outputs by ~1e-4.
    atol = 1e-3 if kind == "performer" else 1e-5
    np.testing.assert_allclose(enc(ids, lengths)[:, :10], enc(other, lengths)[:, :10], atol=atol)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: nn.MultiHeadAttention(8, 2, kind="cosine", rngs=nnx.Rngs(0)), "kind must be one of"),
        (lambda: nn.MultiHeadAttention(8, 2, kind="linear", score="additive", rngs=nnx.Rngs(0)), "needs score='dot'"),
        (lambda: _encoder(attention=nn.Linear(), attention_mask=masks.window(2, 2)), "takes no attention_mask"),
        (lambda: _encoder(attention_mask=np.ones((4, 4), bool)), "attention_mask must be an attnlab.masks Mask"),
        (
            lambda: nn.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))(jnp.ones((3, 8)), kv_lengths=jnp.array(3)),
            "takes padding as a mask",
        ),
        (
            lambda: attnlab.multi_head_attention(
                attnlab.init_multi_head_params(jax.random.key(0), 8, 2),
                jnp.ones((3, 8)),
                mask=masks.causal(),
                attention_fn=efficient.linear_attention,
            ),
            "with attention_fn, mask, bias and return_weights must be unset",
        ),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
