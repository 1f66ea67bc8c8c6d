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

__all__ = ["Packed", "pack", "pack_pairs", "PAD_SEGMENT", "segment_positions"]

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


def _items(name: str, sequences, row_len: int, align: int) -> list[np.ndarray]:
    """Check and convert ``sequences``: each ``[n, ...]`` with 1 <= n <= row_len and one trailing shape."""
    seqs = []
    for i, s in enumerate(sequences):
        a = np.asarray(s)
        a = a.astype(np.int32) if (a.dtype == bool or np.issubdtype(a.dtype, np.integer)) else a
        a = a.reshape(-1) if a.ndim <= 1 else a
        if not 1 <= a.shape[0] <= row_len:
            raise ValueError(f"{name}[{i}] has length {a.shape[0]}; each must have 1 to row_len={row_len} items")
        if seqs and (a.shape[1:] != seqs[0].shape[1:] or a.dtype != seqs[0].dtype):
            raise ValueError(
                f"{name}[{i}] is {a.dtype} {a.shape}; every item must share {name}[0]'s dtype {seqs[0].dtype} "
                f"and trailing shape {seqs[0].shape[1:]}"
            )
        seqs.append(a)
    if align > 1 and row_len % align:
        raise ValueError(f"row_len={row_len} must be a multiple of align={align}")
    return seqs


def _check_len(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _slot(n: int, align: int) -> int:
    return -(-n // align) * align  # n rounded up to a multiple of align


def _place(sizes: list[tuple[int, ...]], capacity: tuple[int, ...]) -> list[list[int]]:
    """First-fit decreasing: item indices per row, in placement order (largest share of a row first)."""
    order = sorted(range(len(sizes)), key=lambda i: -max(s / c for s, c in zip(sizes[i], capacity, strict=True)))
    free: list[list[int]] = []
    rows: list[list[int]] = []
    for i in order:
        fits = (r for r, room in enumerate(free) if all(s <= f for s, f in zip(sizes[i], room, strict=True)))
        r = next(fits, None)
        if r is None:
            free.append(list(capacity))
            rows.append([])
            r = len(rows) - 1
        rows[r].append(i)
        free[r] = [f - s for f, s in zip(free[r], sizes[i], strict=True)]
    return rows


def _fill(seqs, rows, row_len: int, align: int, pad_value) -> Packed:
    R = max(1, len(rows))
    tail = seqs[0].shape[1:] if seqs else ()
    dtype = seqs[0].dtype if seqs else np.int32
    tokens = np.full((R, row_len, *tail), pad_value, dtype)
    segment_ids = np.full((R, row_len), PAD_SEGMENT, np.int32)
    positions = np.zeros((R, row_len), np.int32)
    placement = [None] * len(seqs)
    for r, members in enumerate(rows):
        start = 0
        for doc, i in enumerate(members):
            n = seqs[i].shape[0]
            tokens[r, start : start + n] = seqs[i]
            segment_ids[r, start : start + n] = doc
            positions[r, start : start + n] = np.arange(n)
            placement[i] = (r, start)
            start += _slot(n, align)
    return Packed(tokens, segment_ids, positions, tuple(placement))


def pack(sequences: Sequence, row_len: int, *, pad_value=0, align: int = 1) -> Packed:
    """First-fit-decreasing packing of ``sequences`` into rows of ``row_len`` items.

    Longer sequences are placed first, each into the first row with room (a new row when none has),
    which keeps rows nearly full; the order inside a row is the placement order.

    Args:
        sequences: non-empty sequences: token ids (ints, ``[n]``) or feature frames (``[n, F]``, any
            dtype; all with the same trailing shape), each of length <= ``row_len``.
        row_len: items per row.
        pad_value: what fills a row after its last sequence.
        align: every sequence starts at a multiple of ``align`` (the gap is padding). A stride-2
            subsampling front end needs it: ``EncoderDecoder(subsample=k)`` takes ``align=2**k``,
            so each document's frames are subsampled as they would be alone.

    Raises:
        ValueError: an empty or too long sequence, mixed trailing shapes, ``row_len`` < 1, or
            ``row_len`` not a multiple of ``align``.
    """
    row_len = _check_len("row_len", row_len)
    align = _check_len("align", align)
    seqs = _items("sequences", sequences, row_len, align)
    rows = _place([(_slot(s.shape[0], align),) for s in seqs], (row_len,))
    return _fill(seqs, rows, row_len, align, pad_value)


def pack_pairs(
    sources: Sequence,
    targets: Sequence,
    source_len: int,
    target_len: int,
    *,
    source_pad=0,
    target_pad=0,
    source_align: int = 1,
) -> tuple[Packed, Packed]:
    """Pack (source, target) pairs for an encoder-decoder: pair i goes to one row on both sides.

    The two ``Packed`` share rows and segment ids (pair i has the same row and document id in both),
    which is what ``EncoderDecoder(..., source_segment_ids=, target_segment_ids=)`` pairs by: target
    document d cross-attends to source document d of its row only.

    Args:
        sources, targets: equally many sequences (as ``pack`` takes: ids or ``[n, F]`` frames).
        source_len, target_len: row lengths of the two sides.
        source_pad, target_pad: fill values.
        source_align: sources start at multiples of it (``2**subsample`` for a conv front end).
    """
    source_len = _check_len("source_len", source_len)
    target_len = _check_len("target_len", target_len)
    source_align = _check_len("source_align", source_align)
    if len(sources) != len(targets):
        raise ValueError(f"sources and targets must pair up: got {len(sources)} sources and {len(targets)} targets")
    src = _items("sources", sources, source_len, source_align)
    tgt = _items("targets", targets, target_len, 1)
    sizes = [(_slot(s.shape[0], source_align), t.shape[0]) for s, t in zip(src, tgt, strict=True)]
    rows = _place(sizes, (source_len, target_len))
    return _fill(src, rows, source_len, source_align, source_pad), _fill(tgt, rows, target_len, 1, target_pad)


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
