"""Packed (source, target) pairs through nn.EncoderDecoder: each pair gives what it gives alone.

The independent computation is the unpacked route: the same pairs as a padded batch with lengths.
Both routes run under ``nnx.jit`` (one compile per shape; op by op, the model's hundreds of small
ops each compile on first use: the gradient test took 25 s); test_packed_bad_input calls it eagerly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import masks, nn
from attnlab.data import packing

F, V = 6, 11
SRC_LENS = [13, 7, 10, 4, 9]  # frames
TGT_LENS = [5, 3, 4, 2, 4]  # tokens


def pairs(seed=0, src_lens=SRC_LENS, tgt_lens=TGT_LENS):
    rng = np.random.default_rng(seed)
    src = [rng.normal(size=(n, F)).astype(np.float32) for n in src_lens]
    tgt = [rng.integers(1, V, size=n).astype(np.int32) for n in tgt_lens]
    return src, tgt


def padded(seqs, dtype):
    width = max(len(s) for s in seqs)
    out = np.zeros((len(seqs), width, *np.shape(seqs[0])[1:]), dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return jnp.asarray(out), jnp.asarray([len(s) for s in seqs], jnp.int32)


def _call(m, *args, **kwargs):
    return m(*args, **kwargs)


_apply = nnx.jit(_call)  # the model under jit


def alone(model, src, tgt):
    feats, lens = padded(src, np.float32)
    toks, tlens = padded(tgt, np.int32)
    return _apply(model, feats, lens, toks, tlens)  # [P, U, V]


def call_packed(m, ps, pt, apply=_call):
    """The model on packed rows: sources ``ps`` and targets ``pt`` from ``packing.pack_pairs``
    (``apply=_apply``: under jit)."""
    return apply(
        m,
        jnp.asarray(ps.tokens),
        None,
        jnp.asarray(pt.tokens),
        source_segment_ids=jnp.asarray(ps.segment_ids),
        target_segment_ids=jnp.asarray(pt.segment_ids),
    )


def packed(model, src, tgt, subsample, source_len=32, target_len=10):
    ps, pt = packing.pack_pairs(src, tgt, source_len, target_len, source_align=2**subsample)
    return call_packed(model, ps, pt, _apply), ps, pt


def model(subsample, encoder_mask=None, seed=0):
    return nn.EncoderDecoder(
        input_dim=F,
        vocab_size=V,
        d_model=16,
        num_heads=2,
        encoder_layers=2,
        decoder_layers=2,
        subsample=subsample,
        encoder_mask=encoder_mask,
        max_source_len=64,
        max_target_len=16,
        rngs=nnx.Rngs(seed),
    )


@pytest.mark.parametrize(
    "subsample,encoder_mask",
    [(0, None), (1, None), (2, None), (1, masks.window(1, 1))],
    ids=["s0", "s1", "s2", "s1-win"],
)
def test_packed_pairs_equal_each_pair_alone(subsample, encoder_mask):
    m = model(subsample, encoder_mask)
    src, tgt = pairs()
    out, ps, pt = packed(m, src, tgt, subsample)
    assert ps.tokens.shape[0] < len(src)  # several pairs share a row: it is packed
    ref = alone(m, src, tgt)
    for i, (r, start) in enumerate(pt.placement):
        n = len(tgt[i])
        np.testing.assert_allclose(out[r, start : start + n], ref[i, :n], rtol=3e-5, atol=3e-5)


def test_packed_pairs_gradients_equal_alone():
    """d(loss)/d(params) of a packed batch equals that of the padded batch (the same tokens)."""
    m = model(2)
    src, tgt = pairs(1)
    ps, pt = packing.pack_pairs(src, tgt, 32, 10, source_align=4)
    real_p = jnp.asarray(pt.segment_ids != packing.PAD_SEGMENT)
    toks, tlens = padded(tgt, np.int32)
    feats, lens = padded(src, np.float32)
    real_a = jnp.arange(toks.shape[1])[None, :] < tlens[:, None]
    w = jax.random.normal(jax.random.key(0), (V,))

    def loss_packed(m):
        out = call_packed(m, ps, pt)
        return jnp.sum(jnp.where(real_p[..., None], jnp.tanh(out) * w, 0))

    def loss_alone(m):
        out = m(feats, lens, toks, tlens)
        return jnp.sum(jnp.where(real_a[..., None], jnp.tanh(out) * w, 0))

    lp, gp = nnx.jit(nnx.value_and_grad(loss_packed))(m)
    la, ga = nnx.jit(nnx.value_and_grad(loss_alone))(m)
    np.testing.assert_allclose(lp, la, rtol=2e-5)
    leaves_p, leaves_a = jax.tree.leaves(nnx.state(gp)), jax.tree.leaves(nnx.state(ga))
    assert len(leaves_p) == len(leaves_a) > 0
    for a, b in zip(leaves_p, leaves_a, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
        assert np.all(np.isfinite(a))


def test_packed_bf16_close_to_alone():
    m = model(1)
    src, tgt = pairs(2)
    src = [s.astype(jnp.bfloat16) for s in src]
    ps, pt = packing.pack_pairs(src, tgt, 32, 10, source_align=2)
    out = call_packed(m, ps, pt, _apply)
    feats, lens = padded(src, jnp.bfloat16)
    toks, tlens = padded(tgt, np.int32)
    ref = _apply(m, feats, lens, toks, tlens)
    for i, (r, start) in enumerate(pt.placement):
        n = len(tgt[i])
        np.testing.assert_allclose(
            np.asarray(out[r, start : start + n], np.float32), np.asarray(ref[i, :n], np.float32), atol=5e-2
        )


def test_packed_under_jit_one_trace_for_new_ids():
    m = model(1)
    traces = []

    @nnx.jit
    def run(m, feats, toks, sid, tid):
        traces.append(1)
        return m(feats, None, toks, source_segment_ids=sid, target_segment_ids=tid)

    for seed, (sl, tl) in enumerate([(SRC_LENS, TGT_LENS), ([16, 6, 8, 2, 12], [1, 6, 2, 3, 2])]):
        src, tgt = pairs(seed, sl, tl)
        ps, pt = packing.pack_pairs(src, tgt, 32, 10, source_align=2)
        assert ps.tokens.shape[0] == 2
        out = run(m, *map(jnp.asarray, (ps.tokens, pt.tokens, ps.segment_ids, pt.segment_ids)))
        ref = alone(m, src, tgt)
        for i, (r, start) in enumerate(pt.placement):
            n = len(tgt[i])
            np.testing.assert_allclose(out[r, start : start + n], ref[i, :n], rtol=3e-5, atol=3e-5)
    assert len(traces) == 1


def test_pack_pairs_layout():
    src, tgt = pairs()
    ps, pt = packing.pack_pairs(src, tgt, 32, 10, source_align=4)
    for i, ((rs, ss), (rt, st)) in enumerate(zip(ps.placement, pt.placement, strict=True)):
        assert rs == rt and ss % 4 == 0
        assert ps.segment_ids[rs, ss] == pt.segment_ids[rt, st]  # pair i: one document id on both sides
        np.testing.assert_array_equal(ps.tokens[rs, ss : ss + len(src[i])], src[i])
        np.testing.assert_array_equal(pt.tokens[rt, st : st + len(tgt[i])], tgt[i])
    assert ps.tokens.dtype == np.float32 and ps.tokens.shape[2:] == (F,)
    with pytest.raises(ValueError, match="sources and targets must pair up"):
        packing.pack_pairs(src, tgt[:-1], 32, 10)
    with pytest.raises(ValueError, match="row_len=30 must be a multiple of align=4"):
        packing.pack_pairs(src, tgt, 30, 10, source_align=4)
    with pytest.raises(ValueError, match=r"targets\[0\] has length 5; each must have 1 to row_len=4"):
        packing.pack_pairs(src, tgt, 32, 4)


def test_packed_bad_input():
    m = model(1)
    feats = jnp.zeros((2, 16, F))
    toks = jnp.zeros((2, 8), jnp.int32)
    ids = jnp.zeros((2, 16), jnp.int32)
    with pytest.raises(ValueError, match="pass both source_segment_ids and target_segment_ids"):
        m(feats, None, toks, source_segment_ids=ids)
    with pytest.raises(ValueError, match=r"segment_ids must be an integer array \[B, T\]"):
        m(feats, None, toks, source_segment_ids=ids[:, :-1], target_segment_ids=toks)
    with pytest.raises(ValueError, match="pass lengths"):
        m.encode(feats)
