"""The Mask base class, layouts, ``&``/``|`` combinations, dense arrays, and the pytree field markers."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, dataclass_transform

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import _pytree  # register_dataclass with the class in the treedef

EMPTY, PARTIAL, FULL = 0, 1, 2


def leaf(**kwargs):
    """A mask field holding arrays (lengths, adjacency, edges, sub-masks): a pytree leaf, traced under jit/vmap.

    Every other field of a ``@mask_class`` is static structure (hashable Python values: a new value
    is a new program). Declare it where the field is: ``lengths: Any = leaf(default=None)``.
    """
    return dataclasses.field(metadata={"leaf": True}, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, leaf))
def mask_class(cls):
    """Class decorator for a Mask: a frozen dataclass registered as a pytree by its fields' ``leaf()`` marks.

    Type checkers read it as the dataclass it makes (``typing.dataclass_transform``): ``Causal(offset=1)``
    type-checks as its fields say.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    _pytree.register_dataclass(
        cls,
        data_fields=[f.name for f in fields if f.metadata.get("leaf")],
        meta_fields=[f.name for f in fields if not f.metadata.get("leaf")],
    )
    return cls


def is_concrete(x) -> bool:
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
        return all(is_concrete(leaf) for leaf in jax.tree_util.tree_leaves(self))

    def block_layout(self, T: int, S: int, block_q: int, block_k: int) -> np.ndarray:
        """Static block layout, int8 ``[ceil(T/block_q), ceil(S/block_k)]``.

        0 = EMPTY, 1 = PARTIAL, 2 = FULL. Positions past T or S (in the last, short block) are
        not counted: a short last block is FULL when every in-range pair may attend.
        """
        _check_lengths(T, S)
        _check_blocks(block_q, block_k)
        layout = np.asarray(self._layout(T, S, block_q, block_k), dtype=np.int8)
        return layout

    def runtime_layout(self, T: int, S: int, block_q: int, block_k: int) -> jax.Array | None:
        """The block layout computed *on device* from the mask's arrays, or None when it has no such rule.

        For masks whose data may be traced (padding lengths, document ids): an int8 jax array
        ``[ceil(T/block_q), ceil(S/block_k)]``, as safe as ``block_layout`` (EMPTY or FULL only when
        certain for every batch element) and at least as exact, whatever the values; a new value never
        recompiles. Kernels schedule from the static ``block_layout`` and refine it with this one at run
        time (a tile it calls EMPTY costs nothing, a FULL one skips the element mask). None means the
        static layout is all there is (structural masks, or data known at trace time).
        """
        return None

    def _layout(self, T: int, S: int, bq: int, bk: int) -> np.ndarray:
        # Safe default: evaluate the mask block by block when its values are known now,
        # otherwise call every block PARTIAL.
        if not self.is_static:
            return np.full((_num_blocks(T, bq), _num_blocks(S, bk)), PARTIAL, np.int8)
        return layout_by_evaluation(self, T, S, bq, bk)

    # ---- what the mask says about itself (kernels ask these; none of them lists mask classes)

    #: True when ``__call__`` is integer arithmetic on the positions alone (no arrays, no constants),
    #: so a kernel can evaluate it inside a tile from ``iota`` positions (Pallas, Triton).
    in_kernel: bool = False

    def conjuncts(self) -> tuple[Mask, ...]:
        """The factors of an ``&`` tree, ``full()`` left out (``full()`` itself has none)."""
        return (self,)

    def split_padding(self) -> tuple[tuple[Mask, ...], Mask | None]:
        """-> (the padding factors of the ``&`` tree, the product of the other factors or None)."""
        pads = tuple(c for c in self.conjuncts() if c.is_padding)
        rest = [c for c in self.conjuncts() if not c.is_padding]
        return pads, and_all(rest)

    #: True for ``masks.padding(...)`` (per-example lengths).
    is_padding: bool = False

    @property
    def is_full(self) -> bool:
        """True when every pair may attend (``full()`` or an ``&`` of them): no mask at all."""
        return not self.conjuncts()

    def interval(self) -> tuple[int | None, int | None] | None:
        """``(lo, hi)`` when the mask is exactly ``t + lo <= s <= t + hi`` (None = unbounded), else None.

        ``full()`` is ``(None, None)``, ``causal(o)`` is ``(None, o)``, ``window(l, r, offset=o)`` is
        ``(o - l, o + r)``; an ``&`` of such masks is their intersection. This is the form that
        flag-driven kernels (cuDNN's ``is_causal`` / ``local_window_size``, splash's causal and local
        masks) take.
        """
        return None

    def for_tiles(self) -> Mask:
        """The same mask in the form cheapest to evaluate once per tile (an edge list becomes its
        adjacency, scattered once); most masks are already in that form."""
        return self

    def edge_list(self):
        """``(senders, receivers, num_nodes)`` when the mask is a graph given as an edge list, else None."""
        return None

    def __and__(self, other: Mask) -> Mask:
        return And(self, as_mask(other, "other"))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, as_mask(other, "other"))

    def __rand__(self, other):
        return And(as_mask(other, "other"), self)

    def __ror__(self, other):
        return Or(as_mask(other, "other"), self)


def layout_by_evaluation(
    mask: Mask, T: int, S: int, bq: int, bk: int, todo=None, *, dense_max=None, numpy_form=None
) -> np.ndarray:
    """Exact layout by evaluating ``mask`` (values known now) on the blocks where ``todo`` is True (all by default).

    Up to ``dense_max`` pairs (default ``DENSE_EVAL_MAX`` = 2**23) the mask is evaluated once on
    ``[T, S]``; beyond, each query-block row is evaluated once on the key blocks still to decide, so a
    banded (or BigBird's scattered) set of PARTIAL blocks costs O(T * band), not O(T * S). The rows
    share one compiled program (``_block_row``, sized for the row with the most blocks to decide), so
    a long sequence costs one compile and a call per row, not the mask's every op dispatched per row.
    ``numpy_form(q_idx, k_idx)``: the mask's values in numpy, where a mask has them (no compile at all).
    """
    nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
    layout = np.full((nq, nk), PARTIAL, np.int8)
    if todo is None:
        todo = np.ones((nq, nk), bool)
    if T * S <= (DENSE_EVAL_MAX if dense_max is None else dense_max):
        return np.where(todo, _layout_of_dense(mask, T, S, bq, bk), layout).astype(np.int8)
    rows = {i: cols for i in range(nq) if (cols := np.nonzero(todo[i])[0]).size}
    most = max((cols.size for cols in rows.values()), default=0)
    with jax.ensure_compile_time_eval():
        on_device = mask if numpy_form is not None else jax.tree.map(jnp.asarray, mask)  # copied once, not per row

        def row(q0, keys):  # int32 positions (faster in numpy than int64)
            if numpy_form is not None:
                return numpy_form(np.minimum(q0 + np.arange(bq, dtype=np.int32), T - 1), np.minimum(keys, S - 1))
            return _block_row(on_device, q0, keys, bq=bq, T=T, S=S)

        for i, cols in rows.items():
            keys = (np.pad(cols, (0, most - cols.size), mode="edge")[:, None] * bk + np.arange(bk)).astype(np.int32)
            values = np.asarray(row(i * bq, keys.ravel()))  # keys: [most * bk]
            # [rows, most, bk]: a position past T or S was clamped to the last one, in the same (short) last
            # block, so it repeats a value of its own block and changes neither "any" nor "all"
            values = np.broadcast_to(values, values.shape[:-2] + (bq, most * bk)).reshape(-1, most, bk)
            empty, full = ~values.any(-1).any(0), values.all(-1).all(0)
            layout[i, cols] = _from_flags(empty, full)[: cols.size]
    return layout


@functools.partial(jax.jit, static_argnames=("bq", "T", "S"))
def _block_row(mask: Mask, q0, k_idx, *, bq: int, T: int, S: int) -> jax.Array:
    """``mask`` on queries ``q0 ... q0 + bq - 1`` and keys ``k_idx``, every index clamped into ``[0, T)`` /
    ``[0, S)`` (a clamped position repeats the last one, in the same block): one program for every block
    row of a layout. The mask is an argument (a pytree): its arrays are not baked into the program."""
    q_idx = jnp.minimum(q0 + jnp.arange(bq), T - 1)
    return mask(q_idx, jnp.minimum(k_idx, S - 1))


DENSE_EVAL_MAX = 2**23


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
    """Elements `layout_by_evaluation` evaluates for `todo` row by row: each query-block row with a block
    to decide, on as many key blocks as the row with the most."""
    counts = todo.sum(1)
    return int((counts > 0).sum()) * bq * int(counts.max(initial=0)) * bk


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


@mask_class
class Dense(Mask):
    """A plain boolean array broadcastable to ``[..., N, T, S]``, wrapped as a mask."""

    array: Any = leaf()

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


def _block_ranges(length, block):
    start = np.arange(_num_blocks(length, block)) * block
    return start, np.minimum(start + block, length) - 1  # first and last position of each block


def _from_flags(empty, full):
    return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)


def _combine_layouts(a, b, op, xp=np):
    """Layouts of two masks -> the layout of their ``&`` (op "and") or ``|``; ``xp`` numpy or jax.numpy."""
    if op == "and":
        out = xp.where((a == EMPTY) | (b == EMPTY), EMPTY, xp.where((a == FULL) & (b == FULL), FULL, PARTIAL))
    else:
        out = xp.where((a == FULL) | (b == FULL), FULL, xp.where((a == EMPTY) & (b == EMPTY), EMPTY, PARTIAL))
    return out.astype(xp.int8)


def _combine_runtime(mask, T, S, bq, bk, op):
    """runtime_layout of an ``&`` / ``|``: the parts' runtime layouts, a part without one by its static layout."""
    a, b = mask.a.runtime_layout(T, S, bq, bk), mask.b.runtime_layout(T, S, bq, bk)
    if a is None and b is None:
        return None
    a = jnp.asarray(mask.a.block_layout(T, S, bq, bk)) if a is None else a
    b = jnp.asarray(mask.b.block_layout(T, S, bq, bk)) if b is None else b
    return _combine_layouts(a, b, op, xp=jnp)


def block_ranges(length: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) position of each block of ``block`` positions in ``[0, length)``."""
    return _block_ranges(length, block)


@mask_class
class And(Mask):
    """Both masks must allow the pair."""

    a: Mask = leaf()
    b: Mask = leaf()

    def __call__(self, q_idx, k_idx):
        return self.a(q_idx, k_idx) & self.b(q_idx, k_idx)

    @property
    def in_kernel(self) -> bool:
        return self.a.in_kernel and self.b.in_kernel

    def conjuncts(self):
        return self.a.conjuncts() + self.b.conjuncts()

    def interval(self):
        a, b = self.a.interval(), self.b.interval()
        if a is None or b is None:
            return None
        lo = [x for x in (a[0], b[0]) if x is not None]
        hi = [x for x in (a[1], b[1]) if x is not None]
        return (max(lo) if lo else None, min(hi) if hi else None)

    def for_tiles(self):
        return And(self.a.for_tiles(), self.b.for_tiles())

    def runtime_layout(self, T, S, bq, bk):
        return _combine_runtime(self, T, S, bq, bk, "and")

    def dense(self, T, S):
        return self.a.dense(T, S) & self.b.dense(T, S)

    def _layout(self, T, S, bq, bk):
        layout = _combine_layouts(self.a._layout(T, S, bq, bk), self.b._layout(T, S, bq, bk), "and")
        return _refine(self, layout, T, S, bq, bk)


@mask_class
class Or(Mask):
    """Either mask may allow the pair."""

    a: Mask = leaf()
    b: Mask = leaf()

    def __call__(self, q_idx, k_idx):
        return self.a(q_idx, k_idx) | self.b(q_idx, k_idx)

    @property
    def in_kernel(self) -> bool:
        return self.a.in_kernel and self.b.in_kernel

    def for_tiles(self):
        return Or(self.a.for_tiles(), self.b.for_tiles())

    def runtime_layout(self, T, S, bq, bk):
        return _combine_runtime(self, T, S, bq, bk, "or")

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
    exact = layout_by_evaluation(mask, T, S, bq, bk, todo)
    return np.where(todo, exact, layout).astype(np.int8)


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


def and_all(masks) -> Mask | None:
    """``masks[0] & masks[1] & ...``, or None for an empty sequence."""
    masks = list(masks)
    if not masks:
        return None
    out = masks[0]
    for m in masks[1:]:
        out = out & m
    return out


def bool_mask_hint(x) -> str:
    """What to pass instead of a non-bool mask array ``x``, read from its values when they are known.

    A float array of 0 and -inf is an additive mask (a bias): ``bias=x``, or the bool mask ``x == 0``
    (``x != 0`` would invert it); an array of 0 and 1 is ``x != 0``; other floats are a bias. Traced
    values (under jit) cannot be read: the hint names both readings.

    Example:
        >>> bool_mask_hint(np.array([0.0, -np.inf]))
        'an array of 0 and -inf is an additive mask: pass it as `bias=x`, or use `mask=(x == 0)` (True = attend)'
    """
    if not is_concrete(x):
        return (
            "use `x != 0` for a 0/1 mask (1 = attend), `x == 0` for an additive 0/-inf mask "
            "(or pass that one as `bias=x`), or an attnlab.masks object"
        )
    values = np.unique(np.asarray(x))
    if np.isin(values, [0.0, -np.inf]).all() and np.isneginf(values).any():
        return "an array of 0 and -inf is an additive mask: pass it as `bias=x`, or use `mask=(x == 0)` (True = attend)"
    if np.isin(values, [0, 1]).all():
        return "use `mask=(x != 0)` (1 = attend), or an attnlab.masks object"
    if np.issubdtype(values.dtype, np.floating):
        return "a float array other than 0/1 is not a mask: pass it as `bias=x` (added to the logits)"
    return "use `mask=(x != 0)` (nonzero = attend), or an attnlab.masks object"


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
        raise ValueError(f"{name} must be a bool array (True = attend), got dtype {arr.dtype}; {bool_mask_hint(arr)}")
    if arr.ndim < 2:  # rank 0 or 1 broadcasts like a bias: [S] -> [1, S]
        arr = arr.reshape((1,) * (2 - arr.ndim) + tuple(arr.shape))
    return Dense(arr)
