"""attnlab.nn.Encoder with rope / alibi / t5: equal to a hand-assembled computation, gradients, lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import np_attention
from flax import nnx

from attnlab import masks, nn, positional

RELATIVE = ["rope", "alibi", "t5"]


def _encoder(posenc, **kw):
    kw = dict(vocab_sizes=30, d_model=16, num_layers=2, num_heads=4, posenc=posenc, rngs=nnx.Rngs(0)) | kw
    return nn.Encoder(**kw)


@nnx.jit
def _run(model, *args):
    return model(*args)  # one compiled program instead of hundreds of eager ops


def _np_bias(posenc, enc, T):
    """The [N, T, T] logit bias written out from the papers' definitions (numpy, not attnlab's callables)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    if posenc == "alibi":  # -slope_n |i - j|, slopes 2^-2, 2^-4, 2^-6, 2^-8 for 4 heads (Press et al.)
        slopes = 2.0 ** -np.array([2, 4, 6, 8])
        return -slopes[:, None, None] * np.abs(i - j)
    if posenc == "t5":  # table[bucket(j - i), n]; bucket checked by hand in test_positional
        buckets = np.asarray(positional.t5_bucket(jnp.asarray(j - i)))
        return np.moveaxis(np.asarray(enc.t5_table[...])[buckets], -1, 0)
    return None


def _np_rope(x, T):
    """RoPE in the paper's complex form: channel pair (2m, 2m+1) times exp(i t 10000^(-2m/H))."""
    h = x.shape[-1]
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(
        1j * np.arange(T)[:, None, None] * 10000.0 ** (-np.arange(0, h, 2) / h)
    )
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


@pytest.mark.parametrize("posenc", RELATIVE)
def test_encoder_equals_hand_assembled_computation(posenc):
    enc = _encoder(posenc)
    if posenc == "t5":  # a table far from zero, so a missing bias would show
        enc.t5_table[...] = jax.random.normal(jax.random.key(5), enc.t5_table[...].shape)
    B, T = 2, 7
    ids = jax.random.randint(jax.random.key(1), (B, T), 0, 30)
    lengths = jnp.array([7, 4])
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x = enc.embed(ids)  # nothing is added to the inputs by a relative scheme
    allowed = np.asarray(masks.padding(lengths, lengths).dense(T, T))  # [B, 1, T, T]
    bias = _np_bias(posenc, enc, T)
    for blk in enc.blocks:
        p = {k: f64(v) for k, v in blk.attn.params().items()}
        y = f64(blk.ln1(x))
        q = np.einsum("btd,dnh->btnh", y, p["wq"]) + p["bq"]
        k = np.einsum("btd,dnh->btnh", y, p["wk"]) + p["bk"]
        v = np.einsum("btd,dnh->btnh", y, p["wv"]) + p["bv"]
        if posenc == "rope":
            q, k = _np_rope(q, T), _np_rope(k, T)
        o, _ = np_attention(q, k, v, mask=allowed, bias=bias)
        h = f64(x) + np.einsum("btnh,nhd->btd", o, p["wo"]) + p["bo"]
        h = jnp.asarray(h, jnp.float32)
        x = h + blk.mlp_out(jax.nn.gelu(blk.mlp_in(blk.ln2(h))))
    want = np.asarray(enc.ln_f(x))
    got = np.asarray(_run(enc, ids, lengths))
    real = np.asarray(nn.sequence_mask(lengths, T))
    np.testing.assert_allclose(got[real], want[real], atol=1e-4)


@pytest.mark.parametrize("posenc", RELATIVE)
def test_padding_and_lengths_beyond_max_len(posenc):
    # encoding() ignores max_len for the relative schemes: they have none
    model = nn.TokenClassifier(_encoder(positional.encoding(posenc, max_len=8), num_layers=1), 5, rngs=nnx.Rngs(1))
    ids = jax.random.randint(jax.random.key(2), (3, 9), 1, 30)
    lengths = jnp.array([9, 4, 1])
    y = _run(model, ids, lengths)  # T = 9 > max_len: the relative schemes have no table to run out of
    junk = jax.random.randint(jax.random.key(3), (3, 9), 1, 30)
    pad = jnp.arange(9)[None] >= lengths[:, None]
    y2 = _run(model, jnp.where(pad, junk, ids), lengths)
    np.testing.assert_allclose(np.where(pad[..., None], 0, y), np.where(pad[..., None], 0, y2), atol=1e-5)


def test_alibi_encoder_is_blind_to_direction_and_t5_rope_are_not():
    # ALiBi's bias -m|i - j| is symmetric, so a bidirectional ALiBi encoder commutes with reversing the
    # sequence: it cannot tell the token k to the left from the one k to the right (README, posenc).
    ids = jax.random.randint(jax.random.key(6), (2, 8), 0, 30)
    for posenc, symmetric in [("alibi", True), ("t5", False)]:
        enc = _encoder(posenc, num_layers=1)
        if posenc == "t5":
            enc.t5_table[...] = jax.random.normal(jax.random.key(7), enc.t5_table[...].shape)
        y, y_rev = _run(enc, ids), _run(enc, ids[:, ::-1])[:, ::-1]
        assert np.allclose(y, y_rev, atol=1e-5) == symmetric, posenc


def test_t5_table_gets_gradients():
    ids = jax.random.randint(jax.random.key(8), (2, 9), 0, 30)
    lengths = jnp.array([9, 5])
    enc = _encoder(positional.T5(8, 16), num_layers=1)

    def loss(model):
        return jnp.sum(jnp.sin(model(ids, lengths)) * nn.sequence_mask(lengths, 9)[..., None])

    value_and_grad = nnx.jit(nnx.value_and_grad(loss))
    _, grads = value_and_grad(enc)
    g = np.asarray(grads.t5_table[...])
    assert g.shape == (8, 4) and np.abs(g).sum() > 0
    # central finite difference on the entries of two buckets (offset 0 and offset +1) of head 1
    table = enc.t5_table[...]
    for bucket in (0, int(positional.t5_bucket(jnp.array(1), num_buckets=8, max_distance=16))):
        eps = 1e-2
        enc.t5_table[...] = table.at[bucket, 1].add(eps)
        up = float(value_and_grad(enc)[0])
        enc.t5_table[...] = table.at[bucket, 1].add(-eps)
        down = float(value_and_grad(enc)[0])
        np.testing.assert_allclose((up - down) / (2 * eps), g[bucket, 1], rtol=2e-2, atol=2e-3)
    enc.t5_table[...] = table


def test_bad_rope_head_dim():
    with pytest.raises(ValueError, match="even head dim"):
        nn.Encoder(vocab_sizes=3, d_model=12, num_layers=1, num_heads=4, posenc="rope", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("posenc", ["alibi", "t5"])
def test_extra_bias_with_a_bias_posenc_is_refused(posenc):
    enc = nn.Encoder(d_model=8, num_layers=1, num_heads=2, vocab_sizes=10, posenc=posenc, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="bias= cannot be combined with posenc"):
        enc(jnp.zeros((1, 4), jnp.int32), bias=jnp.zeros((1, 2, 4, 4)))


def test_extra_bias_adds_to_logits_with_an_additive_posenc():
    enc = nn.Encoder(d_model=8, num_layers=1, num_heads=2, vocab_sizes=10, posenc="sinusoidal", rngs=nnx.Rngs(0))
    x = jnp.array([[1, 2, 3, 4]])
    # a -inf bias everywhere but the diagonal == a mask of the diagonal only
    eye = jnp.eye(4, dtype=bool)
    biased = enc(x, bias=jnp.where(eye, 0.0, -jnp.inf)[None, None])
    masked = enc(x, mask=eye[None, None])
    np.testing.assert_allclose(np.asarray(biased), np.asarray(masked), atol=1e-5)
