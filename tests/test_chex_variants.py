"""jit / no-jit variants through ``chex.variants`` and recompilation checks through ``chex.assert_max_traces``.

Each variant test runs the same body eagerly and under ``jax.jit`` through the default choice
(``implementation=None``) and compares against float64 numpy or the dense reference. The trace tests
pin that array *values* (lengths, adjacency, params, biases) are data: a new value must not be a new
program. Every registered implementation, eager and jitted, with the same trace checks, is
tests/conformance.py (``test_eager_matches_numpy``, ``test_new_data_values_reuse_the_program``).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized
from conftest import grad_tol, np_attention, qkv, tol

import attnlab
from attnlab import masks

T, S = 6, 8
LENS = jnp.array([8, 3])
MASKS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(offset=S - T),
    "window": lambda: masks.window(2, 1),
    "padding": lambda: masks.padding(q_lengths=jnp.array([6, 2]), kv_lengths=LENS),
    "graph": lambda: masks.graph(np.random.default_rng(0).random((T, S)) < 0.4),
    "chunks": lambda: masks.chunks(3),
    "combined": lambda: (masks.causal(S - T) & masks.padding(kv_lengths=LENS)) | masks.window(0, 0),
}


class AttentionVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*MASKS)
    def test_matches_numpy(self, mask_kind):
        q, k, v = qkv((2, T, 4, 8), s=S, kv_heads=2, seed=1)
        mask = MASKS[mask_kind]()
        out = self.variant(attnlab.attention)(q, k, v, mask=mask)
        chex.assert_shape(out, (2, T, 4, 8))
        chex.assert_type(out, jnp.float32)
        dense = None if mask is None else np.asarray(mask.dense(T, S))
        chex.assert_trees_all_close(out, np_attention(q, k, v, mask=dense)[0], **tol(jnp.float32))

    @chex.variants(with_jit=True, without_jit=True)
    def test_grads_match_reference(self):
        q, k, v = qkv((2, T, 2, 4), s=S, seed=2)
        mask = MASKS["combined"]()

        def loss(fn):
            return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, mask=mask)))

        got = self.variant(jax.grad(loss(attnlab.attention), argnums=(0, 1, 2)))(q, k, v)
        want = jax.grad(loss(attnlab.attention_reference), argnums=(0, 1, 2))(q, k, v)
        chex.assert_trees_all_close(got, want, **grad_tol(jnp.float32))
        chex.assert_trees_all_equal_shapes(got, (q, k, v))

    @chex.variants(with_jit=True, without_jit=True)
    def test_split_merge_heads(self):
        x = jnp.arange(2 * 3 * 12.0).reshape(2, 3, 12)
        h = self.variant(attnlab.split_heads, static_argnums=1)(x, 4)
        chex.assert_shape(h, (2, 3, 4, 3))
        chex.assert_trees_all_equal(h[1, 2, 3], x[1, 2, 9:12])  # head 3 = features 9..11
        chex.assert_trees_all_equal(self.variant(attnlab.merge_heads)(h), x)

    @chex.variants(with_jit=True, without_jit=True)
    def test_multi_head_attention_matches_reference_path(self):
        p = attnlab.init_multi_head_params(jax.random.key(0), 8, 2, num_kv_heads=1)
        x = jax.random.normal(jax.random.key(1), (2, 5, 8))
        lens = jnp.array([5, 2])
        got = self.variant(lambda p, x, n: attnlab.multi_head_attention(p, x, mask=masks.padding(n, n)))(p, x, lens)
        chex.assert_shape(got, (2, 5, 8))
        want = attnlab.multi_head_attention(p, x, mask=masks.padding(lens, lens), implementation="reference")
        chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


class NoRecompileTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        chex.clear_trace_counter()

    def _check_one_trace(self, fn, *argsets):
        traced = jax.jit(chex.assert_max_traces(fn, n=1))
        outs = [traced(*args) for args in argsets]  # a second trace raises AssertionError
        self.assertFalse(np.allclose(outs[0], outs[1]))  # the values did reach the program
        return outs

    def test_padding_lengths_are_data(self):
        q, k, v = qkv((2, T, 2, 4), s=S)

        def f(q, k, v, lens):
            return attnlab.attention(q, k, v, mask=masks.padding(kv_lengths=lens) & masks.causal(S - T))

        self._check_one_trace(f, (q, k, v, jnp.array([3, 8])), (q, k, v, jnp.array([8, 1])))

    def test_mask_object_values_are_data(self):
        q, k, v = qkv((2, T, 2, 4), s=S)
        m1 = masks.padding(kv_lengths=jnp.array([3, 8])) & masks.window(2, 2)
        m2 = masks.padding(kv_lengths=jnp.array([7, 2])) & masks.window(2, 2)
        self._check_one_trace(lambda q, k, v, m: attnlab.attention(q, k, v, mask=m), (q, k, v, m1), (q, k, v, m2))

    def test_graph_adjacency_is_data(self):
        q, k, v = qkv((T, 2, 4), s=T)
        rng = np.random.default_rng(1)
        a1, a2 = (jnp.asarray(rng.random((T, T)) < 0.5) for _ in range(2))
        self._check_one_trace(
            lambda q, k, v, a: attnlab.attention(q, k, v, mask=masks.graph(a)),
            (q, k, v, a1),
            (q, k, v, a2),
        )

    def test_graph_edges_are_data(self):
        q, k, v = qkv((T, 2, 4), s=T)

        def f(q, k, v, snd, rcv):
            return attnlab.attention(q, k, v, mask=masks.graph_edges(snd, rcv, T))

        e1 = (jnp.array([0, 1, 2, 3]), jnp.array([1, 2, 3, 4]))
        e2 = (jnp.array([5, 4, 0, 0]), jnp.array([0, 0, 1, 5]))
        self._check_one_trace(f, (q, k, v, *e1), (q, k, v, *e2))

    def test_bias_values_are_data(self):
        q, k, v = qkv((2, T, 2, 4), s=S)
        b1 = jax.random.normal(jax.random.key(0), (2, T, S))
        self._check_one_trace(
            lambda q, k, v, b: attnlab.attention(q, k, v, bias=b), (q, k, v, b1), (q, k, v, 3.0 * b1[::-1])
        )

    def test_multi_head_params_are_data(self):
        x = jax.random.normal(jax.random.key(1), (2, 5, 8))
        p1 = attnlab.init_multi_head_params(jax.random.key(0), 8, 2)
        p2 = attnlab.init_multi_head_params(jax.random.key(1), 8, 2)
        self._check_one_trace(lambda p, x: attnlab.multi_head_attention(p, x, mask=masks.causal()), (p1, x), (p2, x))

    def test_new_structure_is_a_new_trace(self):
        # The check above can fail: a new window size is static structure and must retrace.
        q, k, v = qkv((T, 2, 4), s=S)
        traced = jax.jit(chex.assert_max_traces(lambda q, k, v, m: attnlab.attention(q, k, v, mask=m), n=1))
        traced(q, k, v, masks.window(1, 1))
        with self.assertRaises(AssertionError):
            traced(q, k, v, masks.window(2, 1))
