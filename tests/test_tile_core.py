"""attnlab.kernels.tile_core: one tile's math against numpy and the scores' dense forms.

Every kernel composes these functions, so each is checked here on its own: the online softmax over
tiles against a whole-row softmax written in float64 numpy (with -inf entries, empty rows, logits of
finfo.min), the base-2 conventions, and each score form's tile logits and pull-back against the
score's dense logits and ``jax.grad`` of them, in both views (heads stacked as rows, one head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import positional, scores
from attnlab.kernels import tile_core as core
from attnlab.kernels.xla_loops import Dots


def _np_softmax_out(s, v):
    """Softmax over the last axis of natural logits s [R, S] (-inf excluded; empty rows -> 0) times v [S, D]."""
    out, lse = np.zeros((s.shape[0], v.shape[1])), np.full(s.shape[0], -np.inf)
    for r in range(s.shape[0]):
        ok = s[r] != -np.inf
        if ok.any():
            z = s[r][ok] - s[r][ok].max()
            w = np.exp(z) / np.exp(z).sum()
            out[r] = w @ v[ok]
            lse[r] = s[r][ok].max() + np.log(np.exp(z).sum())
    return out, lse


def _logits():
    r = np.random.default_rng(0)
    s = r.normal(size=(6, 40)) * 3
    s[1] = -np.inf  # an empty row
    s[2, 5:] = -np.inf  # allowed only in the first tile
    s[3, :30] = -np.inf  # allowed only in the last tile
    s[4] = np.finfo(np.float32).min  # finite, however negative: a uniform row
    s[5, ::3] = -np.inf
    return s, r.normal(size=(40, 3))


@pytest.mark.parametrize("base2", [False, True])
def test_online_softmax_over_tiles_is_the_whole_row_softmax(base2):
    s, v = _logits()
    if base2:  # the plain dot product's units: its logits cannot reach finfo.min (x log2(e) would overflow)
        s[4] = -1e30
    want, want_lse = _np_softmax_out(s, v)
    t = jnp.asarray(s * (core.LOG2E if base2 else 1.0), jnp.float32)
    m, l = core.softmax_init((6,))
    acc = jnp.zeros((6, 3), jnp.float32)
    for j0 in range(0, 40, 16):  # tiles of 16, 16 and 8 keys; the mask: finite entries
        tj, vj = t[:, j0 : j0 + 16], jnp.asarray(v[j0 : j0 + 16], jnp.float32)
        m, l, alpha, p = core.softmax_step(m, l, tj, tj != -jnp.inf, base2=base2)
        acc = acc * alpha[:, None] + p @ vj
    out, (m2, log_l) = core.softmax_finalize(m, l, acc, base2=base2)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    lse = core.lse_natural(m2, log_l, base2=base2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    assert np.isneginf(lse[1]) and (out[1] == 0).all()
    # the probabilities recomputed from (m, log l), as the backward does, are the softmax weights
    p = core.probs(t, m2[:, None], log_l[:, None], t != -jnp.inf, base2=base2)
    np.testing.assert_allclose(p @ jnp.asarray(v, jnp.float32), want, rtol=1e-5, atol=1e-6)
    assert (p[1] == 0).all() and not np.isnan(p).any()


@pytest.mark.parametrize("finite", [False, True])
def test_softmax_once_is_the_online_softmax_in_one_span(finite):
    s, v = _logits()
    ok = jnp.asarray(np.isfinite(s))
    s = np.where(np.isneginf(s), 0.0, s)  # finite logits; the mask says what is excluded
    s[4] = -1e30
    t = jnp.asarray(s * core.LOG2E, jnp.float32)
    vj = jnp.asarray(v, jnp.float32)
    m, l, acc = core.softmax_once(t, ok, lambda p: p @ vj, base2=True, finite=finite)
    out, _ = core.softmax_finalize(m, l, acc, base2=True)
    want, _ = _np_softmax_out(np.where(np.asarray(ok), s, -np.inf), v)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert (out[1] == 0).all()


def test_dlogits_and_delta_are_the_softmax_backward():
    s, v = _logits()
    s = s[[0, 2, 3, 5]]
    do = np.random.default_rng(1).normal(size=(4, 3))

    def f(s):
        w = jax.nn.softmax(jnp.where(jnp.isfinite(s), s, -jnp.inf), axis=-1)
        return (w @ jnp.asarray(v, jnp.float32) * do).sum()

    want = jax.grad(f)(jnp.asarray(s, jnp.float32))
    want = np.where(np.isfinite(s), want, 0.0)
    w = np.asarray(jax.nn.softmax(jnp.asarray(s, jnp.float32), axis=-1))
    out = w @ v
    delta = core.softmax_delta(jnp.asarray(out), jnp.asarray(do))
    ds = core.dlogits(jnp.asarray(w), jnp.asarray(do @ v.T, jnp.float32), delta)
    np.testing.assert_allclose(ds, want, rtol=1e-4, atol=1e-6)


SCORES = {
    "dot": lambda N, H: scores.Dot(),
    "dot_scaled": lambda N, H: scores.Dot(0.3),
    "softcap": lambda N, H: scores.SoftCap(2.0),
    "alibi": lambda N, H: positional.Alibi().score(slopes=jnp.linspace(0.1, 0.5, N)),
    "additive_per_head": lambda N, H: scores.Additive(jax.random.normal(jax.random.key(3), (N, H)) * 0.5),
    "additive_shared": lambda N, H: scores.Additive(jax.random.normal(jax.random.key(4), (H,)) * 0.5),
}


@pytest.mark.parametrize("name", sorted(SCORES))
def test_tile_logits_and_their_pullback_match_the_dense_score(name):
    """On one tile of the middle of a [T, N, H] call: the core's logits (heads stacked as rows, G = 2) are the
    score's dense logits in base 2, and the pull-back of a cotangent is jax.grad of the dense logits."""
    T, N, K, H, bq, bk, i, j = 12, 4, 2, 8, 4, 6, 1, 1
    r = np.random.default_rng(2)
    q = jnp.asarray(r.normal(size=(1, T, N, H)), jnp.float32)
    k = jnp.asarray(r.normal(size=(1, T, K, H)), jnp.float32)
    score = SCORES[name](N, H)
    spec = core.tile_spec(score, H, T, T)
    view = core.HeadsView((1,), N, K, bq)
    leaves = tuple(jax.tree_util.tree_leaves(score))
    q_pos, k_pos = core.positions(i, j, bq, bk)
    # the tile's operands as the lax-loop kernels hold them: [B*K, G*bq, H] pre-scaled, [B*K, bk, H]
    qt = (q[0, q_pos].reshape(bq, K, N // K, H).transpose(1, 2, 0, 3).reshape(K, -1, H)) * spec.q_factor
    kt = k[0, k_pos].transpose(1, 0, 2)
    t = core.logits(spec, view, Dots().qk, qt, kt, q_pos, k_pos, leaves)
    dense = score(q, k)[0][:, q_pos][:, :, k_pos]  # [N, bq, bk]
    unit = core.LOG2E if spec.base2 else 1.0  # the plain dot product's logits are base 2, the others natural
    np.testing.assert_allclose(view.to_heads(t)[0], dense * unit, rtol=2e-5, atol=2e-5)

    ds = jnp.asarray(r.normal(size=t.shape), jnp.float32)
    _, pull = core.logits_vjp(spec, view, Dots(), qt, kt, q_pos, k_pos, leaves)
    dq, dkt, d_leaves, _ = pull(ds)

    def dense_tile(q, k, *leaves):
        s = jax.tree_util.tree_structure(score).unflatten(leaves)(q, k)[0][:, q_pos][:, :, k_pos]
        return (s * view.to_heads(ds)[0]).sum()

    gq, gk, *g_leaves = jax.grad(dense_tile, argnums=tuple(range(2 + len(leaves))))(q, k, *leaves)
    # dq of the pre-scaled tile queries: times q_factor and grad_scale it is dL/dq of the rows of the tile
    dq_rows = (dq * spec.grad_scale * spec.q_factor).reshape(K, N // K, bq, H).transpose(2, 0, 1, 3).reshape(bq, N, H)
    np.testing.assert_allclose(dq_rows, gq[0, q_pos], rtol=1e-4, atol=1e-5)
    dk_rows = jnp.swapaxes(dkt * spec.grad_scale, -1, -2).transpose(1, 0, 2)  # [K, H, bk] -> [bk, K, H]
    np.testing.assert_allclose(dk_rows, gk[0, k_pos], rtol=1e-4, atol=1e-5)
    for d, g in zip(d_leaves, g_leaves, strict=True):
        np.testing.assert_allclose(d, g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["dot", "softcap", "alibi", "additive_per_head", "additive_shared"])
def test_one_head_view_is_the_heads_view_of_that_head(name):
    """The Pallas kernels' view (one head's [bq, bk] tile, leaves sliced to the head) gives the same logits as
    the stacked view's row block of that head."""
    T, N, H, bq, bk = 8, 4, 8, 4, 8
    r = np.random.default_rng(5)
    q, k = (jnp.asarray(r.normal(size=(1, T, N, H)), jnp.float32) for _ in range(2))
    score = SCORES[name](N, H)
    spec = core.tile_spec(score, H, T, T)
    leaves = tuple(jax.tree_util.tree_leaves(score))
    axes = score.tile_form().head_axes
    q_pos, k_pos = core.positions(0, 0, bq, bk)

    class _Dot:
        def qk(self, a, b):
            return a @ b.T

    heads = core.HeadsView((1,), N, N, bq)
    qt = q[0, q_pos].transpose(1, 0, 2) * spec.q_factor  # [N, bq, H] (K = N: no stacking)
    stacked = core.logits(spec, heads, Dots().qk, qt, k[0, k_pos].transpose(1, 0, 2), q_pos, k_pos, leaves)
    for n in range(N):
        mine = tuple(
            x if a is None else jax.lax.slice_in_dim(x, n, n + 1, axis=a) for x, a in zip(leaves, axes, strict=True)
        )
        one = core.logits(spec, core.OneHeadView(), _Dot().qk, qt[n], k[0, k_pos, n], q_pos, k_pos, mine)
        np.testing.assert_allclose(one, stacked[n], rtol=2e-5, atol=2e-5)
