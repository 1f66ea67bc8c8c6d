"""What the Pallas flash kernel needs to know about a mask, made outside the kernel.

An attnlab mask is split, by asking it (``split_padding``, ``conjuncts``, ``in_kernel``,
``for_tiles``), into three parts:

* padding lengths -> an int32 kernel input ``[B, 2]`` (q_len, kv_len), concrete or traced, so a new
  length never recompiles and never densifies the structural part's layout;
* an in-kernel part: the factors whose ``__call__`` is integer arithmetic on positions (causal,
  window, chunks, dilated, block band, 2-D window and their ``&``/``|``), evaluated from ``iota``;
* a data part (graph adjacency, dense arrays, global tokens, random blocks) -> per-tile int8
  bitmaps ``[Bm, Nm, P, bq, bk]`` for the visited tiles only.

The block layout the kernels schedule from (``attnlab.kernels.schedule``) is the whole mask's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib

__all__ = ["MaskInfo", "mask_info", "tile_bitmaps"]


class MaskInfo:
    """The split of one mask for a (T, S, bq, bk) tiling.

    Attributes:
        lens: int32 ``[B, 2]`` (q_len, kv_len).
        struct: the in-kernel part (a mask without leaves) or None.
        data: the bitmap part (a mask) or None.
        layout: the whole mask's static block layout int8 ``[nq, nk]`` (not yet adjusted for a short
            last key block: ``schedule.Schedule`` does that).
    """

    def __init__(self, lens, struct, data, layout):
        self.lens, self.struct, self.data, self.layout = lens, struct, data, layout


def mask_info(m, lead, T: int, S: int, bq: int, bk: int) -> MaskInfo:
    """Splits mask ``m`` (an attnlab mask or None) into lengths, in-kernel part and data part."""
    nq, nk = -(-T // bq), -(-S // bk)
    layout = np.full((nq, nk), masks_lib.FULL, np.int8) if m is None else m.block_layout(T, S, bq, bk)
    pads, rest = ((), None) if m is None else m.split_padding()
    struct, data = [], []
    for f in () if rest is None else rest.conjuncts():
        (struct if f.in_kernel else data).append(f.for_tiles())  # an edge list is scattered once, not per tile
    struct, data = masks_lib.and_all(struct), masks_lib.and_all(data)
    ql, kl = masks_lib.padding_lengths(pads, lead, T, S)
    return MaskInfo(jnp.stack([ql, kl], -1), struct, data, layout)


def tile_bitmaps(data, qb, kb, *, T: int, S: int, bq: int, bk: int, lead: tuple):
    """data mask on tiles (qb[p], kb[p]) -> int8 ``[Bm, Nm, P, bq, bk]`` (Bm in {1, B}, Nm in {1, N})."""
    nl = len(lead)

    def one(i, j):
        q_pos = jnp.minimum(i * bq + jnp.arange(bq, dtype=jnp.int32), T - 1)
        k_pos = jnp.minimum(j * bk + jnp.arange(bk, dtype=jnp.int32), S - 1)
        x = data(q_pos, k_pos)
        x = x.reshape((1,) * (nl + 3 - x.ndim) + tuple(x.shape))  # -> [*lead|1, N|1, bq, bk]
        if any(d != 1 for d in x.shape[:nl]):
            x = jnp.broadcast_to(x, tuple(lead) + x.shape[nl:])
        x = x.reshape((-1,) + x.shape[nl:])  # [Bm, Nm, bq, bk]
        return jnp.broadcast_to(x, x.shape[:2] + (bq, bk)).astype(jnp.int8)

    out = jax.vmap(one)(jnp.asarray(qb), jnp.asarray(kb))  # [P, Bm, Nm, bq, bk]
    return jnp.moveaxis(out, 0, 2)
