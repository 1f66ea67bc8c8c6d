"""attnlab.nn: modules equal the pure functions given the same weights; shapes; masks respected."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import np_attention, tol
from flax import nnx

from attnlab import heads, masks, nn, positional


@pytest.mark.parametrize("score", ["dot", "additive"])
@pytest.mark.parametrize("kv_heads", [None, 2, 1])
@pytest.mark.parametrize("implementation", [None, "reference"])
def test_mha_module_matches_pure_function(score, kv_heads, implementation):
    mha = nn.MultiHeadAttention(
        16, 4, num_kv_heads=kv_heads, score=score, implementation=implementation, rngs=nnx.Rngs(0)
    )
    p = mha.params()
    assert p["wq"].shape == (16, 4, 4) and p["wk"].shape == (16, kv_heads or 4, 4)
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    mask = masks.padding(jnp.array([5, 3]), jnp.array([5, 3]))
    got = mha(x, mask=mask)
    want = heads.multi_head_attention(p, x, mask=mask, score=score, implementation=implementation)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # And the same weights in an init_multi_head_params dict give the same result.
    fresh = heads.init_multi_head_params(jax.random.key(0), 16, 4, num_kv_heads=kv_heads, score=score)
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, p)


def test_mha_module_against_numpy_and_weights():
    mha = nn.MultiHeadAttention(8, 2, rngs=nnx.Rngs(3))
    p = {k: np.asarray(v, np.float64) for k, v in mha.params().items()}
    x = np.asarray(jax.random.normal(jax.random.key(2), (3, 8)))  # [T, D], no batch
    q = np.einsum("td,dnh->tnh", x, p["wq"]) + p["bq"]
    k = np.einsum("td,dnh->tnh", x, p["wk"]) + p["bk"]
    v = np.einsum("td,dnh->tnh", x, p["wv"]) + p["bv"]
    causal = np.tril(np.ones((3, 3), bool))
    o, w = np_attention(q, k, v, mask=causal)
    want = np.einsum("tnh,nhd->td", o, p["wo"]) + p["bo"]
    got, got_w = mha(jnp.asarray(x), mask=masks.causal(), return_weights=True)
    np.testing.assert_allclose(got, want, **tol(jnp.float32))
    np.testing.assert_allclose(got_w, w, **tol(jnp.float32))


def test_mha_cross_attention_against_numpy():
    mha = nn.MultiHeadAttention(16, 4, kv_dim=6, rngs=nnx.Rngs(0))
    p = {k: np.asarray(v, np.float64) for k, v in mha.params().items()}
    x_q = np.asarray(jax.random.normal(jax.random.key(1), (2, 5, 16)))  # [B, T, D]
    x_kv = np.asarray(jax.random.normal(jax.random.key(2), (2, 9, 6)))  # [B, S, Dkv]: another width
    q = np.einsum("btd,dnh->btnh", x_q, p["wq"]) + p["bq"]
    k = np.einsum("bsd,dnh->bsnh", x_kv, p["wk"]) + p["bk"]
    v = np.einsum("bsd,dnh->bsnh", x_kv, p["wv"]) + p["bv"]
    o, w = np_attention(q, k, v)
    y, got_w = mha(jnp.asarray(x_q), jnp.asarray(x_kv), return_weights=True)
    assert y.shape == (2, 5, 16) and got_w.shape == (2, 4, 5, 9)
    np.testing.assert_allclose(y, np.einsum("btnh,nhd->btd", o, p["wo"]) + p["bo"], **tol(jnp.float32))
    np.testing.assert_allclose(got_w, w, **tol(jnp.float32))


def test_block_matches_hand_composition():
    blk = nn.TransformerBlock(16, 4, 32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 16))
    mask = masks.window(1, 1)
    h = x + heads.multi_head_attention(blk.attn.params(), blk.ln1(x), mask=mask)
    want = h + blk.mlp_out(jax.nn.gelu(blk.mlp_in(blk.ln2(h))))
    np.testing.assert_allclose(blk(x, mask=mask), want, atol=1e-5)


def test_encoder_matches_hand_composition_sinusoidal():
    enc = nn.Encoder(
        vocab_sizes=(20, 5), d_model=16, num_layers=2, num_heads=4, attention_mask=masks.window(2, 2), rngs=nnx.Rngs(0)
    )
    ids = jax.random.randint(jax.random.key(1), (2, 7, 2), 0, 5)
    lengths = jnp.array([7, 4])
    x = enc.embed.embeds[0].embedding[...][ids[..., 0]] + enc.embed.embeds[1].embedding[...][ids[..., 1]]
    x = x + positional.sinusoidal(7, 16)
    mask = masks.padding(lengths, lengths) & masks.window(2, 2)
    for blk in enc.blocks:
        x = blk(x, mask=mask)
    np.testing.assert_allclose(enc(ids, lengths), enc.ln_f(x), atol=1e-5)


def _models(rngs):
    common = dict(vocab_sizes=30, d_model=16, rngs=rngs)
    return {
        "encoder_full": nn.Encoder(num_layers=2, num_heads=4, posenc="sinusoidal", **common),
        "encoder_learned_window": nn.Encoder(
            num_layers=1, num_heads=2, posenc=positional.Learned(16), attention_mask=masks.window(1, 1), **common
        ),
        "encoder_additive_gqa": nn.Encoder(
            num_layers=1, num_heads=4, num_kv_heads=2, score="additive", posenc="none", **common
        ),
        "mlp": nn.TokenMLP(**common),
        "cnn": nn.CNN(kernel_size=3, **common),
        "lstm": nn.BiRNN(cell="lstm", **common),
        "gru": nn.BiRNN(cell="gru", hidden=8, **common),
    }


@pytest.mark.parametrize("name", list(_models(nnx.Rngs(0))))
def test_padding_does_not_change_real_positions(name):
    model = nn.TokenClassifier(_models(nnx.Rngs(0))[name], 5, rngs=nnx.Rngs(1))
    ids = jax.random.randint(jax.random.key(2), (3, 9), 1, 30)
    lengths = jnp.array([9, 4, 1])
    y = model(ids, lengths)
    assert y.shape == (3, 9, 5)
    junk = jax.random.randint(jax.random.key(3), (3, 9), 1, 30)
    pad = jnp.arange(9)[None] >= lengths[:, None]
    y2 = model(jnp.where(pad, junk, ids), lengths)
    np.testing.assert_allclose(np.where(pad[..., None], 0, y), np.where(pad[..., None], 0, y2), atol=1e-5)
    # A sentence alone (no padding at all) gives the same outputs as inside the padded batch.
    alone = model(ids[1:2, :4], lengths[1:2])
    np.testing.assert_allclose(alone[0], y[1, :4], atol=1e-5)


def test_sequence_classifier_pools_real_positions():
    model = nn.SequenceClassifier(nn.TokenMLP(vocab_sizes=30, d_model=8, rngs=nnx.Rngs(0)), 3, rngs=nnx.Rngs(1))
    ids = jnp.array([[3, 4, 5, 0, 0]])
    y = model(ids, jnp.array([3]))
    np.testing.assert_allclose(y, model(ids[:, :3]), atol=1e-6)
    assert y.shape == (1, 3)


def test_encoder_dropout_is_a_function_of_the_key():
    enc = nn.Encoder(vocab_sizes=30, d_model=16, num_layers=1, num_heads=4, dropout_rate=0.5, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (2, 6), 0, 30)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    np.testing.assert_array_equal(enc(ids, dropout_key=k1), enc(ids, dropout_key=k1))
    assert not np.allclose(enc(ids, dropout_key=k1), enc(ids, dropout_key=k2))
    assert not np.allclose(enc(ids, dropout_key=k1), enc(ids))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="posenc"):
        nn.Encoder(vocab_sizes=3, d_model=8, num_layers=1, num_heads=2, posenc="xpos", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="exactly one"):
        nn.TokenEmbedding(8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cell"):
        nn.BiRNN(vocab_sizes=3, d_model=8, cell="rnn", rngs=nnx.Rngs(0))
    emb = nn.TokenEmbedding(8, vocab_sizes=(3, 4), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="channels"):
        emb(jnp.zeros((1, 2, 3), int))


def test_input_projection_encoder():
    enc = nn.Encoder(input_dim=3, d_model=8, num_layers=1, num_heads=2, rngs=nnx.Rngs(0))
    feats = jax.random.normal(jax.random.key(5), (2, 4, 3))  # [B, T, F] float features, not ids
    lengths = jnp.array([4, 2])
    got = enc(feats, lengths)
    assert got.shape == (2, 4, 8)
    # by hand: x W + b (the input projection), sinusoidal positions, the block under padding, the final norm
    x = feats @ enc.embed.proj.kernel[...] + enc.embed.proj.bias[...] + positional.sinusoidal(4, 8)
    x = enc.blocks[0](x, mask=masks.padding(lengths, lengths))
    np.testing.assert_allclose(got, enc.ln_f(x), atol=1e-5)


def test_learned_positions_are_added():
    enc = nn.Encoder(
        vocab_sizes=30, d_model=8, num_layers=1, num_heads=2, posenc=positional.Learned(16), rngs=nnx.Rngs(0)
    )
    ids = jnp.array([[3, 3, 3, 3]])  # the same token everywhere: only positions tell them apart
    y = enc(ids)
    assert not np.allclose(y[0, 0], y[0, 1], atol=1e-6)
    enc.pos_table[...] = jnp.zeros((16, 8))
    np.testing.assert_allclose(enc(ids)[0, 0], enc(ids)[0, 1], atol=1e-6)


def test_split_key_passes_none_through():
    assert nn.split_key(None, 3) == (None, None, None)
    key = jax.random.key(4)
    got = nn.split_key(key, 3)
    assert isinstance(got, tuple) and len(got) == 3
    want = jax.random.split(key, 3)  # the same keys jax.random.split gives
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w))
    with pytest.raises(ValueError, match="split_key: n must be an int >= 0"):
        nn.split_key(key, 2.0)
