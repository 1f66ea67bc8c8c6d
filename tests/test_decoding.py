"""EncoderDecoder and attnlab.decoding: the KV cache against recomputation, greedy vs beam, padding."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import decoding, masks
from attnlab.nn import EncoderDecoder, subsampled_lengths

BOS, EOS, PAD, V = 1, 2, 0, 11


@pytest.fixture(scope="module")
def model():
    return EncoderDecoder(
        input_dim=6,
        vocab_size=V,
        d_model=16,
        num_heads=2,
        encoder_layers=1,
        decoder_layers=2,
        subsample=1,
        max_target_len=32,
        rngs=nnx.Rngs(0),
    )


def _batch(B=3, T=14, seed=0):
    feats = jax.random.normal(jax.random.key(seed), (B, T, 6))
    lengths = jnp.array([T, T - 5, 3][:B])
    return feats, lengths


def test_subsampled_lengths():
    np.testing.assert_array_equal(subsampled_lengths(jnp.array([1, 2, 3, 8, 9]), 2), [1, 1, 1, 2, 3])


def test_encoder_padding_does_not_leak(model):
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)
    junk = feats.at[1, 9:].set(100.0)  # frames beyond item 1's length
    memory2, _ = model.encode(junk, lengths)
    n = int(mem_len[1])
    np.testing.assert_allclose(memory2[1, :n], memory[1, :n], atol=1e-5)


def test_cached_steps_equal_teacher_forcing(model):
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 3, V).at[:, 0].set(BOS)
    full = model.decode(tokens, memory, mem_len)  # [B, U, V]
    cache = decoding.init_cache(model, memory, mem_len, 9)
    step = jax.jit(decoding.decode_step)
    for t in range(9):
        logits, cache = step(model, cache, tokens[:, t])
        np.testing.assert_allclose(logits, full[:, t], atol=2e-5, rtol=2e-5)
    assert int(cache.index) == 9


def test_greedy_cached_equals_recompute(model):
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)
    kw = dict(max_len=12, bos=BOS, eos=EOS, pad=PAD)
    tok_c, log_c = jax.jit(lambda m, x, n: decoding.greedy(m, x, n, **kw))(model, memory, mem_len)
    tok_r, log_r = jax.jit(lambda m, x, n: decoding.greedy_recompute(m, x, n, **kw))(model, memory, mem_len)
    np.testing.assert_array_equal(tok_c, tok_r)
    np.testing.assert_allclose(log_c, log_r, atol=3e-5, rtol=3e-5)


def test_greedy_stops_at_eos_per_item(model):
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)
    biased = nnx.clone(model)
    biased.out.bias[...] = biased.out.bias[...].at[EOS].set(50.0)
    tokens, logits = decoding.greedy(biased, memory, mem_len, max_len=6, bos=BOS, eos=EOS, pad=PAD)
    np.testing.assert_array_equal(tokens[:, 0], EOS)
    np.testing.assert_array_equal(tokens[:, 1:], PAD)
    np.testing.assert_array_equal(logits[:, 1:], 0.0)


def test_beam_one_equals_greedy(model):
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)
    g, _ = decoding.greedy(model, memory, mem_len, max_len=10, bos=BOS, eos=EOS, pad=PAD)
    b, _ = decoding.beam_search(model, memory, mem_len, beam=1, max_len=10, bos=BOS, eos=EOS, pad=PAD)
    np.testing.assert_array_equal(b, g)


def _sequence_logprob(model, memory, mem_len, seqs):
    """log p(seq) by teacher forcing, counting tokens up to and including the first eos."""
    B, M = seqs.shape
    inputs = jnp.concatenate([jnp.full((B, 1), BOS), seqs[:, :-1]], axis=1)
    logp = jax.nn.log_softmax(model.decode(inputs, memory, mem_len), -1)
    tok_lp = np.take_along_axis(np.asarray(logp), np.asarray(seqs)[..., None], -1)[..., 0]
    out, lengths = [], []
    for row, lp in zip(np.asarray(seqs), tok_lp, strict=True):
        n = int(np.argmax(row == EOS)) + 1 if (row == EOS).any() else M
        out.append(lp[:n].sum())
        lengths.append(n)
    return np.array(out), np.array(lengths)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_score_is_the_sequence_logprob(model, alpha):
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)
    seqs, score = decoding.beam_search(
        model, memory, mem_len, beam=3, max_len=8, bos=BOS, eos=EOS, pad=PAD, alpha=alpha
    )
    lp, n = _sequence_logprob(model, memory, mem_len, seqs)
    np.testing.assert_allclose(score, lp / n**alpha, atol=1e-4, rtol=1e-4)


def test_beam_at_least_as_likely_as_greedy_raw(model):
    # with alpha = 0 and a beam wide enough to hold every first token, beam's best hypothesis is
    # never less likely than greedy's, whose first step is among the beam's candidates
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)
    g, _ = decoding.greedy(model, memory, mem_len, max_len=1, bos=BOS, eos=EOS, pad=PAD)
    b, s = decoding.beam_search(model, memory, mem_len, beam=V, max_len=1, bos=BOS, eos=EOS, pad=PAD, alpha=0.0)
    lg, _ = _sequence_logprob(model, memory, mem_len, g)
    np.testing.assert_array_equal(b, g)  # one step: both take the argmax
    np.testing.assert_allclose(s, lg, atol=1e-5)


def test_padding_never_changes_decoding(model):
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)
    alone_mem, alone_len = model.encode(feats[2:, :3], lengths[2:])  # item 2 without any padding
    kw = dict(max_len=8, bos=BOS, eos=EOS, pad=PAD)
    tok, log = decoding.greedy(model, memory, mem_len, **kw)
    tok1, log1 = decoding.greedy(model, alone_mem, alone_len, **kw)
    np.testing.assert_array_equal(tok[2:], tok1)
    np.testing.assert_allclose(log[2:], log1, atol=2e-5, rtol=2e-5)
    b, _ = decoding.beam_search(model, memory, mem_len, beam=2, **kw)
    b1, _ = decoding.beam_search(model, alone_mem, alone_len, beam=2, **kw)
    np.testing.assert_array_equal(b[2:], b1)


def test_greedy_does_not_retrace(model):
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(m, x, n):
        return decoding.greedy(m, x, n, max_len=5, bos=BOS, eos=EOS, pad=PAD)

    run(model, memory, mem_len)
    run(model, memory + 1.0, mem_len)


def test_windowed_encoder_uses_the_mask():
    m = EncoderDecoder(
        input_dim=4,
        vocab_size=V,
        d_model=8,
        num_heads=2,
        encoder_layers=1,
        decoder_layers=1,
        subsample=0,
        encoder_mask=masks.window(1, 1),
        rngs=nnx.Rngs(1),
    )
    feats = jax.random.normal(jax.random.key(3), (1, 9, 4))
    lengths = jnp.array([9])
    _, weights, _ = m.encode(feats, lengths, return_weights=True)
    w = np.asarray(weights[0][0, 0])  # [T, T]
    assert (w[np.abs(np.subtract.outer(np.arange(9), np.arange(9))) > 1] == 0).all()
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    "kw,match",
    [(dict(max_len=0), "max_len"), (dict(max_len=64), "max_len"), (dict(max_len=4, bos=-1), "bos")],
)
def test_bad_arguments_named(model, kw, match):
    feats, lengths = _batch()
    memory, mem_len = model.encode(feats, lengths)
    args = dict(max_len=4, bos=BOS, eos=EOS, pad=PAD) | kw
    with pytest.raises(ValueError, match=match):
        decoding.greedy(model, memory, mem_len, **args)


def test_model_arguments_named():
    with pytest.raises(ValueError, match="vocab_size"):
        EncoderDecoder(input_dim=4, vocab_size=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="subsample"):
        EncoderDecoder(input_dim=4, vocab_size=5, subsample=-1, rngs=nnx.Rngs(0))
