"""One conformance suite for every attention implementation (``attnlab.impls``).

Each implementation's test class subclasses ``Conformance`` and names the implementation; the
cases below (every mask kind, GQA, odd lengths, empty rows, fp32 and bf16, jit and vmap, the lse and
dropout where the implementation's ``features`` say so) are filtered by the implementation's own
``supports(call, backend)``: a case it does not take is skipped with its reason. Outputs and
gradients of q, k and v are compared with ``attention_reference`` on the same bound call.

A new implementation gets the whole suite by adding one subclass to ``tests/test_conformance.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare, fwd_and_grads, grad_tol, qkv, tol

import attnlab
from attnlab import dispatch, masks, scores
from attnlab.call import bind

# Odd lengths (no multiple of any tile): short last blocks everywhere. Square cases for graphs.
T, S, SQ = 37, 45, 36
B, N, K, H = 2, 4, 2, 8  # GQA: 4 query heads share 2 kv heads


def _graph(t, s, seed=0):
    return np.random.default_rng(seed).random((t, s)) < 0.15


def _edges():
    adj = _graph(SQ, SQ, 3)
    receivers, senders = np.nonzero(adj)
    return masks.graph_edges(senders, receivers, SQ)


def _same_doc(q, k, ids):
    return (ids[..., q] == ids[..., k])[..., None, :, :]


# name -> ((T, S), mask factory)
CASES = {
    "none": ((T, S), lambda: None),
    "full": ((T, S), masks.full),
    "causal": ((T, S), lambda: masks.causal(offset=S - T)),
    "window": ((T, S), lambda: masks.window(5, 3)),
    "left_window": ((T, S), lambda: masks.window(6, 0)),
    "padding": ((T, S), lambda: masks.padding(q_lengths=jnp.array([30, 37]), kv_lengths=jnp.array([45, 10]))),
    "causal_padding": ((T, S), lambda: masks.causal(offset=S - T) & masks.padding(kv_lengths=jnp.array([20, 45]))),
    "empty_rows": ((T, S), lambda: masks.window(2, 0) & masks.padding(q_lengths=jnp.array([0, 20]))),
    "chunks": ((T, S), lambda: masks.chunks(8)),
    "prefix_lm": ((T, S), lambda: masks.prefix_lm(jnp.array([5, 40]))),
    "document": ((SQ, SQ), lambda: masks.document(np.array([[0] * 10 + [1] * 20 + [2] * 6, [0] * 36]))),
    "document_causal_pad": (
        (SQ, SQ),
        lambda: (
            masks.document(np.array([[0] * 10 + [1] * 20 + [7] * 6, [4] * 30 + [7] * 6]), padding_id=7) & masks.causal()
        ),
    ),
    "combined": (
        (T, S),
        lambda: (masks.causal(offset=S - T) & masks.padding(kv_lengths=jnp.array([20, 45]))) | masks.window(0, 0),
    ),
    "predicate": (
        (SQ, SQ),
        lambda: masks.predicate(_same_doc, np.array([[0] * 12 + [1] * 24, [0] * 30 + [1] * 6])) & masks.window(8, 8),
    ),
    "graph": ((SQ, SQ), lambda: masks.graph(_graph(SQ, SQ))),
    "graph_edges": ((SQ, SQ), _edges),
    "window_2d": ((SQ, SQ), lambda: masks.window_2d(6, 1)),
    "array": ((T, S), lambda: np.random.default_rng(1).random((B, 1, T, S)) < 0.5),
}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def _pair_table(s, q_idx, k_idx, table, ids):
    """A Graphormer-style per-pair term: a learned table [N, 3] indexed by an integer relation of (t, s)."""
    rel = jnp.clip(ids[q_idx] - ids[k_idx], -1, 1) + 1  # q_idx [t, 1], k_idx [1, s] -> [t, s] in {0, 1, 2}
    return s + table[:, rel]  # [N, t, s] broadcast over the leading dims


# name -> () -> (score, extra kwargs); each score's arrays get gradients, compared with the reference's
SCORE_CASES = {
    "softcap": lambda: (scores.SoftCap(2.0), {}),
    "softcap_bias": lambda: (scores.SoftCap(2.0), dict(bias=lambda qi, ki: -0.1 * jnp.abs(qi[:, None] - ki))),
    "alibi_mod": lambda: (scores.ScoreMod(scores.alibi_mod, jnp.array([0.5, 0.25, 0.125, 0.0625])), {}),
    "pair_table_mod": lambda: (
        scores.ScoreMod(
            _pair_table,
            jnp.array([[1.0, -2.0, 0.5], [0.0, 1.0, 3.0], [-1.0, 0.0, 1.0], [2.0, 2.0, -2.0]]),
            jnp.asarray(np.random.default_rng(2).integers(0, 5, max(T, S, SQ)), jnp.int32),
            head_axes=(0, None),  # the table is per head, the ids are shared
        ),
        {},
    ),
    "additive": lambda: (scores.Additive(jax.random.normal(jax.random.key(9), (N, H))), {}),
}


class Conformance:
    """Subclass with ``IMPL`` (a name in ``attnlab.IMPLEMENTATIONS``); override ``BACKEND`` / ``run``."""

    IMPL: str = ""
    BACKEND: str = "cpu"  # the backend whose ``supports`` decides (the kernel runs here, on the CPU)

    def impl(self):
        return dispatch.IMPLEMENTATIONS[self.IMPL]

    def run(self, call):
        """The implementation on a bound call (a CPU stand-in where the kernel needs another chip)."""
        return self.impl().run(call)

    def _call(self, q, k, v, **kw):
        return bind(q, k, v, **kw)

    def _supported_or_skip(self, call):
        why = self.impl().supports(call, self.BACKEND)
        if why is not None:
            pytest.skip(f"{self.IMPL} on {self.BACKEND}: {why}")

    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference_fwd_and_grad(self, case, dtype):
        (t, s), make = CASES[case]
        dt = DTYPES[dtype]
        q, k, v = qkv((B, t, N, H), s=s, kv_heads=K, dtype=dt)
        mask = make()
        self._supported_or_skip(self._call(q, k, v, mask=mask))

        def fast(q, k, v):
            return self.run(self._call(q, k, v, mask=mask))

        def ref(q, k, v):
            return attnlab.attention_reference(q, k, v, mask=mask)

        out, grads = fwd_and_grads(fast, q, k, v)
        out_r, grads_r = fwd_and_grads(ref, q, k, v)
        assert out.shape == (B, t, N, H) and out.dtype == dt
        compare(out, out_r, tol(dt))
        for g, g_r in zip(grads, grads_r, strict=True):
            assert g.dtype == dt
            assert np.isfinite(np.asarray(g, np.float32)).all()
            compare(g, g_r, grad_tol(dt))
        if case == "empty_rows":  # batch 0 has no valid query: zeros, and no gradient flows from them
            assert not np.asarray(out[0], np.float32).any()

    def test_vmap_of_unbatched_call_under_jit(self):
        q, k, v = qkv((B, T, N, H), s=S, kv_heads=K, seed=3)
        mask = masks.causal(offset=S - T)
        self._supported_or_skip(self._call(q[0], k[0], v[0], mask=mask))
        out = jax.jit(jax.vmap(lambda q, k, v: self.run(self._call(q, k, v, mask=mask))))(q, k, v)
        compare(out, attnlab.attention_reference(q, k, v, mask=mask), tol(jnp.float32))

    def test_value_head_dim_and_no_batch_dims(self):
        q, k, v = qkv((T, N, H), s=S, kv_heads=K, hv=5, seed=4)
        call = self._call(q, k, v, mask=masks.causal(offset=S - T))
        self._supported_or_skip(call)
        compare(self.run(call), attnlab.attention_reference(q, k, v, mask=call.mask), tol(jnp.float32))

    def test_lse(self):
        if "lse" not in self.impl().features:
            pytest.skip(f"{self.IMPL} has no 'lse' feature")
        q, k, v = qkv((B, T, N, H), s=S, kv_heads=K, seed=5)
        mask = masks.window(2, 0) & masks.padding(q_lengths=jnp.array([0, 30]))
        call = self._call(q, k, v, mask=mask, return_lse=True)
        self._supported_or_skip(call)
        (out, lse), (out_r, lse_r) = self.run(call), attnlab.attention_reference(q, k, v, mask=mask, return_lse=True)
        compare(out, out_r, tol(jnp.float32))
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_r))  # -inf exactly on the empty rows
        finite = np.isfinite(lse_r)
        compare(np.asarray(lse)[finite], np.asarray(lse_r)[finite], tol(jnp.float32))

    def test_dropout_draws_the_reference_mask(self):
        if "dropout" not in self.impl().features:
            pytest.skip(f"{self.IMPL} has no 'dropout' feature")
        q, k, v = qkv((B, T, N, H), s=S, kv_heads=K, seed=6)
        kw = dict(mask=masks.causal(offset=S - T), dropout_rate=0.3, dropout_key=jax.random.key(11))
        call = self._call(q, k, v, **kw)
        self._supported_or_skip(call)
        out, grads = fwd_and_grads(lambda q, k, v: self.run(self._call(q, k, v, **kw)), q, k, v)
        out_r, grads_r = fwd_and_grads(lambda q, k, v: attnlab.attention_reference(q, k, v, **kw), q, k, v)
        compare(out, out_r, tol(jnp.float32))
        for g, g_r in zip(grads, grads_r, strict=True):
            compare(g, g_r, grad_tol(jnp.float32))

    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("mask_case", ["causal", "empty_rows", "document"])
    @pytest.mark.parametrize("score_case", list(SCORE_CASES))
    def test_scores(self, score_case, mask_case, dtype):
        """Scores with a tile form: outputs and gradients (q, k, v and the score's own arrays) = the reference."""
        (t, s), make = CASES[mask_case]
        dt = DTYPES[dtype]
        q, k, v = qkv((B, t, N, H), s=s, kv_heads=K, dtype=dt, seed=8)
        q = q * 4.0  # large logits, so a cap matters
        score, kw = SCORE_CASES[score_case]()
        mask = make()
        self._supported_or_skip(self._call(q, k, v, mask=mask, score=score, **kw))

        def run(fn):
            return fwd_and_grads(lambda q, k, v, sc: fn(q, k, v, mask=mask, score=sc, **kw), q, k, v, score)

        out, grads = run(lambda q, k, v, **a: self.run(self._call(q, k, v, **a)))
        out_r, grads_r = run(attnlab.attention_reference)
        compare(out, out_r, tol(dt))
        for g, g_r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_r), strict=True):
            if g_r.dtype == jax.dtypes.float0:  # an integer array of the score (ids): no gradient
                assert g.dtype == jax.dtypes.float0
                continue
            assert np.isfinite(np.asarray(g, np.float32)).all()
            # the computation's precision decides: a bf16 call gives its fp32 arrays' gradients (sums over
            # every logit of a bf16-rounded ds) to bf16 precision; kernels that round in another order differ
            compare(g, g_r, grad_tol(dt))
        if mask_case == "empty_rows":
            assert not np.asarray(out[0], np.float32).any()
        plain = attnlab.attention_reference(q, k, v, mask=mask, bias=kw.get("bias"))
        assert not np.allclose(np.asarray(out_r, np.float32), np.asarray(plain, np.float32), atol=1e-2)
