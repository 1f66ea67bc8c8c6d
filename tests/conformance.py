"""One conformance base for every attention implementation (``attnlab.dispatch.IMPLEMENTATIONS``).

tokamax's habit: one test base that every implementation subclasses. Each class in
``tests/test_conformance.py`` names its implementation (``IMPL``; ``BACKEND`` and ``run`` where the
kernel needs another chip and runs a CPU stand-in here). Every test below binds a call, asks the
implementation whether it takes it (``dispatch.explain_call(call, implementation=IMPL)``: the
implementation's ``features`` and its own ``supports(call, backend)``) and either skips with that
reason, word for word, or runs it and compares it with an independent computation:

1. **Every mask family** (``CASES``: odd lengths, GQA, empty rows; fp32, bf16 and, for a few, fp16):
   outputs and ``jax.vjp`` gradients of q, k and v against ``attention_reference``, the output
   against float64 numpy (``np_attention``), and zeros (output and dq) on every row the mask leaves
   empty. The same masks with their data traced (passed to the jitted function).
2. **Scores** with a tile form (``SCORE_CASES``): outputs and the gradients of the score's arrays.
3. **Features**: the log-sum-exp and dropout, where ``features`` lists them.
4. **Conventions** (docs/conventions.md): zero-length inputs, empty rows of every kind in fp32 / bf16 /
   fp16, fp32 biases with half inputs, finfo.min and -inf biases, biases of every broadcast shape,
   out-of-range edges, rank-0/1 masks, tiny bf16 shapes, the scale, GQA, lead dims, vmap (gradients
   too), NaN visibility, eager = jit, trace counts (chex), float32 results under ``jax_enable_x64``.
5. **Regressions**: crashes found by fuzzing (issue 41); the edge list of ``graph_edges`` lists some
   edges twice (the sparse kernel counted a repeat twice, the reference once).

Tolerances come from ``attnlab.testing`` (the one table, through ``conftest.tol`` / ``grad_tol``).
A case an implementation takes but gets wrong today is listed in ``KNOWN_FAILURES`` with its
reason and runs as a strict xfail (it fails the suite the day it passes, so the entry goes).

A new implementation gets all of this by adding one subclass to ``tests/test_conformance.py``.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare, fwd_and_grads, grad_tol, np_attention, qkv, tol

import attnlab
from attnlab import dispatch, heads, masks, positional, scores
from attnlab.call import bind

# Odd lengths (no multiple of any tile): short last blocks everywhere. Square cases for graphs.
T, S, SQ = 37, 45, 36
B, N, K, H = 2, 4, 2, 8  # GQA: 4 query heads share 2 kv heads
FMIN = float(np.finfo(np.float32).min)
_RNG = np.random.default_rng(0)
_PER_HEAD = _RNG.random((N, SQ, SQ)) < 0.7  # a bool mask [N, T, S] that differs per head


def _graph(t, s, seed=0):
    return np.random.default_rng(seed).random((t, s)) < 0.15


def _isolated(adj, rows):
    """adj with the given rows emptied: nodes with no neighbour (empty rows)."""
    adj = np.array(adj)
    adj[..., rows, :] = False
    return adj


_GRAPHS = _isolated(_RNG.random((B, SQ, SQ)) < 0.1, [5])  # one graph per example, node 5 isolated in each


def _edges():
    adj = _isolated(_graph(SQ, SQ, 3), [0, 1, 2, 3])  # nodes 0-3 receive nothing
    receivers, senders = np.nonzero(adj)
    # every 9th edge listed again: an edge counts once however often it is listed (found by fuzzing, issue 41)
    return masks.graph_edges(np.r_[senders, senders[::9]], np.r_[receivers, receivers[::9]], SQ)


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
    "chunks_or_global": ((T, S), lambda: masks.chunks(12) | masks.global_tokens([0])),
    "bigbird": ((SQ, SQ), lambda: masks.bigbird(SQ, block_size=6, num_random=1)),
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
    "graph": ((SQ, SQ), lambda: masks.graph(_isolated(_graph(SQ, SQ), [5]))),
    # a graph per example and a mask per head: bitmaps [B, N, ...]
    "graph_per_example_and_head": (
        (SQ, SQ),
        lambda: masks.graph(_GRAPHS) & masks.as_mask(_PER_HEAD),
    ),
    # one graph for every example, a mask per head (what a TPU splash mask can hold)
    "graph_and_per_head": ((SQ, SQ), lambda: masks.graph(_isolated(_graph(SQ, SQ, 4), [5])) & masks.as_mask(_PER_HEAD)),
    "graph_edges": ((SQ, SQ), _edges),
    "window_2d": ((SQ, SQ), lambda: masks.window_2d(6, 1)),
    "array": ((T, S), lambda: np.random.default_rng(1).random((B, 1, T, S)) < 0.5),
}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# every case in fp32 and bf16; fp16 (its own rounding, no bf16 exponent range) on a few
CASE_DTYPES = [(c, d) for c in CASES for d in ("fp32", "bf16")] + [
    (c, "fp16") for c in ("causal", "empty_rows", "chunks_or_global")
]
# cases whose mask holds arrays: run again with those arrays traced (jit arguments)
TRACED_CASES = ["causal_padding", "empty_rows", "document_causal_pad", "graph", "graph_edges"]


def _pair_table(s, q_idx, k_idx, table, ids):
    """A Graphormer-style per-pair term: a learned table [N, 3] indexed by an integer relation of (t, s)."""
    rel = jnp.clip(ids[q_idx] - ids[k_idx], -1, 1) + 1  # q_idx [t, 1], k_idx [1, s] -> [t, s] in {0, 1, 2}
    return s + table[:, rel]  # [N, t, s] broadcast over the leading dims


def _mixed_mod(s, q_idx, k_idx, temp, bias, slopes):
    """A scalar temperature, a bias table all heads share (indexed arithmetically) and per-head slopes."""
    near = (jnp.abs(q_idx - k_idx) <= 2).astype(jnp.float32)  # [t, s]
    return s * temp + bias[0] * near + bias[1] * (1.0 - near) - slopes[:, None, None] * jnp.abs(q_idx - k_idx)


# name -> () -> (score, extra kwargs); each score's arrays get gradients, compared with the reference's
SCORE_CASES = {
    "softcap": lambda: (scores.SoftCap(2.0), {}),
    "softcap_bias": lambda: (scores.SoftCap(2.0), dict(bias=lambda qi, ki: -0.1 * jnp.abs(qi[:, None] - ki))),
    "alibi_mod": lambda: (positional.Alibi().score(slopes=jnp.array([0.5, 0.25, 0.125, 0.0625])), {}),
    "pair_table_mod": lambda: (
        scores.ScoreMod(
            _pair_table,
            jnp.array([[1.0, -2.0, 0.5], [0.0, 1.0, 3.0], [-1.0, 0.0, 1.0], [2.0, 2.0, -2.0]]),
            jnp.asarray(np.random.default_rng(2).integers(0, 5, max(T, S, SQ)), jnp.int32),
            head_axes=(0, None),  # the table is per head, the ids are shared
        ),
        {},
    ),
    # a 0-d array, an array all heads share (head axis None) and a per-head one: each gets its gradient
    "mixed_arrays_mod": lambda: (
        scores.ScoreMod(
            _mixed_mod,
            jnp.float32(0.7),
            jnp.array([0.5, -0.25]),
            jnp.array([0.3, 0.2, 0.1, 0.05]),
            head_axes=(None, None, 0),
        ),
        {},
    ),  # fmt: skip
    "additive": lambda: (scores.Additive(jax.random.normal(jax.random.key(9), (N, H))), {}),
    "additive_shared_w": lambda: (scores.Additive(jnp.linspace(-1.0, 1.5, H)), {}),  # one w [H] for all heads
}
# (score, mask, dtype): every score on a causal mask, empty rows and documents; the arrays of every kind
# (0-d, shared by the heads, per head) and one w for all heads on causal & padding; every score on an edge
# list in fp32 (the edge-list kernel's edge forms: it computes in fp32 whatever the inputs)
SCORE_RUNS = [
    (sc, m, d)
    for sc in SCORE_CASES
    for m in (
        ("causal_padding",) if sc in ("mixed_arrays_mod", "additive_shared_w") else ("causal", "empty_rows", "document")
    )
    for d in ("fp32", "bf16")
] + [(sc, "graph_edges", "fp32") for sc in SCORE_CASES]

# (implementation, test, case id or None) -> why it fails today; run as strict xfails. None today: the
# traced scale is a supports reason now, and splash gives zeros for a mask with no allowed pair.
KNOWN_FAILURES: dict = {}


def _upcast(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def _dense(mask, t, s):
    """The mask as a numpy bool array broadcastable to [..., N, t, s] (None for no mask)."""
    return None if mask is None else np.asarray(masks.as_mask(mask).dense(t, s))


def _empty_rows(dense, shape):
    """bool [..., T, N]: query rows that the mask leaves with nothing to attend (shape: the output's)."""
    *lead, t, n, _ = shape
    if dense is None:
        return np.zeros((*lead, t, n), bool)
    allowed = np.broadcast_to(dense, (*lead, n, t, dense.shape[-1])).any(-1)  # [..., N, T]
    return np.swapaxes(allowed, -1, -2) == 0


@functools.cache
def _np_expected(case, dtype):
    """float64 numpy attention of a case on its inputs (computed once per process)."""
    (t, s), make = CASES[case]
    q, k, v = qkv((B, t, N, H), s=s, kv_heads=K, dtype=DTYPES[dtype])
    return np_attention(q, k, v, mask=_dense(make(), t, s))[0]


@functools.cache
def _reference(case, dtype):
    """The reference's output and gradients on a case's inputs (computed once per process, for every kernel)."""
    (t, s), make = CASES[case]
    q, k, v = qkv((B, t, N, H), s=s, kv_heads=K, dtype=DTYPES[dtype])
    mask = make()
    return fwd_and_grads(lambda q, k, v: attnlab.attention_reference(q, k, v, mask=mask), q, k, v)


def _score_inputs(t, s, dt):
    q, k, v = qkv((B, t, N, H), s=s, kv_heads=K, dtype=dt, seed=8)
    return q * 4.0, k, v  # large logits, so a cap matters


@functools.cache
def _score_reference(score_case, mask_case, dtype):
    """The reference's output and gradients (q, k, v, the score) of a score case, and its output with the plain
    dot product (computed once per process, for every kernel)."""
    (t, s), make = CASES[mask_case]
    q, k, v = _score_inputs(t, s, DTYPES[dtype])
    score, kw = SCORE_CASES[score_case]()
    mask = make()
    ref = lambda q, k, v, sc: attnlab.attention_reference(q, k, v, mask=mask, score=sc, **kw)  # noqa: E731
    return (*fwd_and_grads(ref, q, k, v, score), attnlab.attention_reference(q, k, v, mask=mask, bias=kw.get("bias")))


@functools.cache
def _vmap_reference(case, dtype):
    """A loop of unbatched reference calls over a vmap case's examples, in fp32 on the same values: output and
    gradients (computed once per process, for every kernel)."""
    dt = DTYPES[dtype]
    data, make = VMAP_CASES[case]
    take = lambda b: None if data is None else jax.tree.map(lambda a: a[b], data)  # noqa: E731

    def loop(q, k, v):
        return jnp.stack([attnlab.attention_reference(q[b], k[b], v[b], mask=make(take(b))) for b in range(VB)])

    return fwd_and_grads(lambda *a: loop(*_upcast(*a)).astype(dt), *qkv((VB, VT, 2, H), dtype=dt, seed=3))


def _huge_negative_bias(q_idx, k_idx):
    """finfo.min on every entry of odd query rows, 0.5 * (k - q) elsewhere: [T', S']."""
    rel = 0.5 * (k_idx[None, :] - q_idx[:, None]).astype(jnp.float32)
    return jnp.where((q_idx % 2 == 1)[:, None], jnp.float32(FMIN), rel)


_LENS = jnp.array([8, 3])
EAGER_MASKS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(offset=2),
    "window": lambda: masks.window(2, 1),
    "padding": lambda: masks.padding(q_lengths=jnp.array([6, 2]), kv_lengths=_LENS),
    "graph": lambda: masks.graph(np.random.default_rng(0).random((6, 8)) < 0.4),
    "chunks": lambda: masks.chunks(3),
    "combined": lambda: (masks.causal(2) & masks.padding(kv_lengths=_LENS)) | masks.window(0, 0),
}


# vmap: B=3 examples of T=8, each with its own data (lengths with a full, a short and an empty row)
VB, VT = 3, 8
_VRNG = np.random.default_rng(0)
_VLENGTHS = np.array([8, 3, 0], np.int32)
_VEDGES = np.stack([_VRNG.choice(VT * VT, 10, replace=False) for _ in range(VB)])  # distinct edges per example
VMAP_CASES = {  # name -> (per-example data [B, ...] or None, data_b -> mask)
    "causal": (None, lambda d: masks.causal()),
    "padding": (_VLENGTHS, lambda n: masks.padding(q_lengths=n, kv_lengths=n)),
    "causal_and_padding": (_VLENGTHS, lambda n: masks.causal() & masks.padding(kv_lengths=n)),
    "graph": (_VRNG.random((VB, VT, VT)) < 0.35, lambda a: masks.graph(a)),
    "graph_edges": ((_VEDGES % VT, _VEDGES // VT), lambda sr: masks.graph_edges(sr[0], sr[1], VT)),
    "dense_array": (_VRNG.random((VB, VT, VT)) < 0.5, lambda d: masks.as_mask(d)),
    "bigbird": (None, lambda d: masks.bigbird(VT, block_size=2, window_blocks=3, num_global=1, num_random=1)),
    "window_2d": (None, lambda d: masks.window_2d(4, 1)),  # a 2 x 4 grid
}
VMAP_RUNS = [(c, "fp32") for c in VMAP_CASES] + [("causal_and_padding", "bf16")]


def _closed_over_graph_case(t):
    rng = np.random.default_rng(t)
    adj = jnp.asarray(rng.random((t, t)) < 0.2)
    lens = jnp.asarray([t - 3])
    q = jnp.asarray(rng.normal(size=(1, t, 2, 8)), jnp.float32)
    return q, lambda: masks.graph(adj, self_loops=True) & masks.padding(kv_lengths=lens)


class Conformance:
    """Subclass with ``IMPL`` (a name in ``attnlab.IMPLEMENTATIONS``); override ``BACKEND`` / ``run``."""

    IMPL: str = ""
    BACKEND: str = "cpu"  # the backend whose ``supports`` decides (the kernel runs here, on the CPU)

    def impl(self):
        return dispatch.IMPLEMENTATIONS[self.IMPL]

    def run(self, call):
        """The implementation on a bound call (a CPU stand-in where the kernel needs another chip)."""
        return self.impl().run(call)

    def attention(self, q, k, v, **kw):
        """``attnlab.attention(q, k, v, implementation=IMPL, **kw)``, through ``run``."""
        return self.run(bind(q, k, v, **kw))

    def reason(self, call) -> str | None:
        """Why the implementation does not take ``call`` (its features, then its ``supports``), or None."""
        return dispatch.explain_call(call, backend=self.BACKEND, implementation=self.IMPL).reason(self.IMPL)

    def require(self, q, k, v, **kw):
        """Skips the test, with the implementation's own reason, unless it takes this call."""
        self._skip_unless(self.reason(bind(q, k, v, **kw)))

    def require_traced(self, bind_call, *args):
        """``require`` for a call bound under jit: ``bind_call(*args)`` binds it with ``args`` traced (and
        what it computes from constants, e.g. a mask built inside the trace), as the test then runs it."""
        why = []
        jax.eval_shape(lambda *a: why.append(self.reason(bind_call(*a))), *args)
        self._skip_unless(why[0])

    def _skip_unless(self, why):
        if why is not None:
            pytest.skip(f"{self.IMPL} on {self.BACKEND}: {why}")

    @pytest.fixture(autouse=True)
    def _known_failure(self, request):
        callspec = getattr(request.node, "callspec", None)
        key = (self.IMPL, request.function.__name__, callspec.id if callspec else None)
        if key in KNOWN_FAILURES:
            request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[key]))

    # ------------------------------------------------------------------------------------------
    # 1. every mask family

    @pytest.mark.parametrize("case, dtype", CASE_DTYPES, ids=[f"{c}-{d}" for c, d in CASE_DTYPES])
    def test_matches_reference_fwd_and_grad(self, case, dtype):
        (t, s), make = CASES[case]
        dt = DTYPES[dtype]
        q, k, v = qkv((B, t, N, H), s=s, kv_heads=K, dtype=dt)
        mask = make()
        self.require(q, k, v, mask=mask)

        out, grads = fwd_and_grads(lambda q, k, v: self.attention(q, k, v, mask=mask), q, k, v)
        out_r, grads_r = _reference(case, dtype)
        assert out.shape == (B, t, N, H) and out.dtype == dt
        compare(out, out_r, tol(dt))
        compare(out, _np_expected(case, dtype), tol(dt))
        for g, g_r in zip(grads, grads_r, strict=True):
            assert g.dtype == dt
            assert np.isfinite(np.asarray(g, np.float32)).all()
            compare(g, g_r, grad_tol(dt))
        # a row with nothing to attend: zeros, and no gradient reaches its query
        empty = _empty_rows(_dense(mask, t, s), out.shape)
        assert case != "empty_rows" or empty[0].all()  # batch 0 has no valid query
        assert not np.asarray(out, np.float32)[empty].any() and not np.asarray(grads[0], np.float32)[empty].any()

    @pytest.mark.parametrize("case", TRACED_CASES)
    def test_traced_mask_data(self, case):
        """The mask's arrays (lengths, ids, adjacency, edges) as arguments of the jitted function: traced."""
        (t, s), make = CASES[case]
        q, k, v = qkv((B, t, N, H), s=s, kv_heads=K, seed=1)
        mask = make()
        self.require_traced(lambda m: bind(q, k, v, mask=m), mask)
        out, grads = fwd_and_grads(lambda q, k, v, m: self.attention(q, k, v, mask=m), q, k, v, mask)
        out_r, grads_r = fwd_and_grads(lambda q, k, v: attnlab.attention_reference(q, k, v, mask=mask), q, k, v)
        compare(out, out_r, tol(jnp.float32))
        for g, g_r in zip(grads[:3], grads_r, strict=True):
            compare(g, g_r, grad_tol(jnp.float32))
        empty = _empty_rows(_dense(mask, t, s), out.shape)
        assert not np.asarray(out)[empty].any() and not np.asarray(grads[0])[empty].any()

    # ------------------------------------------------------------------------------------------
    # 2. scores

    @pytest.mark.parametrize("score_case, mask_case, dtype", SCORE_RUNS, ids=["-".join(r) for r in SCORE_RUNS])
    def test_scores(self, score_case, mask_case, dtype):
        """Scores with a tile form: outputs and gradients (q, k, v and the score's own arrays) = the reference."""
        (t, s), make = CASES[mask_case]
        dt = DTYPES[dtype]
        q, k, v = _score_inputs(t, s, dt)
        score, kw = SCORE_CASES[score_case]()
        mask = make()
        self.require(q, k, v, mask=mask, score=score, **kw)

        fn = lambda q, k, v, sc: self.attention(q, k, v, mask=mask, score=sc, **kw)  # noqa: E731
        out, grads = fwd_and_grads(fn, q, k, v, score)
        out_r, grads_r, plain = _score_reference(score_case, mask_case, dtype)
        compare(out, out_r, tol(dt))
        for g, g_r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_r), strict=True):
            if g_r.dtype == jax.dtypes.float0:  # an integer array of the score (ids): no gradient
                assert g.dtype == jax.dtypes.float0
                continue
            assert np.isfinite(np.asarray(g, np.float32)).all()
            # the computation's precision decides: a bf16 call gives its fp32 arrays' gradients (sums over
            # every logit of a bf16-rounded ds) to bf16 precision; kernels that round in another order differ
            compare(g, g_r, grad_tol(dt))
        for leaf in jax.tree_util.tree_leaves(grads[3]):  # each float array of the score really gets one
            assert leaf.dtype == jax.dtypes.float0 or np.abs(np.asarray(leaf, np.float32)).max() > 0
        if mask_case == "empty_rows":
            assert not np.asarray(out[0], np.float32).any()
        assert not np.allclose(np.asarray(out_r, np.float32), np.asarray(plain, np.float32), atol=1e-2)

    # ------------------------------------------------------------------------------------------
    # 3. features: the log-sum-exp, dropout

    def test_lse(self):
        q, k, v = qkv((B, T, N, H), s=S, kv_heads=K, seed=5)
        mask = masks.window(2, 0) & masks.padding(q_lengths=jnp.array([0, 30]))
        self.require(q, k, v, mask=mask, return_lse=True)
        out, lse = self.attention(q, k, v, mask=mask, return_lse=True)
        out_r, lse_r = attnlab.attention_reference(q, k, v, mask=mask, return_lse=True)
        assert lse.shape == (B, T, N) and lse.dtype == jnp.float32
        compare(out, out_r, tol(jnp.float32))
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_r))  # -inf exactly on the empty rows
        finite = np.isfinite(lse_r)
        compare(np.asarray(lse)[finite], np.asarray(lse_r)[finite], tol(jnp.float32))
        # float64: log sum_s exp(logit) over the allowed keys of each row that has one
        q64, k64 = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), N // K, -2)  # [B, S, N, H]
        logits = np.einsum("btnh,bsnh->bnts", q64, k64) / np.sqrt(H)
        summed = np.where(np.broadcast_to(_dense(mask, T, S), logits.shape), np.exp(logits), 0.0).sum(-1)  # [B, N, T]
        lse64 = np.swapaxes(np.log(np.where(summed > 0, summed, 1.0)), -1, -2)  # [B, T, N]
        compare(np.asarray(lse)[finite], lse64[finite], tol(jnp.float32))

    def test_lse_without_mask_is_jax_nn_residual(self):
        q, k, v = qkv((B, T, N, H), s=S, kv_heads=K, seed=6)
        self.require(q, k, v, return_lse=True)
        _, lse = self.attention(q, k, v, return_lse=True)
        _, theirs = jax.nn.dot_product_attention(q, k, v, return_residual=True)  # the same quantity, [B, T, N]
        compare(lse, theirs, tol(jnp.float32))

    def test_dropout_draws_the_reference_mask(self):
        q, k, v = qkv((B, T, N, H), s=S, kv_heads=K, seed=6)
        kw = dict(mask=masks.causal(offset=S - T), dropout_rate=0.3, dropout_key=jax.random.key(11))
        self.require(q, k, v, **kw)
        out, grads = fwd_and_grads(lambda q, k, v: self.attention(q, k, v, **kw), q, k, v)
        out_r, grads_r = fwd_and_grads(lambda q, k, v: attnlab.attention_reference(q, k, v, **kw), q, k, v)
        compare(out, out_r, tol(jnp.float32))
        for g, g_r in zip(grads, grads_r, strict=True):
            compare(g, g_r, grad_tol(jnp.float32))

    # ------------------------------------------------------------------------------------------
    # 4. conventions (docs/conventions.md)

    @pytest.mark.parametrize("mask_kind", ["none", "causal"])
    @pytest.mark.parametrize("t, s", [(0, 5), (4, 0), (0, 0)])
    def test_zero_length_sequences(self, t, s, mask_kind):
        """T = 0 or S = 0: [..., T, N, Hv] zeros, zero gradients."""
        q, k, v = qkv((2, t, 2, 8), s=s)
        mask = masks.causal() if mask_kind == "causal" else None
        self.require(q, k, v, mask=mask)
        out, grads = fwd_and_grads(lambda q, k, v: self.attention(q, k, v, mask=mask), q, k, v)
        assert out.shape == (2, t, 2, 8) and out.dtype == q.dtype
        np.testing.assert_array_equal(np.asarray(out), np.zeros((2, t, 2, 8)))
        for g, x in zip(grads, (q, k, v), strict=True):
            assert g.shape == x.shape and not np.asarray(g).any()

    @pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
    @pytest.mark.parametrize("kind", ["padding_q", "padding_kv_zero", "isolated_node", "all_masked", "neg_inf_bias"])
    def test_rows_with_nothing_to_attend_are_zero(self, kind, dtype):
        """Every way a row can be empty, in every dtype: zeros, finite gradients, dq = 0 on those rows."""
        dt = DTYPES[dtype]
        q, k, v = qkv((2, 6, 2, 8), s=6, dtype=dt, seed=13)
        kw, empty = {}, np.zeros((2, 6), bool)  # empty: [B, T]
        if kind == "padding_q":
            kw["mask"] = masks.padding(q_lengths=jnp.array([6, 2]))
            empty[1, 2:] = True
        elif kind == "padding_kv_zero":
            kw["mask"] = masks.padding(kv_lengths=jnp.array([0, 6]))
            empty[0] = True
        elif kind == "isolated_node":
            kw["mask"] = masks.graph(_isolated(np.ones((6, 6), bool), [3]))  # node 3 has no neighbour
            empty[:, 3] = True
        elif kind == "all_masked":
            kw["mask"] = np.zeros((6, 6), bool)
            empty[:] = True
        else:
            kw["bias"] = jnp.zeros((6, 6), jnp.float32).at[2, :].set(-jnp.inf)
            empty[:, 2] = True
        self.require(q, k, v, **kw)
        out, grads = fwd_and_grads(lambda q, k, v: self.attention(q, k, v, **kw), q, k, v)
        assert out.dtype == dt
        out = np.asarray(out, np.float32)
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out[empty], 0.0)
        if (~empty).any():
            assert np.abs(out[~empty]).min() > 0  # the other rows are real outputs
        compare(out, attnlab.attention_reference(*_upcast(q, k, v), **kw), tol(dt))
        for g in grads:
            assert np.isfinite(np.asarray(g, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(grads[0], np.float32)[empty], 0.0)  # dq of empty rows

    @pytest.mark.parametrize("dtype", ["bf16", "fp16"])
    def test_fp32_bias_is_not_rounded_to_half(self, dtype):
        """An fp32 array bias stays fp32 with half-precision inputs (biases near 300: bf16 steps of 2)."""
        dt = DTYPES[dtype]
        q, k, v = qkv((2, 6, 2, 8), s=7, dtype=dt, seed=1)
        bias = jnp.asarray(np.random.default_rng(0).uniform(295.0, 305.0, (2, 2, 6, 7)), jnp.float32)
        self.require(q, k, v, bias=bias)
        out, grads = fwd_and_grads(lambda q, k, v: self.attention(q, k, v, bias=bias), q, k, v)
        compare(out, np_attention(q, k, v, bias=bias)[0], tol(dt))
        # the fp32 reference on the same (half-precision) values, the same cotangent
        _, want = fwd_and_grads(lambda *a: attnlab.attention_reference(*_upcast(*a), bias=bias).astype(dt), q, k, v)
        for g, w in zip(grads, want, strict=True):
            compare(g, w, grad_tol(dt))

    def test_bias_row_of_finfo_min_is_uniform_not_nan_in_bf16(self):
        q, k, v = qkv((1, 4, 2, 8), s=5, dtype=jnp.bfloat16)
        bias = jnp.zeros((1, 2, 4, 5), jnp.float32).at[:, :, 1, :].set(FMIN)
        self.require(q, k, v, bias=bias)
        out, grads = fwd_and_grads(lambda q, k, v: self.attention(q, k, v, bias=bias), q, k, v)
        expected, _ = np_attention(q, k, v, bias=bias)
        # float64: every logit of row 1 is finfo.min (q.k is below its resolution): the plain average of v
        np.testing.assert_allclose(expected[:, 1], np.asarray(v, np.float32).mean(-3), rtol=1e-6)
        compare(out, expected, tol(jnp.bfloat16))
        for g in grads:
            assert np.isfinite(np.asarray(g, np.float32)).all()

    @pytest.mark.parametrize("mask_kind", ["none", "causal", "window"])
    def test_huge_negative_finite_logits_are_a_softmax(self, mask_kind):
        """finfo.min on every entry of odd rows (a callable bias): a softmax, not an empty row; a masked
        entry beside allowed finfo.min ones (window) must not win the row max."""
        n = 10
        q, k, v = qkv((2, n, 2, 8), seed=4)
        mask = {"none": None, "causal": masks.causal(), "window": masks.window(3, 1)}[mask_kind]
        self.require(q, k, v, mask=mask, bias=_huge_negative_bias)
        out, grads = fwd_and_grads(
            lambda q, k, v: self.attention(q, k, v, mask=mask, bias=_huge_negative_bias), q, k, v
        )
        dense_bias = np.asarray(_huge_negative_bias(jnp.arange(n), jnp.arange(n)))
        expected, w = np_attention(q, k, v, mask=_dense(mask, n, n), bias=dense_bias)
        assert (w[..., 1, :].sum(-1) > 0.99).all()  # the finfo.min row is a real softmax in float64
        compare(out, expected, tol(jnp.float32))
        ref = functools.partial(attnlab.attention_reference, mask=mask, bias=_huge_negative_bias)
        for g, r in zip(grads, fwd_and_grads(ref, q, k, v)[1], strict=True):
            compare(g, r, grad_tol(jnp.float32))

    @pytest.mark.parametrize("shape", [(B, N, T, S), (1, N, 1, S), (T, S), (S,), "callable_per_head"])
    def test_bias_broadcasts_like_the_logits(self, shape):
        """An array bias of any shape that broadcasts to [..., N, T, S] (its gradient too), or a callable
        bias(q_idx, k_idx) -> [N, T', S'] (ALiBi-like, per head)."""
        q, k, v = qkv((B, T, N, H), s=S, kv_heads=K, seed=12)
        mask = masks.window(3, 2)
        slopes = 2.0 ** -jnp.arange(1, N + 1, dtype=jnp.float32)
        if shape == "callable_per_head":
            bias = lambda qi, ki: -slopes[:, None, None] * jnp.abs(qi[:, None] - ki[None, :]).astype(jnp.float32)  # noqa: E731
        else:
            bias = jax.random.normal(jax.random.key(3), shape, jnp.float32) * 2
        self.require(q, k, v, mask=mask, bias=bias)
        dense = bias(jnp.arange(T), jnp.arange(S)) if callable(bias) else bias
        args = (q, k, v) if callable(bias) else (q, k, v, bias)
        out, grads = fwd_and_grads(
            lambda q, k, v, *b: self.attention(q, k, v, mask=mask, bias=b[0] if b else bias), *args
        )
        out_r, grads_r = fwd_and_grads(
            lambda q, k, v, *b: attnlab.attention_reference(q, k, v, mask=mask, bias=b[0] if b else bias), *args
        )
        compare(out, np_attention(q, k, v, mask=_dense(mask, T, S), bias=dense)[0], tol(jnp.float32))
        for g, g_r in zip(grads, grads_r, strict=True):  # dq, dk, dv (and the array bias's)
            assert g.shape == g_r.shape
            compare(g, g_r, grad_tol(jnp.float32))

    @pytest.mark.parametrize("form", ["array", "callable"])
    def test_minus_inf_bias_empties_a_row(self, form):
        q, k, v = qkv((1, 4, 1, 8), s=6)
        dense = jnp.zeros((4, 6), jnp.float32).at[2].set(-jnp.inf).at[1, :3].set(FMIN)
        bias = dense if form == "array" else (lambda qi, ki: dense[qi][:, ki])
        self.require(q, k, v, bias=bias)
        args = (q, k, v) if callable(bias) else (q, k, v, bias)  # an array bias is differentiated too
        out, grads = fwd_and_grads(lambda q, k, v, *b: self.attention(q, k, v, bias=b[0] if b else bias), *args)
        expected, _ = np_attention(q, k, v, bias=dense)
        assert (expected[:, 2] == 0).all()
        compare(out, expected, tol(jnp.float32))
        _, grads_r = fwd_and_grads(
            lambda q, k, v, *b: attnlab.attention_reference(q, k, v, bias=b[0] if b else bias), *args
        )
        for g, g_r in zip(grads, grads_r, strict=True):
            assert np.isfinite(np.asarray(g)).all()
            compare(g, g_r, grad_tol(jnp.float32))
        np.testing.assert_array_equal(np.asarray(grads[0])[:, 2], 0.0)  # dq of the empty row
        if not callable(bias):
            np.testing.assert_array_equal(np.asarray(grads[3])[2], 0.0)  # dbias of the empty row

    @pytest.mark.parametrize("score", ["dot", "additive"])
    def test_out_of_range_edges_are_dropped(self, score):
        """Traced edge indices outside [0, n) (under jit) are dropped, negative ones too."""
        n = 5
        q, k, v = qkv((2, n, 2, 4), seed=6)
        senders = jnp.array([0, 1, 7, 3, -1, 4, 2], jnp.int32)  # edges 2 (sender 7) and 4 (sender -1): out of range
        receivers = jnp.array([1, 2, 3, 3, 0, 9, 4], jnp.int32)  # edge 5 (receiver 9) too
        kept = np.array([1, 1, 0, 1, 0, 0, 1], bool)
        adj = np.zeros((n, n), bool)
        adj[np.asarray(receivers)[kept], np.asarray(senders)[kept]] = True
        sc = "dot" if score == "dot" else scores.Additive(jnp.linspace(-1, 1, 4))
        self.require_traced(lambda s, r: bind(q, k, v, mask=masks.graph_edges(s, r, n), score=sc), senders, receivers)

        def fn(q, k, v, s, r):
            return self.attention(q, k, v, mask=masks.graph_edges(s, r, n), score=sc)

        ref = functools.partial(attnlab.attention_reference, mask=adj, score=sc)
        out, grads = fwd_and_grads(fn, q, k, v, senders, receivers)  # the edges traced (jit arguments)
        out_r, grads_r = fwd_and_grads(ref, q, k, v)
        compare(out, np_attention(q, k, v, mask=adj)[0] if score == "dot" else out_r, tol(jnp.float32))
        for g, w in zip(grads[:3], grads_r, strict=True):
            compare(g, w, grad_tol(jnp.float32))

    def test_rank1_mask_broadcasts_like_a_bias(self):
        q, k, v = qkv((2, 4, 2, 8), s=6, seed=8)
        mask = np.arange(6) <= 3  # [S]
        self.require(q, k, v, mask=mask)
        out = self.attention(q, k, v, mask=mask)
        compare(out, np_attention(q, k, v, mask=np.broadcast_to(mask, (2, 2, 4, 6)))[0], tol(jnp.float32))
        theirs = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask))  # jax.nn broadcasts [S] itself
        compare(out, theirs, tol(jnp.float32))

    def test_rank0_false_mask_masks_everything(self):
        q, k, v = qkv((2, 4, 2, 8), s=6, seed=8)
        self.require(q, k, v, mask=np.bool_(False))
        np.testing.assert_array_equal(np.asarray(self.attention(q, k, v, mask=np.bool_(False))), 0.0)

    @pytest.mark.parametrize("s", [1, 2])
    def test_bf16_tiny_shapes_under_jit(self, s):
        """B = T = N = 1 in bf16 under jit (XLA:CPU's small-shape emitter rejected jax.nn's bf16 dot)."""
        q, k, v = qkv((1, 1, 1, 8), s=s, dtype=jnp.bfloat16, seed=9)
        self.require(q, k, v)
        out, grads = fwd_and_grads(self.attention, q, k, v)
        compare(out, np_attention(q, k, v)[0], tol(jnp.bfloat16))
        _, want = fwd_and_grads(lambda *a: attnlab.attention_reference(*_upcast(*a)).astype(a[0].dtype), q, k, v)
        for g, w in zip(grads, want, strict=True):  # the fp32 reference on the same values
            compare(g, w, grad_tol(jnp.bfloat16))

    @pytest.mark.parametrize("how", ["0d_array", "traced", "dot_score"])
    def test_scale(self, how):
        """A scale as a 0-d array, traced under jit, or as score=Dot(scale): the same attention."""
        q, k, v = qkv((1, 4, 2, 8), s=5)
        mask = masks.causal()
        kw = dict(score=scores.Dot(0.3)) if how == "dot_score" else dict(scale=np.float32(0.3))
        self.require(q, k, v, mask=mask, **kw)
        if how == "traced":
            self.require_traced(lambda sc: bind(q, k, v, mask=mask, scale=sc), jnp.float32(0.3))
            out = jax.jit(lambda sc: self.attention(q, k, v, mask=mask, scale=sc))(jnp.float32(0.3))
        else:
            out = self.attention(q, k, v, mask=mask, **kw)
        compare(out, np_attention(q, k, v, mask=_dense(mask, 4, 5), scale=0.3)[0], tol(jnp.float32))

    @pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
    def test_grouped_query_heads(self, kv_heads):
        q, k, v = qkv((3, 6, 4, 8), s=5, kv_heads=kv_heads, seed=1)
        mask = masks.window(1, 1)
        self.require(q, k, v, mask=mask)
        compare(self.attention(q, k, v, mask=mask), np_attention(q, k, v, mask=_dense(mask, 6, 5))[0], tol(jnp.float32))

    @pytest.mark.parametrize("lead", [(), (3,), (2, 3)], ids=["unbatched", "B", "B1xB2"])
    def test_leading_batch_dims(self, lead):
        q, k, v = qkv((*lead, 5, 2, 8), s=6, seed=2)
        lens = jnp.full(lead, 4, jnp.int32) if lead else jnp.array(4)
        mask = masks.padding(kv_lengths=lens) & masks.causal(offset=1)
        self.require(q, k, v, mask=mask)
        out = self.attention(q, k, v, mask=mask)
        assert out.shape == (*lead, 5, 2, 8)
        compare(out, np_attention(q, k, v, mask=_dense(mask, 5, 6))[0], tol(jnp.float32))

    def test_value_head_dim_and_no_batch_dims(self):
        q, k, v = qkv((T, N, H), s=S, kv_heads=K, hv=5, seed=4)
        mask = masks.causal(offset=S - T)
        self.require(q, k, v, mask=mask)
        compare(self.attention(q, k, v, mask=mask), attnlab.attention_reference(q, k, v, mask=mask), tol(jnp.float32))

    @pytest.mark.parametrize("case, dtype", VMAP_RUNS, ids=[f"{c}-{d}" for c, d in VMAP_RUNS])
    def test_vmap_of_unbatched_calls_equals_a_loop(self, case, dtype):
        """jax.vmap over one-example calls, each building its mask from its own data (lengths, adjacency,
        edges) or closing over a structural one = a loop of unbatched reference calls; gradients too
        (a custom backward under vmap)."""
        dt = DTYPES[dtype]
        data, make = VMAP_CASES[case]
        q, k, v = qkv((VB, VT, 2, H), dtype=dt, seed=3)
        take = lambda b: None if data is None else jax.tree.map(lambda a: a[b], data)  # noqa: E731
        self.require_traced(lambda d: bind(q[0], k[0], v[0], mask=make(d)), take(0))  # one example, traced by vmap

        def vmapped(q, k, v):
            return jax.vmap(
                lambda q, k, v, d: self.attention(q, k, v, mask=make(d)), (0, 0, 0, None if data is None else 0)
            )(q, k, v, data)

        out, grads = fwd_and_grads(vmapped, q, k, v)
        chex.assert_shape(out, q.shape)
        out_r, grads_r = _vmap_reference(case, dtype)
        compare(out, out_r, tol(dt))
        for g, w in zip(grads, grads_r, strict=True):
            compare(g, w, grad_tol(dt))

    def test_nan_inputs_are_not_hidden(self):
        """A NaN in one query shows in that row's output (a bug upstream must not vanish), and only there."""
        q, k, v = qkv((4, 1, 8), seed=14)
        q = q.at[1, 0, 0].set(jnp.nan)
        self.require(q, k, v)
        out = np.asarray(self.attention(q, k, v))
        assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2, 3]]).all()

    @pytest.mark.parametrize("mask_kind", ["none", "causal", "window", "padding", "graph", "chunks", "combined"])
    def test_eager_matches_numpy(self, mask_kind):
        """Outside jit (op by op) too, gradients on the combined mask; the jitted path is every other test here."""
        q, k, v = qkv((2, 6, 4, 8), s=8, kv_heads=2, seed=1)
        mask = EAGER_MASKS[mask_kind]()
        self.require(q, k, v, mask=mask)
        out = self.attention(q, k, v, mask=mask)
        chex.assert_shape(out, (2, 6, 4, 8))
        chex.assert_type(out, jnp.float32)
        compare(out, np_attention(q, k, v, mask=_dense(mask, 6, 8))[0], tol(jnp.float32))
        if mask_kind == "combined":

            def loss(fn):
                return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, mask=mask))), argnums=(0, 1, 2))

            want = jax.jit(loss(attnlab.attention_reference))(q, k, v)
            chex.assert_trees_all_close(loss(self.attention)(q, k, v), want, **grad_tol(jnp.float32))

    @pytest.mark.parametrize("data", ["padding_lengths", "graph_adjacency", "graph_edges", "bias"])
    def test_new_data_values_reuse_the_program(self, data):
        """Array values (lengths, adjacency, edges, biases) are data: new values, one trace (chex)."""
        q, k, v = qkv((2, 6, 2, 8), s=6, seed=2)
        rng = np.random.default_rng(1)
        if data == "padding_lengths":
            args = (jnp.array([3, 6]), jnp.array([6, 1]))
            make = lambda n: dict(mask=masks.padding(kv_lengths=n) & masks.causal())  # noqa: E731
        elif data == "graph_adjacency":
            args = tuple(jnp.asarray(rng.random((6, 6)) < 0.5) for _ in range(2))
            make = lambda a: dict(mask=masks.graph(a))  # noqa: E731
        elif data == "graph_edges":
            args = (
                (jnp.array([0, 1, 2, 3]), jnp.array([1, 2, 3, 4])),
                (jnp.array([5, 4, 0, 0]), jnp.array([0, 0, 1, 5])),
            )
            make = lambda e: dict(mask=masks.graph_edges(e[0], e[1], 6))  # noqa: E731
        else:
            args = (
                jax.random.normal(jax.random.key(0), (2, 6, 6)),
                3.0 * jax.random.normal(jax.random.key(1), (2, 6, 6)),
            )
            make = lambda b: dict(bias=b)  # noqa: E731
        self.require_traced(lambda d: bind(q, k, v, **make(d)), args[0])
        chex.clear_trace_counter()
        traced = jax.jit(chex.assert_max_traces(lambda q, k, v, d: self.attention(q, k, v, **make(d)), n=1))
        outs = [traced(q, k, v, d) for d in args]  # a second trace raises AssertionError
        for out, d in zip(outs, args, strict=True):
            compare(out, attnlab.attention_reference(q, k, v, **make(d)), tol(jnp.float32))
        assert not np.allclose(outs[0], outs[1])  # the values did reach the program

    def test_new_structure_is_a_new_program(self):
        """The check above can fail: a new window size is static structure and must retrace."""
        q, k, v = qkv((6, 2, 8), s=8)
        self.require(q, k, v, mask=masks.window(1, 1))
        chex.clear_trace_counter()
        traced = jax.jit(chex.assert_max_traces(lambda q, k, v, m: self.attention(q, k, v, mask=m), n=1))
        traced(q, k, v, masks.window(1, 1))
        with pytest.raises(AssertionError):
            traced(q, k, v, masks.window(2, 1))

    @pytest.mark.parametrize("case", ["document_window_additive", "document_dot"])
    def test_x64_keeps_float32(self, case):
        """Under jax_enable_x64 (a scoped config: the suite itself runs 32-bit, conftest._no_x64), float32
        inputs give float32 outputs and gradients equal to the reference's in the same mode (issue 41: a
        jnp.zeros without a dtype is float64 there and met float32 values inside a kernel)."""
        with jax.enable_x64(True):
            rng = np.random.default_rng(0)
            q, k, v = (jnp.asarray(rng.normal(size=(1, 40, 2, 8)), jnp.float32) for _ in range(3))
            ids = jnp.asarray(np.repeat(np.arange(4), 10)[None])
            if case == "document_window_additive":
                kw = dict(
                    mask=masks.document(ids) & masks.window(5, 2),
                    score=scores.Additive(jnp.asarray(rng.normal(size=(2, 8)), jnp.float32)),
                )
            else:
                kw = dict(mask=masks.document(ids))
            self.require(q, k, v, **kw)

            def loss(fn):
                return lambda *a: (fn(*a) ** 2).sum()

            fast = functools.partial(self.attention, **kw)
            ref = functools.partial(attnlab.attention_reference, **kw)
            out, grads = jax.jit(lambda *a: (fast(*a), jax.grad(loss(fast), (0, 1, 2))(*a)))(q, k, v)
            assert {out.dtype, *(g.dtype for g in grads)} == {jnp.dtype(jnp.float32)}
            compare(out, ref(q, k, v), tol(jnp.float32))
            for g, r in zip(grads, jax.grad(loss(ref), (0, 1, 2))(q, k, v), strict=True):
                compare(g, r, grad_tol(jnp.float32))

    # ------------------------------------------------------------------------------------------
    # 5. regressions found by fuzzing (issue 41)

    @pytest.mark.parametrize("t", [33, 64, 100])
    def test_graph_under_jit_with_closed_over_padding(self, t):
        """graph(adj, self_loops=True) & padding(kv_lengths=lens), adj and lens closed over (constants) under
        jit: the graph built inside the trace is traced, the lengths are not."""
        q, mask = _closed_over_graph_case(t)
        self.require_traced(lambda: bind(q, q, q, mask=mask()))
        out = jax.jit(lambda q: self.attention(q, q, q, mask=mask()))(q)
        compare(out, attnlab.attention_reference(q, q, q, mask=mask()), tol(jnp.float32))

    def test_graph_under_jit_through_multi_head_attention(self):
        """The same mask through heads.multi_head_attention (a molecule-sized graph)."""
        t = 33
        _, mask = _closed_over_graph_case(t)
        p = heads.init_multi_head_params(jax.random.key(0), 16, 2)
        x = jax.random.normal(jax.random.key(1), (1, t, 16))
        q, k, v = heads.project_qkv(p, x, x)
        self.require_traced(lambda: bind(q, k, v, mask=mask()))

        def mha(x, fn):
            return heads.multi_head_attention(p, x, attention_fn=lambda q, k, v: fn(q, k, v, mask=mask()))

        out = jax.jit(lambda x: mha(x, self.attention))(x)
        compare(out, mha(x, attnlab.attention_reference), tol(jnp.float32))
