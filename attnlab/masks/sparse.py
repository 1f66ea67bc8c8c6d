"""The sparse family (static structure): chunks, dilated windows, global tokens, random blocks, BigBird."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attnlab.masks.base import Mask, _block_ranges, _check_int, _from_flags, _num_blocks, mask_class


@mask_class
class Chunks(Mask):
    """Non-overlapping chunks: t attends to s iff they are in the same chunk of ``size`` (LRA's local attention)."""

    size: int
    in_kernel = True

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


@mask_class
class Dilated(Mask):
    """Dilated window: t attends to s iff -left <= s - t <= right and (s - t) % dilation == 0.

    ``dilated(L, 0, d) & causal()`` with L >= T is the Sparse Transformer's strided pattern
    (Child et al. 2019, arXiv 1904.10509); with small L it is Longformer's dilated window.
    """

    left: int
    right: int
    dilation: int
    in_kernel = True

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


@mask_class
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


@mask_class
class BlockBand(Mask):
    """Blocked sliding window: block t // block_size attends to blocks within ``half`` of it (BigBird)."""

    block_size: int
    half: int
    in_kernel = True

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


@mask_class
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
        >>> (chunks(1) | global_tokens([0])).dense(3, 3).astype(int).tolist()  # chunks(1) = the diagonal
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
