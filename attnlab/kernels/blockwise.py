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
A band (one key span per query block, ``_tiles.wide_spans``) is the exception in its forward: each
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
from attnlab.call import Call, bind
from attnlab.kernels._tiles import (  # the shared tile machinery (also used by ring and pallas_flash)
    Static,
    adjust_layout,
    backward,
    backward_wide,
    block_schedule,
    compute_dtype,
    default_scale,
    dropout_keep,
    forward,
    forward_wide,
    layout_rows,
    lse_value,
    row_tiles,
    runtime_schedule,
    tile_kv,
    tile_q,
    untile,
    wide_spans,
    zero_cotangents,
)

__all__ = [
    "BlockSizes",
    "default_block_sizes",
    "pick_block_sizes",
    "blockwise_attention",
    "attend",
    "call_reason",
    "block_schedule",
    "runtime_schedule",
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
    """Default tile sizes for ``backend`` (default: ``jax.default_backend()``).

    Args:
        backend: ``"cpu"``, ``"gpu"``, ``"tpu"``, or None for the current default backend.
        sparse: True for masks with many empty blocks (windows, block-sparse graphs): smaller tiles.
    """
    backend = jax.default_backend() if backend is None else backend
    dense, sparse_ = _DEFAULTS.get(backend, _DEFAULTS["gpu"])
    return sparse_ if sparse else dense


# A tile's fixed cost (loop step, mask and softmax bookkeeping) counted in (query, key) pairs.
_TILE_OVERHEAD_PAIRS = 64 * 64

# One key span per query block instead of a tile list (``_tiles.wide_spans``) when every row's non-empty
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, mask, consts, seed, sched, st, bias_fn):
    """sched = (index, kind, count): the schedule, int32 arrays (count [nq] or None: see ``_tiles.forward``);
    with ``st.wide``, (starts [nq], None, None): one key span per query block (``_tiles.wide_spans``).

    seed: uint32 [2], the dropout seed (unused when ``st.dropout_rate == 0``).
    Returns (out [nq, B*K, G*bq, Hv], lse [nq, B*K, G*bq] fp32, -inf on empty rows).
    """
    out, lse = _forward(q, k, v, mask, consts, seed, sched, st, bias_fn)
    return out, lse_value(lse)


def _forward(q, k, v, mask, consts, seed, sched, st, bias_fn):
    return forward(q, k, v, mask, consts, sched[0], sched[1], st=st, bias_fn=bias_fn, seed=seed, count=sched[2])


def _flash_fwd(q, k, v, mask, consts, seed, sched, st, bias_fn):
    out, lse = _forward(q, k, v, mask, consts, seed, sched, st, bias_fn)
    return (out, lse_value(lse)), (q, k, v, mask, consts, seed, sched, out, lse)


def _flash_bwd(st, bias_fn, res, cts):
    q, k, v, mask, consts, seed, sched, out, lse = res
    dout, dlse = cts
    dq, dk, dv, dconsts = backward(
        q, k, v, mask, consts, sched[0], sched[1], out, lse, dout, st=st, bias_fn=bias_fn, seed=seed,
        dlse=dlse, count=sched[2],
    )  # fmt: skip
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return (*grads, zero_cotangents(mask), dconsts, zero_cotangents(seed), zero_cotangents(sched))


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _flash_wide(q, k, v, mask, consts, starts, st, bias_fn):
    """One key span per query block (``st.wide``) on the ``[B, T, N, H]`` layout, T and S padded to whole
    blocks: (out [B, T, N, Hv] fp32, lse [B, T, N] fp32, -inf on empty rows). The forward alone reads its
    tiles from that layout in place (``forward_wide(rows=True)``); under differentiation the arrays are tiled
    once and shared by the forward and ``backward_wide``."""
    out, lse = forward_wide(q, k, v, mask, consts, starts, st=st, bias_fn=bias_fn, rows=True)
    return out, lse_value(lse)


def _flash_wide_fwd(q, k, v, mask, consts, starts, st, bias_fn):
    (qs, ks, vs), untile_vjp = jax.vjp(lambda q, k, v: (tile_q(q, st), tile_kv(k, st), tile_kv(v, st)), q, k, v)
    out, lse = forward_wide(qs, ks, vs, mask, consts, starts, st=st, bias_fn=bias_fn)
    T = q.shape[1]
    rows = (untile(out, st, T), untile(lse_value(lse)[..., None], st, T)[..., 0])  # back to [B, T, N, ...]
    return rows, (qs, ks, vs, untile_vjp, mask, consts, starts, out, lse)


def _flash_wide_bwd(st, bias_fn, res, cts):
    qs, ks, vs, untile_vjp, mask, consts, starts, out, lse = res
    dout, dlse = cts
    dq, dk, dv, dconsts = backward_wide(
        qs, ks, vs, mask, consts, starts, out, lse, row_tiles(dout, st), st=st, bias_fn=bias_fn,
        dlse=row_tiles(dlse[..., None], st)[..., 0],
    )  # fmt: skip
    dq, dk, dv = untile_vjp((dq.astype(qs.dtype), dk.astype(ks.dtype), dv.astype(vs.dtype)))
    return dq, dk, dv, zero_cotangents(mask), dconsts, zero_cotangents(starts)


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
    if (why := call_reason(call)) is not None:
        raise ValueError(f"blockwise_attention: {why}")
    return attend(call, block_sizes=block_sizes)


def call_reason(call: Call) -> str | None:
    """None when the kernel computes the bound call's score in its tiles (``score.tiled``), else why not."""
    if not call.score.tiled:
        return (
            f"computes scores with a tile form only (Dot, SoftCap, ScoreMod, Additive; got "
            f"{type(call.score).__name__}, dense only: write a per-element change as scores.ScoreMod)"
        )
    return None  # bias: None, a callable of positions, or an array (sliced per tile)


def attend(call: Call, *, block_sizes: BlockSizes | None = None):
    """The blockwise kernel on a bound call (``attnlab.call.bind``; a score ``call_reason`` accepts): see
    ``blockwise_attention``."""
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be an attnlab.kernels.BlockSizes, got {block_sizes!r}")
    if call.empty:
        return call.zeros()
    T, S, m = call.T, call.S, call.tile_mask

    # Tiles and compute dtype depend on the platform the computation is *lowered* for (not on
    # jax.default_backend() at trace time): one plan per platform, joined when equal, picked by
    # lax.platform_dependent (only the lowering platform's branch is lowered; eagerly, only it runs).
    layouts = {}  # (bq, bk) -> the mask's layout, computed once per tile size

    def layout_fn(bq, bk):
        if (bq, bk) not in layouts:
            layouts[bq, bk] = np.full((-(-T // bq), -(-S // bk)), masks_lib.FULL, np.int8)
            if m is not None:
                layouts[bq, bk] = m.block_layout(T, S, bq, bk)
        return layouts[bq, bk]

    plans = {}
    for platform in _PLATFORMS:
        if block_sizes is not None:
            bs = block_sizes
        elif call.score.pair_form:  # a pair form holds [B*N, bq, bk, H] per tile: the small tiles
            bs = default_block_sizes(platform, sparse=True)
        else:
            bs = pick_block_sizes(m, T, S, platform, layout_fn)
        plans[platform] = _plan(layout_fn, call, m, bs, platform)
    branches = {}
    for platform, plan in plans.items():
        same = next((p for p in branches if plans[p] == plan), None)
        branches[platform] = branches[same] if same is not None else plan.branch()
    seed = jnp.zeros((2,), jnp.uint32) if call.dropout_seed is None else call.dropout_seed
    args = (call.q, call.k, call.v, m, seed)
    if len({id(b) for b in branches.values()}) == 1:
        out, lse = branches["cpu"](*args)
    else:
        out, lse = jax.lax.platform_dependent(
            *args, cpu=branches["cpu"], cuda=branches["gpu"], rocm=branches["gpu"], tpu=branches["tpu"]
        )
    return (out, lse) if call.return_lse else out


_PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """One platform's static plan: tiles, schedule and the bias function (compared by value)."""

    st: Static
    sched: tuple  # numpy (index, kind, layout): the static schedule and the adjusted layout it came from
    bias_fn: object
    consts: tuple

    def __eq__(self, other):  # equal tiles and dtype: the same computation (bias_fn differs by identity only)
        return self.st == other.st and all(np.array_equal(a, b) for a, b in zip(self.sched, other.sched, strict=True))

    __hash__ = None

    def branch(self):
        def run(q, k, v, m, seed):
            index, kind, layout = self.sched
            if self.st.wide:  # index holds the span starts
                sched = (jnp.asarray(index), None, None)
            elif self.st.runtime_schedule:  # refined on device from the mask's (traced) data
                st = self.st
                runtime = m.runtime_layout(st.T, st.S, st.bq, st.bk)
                sched = runtime_schedule(layout, runtime, st.S, st.bk, index.shape[1])
            else:
                sched = (jnp.asarray(index), jnp.asarray(kind), None)
            return _blockwise(q, k, v, m, self.consts, seed, sched, self.st, self.bias_fn)

        return run


def _plan(layout_fn, call: Call, m, block_sizes: BlockSizes, platform: str) -> _Plan:
    """One platform's plan; ``m`` is the call's tile mask (``call.tile_mask``, formed once by ``attend``)."""
    T, S = call.T, call.S
    bq, bk = min(block_sizes.block_q, T), min(block_sizes.block_k, S)
    layout = adjust_layout(layout_fn(bq, bk), S, bk)
    index, kind = layout_rows(layout)
    kinds = set(np.unique(kind).tolist())
    # a mask whose data is traced refines the static layout on device (EMPTY tiles skipped, FULL
    # tiles unmasked), with no recompile when the data changes
    # (asked of the mask itself, not of its abstract shape: a mask whose data is partly concrete, e.g. a graph
    # built under jit & padding lengths closed over as constants, has no runtime layout though eval_shape's
    # abstract copy, all of it traced, would have one)
    runtime = (
        m is not None and not m.is_static and masks_lib.PARTIAL in kinds and m.runtime_layout(T, S, bq, bk) is not None
    )
    if runtime:
        kinds |= {masks_lib.FULL}
    # a band (window): one contiguous key span per query block, one step each (CPU-measured: see WIDE_*)
    # (not for a pair-form score: its tile holds H values per pair)
    wide = None
    if not runtime and not call.dropout_rate and not call.score.pair_form:
        wide = wide_spans(layout, S, bk, WIDE_MAX_KEYS, WIDE_MAX_PAIRS, bq)
    bias_fn, consts = _bias_fn(call, bq, bk if wide is None else wide[1])  # traced at the tile's key width
    n_bias, score_def = len(consts), ()
    if not call.score.is_dot:  # the score's tile form: its treedef is static, its leaves are kernel inputs
        leaves, treedef = jax.tree_util.tree_flatten(call.score)
        consts, score_def = consts + tuple(jnp.asarray(x) for x in leaves), (treedef,)
    st = Static(
        T=T,
        S=S,
        bq=bq,
        bk=bk,
        lead=call.lead,
        N=call.N,
        K=call.K,
        scale=default_scale(call.H, call.score.tile_scale(call.H)),
        score=score_def,
        n_bias=n_bias,
        has_bias=bias_fn is not None,
        kinds_used=tuple(sorted(kinds)),
        kinds_used_t=(),
        compute_dtype=compute_dtype(call.dtype, platform).name,
        dropout_rate=call.dropout_rate,
        runtime_schedule=runtime,
        wide=0 if wide is None else wide[1],
    )
    if wide is not None:
        return _Plan(st, (wide[0], np.zeros((0,), np.int32), layout), bias_fn, consts)
    return _Plan(st, (index, kind, layout), bias_fn, consts)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _blockwise(q, k, v, m, consts, seed, sched, st: Static, bias_fn):
    """Layout in, layout out: [..., T, N, H] -> heads-first tiles -> kernel -> [..., T, N, Hv] (a band's
    forward: the tiles of one step at a time, ``_flash_wide``).

    Also returns the log-sum-exp [..., T, N] (fp32; dead code for XLA when the caller drops it).
    """
    lead, T, N, Hv = st.lead, st.T, st.N, v.shape[-1]
    B = st.lead_size
    if st.wide:  # the forward reads its tiles from this layout in place (``_flash_wide``)

        def padded(x, n):  # [..., L, heads, D] -> [B, n, heads, D], zeros past L (padded rows are discarded)
            x = x.reshape(B, *x.shape[-3:])
            return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))

        nq, nk = -(-T // st.bq), -(-st.S // st.bk)
        out, lse = _flash_wide(
            padded(q, nq * st.bq), padded(k, nk * st.bk), padded(v, nk * st.bk), m, consts, sched[0], st, bias_fn
        )
        return out[:, :T].reshape(*lead, T, N, Hv).astype(q.dtype), lse[:, :T].reshape(*lead, T, N)
    qs = tile_q(q.reshape(B, T, N, -1), st)
    ks, vs = tile_kv(k.reshape(B, st.S, st.K, -1), st), tile_kv(v.reshape(B, st.S, st.K, Hv), st)
    out, lse = _flash(qs, ks, vs, m, consts, seed, sched, st, bias_fn)
    out = untile(out, st, T).reshape(*lead, T, N, Hv).astype(q.dtype)
    return out, untile(lse[..., None], st, T).reshape(*lead, T, N)  # [nq, B*K, G*bq] -> [..., T, N]
