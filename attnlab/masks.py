"""Attention masks as structured objects.

A mask says which (query position t, key position s) pairs may attend: **True = attend**. Every
mask can give

* ``mask.dense(T, S)``: a boolean array broadcastable to ``[..., N, T, S]`` (the logits' shape);
* ``mask.block_layout(T, S, block_q, block_k)``: a numpy int8 array ``[ceil(T/bq), ceil(S/bk)]``
  with ``EMPTY = 0`` (no pair in the block may attend, for any batch element), ``PARTIAL = 1``
  and ``FULL = 2`` (every in-range pair in the block may attend, for every batch element). This
  is what fast kernels use to skip work. The layout is always *safe*: a block is only called
  EMPTY or FULL when that is certain. Masks whose structure is only known at run time (padding
  with traced lengths, a traced adjacency) mark such blocks PARTIAL.
* ``mask(q_idx, k_idx)``: the same boolean values for arbitrary 1-D position vectors, so that a
  kernel can evaluate the mask on one block at a time without forming ``[T, S]``.

Masks compose with ``&`` (both must allow) and ``|`` (either allows).

Masks are JAX pytrees: their structure (window sizes, causal offset) is static metadata and
their arrays (padding lengths, adjacency, edge lists) are leaves. So a mask can be passed as an
ordinary argument to a ``jax.jit``-ed function; changing a window size recompiles, changing the
lengths does not.

Shape legend (as ``jax.nn.dot_product_attention``): B batch (any number of leading dims), T query
length, S key length, N heads. Position t of the queries and s of the keys are both counted from
0, so ``causal()`` is top-left aligned like ``jax.nn``; use ``offset`` to align queries with the
end of a longer key sequence (decoding with a cache).

Example:
    >>> m = causal() & window(2, 0)          # each query sees itself and the 2 keys before it
    >>> m.dense(4, 4).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]
    >>> m.block_layout(8, 8, 4, 4).tolist()    # 0 = empty, 1 = partial, 2 = full
    [[1, 0], [1, 1]]
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "EMPTY",
    "PARTIAL",
    "FULL",
    "Mask",
    "Full",
    "Causal",
    "Window",
    "Padding",
    "Graph",
    "GraphEdges",
    "Dense",
    "And",
    "Or",
    "full",
    "causal",
    "window",
    "padding",
    "graph",
    "graph_edges",
    "with_self_loops",
    "as_mask",
    "Chunks",
    "Dilated",
    "GlobalTokens",
    "BlockBand",
    "RandomBlocks",
    "chunks",
    "dilated",
    "global_tokens",
    "random_blocks",
    "bigbird",
    "Window2D",
    "window_2d",
    "from_spec",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


def _is_concrete(x) -> bool:
    """True when ``x`` holds values known now (not a tracer inside jit/grad/vmap)."""
    return x is None or not isinstance(x, jax.core.Tracer)


def _num_blocks(length: int, block: int) -> int:
    return -(-length // block)


def _check_lengths(T: int, S: int) -> None:
    for name, n in (("T", T), ("S", S)):
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")


def _check_blocks(block_q: int, block_k: int) -> None:
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(b, (int, np.integer)) or b <= 0:
            raise ValueError(f"{name} must be a positive int, got {b!r}")


class Mask:
    """Base class. Subclasses implement ``__call__`` and, when they can, ``_layout``."""

    __array_ufunc__ = None  # `numpy_array & mask` defers to Mask.__rand__ instead of looping

    def __call__(self, q_idx: jax.Array, k_idx: jax.Array) -> jax.Array:
        """Evaluates the mask at query positions ``q_idx`` [T'] and key positions ``k_idx`` [S'].

        Returns:
            bool array broadcastable to ``[..., N, T', S']``.
        """
        raise NotImplementedError

    def dense(self, T: int, S: int) -> jax.Array:
        """The mask as a boolean array broadcastable to ``[..., N, T, S]``."""
        _check_lengths(T, S)
        return self(jnp.arange(T), jnp.arange(S))

    @property
    def is_static(self) -> bool:
        """True when ``block_layout`` is exact (the structure is known at trace time)."""
        return all(_is_concrete(leaf) for leaf in jax.tree_util.tree_leaves(self))

    def block_layout(self, T: int, S: int, block_q: int, block_k: int) -> np.ndarray:
        """Static block layout, int8 ``[ceil(T/block_q), ceil(S/block_k)]``.

        0 = EMPTY, 1 = PARTIAL, 2 = FULL. Positions past T or S (in the last, short block) are
        not counted: a short last block is FULL when every in-range pair may attend.
        """
        _check_lengths(T, S)
        _check_blocks(block_q, block_k)
        layout = np.asarray(self._layout(T, S, block_q, block_k), dtype=np.int8)
        return layout

    def _layout(self, T: int, S: int, bq: int, bk: int) -> np.ndarray:
        # Safe default: evaluate the mask block by block when its values are known now,
        # otherwise call every block PARTIAL.
        if not self.is_static:
            return np.full((_num_blocks(T, bq), _num_blocks(S, bk)), PARTIAL, np.int8)
        return _layout_by_evaluation(self, T, S, bq, bk)

    def __and__(self, other: Mask) -> Mask:
        return And(self, as_mask(other, "other"))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, as_mask(other, "other"))

    def __rand__(self, other):
        return And(as_mask(other, "other"), self)

    def __ror__(self, other):
        return Or(as_mask(other, "other"), self)


def _classify(values: np.ndarray) -> int:
    """values: bool [..., bq, bk] for one block, all batch dims included."""
    if not values.any():
        return EMPTY
    if values.all():
        return FULL
    return PARTIAL


def _layout_by_evaluation(mask: Mask, T: int, S: int, bq: int, bk: int, todo=None) -> np.ndarray:
    """Exact layout by evaluating ``mask`` on the blocks where ``todo`` is True (all by default).

    Each query-block row is evaluated once over the span of its key blocks still to decide, so a
    banded set of PARTIAL blocks costs O(T * band), not O(T * S).
    """
    nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
    layout = np.full((nq, nk), PARTIAL, np.int8)
    if todo is None:
        todo = np.ones((nq, nk), bool)
    if T * S <= _DENSE_EVAL_MAX:
        return np.where(todo, _layout_of_dense(mask, T, S, bq, bk), layout).astype(np.int8)
    with jax.ensure_compile_time_eval():
        for i in range(nq):
            cols = np.nonzero(todo[i])[0]
            if cols.size == 0:
                continue
            q_idx = np.arange(i * bq, min((i + 1) * bq, T))
            k0, k1 = cols[0] * bk, min((cols[-1] + 1) * bk, S)
            row = np.asarray(mask(jnp.asarray(q_idx), jnp.arange(k0, k1)))
            row = np.broadcast_to(row, row.shape[:-2] + (q_idx.size, k1 - k0))
            for j in cols:
                layout[i, j] = _classify(row[..., j * bk - k0 : min((j + 1) * bk, S) - k0])
    return layout


# Up to this many (query, key) pairs, evaluate the mask once on all of [T, S] (a few eager ops of one
# shape) rather than row by row (ops of many shapes, each compiled anew: seconds for BigBird at 2K).
_DENSE_EVAL_MAX = 2**23


def _layout_of_dense(mask: Mask, T: int, S: int, bq: int, bk: int) -> np.ndarray:
    """Exact layout of every block from one evaluation of ``mask`` on [T, S] (all batch dims included)."""
    nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
    with jax.ensure_compile_time_eval():
        values = np.asarray(mask(jnp.arange(T), jnp.arange(S)))
    values = np.broadcast_to(values, values.shape[:-2] + (T, S)).reshape(-1, T, S)
    any_ = np.zeros((values.shape[0], nq * bq, nk * bk), bool)  # out-of-range positions: never allowed
    all_ = np.ones((values.shape[0], nq * bq, nk * bk), bool)  # ... and never spoil "every pair allowed"
    any_[:, :T, :S] = values
    all_[:, :T, :S] = values
    blocks = (values.shape[0], nq, bq, nk, bk)
    empty = ~any_.reshape(blocks).any((0, 2, 4))
    full = all_.reshape(blocks).all((0, 2, 4))
    return _from_flags(empty, full)


def _evaluation_cost(todo: np.ndarray, bq: int, bk: int) -> int:
    """Elements `_layout_by_evaluation` would evaluate for `todo` (rows x spanned columns)."""
    rows = np.nonzero(todo.any(1))[0]
    cost = 0
    for i in rows:
        cols = np.nonzero(todo[i])[0]
        cost += bq * (cols[-1] - cols[0] + 1) * bk
    return cost


_REFINE_BUDGET = 2**24  # elements; beyond this a combination keeps its (safe) PARTIAL blocks


def _interval_layout(T, S, bq, bk, lo_fn, hi_fn):
    """Layout for masks of the form ``lo(t) <= s <= hi(t)`` with lo(t) = t + c_lo, hi(t) = t + c_hi.

    For a query block [t0, t1] and key block [s0, s1] the allowed set is empty iff no row
    intersects it, and full iff every row covers it. Monotone bounds make both checks O(1).
    """
    nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
    t0 = np.arange(nq)[:, None] * bq
    t1 = np.minimum(t0 + bq, T) - 1
    s0 = np.arange(nk)[None, :] * bk
    s1 = np.minimum(s0 + bk, S) - 1
    # empty: even the lowest row's lower bound is past s1, or the highest row's upper bound is
    # before s0. (Exact for bounds t + c: rows meeting each condition then always overlap.)
    empty = (lo_fn(t0) > s1) | (hi_fn(t1) < s0)
    # full: every row covers [s0, s1]: max lower bound <= s0 and min upper bound >= s1
    full_ = (lo_fn(t1) <= s0) & (hi_fn(t0) >= s1)
    layout = np.where(empty, EMPTY, np.where(full_, FULL, PARTIAL)).astype(np.int8)
    return layout


# ------------------------------------------------------------------------------------------
# Structural masks (static metadata only)


@dataclasses.dataclass(frozen=True)
class Full(Mask):
    """Every query attends to every key."""

    def __call__(self, q_idx, k_idx):
        return jnp.ones((q_idx.shape[0], k_idx.shape[0]), bool)

    def _layout(self, T, S, bq, bk):
        return np.full((_num_blocks(T, bq), _num_blocks(S, bk)), FULL, np.int8)


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
    """Query t attends to keys s <= t + offset."""

    offset: int = 0

    def __call__(self, q_idx, k_idx):
        return k_idx[None, :] <= q_idx[:, None] + self.offset

    def _layout(self, T, S, bq, bk):
        return _interval_layout(T, S, bq, bk, lambda t: np.full_like(t, -(2**62)), lambda t: t + self.offset)


@dataclasses.dataclass(frozen=True)
class Window(Mask):
    """Query t attends to keys t + offset - left <= s <= t + offset + right (truncated attention)."""

    left: int
    right: int
    offset: int = 0

    def __call__(self, q_idx, k_idx):
        d = k_idx[None, :] - (q_idx[:, None] + self.offset)
        return (d >= -self.left) & (d <= self.right)

    def _layout(self, T, S, bq, bk):
        return _interval_layout(
            T,
            S,
            bq,
            bk,
            lambda t: t + self.offset - self.left,
            lambda t: t + self.offset + self.right,
        )


# ------------------------------------------------------------------------------------------
# Data-carrying masks (arrays are pytree leaves)


@dataclasses.dataclass(frozen=True)
class Padding(Mask):
    """Per-example valid lengths: query t is valid iff t < q_lengths[b], key s iff s < kv_lengths[b].

    A pair may attend iff both are valid. ``dense`` has shape ``[*B, 1, T, S]``.
    """

    q_lengths: Any = None
    kv_lengths: Any = None

    def __call__(self, q_idx, k_idx):
        ok = jnp.ones((q_idx.shape[0], k_idx.shape[0]), bool)
        if self.q_lengths is not None:
            lq = jnp.asarray(self.q_lengths)[..., None, None, None]  # [*B] -> [*B, 1, 1, 1]
            ok = ok & (q_idx[:, None] < lq)
        if self.kv_lengths is not None:
            lk = jnp.asarray(self.kv_lengths)[..., None, None, None]
            ok = ok & (k_idx[None, :] < lk)
        return ok

    def _layout(self, T, S, bq, bk):
        nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
        if not self.is_static:
            return np.full((nq, nk), PARTIAL, np.int8)

        def axis_state(lengths, n, block, size):
            # -> per-example [*B, n]: 0 none valid, 2 all (in-range) valid, 1 some
            start = np.arange(n) * block
            stop = np.minimum(start + block, size)
            if lengths is None:
                return np.full((1, n), FULL, np.int8)
            ln = np.asarray(lengths).reshape(-1, 1)
            return np.where(ln <= start, EMPTY, np.where(ln >= stop, FULL, PARTIAL))

        sq = axis_state(self.q_lengths, nq, bq, T)[:, :, None]  # [B, nq, 1]
        sk = axis_state(self.kv_lengths, nk, bk, S)[:, None, :]  # [B, 1, nk]
        per_example = np.where(
            (sq == EMPTY) | (sk == EMPTY), EMPTY, np.where((sq == FULL) & (sk == FULL), FULL, PARTIAL)
        )
        all_empty = (per_example == EMPTY).all(0)
        all_full = (per_example == FULL).all(0)
        return np.where(all_empty, EMPTY, np.where(all_full, FULL, PARTIAL)).astype(np.int8)


@dataclasses.dataclass(frozen=True)
class Graph(Mask):
    """Attention along the edges of a graph: ``adjacency[..., i, j]`` = node i attends to node j.

    ``adjacency`` is bool ``[T, S]`` or ``[*B, T, S]``; ``dense`` is ``[T, S]`` or ``[*B, 1, T, S]``.
    """

    adjacency: Any

    def __call__(self, q_idx, k_idx):
        adj = jnp.asarray(self.adjacency)
        out = jnp.take(jnp.take(adj, q_idx, axis=-2), k_idx, axis=-1)
        return out if adj.ndim == 2 else out[..., None, :, :]  # [*B, T', S'] -> [*B, 1, T', S']

    def dense(self, T, S):
        _check_lengths(T, S)
        shape = tuple(self.adjacency.shape[-2:])
        if shape != (T, S):
            raise ValueError(
                f"graph mask: adjacency is {shape[0]}x{shape[1]} but attention is "
                f"{T}x{S} (T queries x S keys); they must be equal"
            )
        adj = jnp.asarray(self.adjacency)
        return adj if adj.ndim == 2 else adj[..., None, :, :]

    def _layout(self, T, S, bq, bk):
        nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
        if not self.is_static:
            return np.full((nq, nk), PARTIAL, np.int8)
        adj = np.asarray(self.adjacency, bool).reshape((-1,) + tuple(self.adjacency.shape[-2:]))
        adj = adj[:, :T, :S]
        pad = np.zeros((adj.shape[0], nq * bq, nk * bk), np.int32)
        pad[:, :T, :S] = adj
        counts = pad.reshape(adj.shape[0], nq, bq, nk, bk).sum((2, 4))  # [B, nq, nk]
        rows = np.minimum(np.arange(nq) * bq + bq, T) - np.arange(nq) * bq
        cols = np.minimum(np.arange(nk) * bk + bk, S) - np.arange(nk) * bk
        sizes = rows[:, None] * cols[None, :]
        all_empty = (counts == 0).all(0)
        all_full = (counts == sizes).all(0)
        return np.where(all_empty, EMPTY, np.where(all_full, FULL, PARTIAL)).astype(np.int8)


@dataclasses.dataclass(frozen=True)
class GraphEdges(Mask):
    """A graph as an edge list: edge e carries a message from ``senders[e]`` to ``receivers[e]``.

    The receiver (query) attends to the sender (key), so ``dense()[r, s]`` is True for each edge.
    This is the input of the O(E) sparse kernel; ``dense`` scatters it into ``[num_nodes, num_nodes]``.
    """

    senders: Any
    receivers: Any
    num_nodes: int = 0

    def __call__(self, q_idx, k_idx):
        adj = self.adjacency()
        return jnp.take(jnp.take(adj, q_idx, axis=0), k_idx, axis=1)

    def adjacency(self) -> jax.Array:
        """bool ``[num_nodes, num_nodes]``: ``adjacency[r, s]`` is True iff an edge s -> r exists."""
        n = self.num_nodes
        adj = jnp.zeros((n, n), bool)
        # an edge outside [0, n) (possible only with traced indices) is dropped, negative ones too
        r, s = (jnp.asarray(x) for x in (self.receivers, self.senders))
        r, s = jnp.where(r < 0, n, r), jnp.where(s < 0, n, s)
        return adj.at[r, s].set(True, mode="drop")

    def dense(self, T, S):
        _check_lengths(T, S)
        if (T, S) != (self.num_nodes, self.num_nodes):
            raise ValueError(
                f"graph_edges mask: num_nodes={self.num_nodes} but attention is "
                f"{T}x{S} (T queries x S keys); both must equal num_nodes"
            )
        return self.adjacency()

    def _layout(self, T, S, bq, bk):
        nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
        if not self.is_static:
            return np.full((nq, nk), PARTIAL, np.int8)
        r = np.asarray(self.receivers)
        s = np.asarray(self.senders)
        keep = (r < T) & (s < S)
        r, s = r[keep], s[keep]
        pairs = np.unique(np.stack([r, s]), axis=1)  # drop duplicate edges before counting
        counts = np.zeros((nq, nk), np.int64)
        np.add.at(counts, (pairs[0] // bq, pairs[1] // bk), 1)
        rows = np.minimum(np.arange(nq) * bq + bq, T) - np.arange(nq) * bq
        cols = np.minimum(np.arange(nk) * bk + bk, S) - np.arange(nk) * bk
        sizes = rows[:, None] * cols[None, :]
        return np.where(counts == 0, EMPTY, np.where(counts == sizes, FULL, PARTIAL)).astype(np.int8)


@dataclasses.dataclass(frozen=True)
class Dense(Mask):
    """A plain boolean array broadcastable to ``[..., N, T, S]``, wrapped as a mask."""

    array: Any

    def __call__(self, q_idx, k_idx):
        a = jnp.asarray(self.array)
        if a.ndim < 2:
            raise ValueError(f"mask array must have rank >= 2 ([..., T, S]), got shape {a.shape}")
        q = q_idx if a.shape[-2] != 1 else jnp.zeros_like(q_idx)
        k = k_idx if a.shape[-1] != 1 else jnp.zeros_like(k_idx)
        return jnp.take(jnp.take(a, q, axis=-2), k, axis=-1)

    def dense(self, T, S):
        _check_lengths(T, S)
        a = jnp.asarray(self.array)
        if a.ndim < 2:
            raise ValueError(f"mask array must have rank >= 2 ([..., T, S]), got shape {a.shape}")
        if a.shape[-2] not in (1, T) or a.shape[-1] not in (1, S):
            raise ValueError(f"mask array of shape {a.shape} does not broadcast to [..., {T}, {S}]")
        return a


# ------------------------------------------------------------------------------------------
# The sparse family (static structure): chunks, dilated windows, global tokens, random blocks


def _block_ranges(length, block):
    start = np.arange(_num_blocks(length, block)) * block
    return start, np.minimum(start + block, length) - 1  # first and last position of each block


def _from_flags(empty, full):
    return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)


@dataclasses.dataclass(frozen=True)
class Chunks(Mask):
    """Non-overlapping chunks: t attends to s iff they are in the same chunk of ``size`` (LRA's local attention)."""

    size: int

    def __call__(self, q_idx, k_idx):
        return (q_idx[:, None] // self.size) == (k_idx[None, :] // self.size)

    def _layout(self, T, S, bq, bk):
        t0, t1 = _block_ranges(T, bq)
        s0, s1 = _block_ranges(S, bk)
        c = self.size
        qlo, qhi = (t0 // c)[:, None], (t1 // c)[:, None]  # chunks a query block spans
        klo, khi = (s0 // c)[None, :], (s1 // c)[None, :]
        empty = np.maximum(qlo, klo) > np.minimum(qhi, khi)
        full = (qlo == qhi) & (klo == khi) & (qlo == klo)
        return _from_flags(empty, full)


@dataclasses.dataclass(frozen=True)
class Dilated(Mask):
    """Dilated window: t attends to s iff -left <= s - t <= right and (s - t) % dilation == 0.

    ``dilated(L, 0, d) & causal()`` with L >= T is the Sparse Transformer's strided pattern
    (Child et al. 2019, arXiv 1904.10509); with small L it is Longformer's dilated window.
    """

    left: int
    right: int
    dilation: int

    def __call__(self, q_idx, k_idx):
        d = k_idx[None, :] - q_idx[:, None]
        return (d >= -self.left) & (d <= self.right) & (d % self.dilation == 0)

    def _layout(self, T, S, bq, bk):
        t0, t1 = (x[:, None] for x in _block_ranges(T, bq))
        s0, s1 = (x[None, :] for x in _block_ranges(S, bk))
        lo = np.maximum(-self.left, s0 - t1)  # offsets d = s - t that occur in the block and are in the window
        hi = np.minimum(self.right, s1 - t0)
        empty = np.floor_divide(hi, self.dilation) * self.dilation < lo  # no multiple of dilation in [lo, hi]
        in_window = (s0 - t1 >= -self.left) & (s1 - t0 <= self.right)
        single = (t0 == t1) & (s0 == s1)
        full = in_window & ((self.dilation == 1) | (single & ((s0 - t0) % self.dilation == 0)))
        return _from_flags(empty, full & ~empty)


@dataclasses.dataclass(frozen=True)
class GlobalTokens(Mask):
    """Global positions attend to everything and are attended to by everything (Longformer, BigBird)."""

    indices: tuple[int, ...]

    def __call__(self, q_idx, k_idx):
        g = jnp.asarray(self.indices, jnp.int32)
        q_global = jnp.isin(q_idx, g)[:, None]
        k_global = jnp.isin(k_idx, g)[None, :]
        return q_global | k_global

    def _layout(self, T, S, bq, bk):
        def counts(length, block):
            g = np.asarray([i for i in self.indices if i < length], np.int64)
            c = np.bincount(g // block, minlength=_num_blocks(length, block))
            start, stop = _block_ranges(length, block)
            return c, stop - start + 1

        cq, nq_len = counts(T, bq)
        ck, nk_len = counts(S, bk)
        empty = (cq[:, None] == 0) & (ck[None, :] == 0)
        full = (cq == nq_len)[:, None] | (ck == nk_len)[None, :]
        return _from_flags(empty, full)


@dataclasses.dataclass(frozen=True)
class BlockBand(Mask):
    """Blocked sliding window: block t // block_size attends to blocks within ``half`` of it (BigBird)."""

    block_size: int
    half: int

    def __call__(self, q_idx, k_idx):
        return jnp.abs(q_idx[:, None] // self.block_size - k_idx[None, :] // self.block_size) <= self.half

    def _layout(self, T, S, bq, bk):
        b = self.block_size
        t0, t1 = (x[:, None] // b for x in _block_ranges(T, bq))
        s0, s1 = (x[None, :] // b for x in _block_ranges(S, bk))
        lo, hi = s0 - t1, s1 - t0  # block-index differences that occur in the kernel block
        empty = (hi < -self.half) | (lo > self.half)
        full = (lo >= -self.half) & (hi <= self.half)
        return _from_flags(empty, full)


@dataclasses.dataclass(frozen=True)
class RandomBlocks(Mask):
    """Fixed random blocks: t attends to s iff ``table[t // block_size, s // block_size]`` (BigBird).

    ``table`` is stored as a static tuple of rows, so the layout is known at trace time.
    """

    block_size: int
    table: tuple[tuple[bool, ...], ...]

    def __call__(self, q_idx, k_idx):
        table = jnp.asarray(np.asarray(self.table, bool))
        nb_q, nb_k = table.shape
        qb = jnp.minimum(q_idx // self.block_size, nb_q - 1)
        kb = jnp.minimum(k_idx // self.block_size, nb_k - 1)
        inside = (q_idx < nb_q * self.block_size)[:, None] & (k_idx < nb_k * self.block_size)[None, :]
        return table[qb[:, None], kb[None, :]] & inside

    def _layout(self, T, S, bq, bk):
        table = np.asarray(self.table, np.int64)
        nb_q, nb_k = table.shape
        csum = np.zeros((nb_q + 1, nb_k + 1), np.int64)
        csum[1:, 1:] = table.cumsum(0).cumsum(1)  # 2-D prefix sums: O(1) count per rectangle
        t0, t1 = (x // self.block_size for x in _block_ranges(T, bq))
        s0, s1 = (x // self.block_size for x in _block_ranges(S, bk))
        out_q = (t1 >= nb_q)[:, None]  # a query block reaching past the table has rows that see nothing
        out_k = (s1 >= nb_k)[None, :]
        t0c, t1c = np.minimum(t0, nb_q - 1)[:, None], np.minimum(t1, nb_q - 1)[:, None]
        s0c, s1c = np.minimum(s0, nb_k - 1)[None, :], np.minimum(s1, nb_k - 1)[None, :]
        count = csum[t1c + 1, s1c + 1] - csum[t0c, s1c + 1] - csum[t1c + 1, s0c] + csum[t0c, s0c]
        area = (t1c - t0c + 1) * (s1c - s0c + 1)
        empty = (count == 0) | (t0[:, None] >= nb_q) | (s0[None, :] >= nb_k)
        full = (count == area) & ~out_q & ~out_k
        return _from_flags(empty, full & ~empty)


@dataclasses.dataclass(frozen=True)
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

    def __call__(self, q_idx, k_idx):
        w = self.width
        dr = k_idx[None, :] // w - q_idx[:, None] // w
        dc = k_idx[None, :] % w - q_idx[:, None] % w
        return (jnp.abs(dr) <= self.row_radius) & (jnp.abs(dc) <= self.col_radius)

    def _layout(self, T, S, bq, bk):
        # |s - t| = |dr * width + dc| <= row_radius * width + min(col_radius, width - 1) is necessary,
        # so blocks outside that 1-D band are EMPTY (exactly, O(blocks)); the band's blocks are
        # evaluated exactly, O(T * band) (skipped, left PARTIAL, beyond the refinement budget).
        reach = self.row_radius * self.width + min(self.col_radius, self.width - 1)
        band = _interval_layout(T, S, bq, bk, lambda t: t - reach, lambda t: t + reach)
        todo = band != EMPTY
        if not todo.any() or _evaluation_cost(todo, bq, bk) > _REFINE_BUDGET:
            return np.where(todo, PARTIAL, EMPTY).astype(np.int8)
        layout = np.full(todo.shape, EMPTY, np.int8)
        w = self.width
        for i in np.nonzero(todo.any(1))[0]:  # numpy, one query-block row over its band of key blocks
            cols = np.nonzero(todo[i])[0]
            t = np.arange(i * bq, min((i + 1) * bq, T))[:, None]
            k0, k1 = cols[0] * bk, min((cols[-1] + 1) * bk, S)
            s = np.arange(k0, k1)[None, :]
            row = (np.abs(s // w - t // w) <= self.row_radius) & (np.abs(s % w - t % w) <= self.col_radius)
            for j in cols:
                layout[i, j] = _classify(row[:, j * bk - k0 : min((j + 1) * bk, S) - k0])
        return layout


# ------------------------------------------------------------------------------------------
# Combinations


def _combine_layouts(a, b, op):
    if op == "and":
        out = np.where((a == EMPTY) | (b == EMPTY), EMPTY, np.where((a == FULL) & (b == FULL), FULL, PARTIAL))
    else:
        out = np.where((a == FULL) | (b == FULL), FULL, np.where((a == EMPTY) & (b == EMPTY), EMPTY, PARTIAL))
    return out.astype(np.int8)


@dataclasses.dataclass(frozen=True)
class And(Mask):
    """Both masks must allow the pair."""

    a: Mask
    b: Mask

    def __call__(self, q_idx, k_idx):
        return self.a(q_idx, k_idx) & self.b(q_idx, k_idx)

    def dense(self, T, S):
        return self.a.dense(T, S) & self.b.dense(T, S)

    def _layout(self, T, S, bq, bk):
        layout = _combine_layouts(self.a._layout(T, S, bq, bk), self.b._layout(T, S, bq, bk), "and")
        return _refine(self, layout, T, S, bq, bk)


@dataclasses.dataclass(frozen=True)
class Or(Mask):
    """Either mask may allow the pair."""

    a: Mask
    b: Mask

    def __call__(self, q_idx, k_idx):
        return self.a(q_idx, k_idx) | self.b(q_idx, k_idx)

    def dense(self, T, S):
        return self.a.dense(T, S) | self.b.dense(T, S)

    def _layout(self, T, S, bq, bk):
        layout = _combine_layouts(self.a._layout(T, S, bq, bk), self.b._layout(T, S, bq, bk), "or")
        return _refine(self, layout, T, S, bq, bk)


def _refine(mask, layout, T, S, bq, bk):
    """Combining two PARTIAL blocks is PARTIAL only conservatively; evaluate those blocks exactly."""
    if not mask.is_static:
        return layout
    todo = layout == PARTIAL
    if not todo.any() or _evaluation_cost(todo, bq, bk) > _REFINE_BUDGET:
        return layout
    exact = _layout_by_evaluation(mask, T, S, bq, bk, todo)
    return np.where(todo, exact, layout).astype(np.int8)


for _cls, _data in (
    (Full, []),
    (Causal, []),
    (Window, []),
    (Padding, ["q_lengths", "kv_lengths"]),
    (Graph, ["adjacency"]),
    (GraphEdges, ["senders", "receivers"]),
    (Dense, ["array"]),
    (Chunks, []),
    (Dilated, []),
    (GlobalTokens, []),
    (BlockBand, []),
    (RandomBlocks, []),
    (Window2D, []),
    (And, ["a", "b"]),
    (Or, ["a", "b"]),
):
    _meta = [f.name for f in dataclasses.fields(_cls) if f.name not in _data]
    jax.tree_util.register_dataclass(_cls, data_fields=_data, meta_fields=_meta)


# ------------------------------------------------------------------------------------------
# Constructors (these validate; the classes themselves do not, so pytree unflattening is free)


def full() -> Mask:
    """No masking: every query attends to every key."""
    return Full()


# Positions are int32 inside the kernels; bounding every structural int by 2**30 keeps sums
# like q_idx + offset from wrapping (and a window of 2**30 already covers any sequence).
_MAX_INT = 2**30


def _check_int(name: str, value, *, minimum=None, bounded=True) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a Python int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if bounded and abs(int(value)) > _MAX_INT:
        raise ValueError(
            f"{name} must be in [-2**30, 2**30] (positions are int32; 2**30 already covers any sequence), got {value}"
        )
    return int(value)


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


def _check_lengths_array(name, lengths):
    if lengths is None:
        return None
    arr = lengths if isinstance(lengths, jax.Array) else np.asarray(lengths)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of per-example lengths, got dtype {arr.dtype}")
    if _is_concrete(arr) and np.any(np.asarray(arr) < 0):
        raise ValueError(f"{name} must be >= 0, got {np.asarray(arr).tolist()}")
    return arr


def padding(q_lengths=None, kv_lengths=None) -> Mask:
    """Variable-length sequences: only the first ``q_lengths[b]`` queries and ``kv_lengths[b]`` keys are real.

    Args:
        q_lengths: int ``[*B]`` (may be a traced array under jit), or None for no query padding.
        kv_lengths: int ``[*B]``, or None for no key padding.

    Padded query rows have no key to attend to, so attention returns zeros there.

    Example:
        >>> padding(kv_lengths=jnp.array([2])).dense(2, 3).astype(int).tolist()
        [[[[1, 1, 0], [1, 1, 0]]]]
    """
    if q_lengths is None and kv_lengths is None:
        raise ValueError("padding() needs q_lengths, kv_lengths or both")
    q = _check_lengths_array("q_lengths", q_lengths)
    k = _check_lengths_array("kv_lengths", kv_lengths)
    if q is not None and k is not None and q.shape != k.shape:
        raise ValueError(f"q_lengths and kv_lengths must have the same batch shape, got {q.shape} and {k.shape}")
    return Padding(q, k)


def _check_adjacency(adjacency, *, square: bool):
    adj = adjacency if isinstance(adjacency, jax.Array) else np.asarray(adjacency)
    if adj.dtype != bool:
        raise ValueError(f"adjacency must be a bool array (True = attend), got dtype {adj.dtype}")
    if adj.ndim < 2:
        raise ValueError(f"adjacency must be [T, S] or [*B, T, S], got shape {adj.shape}")
    if square and adj.shape[-1] != adj.shape[-2]:
        raise ValueError(f"adjacency must be square [..., n, n] for self-loops, got shape {adj.shape}")
    return adj


def with_self_loops(adjacency):
    """Adds self-loops (node i attends to itself) to a square adjacency ``[..., n, n]``."""
    adj = _check_adjacency(adjacency, square=True)
    eye = np.eye(adj.shape[-1], dtype=bool)
    return (adj | eye) if isinstance(adj, np.ndarray) else jnp.logical_or(adj, eye)


def graph(adjacency, *, self_loops: bool = False) -> Mask:
    """Graph attention: ``adjacency[..., i, j]`` True means node i attends to node j (its neighbour).

    Args:
        adjacency: bool ``[T, S]`` or ``[*B, T, S]`` (numpy or jax; traced arrays allowed).
        self_loops: also let every node attend to itself (requires T == S).

    Example:
        >>> import numpy as np
        >>> path = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], bool)  # 0 - 1 - 2
        >>> graph(path, self_loops=True).dense(3, 3).astype(int).tolist()
        [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
    """
    adj = _check_adjacency(adjacency, square=self_loops)
    if self_loops:
        adj = with_self_loops(adj)
    return Graph(adj)


def graph_edges(senders, receivers, num_nodes: int) -> Mask:
    """A graph given as an edge list (for the O(E) sparse kernel): receiver r attends to sender s.

    Args:
        senders: int ``[E]`` source node of each edge (the key).
        receivers: int ``[E]`` target node of each edge (the query).
        num_nodes: number of nodes n (T = S = n).

    Example:
        >>> graph_edges([0, 1], [1, 2], 3).dense(3, 3).astype(int).tolist()
        [[0, 0, 0], [1, 0, 0], [0, 1, 0]]
    """
    n = _check_int("num_nodes", num_nodes, minimum=1)
    out = []
    for name, idx in (("senders", senders), ("receivers", receivers)):
        arr = idx if isinstance(idx, jax.Array) else np.asarray(idx)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be a 1-D int array [E], got shape {arr.shape}")
        if arr.size and not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
        arr = arr.astype(np.int32)
        if _is_concrete(arr) and arr.size:
            vals = np.asarray(arr)
            if vals.min() < 0 or vals.max() >= n:
                raise ValueError(f"{name} has node indices outside [0, {n}): min {vals.min()}, max {vals.max()}")
        out.append(arr)
    if out[0].shape != out[1].shape:
        raise ValueError(
            f"senders and receivers must have the same length, got {out[0].shape[0]} and {out[1].shape[0]}"
        )
    return GraphEdges(out[0], out[1], n)


def chunks(size: int) -> Mask:
    """Non-overlapping chunks of ``size`` positions attend only within themselves (LRA's "local attention").

    Example:
        >>> chunks(2).dense(4, 4).astype(int).tolist()
        [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    """
    return Chunks(_check_int("size", size, minimum=1))


def dilated(left: int, right: int, dilation: int) -> Mask:
    """A window t-left .. t+right that keeps only every ``dilation``-th offset (Sparse Transformer, Longformer).

    Example:
        >>> dilated(4, 0, 2).dense(5, 5).astype(int).tolist()
        [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    """
    return Dilated(
        _check_int("left", left, minimum=0),
        _check_int("right", right, minimum=0),
        _check_int("dilation", dilation, minimum=1),
    )


def global_tokens(indices) -> Mask:
    """Positions ``indices`` see every position and are seen by every position (Beltagy et al. 2020, arXiv 2004.05150).

    Example:
        >>> (window(0, 0) | global_tokens([0])).dense(3, 3).astype(int).tolist()
        [[1, 1, 1], [1, 1, 0], [1, 0, 1]]
    """
    idx = tuple(
        sorted(
            {
                _check_int("indices", int(i) if isinstance(i, np.integer) else i, minimum=0)
                for i in np.atleast_1d(np.asarray(indices)).tolist()
            }
        )
    )
    if not idx:
        raise ValueError("indices must name at least one global position")
    return GlobalTokens(idx)


def random_blocks(seq_len: int, block_size: int, num_random: int, *, seed: int = 0) -> Mask:
    """Each query block attends to ``num_random`` key blocks drawn with a fixed ``seed`` (a static layout).

    Args:
        seq_len: T = S the table covers (positions past it attend to nothing through this mask).
        block_size: size of the random blocks (match the kernel's block size to skip work exactly).
        num_random: key blocks per query block (at most the number of blocks).
        seed: numpy seed; the same seed gives the same layout on every machine.
    """
    n = _check_int("seq_len", seq_len, minimum=1)
    b = _check_int("block_size", block_size, minimum=1)
    r = _check_int("num_random", num_random, minimum=0)
    nb = _num_blocks(n, b)
    if r > nb:
        raise ValueError(f"num_random must be <= the number of blocks ({nb}), got {r}")
    rng = np.random.default_rng(_check_int("seed", seed, minimum=0, bounded=False))
    table = np.zeros((nb, nb), bool)
    for i in range(nb):
        table[i, rng.choice(nb, size=r, replace=False)] = True
    return RandomBlocks(b, tuple(map(tuple, table.tolist())))


def bigbird(
    seq_len: int,
    *,
    block_size: int = 64,
    window_blocks: int = 3,
    num_global: int = 2,
    num_random: int = 3,
    seed: int = 0,
) -> Mask:
    """BigBird (Zaheer et al. 2020, arXiv 2007.14062): window + global tokens + random blocks.

    Args:
        seq_len: T = S.
        block_size: block size of the pattern (use the kernel's block size).
        window_blocks: width of the sliding window in blocks (3 = the block itself and one each side).
        num_global: the first ``num_global`` positions are global.
        num_random: random key blocks per query block, fixed by ``seed``.
    """
    half = _check_int("window_blocks", window_blocks, minimum=1) // 2
    parts = BlockBand(_check_int("block_size", block_size, minimum=1), half)
    if num_global:
        parts = parts | global_tokens(range(_check_int("num_global", num_global, minimum=0)))
    if num_random:
        parts = parts | random_blocks(seq_len, block_size, num_random, seed=seed)
    return parts


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


def as_mask(mask, name: str = "mask") -> Mask | None:
    """Turns None, a Mask, or a bool array (broadcastable to ``[..., N, T, S]``) into a Mask.

    Arrays follow numpy broadcasting like a bias: a rank-1 ``[S]`` mask applies to every query.
    """
    if mask is None or isinstance(mask, Mask):
        return mask
    if not hasattr(mask, "dtype") and not isinstance(mask, (list, tuple)):
        raise ValueError(f"{name} must be a Mask (attnlab.masks) or a bool array, got {type(mask).__name__}")
    arr = mask if isinstance(mask, jax.Array) else np.asarray(mask)
    if arr.dtype != bool:
        raise ValueError(
            f"{name} must be a bool array (True = attend), got dtype {arr.dtype}; "
            f"use `x != 0` or an attnlab.masks object"
        )
    if arr.ndim < 2:  # rank 0 or 1 broadcasts like a bias: [S] -> [1, S]
        arr = arr.reshape((1,) * (2 - arr.ndim) + tuple(arr.shape))
    return Dense(arr)


# ------------------------------------------------------------------------------------------
# Masks from strings (flags, configs): one grammar for the sweep, the configs and the Encoder

SPEC_GRAMMAR = """\
spec    := conj ("|" conj)*          either side allows
conj    := term ("&" term)*          both sides allow
term    := full | causal[:OFFSET] | window:LEFT:RIGHT | chunks:SIZE | dilated:LEFT:RIGHT:DILATION
         | global:I[,J...] | window_2d:WIDTH:ROW[:COL] | graph:DENSITY
         | bigbird[:KEY=VALUE...]  (block_size, window_blocks, num_global, num_random, seed, seq_len)"""


def _spec_int(spec, what, text):
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"masks.from_spec: bad spec {spec!r}: {what} must be an int, got {text!r}") from None


def _spec_term(term: str, spec: str, seq_len, seed) -> Mask:
    name, *args = term.strip().split(":")
    ints = lambda *whats: [_spec_int(spec, w, a) for w, a in zip(whats, args, strict=False)]  # noqa: E731
    arity = {"full": (0,), "causal": (0, 1), "window": (2,), "chunks": (1,), "dilated": (3,), "global": (1,)}
    arity |= {"window_2d": (2, 3), "graph": (1,)}
    if name in arity and len(args) not in arity[name]:
        raise ValueError(
            f"masks.from_spec: bad spec {spec!r}: {name!r} takes {' or '.join(map(str, arity[name]))} "
            f"':'-separated arguments, got {len(args)} in {term.strip()!r}"
        )
    match name:
        case "full":
            return full()
        case "causal":
            return causal(*ints("offset"))
        case "window":
            return window(*ints("left", "right"))
        case "chunks":
            return chunks(*ints("size"))
        case "dilated":
            return dilated(*ints("left", "right", "dilation"))
        case "global":
            return global_tokens([_spec_int(spec, "a global index", i) for i in args[0].split(",")])
        case "window_2d":
            return window_2d(*ints("width", "row_radius", "col_radius"))
        case "graph":
            if seq_len is None:
                raise ValueError(f"masks.from_spec: bad spec {spec!r}: 'graph:DENSITY' needs seq_len=")
            try:
                density = float(args[0])
            except ValueError:
                msg = f"masks.from_spec: bad spec {spec!r}: density must be a float, got {args[0]!r}"
                raise ValueError(msg) from None
            adj = np.random.default_rng(seed).random((seq_len, seq_len)) < density
            return graph(adj | np.eye(seq_len, dtype=bool))  # self-loops: no empty rows
        case "bigbird":
            kw = {"seed": seed, "seq_len": seq_len}
            keys = ("block_size", "window_blocks", "num_global", "num_random", "seed", "seq_len")
            for a in args:
                key, eq, val = a.partition("=")
                if not eq or key not in keys:
                    raise ValueError(f"masks.from_spec: bad spec {spec!r}: bigbird takes KEY=VALUE with KEY in {keys}")
                kw[key] = _spec_int(spec, key, val)
            n = kw.pop("seq_len")
            if n is None:
                raise ValueError(f"masks.from_spec: bad spec {spec!r}: 'bigbird' needs seq_len (argument or seq_len=N)")
            return bigbird(n, **kw)
    raise ValueError(f"masks.from_spec: bad spec {spec!r}: unknown mask {name!r}; expected\n{SPEC_GRAMMAR}")


def from_spec(spec: str, *, seq_len: int | None = None, seed: int = 0) -> Mask:
    """A structural mask from a string, e.g. ``"window:64:64"``, ``"causal & chunks:128"``.

    Grammar (``&`` binds tighter than ``|``; spaces are ignored)::

        spec    := conj ("|" conj)*
        conj    := term ("&" term)*
        term    := full | causal[:OFFSET] | window:LEFT:RIGHT | chunks:SIZE | dilated:LEFT:RIGHT:DILATION
                 | global:I[,J...] | window_2d:WIDTH:ROW[:COL] | graph:DENSITY | bigbird[:KEY=VALUE...]

    ``graph:DENSITY`` is a random adjacency with self-loops (numpy ``seed``) and ``bigbird`` needs
    ``seq_len`` (here or as ``seq_len=N`` in the spec); padding is data, not structure, so it has no spec.

    Raises:
        ValueError: naming the spec and what was expected.

    Example:
        >>> from_spec("window:1:0 | global:0").dense(3, 3).astype(int).tolist()
        [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"masks.from_spec: spec must be a non-empty string, got {spec!r}")
    either = []
    for conj in spec.split("|"):
        try:
            both = [_spec_term(t, spec, seq_len, seed) for t in conj.split("&")]
        except ValueError as e:  # a constructor's message (e.g. "left must be >= 0") gets the spec
            if str(e).startswith("masks.from_spec"):
                raise
            raise ValueError(f"masks.from_spec: bad spec {spec!r}: {e}") from None
        either.append(functools.reduce(lambda a, b: a & b, both))
    return functools.reduce(lambda a, b: a | b, either)
