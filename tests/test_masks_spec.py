"""masks.from_spec: each term equals its constructor, & binds tighter than |, errors name the spec."""

import numpy as np
import pytest
from flax import nnx

from attnlab import masks, nn

N = 12


@pytest.mark.parametrize(
    "spec, mask",
    [
        ("full", masks.full()),
        ("causal", masks.causal()),
        ("causal:-2", masks.causal(-2)),
        ("window:64:64", masks.window(64, 64)),
        ("window:3:0", masks.window(3, 0)),
        ("chunks:4", masks.chunks(4)),
        ("dilated:4:2:2", masks.dilated(4, 2, 2)),
        ("global:0,5", masks.global_tokens([0, 5])),
        ("window_2d:4:1", masks.window_2d(4, 1)),
        ("window_2d:4:1:0", masks.window_2d(4, 1, 0)),
        ("bigbird:seq_len=12:block_size=2:num_random=1", masks.bigbird(12, block_size=2, num_random=1)),
    ],
)
def test_each_term_is_its_constructor(spec, mask):
    got = masks.from_spec(spec)
    assert got == mask  # frozen dataclasses: same structure, same fields
    np.testing.assert_array_equal(got.dense(N, N), mask.dense(N, N))


def test_combinations_and_precedence():
    t = np.arange(N)[:, None]
    s = np.arange(N)[None, :]
    causal, chunk, band, first = s <= t, t // 4 == s // 4, np.abs(t - s) <= 1, (t == 0) | (s == 0)
    got = masks.from_spec("causal & chunks:4 | window:1:1 & global:0")
    # & binds tighter: (causal & chunks) | (window & global), written out in numpy
    np.testing.assert_array_equal(got.dense(N, N), (causal & chunk) | (band & first))
    np.testing.assert_array_equal(masks.from_spec(" causal&chunks:4 ").dense(N, N), causal & chunk)
    assert masks.from_spec("causal & window:2:0") == masks.causal() & masks.window(2, 0)


def test_document_and_prefix_lm_specs():
    m = masks.from_spec("document:4", seq_len=30, seed=2)
    ids = np.asarray(m.q_ids)[0]
    assert ids.shape == (30,) and sorted(set(ids.tolist())) == [0, 1, 2, 3] and (np.diff(ids) >= 0).all()
    dense = np.asarray(m.dense(30, 30))[0, 0]
    np.testing.assert_array_equal(dense, ids[:, None] == ids[None, :])  # block diagonal, one block per document
    same = masks.from_spec("document:4", seq_len=30, seed=2)  # the same seed: the same documents
    np.testing.assert_array_equal(np.asarray(same.q_ids), np.asarray(m.q_ids))
    np.testing.assert_array_equal(masks.from_spec("prefix_lm:3").dense(6, 6), masks.prefix_lm(3).dense(6, 6))
    with pytest.raises(ValueError, match="needs seq_len"):
        masks.from_spec("document:4")
    with pytest.raises(ValueError, match="DOCS must be in"):
        masks.from_spec("document:40", seq_len=30)


def test_graph_spec_is_random_with_self_loops():
    got = masks.from_spec("graph:0.2", seq_len=N, seed=3)
    adj = np.random.default_rng(3).random((N, N)) < 0.2  # the sweep's construction
    np.testing.assert_array_equal(np.asarray(got.dense(N, N)), adj | np.eye(N, dtype=bool))


def test_bigbird_takes_seq_len_from_the_keyword():
    got = masks.from_spec("bigbird:block_size=4:num_random=1", seq_len=16, seed=2)
    assert got == masks.bigbird(16, block_size=4, num_random=1, seed=2)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("window:64", r"bad spec 'window:64': 'window' takes 2 ':'-separated arguments, got 1"),
        ("window:a:1", r"bad spec 'window:a:1': left must be an int, got 'a'"),
        ("window:-1:0", r"bad spec 'window:-1:0': left must be >= 0"),
        ("causal & banded:3", r"bad spec 'causal & banded:3': unknown mask 'banded'"),
        ("chunks:0", r"bad spec 'chunks:0': size must be >= 1"),
        ("graph:0.1", r"bad spec 'graph:0.1': 'graph:DENSITY' needs seq_len="),
        ("graph:lots", r"density must be a float"),
        ("bigbird", r"bad spec 'bigbird': 'bigbird' needs seq_len"),
        ("bigbird:blocks=4", r"bigbird takes KEY=VALUE"),
        ("causal &", r"unknown mask ''"),
        ("", r"non-empty string"),
    ],
)
def test_errors_name_the_spec(spec, match):
    kw = {"seq_len": 8} if spec == "graph:lots" else {}
    with pytest.raises(ValueError, match=match):
        masks.from_spec(spec, **kw)


def test_encoder_takes_a_spec():
    kw = dict(vocab_sizes=10, d_model=8, num_layers=1, num_heads=2)
    enc = nn.Encoder(attention_mask="window:2:2 & chunks:4", **kw, rngs=nnx.Rngs(0))
    assert enc.attention_mask == masks.window(2, 2) & masks.chunks(4)
    with pytest.raises(ValueError, match="bad spec 'window:2'"):
        nn.Encoder(attention_mask="window:2", **kw, rngs=nnx.Rngs(0))
