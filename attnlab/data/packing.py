"""Packing variable-length sequences into fixed rows: the tokens, segment ids and positions.

Packing puts several sequences (documents) into one row of ``row_len`` tokens, so a batch carries
no padding but the tail of each row; ``masks.document(segment_ids)`` (with ``& masks.causal()`` for
a language model) keeps each document attending only within itself, and ``positions`` restart at 0
in every document, so a positional encoding sees each one as if it were alone.

Example:
    >>> p = pack([[5, 6, 7], [8, 9], [4]], row_len=4)
    >>> p.tokens.tolist(), p.segment_ids.tolist(), p.positions.tolist()
    ([[5, 6, 7, 4], [8, 9, 0, 0]], [[0, 0, 0, 1], [0, 0, -1, -1]], [[0, 1, 2, 0], [0, 1, 0, 0]])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Packed", "pack", "PAD_SEGMENT", "segment_positions"]

PAD_SEGMENT = -1  # the segment id of padding (pass it as masks.document(..., padding_id=PAD_SEGMENT))


@dataclasses.dataclass(frozen=True)
class Packed:
    """Rows of packed sequences, all int32 ``[R, row_len]`` (numpy).

    Attributes:
        tokens: the sequences' items, ``pad_value`` after the last one of a row.
        segment_ids: 0, 1, ... per document within its row; ``PAD_SEGMENT`` on padding.
        positions: the position of each token within its document (0 on padding).
        placement: for each input sequence, ``(row, start)``: where it went.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    placement: tuple[tuple[int, int], ...]

    @property
    def lengths(self) -> np.ndarray:
        """int32 ``[R]``: the real (non-padding) tokens of each row."""
        return (self.segment_ids != PAD_SEGMENT).sum(1).astype(np.int32)


def pack(sequences: Sequence[Sequence[int]], row_len: int, *, pad_value: int = 0) -> Packed:
    """First-fit-decreasing packing of ``sequences`` into rows of ``row_len`` tokens.

    Longer sequences are placed first, each into the first row with room (a new row when none has),
    which keeps rows nearly full; the order inside a row is the placement order.

    Args:
        sequences: non-empty sequences of ints (token ids), each of length <= ``row_len``.
        row_len: tokens per row.
        pad_value: the token written after a row's last sequence.

    Raises:
        ValueError: an empty or too long sequence, or ``row_len`` < 1.
    """
    if isinstance(row_len, bool) or not isinstance(row_len, (int, np.integer)) or row_len < 1:
        raise ValueError(f"row_len must be a positive int, got {row_len!r}")
    seqs = [np.asarray(s, np.int32).reshape(-1) for s in sequences]
    for i, s in enumerate(seqs):
        if not 1 <= s.size <= row_len:
            raise ValueError(f"sequences[{i}] has length {s.size}; each must have 1 to row_len={row_len} tokens")
    order = sorted(range(len(seqs)), key=lambda i: -seqs[i].size)
    free: list[int] = []  # room left per row
    rows: list[list[int]] = []  # sequence indices per row, in placement order
    for i in order:
        r = next((r for r, room in enumerate(free) if room >= seqs[i].size), None)
        if r is None:
            free.append(row_len)
            rows.append([])
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= seqs[i].size
    R = max(1, len(rows))
    tokens = np.full((R, row_len), pad_value, np.int32)
    segment_ids = np.full((R, row_len), PAD_SEGMENT, np.int32)
    positions = np.zeros((R, row_len), np.int32)
    placement = [None] * len(seqs)
    for r, members in enumerate(rows):
        start = 0
        for doc, i in enumerate(members):
            n = seqs[i].size
            tokens[r, start : start + n] = seqs[i]
            segment_ids[r, start : start + n] = doc
            positions[r, start : start + n] = np.arange(n)
            placement[i] = (r, start)
            start += n
    return Packed(tokens, segment_ids, positions, tuple(placement))


def segment_positions(segment_ids) -> jax.Array:
    """Each token's position within its segment, from segment ids ``[..., T]`` (traced or not): int32.

    A segment is a run of equal ids; the position counts from 0 at each run's first token (so padding,
    one run of ``PAD_SEGMENT``, counts too: its positions are never attended). Equals ``pack``'s
    ``positions`` on real tokens.

    Example:
        >>> segment_positions(jnp.array([0, 0, 0, 1, 1, 2])).tolist()
        [0, 1, 2, 0, 1, 0]
    """
    ids = jnp.asarray(segment_ids)
    if ids.ndim < 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be an integer array [..., T], got {getattr(ids, 'shape', ids)} {ids.dtype}")
    t = jnp.arange(ids.shape[-1], dtype=jnp.int32)
    new = jnp.concatenate([jnp.ones(ids.shape[:-1] + (1,), bool), ids[..., 1:] != ids[..., :-1]], axis=-1)
    start = jax.lax.cummax(jnp.where(new, t, 0), axis=ids.ndim - 1)
    return t - start
