"""Block schedules: which tiles each row of blocks visits, FULL tiles listed apart from PARTIAL ones.

A mask's ``block_layout(T, S, bq, bk)`` calls each tile EMPTY (0), PARTIAL (1) or FULL (2). A kernel
visits, per query block (a row of the layout), the non-empty tiles in two loops: first the FULL ones,
with no mask code at all (a plain loop Triton can pipeline: FlexAttention's full / partial block lists,
kvax's masked / full ranges), then the PARTIAL ones, which evaluate the mask per element. So a
schedule row is the column indices of its FULL tiles, then of its PARTIAL tiles, then padding, with
``counts = (n_full, n_partial)``; the loops are ``[0, n_full)`` and ``[n_full, n_full + n_partial)``.

The same function builds a schedule at trace time from a static layout (numpy) and on device from a
layout refined by the mask's traced data (``jax.numpy``: padding lengths, document ids), so a new value
reuses the compiled program and the kernels cannot tell the two apart.

Shape legend: nq, nk query / key blocks; J the schedule's width (the most tiles a row visits,
padded to a power of two for the Triton kernels).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib

__all__ = ["Schedule", "adjust_layout", "refine", "rows", "width"]

EMPTY, PARTIAL, FULL = masks_lib.EMPTY, masks_lib.PARTIAL, masks_lib.FULL


def adjust_layout(layout, S: int, bk: int, xp=np):
    """The layout a kernel schedules from: a short last key block (``S % bk``) is at most PARTIAL, so the
    keys past S in it are masked."""
    layout = xp.asarray(layout, xp.int32)
    if S % bk:
        if xp is np:
            layout = layout.copy()
            layout[:, -1] = np.minimum(layout[:, -1], PARTIAL)
        else:
            layout = layout.at[:, -1].set(jnp.minimum(layout[:, -1], PARTIAL))
    return layout


def refine(layout, runtime, S: int, bk: int):
    """A static (adjusted) layout refined on device by a mask's ``runtime_layout`` (traced data): EMPTY if
    either says so, FULL if either says so (both are safe for the same mask), PARTIAL otherwise; the short
    last key block stays at most PARTIAL. int32 ``[nq, nk]`` (a jax array)."""
    layout = jnp.asarray(layout, jnp.int32)
    runtime = runtime.astype(jnp.int32)
    empty = (layout == EMPTY) | (runtime == EMPTY)
    full = (layout == FULL) | (runtime == FULL)
    return adjust_layout(jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)), S, bk, jnp)


def width(layout, *, pow2: bool = False) -> int:
    """The most non-empty tiles of any row of a static layout (at least 1); the next power of two with
    ``pow2`` (Triton tensor sizes)."""
    J = max(1, int((np.asarray(layout) != EMPTY).sum(1).max(initial=0)))
    return 1 << (J - 1).bit_length() if pow2 else J


def rows(layout, J: int, xp=np):
    """Per row of ``layout`` (int ``[n_rows, n_cols]``): its FULL tiles' columns, then its PARTIAL tiles'
    columns (each in column order), then zeros -> ``(index int32 [n_rows, J], counts int32 [n_rows, 2])``
    with ``counts = (n_full, n_partial)``. ``xp``: numpy (a static layout) or jax.numpy (on device)."""
    layout = xp.asarray(layout)
    rank = xp.where(layout == FULL, 0, xp.where(layout == PARTIAL, 1, 2))
    if xp is np:
        order = np.argsort(rank, axis=1, kind="stable").astype(np.int32)
    else:
        order = jnp.argsort(rank, axis=1, stable=True).astype(jnp.int32)
    counts = xp.stack([(layout == FULL).sum(1), (layout == PARTIAL).sum(1)], axis=1).astype(xp.int32)
    n = order.shape[1]
    if n < J:  # fewer columns than the (padded) width
        order = xp.pad(order, ((0, 0), (0, J - n)))
    index = order[:, :J]
    live = xp.arange(J)[None, :] < counts.sum(1, keepdims=True)
    return xp.where(live, index, 0).astype(xp.int32), counts


class Schedule:
    """A kernel's schedule and its transpose (key block -> query blocks, for a dk/dv pass).

    Attributes:
        layout: the static adjusted layout int32 ``[nq, nk]`` the schedule came from (numpy).
        index, counts: ``rows`` of the layout (numpy when static, jax arrays when refined on device).
        index_t, counts_t: ``rows`` of the transposed layout, or None when not asked for.
        refined: True when the schedule was refined on device from a runtime layout.
    """

    def __init__(self, layout, S: int, bk: int, *, runtime=None, transposed: bool = False, pow2: bool = False):
        self.layout = adjust_layout(layout, S, bk)
        J, I = width(self.layout, pow2=pow2), width(self.layout.T, pow2=pow2)
        self.refined = runtime is not None
        lay, xp = (refine(self.layout, runtime, S, bk), jnp) if self.refined else (self.layout, np)
        self.index, self.counts = rows(lay, J, xp)
        self.index_t = self.counts_t = None
        if transposed:
            self.index_t, self.counts_t = rows(lay.T, I, xp)

    @property
    def kinds(self) -> frozenset:
        """The kinds of tile the static layout has (a refined schedule may also hold FULL tiles)."""
        kinds = set(np.unique(self.layout).tolist()) - {EMPTY}
        return frozenset(kinds | ({FULL} if self.refined else set()))
