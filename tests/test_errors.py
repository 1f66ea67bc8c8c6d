"""Bad input raises ValueError naming the argument and what was expected."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import qkv

import attnlab
from attnlab import masks, scores

q, k, v = qkv((2, 4, 4, 8), s=5, kv_heads=2)


@pytest.mark.parametrize(
    "call, match",
    [
        # q/k/v rank and head-dim mismatch
        (lambda: attnlab.attention(q[0, 0], k, v), r"q must have shape \[\.\.\., T, N, H\]"),
        (lambda: attnlab.attention(q, k[..., :4], v), r"same head dim H"),
        (lambda: attnlab.attention(q, k, v[:, :3]), r"v must match k"),
        (lambda: attnlab.attention(q[0], k, v), r"same batch dims"),
        (lambda: attnlab.attention(q, k, v.astype(jnp.bfloat16)), r"same dtype"),
        (lambda: attnlab.attention(q.astype(jnp.int32), k, v), r"q must be floating point"),
        # N not divisible by K
        (lambda: attnlab.attention(q[..., :3, :], k, v), r"N=3 must be a multiple of key heads K=2"),
        # masks and biases that do not broadcast
        (lambda: attnlab.attention(q, k, v, mask=np.ones((4, 4), bool)), r"mask array of shape \(4, 4\)"),
        (lambda: attnlab.attention(q, k, v, mask=np.ones((3, 4, 4, 5), bool)), r"mask of shape"),
        (
            lambda: attnlab.attention(q, k, v, mask=masks.padding(kv_lengths=jnp.array([1, 2, 3]))),
            r"mask of shape \(3, 1, 4, 5\) does not broadcast",
        ),
        (lambda: attnlab.attention(q, k, v, bias=jnp.zeros((4, 4))), r"bias of shape \(4, 4\)"),
        (
            lambda: attnlab.attention(q, k, v, bias=jnp.zeros((2, 4, 4, 5), jnp.int32)),
            r"bias must be floating",
        ),
        # non-bool mask arrays
        (lambda: attnlab.attention(q, k, v, mask=np.ones((4, 5))), r"mask must be a bool array"),
        (lambda: attnlab.attention(q, k, v, mask="causal"), r"mask must be a Mask"),
        # scores and implementations
        (lambda: attnlab.attention(q, k, v, score="additive"), r"partial\(attnlab.scores.additive"),
        (lambda: attnlab.attention(q, k, v, score="cosine"), r"score must be 'dot' or a callable"),
        (lambda: attnlab.attention(q, k, v, implementation="flash"), r"implementation must be one of"),
        (
            lambda: attnlab.attention(q, k, v, score=lambda q, k: scores.dot_product(q, k), implementation="xla"),
            r"'xla' supports score='dot' only",
        ),
        (
            lambda: attnlab.attention(q, k, v, score=lambda q, k: jnp.zeros((4, 5))),
            r"must return \[\.\.\., N, T, S\]",
        ),
        (
            lambda: attnlab.attention(q, k, v, score=lambda q, k: scores.dot_product(q, k), scale=2.0),
            r"scale applies to score='dot' only",
        ),
        # additive w of the wrong shape
        (lambda: scores.additive(q, k, jnp.ones((2, 8))), r"w must have shape \[N, H\] = \[4, 8\]"),
        (
            lambda: attnlab.attention(q, k, v, score=functools.partial(scores.additive, w=jnp.ones(7))),
            r"w must have shape",
        ),
        # negative window, bad ints
        (lambda: masks.window(-1, 2), r"left must be >= 0"),
        (lambda: masks.window(1, -2), r"right must be >= 0"),
        (lambda: masks.window(1.5, 2), r"left must be a Python int"),
        (lambda: masks.causal(offset=0.5), r"offset must be a Python int"),
        # padding
        (lambda: masks.padding(), r"needs q_lengths, kv_lengths"),
        (lambda: masks.padding(kv_lengths=np.array([1.0])), r"kv_lengths must be an integer array"),
        (lambda: masks.padding(q_lengths=np.array([-1])), r"q_lengths must be >= 0"),
        (lambda: masks.padding(np.array([1, 2]), np.array([1])), r"same batch shape"),
        # adjacency: non-bool, non-square (self-loops), wrong size
        (lambda: masks.graph(np.ones((3, 3))), r"adjacency must be a bool array"),
        (lambda: masks.graph(np.ones(3, bool)), r"adjacency must be \[T, S\]"),
        (lambda: masks.graph(np.ones((3, 4), bool), self_loops=True), r"adjacency must be square"),
        (lambda: masks.with_self_loops(np.ones((3, 4), bool)), r"adjacency must be square"),
        (
            lambda: attnlab.attention(q, k, v, mask=masks.graph(np.ones((3, 3), bool))),
            r"adjacency is 3x3 but attention is 4x5",
        ),
        # edge lists: out of range, mismatched, wrong rank
        (lambda: masks.graph_edges([0, 5], [1, 2], 5), r"senders has node indices outside \[0, 5\)"),
        (lambda: masks.graph_edges([0, 1], [1, -1], 5), r"receivers has node indices outside"),
        (lambda: masks.graph_edges([0, 1], [1], 5), r"same length"),
        (lambda: masks.graph_edges([[0, 1]], [[1, 0]], 5), r"senders must be a 1-D int array"),
        (lambda: masks.graph_edges([0.0], [1.0], 5), r"senders must be an integer array"),
        (lambda: masks.graph_edges([0], [1], 0), r"num_nodes must be >= 1"),
        (
            lambda: attnlab.attention(q, k, v, mask=masks.graph_edges([0], [1], 4)),
            r"num_nodes=4 but attention is 4x5",
        ),
        # block layouts
        (lambda: masks.causal().block_layout(8, 8, 0, 4), r"block_q must be a positive int"),
        (lambda: masks.causal().dense(-1, 4), r"T must be a non-negative int"),
        # heads
        (lambda: attnlab.split_heads(jnp.ones((3, 10)), 4), r"divisible by num_heads=4"),
        (lambda: attnlab.split_heads(jnp.ones((3, 8)), 0), r"num_heads must be a positive int"),
        (lambda: attnlab.merge_heads(jnp.ones((3, 8))), r"x must have shape \[\.\.\., T, N, H\]"),
        (lambda: attnlab.init_multi_head_params(None, 10, 4), r"d_model=10 is not divisible by num_heads=4"),
        (lambda: attnlab.init_multi_head_params(None, 8, 4, num_kv_heads=3), r"multiple of num_kv_heads=3"),
        (
            lambda: attnlab.init_multi_head_params(None, 8, 4, score="cos"),
            r"score must be 'dot' or 'additive'",
        ),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_multi_head_attention_bad_inputs():
    import jax

    p = attnlab.init_multi_head_params(jax.random.key(0), 8, 2)
    with pytest.raises(ValueError, match=r"x_q has width 6 but params expect 8"):
        attnlab.multi_head_attention(p, jnp.ones((3, 6)))
    with pytest.raises(ValueError, match=r"same batch dims"):
        attnlab.multi_head_attention(p, jnp.ones((2, 3, 8)), jnp.ones((3, 3, 8)))
    with pytest.raises(ValueError, match=r"needs params\['w_score'\]"):
        attnlab.multi_head_attention(p, jnp.ones((3, 8)), score="additive")
