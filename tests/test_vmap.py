"""vmap of an unbatched call == a Python loop of unbatched reference calls, for every mask kind.

Equinox's habit: write the function for one example and let ``jax.vmap`` add the batch. Here each
case builds its mask *inside* the vmapped function from per-example data (lengths, adjacency,
edge lists) or closes over a structural mask, and the expected value is an explicit loop over the
batch calling ``attnlab.attention_reference`` on one example at a time with concrete inputs, here
through the default choice (every registered implementation, gradients included: tests/conformance.py).
The same holds for the heads functions, ``multi_head_attention`` (over inputs and over stacked params)
and the NNX ``MultiHeadAttention`` module.

Shapes are tiny (B=3, T=S=8) so the whole file runs in seconds.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import qkv, tol
from flax import nnx

import attnlab
from attnlab import masks
from attnlab.nn import MultiHeadAttention

B, T, N, H = 3, 8, 2, 4
RNG = np.random.default_rng(0)
LENGTHS = np.array([8, 3, 0], np.int32)  # a full row, a short one, an empty one (output zeros)
ADJ = RNG.random((B, T, T)) < 0.35  # one graph per example; some rows are empty
E = 10
SENDERS = np.stack([RNG.choice(T * T, E, replace=False) for _ in range(B)])  # distinct edges per example
RECEIVERS, SENDERS = SENDERS // T, SENDERS % T  # edge e: receiver r attends to sender s
DENSE = RNG.random((B, T, T)) < 0.5


def _structural(mask):
    """A mask that holds no per-example data: the same for every b."""
    return lambda b_data: mask


# Each case: name -> (per-example data [B, ...] or None, data_b -> Mask). The constructor is called
# with traced data under vmap and with concrete numpy data in the reference loop.
CASES = {
    "full": (None, _structural(masks.full())),
    "causal": (None, _structural(masks.causal())),
    "window": (None, _structural(masks.window(2, 1))),
    "padding": (LENGTHS, lambda n: masks.padding(q_lengths=n, kv_lengths=n)),
    "padding_kv": (LENGTHS, lambda n: masks.padding(kv_lengths=n)),
    "chunks": (None, _structural(masks.chunks(3))),
    "dilated": (None, _structural(masks.dilated(4, 2, 2))),
    "global_tokens": (None, _structural(masks.window(0, 0) | masks.global_tokens([0, 5]))),
    "random_blocks": (None, _structural(masks.random_blocks(T, 2, 2, seed=3))),
    "bigbird": (None, _structural(masks.bigbird(T, block_size=2, window_blocks=3, num_global=1, num_random=1))),
    "graph": (ADJ, lambda a: masks.graph(a)),
    "graph_edges": ((SENDERS, RECEIVERS), lambda sr: masks.graph_edges(sr[0], sr[1], T)),
    "window_2d": (None, _structural(masks.window_2d(4, 1))),  # a 2 x 4 grid
    "dense_array": (DENSE, lambda d: masks.as_mask(d)),
    "causal_and_padding": (LENGTHS, lambda n: masks.causal() & masks.padding(kv_lengths=n)),
    "graph_or_window": (ADJ, lambda a: masks.graph(a) | masks.window(1, 0)),
    "chunks_and_padding_or_global": (
        LENGTHS,
        lambda n: (masks.chunks(4) & masks.padding(n, n)) | masks.global_tokens([1]),
    ),
}


def _take(data, b):
    return None if data is None else jax.tree.map(lambda a: a[b], data)


def _loop_reference(q, k, v, data, make_mask, **kw):
    """The expected value: one unbatched reference call per example, on concrete data."""
    outs = [
        attnlab.attention_reference(q[b], k[b], v[b], mask=make_mask(_take(data, b)), **kw) for b in range(q.shape[0])
    ]
    return jnp.stack(outs)


def _vmapped(fn, q, k, v, data, make_mask):
    def one(q, k, v, d):  # q [T, N, H]: one example
        return fn(q, k, v, mask=make_mask(d))

    in_axes = (0, 0, 0, None if data is None else 0)
    return jax.jit(jax.vmap(one, in_axes=in_axes))(q, k, v, data)


@functools.cache
def _expected(case):
    """The reference loop for a case on the shared inputs (computed once per case)."""
    data, make_mask = CASES[case]
    return _loop_reference(*qkv((B, T, N, H), seed=1), data, make_mask)


@pytest.mark.parametrize("case", list(CASES))
def test_attention_vmap_equals_reference_loop(case):
    """The default choice on every mask kind (each registered implementation, outputs and gradients, on the
    masks that carry per-example data: tests/conformance.py, test_vmap_of_unbatched_calls_equals_a_loop)."""
    data, make_mask = CASES[case]
    q, k, v = qkv((B, T, N, H), seed=1)
    out = _vmapped(attnlab.attention, q, k, v, data, make_mask)
    chex.assert_shape(out, (B, T, N, H))
    chex.assert_trees_all_close(out, _expected(case), **tol(jnp.float32))


def test_attention_weights_vmap_equals_loop():
    data, make_mask = CASES["graph_or_window"]
    q, k, _ = qkv((B, T, N, H), seed=5)
    got = jax.vmap(lambda q, k, a: attnlab.attention_weights(q, k, mask=make_mask(a)))(q, k, data)
    want = jnp.stack([attnlab.attention_weights(q[b], k[b], mask=make_mask(data[b])) for b in range(B)])
    chex.assert_shape(got, (B, N, T, T))
    chex.assert_trees_all_close(got, want, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Heads


def test_split_and_merge_heads_vmap_equal_loop():
    x = jax.random.normal(jax.random.key(0), (B, T, N * H))
    split = jax.vmap(lambda x: attnlab.split_heads(x, N))(x)
    chex.assert_shape(split, (B, T, N, H))
    chex.assert_trees_all_equal(split, jnp.stack([attnlab.split_heads(x[b], N) for b in range(B)]))
    merged = jax.vmap(attnlab.merge_heads)(split)
    chex.assert_trees_all_equal(merged, jnp.stack([attnlab.merge_heads(split[b]) for b in range(B)]))
    chex.assert_trees_all_equal(merged, x)  # merge inverts split
    # nested vmap over two leading dims equals the batched call on [2, B, T, N*H]
    x2 = jax.random.normal(jax.random.key(1), (2, B, T, N * H))
    nested = jax.vmap(jax.vmap(lambda x: attnlab.split_heads(x, N)))(x2)
    chex.assert_trees_all_equal(nested, attnlab.split_heads(x2, N))


def _params(key, kv_heads=None, score="dot"):
    p = attnlab.init_multi_head_params(key, N * H, N, num_kv_heads=kv_heads, score=score)
    k2 = jax.random.fold_in(key, 1)
    return jax.tree.map(lambda a: a + 0.1 * jax.random.normal(k2, a.shape), p)  # non-zero biases


@pytest.mark.parametrize("score", ["dot", "additive"])
@pytest.mark.parametrize("kv_heads", [None, 1], ids=["mha", "mqa"])
def test_multi_head_attention_vmap_over_inputs_equals_loop(kv_heads, score):
    p = _params(jax.random.key(0), kv_heads, score)
    x = jax.random.normal(jax.random.key(1), (B, T, N * H))
    lens = jnp.asarray(LENGTHS)

    def one(x, n):  # x [T, D], one length
        return attnlab.multi_head_attention(p, x, mask=masks.padding(n, n) & masks.window(2, 2), score=score)

    got = jax.jit(jax.vmap(one))(x, lens)
    chex.assert_shape(got, (B, T, N * H))
    # reference loop: the matrix form on one example, attention_reference inside
    want = []
    for b in range(B):
        xb = x[b]
        q = attnlab.split_heads(xb @ p["wq"].reshape(N * H, -1) + p["bq"].reshape(-1), N)
        kh = p["wk"].shape[1]
        k = attnlab.split_heads(xb @ p["wk"].reshape(N * H, -1) + p["bk"].reshape(-1), kh)
        v = attnlab.split_heads(xb @ p["wv"].reshape(N * H, -1) + p["bv"].reshape(-1), kh)
        s = "dot" if score == "dot" else functools.partial(attnlab.scores.additive, w=p["w_score"])
        mask = masks.padding(LENGTHS[b], LENGTHS[b]) & masks.window(2, 2)
        o = attnlab.attention_reference(q, k, v, mask=mask, score=s)
        want.append(attnlab.merge_heads(o) @ p["wo"].reshape(N * H, -1) + p["bo"])
    chex.assert_trees_all_close(got, jnp.stack(want), atol=1e-4, rtol=1e-4)


def test_multi_head_attention_vmap_over_params_equals_loop():
    # An ensemble: stacked params [E, ...] vmapped against one shared input.
    ps = [_params(jax.random.key(i)) for i in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ps)
    x = jax.random.normal(jax.random.key(9), (T, N * H))
    got = jax.vmap(lambda p: attnlab.multi_head_attention(p, x, mask=masks.causal()), in_axes=(0,))(stacked)
    want = jnp.stack([attnlab.multi_head_attention(p, x, mask=masks.causal(), implementation="reference") for p in ps])
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_nnx_multi_head_attention_vmap_equals_loop():
    mha = MultiHeadAttention(N * H, N, num_kv_heads=1, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, T, N * H))
    adj = jnp.asarray(ADJ)
    got = jax.vmap(lambda x, a: mha(x, mask=masks.graph(a)))(x, adj)
    p = mha.params()
    want = jnp.stack(
        [attnlab.multi_head_attention(p, x[b], mask=masks.graph(ADJ[b]), implementation="reference") for b in range(B)]
    )
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    # and vmapped weights: rows of an empty graph row are all zero
    _, w = jax.vmap(lambda x, a: mha(x, mask=masks.graph(a), return_weights=True))(x, adj)
    chex.assert_shape(w, (B, N, T, T))
    np.testing.assert_array_equal(np.asarray(w)[~np.broadcast_to(ADJ[:, None].any(-1, keepdims=True), w.shape)], 0.0)
