"""The sparse (edge-list, segment softmax) kernel against dense attention on the same graph."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare, fwd_and_grads, grad_tol, qkv, tol

import attnlab
from attnlab import kernels, masks, positional, scores

NODES = 23


def _random_edges(seed, num_nodes=NODES, p=0.2, isolated=(0, 7)):
    """Unique edges (sender -> receiver) of a random graph; `isolated` nodes receive none."""
    adj = np.random.default_rng(seed).random((num_nodes, num_nodes)) < p  # adj[r, s]
    adj[list(isolated)] = False
    receivers, senders = np.nonzero(adj)
    perm = np.random.default_rng(seed + 1).permutation(len(senders))  # edge order must not matter
    return masks.graph_edges(senders=senders[perm], receivers=receivers[perm], num_nodes=num_nodes), adj


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("score_kind", ["dot", "additive"])
def test_matches_dense_graph_fwd_and_grad(score_kind, kv_heads, dtype):
    edges, adj = _random_edges(0)
    q, k, v = qkv((2, NODES, 4, 8), kv_heads=kv_heads, dtype=dtype, seed=1)
    w = jax.random.normal(jax.random.key(2), (4, 8), jnp.float32)
    if score_kind == "dot":

        def sparse(q, k, v, w):
            return attnlab.attention(q, k, v, mask=edges, implementation="sparse")

        def dense(q, k, v, w):
            return attnlab.attention_reference(q, k, v, mask=masks.graph(adj))
    else:

        def sparse(q, k, v, w):
            score = functools.partial(scores.additive, w=w)
            return attnlab.attention(q, k, v, mask=edges, score=score, implementation="sparse")

        def dense(q, k, v, w):
            return attnlab.attention_reference(
                q, k, v, mask=masks.graph(adj), score=functools.partial(scores.additive, w=w)
            )

    out, grads = fwd_and_grads(sparse, q, k, v, w)
    out_r, grads_r = fwd_and_grads(dense, q, k, v, w)
    assert out.shape == (2, NODES, 4, 8) and out.dtype == dtype
    compare(out, out_r, tol(dtype))
    for g, g_r in zip(grads, grads_r, strict=True):  # dq, dk, dv, dw
        compare(g, g_r, grad_tol(dtype))
    # isolated nodes (no incoming edge) get zeros, with zero dq
    assert np.all(np.asarray(out, np.float32)[:, [0, 7]] == 0)
    assert np.all(np.asarray(grads[0], np.float32)[:, [0, 7]] == 0)


def test_dispatch_takes_sparse_where_the_blockwise_tiles_hold_many_pairs_per_edge():
    """On the CPU sparse pays off from min_pairs_per_edge(H) pairs of the blockwise kernel's non-empty tiles per
    edge (random graphs: T x S pairs; traced edges too); on a GPU whenever it supports the call."""
    from attnlab.impls.sparse import MIN_PAIRS_PER_EDGE, min_pairs_per_edge
    from benchmarks.cases import random_graph

    assert [min_pairs_per_edge(h) for h in (8, 16, 17, 32, 33, 64, 128)] == [16, 16, 32, 32, 64, 64, 64]
    assert MIN_PAIRS_PER_EDGE[-1] == (np.inf, 64)
    T = 1024
    q = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)
    for degree, chosen in ((4, "sparse"), (16, "blockwise")):  # 205 and 60 pairs per edge (with self loops)
        senders, receivers = random_graph(T, degree)
        assert (T * T >= 64 * len(senders)) == (chosen == "sparse")
        for score in ("dot", scores.SoftCap(30.0)):
            edges = masks.graph_edges(senders, receivers, T)
            assert attnlab.explain(q, q, q, mask=edges, score=score).implementation == chosen
            assert attnlab.explain(q, q, q, mask=edges, score=score, backend="gpu").implementation == "sparse"
        seen = []  # the edges traced: the rule counts every pair (no EMPTY tile is known)
        jax.eval_shape(
            lambda s, r, seen=seen: seen.append(attnlab.explain(q, q, q, mask=masks.graph_edges(s, r, T))),
            senders,
            receivers,
        )
        assert seen[0].implementation == chosen
    reason = seen[0].reason("sparse")
    assert "from 64 pairs per edge (at H = 64)" in reason and "(here 60.2:" in reason
    # smaller heads: the blockwise kernel's per-pair softmax weighs more, so sparse pays off from fewer pairs per edge
    senders, receivers = random_graph(T, 16)  # 60.2 pairs per edge
    for h, chosen in ((16, "sparse"), (32, "sparse"), (48, "blockwise")):
        small = jax.ShapeDtypeStruct((1, T, 4, h), jnp.float32)
        explained = attnlab.explain(small, small, small, mask=masks.graph_edges(senders, receivers, T))
        assert explained.implementation == chosen, (h, explained)
    senders, receivers = random_graph(T, 64)  # 15.8 pairs per edge: below even H = 16's threshold
    small = jax.ShapeDtypeStruct((1, T, 4, 16), jnp.float32)
    explained = attnlab.explain(small, small, small, mask=masks.graph_edges(senders, receivers, T))
    assert explained.implementation == "blockwise"
    # a block-diagonal batch of small graphs: the tiles off the diagonal are EMPTY, so few pairs per edge
    blocks = np.repeat(np.arange(16) * 64, 64 * 8) + np.random.default_rng(0).integers(0, 64, (2, 16 * 64 * 8))
    edges = masks.graph_edges(blocks[0], blocks[1], T)
    assert attnlab.explain(q, q, q, mask=edges).implementation == "blockwise"


def test_dispatch_on_a_small_graph_agrees_with_the_kernels():
    edges, adj = _random_edges(4)
    q, k, v = qkv((NODES, 2, 8), seed=5)  # no batch dims
    out = attnlab.attention(q, k, v, mask=edges)  # implementation=None: 23 nodes are dense work (xla)
    assert attnlab.explain(q, k, v, mask=edges).implementation == "xla"
    compare(out, kernels.sparse_attention(q, k, v, mask=edges), tol(jnp.float32))
    compare(out, attnlab.attention_reference(q, k, v, mask=masks.graph(adj)), tol(jnp.float32))
    # the same edge list through the blockwise kernel (as a dense adjacency, evaluated per tile)
    compare(out, attnlab.attention(q, k, v, mask=edges, implementation="blockwise"), tol(jnp.float32))


def test_traced_edges_under_jit_without_recompiling():
    q, k, v = qkv((NODES, 2, 8), seed=6)
    traces = []

    @jax.jit
    def f(q, k, v, senders, receivers):
        traces.append(1)
        mask = masks.graph_edges(senders, receivers, num_nodes=NODES)
        return attnlab.attention(q, k, v, mask=mask, implementation="sparse")

    for seed in (0, 1):
        edges, adj = _random_edges(seed, p=0.15)
        e = 40  # same number of edges, different graphs: no retrace
        s, r = jnp.asarray(edges.senders[:e]), jnp.asarray(edges.receivers[:e])
        sub = np.zeros_like(adj)
        sub[np.asarray(r), np.asarray(s)] = True
        compare(f(q, k, v, s, r), attnlab.attention_reference(q, k, v, mask=masks.graph(sub)), tol(jnp.float32))
    assert len(traces) == 1


@pytest.mark.parametrize("score_kind", ["dot", "additive"])
@pytest.mark.parametrize("traced", [False, True], ids=["known", "traced"])
def test_an_edge_listed_twice_counts_once(traced, score_kind):
    """A repeated edge is one edge of the adjacency (``GraphEdges.dense``), so it gets one share of its
    receiver's softmax, as in the reference: found by fuzzing against it (a node whose three listed senders
    held a repeat got a third of the weight on the repeated one instead of half)."""
    edges, adj = _random_edges(8)
    s, r = np.asarray(edges.senders), np.asarray(edges.receivers)
    twice = np.random.default_rng(9).choice(len(s), 15, replace=False)  # 15 edges listed again, some 3 times
    s, r = np.concatenate([s, s[twice], s[twice[:4]]]), np.concatenate([r, r[twice], r[twice[:4]]])
    q, k, v = qkv((2, NODES, 4, 8), kv_heads=2, seed=10)
    score = "dot" if score_kind == "dot" else scores.Additive(jax.random.normal(jax.random.key(3), (4, 8)))

    def sparse(q, k, v, s, r):
        return attnlab.attention(q, k, v, mask=masks.graph_edges(s, r, NODES), score=score, implementation="sparse")

    run = jax.jit(sparse) if traced else sparse
    out, grads = fwd_and_grads(lambda q, k, v: run(q, k, v, s, r), q, k, v)
    ref, grads_r = fwd_and_grads(
        lambda q, k, v: attnlab.attention_reference(q, k, v, mask=masks.graph(adj), score=score), q, k, v
    )
    compare(out, ref, tol(jnp.float32))
    for g, g_r in zip(grads, grads_r, strict=True):
        compare(g, g_r, grad_tol(jnp.float32))


def test_a_score_mod_that_masks_every_edge_of_a_node_gives_it_zeros():
    """A score_mod may return -inf (a mask written as a score): a receiver whose edges all get -inf has
    nothing to attend, so zeros and zero gradients, never 0 / 0; the others equal the reference."""
    edges, adj = _random_edges(3)
    q, k, v = qkv((2, NODES, 4, 8), kv_heads=2, seed=4)

    def drop(s, q_idx, k_idx, cut):  # node 5 loses all its edges, node 9 those from even senders
        gone = (q_idx == 5) | ((q_idx == 9) & (k_idx % 2 == 0))
        return jnp.where(gone, -jnp.inf, s * cut)

    score = scores.ScoreMod(drop, jnp.float32(0.8), head_axes=(None,))
    out, grads = fwd_and_grads(
        lambda q, k, v, sc: attnlab.attention(q, k, v, mask=edges, score=sc, implementation="sparse"), q, k, v, score
    )
    out_r, grads_r = fwd_and_grads(
        lambda q, k, v, sc: attnlab.attention_reference(q, k, v, mask=masks.graph(adj), score=sc), q, k, v, score
    )
    assert adj[5].any() and not np.asarray(out)[:, 5].any() and not np.asarray(grads[0])[:, 5].any()
    compare(out, out_r, tol(jnp.float32))
    for g, g_r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), strict=True):
        assert np.isfinite(np.asarray(g)).all()
        compare(g, g_r, grad_tol(jnp.float32))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_score_mod_may_hold_a_python_number(jit):
    """A ScoreMod's arrays may be plain Python numbers (a temperature): the chunked backward reads each leaf's
    shape and dtype, which jax's literal for a Python float lacks until it is made an array."""
    edges, adj = _random_edges(2)
    q, k, v = qkv((NODES, 2, 8), seed=6)
    score = scores.ScoreMod(lambda s, q_idx, k_idx, t: s * t, 0.5, head_axes=(None,))

    def grads(impl, mask):
        loss = lambda q, k, v: jnp.sum(attnlab.attention(q, k, v, mask=mask, score=score, implementation=impl) ** 2)  # noqa: E731
        run = jax.grad(loss, argnums=(0, 1, 2))
        return (jax.jit(run) if jit else run)(q, k, v)

    for g, g_r in zip(grads("sparse", edges), grads("reference", masks.graph(adj)), strict=True):
        compare(g, g_r, grad_tol(jnp.float32))


def test_a_score_mod_needs_its_head_axes_on_the_edges():
    """Without head_axes the edges cannot know how fn's arrays meet the heads: dispatch passes it by."""
    q, k, v = qkv((NODES, 2, 8))
    edges, _ = _random_edges(0)
    mod = scores.ScoreMod(lambda s, q_idx, k_idx, r: s - r * abs(q_idx - k_idx), jnp.float32(0.1))
    assert mod.edge_form() is None
    ex = attnlab.explain(q, k, v, mask=edges, score=mod)
    assert "ScoreMod with head_axes" in ex.reason("sparse") and ex.implementation != "sparse"
    with pytest.raises(ValueError, match="score"):
        attnlab.attention(q, k, v, mask=edges, score=mod, implementation="sparse")


def test_errors_name_the_argument():
    q, k, v = qkv((NODES, 2, 8))
    edges, adj = _random_edges(0)
    with pytest.raises(ValueError, match="mask"):
        attnlab.attention(q, k, v, mask=masks.graph(adj), implementation="sparse")
    with pytest.raises(ValueError, match="mask"):
        attnlab.attention(q, k, v, mask=None, implementation="sparse")
    with pytest.raises(ValueError, match="bias"):
        attnlab.attention(q, k, v, mask=edges, bias=jnp.zeros((NODES, NODES)), implementation="sparse")
    with pytest.raises(ValueError, match="score"):
        attnlab.attention(q, k, v, mask=edges, score=lambda q, k: scores.dot_product(q, k), implementation="sparse")
    q2, k2, v2 = qkv((NODES + 1, 2, 8))
    with pytest.raises(ValueError, match="num_nodes"):
        attnlab.attention(q2, k2, v2, mask=edges, implementation="sparse")


def test_memory_is_linear_in_edges():
    """Compiled fwd+bwd temp memory for 4x the edges is ~4x, and never a [T, S] array."""

    def temp_bytes(num_edges, nodes=4096):
        x = jax.ShapeDtypeStruct((nodes, 2, 16), jnp.float32)
        e = jax.ShapeDtypeStruct((num_edges,), jnp.int32)

        def loss(q, k, v, s, r):
            return jnp.sum(kernels.sparse_attention(q, k, v, mask=masks.GraphEdges(s, r, nodes)))

        return (
            jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            .lower(x, x, x, e, e)
            .compile()
            .memory_analysis()
            .temp_size_in_bytes
        )

    small, large = temp_bytes(8192), temp_bytes(32768)
    assert large < 5 * small, (small, large)
    assert large < 4096 * 4096 * 4, large  # less than one dense fp32 [T, S]


HOPS = jnp.asarray(np.random.default_rng(4).integers(0, 5, (NODES, NODES)), jnp.int32)  # made outside any trace


def _graphormer(w):
    """A Graphormer-style score: a learned bias per head and hop count, read through an integer [T, S] table of
    hop counts (the table's cotangent is float0)."""

    def bias(s, q_idx, k_idx, hops, w):  # s [N, t, s]; w [N, 5]
        return s + jnp.moveaxis(w.T[hops[q_idx, k_idx]], -1, 0)  # [t, s, N] -> [N, t, s]

    return scores.ScoreMod(bias, HOPS, w, head_axes=(None, 0))


EDGE_SCORES = {
    "dot": lambda w: scores.Dot(),
    "softcap": lambda w: scores.SoftCap(1.5),
    "alibi": lambda w: positional.Alibi().score(slopes=w[:, 0]),
    "graphormer": _graphormer,
    "additive": lambda w: scores.Additive(w[:, :4].repeat(2, axis=1)),  # w [N, H]
}


@pytest.mark.parametrize("score_kind", list(EDGE_SCORES))
def test_edge_chunks_do_not_change_the_result(monkeypatch, score_kind):
    """16-edge chunks: several chunks and a padded last one (the edge count is not a multiple of 16). The
    chunked backward sums the score's arrays' cotangents (ALiBi's slopes, a per-head table read through
    integer hop counts, the additive score's w) over the chunks."""
    from attnlab.kernels import sparse as sparse_lib

    edges, adj = _random_edges(8)
    assert edges.senders.shape[0] % 16
    q, k, v = qkv((2, NODES, 4, 8), kv_heads=2, seed=9)
    w = jax.random.normal(jax.random.key(5), (4, 5), jnp.float32)
    make = EDGE_SCORES[score_kind]
    monkeypatch.setattr(sparse_lib, "EDGE_CHUNK", 16)

    def sparse(q, k, v, w):
        return kernels.sparse_attention(q, k, v, mask=edges, score=make(w))

    def dense(q, k, v, w):
        return attnlab.attention_reference(q, k, v, mask=masks.graph(adj), score=make(w))

    out, grads = fwd_and_grads(sparse, q, k, v, w)
    out_r, grads_r = fwd_and_grads(dense, q, k, v, w)
    compare(out, out_r, tol(jnp.float32))
    for g, g_r in zip(grads, grads_r, strict=True):  # dq, dk, dv, dw
        compare(g, g_r, grad_tol(jnp.float32))
    if score_kind in ("alibi", "graphormer", "additive"):
        assert np.abs(np.asarray(grads[3])).max() > 1e-3  # the score's arrays are reached


def test_every_score_keeps_the_dot_products_memory():
    """Every score runs the chunked backward (jax differentiates only each chunk's logits): compiled fwd+bwd
    temp memory within 1.5x of the dot product's, where autodiff of the whole edge form kept every edge's
    gathered [E, N, H] rows (and the additive score's tanh of them)."""

    def temp_bytes(score, nodes=4096, num_edges=65536):
        x = jax.ShapeDtypeStruct((nodes, 4, 32), jnp.float32)
        e = jax.ShapeDtypeStruct((num_edges,), jnp.int32)

        def loss(q, k, v, s, r):
            return jnp.sum(kernels.sparse_attention(q, k, v, mask=masks.GraphEdges(s, r, nodes), score=score))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(x, x, x, e, e).compile().memory_analysis().temp_size_in_bytes

    dot = temp_bytes(scores.Dot())
    slopes = jnp.linspace(0.1, 1.0, 4)
    for score in (scores.SoftCap(30.0), positional.Alibi().score(slopes=slopes), scores.Additive(jnp.ones(32))):
        assert temp_bytes(score) < 1.5 * dot, (score, temp_bytes(score), dot)
