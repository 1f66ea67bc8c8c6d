"""Packing sequences into rows: every sequence once and intact, positions restart, the document mask."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab import masks
from attnlab.data.packing import PAD_SEGMENT, pack


def test_every_sequence_is_placed_once_intact_with_its_positions():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 50, rng.integers(1, 30)) for _ in range(40)]
    p = pack(seqs, row_len=64)
    assert p.tokens.shape[1] == 64 and len(p.placement) == len(seqs)
    covered = np.zeros(p.tokens.shape, int)
    for s, (r, start) in zip(seqs, p.placement, strict=True):
        np.testing.assert_array_equal(p.tokens[r, start : start + len(s)], s)
        np.testing.assert_array_equal(p.positions[r, start : start + len(s)], np.arange(len(s)))
        assert len(set(p.segment_ids[r, start : start + len(s)].tolist())) == 1
        covered[r, start : start + len(s)] += 1
    assert covered.max() == 1  # no overlap
    np.testing.assert_array_equal(covered == 1, p.segment_ids != PAD_SEGMENT)
    np.testing.assert_array_equal(p.lengths, covered.sum(1))
    assert p.tokens.shape[0] <= -(-sum(map(len, seqs)) // 64) + 1  # first-fit-decreasing: nearly full rows


def test_document_mask_of_a_packed_batch_is_block_diagonal():
    p = pack([[1, 2, 3], [4, 5], [6]], row_len=4)
    m = masks.document(p.segment_ids, padding_id=PAD_SEGMENT) & masks.causal()
    dense = np.asarray(m.dense(4, 4))[:, 0]
    seg = p.segment_ids
    want = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != PAD_SEGMENT) & np.tril(np.ones((4, 4), bool))
    np.testing.assert_array_equal(dense, want)


@pytest.mark.parametrize(
    "args, match", [(([[1, 2, 3]], 2), "length 3"), (([[]], 4), "length 0"), (([[1]], 0), "row_len")]
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        pack(*args)
