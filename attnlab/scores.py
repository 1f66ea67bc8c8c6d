"""Relevance scores between query and key positions (the α before the softmax).

The course note gives two ways to measure how relevant key s is to query t:

* **dot product**: ``q_t · k_s``, scaled by ``1/sqrt(H)`` (Vaswani et al. 2017, arXiv 1706.03762);
* **additive**: ``w · tanh(q_t + k_s)`` (Bahdanau et al. 2014, arXiv 1409.0473), where the
  projections W_q a_t and W_k a_s are already folded into q and k.

Any callable ``score(q, k) -> logits [..., N, T, S]`` can stand in for these; pass it as
``attention(..., score=fn)``. For learnable additive weights use ``Additive(w)`` (or
``functools.partial(additive, w=w)``; w stays a traced array, so ``jax.grad`` reaches it).

Score objects (``Dot``, ``Additive``, ``SoftCap``, ``ScoreMod``, ``Custom``) are small pytrees, one
class per score, that carry the forms a kernel may need, so a kernel asks the score for the one form
it computes instead of a dispatcher inspecting it:

* ``score(q, k)``: the dense logits ``[..., N, T, S]`` (the reference uses this);
* ``score.tile_form()``: how the tiled kernels (blockwise, ring, Pallas) compute it inside their tiles,
  forward and backward, with O(T + S) memory, or None: ``DotTile`` (the scaled dot product itself),
  ``ModTile`` (the scaled product changed per element: ``SoftCap``, ``ScoreMod``) or ``PairTile`` (a
  tile's logits from its queries and keys: ``Additive``). The kernels differentiate these with
  ``jax.vjp`` one tile at a time, so a new tiled score writes only its forward;
* ``score.edge_form()``: the per-edge form ``(q_e [E, K, G, H], k_e [E, K, H], q_idx [E], k_idx [E]) ->
  [E, K, G]`` for the sparse (edge-list) kernel, or None: ``Dot``, ``Additive``, ``SoftCap`` and a
  ``ScoreMod`` that declares its ``head_axes`` have one;
* ``score.edge_mod()``: for a score that changes the scaled dot product per edge (``Dot``: not at all,
  ``SoftCap``, a ``ScoreMod`` with ``head_axes``), that change alone, ``(s [E, K, G], q_idx [E], k_idx [E])
  -> [E, K, G]``, with the dot product's ``score.scale``; their edge form is this on ``_dot_edges``. The
  sparse kernel computes the dot product and its backward itself and differentiates only this;
* ``score.is_dot``: derived from the tile form; True for ``Dot(scale)``, the one score the fused
  kernels (cuDNN, splash) compute.

The additive score is one idea, ``Additive(w)``: its dense form is ``additive(q, k, w)``, its forms the
pair tile, a one-head tile with a written-out backward (Pallas) and the edge form, all reading w
through one helper.

``as_score(score, scale)`` turns ``"dot"``, a score object, ``functools.partial(additive, w=w)``
or any callable into one of these.

Shape legend (as ``jax.nn.dot_product_attention``): T query length, S key length, N query heads,
K key/value heads (N % K == 0; G = N // K query heads share one key head: GQA/MQA), H head dim.
Query head n uses key head n // G.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import _pytree  # register_dataclass with the class in the treedef

__all__ = [
    "dot_product",
    "additive",
    "check_qk",
    "Score",
    "Dot",
    "Additive",
    "SoftCap",
    "ScoreMod",
    "Custom",
    "as_score",
    "check_scale",
    "from_spec",
    "SPEC_GRAMMAR",
]


def check_qk(q: jax.Array, k: jax.Array, *, fn: str = "score") -> tuple[int, int]:
    """Validates q ``[..., T, N, H]`` and k ``[..., S, K, H]``; returns (N, K)."""
    for name, x in (("q", q), ("k", k)):
        if not hasattr(x, "ndim") or x.ndim < 3:
            raise ValueError(
                f"{fn}: {name} must have shape [..., T, N, H] (rank >= 3), got {getattr(x, 'shape', type(x).__name__)}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be floating point, got dtype {x.dtype}")
    if q.ndim != k.ndim or q.shape[:-3] != k.shape[:-3]:
        raise ValueError(
            f"{fn}: q and k must have the same batch dims, got q {q.shape} "
            f"([..., T, N, H]) and k {k.shape} ([..., S, K, H])"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{fn}: q and k must have the same head dim H, got q {q.shape} and k {k.shape}")
    n, kh = q.shape[-2], k.shape[-2]
    if n % kh != 0:
        raise ValueError(
            f"{fn}: number of query heads N={n} must be a multiple of key heads K={kh} (q {q.shape}, k {k.shape})"
        )
    return n, kh


def check_scale(scale, *, fn: str = "score") -> None:
    """``scale`` must be None or one real number (a Python float/int or a 0-d array, traced or not).

    An array of length S would silently scale each key differently: a ValueError instead.
    """
    if scale is None:
        return
    is_number = isinstance(scale, (int, float, np.integer, np.floating)) or hasattr(scale, "shape")
    if isinstance(scale, bool) or not is_number:
        raise ValueError(f"{fn}: scale must be a real number (float or 0-d array) or None, got {type(scale).__name__}")
    if hasattr(scale, "shape"):
        if tuple(scale.shape) != ():
            raise ValueError(
                f"{fn}: scale must be a scalar (one logit scale for all keys), got shape {tuple(scale.shape)}"
            )
        if not (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
            raise ValueError(f"{fn}: scale must be a real number, got dtype {scale.dtype}")


def _group(q: jax.Array, num_kv_heads: int) -> jax.Array:
    # [..., T, N, H] -> [..., T, K, G, H]; query head n = kv_head * G + g
    *lead, t, n, h = q.shape
    return q.reshape(*lead, t, num_kv_heads, n // num_kv_heads, h)


def dot_product(q: jax.Array, k: jax.Array, *, scale: float | None = None) -> jax.Array:
    """Scaled dot-product relevance ``scale * q_t · k_s`` with fp32 accumulation.

    Args:
        q: ``[..., T, N, H]`` queries.
        k: ``[..., S, K, H]`` keys, N % K == 0.
        scale: multiplies the logits; default ``1/sqrt(H)``.

    Returns:
        fp32 logits ``[..., N, T, S]``.

    Example:
        >>> q = jnp.ones((2, 1, 4)); k = jnp.ones((3, 1, 4))
        >>> dot_product(q, k).shape, float(dot_product(q, k)[0, 0, 0])   # 4 / sqrt(4)
        ((1, 2, 3), 2.0)
    """
    n, kh = check_qk(q, k, fn="dot_product")
    check_scale(scale, fn="dot_product")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    qg = _group(q, kh)  # [..., T, K, G, H]
    logits = jnp.einsum("...TKGH,...SKH->...KGTS", qg, k, preferred_element_type=jnp.float32)
    *lead, _, _, t, s = logits.shape
    return logits.reshape(*lead, n, t, s) * jnp.float32(scale)  # [..., K, G, T, S] -> [..., N, T, S]


def _additive_weights(w, n: int, h: int, *, check: bool = False) -> jax.Array:
    """The additive score's weights, as every form of it reads them: w ``[N, H]`` or ``[H]`` -> fp32 ``[N, H]``.

    ``check``: the public boundary's ValueError for a w of the wrong shape or dtype.
    """
    w = jnp.asarray(w)
    if check and w.shape not in ((n, h), (h,)):
        raise ValueError(f"additive: w must have shape [N, H] = [{n}, {h}] or [H] = [{h}], got {w.shape}")
    if check and not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"additive: w must be floating point, got dtype {w.dtype}")
    return jnp.broadcast_to(w.astype(jnp.float32), (n, h))


def additive(q: jax.Array, k: jax.Array, w: jax.Array) -> jax.Array:
    """Additive (tanh) relevance ``sum_h w[n, h] * tanh(q[t, n, h] + k[s, n // G, h])``.

    Memory is O(T * S * N * H): this is the readable form for the note's examples and the
    reference, not a fast path.

    Args:
        q: ``[..., T, N, H]`` queries (W_q a_t).
        k: ``[..., S, K, H]`` keys (W_k a_s).
        w: ``[N, H]`` one scoring vector per head, or ``[H]`` shared by all heads.

    Returns:
        fp32 logits ``[..., N, T, S]``.

    Example:
        >>> q = jnp.zeros((1, 1, 2)); k = jnp.full((2, 1, 2), 0.5)
        >>> w = jnp.array([1.0, -2.0])   # tanh(0.5) * (1 - 2) = -0.4621
        >>> additive(q, k, w).round(4).tolist()
        [[[-0.4621, -0.4621]]]
    """
    n, kh = check_qk(q, k, fn="additive")
    h = q.shape[-1]
    w = _additive_weights(w, n, h, check=True).reshape(kh, n // kh, h)  # [K, G, H]
    qg = _group(q, kh).astype(jnp.float32)  # [..., T, K, G, H]
    kf = k.astype(jnp.float32)
    # [..., T, 1, K, G, H] + [..., 1, S, K, 1, H] -> [..., T, S, K, G, H]
    pre = qg[..., :, None, :, :, :] + kf[..., None, :, :, None, :]
    logits = jnp.einsum("...TSKGH,KGH->...KGTS", jnp.tanh(pre), w)
    *lead, _, _, t, s = logits.shape
    return logits.reshape(*lead, n, t, s)  # [..., K, G, T, S] -> [..., N, T, S]


# ------------------------------------------------------------------------------------------
# Score objects: the dense form plus the forms kernels use


class TileForm:
    """Base of the tile forms: how a tiled kernel computes a score one tile at a time.

    A kernel asks ``score.tile_form()`` and gets one of three forms, or None (dense only):

    * ``DotTile``: the scaled dot product itself (the kernel folds ``scale`` into the queries);
    * ``ModTile``: the scaled dot product changed per element by ``mod(s, q_idx, k_idx)``
      (``SoftCap``, ``ScoreMod``);
    * ``PairTile``: logits of a whole tile from its queries and keys, ``pair(q, k)`` (``Additive``).

    Every form has ``query_scale(H)``, the factor folded into the queries once, and ``head_axes``:
    per array leaf of the score (``jax.tree_util.tree_leaves`` order), the axis of length N the query
    head indexes, or None for a leaf every head reads whole; ``head_axes`` is None when unknown. A
    kernel that works on one head at a time (Pallas) slices the leaves with it and takes the form only
    when it is known. The attnlab tile core (``attnlab.kernels.tile_core``) is the one consumer: it
    differentiates ``mod`` and ``pair`` with ``jax.vjp`` one tile at a time, so a new score writes
    only its forward.
    """

    scale: float | None = None
    head_axes: tuple | None = ()

    def query_scale(self, head_dim: int) -> float:
        """The factor the kernels fold into the queries: ``scale``, or ``1/sqrt(H)`` when it is None."""
        return 1.0 / math.sqrt(head_dim) if self.scale is None else float(self.scale)


@dataclasses.dataclass(frozen=True)
class DotTile(TileForm):
    """The scaled dot product ``scale * q . k``."""

    scale: float | None = None
    head_axes: tuple | None = ()


@dataclasses.dataclass(frozen=True)
class ModTile(TileForm):
    """The scaled dot product changed per element: ``mod(s, q_idx, k_idx)``.

    ``s`` fp32 ``[..., N|1, t, s]`` (the call's leading dims and heads, or one head ``[1, t, s]`` in a
    kernel that slices the leaves per head), ``q_idx`` int32 ``[t]``, ``k_idx`` ``[s]`` (global
    positions) -> the new logits, same shape. ``elementwise``: ``mod`` reads neither positions nor
    heads nor arrays (``SoftCap``), so it may run on a tile of any shape.
    """

    mod: Callable
    scale: float | None = None
    head_axes: tuple | None = ()
    elementwise: bool = False


@dataclasses.dataclass(frozen=True)
class PairTile(TileForm):
    """Logits of a tile from its queries and keys (queries scaled by ``scale``, 1.0 for ``Additive``).

    ``pair(q, k)``: q ``[B, K, G, t, H]``, k ``[B, K, s, H]`` -> fp32 ``[B, K, G, t, s]``.
    ``head_pair_vjp(q, k, *, dq, dk, leaf_grads)`` or None: one head's tile, q ``[t, H']``, k ``[s, H']``
    (H' >= H: zero columns past the head dim may pad them), the array leaves sliced to this head; returns
    ``(s [t, s], back)``, ``back(ds) -> (dq, dk, d_leaves)`` fp32 (None where not asked for, ``d_leaves``
    one per array leaf or ``()``), built from ``[t, s]`` operations only (a GPU program's registers hold
    no ``[t, s, H]`` tensor).
    """

    pair: Callable
    head_pair_vjp: Callable | None = None
    scale: float | None = 1.0
    head_axes: tuple | None = ()


class Score:
    """Base class of score objects: the dense form ``score(q, k) -> fp32 [..., N, T, S]`` and the forms
    kernels use, each None when the score has none:

    * ``tile_form()``: a ``TileForm`` (``DotTile``, ``ModTile``, ``PairTile``) for the tiled kernels
      (blockwise, ring, Pallas), forward and backward, O(T + S) memory;
    * ``edge_form()``: ``(q_e [E, K, G, H], k_e [E, K, H], q_idx [E], k_idx [E]) -> fp32 [E, K, G]``, one
      logit per edge and query head, for the sparse (edge-list) kernel; ``q_idx`` and ``k_idx`` are the
      edges' receivers and senders (the positions a ``ScoreMod`` reads).
    * ``edge_mod()``: ``(s [E, K, G], q_idx [E], k_idx [E]) -> fp32 [E, K, G]``, the change such a score makes to
      each edge's scaled dot product ``s`` (scaled by ``self.scale``, None: ``1/sqrt(H)``), or None where the
      score is not a change of the dot product (``Additive``). Where it is given, ``edge_form`` is this on the
      dot product (``_mod_edge_form``).

    The score's array leaves (``Additive.w``, ``ScoreMod``'s arrays) reach a kernel as inputs: traced
    values reuse the compiled program and receive gradients.
    """

    def __call__(self, q: jax.Array, k: jax.Array) -> jax.Array:
        raise NotImplementedError

    def tile_form(self) -> TileForm | None:
        return None

    def edge_form(self) -> Callable | None:
        return None

    def edge_mod(self) -> Callable | None:
        return None

    @property
    def is_dot(self) -> bool:
        """The scaled dot product itself (fused kernels such as cuDNN and splash compute only this)."""
        return isinstance(self.tile_form(), DotTile)


@dataclasses.dataclass(frozen=True)
class Dot(Score):
    """Scaled dot product ``scale * q_t . k_s`` (default scale ``1/sqrt(H)``, decided per call).

    Example:
        >>> q = jnp.ones((2, 1, 4)); k = jnp.ones((3, 1, 4))
        >>> float(Dot()(q, k)[0, 0, 0]), float(Dot(0.5)(q, k)[0, 0, 0])
        (2.0, 2.0)
    """

    scale: float | None = None  # None: 1/sqrt(H), resolved per call from the head dim

    def __call__(self, q, k):
        return dot_product(q, k, scale=self.scale)

    def tile_form(self):
        return DotTile(self.scale)

    def edge_form(self):
        return _mod_edge_form(self)

    def edge_mod(self):
        return lambda s, q_idx, k_idx: s


def _dot_edges(q_e, k_e, scale):
    """The scaled dot product of each edge: q_e ``[E, K, G, H]``, k_e ``[E, K, H]`` -> fp32 ``[E, K, G]``."""
    s = 1.0 / math.sqrt(q_e.shape[-1]) if scale is None else scale
    return jnp.einsum("ekgh,ekh->ekg", q_e, k_e, preferred_element_type=jnp.float32) * jnp.float32(s)


def _mod_edge_form(score):
    """The edge form of a score that changes the scaled dot product per edge: its ``edge_mod`` on ``_dot_edges``."""
    mod = score.edge_mod()
    return lambda q_e, k_e, q_idx, k_idx: mod(_dot_edges(q_e, k_e, score.scale), q_idx, k_idx)


def _additive_pairs(q: jax.Array, k: jax.Array, w) -> jax.Array:
    """``sum_h w[n, h] tanh(q[t, n, h] + k[s, n // G, h])`` for every pair of a tile: q ``[B, K, G, t, H]``,
    k ``[B, K, s, H]``, w ``[N, H]`` or ``[H]`` -> fp32 ``[B, K, G, t, s]``.

    ``Additive``'s pair form (``PairTile.pair``). The dense form (``additive``, the reference's) keeps its
    own einsum over ``[..., T, S, K, G, H]``: the committed results were computed with it. Computed as rows
    ``[B*K, G*t, s, H]`` against per-row weights: a batched mat-vec with its batch dims leading (an einsum
    contracting ``[K, G, H]`` against the 6-D tensor made XLA:CPU transpose it: 7x slower).
    """
    b, kh, g, t, h = q.shape
    s = k.shape[2]
    w = _additive_weights(w, kh * g, h).reshape(kh, g, h)
    rows = jnp.broadcast_to(w[None, :, :, None, :], (b, kh, g, t, h)).reshape(b * kh, g * t, h)
    qf = q.astype(jnp.float32).reshape(b * kh, g * t, h)
    kf = k.astype(jnp.float32).reshape(b * kh, s, h)
    out = jnp.einsum("nqsh,nqh->nqs", jnp.tanh(qf[:, :, None, :] + kf[:, None, :, :]), rows)
    return out.reshape(b, kh, g, t, s)


def _additive_head(w, q, k, *, dq=True, dk=True, leaf_grads=True):
    """One head's additive tile (``PairTile.head_pair_vjp``): a loop over the head dim, one ``[t, s]`` tanh
    tile per step, so the ``[t, s, H]`` tensor never exists. Columns are picked with a one-hot compare, not
    an index, and the backward is written out (tanh' = 1 - tanh^2): the Triton lowering sees only
    elementwise ops, reductions and a counted loop."""
    w = jnp.asarray(w).astype(jnp.float32)  # [1, H] (this head's row) or [H] (shared)
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, qf.shape[1]), 1)  # [1, H']
    w_lane = jax.lax.broadcasted_iota(jnp.int32, w.shape, w.ndim - 1)

    def tanh_h(h):  # tanh(q[:, h] + k[:, h]) [t, s] and w[h]
        qh = jnp.sum(jnp.where(lane == h, qf, 0.0), axis=1)
        kh = jnp.sum(jnp.where(lane == h, kf, 0.0), axis=1)
        return jnp.tanh(qh[:, None] + kh[None, :]), jnp.sum(jnp.where(w_lane == h, w, 0.0))

    def fwd(h, s):
        t, wh = tanh_h(h)
        return s + wh * t

    n = w.shape[-1]
    s = jax.lax.fori_loop(0, n, fwd, jnp.zeros((qf.shape[0], kf.shape[0]), jnp.float32))

    def back(ds):
        def step(h, c):
            gq, gk, gw = c
            t, wh = tanh_h(h)
            g = ds * (wh * (1.0 - t * t))
            if dq:
                gq = gq + jnp.where(lane == h, jnp.sum(g, axis=1)[:, None], 0.0)
            if dk:
                gk = gk + jnp.where(lane == h, jnp.sum(g, axis=0)[:, None], 0.0)
            if leaf_grads:
                gw = gw + jnp.where(w_lane == h, jnp.sum(ds * t), 0.0)
            return gq, gk, gw

        z = jnp.zeros((), jnp.float32)
        init = (
            jnp.zeros(qf.shape, jnp.float32) if dq else z,
            jnp.zeros(kf.shape, jnp.float32) if dk else z,
            jnp.zeros(w.shape, jnp.float32) if leaf_grads else z,
        )
        gq, gk, gw = jax.lax.fori_loop(0, n, step, init)
        return (gq if dq else None), (gk if dk else None), ((gw,) if leaf_grads else ())

    return s, back


@dataclasses.dataclass(frozen=True)
class Additive(Score):
    """Additive (tanh) score ``w . tanh(q_t + k_s)`` with weights ``w`` ``[N, H]`` or ``[H]`` (a pytree leaf).

    Example:
        >>> q = jnp.zeros((1, 1, 2)); k = jnp.full((2, 1, 2), 0.5)
        >>> Additive(jnp.array([1.0, -2.0]))(q, k).round(4).tolist()
        [[[-0.4621, -0.4621]]]
    """

    w: Any

    def __call__(self, q, k):
        return additive(q, k, self.w)

    def tile_form(self):
        head_axes = (0,) if np.ndim(self.w) == 2 else (None,)  # w [N, H]: per head; [H]: shared
        return PairTile(
            pair=lambda q, k: _additive_pairs(q, k, self.w),
            head_pair_vjp=functools.partial(_additive_head, self.w),
            head_axes=head_axes,
        )

    def edge_form(self):
        def edge(q_e, k_e, q_idx, k_idx):  # [E, K, G, H] + [E, K, 1, H] -> [E, K, G]
            kh, g, h = q_e.shape[1:]
            w = _additive_weights(self.w, kh * g, h).reshape(kh, g, h)
            return jnp.sum(jnp.tanh(q_e.astype(jnp.float32) + k_e.astype(jnp.float32)[:, :, None, :]) * w, -1)

        return edge


@dataclasses.dataclass(frozen=True)
class SoftCap(Score):
    """Soft-capped dot product ``cap * tanh(scale * q_t . k_s / cap)`` (Gemma 2, Grok): logits stay in (-cap, cap).

    Its tile form is elementwise (``ModTile(elementwise=True)``): every tiled kernel computes it inside
    its tiles, forward and backward (``1 - tanh^2``), with O(T + S) memory.

    Example:
        >>> q = jnp.ones((1, 1, 4)); k = jnp.full((2, 1, 4), 10.0)
        >>> SoftCap(5.0)(q, k).round(3).tolist()           # dot 20 -> 5 tanh(4)
        [[[4.997, 4.997]]]
    """

    cap: float
    scale: float | None = None

    def __post_init__(self):
        if isinstance(self.cap, bool) or not isinstance(self.cap, (int, float)) or not self.cap > 0:
            raise ValueError(f"SoftCap: cap must be a positive Python number, got {self.cap!r}")
        check_scale(self.scale, fn="SoftCap")

    def _cap(self, s, q_idx=None, k_idx=None):
        return jnp.float32(self.cap) * jnp.tanh(s * jnp.float32(1.0 / self.cap))

    def tile_form(self):
        return ModTile(self._cap, self.scale, head_axes=(), elementwise=True)

    def edge_form(self):
        return _mod_edge_form(self)

    def edge_mod(self):
        return lambda s, q_idx, k_idx: self._cap(s)

    def __call__(self, q, k):
        return self._cap(dot_product(q, k, scale=self.scale))


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreMod(Score):
    """The scaled dot product modified per element: ``fn(s, q_idx, k_idx, *arrays)`` (FlexAttention's ``score_mod``).

    ``fn`` gets the logits ``s`` fp32 ``[..., N, t, s]`` (the call's leading dims, heads, a block of
    query and key positions), the global positions ``q_idx`` int32 ``[t, 1]`` and ``k_idx`` ``[1, s]``
    (as ``masks.predicate`` gets them: ``q_idx - k_idx`` is the ``[t, s]`` distance, ``table[q_idx,
    k_idx]`` a per-pair term), and the ``arrays``; it returns the new logits, same shape, built from
    broadcasting jnp operations that act on each logit separately (elementwise in ``s``, as
    FlexAttention asks of its ``score_mod``). The dense reference calls it once
    on ``[..., N, T, S]``; the tiled kernels once per tile, forward and backward (``jax.vjp`` of
    ``fn``), so memory stays O(T + S). ``arrays`` are pytree leaves: traced values (learned ALiBi
    slopes, per-pair tables indexed by positions) reuse the compiled program and get gradients.
    ``fn`` is static: pass the same function object to reuse a compiled program.

    ``head_axes`` (one entry per array: the axis of length N that the query head indexes, or None
    for an array all heads read whole, e.g. a shared relative-position table) lets a kernel that
    works on one head at a time (the Pallas kernel) take this score: it calls ``fn`` on ``s``
    ``[1, t, s]`` (no leading dims) with each per-head array sliced to a length-1 head axis, so
    ``fn`` must broadcast over the heads rather than assume N of them. Default: ``fn.head_axes`` when
    ``fn`` carries one (ALiBi's does: ``(0,)``), else unknown (the Pallas kernel declines).

    Special cases: ALiBi (``positional.Alibi().score(N)``), relative-position biases (a table indexed by
    ``q_idx - k_idx``), Graphormer-style per-pair terms (an array indexed by ``q_idx`` and ``k_idx``),
    soft-capping (``SoftCap``, which is this with ``cap * tanh(s / cap)``).

    Example:
        >>> q = k = jnp.ones((3, 2, 4))                              # [T, N, H]
        >>> near = lambda s, q_idx, k_idx, rate: s - rate[:, None, None] * abs(q_idx - k_idx)
        >>> mod = ScoreMod(near, jnp.array([1.0, 0.5]), head_axes=(0,))   # a rate per head
        >>> mod(q, k)[1].round(2).tolist()                            # head 1: 2 - 0.5 |t - s|
        [[2.0, 1.5, 1.0], [1.5, 2.0, 1.5], [1.0, 1.5, 2.0]]
    """

    fn: Callable
    arrays: tuple = ()
    scale: float | None = None
    head_axes: tuple | None = None

    def __init__(self, fn: Callable, *arrays, scale: float | None = None, head_axes=None):
        if not callable(fn):
            raise ValueError(f"ScoreMod: fn must be a callable fn(s, q_idx, k_idx, *arrays), got {type(fn).__name__}")
        check_scale(scale, fn="ScoreMod")
        if head_axes is None:
            head_axes = getattr(fn, "head_axes", None)
        if head_axes is not None:
            head_axes = tuple(head_axes)
            bad = [a for a in head_axes if a is not None and (isinstance(a, bool) or not isinstance(a, int))]
            if len(head_axes) != len(arrays) or bad:
                raise ValueError(
                    f"ScoreMod: head_axes must give one int axis (or None) per array, {len(arrays)} in all, "
                    f"got {head_axes!r}"
                )
            for i, (x, a) in enumerate(zip(arrays, head_axes, strict=True)):
                if a is not None and not -np.ndim(x) <= a < np.ndim(x):
                    raise ValueError(
                        f"ScoreMod: head_axes[{i}]={a} is out of range for array {i} of shape {np.shape(x)}"
                    )
            head_axes = tuple(a if a is None or a >= 0 else a + np.ndim(arrays[i]) for i, a in enumerate(head_axes))
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "arrays", tuple(arrays))
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "head_axes", head_axes)

    def _mod(self, s, q_idx, k_idx):
        out = self.fn(s, q_idx[:, None], k_idx[None, :], *self.arrays)
        if getattr(out, "shape", None) != s.shape:
            raise ValueError(
                f"ScoreMod: fn must return the logits' shape {tuple(s.shape)} ([..., N, t, s]), "
                f"got {getattr(out, 'shape', type(out).__name__)}"
            )
        return out.astype(jnp.float32)

    def tile_form(self):
        return ModTile(self._mod, self.scale, head_axes=self.head_axes)

    def edge_form(self):
        return None if self.head_axes is None else _mod_edge_form(self)

    def edge_mod(self):
        """``fn`` on the edges' logits as ``s [N, E, 1]``, with ``q_idx`` and ``k_idx`` ``[E, 1]`` (each
        edge's receiver and sender): elementwise, ``fn`` then gives each edge the logit it gives that pair
        in the dense ``[N, T, S]``. Only with ``head_axes`` declared (None otherwise): as in the Pallas
        kernel, it says that ``fn`` broadcasts its arrays over the heads and no leading dims."""
        if self.head_axes is None:
            return None

        def edge(s, q_idx, k_idx):  # s [E, K, G]
            heads_first = s.reshape(s.shape[0], -1).T[:, :, None]  # [N, E, 1]
            out = self.fn(heads_first, q_idx[:, None], k_idx[:, None], *self.arrays)
            if getattr(out, "shape", None) != heads_first.shape:
                raise ValueError(
                    f"ScoreMod: fn must return the logits' shape {tuple(heads_first.shape)} ([N, edges, 1] in the "
                    f"edge-list kernel), got {getattr(out, 'shape', type(out).__name__)}"
                )
            return out.astype(jnp.float32)[:, :, 0].T.reshape(s.shape)

        return edge

    def __call__(self, q, k):
        s = dot_product(q, k, scale=self.scale)
        t_idx = jnp.arange(q.shape[-3], dtype=jnp.int32)
        s_idx = jnp.arange(k.shape[-3], dtype=jnp.int32)
        return self._mod(s, t_idx, s_idx)


@dataclasses.dataclass(frozen=True)
class Custom(Score):
    """Any callable ``fn(q, k) -> [..., N, T, S]``: dense form only (static, compared by identity)."""

    fn: Callable

    def __call__(self, q, k):
        return self.fn(q, k)


def _unflatten_mod(aux, arrays):
    # no validation: the leaves may be sentinels (tree_map) or per-head slices inside a kernel
    m = object.__new__(ScoreMod)
    for name, value in zip(("fn", "scale", "head_axes"), aux, strict=True):
        object.__setattr__(m, name, value)
    object.__setattr__(m, "arrays", tuple(arrays))
    return m


_pytree.register_dataclass(Dot, data_fields=[], meta_fields=["scale"])
_pytree.register_dataclass(Additive, data_fields=["w"], meta_fields=[])
_pytree.register_dataclass(Custom, data_fields=[], meta_fields=["fn"])
_pytree.register_dataclass(SoftCap, data_fields=[], meta_fields=["cap", "scale"])
jax.tree_util.register_pytree_node(
    ScoreMod,
    lambda m: (m.arrays, (m.fn, m.scale, m.head_axes)),
    lambda aux, arrays: _unflatten_mod(aux, arrays),
)


def as_score(score, scale: float | None = None, *, fn: str = "attention") -> Score:
    """``"dot"``, a ``Score``, ``functools.partial(additive, w=w)`` or a callable -> a ``Score``.

    Raises:
        ValueError: an unknown string, ``"additive"`` without weights, a non-callable, or ``scale``
            given with a score other than the dot product.
    """
    check_scale(scale, fn=fn)
    if scale is not None and not hasattr(scale, "shape"):
        scale = float(scale)
    if isinstance(score, str):
        if score in ("dot", "dot_product"):
            return Dot(scale)
        if score == "additive":
            raise ValueError(
                f"{fn}: score='additive' needs its weights: pass score=attnlab.scores.Additive(w) "
                f"or functools.partial(attnlab.scores.additive, w=w)"
            )
        raise ValueError(f"{fn}: score must be 'dot' or a callable score(q, k) -> [..., N, T, S], got {score!r}")
    if isinstance(score, Dot) and scale is not None:
        if isinstance(score.scale, float) and isinstance(scale, float) and score.scale != scale:
            raise ValueError(f"{fn}: scale={scale} conflicts with score=Dot(scale={score.scale})")
        return Dot(scale)
    if scale is not None:
        raise ValueError(f"{fn}: scale applies to score='dot' only; fold it into your score function")
    if isinstance(score, Score):
        return score
    if (
        isinstance(score, functools.partial)
        and score.func is additive
        and not score.args
        and set(score.keywords) == {"w"}
    ):
        return Additive(score.keywords["w"])
    if not callable(score):
        raise ValueError(f"{fn}: score must be 'dot' or a callable, got {type(score).__name__}")
    return Custom(score)


SPEC_GRAMMAR = "dot | softcap:CAP | alibi | additive"


def from_spec(spec: str, *, num_heads: int, head_dim: int, seed: int = 0) -> Score:
    """A score from a string, for experiment flags: ``dot``, ``softcap:CAP``, ``alibi`` or ``additive``.

    ``alibi`` is ``positional.Alibi().score(num_heads)``: a ``ScoreMod`` with the paper's slopes;
    ``additive`` is ``Additive(w)`` with w ``[num_heads, head_dim]`` drawn from a normal of sd
    ``1/sqrt(head_dim)`` (numpy ``seed``).

    Example:
        >>> from_spec("softcap:30", num_heads=8, head_dim=64)
        SoftCap(cap=30.0, scale=None)
    """
    name, _, arg = spec.strip().partition(":") if isinstance(spec, str) else ("", "", "")
    if name in ("dot", "dot_product") and not arg:
        return Dot()
    if name == "softcap":
        try:
            return SoftCap(float(arg))
        except ValueError:
            raise ValueError(
                f"scores.from_spec: bad spec {spec!r}: softcap needs a positive CAP (softcap:30)"
            ) from None
    if name == "alibi" and not arg:
        from attnlab.positional import Alibi  # (positional imports scores)

        return Alibi().score(num_heads)
    if name == "additive" and not arg:
        w = np.random.default_rng(seed).normal(0.0, 1.0 / math.sqrt(head_dim), (num_heads, head_dim))
        return Additive(jnp.asarray(w, jnp.float32))
    raise ValueError(f"scores.from_spec: bad spec {spec!r}: expected {SPEC_GRAMMAR}")


def __getattr__(name: str):
    if name == "alibi_mod":  # deprecated 2026-12-06: ALiBi has one name, attnlab.positional.Alibi
        import warnings

        from attnlab.positional import _alibi_mod

        warnings.warn(
            "attnlab.scores.alibi_mod is deprecated: use positional.Alibi().score(num_heads) "
            "(or .score(slopes=slopes) for your own slopes)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _alibi_mod
    raise AttributeError(f"module 'attnlab.scores' has no attribute {name!r}")
