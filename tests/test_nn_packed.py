"""Packed batches through nn.Encoder: each document gives what it gives alone, for every positional scheme."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import nn, positional
from attnlab.data import packing

DOCS = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14], [15, 16]]  # 14 tokens
ROW = 8


def alone(enc, docs):
    """Each document as its own sequence (one padded batch, padding by lengths): the unpacked route."""
    width = max(map(len, docs))
    tokens = np.zeros((len(docs), width), np.int32)
    for i, d in enumerate(docs):
        tokens[i, : len(d)] = d
    return np.asarray(enc(jnp.asarray(tokens), jnp.asarray([len(d) for d in docs])))


@pytest.mark.parametrize(
    "posenc",
    [positional.Sinusoidal(32), positional.Learned(32), positional.Rope(), positional.Alibi(), positional.T5()],
    ids=lambda p: type(p).__name__,
)
def test_packed_documents_equal_each_document_alone(posenc):
    enc = nn.Encoder(vocab_sizes=20, d_model=16, num_layers=2, num_heads=2, posenc=posenc, rngs=nnx.Rngs(0))
    p = packing.pack(DOCS, row_len=ROW)
    out = enc(jnp.asarray(p.tokens), segment_ids=jnp.asarray(p.segment_ids))  # positions from the ids
    out_given = enc(jnp.asarray(p.tokens), segment_ids=jnp.asarray(p.segment_ids), positions=jnp.asarray(p.positions))
    real = p.segment_ids != packing.PAD_SEGMENT  # (padding's positions differ, and attend to nothing real)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(out_given)[real], rtol=1e-6, atol=1e-6)
    ref = alone(enc, DOCS)
    for i, (doc, (row, start)) in enumerate(zip(DOCS, p.placement, strict=True)):
        np.testing.assert_allclose(out[row, start : start + len(doc)], ref[i, : len(doc)], rtol=2e-5, atol=2e-5)


def test_packed_under_jit_one_trace_for_new_ids():
    enc = nn.Encoder(vocab_sizes=20, d_model=16, num_layers=1, num_heads=2, rngs=nnx.Rngs(1))
    traces = []

    @nnx.jit
    def run(enc, tokens, ids):
        traces.append(1)
        return enc(tokens, segment_ids=ids)

    for docs in (DOCS, [[1] * 6, [2] * 2, [3] * 4, [4] * 4], [[5] * 8, [6] * 8]):
        p = packing.pack(docs, row_len=ROW)
        if p.tokens.shape[0] != 2:
            continue
        out = run(enc, jnp.asarray(p.tokens), jnp.asarray(p.segment_ids))
        ref = alone(enc, docs)
        for i, (doc, (row, start)) in enumerate(zip(docs, p.placement, strict=True)):
            np.testing.assert_allclose(out[row, start : start + len(doc)], ref[i, : len(doc)], rtol=2e-5, atol=2e-5)
    assert len(traces) == 1


def test_segment_positions_match_pack():
    p = packing.pack([[1] * 5, [2] * 3, [3] * 7, [4]], row_len=8)
    pos = np.asarray(packing.segment_positions(jnp.asarray(p.segment_ids)))
    real = p.segment_ids != packing.PAD_SEGMENT
    np.testing.assert_array_equal(pos[real], p.positions[real])
    np.testing.assert_array_equal(np.asarray(jax.jit(packing.segment_positions)(p.segment_ids)), pos)
    with pytest.raises(ValueError, match="segment_ids must be an integer array"):
        packing.segment_positions(jnp.zeros(4))


def test_packed_bad_input():
    enc = nn.Encoder(vocab_sizes=20, d_model=8, num_layers=1, num_heads=2, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, ROW), jnp.int32)
    with pytest.raises(ValueError, match=r"segment_ids must be an integer array \[B, T\]"):
        enc(tokens, segment_ids=jnp.zeros((2, ROW - 1), jnp.int32))
    with pytest.raises(ValueError, match=r"positions must be an integer array"):
        enc(tokens, positions=jnp.zeros((2, ROW)))
    linear = nn.Encoder(vocab_sizes=20, d_model=8, num_layers=1, num_heads=2, attention="linear", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="need an attention that takes a mask"):
        linear(tokens, segment_ids=jnp.zeros((2, ROW), jnp.int32))
