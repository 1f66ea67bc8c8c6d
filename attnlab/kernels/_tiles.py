"""The tile machinery shared by the blockwise kernel, ring attention and the Pallas kernels (private).

One place for what a flash-style kernel is made of, so each kernel module keeps only its own
plan and entry point:

- the static description of a tiling (``Static``) and the moves between the ``[B, T, N, H]``
  layout and heads-first tiles (``tile_q``, ``tile_kv``, ``untile``);
- the block schedule read from a mask's block layout (``block_schedule``, ``adjust_layout``,
  ``layout_rows``);
- one tile's logits, element mask, bias and dropout decisions;
- the online softmax as a resumable block step (``init_carry``, ``forward_carry``, ``finalize``)
  and the FlashAttention-2-style ``backward`` that recomputes probabilities from the
  log-sum-exp (with travelling dk/dv accumulators for ring attention);
- dtype, scale, dropout and cotangent helpers.

``attnlab.kernels.blockwise`` wraps these in a ``custom_vjp`` over one device;
``attnlab.kernels.ring`` streams key/value shards through the same block step and backward.
Shapes follow the legend in ``attnlab.kernels.blockwise``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib
from attnlab.numerics import check_dropout, compute_dtype, default_scale, dropout_keep  # noqa: F401 (for the kernels)


def zero_cotangents(tree):
    """Zero cotangents for a pytree of non-differentiated inputs (masks, schedules).

    Integer and boolean leaves get ``float0`` zeros (what ``custom_vjp`` requires for them),
    floating leaves (e.g. a float padding length) zeros of their own shape and dtype.
    """

    def zero(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.zeros_like(x)
        return np.zeros(x.shape, jax.dtypes.float0)

    return jax.tree_util.tree_map(zero, tree)


# ------------------------------------------------------------------------------------------
# The static schedule: which key blocks each query block visits


def block_schedule(layout: np.ndarray, S: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query block, the list of non-empty key blocks and their kind.

    Args:
        layout: int8 ``[nq, nk]`` from ``mask.block_layout`` (0 EMPTY, 1 PARTIAL, 2 FULL).
        S: key length (a short last key block is made PARTIAL so its padding is masked).
        bk: key block size.

    Returns:
        ``(index, kind)``, both int32 ``[nq, J]``: key block indices (padding entries point to
        block 0) and kinds (0 = padding entry, skipped; 1 = PARTIAL; 2 = FULL).
    """
    return layout_rows(adjust_layout(layout, S, bk))


def adjust_layout(layout: np.ndarray, S: int, bk: int) -> np.ndarray:
    layout = np.array(layout, np.int32)
    if S % bk:
        layout[:, -1] = np.minimum(layout[:, -1], masks_lib.PARTIAL)
    return layout


def padded_schedule(layout: np.ndarray) -> np.ndarray:
    """layout int ``[n_rows, n_cols]`` -> int32 ``[n_rows, 2, J]`` (column index; kind), J a power of two.

    The schedule as one kernel input (the Pallas kernels: Triton tensor sizes are powers of two).
    """
    index, kind = layout_rows(layout)
    J = 1 << max(0, index.shape[1] - 1).bit_length()
    sched = np.zeros((layout.shape[0], 2, J), np.int32)
    sched[:, 0, : index.shape[1]] = index
    sched[:, 1, : kind.shape[1]] = kind
    return sched


def layout_rows(layout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nq = layout.shape[0]
    rows = [np.nonzero(layout[i])[0] for i in range(nq)]
    J = max(1, max(len(r) for r in rows))
    index = np.zeros((nq, J), np.int32)
    kind = np.zeros((nq, J), np.int32)
    for i, r in enumerate(rows):
        index[i, : len(r)] = r
        kind[i, : len(r)] = layout[i, r]
    return index, kind


# ------------------------------------------------------------------------------------------
# One tile: logits, the element mask, and the bias function


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything the traced kernel needs to know as Python values (hashable, static)."""

    T: int
    S: int
    bq: int
    bk: int
    lead: tuple
    N: int
    K: int
    scale: float
    has_bias: bool
    kinds_used: tuple  # sorted kinds present in the schedule, e.g. (2,) for full attention
    kinds_used_t: tuple  # the same for the transposed schedule (key block -> query blocks)
    compute_dtype: str
    dropout_rate: float = 0.0
    # the tile form of a score other than the plain dot product (scores.Score: tile_mod / tile_pair), as
    # (treedef,) of the score object, () for the dot product (a tuple: a PyTreeDef cannot be compared with
    # None); its array leaves are the last consts, after the bias's n_bias
    score: tuple = ()
    n_bias: int = 0
    runtime_schedule: bool = False  # the schedule comes from the mask's runtime_layout (per-row counts, on device)
    wide: int = 0  # > 0: one key span of this many keys per query block (``wide_spans``), not a tile schedule
    # the Pallas kernels' extra statics (attnlab.kernels.pallas_flash); defaults elsewhere
    H: int = 0
    Hv: int = 0
    struct: object = None  # the in-kernel (arithmetic) part of the mask, or None
    has_bitmap: bool = False  # the data part of the mask comes as per-tile bitmaps
    bm_shape: tuple = (1, 1)  # (Bm, Nm) of those bitmaps
    num_warps: int = 4
    num_stages: int = 2
    on_gpu: bool = False  # traced for the Triton lowering (not Pallas interpret mode): fp32 dots as TF32x3
    # the score's array leaves as the Pallas kernels take them: (head axis or None, is floating) per leaf
    score_leaves: tuple = ()

    def tile_score(self, consts):
        """The score object rebuilt from its treedef and its leaves (the consts after the bias's), or None."""
        return self.score[0].unflatten(consts[self.n_bias :]) if self.score else None

    @property
    def lead_size(self) -> int:
        return math.prod(self.lead)

    @property
    def groups(self) -> int:
        return self.N // self.K  # G

    @property
    def fp32(self) -> bool:
        return self.compute_dtype == "float32"


def _to_tile(x: jax.Array, st: Static) -> jax.Array:
    """[..., N|1, bq|1, bk|1] (broadcastable to [*lead, N, bq, bk]) -> [B*K|1, G*bq, bk|1].

    The result broadcasts against a logit tile ``[B*K, G*bq, bk]`` (rows ordered (g, q))."""
    nl, G = len(st.lead), st.N // st.K
    x = x.reshape((1,) * (nl + 3 - x.ndim) + tuple(x.shape))
    if any(d != 1 for d in x.shape[:nl]):
        x = jnp.broadcast_to(x, st.lead + x.shape[nl:]).reshape((-1,) + x.shape[nl:])
    else:
        x = x.reshape((1,) + x.shape[nl:])
    b_, n_, _, k_ = x.shape  # [B|1, N|1, bq|1, bk|1]
    x = x.reshape(b_, 1, 1, x.shape[2], k_) if n_ == 1 else x.reshape(b_, st.K, G, x.shape[2], k_)
    if b_ == 1 and n_ == 1:
        return jnp.broadcast_to(x, (1, 1, G, st.bq, k_)).reshape(1, G * st.bq, k_)
    return jnp.broadcast_to(x, (st.lead_size, st.K, G, st.bq, k_)).reshape(st.lead_size * st.K, G * st.bq, k_)


def _positions(i, k0, width: int, st: Static):
    """Query positions of block i [bq] and the ``width`` key positions from ``k0`` (a tile: j * bk, bk)."""
    q_pos = i * st.bq + jnp.arange(st.bq, dtype=jnp.int32)  # [bq]
    k_pos = k0 + jnp.arange(width, dtype=jnp.int32)  # [width]
    return q_pos, k_pos


def _allowed(mask, i, k0, width: int, st: Static):
    """bool [B*K|1, G*bq, width]: the mask on query block i and keys k0 .. k0 + width, False past S."""
    q_pos, k_pos = _positions(i, k0, width, st)
    q_c = jnp.minimum(q_pos, st.T - 1)  # padded query rows are discarded; keep indices in range
    k_c = jnp.minimum(k_pos, st.S - 1)
    ok = (k_pos < st.S)[None, :]
    if mask is not None:
        ok = ok & mask(q_c, k_c)
    return _to_tile(ok, st)


def _tile_keep(seed, i, j, st: Static):
    """bool [B*K, G*bq, bk]: the dropout decisions on tile (i, j), as ``dropout_keep`` draws them densely."""
    G = st.N // st.K
    bk_ = jnp.arange(st.lead_size * st.K, dtype=jnp.uint32)[:, None, None]  # tile batch row = b * K + kh
    r = jnp.arange(G * st.bq, dtype=jnp.uint32)[None, :, None]  # tile row = g * bq + q
    n = (bk_ % st.K) * G + r // st.bq  # query head
    rows = ((bk_ // st.K) * st.N + n) * st.T + (i * st.bq + r % st.bq).astype(jnp.uint32)
    cols = (j * st.bk + jnp.arange(st.bk, dtype=jnp.int32)).astype(jnp.uint32)[None, None, :]
    return dropout_keep(seed, st.dropout_rate, rows, cols)


def _drop(x, keep, st: Static):
    """Dropped and rescaled: ``where(keep, x / (1 - rate), 0)``; x unchanged without dropout."""
    if keep is None:
        return x
    return jnp.where(keep, x * jnp.float32(1.0 / (1.0 - st.dropout_rate)), 0.0)


def _from_tile(s, st: Static):
    """A logit tile [B*K, G*bq, bk] -> [*lead, N, bq, bk] (rows are (g, q) and n = kh * G + g: a reshape)."""
    return s.reshape(*st.lead, st.N, st.bq, s.shape[-1])


def _post(s, consts, bias_fn, i, k0, st: Static):
    """The logits after the dot (or pair) product: the score's ``tile_mod``, then + bias(q_pos, k_pos)."""
    if not st.score and not st.has_bias:
        return s
    q_pos, k_pos = _positions(i, k0, s.shape[-1], st)
    q_c, k_c = jnp.minimum(q_pos, st.T - 1), jnp.minimum(k_pos, st.S - 1)
    if st.score:
        score = st.tile_score(consts)
        if score.has_mod:
            s = score.tile_mod(_from_tile(s, st), q_c, k_c).reshape(s.shape)
    if st.has_bias:
        s = s + _to_tile(bias_fn(q_c, k_c, *consts[: st.n_bias]).astype(jnp.float32), st)
    return s


def _raw(qi, kj, consts, st: Static):
    """fp32 [B*K, G*bq, bk]: (pre-scaled q) . k, or the score's pair form."""
    score = st.tile_score(consts)
    if score is not None and score.pair_form:
        BK, R, H = qi.shape
        B, G = BK // st.K, R // st.bq
        s = score.tile_pair(qi.reshape(B, st.K, G, st.bq, H), kj.reshape(B, st.K, kj.shape[1], H))
        return s.reshape(BK, R, kj.shape[1])
    return jnp.einsum("nqh,nsh->nqs", qi, kj, preferred_element_type=jnp.float32)


def _logits(qi, kj, bias_fn, consts, i, k0, st: Static):
    """fp32 [B*K, G*bq, bk]: the tile's logits (dot or pair product, the score's tile_mod, the bias);
    ``k0`` is the position of the tile's first key (j * bk)."""
    return _post(_raw(qi, kj, consts, st), consts, bias_fn, i, k0, st)


def _logits_vjp(qi, kj, bias_fn, consts, i, k0, st: Static, qt=None):
    """The tile's logits and a function ds -> (dq [B*K, G*bq, H], dk^T [B*K, H, bk], dconsts), fp32.

    The dot product's own part is two plain matmuls; what comes after it (``tile_mod``, the bias) and a
    pair form are differentiated by ``jax.vjp`` on this tile only; with no arrays to differentiate
    (``SoftCap``), the elementwise ``tile_mod``'s slope comes from one ``jax.jvp`` instead, computed
    with the logits (on XLA:CPU that ran SoftCap's fwd+bwd at 4K about a tenth faster than ``jax.vjp``).
    ``qt``: qi transposed, [B*K, H, G*bq] (made once per query block by the caller).
    """
    score = st.tile_score(consts)
    if score is not None and score.pair_form:

        def f(qi, kj, *cs):
            return _logits(qi, kj, bias_fn, cs, i, k0, st)

        s, vjp = jax.vjp(f, qi, kj, *consts)

        def pull(ds):
            dq, dk, *dcs = vjp(ds)
            return dq.astype(jnp.float32), jnp.swapaxes(dk, -1, -2).astype(jnp.float32), tuple(dcs)

        return s, pull
    raw = jnp.einsum("nqh,nsh->nqs", qi, kj, preferred_element_type=jnp.float32)
    if not st.score and not (st.has_bias and consts):
        s, post_vjp = _post(raw, consts, bias_fn, i, k0, st), None
    elif not consts:  # an elementwise tile_mod (and a bias with no arrays): its slope by one jvp, fused
        s, slope = jax.jvp(lambda r: _post(r, (), bias_fn, i, k0, st), (raw,), (jnp.ones_like(raw),))
        post_vjp = lambda ds: (ds * slope,)  # noqa: E731
    else:
        s, post_vjp = jax.vjp(lambda r, *cs: _post(r, cs, bias_fn, i, k0, st), raw, *consts)

    def pull(ds):
        dcs = tuple(jnp.zeros(x.shape, jnp.float32) for x in consts)
        if post_vjp is not None:
            ds, *dcs = post_vjp(ds)
        dq = jnp.einsum("nqs,nsh->nqh", ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32)
        qt_ = jnp.swapaxes(qi, -1, -2) if qt is None else qt
        dkt = jnp.einsum("nhq,nqs->nhs", qt_, ds.astype(qi.dtype), preferred_element_type=jnp.float32)
        return dq, dkt, tuple(dcs)

    return s, pull


# ------------------------------------------------------------------------------------------
# Forward: lax.map over query blocks, lax.scan over that block's non-empty key blocks


def forward(q, k, v, mask, consts, index, kind, *, st: Static, bias_fn, seed=None, count=None):
    """q [nq, B*K, G*bq, H] (pre-scaled), k [nk, B*K, bk, H], v [nk, B*K, bk, Hv].

    ``count`` (int32 [nq] or None): how many leading entries of each schedule row to visit (a schedule
    made on device, ``runtime_schedule``); None visits every entry (kind 0 entries are skipped).
    Returns out [nq, B*K, G*bq, Hv] (compute dtype) and lse = (m, log l), each [nq, B*K, G*bq] (fp32).
    """
    carry = init_carry(q, v.shape[-1])
    return finalize(
        *forward_carry(q, k, v, mask, consts, index, kind, carry, st=st, bias_fn=bias_fn, seed=seed, count=count)
    )


def runtime_schedule(layout, runtime, S: int, bk: int, J: int):
    """The static (adjusted) layout refined by a mask's runtime layout -> (index, kind, count), on device.

    ``layout`` int [nq, nk] (static, ``adjust_layout``-ed), ``runtime`` int8 [nq, nk] (traced): a tile
    is EMPTY if either says so, FULL if either says so (both are safe for the same mask), PARTIAL
    otherwise; the short last key block stays at most PARTIAL. Each row lists its non-empty tiles first
    (``index``, ``kind`` int32 [nq, J], J the static schedule's width) and ``count`` [nq] says how many.
    """
    layout = jnp.asarray(layout, jnp.int32)
    runtime = runtime.astype(jnp.int32)
    empty = (layout == masks_lib.EMPTY) | (runtime == masks_lib.EMPTY)
    full = (layout == masks_lib.FULL) | (runtime == masks_lib.FULL)
    refined = jnp.where(empty, masks_lib.EMPTY, jnp.where(full, masks_lib.FULL, masks_lib.PARTIAL))
    if S % bk:
        refined = refined.at[:, -1].set(jnp.minimum(refined[:, -1], masks_lib.PARTIAL))
    nonempty = refined != masks_lib.EMPTY
    order = jnp.argsort(~nonempty, axis=1, stable=True)[:, :J].astype(jnp.int32)  # non-empty first, in order
    count = nonempty.sum(1).astype(jnp.int32)
    kind = jnp.take_along_axis(refined, order, axis=1)
    kind = jnp.where(jnp.arange(J)[None, :] < count[:, None], kind, 0)
    return order, kind.astype(jnp.int32), count


def _loop(step, carry, index_i, kind_i, count_i):
    """Folds ``step(carry, (j, kind))`` over a schedule row: a scan, or a loop of ``count_i`` steps."""
    if count_i is None:
        return jax.lax.scan(step, carry, (index_i, kind_i))[0]
    return jax.lax.fori_loop(0, count_i, lambda t, c: step(c, (index_i[t], kind_i[t]))[0], carry)


def init_carry(q, Hv):
    """Empty online-softmax state for tiled queries q [nq, B*K, G*bq, H]: (m, l, acc), fp32.

    The running max starts at -inf, not at a finite "very negative" value: finite logits, however
    negative (a bias of finfo.min), are part of the softmax; only masked and -inf entries are not.
    """
    shape = q.shape[:-1]
    return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, Hv), jnp.float32)


def finalize(m, l, acc):
    """Online-softmax state -> (out = acc / l, lse = (m, log l)); rows with nothing allowed -> 0, (0, inf).

    The log-sum-exp is kept as the pair (m, log l), not the sum m + log l: for logits near
    finfo.min, m + log l rounds back to m (its ulp is ~2e31) and the backward's
    ``exp(s - lse)`` would lose the 1/l. ``exp((s - m) - log l)`` keeps it (``tile_probs``). An
    empty row has log l = +inf, so its recomputed probabilities are 0 in any tile.
    """
    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[..., None]
    m = jnp.where(nonempty, m, 0.0)
    log_l = jnp.where(nonempty, jnp.log(jnp.where(nonempty, l, 1.0)), jnp.inf)
    return out, (m, log_l)


def lse_value(lse):
    """The pair (m, log l) -> log-sum-exp m + log l, -inf on rows with nothing allowed (fp32)."""
    m, log_l = lse
    return jnp.where(log_l == jnp.inf, -jnp.inf, m + log_l)


def tile_probs(s, m, log_l):
    """Softmax probabilities of logits ``s`` from the row statistics (broadcast to s by the caller)."""
    return jnp.exp((s - m) - log_l)


def forward_carry(q, k, v, mask, consts, index, kind, carry, *, st: Static, bias_fn, seed=None, count=None):
    """The block step: folds the key blocks of the schedule into the running (m, l, acc).

    ``carry`` is ``(m [nq, B*K, G*bq], l [same], acc [nq, B*K, G*bq, Hv])`` (fp32) from
    ``init_carry`` or a previous call, so a caller can stream key/value blocks that arrive one
    after another (ring attention) and ``finalize`` once at the end. ``mask(q_idx, k_idx)`` sees
    local block positions; a caller with sharded sequences passes a mask that adds its offsets.
    With ``st.dropout_rate > 0``, ``seed`` (uint32 [2]) draws the dropout mask per tile; the
    running sum ``l`` is of the undropped probabilities (dropout acts after normalisation).
    """

    def one_query_block(args):
        qi, i, idx_i, kind_i, count_i, m0, l0, acc0 = args

        def step(carry, jk):
            j, kd = jk

            def visit(carry, partial, ok=None):
                if partial and ok is None:  # evaluate the tile's mask; skip it if empty at run time
                    ok = _allowed(mask, i, j * st.bk, st.bk, st)
                    return jax.lax.cond(ok.any(), functools.partial(visit, partial=True, ok=ok), lambda c: c, carry)
                m, l, acc = carry
                s = _logits(qi, k[j], bias_fn, consts, i, j * st.bk, st)
                if partial:
                    s = jnp.where(ok, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                # nothing allowed yet (m_new = -inf): shift by 0, so exp(-inf - 0) = 0, never NaN;
                # the carried max stays -inf, so a later finite (however negative) logit still counts
                shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(s - shift[..., None])
                alpha = jnp.exp(m - shift)
                l = l * alpha + p.sum(-1)
                keep = _tile_keep(seed, i, j, st) if st.dropout_rate else None
                pd = _drop(p, keep, st)
                pv = jnp.einsum("nqs,nsh->nqh", pd.astype(v.dtype), v[j], preferred_element_type=jnp.float32)
                return m_new, l, acc * alpha[..., None] + pv

            branches = {
                0: lambda c: c,
                1: functools.partial(visit, partial=True),
                2: functools.partial(visit, partial=False),
            }
            if len(st.kinds_used) == 1:
                return branches[st.kinds_used[0]](carry), None
            return jax.lax.switch(kd, [branches[0], branches[1], branches[2]], carry), None

        return _loop(step, (m0, l0, acc0), idx_i, kind_i, count_i)

    iq = jnp.arange(q.shape[0], dtype=jnp.int32)
    return jax.lax.map(one_query_block, (q, iq, index, kind, count, *carry))


# ------------------------------------------------------------------------------------------
# Backward: recompute each tile's probabilities from the stored log-sum-exp


def backward(
    q,
    k,
    v,
    mask,
    consts,
    index,
    kind,
    out,
    lse,
    dout,
    *,
    st: Static,
    bias_fn,
    dk0=None,
    dv0=None,
    seed=None,
    dlse=None,
    count=None,
):
    """FlashAttention-2-style backward: scan over query blocks; dk, dv are carried full-size.

    ``dk0``/``dv0`` (fp32, k's/v's tile shapes) are added to: a caller streaming key/value shards
    (ring attention) passes its travelling accumulators instead of adding a fresh copy.

    dk and dv are accumulated transposed, ``[nk, B*K, H, bk]``, from the transposed query and
    output-gradient tiles (``q_i^T``, ``do_i^T``: small, made once per query block): then all five
    tile matmuls are plain products (``do^T p``, not ``p^T do``); XLA:CPU runs a product whose
    left operand is contracted over its rows at about half speed.

    ``dlse`` (fp32 ``[nq, B*K, G*bq]`` or None) is the cotangent of the returned log-sum-exp:
    d lse / d logit = p, so it only shifts ``delta``. With dropout (``seed``), the recomputed tile
    mask scales p in dv and dp, as in the forward.
    """
    nq, BK, R, H = q.shape
    delta = softmax_delta(out, dout, dlse)  # [nq, B*K, G*bq]

    def one_query_block(carry, args):
        dk, dv, dconsts = carry  # transposed: [nk, B*K, H, bk], [nk, B*K, Hv, bk]
        qi, doi, lse_i, delta_i, i, idx_i, kind_i, count_i = args
        qt_i, dot_i = jnp.swapaxes(qi, -1, -2), jnp.swapaxes(doi, -1, -2)  # [B*K, H, G*bq], [B*K, Hv, G*bq]

        def step(c, jk):
            j, kd = jk
            kj, vj = k[j], v[j]

            # A branch returns only this tile's contributions (dq_i's, dk_j, dv_j, the bias
            # constants'), never the full-size dk/dv carries: passing those through lax.switch /
            # lax.cond made XLA copy them on every tile (causal fwd+bwd was slower than full).
            def zeros():
                return (
                    jnp.zeros((BK, R, H), jnp.float32),
                    jnp.zeros((BK, H, st.bk), jnp.float32),
                    jnp.zeros((BK, dout.shape[-1], st.bk), jnp.float32),
                    tuple(jnp.zeros(x.shape, jnp.float32) for x in consts),
                )

            def visit(partial, ok=None):
                if partial and ok is None:
                    ok = _allowed(mask, i, j * st.bk, st.bk, st)
                    return jax.lax.cond(ok.any(), functools.partial(visit, True, ok), zeros)
                s, pull = _logits_vjp(qi, kj, bias_fn, consts, i, j * st.bk, st, qt=qt_i)
                p = tile_probs(s, lse_i[0][..., None], lse_i[1][..., None])
                if partial:
                    p = jnp.where(ok, p, 0.0)
                keep = _tile_keep(seed, i, j, st) if st.dropout_rate else None
                pd = _drop(p, keep, st)
                dv_j = jnp.einsum("nhq,nqs->nhs", dot_i, pd.astype(doi.dtype), preferred_element_type=jnp.float32)
                dp = _drop(jnp.einsum("nqh,nsh->nqs", doi, vj, preferred_element_type=jnp.float32), keep, st)
                ds = p * (dp - delta_i[..., None])  # d(logit) [B*K, G*bq, bk]
                dq_c, dk_j, dcs = pull(ds)
                dcs = tuple(_f32_cotangent(d, x) for d, x in zip(dcs, consts, strict=True))
                return dq_c, dk_j, dv_j, dcs

            branches = {0: zeros, 1: functools.partial(visit, True), 2: functools.partial(visit, False)}
            if len(st.kinds_used) == 1:
                dq_c, dk_j, dv_j, dcs = branches[st.kinds_used[0]]()
            else:
                dq_c, dk_j, dv_j, dcs = jax.lax.switch(kd, [branches[0], branches[1], branches[2]])
            dq_i, dk, dv, dconsts = c
            dconsts = tuple(x + y for x, y in zip(dconsts, dcs, strict=True))
            return (dq_i + dq_c, dk.at[j].add(dk_j), dv.at[j].add(dv_j), dconsts), None

        dq0 = jnp.zeros((BK, R, H), jnp.float32)
        dq_i, dk, dv, dconsts = _loop(step, (dq0, dk, dv, dconsts), idx_i, kind_i, count_i)
        return (dk, dv, dconsts), dq_i

    dk0 = jnp.zeros(k.shape, jnp.float32) if dk0 is None else dk0
    dv0 = jnp.zeros(v.shape, jnp.float32) if dv0 is None else dv0
    dc0 = tuple(jnp.zeros(c.shape, jnp.float32) for c in consts)
    iq = jnp.arange(nq, dtype=jnp.int32)
    carry0 = (jnp.swapaxes(dk0, -1, -2), jnp.swapaxes(dv0, -1, -2), dc0)
    (dk, dv, dconsts), dq = jax.lax.scan(one_query_block, carry0, (q, dout, lse, delta, iq, index, kind, count))
    return dq, jnp.swapaxes(dk, -1, -2), jnp.swapaxes(dv, -1, -2), const_cotangents(dconsts, consts)


def _f32_cotangent(d, x):
    """A const's tile cotangent as fp32 of its shape (an integer const's float0 -> zeros)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact) or d.dtype == jax.dtypes.float0:
        return jnp.zeros(x.shape, jnp.float32)
    return d.astype(jnp.float32)


def const_cotangents(dconsts, consts):
    """Accumulated fp32 cotangents -> each const's dtype; integer consts get ``float0`` zeros."""
    return tuple(
        d.astype(c.dtype) if jnp.issubdtype(c.dtype, jnp.inexact) else np.zeros(c.shape, jax.dtypes.float0)
        for d, c in zip(dconsts, consts, strict=True)
    )


# ------------------------------------------------------------------------------------------
# Wide spans: one contiguous key span per query block instead of a list of tiles


def wide_spans(layout: np.ndarray, S: int, bk: int, max_keys: int, max_pairs: int, bq: int):
    """``(starts int32 [nq], width)`` when every query block's non-empty key blocks are one contiguous
    run of at most ``max_keys`` keys (a window, a band), else None.

    Each query block then takes one span of ``width = J * bk`` keys from ``starts[i]`` (its first
    non-empty block, moved left where the span would pass the last key block): one step per query block
    with the mask evaluated on the span, instead of J tile steps each paying a loop step, a branch and
    its softmax bookkeeping. The span covers every key the layout allows to the row, so extra keys it
    holds are ones the mask excludes or allows: either way the mask decides. ``max_pairs`` bounds
    ``bq * width`` (the span's logits stay in cache).
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


def _flat_kv(x):
    """Key/value tiles [nk, B*K, bk, D] -> [B*K, nk*bk, D]."""
    nk, BK, bk, D = x.shape
    return jnp.swapaxes(x, 0, 1).reshape(BK, nk * bk, D)


def forward_wide(q, k, v, mask, consts, starts, *, st: Static, bias_fn, rows: bool = False):
    """The forward over one key span per query block (``wide_spans``): same outputs as ``forward``.

    Tiles (``rows=False``): q ``[nq, B*K, G*bq, H]`` (pre-scaled), k, v ``[nk, B*K, bk, H|Hv]``; returns out
    ``[nq, B*K, G*bq, Hv]`` and lse = (m, log l), each ``[nq, B*K, G*bq]`` (fp32).

    Rows (``rows=True``): q ``[B, nq*bq, N, H]`` (unscaled), k, v ``[B, nk*bk, K, H|Hv]`` (lengths padded to
    whole blocks); each step slices its ``bq`` query rows and its span of ``W`` keys and moves only those
    slices to the tile layout, and its output back: no relayout of the whole arrays before and after the
    loop, which on XLA:CPU were a large share of a forward window ±128 at 16K (the slices stay in cache).
    Returns out ``[B, nq*bq, N, Hv]`` and lse = (m, log l), each ``[B, nq*bq, N]`` (fp32). The blockwise
    kernel runs its forward on rows, and on tiles when the backward will need them anyway.
    """
    W, cd = st.wide, st.compute_dtype
    if rows:  # one block's rows to a tile and back: row_tiles / untile on bq rows

        def query(i):
            x = jax.lax.dynamic_slice_in_dim(q, i * st.bq, st.bq, axis=1)
            return row_tiles((x.astype(jnp.float32) * st.scale).astype(cd), st)[0]

        def span(x, k0):  # keys k0 .. k0 + W of [B, nk*bk, K, D] -> [B*K, W, D]
            x = jax.lax.dynamic_slice_in_dim(x, k0, W, axis=1).astype(cd)
            return jnp.swapaxes(x, 1, 2).reshape(-1, W, x.shape[-1])

        def put(x):  # [B*K, G*bq, Hv] -> [B, bq, N, Hv]; per-row statistics [B*K, G*bq] -> [B, bq, N]
            return untile(x[None], st, st.bq) if x.ndim == 3 else untile(x[None, ..., None], st, st.bq)[..., 0]

        kf, vf = k, v
    else:
        kf, vf = _flat_kv(k), _flat_kv(v)
        query = q.__getitem__

        def span(x, k0):
            return jax.lax.dynamic_slice_in_dim(x, k0, W, axis=1)

        put = None

    def one(args):
        i, k0 = args
        qi, kj, vj = query(i), span(kf, k0), span(vf, k0)
        ok = _allowed(mask, i, k0, W, st)
        s = _logits(qi, kj, bias_fn, consts, i, k0, st)
        if st.score or st.has_bias:  # a score or bias can make every allowed logit of a row -inf: shift safely
            s = jnp.where(ok, s, -jnp.inf)
            m = s.max(-1)
            p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])  # a row with nothing allowed: p = 0
            l = p.sum(-1)
            acc = jnp.einsum("nqs,nsh->nqh", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
        else:
            # Dot-product logits are finite (NaN stays NaN), so a row's max is -inf only where the mask allows
            # nothing: the mask goes in as a 0/-inf bias and the shift is the max itself, which XLA:CPU fuses
            # with the matmul into one kernel when the max is not needed after it (a forward without the
            # log-sum-exp); a guard on the max splits that kernel. Rows the mask empties come out NaN here
            # and are zeroed from the mask alone. (A NaN or infinite key that the mask excludes but the
            # span holds makes the row NaN, as a NaN value the mask excludes does in every implementation.)
            s = s + jnp.where(ok, 0.0, -jnp.inf)
            m = s.max(-1)
            p = jnp.exp(s - m[..., None])
            empty = ~ok.any(-1)
            l = jnp.where(empty, 0.0, p.sum(-1))
            acc = jnp.einsum("nqs,nsh->nqh", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
            acc = jnp.where(empty[..., None], 0.0, acc)
        out, (m, log_l) = finalize(m, l, acc)
        if put is None:
            return out, (m, log_l)
        return put(out), (put(m), put(log_l))

    iq = jnp.arange(starts.shape[0], dtype=jnp.int32)
    out, lse = jax.lax.map(one, (iq, starts))
    if put is None:
        return out, lse

    def joined(x):  # [nq, B, bq, ...] -> [B, nq*bq, ...] (a reshape when B == 1)
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])

    return joined(out), (joined(lse[0]), joined(lse[1]))


def backward_wide(q, k, v, mask, consts, starts, out, lse, dout, *, st: Static, bias_fn, dlse=None):
    """The backward of ``forward_wide``: a scan over query blocks adding each span's dk, dv in place."""
    nk, BK, bk, H = k.shape
    Hv, W = v.shape[-1], st.wide
    kf, vf = _flat_kv(k), _flat_kv(v)
    delta = softmax_delta(out, dout, dlse)

    def one(carry, args):
        dkt, dvt, dconsts = carry  # transposed: [B*K, H, nk*bk], [B*K, Hv, nk*bk]
        qi, doi, lse_i, delta_i, i, k0 = args
        kj = jax.lax.dynamic_slice_in_dim(kf, k0, W, axis=1)
        vj = jax.lax.dynamic_slice_in_dim(vf, k0, W, axis=1)
        ok = _allowed(mask, i, k0, W, st)
        s, pull = _logits_vjp(qi, kj, bias_fn, consts, i, k0, st, qt=jnp.swapaxes(qi, -1, -2))
        p = jnp.where(ok, tile_probs(s, lse_i[0][..., None], lse_i[1][..., None]), 0.0)
        dot_i = jnp.swapaxes(doi, -1, -2)
        dv_j = jnp.einsum("nhq,nqs->nhs", dot_i, p.astype(doi.dtype), preferred_element_type=jnp.float32)
        dp = jnp.einsum("nqh,nsh->nqs", doi, vj, preferred_element_type=jnp.float32)
        dq_i, dk_j, dcs = pull(p * (dp - delta_i[..., None]))

        def add(acc, x):
            return jax.lax.dynamic_update_slice_in_dim(acc, jax.lax.dynamic_slice_in_dim(acc, k0, W, 2) + x, k0, 2)

        dconsts = tuple(a + _f32_cotangent(d, c) for a, d, c in zip(dconsts, dcs, consts, strict=True))
        return (add(dkt, dk_j), add(dvt, dv_j), dconsts), dq_i

    init = (
        jnp.zeros((BK, H, nk * bk), jnp.float32),
        jnp.zeros((BK, Hv, nk * bk), jnp.float32),
        tuple(jnp.zeros(c.shape, jnp.float32) for c in consts),
    )
    iq = jnp.arange(q.shape[0], dtype=jnp.int32)
    (dkt, dvt, dconsts), dq = jax.lax.scan(one, init, (q, dout, lse, delta, iq, starts))

    def tiles(xt):  # [B*K, D, nk*bk] -> [nk, B*K, bk, D]
        return xt.reshape(BK, xt.shape[1], nk, bk).transpose(2, 0, 3, 1)

    return dq, tiles(dkt), tiles(dvt), const_cotangents(dconsts, consts)


def softmax_delta(out, dout, dlse):
    """rowsum(dout * out) [nq, B*K, G*bq], less the log-sum-exp's cotangent when it has one."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def tile_q(q, st: Static):
    """[B, T, N, H] -> pre-scaled query tiles [nq, B*K, G*bq, H] (compute dtype, T padded to nq*bq)."""
    return row_tiles((q.astype(jnp.float32) * st.scale).astype(st.compute_dtype), st)


def row_tiles(x, st: Static):
    """Per-query rows [B, T, N, D] -> tiles [nq, B*K, G*bq, D] (T padded to nq*bq; dtype kept)."""
    B, T, N, D = x.shape
    K, G, bq = st.K, N // st.K, st.bq
    nq = -(-T // bq)
    x = jnp.pad(x.reshape(B, T, K, G, D), ((0, 0), (0, nq * bq - T), (0, 0), (0, 0), (0, 0)))
    # [B, nq, bq, K, G, D] -> [nq, B, K, G, bq, D] -> [nq, B*K, G*bq, D]
    return x.reshape(B, nq, bq, K, G, D).transpose(1, 0, 3, 4, 2, 5).reshape(nq, B * K, G * bq, D)


def tile_kv(x, st: Static):
    """[B, S, K, D] -> key/value tiles [nk, B*K, bk, D] (compute dtype, S padded to nk*bk)."""
    B, S, K, D = x.shape
    bk = st.bk
    nk = -(-S // bk)
    x = jnp.pad(x.astype(st.compute_dtype), ((0, 0), (0, nk * bk - S), (0, 0), (0, 0)))
    return x.reshape(B, nk, bk, K, D).transpose(1, 0, 3, 2, 4).reshape(nk, B * K, bk, D)


def untile(out, st: Static, T: int):
    """Output tiles [nq, B*K, G*bq, Hv] -> [B, T, N, Hv]."""
    nq, BK, _, Hv = out.shape
    K, G, bq = st.K, st.N // st.K, st.bq
    B = BK // K
    out = out.reshape(nq, B, K, G, bq, Hv).transpose(1, 0, 4, 2, 3, 5)  # [B, nq, bq, K, G, Hv]
    return out.reshape(B, nq * bq, st.N, Hv)[:, :T]
