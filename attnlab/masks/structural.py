"""Structural masks (static metadata only): full, causal, window, window_2d."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attnlab.masks.base import (
    _REFINE_BUDGET,
    EMPTY,
    FULL,
    PARTIAL,
    Mask,
    _check_int,
    _evaluation_cost,
    _interval_layout,
    _num_blocks,
    layout_by_evaluation,
    mask_class,
)


@mask_class
class Full(Mask):
    """Every query attends to every key."""

    in_kernel = True

    def __call__(self, q_idx, k_idx):
        return jnp.ones((q_idx.shape[0], k_idx.shape[0]), bool)

    def conjuncts(self):
        return ()

    def interval(self):
        return (None, None)

    def _layout(self, T, S, bq, bk):
        return np.full((_num_blocks(T, bq), _num_blocks(S, bk)), FULL, np.int8)


@mask_class
class Causal(Mask):
    """Query t attends to keys s <= t + offset."""

    offset: int = 0
    in_kernel = True

    def __call__(self, q_idx, k_idx):
        return k_idx[None, :] <= q_idx[:, None] + self.offset

    def interval(self):
        return (None, self.offset)

    def _layout(self, T, S, bq, bk):
        return _interval_layout(T, S, bq, bk, lambda t: np.full_like(t, -(2**62)), lambda t: t + self.offset)


@mask_class
class Window(Mask):
    """Query t attends to keys t + offset - left <= s <= t + offset + right (truncated attention)."""

    left: int
    right: int
    offset: int = 0

    in_kernel = True

    def __call__(self, q_idx, k_idx):
        d = k_idx[None, :] - (q_idx[:, None] + self.offset)
        return (d >= -self.left) & (d <= self.right)

    def interval(self):
        return (self.offset - self.left, self.offset + self.right)

    def _layout(self, T, S, bq, bk):
        return _interval_layout(
            T,
            S,
            bq,
            bk,
            lambda t: t + self.offset - self.left,
            lambda t: t + self.offset + self.right,
        )


@mask_class
class Window2D(Mask):
    """2-D local attention on a row-major grid of ``width`` columns (an image as a sequence).

    Position t is the grid cell (t // width, t % width); query t attends to key s iff their rows
    differ by at most ``row_radius`` and their columns by at most ``col_radius``: a
    (2 row_radius + 1) x (2 col_radius + 1) neighbourhood, cut at the image border (a convolution's
    window with attention weights instead of fixed ones).
    """

    width: int
    row_radius: int
    col_radius: int
    in_kernel = True

    def __call__(self, q_idx, k_idx):
        return self._near(q_idx, k_idx, jnp)

    def _near(self, q_idx, k_idx, xp):
        """The mask's values with ``xp`` (jax.numpy in a kernel, numpy to classify tiles)."""
        w = self.width
        dr = k_idx[None, :] // w - q_idx[:, None] // w
        dc = k_idx[None, :] % w - q_idx[:, None] % w
        return (xp.abs(dr) <= self.row_radius) & (xp.abs(dc) <= self.col_radius)

    def _layout(self, T, S, bq, bk):
        # |s - t| = |dr * width + dc| <= row_radius * width + min(col_radius, width - 1) is necessary,
        # so blocks outside that 1-D band are EMPTY (exactly, O(blocks)); the band's blocks are
        # evaluated exactly, O(T * band) (skipped, left PARTIAL, beyond the refinement budget).
        reach = self.row_radius * self.width + min(self.col_radius, self.width - 1)
        band = _interval_layout(T, S, bq, bk, lambda t: t - reach, lambda t: t + reach)
        todo = band != EMPTY
        if not todo.any() or _evaluation_cost(todo, bq, bk) > _REFINE_BUDGET:
            return np.where(todo, PARTIAL, EMPTY).astype(np.int8)
        exact = layout_by_evaluation(self, T, S, bq, bk, todo, numpy_form=lambda q, k: self._near(q, k, np))
        return np.where(todo, exact, EMPTY).astype(np.int8)


def full() -> Mask:
    """No masking: every query attends to every key."""
    return Full()


def causal(offset: int = 0) -> Mask:
    """Query t attends to keys s <= t + offset (offset = S - T aligns the last query with the last key).

    Example:
        >>> causal().dense(3, 3).astype(int).tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    return Causal(_check_int("offset", offset))


def window(left: int, right: int = 0, *, offset: int = 0) -> Mask:
    """Truncated (local) attention: query t sees keys t-left .. t+right, like jax.nn's local_window_size.

    ``window(L, 0)`` is a causal window of L past keys plus the key at t; ``window(L, L)`` is
    symmetric. For an unbounded side use ``full()`` or ``causal()``.

    Example:
        >>> window(1, 1).dense(4, 4).astype(int).tolist()
        [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    """
    return Window(
        _check_int("left", left, minimum=0),
        _check_int("right", right, minimum=0),
        _check_int("offset", offset),
    )


def window_2d(width: int, row_radius: int, col_radius: int | None = None) -> Mask:
    """2-D local attention for an image flattened row-major into a sequence (pixels or patches).

    Query (r, c) sees the keys (r', c') with ``|r' - r| <= row_radius`` and ``|c' - c| <= col_radius``
    (default ``col_radius = row_radius``), where position t is cell ``(t // width, t % width)``. On
    28 x 28 pixels, ``window_2d(28, 3)`` is a 7 x 7 neighbourhood. The block layout is exact (up to a
    size budget far beyond images): kernels skip the tiles outside the band
    ``|s - t| <= row_radius * width + col_radius``.

    Example:
        >>> m = window_2d(3, 1)          # a 3 x 3 grid (tokens 0 1 2 / 3 4 5 / 6 7 8), 3 x 3 windows
        >>> m.dense(9, 9)[0].astype(int).tolist()   # the corner sees its 2 x 2 block
        [1, 1, 0, 1, 1, 0, 0, 0, 0]
        >>> m.dense(9, 9)[5].astype(int).tolist()   # no wrap-around from the right edge to the next row
        [0, 1, 1, 0, 1, 1, 0, 1, 1]
    """
    w = _check_int("width", width, minimum=1)
    r = _check_int("row_radius", row_radius, minimum=0)
    c = r if col_radius is None else _check_int("col_radius", col_radius, minimum=0)
    return Window2D(w, r, c)
