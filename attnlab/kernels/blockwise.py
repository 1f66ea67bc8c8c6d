"""Block-sparse, flash-style attention in pure JAX: O(N) memory forward and backward.

The queries are cut into blocks of ``block_q`` rows and the keys into blocks of ``block_k``
columns. The mask's static ``block_layout`` says which (query block, key block) pairs are EMPTY
(skipped: never loaded, never multiplied), FULL (no mask is evaluated) or PARTIAL (the mask is
evaluated on that block only, with ``mask(q_idx, k_idx)``). For each query block the kernel runs
an online softmax (Milakov & Gimelshein 2018, arXiv 1805.02867) over its non-empty key blocks,
keeping a running max ``m``, a running sum ``l`` and an fp32 accumulator, as in FlashAttention
(Dao et al. 2022, arXiv 2205.14135). Only the output and the log-sum-exp ``L = m + log l`` per
row (kept as the pair m, log l) are stored; the backward pass (a ``jax.custom_vjp``) recomputes
each block's probabilities from ``L`` instead of storing ``[T, S]`` of them, so memory is O(T + S) in both directions.

Shape legend (as ``jax.nn.dot_product_attention``):
    B    batch (all leading dims flattened)   T, S  query / key length
    N    query heads, K kv heads, G = N // K  H, Hv  head dims
    nq, nk  number of query / key blocks     bq, bk  block sizes
    J    the longest list of non-empty key blocks of any query block

Inside, everything is heads-first and three-dimensional: ``[B, T, N, H]`` is transposed once
to ``[nq, B*K, G*bq, H]`` (the G query heads that share a key head are stacked as extra rows of
one tile, so each tile product is one plain batched matmul over B*K) and back once at the end.
Keys and values become ``[nk, B*K, bk, H]``. (A five-dimensional ``[B, K, G, bq, bk]`` tile costs
XLA:CPU a relayout copy of every logit tile; the flat tile ran full attention 10-25% faster.)
A band (one key span per query block, ``xla_loops.wide_spans``) is the exception in its forward: each
step moves only its own query rows and key span to that layout (``_flash_wide``), since the whole-array
moves were a large share of a window's forward (docs/kernels.md, "Against FlexAttention").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib
from attnlab import platform
from attnlab import scores as scores_lib
from attnlab.call import Call, bind
from attnlab.kernels import schedule
from attnlab.kernels import tile_core as core
from attnlab.kernels.xla_loops import (  # the lax loops on the tile core (also used by ring)
    LoopSpec,
    backward,
    backward_wide,
    flat_kv,
    forward,
    forward_wide,
    row_tiles,
    tile_kv,
    tile_q,
    untile,
    wide_spans,
    zero_cotangents,
)
from attnlab.numerics import compute_dtype, dropout_keep

__all__ = [
    "BlockSizes",
    "default_block_sizes",
    "pick_block_sizes",
    "blockwise_attention",
    "attend",
    "dropout_keep",
]


BiasFn = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tile sizes of the blockwise kernel (Python ints; changing them recompiles).

    Attributes:
        block_q: queries per block (rows of one tile).
        block_k: keys per block (columns of one tile).

    The backward is one pass over query blocks carrying full-size dk/dv (5 tile matmuls plus tile
    transposes per tile).
    """

    block_q: int
    block_k: int

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            b = getattr(self, name)
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0:
                raise ValueError(f"{name} must be a positive int, got {b!r}")


# Per-backend defaults (dense, sparse). CPU dense: 512 x 256, chosen on the 2-core development
# machine (2026-11-30) among {256, 512, 1024, 2048} x {128, 256, 512} against torch SDPA in one
# process: tiles must be tall enough that XLA:CPU splits each tile matmul over both cores (256 x 256
# and 512 x 128 tiles run on one: 0.5x) and small enough to stay in cache (1024 x 512 and larger fall
# back). 512 x 256 and 1024 x 256 were within noise forward; 512 x 256 was 5-10% faster
# forward+backward and under load. CPU sparse: 64 x 64 is the best of {32, ..., 256}^2 for a ±128
# window at N = 4K (little work wasted on the band's edges). GPU/TPU: 128-wide tiles, the usual
# flash choice (untested here: no accelerator was available).
_DEFAULTS = {
    "cpu": (BlockSizes(512, 256), BlockSizes(64, 64)),
    "gpu": (BlockSizes(128, 128), BlockSizes(128, 128)),
    "tpu": (BlockSizes(512, 512), BlockSizes(128, 128)),
}


def default_block_sizes(backend: str | None = None, *, sparse: bool = False) -> BlockSizes:
    """Default tile sizes for ``backend`` (default: ``attnlab.platform.target()``).

    Args:
        backend: ``"cpu"``, ``"gpu"``, ``"tpu"``, or None for the backend the trace is for.
        sparse: True for masks with many empty blocks (windows, block-sparse graphs): smaller tiles.
    """
    backend = platform.normalize(backend)
    dense, sparse_ = _DEFAULTS[backend]
    return sparse_ if sparse else dense


# A tile's fixed cost (loop step, mask and softmax bookkeeping) counted in (query, key) pairs.
_TILE_OVERHEAD_PAIRS = 64 * 64

# One key span per query block instead of a tile list (``xla_loops.wide_spans``) when every row's non-empty
# key blocks are contiguous, span at most WIDE_MAX_KEYS keys and bq * span <= WIDE_MAX_PAIRS (so the
# sparse 64 x 64 tiles of a window qualify, the dense 512 x 256 tiles do not).
WIDE_MAX_KEYS = 512
WIDE_MAX_PAIRS = 64 * 512


def pick_block_sizes(m, T: int, S: int, backend: str | None = None, layout_fn=None) -> BlockSizes:
    """The backend's dense or sparse tiles, whichever visits fewer pairs (plus a per-tile cost).

    The block layout is always safe, so it is consulted for every mask: a window, chunks or BigBird
    mask ANDed with *traced* padding lengths keeps the EMPTY tiles of its structural part (the
    padding only turns tiles PARTIAL), and gets the small tiles it would get with concrete lengths.
    """
    dense, sparse = default_block_sizes(backend), default_block_sizes(backend, sparse=True)
    if m is None:
        return dense
    layout_fn = layout_fn or (lambda bq, bk: m.block_layout(T, S, bq, bk))

    def cost(bs):
        bq, bk = min(bs.block_q, T), min(bs.block_k, S)
        tiles = int((layout_fn(bq, bk) != masks_lib.EMPTY).sum())
        return tiles * (bq * bk + _TILE_OVERHEAD_PAIRS)

    return sparse if cost(sparse) < cost(dense) else dense


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _flash(q, k, v, mask, leaves, consts, seed, sched, ls, bias_fn):
    """sched = (index, counts): the schedule (``attnlab.kernels.schedule``), int32 arrays.

    seed: uint32 [2], the dropout seed (unused when ``ls.dropout_rate == 0``).
    Returns (out [nq, B*K, G*bq, Hv] fp32, lse [nq, B*K, G*bq] fp32 natural, -inf on empty rows).
    """
    out, lse = forward(q, k, v, mask, leaves, consts, *sched, ls=ls, bias_fn=bias_fn, seed=seed)
    return out, core.lse_natural(*lse, base2=ls.core.base2)


def _flash_fwd(q, k, v, mask, leaves, consts, seed, sched, ls, bias_fn):
    out, lse = forward(q, k, v, mask, leaves, consts, *sched, ls=ls, bias_fn=bias_fn, seed=seed)
    return (out, core.lse_natural(*lse, base2=ls.core.base2)), (q, k, v, mask, leaves, consts, seed, sched, out, lse)


def _flash_bwd(ls, bias_fn, res, cts):
    q, k, v, mask, leaves, consts, seed, sched, out, lse = res
    dout, dlse = cts
    dq, dk, dv, dls, dcs = backward(
        q, k, v, mask, leaves, consts, *sched, out, lse, dout, ls=ls, bias_fn=bias_fn, seed=seed, dlse=dlse
    )
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return (
        *grads,
        zero_cotangents(mask),
        core.cast_cotangents(dls, leaves),
        core.cast_cotangents(dcs, consts),
        zero_cotangents(seed),
        zero_cotangents(sched),
    )


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash_wide(q, k, v, mask, leaves, consts, starts, ls, bias_fn):
    """One key span per query block (``ls.wide``) on the ``[B, T, N, H]`` layout, T and S padded to whole
    blocks: (out [B, T, N, Hv] fp32, lse [B, T, N] fp32, -inf on empty rows). The forward alone reads its
    tiles from that layout in place (``forward_wide(rows=True)``); under differentiation the queries are tiled
    and the keys and values laid out one row per head (``flat_kv``) once, shared by the forward and
    ``backward_wide``."""
    out, lse = forward_wide(q, k, v, mask, leaves, consts, starts, ls=ls, bias_fn=bias_fn, rows=True)
    return out, core.lse_natural(*lse, base2=ls.core.base2)


def _flash_wide_fwd(q, k, v, mask, leaves, consts, starts, ls, bias_fn):
    (qs, ks, vs), untile_vjp = jax.vjp(lambda q, k, v: (tile_q(q, ls), flat_kv(k, ls), flat_kv(v, ls)), q, k, v)
    out, lse = forward_wide(qs, ks, vs, mask, leaves, consts, starts, ls=ls, bias_fn=bias_fn)
    T = q.shape[1]
    rows = (
        untile(out, ls, T),
        untile(core.lse_natural(*lse, base2=ls.core.base2)[..., None], ls, T)[..., 0],
    )  # back to [B, T, N, ...]
    return rows, (qs, ks, vs, untile_vjp, mask, leaves, consts, starts, out, lse)


def _flash_wide_bwd(ls, bias_fn, res, cts):
    qs, ks, vs, untile_vjp, mask, leaves, consts, starts, out, lse = res
    dout, dlse = cts
    dq, dk, dv, dls, dcs = backward_wide(
        qs, ks, vs, mask, leaves, consts, starts, out, lse, row_tiles(dout, ls), ls=ls, bias_fn=bias_fn,
        dlse=row_tiles(dlse[..., None], ls)[..., 0],
    )  # fmt: skip
    dq, dk, dv = untile_vjp((dq.astype(qs.dtype), dk.astype(ks.dtype), dv.astype(vs.dtype)))
    return (
        dq, dk, dv, zero_cotangents(mask), core.cast_cotangents(dls, leaves), core.cast_cotangents(dcs, consts),
        zero_cotangents(starts),
    )  # fmt: skip


_flash_wide.defvjp(_flash_wide_fwd, _flash_wide_bwd)


# ------------------------------------------------------------------------------------------
# Public entry point


def _array_bias(q_idx, k_idx, b):
    """The tile of an array bias b [..., N|1, T|1, S|1] at positions q_idx [bq], k_idx [bk]."""
    q_idx = q_idx if b.shape[-2] != 1 else jnp.zeros_like(q_idx)
    k_idx = k_idx if b.shape[-1] != 1 else jnp.zeros_like(k_idx)
    return jnp.take(jnp.take(b, q_idx, axis=-2), k_idx, axis=-1)


def _bias_fn(call: Call, bq: int, bk: int):
    """The bound call's bias -> (fn(q_idx, k_idx, *consts), consts); no bias -> (None, ()).

    A callable is closure-converted (arrays it closes over become the consts and get gradients);
    an array ``[..., N|1, T|1, S|1]`` becomes the const of ``_array_bias``, sliced per tile.
    (``bind`` has checked either form against the logits' shape.)
    """
    if call.bias_kind == "none":
        return None, ()
    if call.bias_kind == "array":
        b = jnp.asarray(call.bias)
        return _array_bias, (b.reshape((1,) * max(0, 2 - b.ndim) + tuple(b.shape)),)  # rank 0/1 like numpy
    bias = call.bias
    ex_q, ex_k = jnp.zeros((bq,), jnp.int32), jnp.zeros((bk,), jnp.int32)
    # (a lambda: closure_convert caches on its argument, and a pytree bias holding tracers is unhashable)
    fn, consts = jax.closure_convert(lambda q_idx, k_idx: bias(q_idx, k_idx), ex_q, ex_k)
    return fn, tuple(consts)


def blockwise_attention(
    q,
    k,
    v,
    *,
    mask=None,
    bias=None,
    scale=None,
    block_sizes=None,
    dropout_rate=0.0,
    dropout_key=None,
    return_lse=False,
    score="dot",
):
    """Flash-style attention visiting only the non-empty blocks of ``mask``; O(T + S) memory.

    Args:
        q: ``[..., T, N, H]`` queries.
        k: ``[..., S, K, H]`` keys (N % K == 0; GQA shares each key tile between G query heads).
        v: ``[..., S, K, Hv]`` values.
        mask: an ``attnlab.masks`` object or bool array (True = attend), or None. Its static
            ``block_layout`` decides which tiles are skipped; traced leaves (padding lengths
            under jit) make tiles PARTIAL, evaluated per tile, and tiles found empty at run time
            are skipped with ``lax.cond``-style branching. Changing only lengths never recompiles.
        bias: None, a float array broadcastable to ``[..., N, T, S]`` (sliced one tile at a time;
            it stays fp32 and receives gradients), or a callable
            ``bias(q_idx, k_idx) -> float [..., N, len(q_idx), len(k_idx)]`` of integer positions
            (ALiBi, relative bias), evaluated one tile at a time; arrays it closes over receive
            gradients.
        scale: logit scale; default ``1/sqrt(H)``.
        block_sizes: a ``BlockSizes``; default: the backend's dense or sparse tiles
            (``default_block_sizes``), whichever visits fewer (query, key) pairs for this mask.
        dropout_rate: attention dropout on the weights (kept ones scaled by ``1/(1 - rate)``).
        dropout_key: a ``jax.random`` key, required when ``dropout_rate > 0``. Each tile draws its
            mask from the key and its positions (``dropout_keep``), the backward the same one; the
            dense reference with the same key draws the same mask.
        return_lse: also return the log-sum-exp of each row, fp32 ``[..., T, N]`` (-inf on rows
            with nothing allowed), differentiable.
        score: ``"dot"`` / ``scores.Dot(scale)``, or ``scores.SoftCap(cap, scale)``: the soft cap is
            applied inside the tiles, forward and backward.

    Returns:
        ``[..., T, N, Hv]`` in q's dtype (and ``lse`` with ``return_lse``); softmax statistics and
        accumulation in fp32. Rows with no allowed key are zeros, with zero gradients.

    Example:
        >>> q = k = v = jnp.ones((1000, 2, 8))                   # [T, N, H]
        >>> blockwise_attention(q, k, v, mask=masks_lib.window(16, 0)).shape
        (1000, 2, 8)
    """
    call = bind(
        q, k, v, mask=mask, bias=bias, score=score, scale=scale, dropout_rate=dropout_rate,
        dropout_key=dropout_key, return_lse=return_lse, fn="blockwise_attention",
    )  # fmt: skip
    from attnlab.impls.blockwise import BLOCKWISE  # noqa: PLC0415 (the protocol lives with the implementation)

    if (why := BLOCKWISE.supports(call, platform.target())) is not None:
        raise ValueError(f"blockwise_attention: {why}")
    return attend(call, block_sizes=block_sizes)


def attend(call: Call, *, block_sizes: BlockSizes | None = None):
    """The blockwise kernel on a bound call (``attnlab.call.bind``) that the implementation supports: see
    ``blockwise_attention``. Plans for the backend the trace is for (``attnlab.platform.target()``)."""
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be an attnlab.kernels.BlockSizes, got {block_sizes!r}")
    if call.empty:
        return call.zeros()
    T, S, m = call.T, call.S, call.tile_mask
    backend = platform.target()
    layouts = {}  # (bq, bk) -> the mask's layout, computed once per tile size

    def layout_fn(bq, bk):
        if (bq, bk) not in layouts:
            layouts[bq, bk] = np.full((-(-T // bq), -(-S // bk)), masks_lib.FULL, np.int8)
            if m is not None:
                layouts[bq, bk] = m.block_layout(T, S, bq, bk)
        return layouts[bq, bk]

    if block_sizes is not None:
        bs = block_sizes
    elif isinstance(call.score.tile_form(), scores_lib.PairTile):  # a pair form holds [B*N, bq, bk, H] per tile
        bs = default_block_sizes(backend, sparse=True)
    else:
        bs = pick_block_sizes(m, T, S, backend, layout_fn)
    plan = _plan(layout_fn, call, m, bs, backend)
    seed = jnp.zeros((2,), jnp.uint32) if call.dropout_seed is None else call.dropout_seed
    out, lse = plan.run(call.q, call.k, call.v, m, seed)
    return (out, lse) if call.return_lse else out


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static plan of one call: the loops' spec, the adjusted layout, the bias and the score's leaves."""

    ls: LoopSpec
    layout: np.ndarray  # int32 [nq, nk], adjusted (schedule.adjust_layout)
    runtime: bool  # refine the schedule on device from the mask's runtime layout (traced data)
    starts: np.ndarray | None  # a band: the span starts (wide_spans)
    bias_fn: object
    consts: tuple  # the bias's arrays
    leaves: tuple  # the score's arrays

    def run(self, q, k, v, m, seed):
        ls = self.ls
        if self.starts is not None:
            sched = (jnp.asarray(self.starts),)
        else:
            runtime = m.runtime_layout(ls.T, ls.S, ls.bq, ls.bk) if self.runtime else None
            sc = schedule.Schedule(self.layout, ls.S, ls.bk, runtime=runtime)
            sched = (jnp.asarray(sc.index), jnp.asarray(sc.counts))
        return _blockwise(q, k, v, m, self.leaves, self.consts, seed, sched, ls, self.bias_fn)


def _plan(layout_fn, call: Call, m, block_sizes: BlockSizes, backend: str) -> _Plan:
    """The plan for ``backend``; ``m`` is the call's tile mask (``call.tile_mask``, formed once by ``attend``)."""
    T, S = call.T, call.S
    bq, bk = min(block_sizes.block_q, T), min(block_sizes.block_k, S)
    layout = schedule.adjust_layout(layout_fn(bq, bk), S, bk)
    kinds = set(np.unique(layout).tolist()) - {masks_lib.EMPTY}
    # a mask whose data is traced refines the static layout on device (EMPTY tiles skipped, FULL tiles
    # unmasked), with no recompile when the data changes. (Asked of the mask itself, not of its abstract
    # shape: a mask whose data is partly concrete, e.g. a graph built under jit & padding lengths closed
    # over as constants, has no runtime layout though eval_shape's all-traced copy would have one.)
    runtime = (
        m is not None and not m.is_static and masks_lib.PARTIAL in kinds and m.runtime_layout(T, S, bq, bk) is not None
    )
    if runtime:
        kinds |= {masks_lib.FULL}
    # a band (window): one contiguous key span per query block, one step each (CPU-measured: see WIDE_*)
    # (not for a pair-form score: its tile holds H values per pair)
    pair = isinstance(call.score.tile_form(), scores_lib.PairTile)
    wide = None
    if not runtime and not call.dropout_rate and not pair:
        wide = wide_spans(layout, S, bk, WIDE_MAX_KEYS, WIDE_MAX_PAIRS, bq)
    bias_fn, consts = _bias_fn(call, bq, bk if wide is None else wide[1])  # traced at the tile's key width
    leaves = () if call.score.is_dot else tuple(jnp.asarray(x) for x in jax.tree_util.tree_leaves(call.score))
    ls = LoopSpec(
        core=core.tile_spec(call.score, call.H, T, S, has_bias=bias_fn is not None),
        bq=bq,
        bk=bk,
        lead=call.lead,
        N=call.N,
        K=call.K,
        compute_dtype=compute_dtype(call.dtype, backend).name,
        kinds=frozenset(kinds),
        dropout_rate=call.dropout_rate,
        wide=0 if wide is None else wide[1],
    )
    return _Plan(ls, layout, runtime, None if wide is None else wide[0], bias_fn, consts, leaves)


@functools.partial(jax.jit, static_argnums=(8, 9))
def _blockwise(q, k, v, m, leaves, consts, seed, sched, ls: LoopSpec, bias_fn):
    """Layout in, layout out: [..., T, N, H] -> heads-first tiles -> kernel -> [..., T, N, Hv] (a band's
    forward: the tiles of one step at a time, ``_flash_wide``).

    Also returns the log-sum-exp [..., T, N] (fp32, natural; dead code for XLA when the caller drops it).
    """
    lead, T, N, Hv = ls.lead, ls.T, ls.N, v.shape[-1]
    B = ls.lead_size
    if ls.wide:  # the forward reads its tiles from this layout in place (``_flash_wide``)

        def padded(x, n):  # [..., L, heads, D] -> [B, n, heads, D], zeros past L (padded rows are discarded)
            x = x.reshape(B, *x.shape[-3:])
            return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))

        nq, nk = -(-T // ls.bq), -(-ls.S // ls.bk)
        out, lse = _flash_wide(
            padded(q, nq * ls.bq), padded(k, nk * ls.bk), padded(v, nk * ls.bk), m, leaves, consts, sched[0], ls,
            bias_fn,
        )  # fmt: skip
        return out[:, :T].reshape(*lead, T, N, Hv).astype(q.dtype), lse[:, :T].reshape(*lead, T, N)
    qs = tile_q(q.reshape(B, T, N, -1), ls)
    ks, vs = tile_kv(k.reshape(B, ls.S, ls.K, -1), ls), tile_kv(v.reshape(B, ls.S, ls.K, Hv), ls)
    out, lse = _flash(qs, ks, vs, m, leaves, consts, seed, sched, ls, bias_fn)
    out = untile(out, ls, T).reshape(*lead, T, N, Hv).astype(q.dtype)
    return out, untile(lse[..., None], ls, T).reshape(*lead, T, N)  # [nq, B*K, G*bq] -> [..., T, N]
