"""The blockwise (flash-style) kernel: what is specific to it (tiles, schedules, dispatch); the
outputs and gradients against the reference for every mask kind are in tests/conformance.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare, fwd_and_grads, grad_tol, qkv, tol

import attnlab
from attnlab import kernels, masks
from attnlab.testing import assert_close

# Odd lengths, not multiples of the (small) tiles, so short last blocks are exercised.
T, S = 37, 45
SMALL = kernels.BlockSizes(8, 16)


@pytest.mark.parametrize("block", [(8, 16), (16, 8), (64, 64), (1, 45)])
def test_block_sizes_do_not_change_the_result(block):
    q, k, v = qkv((T, 2, 8), s=S, seed=2)  # no batch dims at all
    mask = masks.window(7, 2) & masks.causal(offset=S - T)
    out = kernels.blockwise_attention(q, k, v, mask=mask, block_sizes=kernels.BlockSizes(*block))
    compare(out, attnlab.attention_reference(q, k, v, mask=mask), tol(jnp.float32))


def test_value_head_dim_and_leading_dims():
    q, k, v = qkv((2, 3, T, 2, 8), s=S, hv=5, seed=4)  # two leading batch dims, Hv != H
    mask = masks.causal(offset=S - T)
    out = kernels.blockwise_attention(q, k, v, mask=mask, block_sizes=SMALL)
    assert out.shape == (2, 3, T, 2, 5)
    compare(out, attnlab.attention_reference(q, k, v, mask=mask), tol(jnp.float32))
    # vmap over an unbatched call gives the batched result
    per_example = jax.vmap(
        jax.vmap(lambda q, k, v: kernels.blockwise_attention(q, k, v, mask=mask, block_sizes=SMALL))
    )(q, k, v)
    compare(per_example, out, tol(jnp.float32))


@pytest.mark.parametrize("kind", ["padded_query", "empty_kv", "isolated_node", "neg_inf_bias"])
def test_fully_masked_rows_are_zero_with_finite_grads(kind):
    q, k, v = qkv((2, T, 2, 8), s=S, seed=5)
    bias = None
    if kind == "padded_query":
        mask = masks.padding(q_lengths=jnp.array([3, 37]))
    elif kind == "empty_kv":
        mask = masks.padding(kv_lengths=jnp.array([0, 45]))
    elif kind == "isolated_node":
        adj = np.random.default_rng(3).random((T, S)) < 0.2
        adj[[0, 5, 36]] = False
        mask = masks.graph(adj)
    else:
        mask = masks.causal(offset=S - T)
        bias = lambda qi, ki: jnp.where(qi[:, None] < 4, -jnp.inf, 0.0)  # noqa: E731  rows 0..3 empty
    expected = attnlab.attention_reference(q, k, v, mask=mask, bias=bias)
    fast = functools.partial(kernels.blockwise_attention, mask=mask, bias=bias, block_sizes=SMALL)
    out, grads = fwd_and_grads(fast, q, k, v)
    compare(out, expected, tol(jnp.float32))
    empty = ~np.asarray(masks.as_mask(mask).dense(T, S)).any(-1)  # [*B|1, 1|, T]
    if kind == "neg_inf_bias":
        empty = np.arange(T) < 4
    rows = np.broadcast_to(empty.reshape(-1, T) if empty.ndim > 1 else empty, (2, T))
    assert rows.any()
    assert np.all(np.asarray(out)[rows] == 0)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0])[rows] == 0)  # dq of an empty row is zero


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_window_spans_read_in_place_match_the_reference(dtype, monkeypatch):
    """A band takes one key span per query block read from the [B, T, N, H] layout (``_flash_wide``): lead
    dims, GQA, short last blocks, rows the mask empties (zeros, zero dq) and a NaN query row (NaN, as in the
    reference: never hidden as an empty row)."""
    from attnlab.kernels import blockwise as bw

    calls = []
    wide = bw._flash_wide
    monkeypatch.setattr(bw, "_flash_wide", lambda *a: calls.append(a[7].wide) or wide(*a))
    q, k, v = qkv((2, T, 4, 8), s=S, kv_heads=2, dtype=dtype, seed=9)
    mask = masks.window(7, 2) & masks.padding(q_lengths=np.array([30, 37]), kv_lengths=np.array([45, 0]))
    fast = functools.partial(kernels.blockwise_attention, mask=mask, block_sizes=SMALL)
    out, grads = fwd_and_grads(fast, q, k, v)
    assert calls and all(w > 0 for w in calls)  # the span path, not the tile schedule
    ref_out, ref_grads = fwd_and_grads(functools.partial(attnlab.attention_reference, mask=mask), q, k, v)
    compare(out, ref_out, tol(dtype))
    for g, r in zip(grads, ref_grads, strict=True):
        compare(g, r, grad_tol(dtype))
    empty = ~np.asarray(mask.dense(T, S)).any(-1).reshape(2, T)
    assert empty[0, 30:].all() and empty[1].all()
    assert np.all(np.asarray(out)[empty] == 0) and np.all(np.asarray(grads[0])[empty] == 0)
    q_nan = q.at[0, 5, 1].set(jnp.nan)
    got = np.asarray(fast(q_nan, k, v), np.float32)
    want = np.asarray(attnlab.attention_reference(q_nan, k, v, mask=mask), np.float32)
    assert np.isnan(want[0, 5, 1]).all() and np.isnan(got[0, 5, 1]).all()
    np.testing.assert_allclose(got, want, equal_nan=True, **tol(dtype))


@pytest.mark.parametrize("path", ["reference", "xla", "blockwise tiles", "blockwise band"])
def test_a_nan_key_the_mask_excludes(path, monkeypatch):
    """docs/conventions.md, "Non-finite keys and values": the rows that see a NaN key are NaN everywhere; the
    others ignore it, except on the band path's forward (one key span per query block, fused on XLA:CPU),
    where every row of a query block whose span holds the key is NaN. The reference's dq is NaN in every
    row (dq = dS k meets the NaN key with a 0)."""
    from attnlab.kernels import blockwise as bw

    q, k, v = qkv((1, T, 2, 8), s=S, seed=3)
    mask, j = masks.window(7, 2), 20
    k_nan = k.at[0, j].set(jnp.nan)
    sees = np.asarray(mask.dense(T, S))[:, j]  # [T]: the rows the mask lets see key j
    if path == "blockwise tiles":  # no band: the tile schedule, partial tiles through a select
        monkeypatch.setattr(bw, "WIDE_MAX_KEYS", 0)
    calls = []
    wide = bw._flash_wide
    monkeypatch.setattr(bw, "_flash_wide", lambda *a: calls.append(a) or wide(*a))
    if path in ("reference", "xla"):
        fn = functools.partial(attnlab.attention, mask=mask, implementation=path)
    else:
        fn = functools.partial(kernels.blockwise_attention, mask=mask, block_sizes=SMALL)
    out = np.asarray(jax.jit(fn)(q, k_nan, v))[0]  # [T, N, H]
    assert bool(calls) == (path == "blockwise band")
    clean = np.asarray(attnlab.attention_reference(q, k, v, mask=mask))[0]
    nan_rows = np.isnan(out).any(axis=(1, 2))
    assert np.isnan(out[sees]).all()
    if path == "blockwise band":
        blocks = nan_rows.reshape(-1)[: T - T % SMALL.block_q].reshape(-1, SMALL.block_q)
        assert (blocks.all(axis=1) | ~blocks.any(axis=1)).all()  # whole query blocks
        assert nan_rows.sum() > sees.sum()  # some rows that do not see the key
    else:
        np.testing.assert_array_equal(nan_rows, sees)
    compare(out[~nan_rows], clean[~nan_rows], tol(jnp.float32))
    if path == "reference":
        dq = jax.grad(lambda q: jnp.sum(attnlab.attention_reference(q, k_nan, v, mask=mask)))(q)
        assert np.isnan(np.asarray(dq)[0]).any(axis=(1, 2)).all()


def _alibi(slopes):
    # ALiBi-like linear bias -slope[n] * |i - j|, [N, T', S'] (Press et al. 2021, arXiv 2108.12409)
    def bias(q_idx, k_idx):
        dist = jnp.abs(q_idx[:, None] - k_idx[None, :]).astype(jnp.float32)
        return -slopes[:, None, None] * dist

    return bias


def test_callable_bias_matches_dense_array_bias_with_grads():
    q, k, v = qkv((2, T, 4, 8), s=S, kv_heads=2, seed=6)
    slopes = 2.0 ** -jnp.arange(1, 5, dtype=jnp.float32)
    mask = masks.causal(offset=S - T)
    dense = _alibi(slopes)(jnp.arange(T), jnp.arange(S))  # [N, T, S]

    def loss(q, k, v, slopes, impl):
        if impl == "dense":
            b = _alibi(slopes)(jnp.arange(T), jnp.arange(S))
            out = attnlab.attention_reference(q, k, v, mask=mask, bias=b)
        else:
            bs = kernels.BlockSizes(8, 16)
            out = kernels.blockwise_attention(q, k, v, mask=mask, bias=_alibi(slopes), block_sizes=bs)
        return jnp.sum(out * jnp.cos(out)), out

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True), static_argnums=4)
    (gs, out), (gs_r, out_r) = g(q, k, v, slopes, "fast"), g(q, k, v, slopes, "dense")
    compare(out, out_r, tol(jnp.float32))
    compare(out, attnlab.attention_reference(q, k, v, mask=mask, bias=dense), tol(jnp.float32))
    for a, b in zip(gs, gs_r, strict=True):  # dq, dk, dv and d slopes
        compare(a, b, grad_tol(jnp.float32))
    # the public entry point takes the callable too (each implementation that takes a bias: tests/conformance.py)
    compare(attnlab.attention(q, k, v, mask=mask, bias=_alibi(slopes)), out_r, tol(jnp.float32))


def test_padding_lengths_change_without_recompiling():
    q, k, v = qkv((2, T, 2, 8), s=S, seed=8)
    traces = []

    @jax.jit
    def f(q, k, v, kv_lengths):
        traces.append(1)
        mask = masks.padding(kv_lengths=kv_lengths)
        return attnlab.attention(q, k, v, mask=mask, implementation="blockwise")

    for lengths in ([45, 3], [10, 0], [1, 44]):
        lengths = jnp.array(lengths)
        out = f(q, k, v, lengths)
        compare(out, attnlab.attention_reference(q, k, v, mask=masks.padding(kv_lengths=lengths)), tol(jnp.float32))
    assert len(traces) == 1


def test_schedule_visits_only_nonempty_blocks():
    layout = masks.window(128, 128).block_layout(4096, 4096, 128, 128)
    sc = kernels.Schedule(layout, 4096, 128)
    assert sc.index.shape == (32, 3)  # 3 key blocks per query block (1.5x the useful pairs), not 32
    # with 128-wide tiles the diagonal tile is FULL (|t - s| <= 127), its two neighbours PARTIAL (|t - s| from 1
    # to 255), the next ones EMPTY (|t - s| >= 129); the first and last rows have one neighbour
    n_full, n_partial = sc.counts[:, 0], sc.counts[:, 1]
    assert (n_full == 1).all() and n_partial[0] == 1 and n_partial[-1] == 1 and (n_partial[1:-1] == 2).all()
    for i in range(32):  # FULL tiles first, then PARTIAL ones, each in column order
        full, part = sc.index[i, : n_full[i]], sc.index[i, n_full[i] : n_full[i] + n_partial[i]]
        assert full.tolist() == np.nonzero(layout[i] == masks.FULL)[0].tolist()
        assert part.tolist() == np.nonzero(layout[i] == masks.PARTIAL)[0].tolist()
    # a short last key block is never FULL (its padding must be masked)
    sc = kernels.Schedule(np.full((2, 3), masks.FULL, np.int8), S=40, bk=16)
    np.testing.assert_array_equal(sc.counts, [[2, 1], [2, 1]])
    np.testing.assert_array_equal(sc.index, [[0, 1, 2], [0, 1, 2]])


def test_dispatch_rule():
    q, k, v = qkv((16, 2, 8))
    big_q, big_k, big_v = (jax.ShapeDtypeStruct((512, 2, 8), jnp.float32),) * 3
    edges = masks.graph_edges(senders=[0, 1], receivers=[1, 0], num_nodes=16)
    assert attnlab.explain(q, k, v, mask=edges, backend="cpu").implementation == "sparse"
    assert attnlab.explain(q, k, v, mask=None, backend="cpu").implementation == "xla"
    assert attnlab.explain(q, k, v, mask=masks.causal(), backend="cpu").implementation == "xla"
    long = masks.window(128, 128).block_layout(1024, 1024, 128, 128)
    assert (long == masks.EMPTY).any()
    q1 = jax.ShapeDtypeStruct((1024, 2, 8), jnp.float32)
    win = masks.window(128, 128)
    assert attnlab.explain(q1, q1, q1, mask=win, backend="cpu").implementation == "blockwise"
    assert attnlab.explain(big_q, big_k, big_v, mask=None, backend="cpu").implementation == "blockwise"
    # an array bias is already O(T*S): XLA
    assert (
        attnlab.explain(big_q, big_k, big_v, mask=None, backend="cpu", bias=jnp.zeros((512, 512))).implementation
        == "xla"
    )


def test_errors_name_the_argument():
    q, k, v = qkv((T, 2, 8), s=S)
    # an array bias is supported since issue #20 item 12; a wrongly shaped one is named
    with pytest.raises(ValueError, match=r"bias of shape \(3, \d+\) does not broadcast"):
        attnlab.attention(q, k, v, bias=jnp.zeros((3, S)), implementation="blockwise")
    with pytest.raises(ValueError, match="score"):
        attnlab.attention(q, k, v, score=lambda q, k: attnlab.scores.dot_product(q, k), implementation="blockwise")
    with pytest.raises(ValueError, match="block_q"):
        kernels.BlockSizes(0, 16)
    with pytest.raises(ValueError, match="mask"):
        attnlab.attention(q, k, v, mask=np.ones((3, T, S), bool), implementation="blockwise")


def test_memory_is_linear_in_length():
    """Compiled fwd+bwd temp memory grows ~linearly (x4 for 4x N), far from quadratic (x16)."""

    def temp_bytes(n):
        q = jax.ShapeDtypeStruct((1, n, 2, 64), jnp.float32)

        def loss(q, k, v):
            return jnp.sum(kernels.blockwise_attention(q, k, v, mask=masks.causal()))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(1024), temp_bytes(4096)
    dense_large = 4096 * 4096 * 2 * 4  # one fp32 [N, T, S] array for 2 heads
    assert large < 6 * small, (small, large)
    assert large < dense_large / 4, (large, dense_large)


def test_t5_bias_table_gets_gradients():
    # attnlab.positional's learnable T5 bias is a callable pytree: its table must receive gradients
    from attnlab import positional

    q, k, v = qkv((T, 4, 8), s=S, seed=12)
    scheme = positional.T5(num_buckets=8, max_distance=16, stddev=1.0)
    t5 = scheme.bias(4, scheme.init(jax.random.key(1), num_heads=4))
    mask = masks.window(9, 4)

    def loss(table, impl):
        out = attnlab.attention(q, k, v, mask=mask, bias=dataclasses.replace(t5, table=table), implementation=impl)
        return jnp.sum(out * jnp.sin(out))

    g = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (val, grad), (val_r, grad_r) = g(t5.table, "blockwise"), g(t5.table, "reference")
    compare(val, val_r, tol(jnp.float32))
    compare(grad, grad_r, grad_tol(jnp.float32))
    assert np.abs(np.asarray(grad)).sum() > 0


@pytest.mark.parametrize(
    "make_mask",
    [
        lambda: masks.chunks(8),
        lambda: masks.dilated(12, 4, 3),
        lambda: masks.window(2, 2) | masks.global_tokens([0, 17]),
        lambda: masks.bigbird(40, block_size=8, num_global=1, num_random=1, seed=3),
    ],
    ids=["chunks", "dilated", "window_global", "bigbird"],
)
def test_sparse_family_masks(make_mask):
    # main's structured sparse masks: their layouts let the kernel skip tiles; results must not change
    mask = make_mask()
    q, k, v = qkv((40, 2, 8), s=40, seed=13)
    fast = functools.partial(kernels.blockwise_attention, mask=mask, block_sizes=SMALL)
    ref = functools.partial(attnlab.attention_reference, mask=mask)
    (out, grads), (out_r, grads_r) = fwd_and_grads(fast, q, k, v), fwd_and_grads(ref, q, k, v)
    compare(out, out_r, tol(jnp.float32))
    for g, g_r in zip(grads, grads_r, strict=True):
        compare(g, g_r, grad_tol(jnp.float32))


def test_traced_document_ids_skip_tiles_at_run_time_without_retracing():
    """Packed documents with ids (and lengths) traced: one trace for new ids, the reference's values and
    gradients, and the schedule built on device visits only the tiles the ids make non-empty."""
    import chex  # noqa: PLC0415

    T = 200
    q, k, v = qkv((2, T, 4, 8), kv_heads=2, seed=9)
    bs = kernels.BlockSizes(16, 32)

    def mask(ids, lengths):
        return masks.document(ids, padding_id=99) & masks.causal() & masks.padding(kv_lengths=lengths)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(q, k, v, ids, lengths):
        return fwd_and_grads(
            lambda q, k, v: kernels.blockwise_attention(q, k, v, mask=mask(ids, lengths), block_sizes=bs), q, k, v
        )

    rng = np.random.default_rng(0)
    for _ in range(3):
        cuts = np.sort(rng.choice(np.arange(1, T), 6, replace=False))
        row = np.searchsorted(cuts, np.arange(T), side="right").astype(np.int32)
        ids = np.stack([row, np.where(np.arange(T) < 170, row, 99)])
        lengths = rng.integers(100, T + 1, (2,)).astype(np.int32)
        out, grads = run(q, k, v, ids, lengths)
        ref = functools.partial(attnlab.attention_reference, mask=mask(ids, lengths))
        out_r, grads_r = fwd_and_grads(ref, q, k, v)
        compare(out, out_r, tol(jnp.float32))
        for g, g_r in zip(grads, grads_r, strict=True):
            compare(g, g_r, grad_tol(jnp.float32))
    # the on-device schedule lists every tile the ids make non-empty (safe) and skips most of the rest
    nq, nk = -(-T // 16), -(-T // 32)
    static = np.full((nq, nk), masks.PARTIAL, np.int32)
    static = np.where(masks.causal().block_layout(T, T, 16, 32) == masks.EMPTY, masks.EMPTY, static)
    runtime = jax.jit(lambda i, ln: mask(i, ln).runtime_layout(T, T, 16, 32))(ids, lengths)
    sc = kernels.Schedule(static, T, 32, runtime=runtime)
    index, count = np.asarray(sc.index), np.asarray(sc.counts).sum(1)
    exact = mask(ids, lengths).block_layout(T, T, 16, 32)
    for i in range(nq):
        listed = set(index[i, : int(count[i])].tolist())
        assert set(np.nonzero(exact[i])[0].tolist()) <= listed <= set(np.nonzero(static[i])[0].tolist())
    visited, nonempty, scheduled = int(count.sum()), int((exact != masks.EMPTY).sum()), int((static != 0).sum())
    assert visited <= nonempty + nq < scheduled  # at most one extra tile per row (the AND of safe layouts)


@pytest.mark.parametrize("T", [33, 64, 100])
def test_graph_and_padding_closed_over_under_jit(T):
    # issue 41: with adj and lens closed over (constants) under jit, the graph built inside the trace is traced
    # while the padding lengths stay concrete; the plan asked the abstract (all-traced) copy of the mask for a
    # runtime layout that the mask itself does not give ('NoneType' object has no attribute 'astype').
    rng = np.random.default_rng(T)
    adj = jnp.asarray(rng.random((T, T)) < 0.2)
    lens = jnp.asarray([T - 3])
    q = jnp.asarray(rng.normal(size=(1, T, 2, 8)), jnp.float32)

    def run(impl, q):
        m = masks.graph(adj, self_loops=True) & masks.padding(kv_lengths=lens)
        return attnlab.attention(q, q, q, mask=m, implementation=impl)

    out = jax.jit(lambda q: run("blockwise", q))(q)
    assert_close(out, run("reference", q), jnp.float32)
