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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib
from attnlab import scores as scores_lib

__all__ = ["BlockSizes", "default_block_sizes", "blockwise_attention", "block_schedule", "dropout_keep"]


BiasFn = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tile sizes of the blockwise kernel (Python ints; changing them recompiles).

    Attributes:
        block_q: queries per block (rows of one tile).
        block_k: keys per block (columns of one tile).
        backward: ``"fused"``, the only backward: one pass over query blocks carrying full-size
            dk/dv, 5 tile matmuls plus tile transposes. (A ``"two_pass"`` backward, a dk/dv pass over
            key blocks and a dq pass over query blocks, was used by tests only and was removed.)
    """

    block_q: int
    block_k: int
    backward: str = "fused"

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            b = getattr(self, name)
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0:
                raise ValueError(f"{name} must be a positive int, got {b!r}")
        if self.backward != "fused":
            raise ValueError(f"backward must be 'fused' (the two-pass backward was removed), got {self.backward!r}")


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


def _pick_block_sizes(m, T: int, S: int, backend: str | None = None, layout_fn=None) -> BlockSizes:
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


def compute_dtype(dtype, backend: str | None = None) -> jnp.dtype:
    """The tiles' dtype for inputs of ``dtype`` on ``backend``: fp32 for half precision on XLA:CPU, else ``dtype``.

    XLA:CPU has no fast half-precision dot (and no fp16 x fp16 -> fp32 one); elsewhere tiles stay in
    the input dtype with fp32 accumulation. ``backend`` None means ``jax.default_backend()``;
    ``blockwise_attention`` passes each lowering platform's name instead (``lax.platform_dependent``).
    """
    backend = jax.default_backend() if backend is None else backend
    dtype = jnp.dtype(dtype)
    half = dtype in (jnp.bfloat16, jnp.float16)
    return jnp.dtype(jnp.float32) if (half and backend == "cpu") else dtype


def default_scale(H: int, scale) -> float:
    """The logit scale: ``scale`` as a float, or ``1/sqrt(H)`` when it is None."""
    scores_lib.check_scale(scale, fn="blockwise_attention")
    return 1.0 / math.sqrt(H) if scale is None else float(scale)


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
# Attention dropout: one keep/drop decision per (batch, head, query, key), from the key alone


def check_dropout(rate, key, fn="attention"):
    """Validates ``dropout_rate`` / ``dropout_key``; returns (rate as float, seed uint32 [2] or None)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
        raise ValueError(f"{fn}: dropout_rate must be a Python float in [0, 1), got {type(rate).__name__} {rate!r}")
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{fn}: dropout_rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return 0.0, None
    if key is None:
        raise ValueError(f"{fn}: dropout_rate={rate} needs an explicit dropout_key (a jax.random key)")
    if not hasattr(key, "dtype"):
        raise ValueError(f"{fn}: dropout_key must be a jax.random key, got {type(key).__name__}")
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.shape != (2,):
            raise ValueError(
                f"{fn}: dropout_key must be a jax.random.key(...) or a raw uint32 [2] PRNGKey, "
                f"got dtype {key.dtype} shape {key.shape}"
            )
        key = jax.random.wrap_key_data(key)
    if key.shape != ():
        raise ValueError(f"{fn}: dropout_key must be a single key (shape ()), got shape {key.shape}")
    return rate, jax.random.bits(key, (2,), jnp.uint32)  # two words: the seed of the hash below


def dropout_keep(seed, rate: float, rows, cols):
    """bool: keep the weight at (row, col) with probability 1 - rate (broadcasts rows with cols).

    ``rows`` = ``(b * N + n) * T + t`` (flat batch index b, query head n, query t) and ``cols`` =
    key position s. The decision is a counter-based hash (threefry-2x32 of (row, col) under the
    seed), so it depends only on the position, never on how the work is tiled: the dense
    reference, each blockwise tile and the backward pass draw exactly the same mask.
    """
    rows, cols = jnp.broadcast_arrays(jnp.asarray(rows).astype(jnp.uint32), jnp.asarray(cols).astype(jnp.uint32))
    bits = jax.extend.random.threefry2x32_p.bind(seed[0], seed[1], rows, cols)[0]
    threshold = min(int(round((1.0 - rate) * 2.0**32)), 2**32 - 1)
    return bits < jnp.uint32(threshold)


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
    return _rows(_adjusted(layout, S, bk))


def _adjusted(layout: np.ndarray, S: int, bk: int) -> np.ndarray:
    layout = np.array(layout, np.int32)
    if S % bk:
        layout[:, -1] = np.minimum(layout[:, -1], masks_lib.PARTIAL)
    return layout


def _rows(layout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
class _Static:
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
    backward: str
    dropout_rate: float = 0.0

    @property
    def lead_size(self) -> int:
        return math.prod(self.lead)


def _to_tile(x: jax.Array, st: _Static) -> jax.Array:
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


def _positions(i, j, st: _Static):
    q_pos = i * st.bq + jnp.arange(st.bq, dtype=jnp.int32)  # [bq]
    k_pos = j * st.bk + jnp.arange(st.bk, dtype=jnp.int32)  # [bk]
    return q_pos, k_pos


def _allowed(mask, i, j, st: _Static):
    """bool [B*K|1, G*bq, bk]: the mask on tile (i, j), False on padded key positions."""
    q_pos, k_pos = _positions(i, j, st)
    q_c = jnp.minimum(q_pos, st.T - 1)  # padded query rows are discarded; keep indices in range
    k_c = jnp.minimum(k_pos, st.S - 1)
    ok = (k_pos < st.S)[None, :]
    if mask is not None:
        ok = ok & mask(q_c, k_c)
    return _to_tile(ok, st)


def _tile_keep(seed, i, j, st: _Static):
    """bool [B*K, G*bq, bk]: the dropout decisions on tile (i, j), as ``dropout_keep`` draws them densely."""
    G = st.N // st.K
    bk_ = jnp.arange(st.lead_size * st.K, dtype=jnp.uint32)[:, None, None]  # tile batch row = b * K + kh
    r = jnp.arange(G * st.bq, dtype=jnp.uint32)[None, :, None]  # tile row = g * bq + q
    n = (bk_ % st.K) * G + r // st.bq  # query head
    rows = ((bk_ // st.K) * st.N + n) * st.T + (i * st.bq + r % st.bq).astype(jnp.uint32)
    cols = (j * st.bk + jnp.arange(st.bk, dtype=jnp.int32)).astype(jnp.uint32)[None, None, :]
    return dropout_keep(seed, st.dropout_rate, rows, cols)


def _drop(x, keep, st: _Static):
    """Dropped and rescaled: ``where(keep, x / (1 - rate), 0)``; x unchanged without dropout."""
    if keep is None:
        return x
    return jnp.where(keep, x * jnp.float32(1.0 / (1.0 - st.dropout_rate)), 0.0)


def _logits(qi, kj, bias_fn, consts, i, j, st: _Static):
    """fp32 [B*K, G*bq, bk]: (pre-scaled q) . k + bias(q_pos, k_pos)."""
    s = jnp.einsum("nqh,nsh->nqs", qi, kj, preferred_element_type=jnp.float32)
    if st.has_bias:
        q_pos, k_pos = _positions(i, j, st)
        b = bias_fn(jnp.minimum(q_pos, st.T - 1), jnp.minimum(k_pos, st.S - 1), *consts)
        s = s + _to_tile(b.astype(jnp.float32), st)
    return s


# ------------------------------------------------------------------------------------------
# Forward: lax.map over query blocks, lax.scan over that block's non-empty key blocks


def _forward(q, k, v, mask, consts, index, kind, *, st: _Static, bias_fn, seed=None):
    """q [nq, B*K, G*bq, H] (pre-scaled), k [nk, B*K, bk, H], v [nk, B*K, bk, Hv].

    Returns out [nq, B*K, G*bq, Hv] (compute dtype) and lse = (m, log l), each [nq, B*K, G*bq] (fp32).
    """
    return finalize(
        *forward_carry(
            q, k, v, mask, consts, index, kind, init_carry(q, v.shape[-1]), st=st, bias_fn=bias_fn, seed=seed
        )
    )


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


def forward_carry(q, k, v, mask, consts, index, kind, carry, *, st: _Static, bias_fn, seed=None):
    """The block step: folds the key blocks of the schedule into the running (m, l, acc).

    ``carry`` is ``(m [nq, B*K, G*bq], l [same], acc [nq, B*K, G*bq, Hv])`` (fp32) from
    ``init_carry`` or a previous call, so a caller can stream key/value blocks that arrive one
    after another (ring attention) and ``finalize`` once at the end. ``mask(q_idx, k_idx)`` sees
    local block positions; a caller with sharded sequences passes a mask that adds its offsets.
    With ``st.dropout_rate > 0``, ``seed`` (uint32 [2]) draws the dropout mask per tile; the
    running sum ``l`` is of the undropped probabilities (dropout acts after normalisation).
    """

    def one_query_block(args):
        qi, i, idx_i, kind_i, m0, l0, acc0 = args

        def step(carry, jk):
            j, kd = jk

            def visit(carry, partial, ok=None):
                if partial and ok is None:  # evaluate the tile's mask; skip it if empty at run time
                    ok = _allowed(mask, i, j, st)
                    return jax.lax.cond(ok.any(), functools.partial(visit, partial=True, ok=ok), lambda c: c, carry)
                m, l, acc = carry
                s = _logits(qi, k[j], bias_fn, consts, i, j, st)
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

        return jax.lax.scan(step, (m0, l0, acc0), (idx_i, kind_i))[0]

    iq = jnp.arange(q.shape[0], dtype=jnp.int32)
    return jax.lax.map(one_query_block, (q, iq, index, kind, *carry))


# ------------------------------------------------------------------------------------------
# Backward: recompute each tile's probabilities from the stored log-sum-exp


def _backward(
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
    st: _Static,
    bias_fn,
    dk0=None,
    dv0=None,
    seed=None,
    dlse=None,
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
    delta = _delta(out, dout, dlse)  # [nq, B*K, G*bq]

    def one_query_block(carry, args):
        dk, dv, dconsts = carry  # transposed: [nk, B*K, H, bk], [nk, B*K, Hv, bk]
        qi, doi, lse_i, delta_i, i, idx_i, kind_i = args
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
                    ok = _allowed(mask, i, j, st)
                    return jax.lax.cond(ok.any(), functools.partial(visit, True, ok), zeros)
                s = _logits(qi, kj, bias_fn, consts, i, j, st)
                p = tile_probs(s, lse_i[0][..., None], lse_i[1][..., None])
                if partial:
                    p = jnp.where(ok, p, 0.0)
                keep = _tile_keep(seed, i, j, st) if st.dropout_rate else None
                pd = _drop(p, keep, st)
                dv_j = jnp.einsum("nhq,nqs->nhs", dot_i, pd.astype(doi.dtype), preferred_element_type=jnp.float32)
                dp = _drop(jnp.einsum("nqh,nsh->nqs", doi, vj, preferred_element_type=jnp.float32), keep, st)
                ds = p * (dp - delta_i[..., None])  # d(logit) [B*K, G*bq, bk]
                dq_c = jnp.einsum("nqs,nsh->nqh", ds.astype(k.dtype), kj, preferred_element_type=jnp.float32)
                dk_j = jnp.einsum("nhq,nqs->nhs", qt_i, ds.astype(qi.dtype), preferred_element_type=jnp.float32)
                if st.has_bias and consts:
                    q_pos, k_pos = _positions(i, j, st)
                    qc, kc = jnp.minimum(q_pos, st.T - 1), jnp.minimum(k_pos, st.S - 1)

                    def tile_bias(*cs):
                        return _to_tile(bias_fn(qc, kc, *cs).astype(jnp.float32), st)

                    b, vjp = jax.vjp(tile_bias, *consts)
                    # sum ds over the dims the bias broadcast along, then pull back
                    axes = tuple(a for a in range(ds.ndim) if b.shape[a] == 1 and ds.shape[a] != 1)
                    dcs = tuple(x.astype(jnp.float32) for x in vjp(ds.sum(axes, keepdims=True)))
                else:
                    dcs = tuple(jnp.zeros(x.shape, jnp.float32) for x in consts)
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
        (dq_i, dk, dv, dconsts), _ = jax.lax.scan(step, (dq0, dk, dv, dconsts), (idx_i, kind_i))
        return (dk, dv, dconsts), dq_i

    dk0 = jnp.zeros(k.shape, jnp.float32) if dk0 is None else dk0
    dv0 = jnp.zeros(v.shape, jnp.float32) if dv0 is None else dv0
    dc0 = tuple(jnp.zeros(c.shape, jnp.float32) for c in consts)
    iq = jnp.arange(nq, dtype=jnp.int32)
    carry0 = (jnp.swapaxes(dk0, -1, -2), jnp.swapaxes(dv0, -1, -2), dc0)
    (dk, dv, dconsts), dq = jax.lax.scan(one_query_block, carry0, (q, dout, lse, delta, iq, index, kind))
    dconsts = tuple(d.astype(c.dtype) for d, c in zip(dconsts, consts, strict=True))
    return dq, jnp.swapaxes(dk, -1, -2), jnp.swapaxes(dv, -1, -2), dconsts


def _delta(out, dout, dlse):
    """rowsum(dout * out) [nq, B*K, G*bq], less the log-sum-exp's cotangent when it has one."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, mask, consts, seed, sched, st, bias_fn):
    """sched = (index, kind, index_t, kind_t): the schedule and its transpose, int32 arrays.

    seed: uint32 [2], the dropout seed (unused when ``st.dropout_rate == 0``).
    Returns (out [nq, B*K, G*bq, Hv], lse [nq, B*K, G*bq] fp32, -inf on empty rows).
    """
    out, lse = _forward(q, k, v, mask, consts, sched[0], sched[1], st=st, bias_fn=bias_fn, seed=seed)
    return out, lse_value(lse)


def _flash_fwd(q, k, v, mask, consts, seed, sched, st, bias_fn):
    out, lse = _forward(q, k, v, mask, consts, sched[0], sched[1], st=st, bias_fn=bias_fn, seed=seed)
    return (out, lse_value(lse)), (q, k, v, mask, consts, seed, sched, out, lse)


def _flash_bwd(st, bias_fn, res, cts):
    q, k, v, mask, consts, seed, sched, out, lse = res
    dout, dlse = cts
    dq, dk, dv, dconsts = _backward(
        q, k, v, mask, consts, sched[0], sched[1], out, lse, dout, st=st, bias_fn=bias_fn, seed=seed, dlse=dlse
    )
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return (*grads, zero_cotangents(mask), dconsts, zero_cotangents(seed), zero_cotangents(sched))


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------
# Public entry point


def _array_bias(q_idx, k_idx, b):
    """The tile of an array bias b [..., N|1, T|1, S|1] at positions q_idx [bq], k_idx [bk]."""
    q_idx = q_idx if b.shape[-2] != 1 else jnp.zeros_like(q_idx)
    k_idx = k_idx if b.shape[-1] != 1 else jnp.zeros_like(k_idx)
    return jnp.take(jnp.take(b, q_idx, axis=-2), k_idx, axis=-1)


def _as_bias_fn(bias, T, S, bq, bk, target=None):
    """Bias -> (fn(q_idx, k_idx, *consts), consts); None -> (None, ()).

    A callable is closure-converted (arrays it closes over become the consts and get gradients);
    an array ``[..., N|1, T|1, S|1]`` becomes the const of ``_array_bias``, sliced per tile.
    """
    if bias is None:
        return None, ()
    if hasattr(bias, "shape") and not callable(bias):
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise ValueError(f"bias must be floating point, got dtype {bias.dtype}")
        b = jnp.asarray(bias)
        b = b.reshape((1,) * max(0, 2 - b.ndim) + tuple(b.shape))  # rank 0/1 broadcasts like numpy
        try:
            ok = jnp.broadcast_shapes(tuple(b.shape), tuple(target)) == tuple(target)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"bias of shape {tuple(bias.shape)} does not broadcast to the logits' shape "
                f"[..., N, T, S] = {tuple(target)}"
            )
        return _array_bias, (b,)
    if not callable(bias):
        raise ValueError(
            "bias must be an array broadcastable to [..., N, T, S] or a callable bias(q_idx, k_idx) -> "
            f"[..., N, len(q_idx), len(k_idx)] (e.g. ALiBi), got {type(bias).__name__}"
        )
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

    Returns:
        ``[..., T, N, Hv]`` in q's dtype (and ``lse`` with ``return_lse``); softmax statistics and
        accumulation in fp32. Rows with no allowed key are zeros, with zero gradients.

    Example:
        >>> q = k = v = jnp.ones((1000, 2, 8))                   # [T, N, H]
        >>> blockwise_attention(q, k, v, mask=masks_lib.window(16, 0)).shape
        (1000, 2, 8)
    """
    *lead, T, N, H = q.shape
    S, K, Hv = v.shape[-3:]
    lead = tuple(lead)
    rate, seed = check_dropout(dropout_rate, dropout_key, "blockwise_attention")
    if T == 0 or S == 0:
        out = jnp.zeros((*lead, T, N, Hv), q.dtype)
        return (out, jnp.full((*lead, T, N), -jnp.inf, jnp.float32)) if return_lse else out
    m = masks_lib.as_mask(mask, "mask")
    if isinstance(m, masks_lib.Full):
        m = None
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be an attnlab.kernels.BlockSizes, got {block_sizes!r}")

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
        bs = _pick_block_sizes(m, T, S, platform, layout_fn) if block_sizes is None else block_sizes
        plans[platform] = _plan(layout_fn, bias, T, S, lead, N, K, H, q.dtype, scale, bs, platform, rate)
    branches = {}
    for platform, plan in plans.items():
        same = next((p for p in branches if plans[p] == plan), None)
        branches[platform] = branches[same] if same is not None else plan.branch()
    seed = jnp.zeros((2,), jnp.uint32) if seed is None else seed
    if len({id(b) for b in branches.values()}) == 1:
        out, lse = branches["cpu"](q, k, v, m, seed)
    else:
        out, lse = jax.lax.platform_dependent(
            q, k, v, m, seed, cpu=branches["cpu"], cuda=branches["gpu"], rocm=branches["gpu"], tpu=branches["tpu"]
        )
    return (out, lse) if return_lse else out


_PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """One platform's static plan: tiles, schedule and the bias function (compared by value)."""

    st: _Static
    sched: tuple  # numpy (index, kind, index_t, kind_t)
    bias_fn: object
    consts: tuple

    def __eq__(self, other):  # equal tiles and dtype: the same computation (bias_fn differs by identity only)
        return self.st == other.st and all(np.array_equal(a, b) for a, b in zip(self.sched, other.sched, strict=True))

    __hash__ = None

    def branch(self):
        def run(q, k, v, m, seed):
            sched = tuple(jnp.asarray(x) for x in self.sched)
            return _blockwise(q, k, v, m, self.consts, seed, sched, self.st, self.bias_fn)

        return run


def _plan(layout_fn, bias, T, S, lead, N, K, H, dtype, scale, block_sizes, platform, rate) -> _Plan:
    bq, bk = min(block_sizes.block_q, T), min(block_sizes.block_k, S)
    layout = _adjusted(layout_fn(bq, bk), S, bk)
    index, kind = _rows(layout)
    index_t, kind_t = _rows(layout.T)  # key block -> the query blocks that see it
    bias_fn, consts = _as_bias_fn(bias, T, S, bq, bk, target=(*lead, N, T, S))
    st = _Static(
        T=T,
        S=S,
        bq=bq,
        bk=bk,
        lead=lead,
        N=N,
        K=K,
        scale=default_scale(H, scale),
        has_bias=bias_fn is not None,
        kinds_used=tuple(np.unique(kind).tolist()),
        kinds_used_t=tuple(np.unique(kind_t).tolist()),
        compute_dtype=compute_dtype(dtype, platform).name,
        backward=block_sizes.backward,
        dropout_rate=rate,
    )
    return _Plan(st, (index, kind, index_t, kind_t), bias_fn, consts)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _blockwise(q, k, v, m, consts, seed, sched, st: _Static, bias_fn):
    """Layout in, layout out: [..., T, N, H] -> heads-first tiles -> kernel -> [..., T, N, Hv].

    Also returns the log-sum-exp [..., T, N] (fp32; dead code for XLA when the caller drops it).
    """
    lead, T, N, Hv = st.lead, st.T, st.N, v.shape[-1]
    B = st.lead_size
    qs = tile_q(q.reshape(B, T, N, -1), st)
    ks, vs = tile_kv(k.reshape(B, st.S, st.K, -1), st), tile_kv(v.reshape(B, st.S, st.K, Hv), st)
    out, lse = _flash(qs, ks, vs, m, consts, seed, sched, st, bias_fn)
    out = untile(out, st, T).reshape(*lead, T, N, Hv).astype(q.dtype)
    return out, untile(lse[..., None], st, T).reshape(*lead, T, N)  # [nq, B*K, G*bq] -> [..., T, N]


def tile_q(q, st: _Static):
    """[B, T, N, H] -> pre-scaled query tiles [nq, B*K, G*bq, H] (compute dtype, T padded to nq*bq)."""
    B, T, N, H = q.shape
    K, G, bq = st.K, N // st.K, st.bq
    nq = -(-T // bq)
    qs = (q.astype(jnp.float32) * st.scale).astype(st.compute_dtype).reshape(B, T, K, G, H)
    qs = jnp.pad(qs, ((0, 0), (0, nq * bq - T), (0, 0), (0, 0), (0, 0)))
    # [B, nq, bq, K, G, H] -> [nq, B, K, G, bq, H] -> [nq, B*K, G*bq, H]
    return qs.reshape(B, nq, bq, K, G, H).transpose(1, 0, 3, 4, 2, 5).reshape(nq, B * K, G * bq, H)


def tile_kv(x, st: _Static):
    """[B, S, K, D] -> key/value tiles [nk, B*K, bk, D] (compute dtype, S padded to nk*bk)."""
    B, S, K, D = x.shape
    bk = st.bk
    nk = -(-S // bk)
    x = jnp.pad(x.astype(st.compute_dtype), ((0, 0), (0, nk * bk - S), (0, 0), (0, 0)))
    return x.reshape(B, nk, bk, K, D).transpose(1, 0, 3, 2, 4).reshape(nk, B * K, bk, D)


def untile(out, st: _Static, T: int):
    """Output tiles [nq, B*K, G*bq, Hv] -> [B, T, N, Hv]."""
    nq, BK, _, Hv = out.shape
    K, G, bq = st.K, st.N // st.K, st.bq
    B = BK // K
    out = out.reshape(nq, B, K, G, bq, Hv).transpose(1, 0, 4, 2, 3, 5)  # [B, nq, bq, K, G, Hv]
    return out.reshape(B, nq * bq, st.N, Hv)[:, :T]
