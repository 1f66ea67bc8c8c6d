"""TPU splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) fed by attnlab masks.

Splash attention is jax's block-sparse flash kernel for TPUs: its ``MaskInfo`` is the same
EMPTY / PARTIAL / FULL block idea as attnlab's ``block_layout``. This module adapts attnlab's
conventions to it:

* ``causal()`` -> ``CausalMask``, ``window(left, right)`` -> ``LocalMask`` (splash's own
  in-kernel computable masks), ``full()`` / None -> ``FullMask``; any other mask whose structure is
  known at trace time (chunks, dilated, global tokens, BigBird, 2-D windows, a concrete graph or
  dense array, their ``&`` / ``|``) through ``_AttnlabMask``, an adapter of splash's mask interface
  (``shape`` and slice ``__getitem__``) that evaluates the attnlab mask one block at a time, so
  splash derives its block layout and partial-block bitmaps from it;
* padding lengths (concrete or traced) become segment ids: key s of example b gets segment 1 when
  s < kv_len[b] and 0 otherwise, queries segment 1; T and S are padded to whole blocks the same
  way; padded query rows are sliced off;
* GQA: the K key/value heads run splash's MQA kernel on their G query heads each (``vmap``);
* ``scale`` is folded into q (splash has no scale argument); rows with no allowed key (a padded
  query, a row the mask empties) are set to zeros with ``jnp.where``, which also zeroes their
  gradients (splash itself returns a finite average there).

Kernel or interpreter is chosen for the backend the trace is for (``attnlab.platform.target()``): Mosaic
on a TPU (``jax.export(..., platforms=["tpu"])`` from a CPU host inside ``attnlab.lowering_for("tpu")``
contains the ``tpu_custom_call``), Pallas interpret mode elsewhere.

Shape legend: B batch (leading dims flattened), T / S query / key length, N query heads, K kv
heads, G = N // K, H head dim (splash needs Hv == H).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib
from attnlab import numerics, platform
from attnlab.call import Call, bind

__all__ = ["splash_attention", "attend", "DEFAULT_BLOCK", "DTYPES"]

DEFAULT_BLOCK = 128  # splash's default; segment ids need block_kv to be a multiple of 128 lanes
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _sa():
    from jax.experimental.pallas.ops.tpu import splash_attention  # noqa: PLC0415 (heavy import)

    return splash_attention


# ------------------------------------------------------------------------------------------
# Mask decomposition and adapter


class _AttnlabMask:
    """splash's mask interface (``shape``, slice ``__getitem__``) over one head of an attnlab mask.

    Positions past the real lengths T, S (block padding) are False.
    """

    def __init__(self, mask, T: int, S: int, Tp: int, Sp: int, head: int = 0):
        self.mask, self.T, self.S, self._shape, self.head = mask, T, S, (Tp, Sp), head

    @property
    def shape(self):
        return self._shape

    def __getitem__(self, idx):
        qs, ks = idx
        q0, q1, _ = qs.indices(self._shape[0])
        k0, k1, _ = ks.indices(self._shape[1])
        out = np.zeros((q1 - q0, k1 - k0), bool)
        qe, ke = min(q1, self.T), min(k1, self.S)
        if qe > q0 and ke > k0:
            with jax.ensure_compile_time_eval():
                vals = np.asarray(self.mask(jnp.arange(q0, qe), jnp.arange(k0, ke)))
            vals = vals.reshape((-1,) + vals.shape[-2:])
            vals = vals[self.head if vals.shape[0] > 1 else 0]
            out[: qe - q0, : ke - k0] = np.broadcast_to(vals, (qe - q0, ke - k0))
        return out

    def __bool__(self):
        raise NotImplementedError("use & and | on masks")


def splash_mask(rest, T, S, Tp, Sp, head):
    """attnlab mask (no padding factors) -> a splash Mask for one head on the padded [Tp, Sp] grid.

    A mask of the interval form ``t + lo <= s <= t + hi`` (``Mask.interval``: full, causal, windows
    and their ``&``) becomes splash's own in-kernel mask; anything else the block-evaluating adapter.
    """
    sa = _sa()
    shape = (Tp, Sp)
    bounds = (None, None) if rest is None else rest.interval()
    if bounds == (None, None):
        return sa.FullMask(shape)
    if bounds is not None:
        lo, hi = bounds
        if lo is None:
            return sa.CausalMask(shape, offset=hi)  # keys past S are cut by the segment ids
        # LocalMask: t + offset - left <= s <= t + offset + right, with left, right >= 0
        offset = 0 if lo <= 0 and (hi is None or hi >= 0) else lo
        return sa.LocalMask(shape, window_size=(offset - lo, None if hi is None else hi - offset), offset=offset)
    # give the adapter splash's Mask base class (its & / | and type checks) without importing
    # splash at module import time
    return type("AttnlabSplashMask", (_AttnlabMask, sa.Mask), {})(rest, T, S, Tp, Sp, head)


def _first_allowed(rest, T, S, bq, bk, heads):
    """int [heads, T]: the first key each query row may attend to (S when none), from the layout."""
    first = np.full((heads, T), S, np.int64)
    if rest is None:
        first[:] = 0
        return first
    layout = rest.block_layout(T, S, bq, bk)
    with jax.ensure_compile_time_eval():
        for i in range(layout.shape[0]):
            q_idx = np.arange(i * bq, min((i + 1) * bq, T))
            rows = first[:, q_idx[0] : q_idx[-1] + 1]
            for j in np.nonzero(layout[i])[0]:
                if (rows < S).all():
                    break
                k_idx = np.arange(j * bk, min((j + 1) * bk, S))
                vals = np.asarray(rest(jnp.asarray(q_idx), jnp.asarray(k_idx)))
                vals = np.broadcast_to(vals.reshape((-1,) + vals.shape[-2:]), (heads, q_idx.size, k_idx.size))
                hit = vals.any(-1)
                idx = k_idx[0] + vals.argmax(-1)
                rows[...] = np.where((rows == S) & hit, idx, rows)
    return first


# ------------------------------------------------------------------------------------------
# Public API


def _block_sizes(block):
    sa = _sa()
    return sa.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )


def splash_attention(q, k, v, *, mask=None, bias=None, scale=None, block=None):
    """Attention through jax's TPU splash kernel (Pallas interpret mode on CPU).

    Args:
        q: ``[..., T, N, H]`` (float32 or bfloat16).
        k: ``[..., S, K, H]``, N % K == 0.
        v: ``[..., S, K, H]`` (splash needs Hv == H).
        mask: an attnlab mask or bool array, or None; see the module docstring for the mapping.
            Only padding lengths may be traced.
        bias: must be None.
        scale: logit scale; default ``1/sqrt(H)`` (folded into q).
        block: splash block size (a multiple of 128); default 128.

    Returns:
        ``[..., T, N, H]`` in q's dtype; rows with no allowed key are zeros (zero gradients).

    Raises:
        ValueError: when the implementation does not support the call (``attnlab.impls.splash``), or on a
            bad block size.
    """
    call = bind(q, k, v, mask=mask, bias=bias, scale=scale, fn="splash_attention")
    from attnlab.impls.splash import SPLASH  # noqa: PLC0415 (the protocol lives with the implementation)

    if (why := SPLASH.check(call, "tpu" if platform.target() == "tpu" else "cpu")) is not None:
        raise ValueError(f"{call.fn}: {why}")
    return attend(call, block=block)


def attend(call: Call, *, block=None):
    """``splash_attention`` on a bound call (``attnlab.call.bind``) that the implementation supports."""
    q, k, v = call.q, call.k, call.v
    block = DEFAULT_BLOCK if block is None else block
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block <= 0 or block % 128:
        raise ValueError(f"block must be a positive multiple of 128, got {block!r}")
    if call.empty:
        return call.zeros()
    lead, T, S, N, K, H = call.lead, call.T, call.S, call.N, call.K, call.H
    B, G = call.batch, N // K
    Tp, Sp = -(-T // block) * block, -(-S // block) * block
    pads, rest = ((), None) if call.mask is None else call.mask.split_padding()
    rest = None if rest is None else rest.for_tiles()
    head_dep = (
        rest is not None and len(jax.eval_shape(rest, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)).shape) == 3
    )
    heads = (
        N if head_dep and jax.eval_shape(rest, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)).shape[0] == N else 1
    )
    ql, kl = masks_lib.padding_lengths(pads, lead, T, S)
    use_segments = bool(pads) or Sp != S
    first = _first_allowed(rest, T, S, block, block, heads)  # [heads, T]
    if (first >= S).all():  # no allowed pair at all (jax's splash mask info asserts on an all-empty mask)
        return call.zeros()

    scale = numerics.default_scale(H, call.score.scale)
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(B, T, K, G, H)
    qs = jnp.pad(qs, ((0, 0), (0, Tp - T), (0, 0), (0, 0), (0, 0))).transpose(0, 2, 3, 1, 4)  # [B, K, G, Tp, H]
    ks = jnp.pad(k.reshape(B, S, K, H), ((0, 0), (0, Sp - S), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # [B, K, Sp, H]
    vs = jnp.pad(v.reshape(B, S, K, H), ((0, 0), (0, Sp - S), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    kv_seg = (jnp.arange(Sp)[None, :] < kl[:, None]).astype(jnp.int32)  # [B, Sp]; 0 never matches
    q_seg = jnp.ones((B, Tp), jnp.int32)

    sa = _sa()

    def run_group(kh, qg, kg, vg, qsg, kvsg, interpret):
        """One kv head: q [B, G, Tp, H], k/v [B, Sp, H] -> [B, G, Tp, H]."""
        hm = [splash_mask(rest, T, S, Tp, Sp, kh * G + g if heads > 1 else 0) for g in range(G)]
        if heads == 1:
            hm = [hm[0]] * G
        kernel = sa.make_splash_mqa_single_device(
            sa.MultiHeadMask(hm), block_sizes=_block_sizes(block), interpret=interpret
        )

        def one(qb, kb, vb, qsb, kvsb):
            seg = sa.SegmentIds(q=qsb, kv=kvsb) if use_segments else None
            return kernel(qb, kb, vb, segment_ids=seg)

        return jax.vmap(one)(qg, kg, vg, qsg, kvsg)

    def run(qs, ks, vs, q_seg, kv_seg, interpret):
        if heads == 1:  # the same mask for every kv head: vmap over K
            f = jax.vmap(
                functools.partial(run_group, 0, interpret=interpret), in_axes=(1, 1, 1, None, None), out_axes=1
            )
            return f(qs, ks, vs, q_seg, kv_seg)
        outs = [run_group(kh, qs[:, kh], ks[:, kh], vs[:, kh], q_seg, kv_seg, interpret) for kh in range(K)]
        return jnp.stack(outs, 1)

    # Mosaic on a TPU, else the interpreter
    out = run(qs, ks, vs, q_seg, kv_seg, interpret=platform.target() != "tpu")  # [B, K, G, Tp, H]
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, Tp, N, H)[:, :T]
    # rows with no allowed key: past q_len, or the mask's first allowed key is not < kv_len
    first_n = np.broadcast_to(first, (N, T)) if heads == 1 else first  # [N, T]
    nonempty = (jnp.asarray(first_n.T)[None] < kl[:, None, None]) & (jnp.arange(T)[None, :, None] < ql[:, None, None])
    out = jnp.where(nonempty[..., None], out, 0).astype(q.dtype)  # [B, T, N, H]
    return out.reshape(*lead, T, N, H)
