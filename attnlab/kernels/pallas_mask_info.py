"""What the Pallas flash kernel needs to know about a mask, made outside the kernel.

An attnlab mask is split, by asking it (``split_padding``, ``conjuncts``, ``in_kernel``,
``for_tiles``), into three parts:

* padding lengths -> an int32 kernel input ``[B, 2]`` (q_len, kv_len), concrete or traced, so a new
  length never recompiles and never densifies the structural part's layout;
* an in-kernel part: the factors whose ``__call__`` is integer arithmetic on positions (causal,
  window, chunks, dilated, block band, 2-D window and their ``&``/``|``), evaluated from ``iota``;
* a data part (graph adjacency, dense arrays, global tokens, random blocks) -> per-tile int8
  bitmaps ``[Bm, Nm, P, bq, bk]`` for the visited tiles only.

Tiles that the mask fills and only the padding lengths may cut get the schedule kind ``LENGTHS``
(checked against the lengths alone).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib
from attnlab.kernels import _tiles

__all__ = ["LENGTHS", "MaskInfo", "mask_info", "runtime_schedules", "tile_bitmaps"]

LENGTHS = 3  # schedule kind: a tile the mask fills (FULL) that only padding lengths may cut


class MaskInfo:
    """The split of one mask for a (T, S, bq, bk) tiling.

    Attributes:
        lens: int32 ``[B, 2]`` (q_len, kv_len).
        struct: the in-kernel part (a mask without leaves) or None.
        data: the bitmap part (a mask) or None.
        sched, sched_t: int32 ``[nq, 2, J]`` / ``[nk, 2, I]``: the schedule and its transpose.
    """

    def __init__(self, lens, struct, data, sched, sched_t, layout=None):
        self.lens, self.struct, self.data, self.sched, self.sched_t = lens, struct, data, sched, sched_t
        self.layout = layout  # the static layout the schedules came from (kinds incl. LENGTHS)


def mask_info(m, lead, T: int, S: int, bq: int, bk: int) -> MaskInfo:
    """Splits mask ``m`` (an attnlab mask or None) and builds the forward and transposed schedules."""
    nq, nk = -(-T // bq), -(-S // bk)
    layout = np.full((nq, nk), masks_lib.FULL, np.int8) if m is None else m.block_layout(T, S, bq, bk)
    layout = _tiles.adjust_layout(layout, S, bk)
    pads, rest = ((), None) if m is None else m.split_padding()
    struct, data = [], []
    for f in () if rest is None else rest.conjuncts():
        (struct if f.in_kernel else data).append(f.for_tiles())  # an edge list is scattered once, not per tile
    struct, data = masks_lib.and_all(struct), masks_lib.and_all(data)
    if pads:  # tiles that only the padding lengths make PARTIAL check the lengths alone
        rest_layout = np.full_like(layout, masks_lib.FULL) if rest is None else rest.block_layout(T, S, bq, bk)
        rest_layout = _tiles.adjust_layout(rest_layout, S, bk)
        layout = np.where((layout == masks_lib.PARTIAL) & (rest_layout == masks_lib.FULL), LENGTHS, layout)
    ql, kl = masks_lib.padding_lengths(pads, lead, T, S)
    sched, sched_t = _tiles.padded_schedule(layout), _tiles.padded_schedule(layout.T)
    return MaskInfo(jnp.stack([ql, kl], -1), struct, data, sched, sched_t, layout)


def runtime_schedules(info: MaskInfo, runtime, S: int, bk: int):
    """The schedules refined on device by the mask's ``runtime_layout`` (traced data): int32
    ``[nq, 2, J]`` and ``[nk, 2, I]`` with each row's non-empty tiles first (the kernels loop over the
    leading non-zero kinds). A tile is EMPTY if either layout says so and FULL if the runtime one does
    (the lengths included); otherwise it keeps its static kind (PARTIAL or LENGTHS)."""
    layout = jnp.asarray(info.layout, jnp.int32)
    runtime = runtime.astype(jnp.int32)
    refined = jnp.where(runtime == masks_lib.EMPTY, masks_lib.EMPTY, layout)
    refined = jnp.where((runtime == masks_lib.FULL) & (layout != masks_lib.EMPTY), masks_lib.FULL, refined)
    if S % bk:  # the short last key block keeps its tail masked
        last = refined[:, -1]
        refined = refined.at[:, -1].set(jnp.where(last == masks_lib.FULL, masks_lib.PARTIAL, last))

    def rows(lay, width):
        nonempty = lay != masks_lib.EMPTY
        order = jnp.argsort(~nonempty, axis=1, stable=True)[:, :width].astype(jnp.int32)
        kind = jnp.where(jnp.take_along_axis(nonempty, order, axis=1), jnp.take_along_axis(lay, order, axis=1), 0)
        if order.shape[1] < width:  # fewer columns than the padded (power of two) width
            pad = width - order.shape[1]
            order, kind = jnp.pad(order, ((0, 0), (0, pad))), jnp.pad(kind, ((0, 0), (0, pad)))
        return jnp.stack([order, kind.astype(jnp.int32)], 1)

    return rows(refined, info.sched.shape[-1]), rows(refined.T, info.sched_t.shape[-1])


def tile_bitmaps(data, qb, kb, st: _tiles.Static):
    """data mask on tiles (qb[p], kb[p]) -> int8 ``[Bm, Nm, P, bq, bk]`` (Bm in {1, B}, Nm in {1, N})."""
    nl = len(st.lead)

    def one(i, j):
        q_pos = jnp.minimum(i * st.bq + jnp.arange(st.bq, dtype=jnp.int32), st.T - 1)
        k_pos = jnp.minimum(j * st.bk + jnp.arange(st.bk, dtype=jnp.int32), st.S - 1)
        x = data(q_pos, k_pos)
        x = x.reshape((1,) * (nl + 3 - x.ndim) + tuple(x.shape))  # -> [*lead|1, N|1, bq, bk]
        if any(d != 1 for d in x.shape[:nl]):
            x = jnp.broadcast_to(x, st.lead + x.shape[nl:])
        x = x.reshape((-1,) + x.shape[nl:])  # [Bm, Nm, bq, bk]
        return jnp.broadcast_to(x, x.shape[:2] + (st.bq, st.bk)).astype(jnp.int8)

    out = jax.vmap(one)(jnp.asarray(qb), jnp.asarray(kb))  # [P, Bm, Nm, bq, bk]
    return jnp.moveaxis(out, 0, 2)
