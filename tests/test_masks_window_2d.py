"""The 2-D local mask (masks.window_2d): dense values from grid coordinates, block layout, kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import brute_layout, grad_tol, qkv, tol

import attnlab
from attnlab import kernels, masks


def np_window_2d(T, S, width, rr, rc):
    """Written out from the definition: position t is cell (t // width, t % width)."""
    out = np.zeros((T, S), bool)
    for t in range(T):
        for s in range(S):
            out[t, s] = abs(t // width - s // width) <= rr and abs(t % width - s % width) <= rc
    return out


def test_by_hand_on_a_3x3_grid():
    # Grid 0 1 2 / 3 4 5 / 6 7 8: the centre sees all 9 cells; a corner sees its 2 x 2 block.
    d = np.asarray(masks.window_2d(3, 1).dense(9, 9)).astype(int)
    assert d[4].tolist() == [1] * 9
    assert d[0].tolist() == [1, 1, 0, 1, 1, 0, 0, 0, 0]
    assert d[5].tolist() == [0, 1, 1, 0, 1, 1, 0, 1, 1]  # right edge: no wrap-around to the next row


@pytest.mark.parametrize(
    "width,rr,rc,T,S", [(7, 1, 1, 49, 49), (5, 2, 0, 23, 31), (8, 0, 3, 40, 40), (4, 9, 9, 16, 16)]
)
def test_dense_matches_numpy(width, rr, rc, T, S):
    got = np.asarray(masks.window_2d(width, rr, rc).dense(T, S))
    np.testing.assert_array_equal(got, np_window_2d(T, S, width, rr, rc))


@pytest.mark.parametrize("blocks", [(4, 4), (3, 5), (7, 7), (16, 8), (1, 1), (64, 64)])
@pytest.mark.parametrize("width,rr,rc", [(7, 1, 1), (6, 2, 1), (10, 0, 0), (5, 4, 4)])
def test_block_layout_agrees_with_dense(width, rr, rc, blocks):
    T, S = 45, 53  # not multiples of the blocks
    m = masks.window_2d(width, rr, rc)
    layout = m.block_layout(T, S, *blocks)
    np.testing.assert_array_equal(layout, brute_layout(np_window_2d(T, S, width, rr, rc), T, S, *blocks))


def test_layout_skips_most_tiles_on_28x28_pixels():
    layout = masks.window_2d(28, 3).block_layout(784, 784, 64, 64)
    np.testing.assert_array_equal(layout, brute_layout(np_window_2d(784, 784, 28, 3, 3), 784, 784, 64, 64))
    assert (layout == masks.EMPTY).mean() > 0.6  # a 7 x 7 window over 784 pixels: most tiles never run


def test_row_by_row_layout_is_classified_in_numpy(monkeypatch):
    """Beyond the dense budget the band's tiles are classified row by row from the mask's numpy form: the
    same layout, nothing compiled (ragged last tiles, T != S)."""
    from attnlab.masks import base

    monkeypatch.setattr(base, "DENSE_EVAL_MAX", 0)
    programs = base._block_row._cache_size()
    T, S = 700, 690
    layout = masks.window_2d(28, 2, 4).block_layout(T, S, 40, 24)
    np.testing.assert_array_equal(layout, brute_layout(np_window_2d(T, S, 28, 2, 4), T, S, 40, 24))
    assert base._block_row._cache_size() == programs and (layout == masks.PARTIAL).any()


def test_combines_and_jits():
    m = masks.window_2d(4, 1) & masks.padding(kv_lengths=jnp.array([10]))
    want = np_window_2d(16, 16, 4, 1, 1) & (np.arange(16) < 10)[None, :]
    np.testing.assert_array_equal(np.asarray(m.dense(16, 16))[0, 0], want)
    leaves, tree = jax.tree_util.tree_flatten(masks.window_2d(4, 1, 2))
    assert leaves == [] and jax.tree_util.tree_unflatten(tree, leaves) == masks.window_2d(4, 1, 2)


def test_blockwise_kernel_matches_reference_fwd_and_grad():
    # An 8 x 8 "image" of 64 tokens, 3 x 3 neighbourhoods, small tiles so that many are skipped.
    mask = masks.window_2d(8, 1)
    q, k, v = qkv((2, 64, 2, 8), seed=5)
    ct = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)

    def fwd_bwd(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(ct)

    fast = functools.partial(kernels.blockwise_attention, mask=mask, block_sizes=kernels.BlockSizes(8, 8))
    ref = functools.partial(attnlab.attention_reference, mask=mask)
    (out, grads), (out_r, grads_r) = jax.jit(lambda: fwd_bwd(fast))(), jax.jit(lambda: fwd_bwd(ref))()
    np.testing.assert_allclose(out, out_r, **tol(jnp.float32))
    for g, g_r in zip(grads, grads_r, strict=True):
        np.testing.assert_allclose(g, g_r, **grad_tol(jnp.float32))
    assert (mask.block_layout(64, 64, 8, 8) == masks.EMPTY).sum() > 30


def test_dispatcher_takes_blockwise_for_local_pixels():
    q = jax.ShapeDtypeStruct((1, 784, 2, 8), jnp.float32)
    assert attnlab.explain(q, q, q, mask=masks.window_2d(28, 3), backend="cpu").implementation == "blockwise"


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: masks.window_2d(0, 1), "width"),
        (lambda: masks.window_2d(28, -1), "row_radius"),
        (lambda: masks.window_2d(28, 1, 1.5), "col_radius"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
