"""Ring attention: sequence-parallel attention whose key/value shards travel around a ring of devices.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(arXiv 2310.01889). Queries, keys and values are cut along the sequence into D equal shards, one
per device of a mesh axis. Each device keeps its query shard; at ring step r it holds key/value
shard ``(d - r) mod D``, folds it into its online-softmax state with the blockwise kernel's
block step (``xla_loops.forward_carry`` on the tile core, global positions for the mask), and passes it to the
next device with ``lax.ppermute`` (issued before the step's compute, so the transfer can overlap
it). After D steps every query has seen every key; only one query shard, one travelling
key/value shard and the fp32 state live on a device: memory O(N / D).

The backward pass (a ``jax.custom_vjp``) rotates too: the key/value shard travels with its dk/dv
accumulators, each device adds the gradient its queries contribute (``xla_loops.backward``
recomputes probabilities from the stored global log-sum-exp), and after D hops the accumulators
are back on the shard's own device.

A step whose (query shard, key shard) pair is EMPTY in the mask's static block layout (causal:
every shard after the device's own; window: every shard out of reach) is skipped.

Causal attention is unbalanced on a contiguous ring: device d's queries see d + 1 of the D key
shards, so the last device does ~D times the work of the first, and as the ring moves in lockstep
every step waits for the busiest device. ``layout="zigzag"`` (the split of
ring-flash-attention and of Llama 3's context parallelism, arXiv 2407.21783; Striped Attention,
arXiv 2311.09431, stripes single positions instead) cuts the sequence into 2D chunks and gives
device d chunks d and 2D-1-d: every device holds one early and one late chunk, and for causal
attention every step after the first does the same number of tiles on every device. The
reordering is two ``ppermute`` s in and two out (no gather).

The work of each (query shard, key shard) pair comes from the mask's static block layout at tile
resolution: chunks are a whole number of tiles, so every local tile is one global block. The
distinct tile layouts among the D x D pairs are compiled once each (``lax.switch`` on a static
[D, D] table; all-EMPTY pairs are skipped), each with the blockwise kernel's static schedule
(EMPTY tiles not visited, FULL tiles without evaluating the mask, PARTIAL tiles evaluated at
global positions).

This module holds the per-device function, called inside ``jax.shard_map``;
``attnlab.parallel.attention`` is the public entry point that pads, shards and calls it.

Shape legend: B batch (leading dims flattened), Tl / Sl the local query / key shard lengths,
N / K local query / kv heads, G = N // K, H / Hv head dims, D the ring size (devices on the axis).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib
from attnlab import scores as scores_lib
from attnlab.kernels import schedule, xla_loops
from attnlab.kernels import tile_core as core

__all__ = [
    "LAYOUTS",
    "shard_layout",
    "pair_layouts",
    "global_positions",
    "RingStatic",
    "make_static",
    "ring_attention_shard",
]

LAYOUTS = ("contiguous", "zigzag")  # how the sequence's chunks are assigned to the ring's devices


def shard_layout(mask, T: int, S: int, D: int) -> np.ndarray:
    """Static int8 ``[D, D]`` layout of (query shard, key shard) pairs: EMPTY, PARTIAL or FULL.

    ``T`` and ``S`` are the true lengths; shards have ``ceil(T / D)`` and ``ceil(S / D)`` positions
    (the last ones padded). A shard that holds padded keys is at most PARTIAL so that the padding
    is masked; shards entirely past the end are EMPTY. A coarse summary of a contiguous ring (one
    kind per pair); the ring program itself works from the tile-level ``pair_layouts``.
    """
    Tl, Sl = -(-T // D), -(-S // D)
    layout = np.full((D, D), masks_lib.EMPTY, np.int8)
    if mask is None:
        inner = np.full((-(-T // Tl), -(-S // Sl)), masks_lib.FULL, np.int8)
    else:
        inner = mask.block_layout(T, S, Tl, Sl)
    layout[: inner.shape[0], : inner.shape[1]] = inner
    if S % Sl:  # the shard holding key S - 1 also holds padding (shards past it are EMPTY)
        last = (S - 1) // Sl
        layout[:, last] = np.minimum(layout[:, last], masks_lib.PARTIAL)
    return layout


def chunking(L: int, n: int, block: int) -> tuple[int, int]:
    """(chunk length C, tile b) for L positions cut into n equal chunks of whole tiles b <= block.

    C = ceil(L / n) rounded up to a whole number of tiles, the tile shrunk so that little is
    padded: ceil(L / n) = 625 with block 512 gives 2 tiles of 313 (C = 626), not one of 1024.
    """
    c0 = max(1, -(-L // n))
    tiles = -(-c0 // block)
    b = -(-c0 // tiles)
    return tiles * b, b


def global_positions(idx, d, C: int, D: int, layout: str):
    """Global (padded) sequence positions of local positions ``idx`` on device ``d``.

    contiguous: device d holds chunk d (length C); zigzag: chunks d and 2D-1-d (C each, local
    positions C.. are the second). Works on numpy and on traced values.
    """
    if layout == "contiguous":
        return d * C + idx
    return d * C + idx + (idx >= C) * (2 * (D - 1 - d) * C)


def pair_layouts(mask, T: int, S: int, D: int, block_sizes, layout: str = "contiguous"):
    """Static tile layouts of every (query device, key device) pair of a ring.

    Args:
        mask: the unpadded global mask, or None (full attention).
        T, S: true global lengths. D: devices on the ring.
        block_sizes: ``BlockSizes`` (upper bounds: tiles are shrunk so chunks are whole tiles).
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).

    Returns:
        ``(layouts, (Cq, bq), (Ck, bk))``: int8 ``[D, D, nq, nk]`` (0 EMPTY, 1 PARTIAL, 2 FULL; tile
        (i, j) of pair (d, s) is query tile i of device d against key tile j of device s), and the
        chunk lengths and tiles of queries and keys (local lengths are ``Cq`` / ``Ck`` times the
        chunks per device: 1 contiguous, 2 zigzag). Key tiles holding padding are at most PARTIAL
        (the padding is masked); tiles entirely past T or S are EMPTY.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    n = 1 if layout == "contiguous" else 2
    (Cq, bq), (Ck, bk) = chunking(T, n * D, block_sizes.block_q), chunking(S, n * D, block_sizes.block_k)
    glob = np.full((n * D * Cq // bq, n * D * Ck // bk), masks_lib.EMPTY, np.int8)  # padded global tiles
    if mask is None:
        inner = np.full((-(-T // bq), -(-S // bk)), masks_lib.FULL, np.int8)
    else:
        inner = mask.block_layout(T, S, bq, bk)
    glob[: inner.shape[0], : inner.shape[1]] = inner
    if S % bk:  # the tile holding key S - 1 also holds padding
        glob[:, (S - 1) // bk] = np.minimum(glob[:, (S - 1) // bk], masks_lib.PARTIAL)
    dev = np.arange(D)[:, None]
    qt = global_positions(np.arange(n * Cq // bq)[None, :] * bq, dev, Cq, D, layout) // bq  # [D, nq]
    kt = global_positions(np.arange(n * Ck // bk)[None, :] * bk, dev, Ck, D, layout) // bk  # [D, nk]
    return glob[qt[:, None, :, None], kt[None, :, None, :]], (Cq, bq), (Ck, bk)


MAX_PAIR_CLASSES = 8  # distinct pair layouts compiled as branches; beyond, pairs are coarsened


def _coarsen_if_many(layouts: np.ndarray) -> np.ndarray:
    """[D, D, nq, nk] -> the same, or, when more than MAX_PAIR_CLASSES distinct non-empty pair
    layouts would each compile a forward and a backward branch (an irregular mask: Dense, Graph),
    every non-empty pair made all FULL (when it is) or all PARTIAL (empty tiles then skipped at
    run time after evaluating the mask): at most 2 branches, at some cost per visited tile."""
    D = layouts.shape[0]
    distinct = {layouts[d, s].tobytes() for d in range(D) for s in range(D) if layouts[d, s].any()}
    if len(distinct) <= MAX_PAIR_CLASSES:
        return layouts
    nonempty = layouts.any((2, 3), keepdims=True)
    full = (layouts == masks_lib.FULL).all((2, 3), keepdims=True)
    kind = np.where(full, masks_lib.FULL, np.where(nonempty, masks_lib.PARTIAL, masks_lib.EMPTY))
    return np.broadcast_to(kind, layouts.shape).astype(np.int8)


@dataclasses.dataclass(frozen=True)
class RingClass:
    """One distinct tile layout of a (query shard, key shard) pair, with its blockwise schedule."""

    ls: xla_loops.LoopSpec
    index: tuple  # [nq][J] key tiles each query tile visits, FULL ones first (schedule.rows)
    counts: tuple  # [nq][2] (n_full, n_partial)


@dataclasses.dataclass(frozen=True)
class RingStatic:
    """Static description of one ring program (hashable)."""

    axis: str  # mesh axis the sequence is sharded over
    D: int  # devices on that axis
    T: int  # true global query length
    S: int  # true global key length
    layout: str  # "contiguous" or "zigzag"
    Cq: int  # chunk lengths (a device holds 1 chunk, or 2 for zigzag)
    Ck: int
    Tl: int  # local (padded) shard lengths
    Sl: int
    table: tuple  # [D][D] class of pair (device, key shard): 0 nothing to do, c -> classes[c - 1]
    classes: tuple  # RingClass per distinct non-empty pair layout


def make_static(
    mask, *, axis, D, T, S, lead, N, K, H, scale, compute_dtype, block_sizes, layout="contiguous"
) -> RingStatic:
    """Builds the static description; ``mask`` is the unpadded global mask (or None)."""
    layouts, (Cq, bq), (Ck, bk) = pair_layouts(mask, T, S, D, block_sizes, layout)
    n = 1 if layout == "contiguous" else 2
    Tl, Sl = n * Cq, n * Ck

    def as_tuple(a):
        return tuple(map(tuple, a.tolist()))

    layouts = _coarsen_if_many(layouts)
    classes, ids = [], {}
    table = np.zeros((D, D), np.int32)
    for d in range(D):
        for s in range(D):
            lay = layouts[d, s]
            if not lay.any():
                continue
            key = lay.tobytes()
            if key not in ids:
                sc = schedule.Schedule(lay, Sl, bk)
                ls = xla_loops.LoopSpec(
                    core=core.tile_spec(scores_lib.Dot(scale), H, Tl, Sl),
                    bq=bq,
                    bk=bk,
                    lead=tuple(lead),
                    N=N,
                    K=K,
                    compute_dtype=jnp.dtype(compute_dtype).name,
                    kinds=sc.kinds,
                )
                classes.append(RingClass(ls=ls, index=as_tuple(sc.index), counts=as_tuple(sc.counts)))
                ids[key] = len(classes)
            table[d, s] = ids[key]
    return RingStatic(
        axis=axis,
        D=D,
        T=T,
        S=S,
        layout=layout,
        Cq=Cq,
        Ck=Ck,
        Tl=Tl,
        Sl=Sl,
        table=as_tuple(table),
        classes=tuple(classes),
    )


def _global_mask(mask, rs: RingStatic, d, src):
    """The mask at global positions of device d's queries and key shard src; keys past S masked."""

    def fn(q_idx, k_idx):
        qg = global_positions(q_idx, d, rs.Cq, rs.D, rs.layout)
        kg = global_positions(k_idx, src, rs.Ck, rs.D, rs.layout)
        ok = (kg < rs.S)[None, :]
        if mask is not None:
            ok = ok & mask(jnp.minimum(qg, rs.T - 1), jnp.minimum(kg, rs.S - 1))
        return ok

    return fn


def _pair_class(rs: RingStatic, d, src):
    return jnp.asarray(np.array(rs.table, np.int32))[d, src]


def _schedule(c: RingClass):
    return jnp.asarray(np.array(c.index, np.int32)), jnp.asarray(np.array(c.counts, np.int32))


def _perm(rs: RingStatic):
    return [(i, (i + 1) % rs.D) for i in range(rs.D)]  # device i sends to i + 1: i then holds i - 1


def _fwd_impl(qs, ks, vs, mask, rs: RingStatic):
    d = jax.lax.axis_index(rs.axis)

    def step(carry, r):
        state, kt, vt = carry
        nxt = jax.lax.ppermute((kt, vt), rs.axis, _perm(rs))  # send on, independent of this step's work
        src = (d - r) % rs.D
        gm = _global_mask(mask, rs, d, src)

        def run(c: RingClass):
            return lambda s: xla_loops.forward_carry(qs, kt, vt, gm, (), (), *_schedule(c), s, ls=c.ls, bias_fn=None)

        branches = [lambda s: s] + [run(c) for c in rs.classes]
        state = jax.lax.switch(_pair_class(rs, d, src), branches, state)
        return (state, *nxt), None

    init = xla_loops.init_carry(qs, vs.shape[-1])
    (state, _, _), _ = jax.lax.scan(step, (init, ks, vs), jnp.arange(rs.D, dtype=jnp.int32))
    return xla_loops.finalize(*state, ls=rs.classes[0].ls)


def _bwd_impl(qs, ks, vs, mask, out, lse, dout, rs: RingStatic):
    d = jax.lax.axis_index(rs.axis)

    def step(carry, r):
        dq, kt, vt, dkt, dvt = carry
        nxt = jax.lax.ppermute((kt, vt), rs.axis, _perm(rs))
        src = (d - r) % rs.D
        gm = _global_mask(mask, rs, d, src)

        def run(c: RingClass):
            def f(acc):
                dq, dkt, dvt = acc
                dq_r, dkt, dvt, _, _ = xla_loops.backward(
                    qs, kt, vt, gm, (), (), *_schedule(c), out, lse, dout, ls=c.ls, bias_fn=None, dk0=dkt, dv0=dvt
                )
                return dq + dq_r, dkt, dvt

            return f

        branches = [lambda acc: acc] + [run(c) for c in rs.classes]
        dq, dkt, dvt = jax.lax.switch(_pair_class(rs, d, src), branches, (dq, dkt, dvt))
        dkt, dvt = jax.lax.ppermute((dkt, dvt), rs.axis, _perm(rs))  # the accumulators travel with the shard
        return (dq, *nxt, dkt, dvt), None

    z = functools.partial(jnp.zeros, dtype=jnp.float32)
    init = (z(qs.shape), ks, vs, z(ks.shape), z(vs.shape))
    (dq, _, _, dk, dv), _ = jax.lax.scan(step, init, jnp.arange(rs.D, dtype=jnp.int32))
    return dq, dk, dv  # after D hops each dk/dv accumulator is home again


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(qs, ks, vs, mask, rs):
    return _fwd_impl(qs, ks, vs, mask, rs)[0]


def _ring_fwd(qs, ks, vs, mask, rs):
    out, lse = _fwd_impl(qs, ks, vs, mask, rs)
    return out, (qs, ks, vs, mask, out, lse)


def _ring_bwd(rs, res, dout):
    qs, ks, vs, mask, out, lse = res
    dq, dk, dv = _bwd_impl(qs, ks, vs, mask, out, lse, dout, rs)
    return dq.astype(qs.dtype), dk.astype(ks.dtype), dv.astype(vs.dtype), xla_loops.zero_cotangents(mask)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _to_zigzag(x, rs: RingStatic, C: int):
    """[B, 2C, ...] holding padded chunks 2d, 2d+1 on device d -> chunks d, 2D-1-d (two ppermutes).

    Chunk c goes to device c (first half) when c < D, else to device 2D-1-c (second half). The
    chunks of one parity land on distinct devices, so each half of the input travels in one
    ppermute; device d's chunk d arrives with the parity of d, chunk 2D-1-d with the other.
    """
    D = rs.D
    dest = lambda c: c if c < D else 2 * D - 1 - c  # noqa: E731
    halves = (x[:, :C], x[:, C:])
    recv = [jax.lax.ppermute(halves[h], rs.axis, [(e, dest(2 * e + h)) for e in range(D)]) for h in (0, 1)]
    odd = jax.lax.axis_index(rs.axis) % 2 == 1
    first, second = jnp.where(odd, recv[1], recv[0]), jnp.where(odd, recv[0], recv[1])
    return jnp.concatenate([first, second], axis=1)


def _from_zigzag(x, rs: RingStatic, C: int):
    """Inverse of ``_to_zigzag``: chunk c (on device d, half h) goes home to device c // 2."""
    D = rs.D
    even_chunk = lambda e: e if e % 2 == 0 else 2 * D - 1 - e  # noqa: E731  of chunks e, 2D-1-e
    odd = jax.lax.axis_index(rs.axis) % 2 == 1
    halves = (x[:, :C], x[:, C:])
    send_even, send_odd = jnp.where(odd, halves[1], halves[0]), jnp.where(odd, halves[0], halves[1])
    even = jax.lax.ppermute(send_even, rs.axis, [(e, even_chunk(e) // 2) for e in range(D)])
    odd_ = jax.lax.ppermute(send_odd, rs.axis, [(e, (2 * D - 1 - even_chunk(e)) // 2) for e in range(D)])
    return jnp.concatenate([even, odd_], axis=1)


def ring_attention_shard(q, k, v, mask, rs: RingStatic):
    """Per-device ring attention; call inside ``jax.shard_map`` over axis ``rs.axis``.

    Args:
        q: local query shard ``[B, Tl, N, H]``: padded global positions ``d * Tl ...`` (contiguous
            shards whatever ``rs.layout``; the zig-zag reordering happens in here).
        k: local key shard ``[B, Sl, K, H]``.
        v: local value shard ``[B, Sl, K, Hv]``.
        mask: the global ``attnlab.masks`` mask (replicated; evaluated at global positions) or None.
        rs: from ``make_static``.

    Returns:
        ``[B, Tl, N, Hv]`` in q's dtype, the same positions as q.
    """
    if rs.layout == "zigzag":
        q = _to_zigzag(q, rs, rs.Cq)
        k, v = _to_zigzag(k, rs, rs.Ck), _to_zigzag(v, rs, rs.Ck)
    if not rs.classes:  # nothing attends anywhere: zeros (the empty-row convention)
        return jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)
    ls = rs.classes[0].ls  # tiling, scale and dtype are the same in every class
    out = _ring(xla_loops.tile_q(q, ls), xla_loops.tile_kv(k, ls), xla_loops.tile_kv(v, ls), mask, rs)
    out = xla_loops.untile(out, ls, rs.Tl).astype(q.dtype)
    if rs.layout == "zigzag":
        out = _from_zigzag(out, rs, rs.Cq)
    return out
