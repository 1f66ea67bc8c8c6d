"""Mask objects: dense values by hand, block layouts against their dense form, pytree behaviour."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import brute_layout

import attnlab
from attnlab import masks


def test_dense_by_hand():
    # Each expected matrix written out from the definition (row t = query, column s = key).
    assert masks.full().dense(2, 3).tolist() == [[True] * 3] * 2
    assert masks.causal().dense(3, 4).astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    # offset = S - T: the last query sees every key (decoding against a cache)
    assert masks.causal(offset=1).dense(3, 4).astype(int).tolist() == [
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]
    assert masks.window(1, 0).dense(4, 4).astype(int).tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1],
    ]
    assert masks.window(0, 2).dense(3, 4).astype(int).tolist() == [[1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    pad = masks.padding(q_lengths=np.array([1, 2]), kv_lengths=np.array([3, 1])).dense(2, 3)
    assert pad.shape == (2, 1, 2, 3)  # [B, 1 (heads), T, S]
    assert pad[:, 0].astype(int).tolist() == [[[1, 1, 1], [0, 0, 0]], [[1, 0, 0], [1, 0, 0]]]


def test_window_matches_jax_nn_local_window_size():
    # jax.nn documents local_window_size=(l, r) as: query t sees keys [t - l, t + r].
    q = k = jax.random.normal(jax.random.key(0), (9, 1, 9))  # jax.nn needs Hv == H
    v = jnp.eye(9)[:, None, :]  # value s = one-hot(s): the output row is the weight row
    out = jax.nn.dot_product_attention(q, k, v, local_window_size=(2, 1))[:, 0, :]
    np.testing.assert_array_equal(np.asarray(out) > 0, np.asarray(masks.window(2, 1).dense(9, 9)))


def test_graph_and_self_loops():
    adj = np.array([[0, 1, 0], [0, 0, 1], [1, 0, 0]], bool)  # a directed 3-cycle
    assert np.array_equal(masks.graph(adj).dense(3, 3), adj)
    with_loops = masks.graph(adj, self_loops=True).dense(3, 3)
    assert np.array_equal(with_loops, adj | np.eye(3, dtype=bool))
    assert np.array_equal(masks.with_self_loops(jnp.asarray(adj)), adj | np.eye(3, dtype=bool))
    batched = masks.graph(np.stack([adj, adj.T])).dense(3, 3)
    assert batched.shape == (2, 1, 3, 3)
    assert np.array_equal(batched[1, 0], adj.T)


def test_graph_edges_equals_adjacency():
    rng = np.random.default_rng(0)
    adj = rng.random((11, 11)) < 0.3
    receivers, senders = np.nonzero(adj)  # edge s -> r means r attends to s
    m = masks.graph_edges(senders, receivers, 11)
    np.testing.assert_array_equal(m.dense(11, 11), adj)
    np.testing.assert_array_equal(m.dense(11, 11), masks.graph(adj).dense(11, 11))
    for bq, bk in [(4, 4), (3, 5), (11, 11), (16, 2)]:
        np.testing.assert_array_equal(m.block_layout(11, 11, bq, bk), brute_layout(adj, 11, 11, bq, bk))


def test_graph_edges_duplicates_are_one_edge():
    m = masks.graph_edges([0, 0, 1], [1, 1, 0], 2)
    assert m.dense(2, 2).astype(int).tolist() == [[0, 1], [1, 0]]
    assert m.block_layout(2, 2, 1, 1).tolist() == [[0, 2], [2, 0]]
    none = masks.graph_edges(np.zeros(0, int), np.zeros(0, int), 3)  # no edge: every tile EMPTY
    assert none.block_layout(3, 3, 2, 2).tolist() == [[0, 0], [0, 0]]


RNG = np.random.default_rng(42)
LAYOUT_MASKS = {
    "full": masks.full(),
    "causal": masks.causal(),
    "causal_offset": masks.causal(offset=5),
    "causal_neg_offset": masks.causal(offset=-3),
    "window_sym": masks.window(3, 3),
    "window_left": masks.window(6, 0),
    "window_offset": masks.window(2, 4, offset=-3),
    "padding": masks.padding(q_lengths=np.array([13, 4]), kv_lengths=np.array([9, 17])),
    "padding_kv": masks.padding(kv_lengths=np.array([5])),
    "graph": masks.graph(RNG.random((13, 17)) < 0.1),
    "graph_batched": masks.graph(RNG.random((2, 13, 17)) < 0.05),
    "causal_and_window": masks.causal() & masks.window(4, 0),
    "window_or_causal": masks.window(1, 1) | masks.causal(offset=-8),
    "padding_and_causal": masks.padding(kv_lengths=np.array([10, 3])) & masks.causal(offset=4),
    "dense_array": masks.as_mask(RNG.random((13, 17)) < 0.5),
    "chunks": masks.chunks(4),
    "dilated": masks.dilated(5, 2, 3),
    "strided_causal": masks.dilated(17, 0, 4) & masks.causal(),
    "global": masks.global_tokens([0, 9]),
    "longformer": masks.window(2, 2) | masks.global_tokens([0, 16]),
    "random_blocks": masks.random_blocks(17, 4, 2, seed=3),
    "bigbird": masks.bigbird(17, block_size=4, num_global=2, num_random=1, seed=5),
}


@pytest.mark.parametrize("blocks", [(4, 4), (3, 5), (8, 16), (13, 17), (1, 1), (32, 32)])
@pytest.mark.parametrize("name", list(LAYOUT_MASKS))
def test_block_layout_agrees_with_dense(name, blocks):
    T, S = 13, 17  # not multiples of the block sizes: the last blocks are short
    m = LAYOUT_MASKS[name]
    layout = m.block_layout(T, S, *blocks)
    assert layout.dtype == np.int8 and layout.shape == (-(-T // blocks[0]), -(-S // blocks[1]))
    np.testing.assert_array_equal(layout, brute_layout(m.dense(T, S), T, S, *blocks))


def test_block_layout_skips_blocks_for_window():
    # A +-128 window at N = 4096 with 128-wide blocks touches 3 diagonals of 32 blocks.
    layout = masks.window(128, 128).block_layout(4096, 4096, 128, 128)
    assert (layout != masks.EMPTY).sum() == 32 * 3 - 2
    assert (layout == masks.FULL).sum() == 32  # diagonal blocks: |t - s| <= 127 < 128


def test_traced_masks_give_safe_layout():
    @jax.jit
    def f(lengths):
        m = masks.padding(kv_lengths=lengths) & masks.causal()
        assert not m.is_static
        layout = m.block_layout(8, 8, 4, 4)
        # causal's empty block is still known; the rest could be anything
        assert layout.tolist() == [[1, 0], [1, 1]]
        return m.dense(8, 8)

    out = f(jnp.array([3]))
    np.testing.assert_array_equal(out[0, 0], np.tril(np.ones((8, 8), bool)) & (np.arange(8) < 3))


def test_masks_are_pytrees():
    m = masks.padding(kv_lengths=jnp.array([2, 3])) & masks.window(1, 2)
    leaves, treedef = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 1  # only the lengths are data
    m2 = jax.tree_util.tree_unflatten(treedef, [jnp.array([4, 1])])
    assert m2.b == masks.window(1, 2)
    assert m2.a.kv_lengths.tolist() == [4, 1]
    # vmap over a batch of masks: each example its own length
    dense = jax.vmap(lambda n: masks.padding(kv_lengths=n).dense(2, 4))(jnp.array([1, 3]))
    assert dense.shape == (2, 1, 2, 4)
    assert dense[:, 0, 0].astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 1, 0]]


def test_evaluation_on_arbitrary_positions():
    # What a kernel does: evaluate the mask on one block without forming [T, S].
    m = masks.causal() & masks.padding(kv_lengths=jnp.array([6]))
    blk = m(jnp.arange(4, 8), jnp.arange(2, 7))
    full = m.dense(8, 8)
    np.testing.assert_array_equal(blk, full[..., 4:8, 2:7])


def test_bool_array_combines_with_mask():
    arr = np.tril(np.ones((3, 3), bool))
    m = arr & masks.window(0, 0)
    np.testing.assert_array_equal(m.dense(3, 3), np.eye(3, dtype=bool))
    m = masks.window(0, 0) | arr.T
    np.testing.assert_array_equal(m.dense(3, 3), np.triu(np.ones((3, 3), bool)))


def test_sparse_family_by_hand():
    # chunks of 3 over 5 positions: {0,1,2}, {3,4}
    assert masks.chunks(3).dense(5, 5).astype(int).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1],
        [0, 0, 0, 1, 1],
    ]
    # strided (Sparse Transformer): keys t, t-3, t-6, ... before the query
    strided = (masks.dilated(10, 0, 3) & masks.causal()).dense(7, 7)
    assert np.nonzero(np.asarray(strided[6]))[0].tolist() == [0, 3, 6]
    # global token 2 sees all and is seen by all, on top of the diagonal
    g = (masks.window(0, 0) | masks.global_tokens([2])).dense(4, 4).astype(int).tolist()
    assert g == [[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]]


def test_random_blocks_are_seeded_and_counted():
    a = masks.random_blocks(64, 8, 3, seed=7)
    b = masks.random_blocks(64, 8, 3, seed=7)
    c = masks.random_blocks(64, 8, 3, seed=8)
    assert a == b and a != c  # static structure: equal seeds give equal (hashable) masks
    layout = a.block_layout(64, 64, 8, 8)
    assert (layout == masks.FULL).sum(1).tolist() == [3] * 8 and (layout == masks.PARTIAL).sum() == 0


def test_bigbird_skips_most_blocks_at_length():
    m = masks.bigbird(4096, block_size=128, num_global=2, num_random=3)
    layout = m.block_layout(4096, 4096, 128, 128)
    visited = (layout != masks.EMPTY).mean()
    # per query block: 3 window + 3 random (some overlap) + the global column; first row is all global
    assert 0.1 < visited < 0.25


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: masks.chunks(0), "size must be >= 1"),
        (lambda: masks.dilated(2, 2, 0), "dilation must be >= 1"),
        (lambda: masks.global_tokens([]), "at least one global position"),
        (lambda: masks.global_tokens([-1]), "indices must be >= 0"),
        (lambda: masks.random_blocks(16, 4, 5), r"num_random must be <= the number of blocks \(4\)"),
    ],
)
def test_sparse_family_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_prefix_lm_by_hand_and_its_layout():
    # prefix 2 of 5: rows 0-1 see keys 0-1 (the prefix, both ways); row t >= 2 sees keys 0..t
    expected = [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert np.asarray(masks.prefix_lm(2).dense(5, 5))[0].astype(int).tolist() == expected
    m = masks.prefix_lm(np.array([3, 9, 0]))  # batched lengths: [B, 1, T, S]
    dense = np.asarray(m.dense(40, 40))
    assert dense.shape == (3, 1, 40, 40)
    np.testing.assert_array_equal(dense[2, 0], np.tril(np.ones((40, 40), bool)))  # no prefix: causal
    np.testing.assert_array_equal(m.block_layout(40, 40, 8, 8), brute_layout(dense, 40, 40, 8, 8))
    with pytest.raises(ValueError, match="prefix_lengths"):
        masks.prefix_lm(np.array([1.5]))


def _packed_ids(T, docs, seed, batch=2):
    """Segment ids of `docs` documents of random lengths packed into rows of T (non-decreasing)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, T), docs - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(T), side="right"))
    return np.stack(rows).astype(np.int32)


def test_document_by_hand():
    ids = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 9, 9]])
    d = np.asarray(masks.document(ids, padding_id=9).dense(5, 5))  # [B, 1, T, S]
    expected0 = [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    expected1 = [[1, 0, 0, 0, 0], [0, 1, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert d[0, 0].astype(int).tolist() == expected0 and d[1, 0].astype(int).tolist() == expected1
    cross = masks.document(np.array([[0, 1]]), np.array([[1, 1, 0]]))  # q and kv ids differ (cross-attention)
    assert np.asarray(cross.dense(2, 3))[0, 0].astype(int).tolist() == [[0, 0, 1], [1, 1, 0]]
    with pytest.raises(ValueError, match="q_segment_ids"):
        masks.document(np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="batch dims"):
        masks.document(np.zeros((2, 4), int), np.zeros((3, 4), int))
    # ids of another length than the attention's: jnp.take would fill the missing ids, and two filled ids match
    q = jnp.ones((1, 12, 2, 8))
    for q_ids, kv_ids, name in [
        (ids[:1], None, "q_segment_ids has length 5"),
        (np.zeros((1, 12), int), ids[:1], "kv_segment_ids has length 5"),
    ]:
        with pytest.raises(ValueError, match=name):
            attnlab.attention(q, q, q, mask=masks.document(q_ids, kv_ids) & masks.causal())


@pytest.mark.parametrize("padding_id", [None, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_runtime_layout_from_traced_ids_is_exact_for_packed_rows(seed, padding_id):
    T, bq, bk = 77, 8, 16
    ids = _packed_ids(T, 5, seed)
    exact = brute_layout(masks.document(ids, padding_id=padding_id).dense(T, T), T, T, bq, bk)
    runtime = jax.jit(lambda i: masks.document(i, padding_id=padding_id).runtime_layout(T, T, bq, bk))(ids)
    np.testing.assert_array_equal(np.asarray(runtime), exact)
    assert masks.document(ids).runtime_layout(T, T, bq, bk) is None  # concrete ids: the static layout is exact


@pytest.mark.parametrize("padding_id", [None, 3, -1])
def test_static_document_layout_is_exact_for_any_known_ids_and_evaluates_nothing(padding_id):
    """Known ids, sorted or not, shared or cross-attention (T != S), with ragged tiles: the
    layout from the ids each block holds equals the brute force, and the mask is never evaluated."""
    from attnlab.masks import base

    rng = np.random.default_rng(1)
    sorted_ids = _packed_ids(77, 5, 0)
    if padding_id == -1:
        sorted_ids[0, 20:23] = -1  # padding inside a row
    cases = [
        (77, 77, sorted_ids, None),
        (77, 77, rng.integers(-1, 4, (2, 77)), None),  # unsorted, with the padding id here and there
        (77, 77, sorted_ids, sorted_ids[:, ::-1].copy()),
        (50, 61, rng.integers(0, 4, (2, 50)), rng.integers(2, 6, (2, 61))),  # cross: only ids 2 and 3 meet
        (33, 40, np.full((1, 33), 3), np.concatenate([np.full((1, 20), 3), np.full((1, 20), 1)], 1)),
    ]
    kinds = set()
    for T, S, q_ids, kv_ids in cases:
        mask = masks.document(np.asarray(q_ids, np.int32), kv_ids, padding_id=padding_id)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(base, "layout_by_evaluation", lambda *a, **k: pytest.fail("the mask was evaluated"))
            layouts = {(bq, bk): mask.block_layout(T, S, bq, bk) for bq, bk in [(8, 16), (16, 8), (1, 1), (7, 64)]}
        for (bq, bk), layout in layouts.items():
            np.testing.assert_array_equal(layout, brute_layout(mask.dense(T, S), T, S, bq, bk))
            kinds |= set(np.unique(layout).tolist())
    assert kinds == {masks.EMPTY, masks.PARTIAL, masks.FULL}


def test_blocks_meet_is_the_join_of_the_blocks_on_their_ids_in_any_chunks():
    graph = importlib.import_module("attnlab.masks.graph")  # the module (masks.graph is the mask's function)
    rng = np.random.default_rng(0)
    nq, nk = 9, 7
    q_block, q_key = rng.integers(0, nq, 40), rng.integers(0, 6, 40)
    k_block, k_key = rng.integers(0, nk, 30), rng.integers(0, 6, 30)
    want = np.zeros((nq, nk), bool)
    for i, a in zip(q_block, q_key, strict=True):
        for j, b in zip(k_block, k_key, strict=True):
            want[i, j] |= a == b
    for chunk in (1, 3, 50, 1 << 22):
        np.testing.assert_array_equal(graph._blocks_meet(q_block, q_key, k_block, k_key, nq, nk, chunk=chunk), want)


def test_runtime_layout_is_safe_for_any_data_and_combines():
    T, S, bq, bk = 50, 61, 8, 16
    rng = np.random.default_rng(4)
    for _ in range(5):
        q_ids, kv_ids = rng.integers(0, 4, (2, T)), rng.integers(0, 4, (2, S))  # unsorted: ranges overlap
        lengths = rng.integers(0, S + 1, (2,))

        def make(qi, ki, ln):
            return (masks.document(qi, ki) & masks.causal(offset=S - T)) | masks.padding(kv_lengths=ln)

        exact = brute_layout(make(q_ids, kv_ids, lengths).dense(T, S), T, S, bq, bk)
        runtime = np.asarray(
            jax.jit(lambda a, b, c: make(a, b, c).runtime_layout(T, S, bq, bk))(q_ids, kv_ids, lengths)
        )
        assert ((runtime == masks.EMPTY) <= (exact == masks.EMPTY)).all()  # EMPTY only when certain
        assert ((runtime == masks.FULL) <= (exact == masks.FULL)).all()  # FULL only when certain
    assert masks.causal().runtime_layout(8, 8, 4, 4) is None  # structural: nothing to learn at run time


def _same_document(q, k, ids):
    return (ids[..., q] == ids[..., k])[..., None, :, :]


def test_predicate_equals_the_built_in_masks_and_reuses_the_program():
    T, bq, bk = 45, 8, 16
    ids = _packed_ids(T, 4, seed=3)
    pred = masks.predicate(_same_document, ids)
    np.testing.assert_array_equal(np.asarray(pred.dense(T, T)), np.asarray(masks.document(ids).dense(T, T)))
    np.testing.assert_array_equal(pred.block_layout(T, T, bq, bk), masks.document(ids).block_layout(T, T, bq, bk))
    window = masks.predicate(lambda q, k: jnp.abs(q - k) <= 3, in_kernel=True)
    np.testing.assert_array_equal(np.asarray(window.dense(T, T)), np.asarray(masks.window(3, 3).dense(T, T)))
    assert window.in_kernel and not pred.in_kernel
    traces = []

    @jax.jit
    def dense(ids):
        traces.append(1)
        return masks.predicate(_same_document, ids).dense(T, T)

    for seed in range(3):
        ids = _packed_ids(T, 4, seed=seed)
        np.testing.assert_array_equal(np.asarray(dense(ids)), np.asarray(masks.document(ids).dense(T, T)))
    assert len(traces) == 1
    with pytest.raises(ValueError, match="callable"):
        masks.predicate("q == k")
    with pytest.raises(ValueError, match="in_kernel"):
        masks.predicate(_same_document, ids, in_kernel=True)
    with pytest.raises(ValueError, match="bool"):
        masks.predicate(lambda q, k: q - k).dense(3, 3)
