"""Scores with a tile form in the blockwise kernel: memory, retraces, specs, errors.

(Values and gradients of every tiled score against the reference, fp32 and bf16, over several masks,
are in the conformance suite: ``Conformance.test_scores``.)
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare, qkv, tol

import attnlab
from attnlab import masks, positional, scores
from attnlab.kernels import blockwise
from experiments import sweep
from experiments.configs import sweep as sweep_configs


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_additive_fwd_bwd_memory_is_linear_not_quadratic():
    """The reference materialises [B, T, S, N, H] tanh values; the tiled additive score holds a tile."""
    T, N, H = 1024, 2, 16
    q, k, v = qkv((1, T, N, H))
    score = scores.Additive(jnp.full((N, H), 0.1))

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v, score=score, mask=masks.causal()) ** 2).sum()

    grad = lambda fn: jax.grad(loss(fn), argnums=(0, 1, 2))  # noqa: E731
    dense = 4 * T * T * N * H  # one fp32 [T, S, N, H] intermediate: 128 MiB
    tiled = _temp_bytes(grad(blockwise.blockwise_attention), q, k, v)
    ref = _temp_bytes(grad(attnlab.attention_reference), q, k, v)
    assert ref >= dense  # the reference keeps it (and more for the backward)
    assert tiled < dense / 8, (tiled, dense)


def test_traced_score_arrays_reuse_the_compiled_program():
    """ALiBi slopes and additive weights are kernel inputs: new values, no retrace."""
    q, k, v = qkv((1, 96, 2, 8))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(slopes, w):
        a = blockwise.blockwise_attention(q, k, v, score=positional.Alibi().score(slopes=slopes))
        b = blockwise.blockwise_attention(q, k, v, score=scores.Additive(w))
        return a, b

    for seed in range(3):
        slopes = jnp.asarray(np.random.default_rng(seed).random(2), jnp.float32)
        w = jnp.asarray(np.random.default_rng(seed).normal(size=(2, 8)), jnp.float32)
        a, b = run(slopes, w)
        alibi = positional.Alibi().score(slopes=slopes)
        compare(a, attnlab.attention_reference(q, k, v, score=alibi), tol(jnp.float32))
        compare(b, attnlab.attention_reference(q, k, v, score=scores.Additive(w)), tol(jnp.float32))


def test_score_mod_alibi_equals_the_alibi_bias():
    """Alibi().score (a ScoreMod) is the same attention as the positional ALiBi bias (two routes)."""
    q, k, v = qkv((2, 70, 4, 8))
    slopes = jnp.asarray(attnlab.positional.alibi_slopes(4), jnp.float32)
    by_mod = blockwise.blockwise_attention(q, k, v, score=positional.Alibi().score(slopes=slopes))
    by_bias = attnlab.attention_reference(q, k, v, bias=attnlab.positional.Alibi().bias(4))
    compare(by_mod, by_bias, tol(jnp.float32))


def test_additive_tiled_by_hand():
    """One query, two keys: softmax(w . tanh(q + k_s)) weighting v, computed in numpy."""
    q = jnp.array([[[0.5, -0.5]]])  # [T=1, N=1, H=2]
    k = jnp.array([[[0.0, 1.0]], [[1.0, 0.0]]])  # [S=2, K=1, H=2]
    v = jnp.array([[[1.0]], [[3.0]]])
    w = np.array([1.0, 2.0])
    logits = np.array([w @ np.tanh(np.array([0.5, -0.5]) + np.asarray(k[s, 0])) for s in range(2)])
    p = np.exp(logits - logits.max())
    p /= p.sum()
    out = blockwise.blockwise_attention(q, k, v, score=scores.Additive(jnp.asarray(w)))
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], p @ np.array([1.0, 3.0]), rtol=1e-5)


@pytest.mark.parametrize("w_shape", [(1, 6), (6,)])
def test_additive_one_head_form_and_its_backward_by_hand(w_shape):
    """The one-head pair form ``PairTile.head_pair_vjp`` (the Pallas kernel's loop over the head dim) against
    numpy: logits, and the hand-derived gradients dq = sum_s ds w (1 - t^2), dk = sum_t ds w (1 - t^2),
    dw = sum ds t; the two zero columns that pad the head dim get zero gradient."""
    r = np.random.default_rng(0)
    q, k = np.zeros((5, 8)), np.zeros((7, 8))
    q[:, :6], k[:, :6] = r.normal(size=(5, 6)), r.normal(size=(7, 6))
    w, ds = r.normal(size=w_shape), r.normal(size=(5, 7))
    t = np.tanh(q[:, None, :6] + k[None, :, :6])  # [5, 7, 6]
    g = ds[:, :, None] * w.reshape(-1) * (1 - t**2)
    form = scores.Additive(jnp.asarray(w, jnp.float32)).tile_form()
    assert isinstance(form, scores.PairTile) and form.head_axes == ((0,) if len(w_shape) == 2 else (None,))
    s, back = form.head_pair_vjp(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32))
    dq, dk, (dw,) = back(jnp.asarray(ds, jnp.float32))
    np.testing.assert_allclose(s, t @ w.reshape(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dq, np.pad(g.sum(1), ((0, 0), (0, 2))), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dk, np.pad(g.sum(0), ((0, 0), (0, 2))), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, (ds[:, :, None] * t).sum((0, 1)).reshape(w_shape), rtol=1e-5, atol=1e-5)
    _, only_k = form.head_pair_vjp(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), dq=False, leaf_grads=False)
    gq, gk, gl = only_k(jnp.asarray(ds, jnp.float32))
    assert gq is None and gl == () and np.allclose(gk, dk)


def test_explain_says_which_implementations_take_a_score():
    x = jax.ShapeDtypeStruct((1, 1024, 4, 32), jnp.float32)
    e = attnlab.explain(x, x, x, score=scores.Additive(jnp.ones(32)), backend="cpu")
    assert e.implementation == "blockwise"
    assert "dot" in e.reason("xla")
    on_gpu = attnlab.explain(x, x, x, score=scores.Additive(jnp.ones(32)), backend="gpu")
    assert on_gpu.implementation == "blockwise"  # pallas takes it, but ran it slower there (its pays_off)
    assert "ran faster in blockwise" in on_gpu.reason("pallas")
    asked = attnlab.explain(x, x, x, score=scores.Additive(jnp.ones(32)), backend="gpu", implementation=("pallas",))
    assert asked.implementation == "pallas"
    custom = attnlab.explain(x, x, x, score=lambda q, k: attnlab.scores.dot_product(q, k), backend="cpu")
    assert custom.implementation == "reference"
    assert "ScoreMod" in custom.reason("blockwise")  # the way to a tiled per-element score


def test_pair_form_takes_blockwise_once_the_dense_intermediate_is_large():
    # 256 x 256 pairs (below BLOCKWISE_MIN_PAIRS), 8 heads x 64: the dense tanh tensor is 128 MiB
    x = jax.ShapeDtypeStruct((1, 256, 8, 64), jnp.float32)
    assert attnlab.explain(x, x, x, score=scores.Additive(jnp.ones(64))).implementation == "blockwise"
    small = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.float32)
    assert attnlab.explain(small, small, small, score=scores.Additive(jnp.ones(8))).implementation == "reference"


def test_from_spec():
    assert scores.from_spec("dot", num_heads=2, head_dim=8) == scores.Dot()
    assert scores.from_spec("softcap:30", num_heads=2, head_dim=8) == scores.SoftCap(30.0)
    alibi = scores.from_spec("alibi", num_heads=4, head_dim=8)
    np.testing.assert_allclose(alibi.arrays[0], attnlab.positional.alibi_slopes(4))
    add = scores.from_spec("additive", num_heads=3, head_dim=16, seed=1)
    assert add.w.shape == (3, 16)
    np.testing.assert_allclose(float(np.std(add.w)), 0.25, rtol=0.3)  # sd 1/sqrt(H)
    for bad in ("softcap", "softcap:-1", "rope", "alibi:2", ""):
        with pytest.raises(ValueError, match="scores.from_spec"):
            scores.from_spec(bad, num_heads=2, head_dim=8)


def test_score_mod_head_axes():
    slopes, table = jnp.ones(4), jnp.ones((3, 4))
    assert positional.Alibi().score(slopes=slopes).head_axes == (0,)  # ALiBi's fn declares its own
    assert scores.ScoreMod(lambda s, qi, ki, w: s, slopes).head_axes is None  # unknown: per-head kernels decline
    assert scores.ScoreMod(lambda s, qi, ki, a, b: s, slopes, table, head_axes=(0, -1)).head_axes == (0, 1)
    assert scores.ScoreMod(lambda s, qi, ki: s, head_axes=()).tile_form().head_axes == ()  # known: none per head
    assert scores.ScoreMod(lambda s, qi, ki, w: s, slopes).tile_form().head_axes is None
    for bad, match in (
        ((0,), "one int axis"),
        ((0, 2), "out of range"),
        ((0, 1.0), "one int axis"),
        ((0, True), "one int axis"),
    ):
        with pytest.raises(ValueError, match=match):
            scores.ScoreMod(lambda s, qi, ki, a, b: s, slopes, table, head_axes=bad)
    with pytest.raises(ValueError, match="out of range for array 0 of shape"):
        scores.ScoreMod(lambda s, qi, ki, t: s * t, 0.5, head_axes=(0,))  # a scalar has no head axis
    leaves, treedef = jax.tree_util.tree_flatten(positional.Alibi().score(slopes=slopes))
    assert treedef.unflatten(leaves).head_axes == (0,)  # a pytree round trip keeps them


def test_score_mod_bad_input():
    with pytest.raises(ValueError, match="fn must be a callable"):
        scores.ScoreMod(3.0)
    q, k, v = qkv((40, 2, 8))
    wrong = scores.ScoreMod(lambda s, qi, ki: s.sum(-1))
    with pytest.raises(ValueError, match="must return the logits' shape"):
        blockwise.blockwise_attention(q, k, v, score=wrong)
    with pytest.raises(ValueError, match="must return the logits' shape"):
        attnlab.attention_reference(q, k, v, score=wrong)


def test_sweep_scores_axis():
    c = sweep_configs.get_config("smoke")
    c.scores = ["dot", "softcap:5", "additive"]
    c.implementations = ["reference", "blockwise", "jax.nn"]
    cells = sweep.expand(c, backend="cpu")
    by = {(cell.implementation, cell.score) for cell in cells}
    assert ("jax.nn", "dot") in by and ("jax.nn", "softcap:5") not in by  # jax.nn: the dot product only
    assert {("blockwise", "softcap:5"), ("blockwise", "additive"), ("reference", "additive")} <= by
    cell = next(x for x in cells if x.implementation == "blockwise" and x.score == "additive")
    fn, args, pairs = sweep.build(cell)
    score = scores.from_spec("additive", num_heads=cell.num_heads, head_dim=cell.head_dim)
    mask = sweep.make_mask(cell.mask, cell.seq_len, cell.batch)
    compare(fn(*args), attnlab.attention_reference(*args[:3], mask=mask, score=score), tol(jnp.float32))
    dot = sweep.Cell(**{**cell.__dict__, "score": "dot"})
    assert sweep.useful_flops(cell, pairs) == sweep.useful_flops(dot, pairs) * 5 // 4  # 3H + 2H vs 2H + 2H
    with pytest.raises(ValueError, match="scores.from_spec"):
        sweep.expand(_with(c, scores=["tanh"]), backend="cpu")


def _with(c, **kw):
    c = c.copy_and_resolve_references()
    for key, value in kw.items():
        c[key] = value
    return c
