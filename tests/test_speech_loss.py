"""The speech experiment's training losses against brute force (no espeak-ng needed)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab.data import speech
from attnlab.nn import EncoderDecoder
from experiments import speech as exp


def _brute_force_ctc(logp: np.ndarray, labels: list[int], blank: int) -> float:
    """-log of the summed probability of every frame path that collapses to ``labels``."""
    total = 0.0
    for path in itertools.product(range(logp.shape[1]), repeat=logp.shape[0]):
        collapsed = [c for i, c in enumerate(path) if c != blank and (i == 0 or c != path[i - 1])]
        if collapsed == labels:
            total += np.exp(sum(logp[t, c] for t, c in enumerate(path)))
    return -np.log(total)


@pytest.fixture(scope="module")
def model():
    return EncoderDecoder(input_dim=6, vocab_size=5, d_model=8, num_heads=2, encoder_layers=1, decoder_layers=1,
                          subsample=0, ctc_head=True, rngs=nnx.Rngs(0))  # fmt: skip


def test_ctc_loss_equals_brute_force_with_padding_and_eos(model):
    rng = np.random.default_rng(0)
    memory = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    mem_len = jnp.array([4, 3])  # frames beyond are padding
    # ids 3, 4 are characters; EOS (2) ends each target and PAD (0) follows: neither is a label
    targets = jnp.array([[3, 4, speech.EOS, speech.PAD], [4, 4, speech.EOS, speech.PAD]])
    target_lengths = jnp.array([3, 3])
    got = exp.ctc_loss(model, memory, mem_len, targets, target_lengths)
    logp = np.asarray(jax.nn.log_softmax(model.ctc_logits(memory), -1), np.float64)
    want = _brute_force_ctc(logp[0, :4], [3, 4], speech.PAD) + _brute_force_ctc(logp[1, :3], [4, 4], speech.PAD)
    np.testing.assert_allclose(got, want / 4, rtol=1e-4)  # per character: 2 + 2


def test_hybrid_loss_mixes_attention_and_ctc(model):
    rng = np.random.default_rng(1)
    batch = {
        "features": jnp.asarray(rng.normal(size=(2, 7, 6)), jnp.float32),
        "lengths": jnp.array([7, 5]),
        "targets": jnp.array([[3, 4, speech.EOS], [3, speech.EOS, speech.PAD]]),
        "target_lengths": jnp.array([3, 2]),
    }

    @nnx.jit  # one program (op by op, the encoder-decoder's small ops each compile on their own)
    def losses(model, batch):
        att, _ = exp.loss_fn(model, batch, None, smoothing=0.1)
        mixed, metrics = exp.loss_fn(model, batch, None, smoothing=0.1, ctc_weight=0.3)
        memory, mem_len = model.encode(batch["features"], batch["lengths"])
        return att, mixed, metrics, exp.ctc_loss(model, memory, mem_len, batch["targets"], batch["target_lengths"])

    att, mixed, metrics, ctc = losses(model, batch)
    np.testing.assert_allclose(metrics["attention_loss"], att, rtol=1e-6)
    np.testing.assert_allclose(mixed, 0.7 * att + 0.3 * ctc, rtol=1e-5)
    gdef, state = nnx.split(model)
    g = jax.jit(jax.grad(lambda st: exp.loss_fn(nnx.merge(gdef, st), batch, None, smoothing=0.1, ctc_weight=0.3)[0]))(
        state
    )
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
    assert np.abs(np.asarray(g["ctc"]["kernel"][...])).sum() > 0  # the CTC head is trained


def test_ctc_logits_needs_the_head():
    m = EncoderDecoder(input_dim=4, vocab_size=5, d_model=8, num_heads=2, subsample=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="ctc_head"):
        m.ctc_logits(jnp.zeros((1, 3, 8)))


def _split(lengths, target_lengths, features=3):
    n = len(lengths)
    T, U = max(lengths), max(target_lengths)
    f = np.zeros((n, T, features), np.float32)
    t = np.zeros((n, U), np.int32)
    for i, (a, b) in enumerate(zip(lengths, target_lengths, strict=True)):
        f[i, :a] = i + 1  # each utterance's frames carry its index + 1
        t[i, :b] = 3
    return speech.Split(f, np.array(lengths), t, np.array(target_lengths), tuple(map(str, range(n))), ("v",) * n)


def test_batches_group_similar_lengths_and_cover_each_epoch_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 300, size=50).tolist()
    split = _split(lengths, [max(2, n // 8) for n in lengths])
    fn = exp._batch_fn(split, batch_size=8, seed=1, pad_to=64, target_pad=16)
    per_epoch = 50 // 8
    padded = []
    for epoch in range(2):
        seen = []
        for step in range(1 + epoch * per_epoch, 1 + (epoch + 1) * per_epoch):
            b = fn(step)
            idx = (b["features"][:, 0, 0] - 1).astype(int)  # recover the utterances from their frames
            np.testing.assert_array_equal(b["lengths"], np.asarray(lengths)[idx])
            T, U = b["features"].shape[1], b["targets"].shape[1]
            assert T % 64 == 0 and T - 64 < b["lengths"].max() <= T
            assert U % 16 == 0 or U == split.targets.shape[1]
            assert b["target_lengths"].max() <= U
            padded.append(T)
            seen += idx.tolist()
        assert len(seen) == len(set(seen)) == per_epoch * 8  # each utterance at most once per epoch
    # similar lengths pad less than random batches of the same size would
    random_T = [-(-max(rng.choice(lengths, 8, replace=False)) // 64) * 64 for _ in range(200)]
    assert np.mean(padded) < 0.8 * np.mean(random_T)
    # deterministic by (seed, step)
    again = exp._batch_fn(split, batch_size=8, seed=1, pad_to=64)
    np.testing.assert_array_equal(again(9)["features"], fn(9)["features"])
    with pytest.raises(ValueError, match="batch_size"):
        exp._batch_fn(split, batch_size=64, seed=0, pad_to=64)


def test_monotonicity_of_hand_made_alignments():
    diagonal = np.eye(5, 8)  # step t attends to frame t
    assert exp.monotonicity(diagonal) == pytest.approx(1.0)
    assert exp.monotonicity(diagonal[::-1]) == pytest.approx(-1.0)
    assert exp.monotonicity(np.full((5, 8), 1 / 8)) == 0.0  # every step attends everywhere: no alignment
    # centroids 0.5, 2, 3.5 (two frames each) against steps 0, 1, 2: a straight line
    assert exp.monotonicity(np.array([[0.5, 0.5, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0.5, 0.5]])) == pytest.approx(1.0)
