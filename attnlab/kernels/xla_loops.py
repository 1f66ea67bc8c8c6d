"""The ``lax``-loop kernels' loops over tiles (blockwise on one device, ring over devices), on the tile core.

Each tile's math (logits, score, mask, online-softmax step, backward tile) is ``attnlab.kernels.tile_core``;
this module owns what is particular to running it as XLA loops:

* the tile layout: ``[B, T, N, H]`` is moved once to heads-first tiles ``[nq, B*K, G*bq, H]`` (the G query
  heads that share a key head stacked as rows, so each tile product is one plain batched matmul over B*K;
  ``tile_q``, ``tile_kv``, ``row_tiles``, ``untile``) and the products in that layout (``Dots``);
* the loops: ``lax.map`` over query blocks, and per block two ``fori_loop``s over its schedule row
  (``attnlab.kernels.schedule``): its FULL tiles with no mask code, then its PARTIAL tiles, each
  evaluating the mask and skipping, with a ``lax.cond``, a tile found empty at run time;
* the FlashAttention-2-style backward: one pass over query blocks carrying dk, dv full size;
* a band's one span per query block (``wide_spans``, ``forward_wide``, ``backward_wide``);
* dropout decisions per tile (``tile_keep``), drawn as the dense reference draws them.

``forward_carry`` and ``backward`` take travelling state (ring attention streams key/value shards
through them). Shapes follow the legend in ``attnlab.kernels.blockwise``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib
from attnlab.kernels import tile_core as core
from attnlab.numerics import dropout_keep

__all__ = [
    "LoopSpec",
    "Dots",
    "zero_cotangents",
    "forward",
    "forward_carry",
    "init_carry",
    "finalize",
    "backward",
    "wide_spans",
    "forward_wide",
    "backward_wide",
    "tile_q",
    "row_tiles",
    "tile_kv",
    "flat_kv",
    "untile",
    "tile_keep",
]


def zero_cotangents(tree):
    """Zero cotangents for a pytree of non-differentiated inputs (masks, schedules): ``float0`` zeros for
    integer and boolean leaves (what ``custom_vjp`` requires), zeros of their own dtype for floating ones."""

    def zero(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.zeros_like(x)
        return np.zeros(x.shape, jax.dtypes.float0)

    return jax.tree_util.tree_map(zero, tree)


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """The loops' statics beside the tile core's (hashable; a new value is a new program).

    Attributes:
        core: the tile core's ``TileSpec`` (score form, scale, T and S).
        bq, bk: tile sizes. lead, N, K: the call's leading dims and heads.
        compute_dtype: the dtype of the tile products' operands (name).
        kinds: the tile kinds the schedule holds (``masks.FULL``, ``masks.PARTIAL``): a loop for a
            kind that never occurs is not traced.
        dropout_rate: attention dropout (0.0: none).
        wide: > 0: one key span of this many keys per query block (``wide_spans``).
    """

    core: core.TileSpec
    bq: int
    bk: int
    lead: tuple
    N: int
    K: int
    compute_dtype: str
    kinds: frozenset = frozenset({masks_lib.PARTIAL, masks_lib.FULL})
    dropout_rate: float = 0.0
    wide: int = 0

    @property
    def T(self) -> int:  # noqa: N802 (the shape legend's names)
        return self.core.T

    @property
    def S(self) -> int:  # noqa: N802 (the shape legend's names)
        return self.core.S

    @property
    def lead_size(self) -> int:
        return math.prod(self.lead)

    @property
    def view(self) -> core.HeadsView:
        return core.HeadsView(self.lead, self.N, self.K, self.bq)


@dataclasses.dataclass(frozen=True)
class Dots:
    """The tile products in the loops' layout: q ``[B*K, R, H]``, k ``[B*K, C, H]``, fp32 accumulation.

    ``dk`` gives the key gradient transposed, ``[B*K, H, C]``, from ``qt`` (the queries transposed once per
    query block, ``[B*K, H, R]``): then every product is a plain one (``q^T ds``, not ``ds^T q``); XLA:CPU
    runs a product whose left operand is contracted over its rows at about half speed."""

    qt: jax.Array | None = None

    def qk(self, q, k):
        return jnp.einsum("nqh,nsh->nqs", q, k, preferred_element_type=jnp.float32)

    def dq(self, ds, k):
        return jnp.einsum("nqs,nsh->nqh", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    def dk(self, ds, q):
        qt = jnp.swapaxes(q, -1, -2) if self.qt is None else self.qt
        return jnp.einsum("nhq,nqs->nhs", qt, ds.astype(q.dtype), preferred_element_type=jnp.float32)

    def orient_dk(self, dk):  # [B*K, C, H] -> [B*K, H, C]
        return jnp.swapaxes(dk, -1, -2)


def _mask(ls: LoopSpec, mask, q_pos, k_pos):
    """bool ``[B*K|1, G*bq, cols]``: the element mask of a tile, False past S."""
    return ls.view.tile_mask(core.mask_at(ls.core, mask, q_pos, k_pos))


def tile_keep(seed, i, j, ls: LoopSpec):
    """bool ``[B*K, G*bq, bk]``: the dropout decisions on tile (i, j), as ``dropout_keep`` draws them densely."""
    G = ls.N // ls.K
    bk_ = jnp.arange(ls.lead_size * ls.K, dtype=jnp.uint32)[:, None, None]  # tile batch row = b * K + kh
    r = jnp.arange(G * ls.bq, dtype=jnp.uint32)[None, :, None]  # tile row = g * bq + q
    n = (bk_ % ls.K) * G + r // ls.bq  # query head
    rows = ((bk_ // ls.K) * ls.N + n) * ls.T + (i * ls.bq + r % ls.bq).astype(jnp.uint32)
    cols = (j * ls.bk + jnp.arange(ls.bk, dtype=jnp.int32)).astype(jnp.uint32)[None, None, :]
    return dropout_keep(seed, ls.dropout_rate, rows, cols)


def _visit_row(ls: LoopSpec, carry, index_i, counts_i, tile):
    """Folds ``tile(carry, j, partial)`` over one schedule row: the FULL tiles ``[0, n_full)``, then the
    PARTIAL ones ``[n_full, n_full + n_partial)`` (``attnlab.kernels.schedule``)."""
    n_full = counts_i[0]
    if masks_lib.FULL in ls.kinds:
        carry = jax.lax.fori_loop(0, n_full, lambda t, c: tile(c, index_i[t], False), carry)
    if masks_lib.PARTIAL in ls.kinds:
        carry = jax.lax.fori_loop(n_full, n_full + counts_i[1], lambda t, c: tile(c, index_i[t], True), carry)
    return carry


# ------------------------------------------------------------------------------------------
# Forward: lax.map over query blocks, two loops over each block's non-empty key blocks


def init_carry(q, Hv):
    """Empty online-softmax state for tiled queries q ``[nq, B*K, G*bq, H]``: (m, l, acc), fp32."""
    m, l = core.softmax_init(q.shape[:-1])
    return m, l, jnp.zeros((*q.shape[:-1], Hv), jnp.float32)


def finalize(m, l, acc, *, ls: LoopSpec):
    """Online-softmax state -> ``(out, (m, log l))`` (``tile_core.softmax_finalize``)."""
    return core.softmax_finalize(m, l, acc, base2=ls.core.base2)


def forward(q, k, v, mask, leaves, consts, index, counts, *, ls: LoopSpec, bias_fn, seed=None):
    """q ``[nq, B*K, G*bq, H]`` (pre-scaled by ``ls.core.q_factor``), k ``[nk, B*K, bk, H]``, v ``[nk, B*K, bk, Hv]``;
    ``index``, ``counts``: the schedule (``schedule.rows``). Returns out ``[nq, B*K, G*bq, Hv]`` (fp32) and
    the log-sum-exp pair ``(m, log l)``, each ``[nq, B*K, G*bq]``."""
    carry = init_carry(q, v.shape[-1])
    state = forward_carry(q, k, v, mask, leaves, consts, index, counts, carry, ls=ls, bias_fn=bias_fn, seed=seed)
    return finalize(*state, ls=ls)


def forward_carry(q, k, v, mask, leaves, consts, index, counts, carry, *, ls: LoopSpec, bias_fn, seed=None):
    """The block step: folds the key blocks of the schedule into the running ``(m, l, acc)``.

    ``carry`` is ``(m [nq, B*K, G*bq], l [same], acc [nq, B*K, G*bq, Hv])`` from ``init_carry`` or a previous
    call, so a caller can stream key/value blocks that arrive one after another (ring attention) and
    ``finalize`` once. ``mask(q_idx, k_idx)`` sees local block positions (a caller with sharded sequences
    passes a mask that adds its offsets). With dropout, ``seed`` (uint32 [2]) draws the decisions per
    tile; ``l`` sums the undropped probabilities (dropout acts after normalisation).
    """
    dots = Dots()

    def one_query_block(args):
        qi, i, idx_i, cnt_i, m0, l0, acc0 = args

        def tile(carry, j, partial):
            q_pos, k_pos = core.positions(i, j, ls.bq, ls.bk)

            def visit(carry, ok=None):
                m, l, acc = carry
                t = core.logits(ls.core, ls.view, dots.qk, qi, k[j], q_pos, k_pos, leaves, consts, bias_fn)
                m, l, alpha, p = core.softmax_step(m, l, t, ok, base2=ls.core.base2)
                keep = tile_keep(seed, i, j, ls) if ls.dropout_rate else None
                pd = core.drop(p, keep, ls.dropout_rate).astype(v.dtype)
                pv = jnp.einsum("nqs,nsh->nqh", pd, v[j], preferred_element_type=jnp.float32)
                return m, l, acc * alpha[..., None] + pv

            if not partial:
                return visit(carry)
            ok = _mask(ls, mask, q_pos, k_pos)  # a tile found empty at run time is skipped
            return jax.lax.cond(ok.any(), lambda c: visit(c, ok), lambda c: c, carry)

        return _visit_row(ls, (m0, l0, acc0), idx_i, cnt_i, tile)

    iq = jnp.arange(q.shape[0], dtype=jnp.int32)
    return jax.lax.map(one_query_block, (q, iq, jnp.asarray(index), jnp.asarray(counts), *carry))


# ------------------------------------------------------------------------------------------
# Backward: recompute each tile's probabilities from the stored log-sum-exp


def backward(
    q, k, v, mask, leaves, consts, index, counts, out, lse, dout, *, ls: LoopSpec, bias_fn,
    dk0=None, dv0=None, seed=None, dlse=None,
):  # fmt: skip
    """FlashAttention-2-style backward: a scan over query blocks; dk and dv are carried full size.

    ``lse`` is the pair ``(m, log l)`` from the forward; ``dlse`` (fp32 ``[nq, B*K, G*bq]`` or None) the
    natural log-sum-exp's cotangent. ``dk0``/``dv0`` (fp32, k's / v's tile shapes) are added to the result: a
    caller streaming key/value shards (ring attention) passes its travelling accumulators.

    dk and dv are accumulated transposed, ``[nk, B*K, H, bk]``, from the transposed query and output-gradient
    tiles (made once per query block; ``Dots``). A tile's branch (a PARTIAL tile found empty skips) returns
    only that tile's contributions, never the full-size carries: passing those through ``lax.cond`` made
    XLA copy them on every tile. Returns ``(dq, dk, dv, d_leaves, d_consts)`` (dq, dk, dv fp32 in tile
    layout, scaled by ``grad_scale``: dq is w.r.t. the pre-scaled query tiles, as the kernels take them).
    """
    nq, BK, R, H = q.shape
    Hv = v.shape[-1]
    delta = core.softmax_delta(out, dout, dlse)  # [nq, B*K, G*bq]

    def one_query_block(carry, args):
        dkt, dvt, dls, dcs = carry  # transposed: [nk, B*K, H, bk], [nk, B*K, Hv, bk]
        qi, doi, m_i, log_l_i, delta_i, i, idx_i, cnt_i = args
        dots = Dots(qt=jnp.swapaxes(qi, -1, -2))
        dot_i = jnp.swapaxes(doi, -1, -2)  # [B*K, Hv, G*bq]

        def contributions(j, q_pos, k_pos, ok=None):
            kj, vj = k[j], v[j]
            t, pull = core.logits_vjp(ls.core, ls.view, dots, qi, kj, q_pos, k_pos, leaves, consts, bias_fn)
            p = core.probs(t, m_i[..., None], log_l_i[..., None], ok, base2=ls.core.base2)
            keep = tile_keep(seed, i, j, ls) if ls.dropout_rate else None
            dv_j = jnp.einsum(
                "nhq,nqs->nhs", dot_i, core.drop(p, keep, ls.dropout_rate).astype(doi.dtype),
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            dp = jnp.einsum("nqh,nsh->nqs", doi, vj, preferred_element_type=jnp.float32)
            dp = core.drop(dp, keep, ls.dropout_rate)
            dq_c, dk_j, dl, dc = pull(core.dlogits(p, dp, delta_i))
            dl = tuple(core.f32_cotangent(d, x) for d, x in zip(dl, leaves, strict=True))
            dc = tuple(core.f32_cotangent(d, x) for d, x in zip(dc, consts, strict=True))
            return dq_c, dk_j, dv_j, dl, dc

        def zeros():
            return (
                jnp.zeros((BK, R, H), jnp.float32),
                jnp.zeros((BK, H, ls.bk), jnp.float32),
                jnp.zeros((BK, Hv, ls.bk), jnp.float32),
                tuple(jnp.zeros(x.shape, jnp.float32) for x in leaves),
                tuple(jnp.zeros(x.shape, jnp.float32) for x in consts),
            )

        def tile(c, j, partial):
            dq_i, dkt, dvt, dls, dcs = c
            q_pos, k_pos = core.positions(i, j, ls.bq, ls.bk)
            if partial:
                ok = _mask(ls, mask, q_pos, k_pos)
                parts = jax.lax.cond(ok.any(), lambda: contributions(j, q_pos, k_pos, ok), zeros)
            else:
                parts = contributions(j, q_pos, k_pos)
            dq_c, dk_j, dv_j, dl, dc = parts
            dls = tuple(a + b for a, b in zip(dls, dl, strict=True))
            dcs = tuple(a + b for a, b in zip(dcs, dc, strict=True))
            return dq_i + dq_c, dkt.at[j].add(dk_j), dvt.at[j].add(dv_j), dls, dcs

        dq0 = jnp.zeros((BK, R, H), jnp.float32)
        dq_i, dkt, dvt, dls, dcs = _visit_row(ls, (dq0, dkt, dvt, dls, dcs), idx_i, cnt_i, tile)
        return (dkt, dvt, dls, dcs), dq_i

    init = (
        jnp.zeros((k.shape[0], BK, H, ls.bk), jnp.float32),
        jnp.zeros((v.shape[0], BK, Hv, ls.bk), jnp.float32),
        tuple(jnp.zeros(x.shape, jnp.float32) for x in leaves),
        tuple(jnp.zeros(x.shape, jnp.float32) for x in consts),
    )
    iq = jnp.arange(nq, dtype=jnp.int32)
    xs = (q, dout, lse[0], lse[1], delta, iq, jnp.asarray(index), jnp.asarray(counts))
    (dkt, dvt, dls, dcs), dq = jax.lax.scan(one_query_block, init, xs)
    dk, dv = jnp.swapaxes(dkt, -1, -2) * ls.core.grad_scale, jnp.swapaxes(dvt, -1, -2)
    dk = dk if dk0 is None else dk0 + dk
    dv = dv if dv0 is None else dv0 + dv
    return dq * ls.core.grad_scale, dk, dv, dls, dcs


# ------------------------------------------------------------------------------------------
# Wide spans: one contiguous key span per query block instead of a list of tiles


def wide_spans(layout: np.ndarray, S: int, bk: int, max_keys: int, max_pairs: int, bq: int):
    """``(starts int32 [nq], width)`` when every query block's non-empty key blocks are one contiguous
    run of at most ``max_keys`` keys (a window, a band), else None.

    Each query block then takes one span of ``width = J * bk`` keys from ``starts[i]`` (its first
    non-empty block, moved left where the span would pass the last key block): one step per query block
    with the mask evaluated on the span, instead of J tile steps each paying a loop step and its softmax
    bookkeeping. The span covers every key the layout allows to the row, so extra keys it holds are ones
    the mask excludes or allows: either way the mask decides. ``max_pairs`` bounds ``bq * width`` (the
    span's logits stay in cache).
    """
    nq, nk = layout.shape
    rows = [np.nonzero(layout[i])[0] for i in range(nq)]
    J = max((len(r) for r in rows), default=0)
    width = J * bk
    if J < 2 or width > max_keys or bq * width > max_pairs:
        return None
    if any(len(r) and r[-1] - r[0] + 1 != len(r) for r in rows):
        return None
    last = max(0, nk * bk - width)
    starts = np.array([min(int(r[0]) * bk, last) if len(r) else 0 for r in rows], np.int32)
    return starts, width


# Steps of a band's loops (``forward_wide``, ``backward_wide``) per loop iteration: a band has many short steps
# (one per 64 query rows), and XLA:CPU pays a while loop's per-iteration cost once per 8 of them and can run
# the independent work of neighbouring steps side by side. ±128 window, 8 heads of 64, fp32, forward+backward,
# one process, alternating (2-core AVX-512 host; bit-identical results): 0.78-0.83 of the time at 8K and
# 16K, 0.92-0.99 at 1K and 4K; 16 per iteration was slower than 8 (docs/kernels.md, CHANGELOG.md).
WIDE_UNROLL = 8


def forward_wide(q, k, v, mask, leaves, consts, starts, *, ls: LoopSpec, bias_fn, rows: bool = False):
    """The forward over one key span per query block (``wide_spans``): same outputs as ``forward``.

    Tiles (``rows=False``): q ``[nq, B*K, G*bq, H]`` (pre-scaled), k, v ``[B*K, nk*bk, H|Hv]`` (``flat_kv``);
    returns out ``[nq, B*K, G*bq, Hv]`` and ``(m, log l)``, each ``[nq, B*K, G*bq]`` (fp32).

    Rows (``rows=True``): q ``[B, nq*bq, N, H]`` (unscaled), k, v ``[B, nk*bk, K, H|Hv]`` (lengths padded to
    whole blocks); each step slices its ``bq`` query rows and its span of ``W`` keys and moves only those
    slices to the tile layout, and its output back: no relayout of the whole arrays before and after the
    loop, which on XLA:CPU were a large share of a forward window ±128 at 16K (the slices stay in cache).
    Returns out ``[B, nq*bq, N, Hv]`` and ``(m, log l)``, each ``[B, nq*bq, N]`` (fp32). The blockwise
    kernel runs its forward on rows, and on tiles when the backward will need them anyway.
    """
    W, cd = ls.wide, ls.compute_dtype
    dots = Dots()
    if rows:  # one block's rows to a tile and back: row_tiles / untile on bq rows

        def query(i):
            x = jax.lax.dynamic_slice_in_dim(q, i * ls.bq, ls.bq, axis=1)
            return row_tiles((x.astype(jnp.float32) * ls.core.q_factor).astype(cd), ls)[0]

        def span(x, k0):  # keys k0 .. k0 + W of [B, nk*bk, K, D] -> [B*K, W, D]
            x = jax.lax.dynamic_slice_in_dim(x, k0, W, axis=1).astype(cd)
            return jnp.swapaxes(x, 1, 2).reshape(-1, W, x.shape[-1])

        def put(x):  # [B*K, G*bq, Hv] -> [B, bq, N, Hv]; per-row statistics [B*K, G*bq] -> [B, bq, N]
            return untile(x[None], ls, ls.bq) if x.ndim == 3 else untile(x[None, ..., None], ls, ls.bq)[..., 0]

        kf, vf = k, v
    else:
        kf, vf = k, v
        query = q.__getitem__

        def span(x, k0):
            return jax.lax.dynamic_slice_in_dim(x, k0, W, axis=1)

        put = None
    # dot-product logits are finite where the mask allows (NaN stays NaN): the fused form (softmax_once)
    finite = ls.core.form == "dot" and not ls.core.has_bias

    def one(args):
        i, k0 = args
        qi, kj, vj = query(i), span(kf, k0), span(vf, k0)
        q_pos, k_pos = core.positions(i, 0, ls.bq, W)
        k_pos = k_pos + k0
        ok = _mask(ls, mask, q_pos, k_pos)
        t = core.logits(ls.core, ls.view, dots.qk, qi, kj, q_pos, k_pos, leaves, consts, bias_fn)
        m, l, acc = core.softmax_once(
            t, ok, lambda p: jnp.einsum("nqs,nsh->nqh", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32),
            base2=ls.core.base2, finite=finite,
        )  # fmt: skip
        out, (m, log_l) = finalize(m, l, acc, ls=ls)
        if put is None:
            return out, (m, log_l)
        return put(out), (put(m), put(log_l))

    iq = jnp.arange(starts.shape[0], dtype=jnp.int32)
    _, (out, lse) = jax.lax.scan(lambda c, x: (c, one(x)), None, (iq, starts), unroll=WIDE_UNROLL)  # a map
    if put is None:
        return out, lse

    def joined(x):  # [nq, B, bq, ...] -> [B, nq*bq, ...] (a reshape when B == 1)
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])

    return joined(out), (joined(lse[0]), joined(lse[1]))


def backward_wide(q, k, v, mask, leaves, consts, starts, out, lse, dout, *, ls: LoopSpec, bias_fn, dlse=None):
    """The backward of ``forward_wide`` on tiles (k, v ``[B*K, nk*bk, H|Hv]``, ``flat_kv``): a scan over query
    blocks adding each span's dk, dv in place. Returns ``(dq, dk, dv, d_leaves, d_consts)`` as ``backward``,
    dk and dv in k and v's layout."""
    BK, S, H = k.shape
    Hv, W = v.shape[-1], ls.wide
    kf, vf = k, v
    delta = core.softmax_delta(out, dout, dlse)

    def one(carry, args):
        dkt, dvt, dls, dcs = carry  # transposed: [B*K, H, nk*bk], [B*K, Hv, nk*bk]
        qi, doi, m_i, log_l_i, delta_i, i, k0 = args
        kj = jax.lax.dynamic_slice_in_dim(kf, k0, W, axis=1)
        vj = jax.lax.dynamic_slice_in_dim(vf, k0, W, axis=1)
        q_pos, k_pos = core.positions(i, 0, ls.bq, W)
        k_pos = k_pos + k0
        ok = _mask(ls, mask, q_pos, k_pos)
        dots = Dots(qt=jnp.swapaxes(qi, -1, -2))
        t, pull = core.logits_vjp(ls.core, ls.view, dots, qi, kj, q_pos, k_pos, leaves, consts, bias_fn)
        p = core.probs(t, m_i[..., None], log_l_i[..., None], ok, base2=ls.core.base2)
        dot_i = jnp.swapaxes(doi, -1, -2)
        dv_j = jnp.einsum("nhq,nqs->nhs", dot_i, p.astype(doi.dtype), preferred_element_type=jnp.float32)
        dp = jnp.einsum("nqh,nsh->nqs", doi, vj, preferred_element_type=jnp.float32)
        dq_i, dk_j, dl, dc = pull(core.dlogits(p, dp, delta_i))

        def add(acc, x):
            return jax.lax.dynamic_update_slice_in_dim(acc, jax.lax.dynamic_slice_in_dim(acc, k0, W, 2) + x, k0, 2)

        dls = tuple(a + core.f32_cotangent(d, x) for a, d, x in zip(dls, dl, leaves, strict=True))
        dcs = tuple(a + core.f32_cotangent(d, x) for a, d, x in zip(dcs, dc, consts, strict=True))
        return (add(dkt, dk_j), add(dvt, dv_j), dls, dcs), dq_i

    init = (
        jnp.zeros((BK, H, S), jnp.float32),
        jnp.zeros((BK, Hv, S), jnp.float32),
        tuple(jnp.zeros(x.shape, jnp.float32) for x in leaves),
        tuple(jnp.zeros(x.shape, jnp.float32) for x in consts),
    )
    iq = jnp.arange(q.shape[0], dtype=jnp.int32)
    xs = (q, dout, lse[0], lse[1], delta, iq, starts)
    (dkt, dvt, dls, dcs), dq = jax.lax.scan(one, init, xs, unroll=WIDE_UNROLL)
    dk, dv = jnp.swapaxes(dkt, 1, 2), jnp.swapaxes(dvt, 1, 2)  # [B*K, nk*bk, D]
    return dq * ls.core.grad_scale, dk * ls.core.grad_scale, dv, dls, dcs


# ------------------------------------------------------------------------------------------
# Layout moves: [B, T, N, H] <-> heads-first tiles


def tile_q(q, ls: LoopSpec):
    """``[B, T, N, H]`` -> pre-scaled query tiles ``[nq, B*K, G*bq, H]`` (compute dtype, T padded to nq*bq)."""
    return row_tiles((q.astype(jnp.float32) * ls.core.q_factor).astype(ls.compute_dtype), ls)


def row_tiles(x, ls: LoopSpec):
    """Per-query rows ``[B, T, N, D]`` -> tiles ``[nq, B*K, G*bq, D]`` (T padded to nq*bq; dtype kept)."""
    B, T, N, D = x.shape
    K, G, bq = ls.K, N // ls.K, ls.bq
    nq = -(-T // bq)
    x = jnp.pad(x.reshape(B, T, K, G, D), ((0, 0), (0, nq * bq - T), (0, 0), (0, 0), (0, 0)))
    # [B, nq, bq, K, G, D] -> [nq, B, K, G, bq, D] -> [nq, B*K, G*bq, D]
    return x.reshape(B, nq, bq, K, G, D).transpose(1, 0, 3, 4, 2, 5).reshape(nq, B * K, G * bq, D)


def _padded_keys(x, ls: LoopSpec):
    """``[B, S, K, D]`` in the compute dtype, S padded to whole key blocks (``nk * bk``)."""
    S = x.shape[1]
    return jnp.pad(x.astype(ls.compute_dtype), ((0, 0), (0, -(-S // ls.bk) * ls.bk - S), (0, 0), (0, 0)))


def tile_kv(x, ls: LoopSpec):
    """``[B, S, K, D]`` -> key/value tiles ``[nk, B*K, bk, D]`` (compute dtype, S padded to nk*bk)."""
    x = _padded_keys(x, ls)
    B, S, K, D = x.shape
    nk = S // ls.bk
    return x.reshape(B, nk, ls.bk, K, D).transpose(1, 0, 3, 2, 4).reshape(nk, B * K, ls.bk, D)


def flat_kv(x, ls: LoopSpec):
    """``[B, S, K, D]`` -> one row of keys per head ``[B*K, nk*bk, D]`` (compute dtype, S padded to nk*bk): a
    band's layout, each query block's span a slice of it (one move, where tiles then rows were two)."""
    x = _padded_keys(x, ls)
    B, S, K, D = x.shape
    return jnp.swapaxes(x, 1, 2).reshape(B * K, S, D)


def untile(out, ls: LoopSpec, T: int):
    """Output tiles ``[nq, B*K, G*bq, Hv]`` -> ``[B, T, N, Hv]``."""
    nq, BK, _, Hv = out.shape
    K, G, bq = ls.K, ls.N // ls.K, ls.bq
    B = BK // K
    out = out.reshape(nq, B, K, G, bq, Hv).transpose(1, 0, 4, 2, 3, 5)  # [B, nq, bq, K, G, Hv]
    return out.reshape(B, nq * bq, ls.N, Hv)[:, :T]
