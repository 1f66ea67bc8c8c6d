"""One tile's math, written once for every kernel: logits, score, mask, online-softmax step, backward tile.

A flash-style kernel visits tiles of ``bq`` query rows by ``bk`` keys. What happens on one tile is
defined here, and only here; each kernel owns its loop, its memory movement and its tuning:

* ``attnlab.kernels.blockwise`` and ``attnlab.kernels.ring`` (``lax`` loops, XLA: CPU and the portable
  fallback) visit tiles ``[B*K, G*bq, bk]`` that stack the G query heads of a key head as rows
  (``HeadsView``);
* ``attnlab.kernels.pallas_flash`` (Pallas, Triton on GPUs, interpret mode on CPU) visits one head's
  ``[bq, bk]`` tile per program (``OneHeadView``).

So a speedup or a numerics fix of a tile lands once, and a new score or mask reaches every kernel
at once. The conventions:

* **Base-2 logits for the plain dot product.** When a tile's logits are the product itself
  (``Dot``, no bias: ``TileSpec.base2``), the scale and ``log2(e)`` are folded into the queries once
  (``TileSpec.q_factor``) and every exponential is an ``exp2``, one FMA per element, as
  FlashAttention-3 and jax's Mosaic-GPU attention do. A mod, a pair form or a bias is computed in
  natural units, where they are defined, and then ``exp`` costs what ``exp2`` of a rescaled logit
  would; natural units also keep a logit of finfo.min finite (in base 2 it would overflow to -inf).
  The row statistics (running max ``m``, running sum ``l``) are in the tile's units; the log-sum-exp
  is the pair ``(m, log l)`` in those units (``lse_natural`` gives ``ln``-units). Every softmax
  function takes ``base2=spec.base2``.
* **Masked entries are -inf**, never a finite "large negative": finite logits, however negative, are
  part of the softmax. A row with nothing allowed shifts by 0 (``exp(-inf) = 0``, never NaN) and
  finalises to zeros, with zero gradients.
* **Full tiles run no mask code**: every function takes ``ok=None`` for a tile the schedule calls
  FULL, and then evaluates nothing but the logits.
* **Natural-unit gradients.** ``dlogits`` gives dL/ds (natural units); a logits pull-back maps it to
  the queries and keys; kernels scale their accumulated dq and dk once by ``TileSpec.grad_scale``
  (the base change), never per element.

Shape legend: B batch (leading dims flattened), N query heads, K kv heads, G = N // K, H head dim,
bq / bk tile rows / columns. "rows" below is a tile's query axis (``G*bq`` or ``bq``), "cols" its key axis.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import scores as scores_lib

__all__ = [
    "LOG2E",
    "LN2",
    "TileSpec",
    "HeadsView",
    "OneHeadView",
    "tile_spec",
    "leaf_layout",
    "positions",
    "mask_at",
    "logits",
    "logits_vjp",
    "softmax_init",
    "softmax_step",
    "softmax_once",
    "softmax_finalize",
    "lse_natural",
    "probs",
    "dlogits",
    "softmax_delta",
    "drop",
    "rows",
    "f32_cotangent",
    "cast_cotangents",
]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------
# What the core needs to know (static)


@dataclasses.dataclass(frozen=True)
class TileSpec:
    """The static part of one tile's math (hashable): the score's form, scale and positions' range.

    Attributes:
        form: ``"dot"``, ``"mod"`` or ``"pair"`` (the score's ``TileForm``: ``DotTile``, ``ModTile``,
            ``PairTile``).
        scale: the score's query scale in natural units (``TileForm.query_scale(H)``).
        T, S: the true query and key lengths: positions past them (a padded last tile) are clamped
            before the score or the bias reads them, and keys past S are masked.
        score_def: the score's treedef (``mod``, ``pair``); its array leaves come at run time, so
            traced values reuse the program and receive gradients. None for ``dot``.
        elementwise: a ``mod`` that reads no positions, heads or arrays (``SoftCap``).
        has_bias: a ``bias(q_pos, k_pos, *consts)`` term is added to the logits (blockwise only).
    """

    form: str
    scale: float
    T: int
    S: int
    score_def: object = None
    elementwise: bool = False
    has_bias: bool = False

    @property
    def base2(self) -> bool:
        """The logits are the product itself (the dot product, no bias): base 2, ``exp2``."""
        return self.form == "dot" and not self.has_bias

    @property
    def q_factor(self) -> float:
        """The factor folded into the queries once: ``scale * log2(e)`` when ``base2`` (the logits come out
        in base 2 from the product), else ``scale``."""
        return self.scale * LOG2E if self.base2 else self.scale

    @property
    def grad_scale(self) -> float:
        """From the core's natural-unit ``ds`` to the gradient at the product ``q' . k`` (q' the pre-scaled
        queries): ``ln 2`` when ``base2`` (the base-2 logits are the product itself), 1 otherwise.
        A kernel multiplies its accumulated ``sum ds . k`` and ``sum ds^T . q'`` by it once: they are then
        dL/dq' and dL/dk (dL/dq = q_factor * dL/dq')."""
        return LN2 if self.base2 else 1.0

    def score(self, leaves):
        """The score object rebuilt from its leaves (a kernel's inputs, sliced per head or traced)."""
        return self.score_def.unflatten(list(leaves))


def tile_spec(score: scores_lib.Score, H: int, T: int, S: int, *, has_bias: bool = False) -> TileSpec:
    """The ``TileSpec`` of a bound call's score (``call.score``) at head dim H and lengths T, S.

    Raises:
        ValueError: the score has no tile form (a kernel's ``supports`` says so first).
    """
    form = score.tile_form()
    if form is None:
        raise ValueError(f"the score {type(score).__name__} has no tile form (dense only)")
    kind = {scores_lib.DotTile: "dot", scores_lib.ModTile: "mod", scores_lib.PairTile: "pair"}[type(form)]
    return TileSpec(
        form=kind,
        scale=form.query_scale(H),
        T=T,
        S=S,
        score_def=None if kind == "dot" else jax.tree_util.tree_structure(score),
        elementwise=kind == "mod" and form.elementwise,
        has_bias=has_bias,
    )


@dataclasses.dataclass(frozen=True)
class HeadsView:
    """Tiles ``[B*K, G*bq, cols]``: the G query heads of one key head stacked as rows (rows ordered
    ``(g, q)``, query head ``n = kh * G + g``), as the ``lax``-loop kernels hold them."""

    lead: tuple
    N: int
    K: int
    bq: int

    def to_heads(self, s):  # [B*K, G*bq, cols] -> [*lead, N, bq, cols]: a reshape
        return s.reshape(*self.lead, self.N, self.bq, s.shape[-1])

    def from_heads(self, s, like):
        return s.reshape(like.shape)

    def pair_operands(self, q, k):  # [B*K, G*bq, H], [B*K, bk, H] -> [B, K, G, bq, H], [B, K, bk, H]
        B = q.shape[0] // self.K
        return q.reshape(B, self.K, self.N // self.K, self.bq, q.shape[-1]), k.reshape(B, self.K, *k.shape[1:])

    def tile_mask(self, ok):
        """A mask value ``[..., N|1, bq, cols]`` (broadcastable to the logits) -> ``[B*K|1, G*bq, cols]``."""
        nl, G = len(self.lead), self.N // self.K
        x = ok.reshape((1,) * (nl + 3 - ok.ndim) + tuple(ok.shape))
        B = math.prod(self.lead)
        if any(d != 1 for d in x.shape[:nl]):
            x = jnp.broadcast_to(x, self.lead + x.shape[nl:]).reshape((-1,) + x.shape[nl:])
        else:
            x = x.reshape((1,) + x.shape[nl:])
        b_, n_, _, k_ = x.shape  # [B|1, N|1, bq|1, cols|1]
        x = x.reshape(b_, 1, 1, x.shape[2], k_) if n_ == 1 else x.reshape(b_, self.K, G, x.shape[2], k_)
        if b_ == 1 and n_ == 1:
            return jnp.broadcast_to(x, (1, 1, G, self.bq, k_)).reshape(1, G * self.bq, k_)
        return jnp.broadcast_to(x, (B, self.K, G, self.bq, k_)).reshape(B * self.K, G * self.bq, k_)


@dataclasses.dataclass(frozen=True)
class OneHeadView:
    """One query head's tile ``[bq, cols]`` (the Pallas kernels): a score's mod sees ``[1, bq, cols]``
    with its array leaves sliced to this head, a pair form runs its one-head form."""

    def to_heads(self, s):
        return s[None]

    def from_heads(self, s, like):
        return s[0]

    def tile_mask(self, ok):
        return ok


def leaf_layout(score) -> list[tuple[tuple, jnp.dtype, int | None]]:
    """(shape, dtype, head axis) of each array leaf of a score as a one-head kernel takes it (a 0-d leaf
    as ``[1]``; the head axis from the tile form's ``head_axes``); arrays or ``jax.ShapeDtypeStruct`` objects."""
    if score.is_dot:
        return []
    leaves = jax.tree_util.tree_leaves(score)
    axes = score.tile_form().head_axes if leaves else ()
    return [
        (tuple(np.shape(x)) or (1,), jnp.dtype(x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype), a)
        for x, a in zip(leaves, axes, strict=True)
    ]


# ------------------------------------------------------------------------------------------
# Positions and the element mask


def positions(i, j, bq: int, bk: int):
    """Query positions of tile row block i ``[bq]`` and key positions of column block j ``[bk]`` (int32)."""
    return i * bq + jnp.arange(bq, dtype=jnp.int32), j * bk + jnp.arange(bk, dtype=jnp.int32)


def mask_at(spec: TileSpec, mask, q_pos, k_pos):
    """The element mask on a tile: the mask object at these positions (clamped to T, S: padded rows are
    discarded, padded keys masked here), False past S; bool broadcastable to ``[..., N|1, rows, cols]``."""
    ok = (k_pos < spec.S)[None, :]
    if mask is not None:
        ok = ok & mask(jnp.minimum(q_pos, spec.T - 1), jnp.minimum(k_pos, spec.S - 1))
    return ok


# ------------------------------------------------------------------------------------------
# Logits: the score's tile form and the bias, in base 2


def _clamped(spec, q_pos, k_pos):
    return jnp.minimum(q_pos, spec.T - 1), jnp.minimum(k_pos, spec.S - 1)


def _mod(spec, view, s, q_pos, k_pos, leaves):
    """The score's mod on natural-unit logits ``s`` (= scale q . k)."""
    mod = spec.score(leaves).tile_form().mod
    if spec.elementwise:
        return mod(s)
    qc, kc = _clamped(spec, q_pos, k_pos)
    return view.from_heads(mod(view.to_heads(s), qc, kc), s)


def _bias(spec, view, q_pos, k_pos, consts, bias_fn):
    """The bias term of the tile, fp32 ``[.., rows, cols]`` (broadcastable) in natural units."""
    qc, kc = _clamped(spec, q_pos, k_pos)
    return view.tile_mask(bias_fn(qc, kc, *consts).astype(jnp.float32))


def _natural(spec, view, s, q_pos, k_pos, leaves, consts, bias_fn):
    """Natural-unit logits after the product ``s``: the score's mod (``mod`` form), then the bias."""
    if spec.form == "mod":
        s = _mod(spec, view, s, q_pos, k_pos, leaves)
    return s + _bias(spec, view, q_pos, k_pos, consts, bias_fn) if spec.has_bias else s


def logits(spec: TileSpec, view, dot, q, k, q_pos, k_pos, leaves=(), consts=(), bias_fn=None):
    """fp32 logits ``[..., rows, cols]`` of a tile: base 2 when ``spec.base2``, else natural units.

    Args:
        spec: the tile spec (``tile_spec``).
        view: ``HeadsView`` or ``OneHeadView``: how the kernel's tile maps to heads.
        dot: the kernel's product ``dot(q, k) -> fp32 q . k^T`` (its layout, its precision).
        q: the tile's queries, pre-scaled by ``spec.q_factor`` (``[..., rows, H]``); k ``[..., cols, H]``.
        q_pos, k_pos: the tile's positions (``positions``).
        leaves: the score's array leaves (sliced to the head with a ``OneHeadView``).
        consts, bias_fn: the bias term (``spec.has_bias``): ``bias_fn(q_pos, k_pos, *consts)``.
    """
    if spec.form == "pair":
        form = spec.score(leaves).tile_form()
        if isinstance(view, OneHeadView):
            s = form.head_pair_vjp(q, k, dq=False, dk=False, leaf_grads=False)[0]
        else:
            s = form.pair(*view.pair_operands(q, k)).reshape(q.shape[:-1] + (k.shape[-2],))
        return _natural(spec, view, s, q_pos, k_pos, leaves, consts, bias_fn)
    return _natural(spec, view, dot(q, k), q_pos, k_pos, leaves, consts, bias_fn)


def _floating(xs) -> list[int]:
    return [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _with(xs, idx, values) -> tuple:
    """``xs`` with the entries at ``idx`` replaced by ``values``."""
    out = list(xs)
    for i, x in zip(idx, values, strict=True):
        out[i] = x
    return tuple(out)


def _spread(n, idx, values) -> tuple:
    """Gradients of the entries at ``idx`` into a tuple of n (None where not differentiated)."""
    return _with((None,) * n, idx, values)


def logits_vjp(
    spec: TileSpec, view, dots, q, k, q_pos, k_pos, leaves=(), consts=(), bias_fn=None, *,
    wants=("q", "k", "leaves"),
):  # fmt: skip
    """The tile's base-2 logits and ``pull(ds) -> (dq, dk, d_leaves, d_consts)``.

    ``ds`` is dL/ds in natural units (``dlogits``); ``dq`` is ``sum ds' . k`` and ``dk`` the kernel's
    ``dots.dk(ds', q)`` (its own orientation), where ``ds'`` is the gradient at the product: kernels scale
    their accumulated dq and dk by ``spec.grad_scale`` once (dq is then w.r.t. the pre-scaled queries q').
    ``wants`` names the parts to compute (``"q"``, ``"k"``, ``"leaves"``); a part not asked for is None.
    ``d_leaves`` (one per score leaf, fp32; None for an integer leaf or when not asked for) and
    ``d_consts`` (the bias's, likewise) are summed by the kernel over its tiles (``f32_cotangent``).

    The dot product's own part is plain matmuls; what comes after it (a mod, the bias) is differentiated
    by ``jax.vjp`` on this tile only, or, for an elementwise mod and a bias with no arrays, by one
    ``jax.jvp`` slope computed with the logits (on XLA:CPU that ran SoftCap's fwd+bwd at 4K about a tenth
    faster). ``dots`` has ``qk(q, k)``, ``dq(ds, k)``, ``dk(ds, q)`` and ``orient_dk(dk)`` (a key gradient
    ``[..., cols, H]`` -> the orientation its ``dk`` gives).
    """
    li = _floating(leaves) if "leaves" in wants else []
    ci = _floating(consts)
    nl, nc = len(leaves), len(consts)
    if spec.form == "pair":
        form = spec.score(leaves).tile_form()
        if isinstance(view, OneHeadView):  # (the one-head kernels take no bias)
            s, back = form.head_pair_vjp(q, k, dq="q" in wants, dk="k" in wants, leaf_grads=bool(li))

            def pull_head(ds):
                gq, gk, gl = back(ds)
                return gq, gk, (tuple(gl) if li else (None,) * nl), ()

            return s, pull_head

        def f(q, k, dl, dc):
            ls, cs = _with(leaves, li, dl), _with(consts, ci, dc)
            pq, pk = view.pair_operands(q, k)
            s = spec.score(ls).tile_form().pair(pq, pk).reshape(q.shape[:-1] + (k.shape[-2],))
            return _natural(spec, view, s, q_pos, k_pos, ls, cs, bias_fn)

        s, vjp = jax.vjp(f, q, k, tuple(leaves[i] for i in li), tuple(consts[i] for i in ci))

        def pull_pair(ds):
            dq, dk, dl, dc = vjp(ds)
            dk = dots.orient_dk(dk.astype(jnp.float32))
            return dq.astype(jnp.float32), dk, _spread(nl, li, dl), _spread(nc, ci, dc)

        return s, pull_pair

    raw = dots.qk(q, k)

    def grads_at_product(ds_raw, d_leaves, d_consts):
        dq = dots.dq(ds_raw, k) if "q" in wants else None
        dk = dots.dk(ds_raw, q) if "k" in wants else None
        return dq, dk, d_leaves, d_consts

    if spec.form == "dot" and not spec.has_bias:
        return raw, lambda ds: grads_at_product(ds, (), ())
    if spec.form == "dot":  # natural units: t = raw + bias

        def bias(dc):
            return jnp.broadcast_to(_bias(spec, view, q_pos, k_pos, _with(consts, ci, dc), bias_fn), raw.shape)

        b, vjp_b = jax.vjp(bias, tuple(consts[i] for i in ci))

        def pull_bias(ds):
            (dc,) = vjp_b(ds)
            return grads_at_product(ds, (), _spread(nc, ci, dc))

        return raw + b, pull_bias

    # a mod: natural s = mod(raw) (+ bias), raw = scale q . k
    if not li and not ci:  # nothing to differentiate but raw: its slope by one jvp, fused with the logits
        s, slope = jax.jvp(
            lambda r: _natural(spec, view, r, q_pos, k_pos, leaves, consts, bias_fn), (raw,), (jnp.ones_like(raw),)
        )
        return s, lambda ds: grads_at_product(ds * slope, (None,) * nl, (None,) * nc)

    def natural(r, dl, dc):
        return _natural(spec, view, r, q_pos, k_pos, _with(leaves, li, dl), _with(consts, ci, dc), bias_fn)

    s, vjp = jax.vjp(natural, raw, tuple(leaves[i] for i in li), tuple(consts[i] for i in ci))

    def pull_mod(ds):
        ds_raw, dl, dc = vjp(ds)
        return grads_at_product(ds_raw, _spread(nl, li, dl), _spread(nc, ci, dc))

    return s, pull_mod


# ------------------------------------------------------------------------------------------
# The online softmax, in base 2


def _exp(base2: bool):
    return jnp.exp2 if base2 else jnp.exp


def _log(base2: bool):
    return (lambda x: jnp.log(x) * LOG2E) if base2 else jnp.log  # (log2 as log: Mosaic GPU lowers log)


def rows(x, like):
    """Per-row values ``x [..., rows]`` broadcast along the last axis of ``like [..., rows, cols]``.

    ``lax.broadcast_in_dim`` rather than ``x[..., None]``: every backend lowers it, Mosaic GPU's row
    layouts included."""
    return jax.lax.broadcast_in_dim(x, like.shape, tuple(range(x.ndim)))


def softmax_init(rows_shape):
    """Empty row statistics ``(m, l)``, fp32 ``rows_shape``: the running max starts at -inf (a finite
    start would hide logits below it, e.g. a bias of finfo.min)."""
    return jnp.full(rows_shape, -jnp.inf, jnp.float32), jnp.zeros(rows_shape, jnp.float32)


def softmax_step(m, l, t, ok=None, *, base2: bool):
    """One tile into the running statistics: ``(m_new, l_new, alpha, p)``.

    ``t`` fp32 logits ``[..., rows, cols]`` (base 2 when ``base2``), ``ok`` the tile's element mask (None on
    a FULL tile: no mask code). The caller updates its accumulator as ``acc * alpha[..., None] + p @ v``.
    A row with nothing allowed yet (``m_new = -inf``) shifts by 0, so ``p = exp(-inf) = 0``, never NaN,
    and its max stays -inf, so a later finite logit, however negative, still counts.
    """
    exp = _exp(base2)
    if ok is not None:
        t = jnp.where(ok, t, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(t, axis=-1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = exp(t - rows(shift, t))
    alpha = exp(m - shift)
    return m_new, l * alpha + jnp.sum(p, axis=-1), alpha, p


def softmax_once(t, ok, pv, *, base2: bool, finite: bool = False):
    """A whole row's softmax from one span (a band's forward): ``(m, l, acc)`` with ``acc = pv(p)``.

    ``pv(p) -> p @ v`` is the kernel's product. ``finite``: the logits are finite wherever the mask allows
    (the plain dot product: NaN stays NaN), so the mask goes in as a 0/-inf bias and the shift is the row
    max itself, which XLA:CPU fuses with the matmul and the exponential into one kernel (a guard on the
    max splits it); rows the mask empties come out NaN there and are zeroed from the mask alone, after
    the product. (A NaN or infinite key that the mask excludes but the span holds makes the row NaN, as a
    NaN value the mask excludes does on every path: docs/conventions.md, "Non-finite keys and values".)
    Otherwise as ``softmax_step``.
    """
    if not finite:
        m, l, _, p = softmax_step(*softmax_init(t.shape[:-1]), t, ok, base2=base2)
        return m, l, pv(p)
    t = t + jnp.where(ok, 0.0, -jnp.inf)
    m = jnp.max(t, axis=-1)
    p = _exp(base2)(t - rows(m, t))
    empty = ~jnp.any(ok, axis=-1)
    acc = pv(p)
    return m, jnp.where(empty, 0.0, jnp.sum(p, axis=-1)), jnp.where(rows(empty, acc), 0.0, acc)


@jax.custom_jvp
def softmax_rows(t, empty):
    """A whole row's softmax in one pass (dense XLA): fp32 ``t [..., cols]``, ``empty [..., 1]`` True on rows
    with nothing allowed (every logit -inf).

    No guard on the row max, so XLA:CPU fuses the logits' matmul, the max and the exponential into one
    kernel (as in ``softmax_once``); an empty row comes out NaN and the caller zeroes it after the
    product, from ``empty``. Under differentiation the rule's primal and tangent are 0 on empty rows,
    so no NaN reaches a gradient (the caller's zeroing makes the two primals agree on its output).
    """
    del empty
    return jax.nn.softmax(t, axis=-1)


@softmax_rows.defjvp
def _softmax_rows_jvp(primals, tangents):
    t, empty = primals
    dt, _ = tangents
    p = jnp.where(empty, 0.0, jax.nn.softmax(t, axis=-1))
    return p, p * (dt - jnp.sum(p * dt, axis=-1, keepdims=True))


def softmax_finalize(m, l, acc, *, base2: bool):
    """``(out = acc / l, (m, log l))`` (``log2`` when ``base2``); a row with nothing allowed -> ``out`` 0
    and ``(0, +inf)``.

    The log-sum-exp is kept as the pair ``(m, log l)``, not the sum: for logits near finfo.min the sum
    rounds back to m and ``probs`` would lose the 1/l. An empty row's ``log l = +inf`` makes its
    recomputed probabilities 0 in any tile.
    """
    nonempty = l > 0
    safe = jnp.where(nonempty, l, 1.0)
    out = acc / rows(safe, acc)
    return out, (jnp.where(nonempty, m, 0.0), jnp.where(nonempty, _log(base2)(safe), jnp.inf))


def lse_natural(m, log_l, *, base2: bool):
    """The natural-log log-sum-exp from the pair (``(m + log2 l) * ln 2`` when ``base2``); -inf on rows
    with nothing allowed."""
    lse = m + log_l
    return jnp.where(log_l == jnp.inf, -jnp.inf, lse * LN2 if base2 else lse)


# ------------------------------------------------------------------------------------------
# The backward tile


def probs(t, m, log_l, ok=None, *, base2: bool):
    """Softmax probabilities recomputed from the row statistics (broadcast to ``t`` by the caller):
    ``exp((t - m) - log l)``, zero where ``ok`` is False."""
    p = _exp(base2)((t - m) - log_l)
    return p if ok is None else jnp.where(ok, p, 0.0)


def dlogits(p, dp, delta):
    """dL/ds (natural units) of a tile: ``p * (dp - delta)``, ``dp = do . v^T``, ``delta`` per row."""
    return p * (dp - rows(delta, dp))


def softmax_delta(out, dout, dlse=None):
    """``rowsum(dout * out)`` per row, less the natural log-sum-exp's cotangent when it has one
    (d lse / d s = p, so it only shifts delta)."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def drop(x, keep, rate: float):
    """Attention dropout on probabilities: ``where(keep, x / (1 - rate), 0)``; x unchanged when keep is None."""
    if keep is None:
        return x
    return jnp.where(keep, x * jnp.float32(1.0 / (1.0 - rate)), 0.0)


def f32_cotangent(d, x) -> jax.Array:
    """A leaf's or const's tile cotangent as fp32 of its shape (an integer one's float0 -> zeros)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact) or d is None or d.dtype == jax.dtypes.float0:
        return jnp.zeros(x.shape, jnp.float32)
    return d.astype(jnp.float32)


def cast_cotangents(dxs, xs) -> tuple:
    """Accumulated fp32 cotangents -> each input's dtype; integer inputs get ``float0`` zeros."""
    return tuple(
        d.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else np.zeros(x.shape, jax.dtypes.float0)
        for d, x in zip(dxs, xs, strict=True)
    )
