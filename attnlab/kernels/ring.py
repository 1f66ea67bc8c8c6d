"""Ring attention: sequence-parallel attention whose key/value shards travel around a ring of devices.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(arXiv 2310.01889). Queries, keys and values are cut along the sequence into D equal shards, one
per device of a mesh axis. Each device keeps its query shard; at ring step r it holds key/value
shard ``(d - r) mod D``, folds it into its online-softmax state with the blockwise kernel's
block step (``blockwise.forward_carry``, global positions for the mask), and passes it to the
next device with ``lax.ppermute`` (issued before the step's compute, so the transfer can overlap
it). After D steps every query has seen every key; only one query shard, one travelling
key/value shard and the fp32 state live on a device: memory O(N / D).

The backward pass (a ``jax.custom_vjp``) rotates too: the key/value shard travels with its dk/dv
accumulators, each device adds the gradient its queries contribute (``blockwise._backward``
recomputes probabilities from the stored global log-sum-exp), and after D hops the accumulators
are back on the shard's own device.

A step whose (query shard, key shard) block is EMPTY in the mask's static block layout (causal:
every shard after the device's own; window: every shard out of reach) is skipped with
``lax.switch`` on a static [D, D] table; FULL blocks run without evaluating the mask; PARTIAL
blocks evaluate it tile by tile at global positions (and skip empty tiles at run time).

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
from attnlab.kernels import blockwise as bw

__all__ = ["shard_layout", "ring_attention_shard"]


def shard_layout(mask, T: int, S: int, D: int) -> np.ndarray:
    """Static int8 ``[D, D]`` layout of (query shard, key shard) pairs: EMPTY, PARTIAL or FULL.

    ``T`` and ``S`` are the true lengths; shards have ``ceil(T / D)`` and ``ceil(S / D)`` positions
    (the last ones padded). A shard that holds padded keys is at most PARTIAL so that the padding
    is masked; shards entirely past the end are EMPTY.
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


@dataclasses.dataclass(frozen=True)
class RingStatic:
    """Static description of one ring program (hashable)."""

    axis: str  # mesh axis the sequence is sharded over
    D: int  # devices on that axis
    T: int  # true global query length
    S: int  # true global key length
    Tl: int  # local (padded) shard lengths
    Sl: int
    layout: tuple  # [D][D] shard kinds (0 EMPTY, 1 PARTIAL, 2 FULL)
    st_partial: bw._Static  # blockwise statics for PARTIAL shard pairs (every tile PARTIAL)
    st_full: bw._Static  # ... for FULL shard pairs (every tile FULL, short last tile PARTIAL)
    sched_partial: tuple  # (index, kind) of the dense local schedule, as nested tuples
    sched_full: tuple


def make_static(mask, *, axis, D, T, S, lead, N, K, H, scale, compute_dtype, block_sizes) -> RingStatic:
    """Builds the static description; ``mask`` is the unpadded global mask (or None)."""
    Tl, Sl = -(-T // D), -(-S // D)
    bq, bk = min(block_sizes.block_q, Tl), min(block_sizes.block_k, Sl)
    nq, nk = -(-Tl // bq), -(-Sl // bk)
    layout = shard_layout(mask, T, S, D)
    sp, sf = (bw.block_schedule(np.full((nq, nk), kd, np.int8), Sl, bk) for kd in (masks_lib.PARTIAL, masks_lib.FULL))

    def st(kinds):
        return bw._Static(
            T=Tl,
            S=Sl,
            bq=bq,
            bk=bk,
            lead=tuple(lead),
            N=N,
            K=K,
            scale=scale,
            has_bias=False,
            kinds_used=tuple(np.unique(kinds).tolist()),
            kinds_used_t=(),
            compute_dtype=jnp.dtype(compute_dtype).name,
            backward="fused",
        )

    def as_tuple(a):
        return tuple(map(tuple, a.tolist()))

    return RingStatic(
        axis=axis,
        D=D,
        T=T,
        S=S,
        Tl=Tl,
        Sl=Sl,
        layout=as_tuple(layout),
        st_partial=st(sp[1]),
        st_full=st(sf[1]),
        sched_partial=(as_tuple(sp[0]), as_tuple(sp[1])),
        sched_full=(as_tuple(sf[0]), as_tuple(sf[1])),
    )


def _global_mask(mask, rs: RingStatic, q_off, k_off):
    """The mask at global positions: local tile positions + shard offsets; keys past S masked."""

    def fn(q_idx, k_idx):
        qg, kg = q_idx + q_off, k_idx + k_off
        ok = (kg < rs.S)[None, :]
        if mask is not None:
            ok = ok & mask(jnp.minimum(qg, rs.T - 1), jnp.minimum(kg, rs.S - 1))
        return ok

    return fn


def _shard_kind(rs: RingStatic, d, src):
    return jnp.asarray(np.array(rs.layout, np.int32))[d, src]


def _perm(rs: RingStatic):
    return [(i, (i + 1) % rs.D) for i in range(rs.D)]  # device i sends to i + 1: i then holds i - 1


def _fwd_impl(qs, ks, vs, mask, rs: RingStatic):
    d = jax.lax.axis_index(rs.axis)
    sp = tuple(jnp.asarray(np.array(x, np.int32)) for x in rs.sched_partial)
    sf = tuple(jnp.asarray(np.array(x, np.int32)) for x in rs.sched_full)

    def step(carry, r):
        state, kt, vt = carry
        nxt = jax.lax.ppermute((kt, vt), rs.axis, _perm(rs))  # send on, independent of this step's work
        src = (d - r) % rs.D
        gm = _global_mask(mask, rs, d * rs.Tl, src * rs.Sl)

        def partial(c):
            return bw.forward_carry(qs, kt, vt, gm, (), *sp, c, st=rs.st_partial, bias_fn=None)

        def full(c):
            return bw.forward_carry(qs, kt, vt, gm, (), *sf, c, st=rs.st_full, bias_fn=None)

        state = jax.lax.switch(_shard_kind(rs, d, src), [lambda c: c, partial, full], state)
        return (state, *nxt), None

    init = bw.init_carry(qs, vs.shape[-1])
    (state, _, _), _ = jax.lax.scan(step, (init, ks, vs), jnp.arange(rs.D, dtype=jnp.int32))
    return bw.finalize(*state)


def _bwd_impl(qs, ks, vs, mask, out, lse, dout, rs: RingStatic):
    d = jax.lax.axis_index(rs.axis)
    sp = tuple(jnp.asarray(np.array(x, np.int32)) for x in rs.sched_partial)
    sf = tuple(jnp.asarray(np.array(x, np.int32)) for x in rs.sched_full)

    def step(carry, r):
        dq, kt, vt, dkt, dvt = carry
        nxt = jax.lax.ppermute((kt, vt), rs.axis, _perm(rs))
        src = (d - r) % rs.D
        gm = _global_mask(mask, rs, d * rs.Tl, src * rs.Sl)

        def run(sched, st):
            def f(c):
                dq, dkt, dvt = c
                dq_r, dkt, dvt, _ = bw._backward(
                    qs, kt, vt, gm, (), *sched, out, lse, dout, st=st, bias_fn=None, dk0=dkt, dv0=dvt
                )
                return dq + dq_r, dkt, dvt

            return f

        dq, dkt, dvt = jax.lax.switch(
            _shard_kind(rs, d, src),
            [lambda c: c, run(sp, rs.st_partial), run(sf, rs.st_full)],
            (dq, dkt, dvt),
        )
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
    return dq.astype(qs.dtype), dk.astype(ks.dtype), dv.astype(vs.dtype), bw.zero_cotangents(mask)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_shard(q, k, v, mask, rs: RingStatic):
    """Per-device ring attention; call inside ``jax.shard_map`` over axis ``rs.axis``.

    Args:
        q: local query shard ``[B, Tl, N, H]`` (global positions ``d * Tl ...``).
        k: local key shard ``[B, Sl, K, H]``.
        v: local value shard ``[B, Sl, K, Hv]``.
        mask: the global ``attnlab.masks`` mask (replicated; evaluated at global positions) or None.
        rs: from ``make_static``.

    Returns:
        ``[B, Tl, N, Hv]`` in q's dtype.
    """
    st = rs.st_full
    out = _ring(bw.tile_q(q, st), bw.tile_kv(k, st), bw.tile_kv(v, st), mask, rs)
    return bw.untile(out, st, rs.Tl).astype(q.dtype)
