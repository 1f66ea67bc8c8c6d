"""Masks from a function of positions: ``masks.predicate(fn, *arrays)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from attnlab.masks.base import Mask, leaf, mask_class


@mask_class
class Predicate(Mask):
    """``fn(q_idx [T', 1], k_idx [1, S'], *arrays) -> bool`` broadcastable to ``[..., N, T', S']``.

    ``fn`` is static structure (a new function is a new program; compared by identity, so define it
    once, not in a loop); ``arrays`` are pytree leaves (traced values reuse the compiled program).
    With concrete arrays the block layout is evaluated exactly; with traced ones it is PARTIAL
    everywhere (safe) and each tile is evaluated when visited.
    """

    fn: Callable | None = None
    arrays: tuple = leaf(default=())
    in_kernel: bool = False

    def __call__(self, q_idx, k_idx):
        out = jnp.asarray(self.fn(q_idx[:, None], k_idx[None, :], *(jnp.asarray(a) for a in self.arrays)))
        if out.dtype != bool:
            raise ValueError(f"predicate: fn must return a bool array, got dtype {out.dtype}")
        return jnp.broadcast_to(out, out.shape[:-2] + (q_idx.shape[0], k_idx.shape[0]))


def predicate(fn: Callable[..., Any], *arrays, in_kernel: bool = False) -> Mask:
    """A mask from a function of query and key positions (FlexAttention's ``mask_mod``).

    Args:
        fn: ``fn(q_idx, k_idx, *arrays) -> bool``; ``q_idx`` is int32 ``[T', 1]`` and ``k_idx``
            ``[1, S']`` (the positions of one tile, or of the whole [T, S] for ``dense``), and the
            result broadcasts to ``[..., N, T', S']``: index a per-example array ``x [*B, T]`` as
            ``x[..., q_idx]`` and add the head axis with ``[..., None, :, :]``.
        *arrays: the arrays ``fn`` reads (ids, lengths, tables): pytree leaves, may be traced.
        in_kernel: declare that ``fn`` is integer arithmetic on the positions alone (no arrays), so
            the Pallas kernel may evaluate it inside the kernel instead of from tile bitmaps.

    Example:
        >>> stripes = predicate(lambda q, k: (k - q) % 3 == 0)
        >>> stripes.dense(3, 4).astype(int).tolist()
        [[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 1, 0]]
    """
    if not callable(fn):
        raise ValueError(f"predicate: fn must be a callable fn(q_idx, k_idx, *arrays) -> bool, got {type(fn).__name__}")
    if in_kernel and arrays:
        raise ValueError("predicate: in_kernel=True is for functions of positions alone, but arrays were given")
    return Predicate(fn, tuple(jnp.asarray(a) if isinstance(a, (list, tuple)) else a for a in arrays), bool(in_kernel))
