"""Scaled attention: the dense reference, the public entry points, and the implementation dispatcher.

The course note's recipe, for every query position t at once (the matrix form):

1. relevance ``α'[t, s] = score(q_t, k_s)`` (dot product or additive, see ``attnlab.scores``),
   plus an optional ``bias[t, s]``, restricted by a ``mask`` (True = attend);
2. ``α[t, :] = softmax(α'[t, :])`` over the allowed keys, in fp32;
3. ``b_t = Σ_s α[t, s] v_s``.

Shape legend (as ``jax.nn.dot_product_attention``):
    ...  any number of leading batch dims (also none), the same for q, k and v
    T    query (target) length          S    key/value (source) length
    N    query heads                    K    key/value heads, N % K == 0, G = N // K
    H    query/key head dim             Hv   value head dim (usually H)

A query row with no key to attend to (a padded query, an isolated graph node) returns zeros,
and its gradients are zero, never NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from attnlab import dispatch, scores
from attnlab import masks as masks_lib

__all__ = ["attention", "attention_weights", "attention_reference", "masked_softmax", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = tuple(dispatch.IMPLEMENTATIONS)  # the names; the registry is attnlab.dispatch
BLOCKWISE_MIN_PAIRS = dispatch.BLOCKWISE_MIN_PAIRS

ScoreFn = Callable[[jax.Array, jax.Array], jax.Array]


# ------------------------------------------------------------------------------------------
# Argument checks (at the public boundary; inside we trust the shapes)


def _check_qkv(q, k, v, fn):
    n, kh = scores.check_qk(q, k, fn=fn)
    if not hasattr(v, "ndim") or v.ndim != k.ndim:
        raise ValueError(
            f"{fn}: v must have shape [..., S, K, Hv] like k {k.shape}, got {getattr(v, 'shape', type(v).__name__)}"
        )
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(
            f"{fn}: v must match k in batch dims, S and K: k {k.shape} "
            f"([..., S, K, H]) vs v {v.shape} ([..., S, K, Hv])"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return n, kh


def _logits_shape(q, k):
    *lead, t, n, _ = q.shape
    return (*lead, n, t, k.shape[-3])


def _check_broadcast(name, shape, target):
    """`shape` must broadcast to `target` without changing `target` (no silent broadcast)."""
    try:
        out = jnp.broadcast_shapes(tuple(shape), tuple(target))
    except ValueError:
        out = None
    if out != tuple(target):
        raise ValueError(
            f"{name} of shape {tuple(shape)} does not broadcast to the logits' shape [..., N, T, S] = {tuple(target)}"
        )


def _dense_mask(mask, target):
    """Mask object/array -> bool array broadcastable to `target` [..., N, T, S], or None."""
    m = masks_lib.as_mask(mask, "mask")
    if m is None:
        return None
    dense = m.dense(target[-2], target[-1])
    if dense.dtype != bool:
        raise ValueError(f"mask must evaluate to bool, got dtype {dense.dtype}")
    _check_broadcast("mask", dense.shape, target)
    return dense


def _check_bias(bias, target):
    if bias is None:
        return None
    if callable(bias) and not hasattr(bias, "shape"):
        # a function of positions, bias(q_idx, k_idx) -> [..., N, T, S]: evaluate it densely here
        bias = bias(jnp.arange(target[-2]), jnp.arange(target[-1]))
    if not hasattr(bias, "shape"):
        raise ValueError(
            f"bias must be an array broadcastable to {tuple(target)} or a callable "
            f"bias(q_idx, k_idx), got {type(bias).__name__}"
        )
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise ValueError(f"bias must be floating point, got dtype {bias.dtype}")
    _check_broadcast("bias", bias.shape, target)
    return bias


def _score_fn(score, scale, fn) -> ScoreFn:
    if isinstance(score, str):
        if score in ("dot", "dot_product"):
            return lambda q, k: scores.dot_product(q, k, scale=scale)
        if score == "additive":
            raise ValueError(
                f"{fn}: score='additive' needs its weights: pass score=functools.partial(attnlab.scores.additive, w=w)"
            )
        raise ValueError(f"{fn}: score must be 'dot' or a callable score(q, k) -> [..., N, T, S], got {score!r}")
    if not callable(score):
        raise ValueError(f"{fn}: score must be 'dot' or a callable, got {type(score).__name__}")
    if scale is not None:
        raise ValueError(f"{fn}: scale applies to score='dot' only; fold it into your score function")
    return score


def _logits(q, k, *, bias, score, scale, fn):
    """fp32 logits [..., N, T, S] = score(q, k) + bias."""
    target = _logits_shape(q, k)
    logits = _score_fn(score, scale, fn)(q, k)
    if tuple(logits.shape) != target:
        raise ValueError(f"{fn}: score(q, k) must return [..., N, T, S] = {target}, got {logits.shape}")
    logits = logits.astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    return logits


# ------------------------------------------------------------------------------------------
# The reference


def masked_softmax(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Softmax over the last axis in fp32, restricted to ``mask``; rows with nothing allowed give 0.

    Masked logits are replaced by a large *finite* negative (not -inf) and then multiplied out, so
    neither the value nor the gradient of an empty row is NaN. A -inf logit (from a bias) counts as
    "not allowed" too.
    """
    logits = logits.astype(jnp.float32)
    neg = jnp.float32(-0.7 * jnp.finfo(jnp.float32).max)
    allowed = logits != -jnp.inf  # NaN stays NaN: a bug upstream should show, not vanish
    if mask is not None:
        allowed = allowed & mask
    x = jnp.where(allowed, logits, neg)
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    p = jnp.where(allowed, jnp.exp(x - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom == 0.0, 1.0, denom)


def _weights(q, k, *, mask, bias, score, scale, fn):
    target = _logits_shape(q, k)
    dense = _dense_mask(mask, target)
    bias = _check_bias(bias, target)
    return masked_softmax(_logits(q, k, bias=bias, score=score, scale=scale, fn=fn), dense)


def _weighted_sum(weights, v):
    """weights fp32 [..., N, T, S], v [..., S, K, Hv] -> fp32 [..., T, N, Hv]."""
    *lead, n, t, s = weights.shape
    kh = v.shape[-2]
    w = weights.reshape(*lead, kh, n // kh, t, s)  # [..., N, T, S] -> [..., K, G, T, S]
    out = jnp.einsum("...KGTS,...SKH->...TKGH", w, v.astype(jnp.float32))
    return out.reshape(*lead, t, n, v.shape[-1])  # [..., T, K, G, Hv] -> [..., T, N, Hv]


def attention_reference(q, k, v, *, mask=None, bias=None, score="dot", scale=None):
    """Dense attention in fp32: the obviously-correct version every fast path is tested against.

    Args:
        q: ``[..., T, N, H]`` queries.
        k: ``[..., S, K, H]`` keys.
        v: ``[..., S, K, Hv]`` values.
        mask: an ``attnlab.masks`` object or a bool array broadcastable to ``[..., N, T, S]``
            (True = attend), or None.
        bias: float array broadcastable to ``[..., N, T, S]``, added to the logits, or a callable
            ``bias(q_idx, k_idx) -> [..., N, len(q_idx), len(k_idx)]`` of positions (evaluated here
            on ``jnp.arange(T), jnp.arange(S)``).
        score: ``"dot"`` or a callable ``score(q, k) -> [..., N, T, S]``.
        scale: logit scale for ``score="dot"``; default ``1/sqrt(H)``.

    Returns:
        ``[..., T, N, Hv]`` in q's dtype (computed in fp32 throughout).

    Raises:
        ValueError: on mismatched shapes, dtypes, masks or biases (the message names the argument).
    """
    _check_qkv(q, k, v, "attention_reference")
    weights = _weights(q, k, mask=mask, bias=bias, score=score, scale=scale, fn="attention_reference")
    return _weighted_sum(weights, v).astype(q.dtype)


def attention_weights(q, k, *, mask=None, bias=None, score="dot", scale=None):
    """The attention weights α ``[..., N, T, S]`` (fp32), each allowed row summing to 1.

    Arguments as in ``attention``. Rows with no allowed key are all zeros.

    Example:
        >>> q = k = jnp.eye(3)[:, None, :]          # [T=3, N=1, H=3]
        >>> a = attention_weights(q, k, mask=masks_lib.causal())
        >>> a.shape, a[0, 0].tolist()
        ((1, 3, 3), [1.0, 0.0, 0.0])
    """
    scores.check_qk(q, k, fn="attention_weights")
    return _weights(q, k, mask=mask, bias=bias, score=score, scale=scale, fn="attention_weights")


# ------------------------------------------------------------------------------------------
# jax.nn.dot_product_attention (XLA) as an implementation


def _to_bnts(x, lead):
    """[..., N|1, T|1, S|1] (any rank <= len(lead)+3) -> [B|1, N|1, T|1, S|1] for jax.nn."""
    x = x.reshape((1,) * (len(lead) + 3 - x.ndim) + tuple(x.shape))
    if all(d == 1 for d in x.shape[: len(lead)]):
        return x.reshape((1,) + x.shape[len(lead) :])
    x = jnp.broadcast_to(x, tuple(lead) + x.shape[len(lead) :])
    return x.reshape((-1,) + x.shape[len(lead) :])


def _attention_xla(q, k, v, *, mask, bias, scale, fn):
    if q.shape[-1] != v.shape[-1]:
        raise ValueError(f"{fn}: implementation='xla' needs Hv == H, got q {q.shape} and v {v.shape}")
    target = _logits_shape(q, k)
    dense = _dense_mask(mask, target)
    bias = _check_bias(bias, target)
    if bias is not None:
        # As in the reference, a -inf bias means "not allowed" (so an all -inf row gives zeros).
        finite = bias != -jnp.inf
        dense = finite if dense is None else dense & finite
        bias = jnp.where(finite, bias, 0)
    lead = q.shape[:-3]
    dtype = q.dtype
    if dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA:CPU has no fp16 x fp16 -> fp32 dot (jax.nn's backward needs it): compute in fp32.
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    # [..., T, N, H] -> [B, T, N, H]
    q4, k4, v4 = (x.reshape((-1,) + x.shape[-3:]) for x in (q, k, v))
    m4 = None if dense is None else _to_bnts(dense, lead)
    b4 = None if bias is None else _to_bnts(bias.astype(q.dtype), lead)
    out = jax.nn.dot_product_attention(q4, k4, v4, bias=b4, mask=m4, scale=scale, implementation="xla")
    if m4 is not None:
        # jax.nn spreads a fully-masked row uniformly over all keys; attnlab returns zeros there.
        any_row = jnp.any(m4, axis=-1)  # [B|1, N|1, T|1]
        out = out * jnp.swapaxes(any_row, -1, -2)[..., None].astype(out.dtype)  # -> [B, T, N, 1]
    return out.reshape(lead + out.shape[1:]).astype(dtype)


# ------------------------------------------------------------------------------------------
# The public entry point


def _check_mask_for_kernel(m, q, k):
    """The kernels evaluate masks per tile; check once that the mask broadcasts correctly."""
    if m is None:
        return
    t, s = q.shape[-3], k.shape[-3]
    target = _logits_shape(q, k)
    shape = jax.eval_shape(lambda mm: mm.dense(t, s), m).shape
    _check_broadcast("mask", shape, target)


def _choose(q, k, v, *, mask, bias, score, is_dot=None, backend=None):
    """The implementation ``attention(implementation=None)`` runs (see ``attnlab.dispatch``)."""
    m = masks_lib.as_mask(mask, "mask")
    _check_mask_for_kernel(m, q, k)  # a mask of the wrong size fails here with its own message
    score = scores.as_score(score, fn="attention")
    return dispatch.choose(q, k, v, mask=m, bias=bias, score=score, backend=backend)


def attention(q, k, v, *, mask=None, bias=None, score="dot", scale=None, implementation=None):
    """Attention ``softmax(score(q, k) + bias | mask) v`` over any leading batch dims.

    Args:
        q: ``[..., T, N, H]`` queries.
        k: ``[..., S, K, H]`` keys; N % K == 0 (K < N is GQA, K == 1 is MQA).
        v: ``[..., S, K, Hv]`` values.
        mask: an ``attnlab.masks`` object (``causal()``, ``window(l, r)``, ``padding(...)``,
            ``graph(adj)``, combined with ``&``/``|``) or a bool array broadcastable to
            ``[..., N, T, S]``; True = attend.
        bias: float array broadcastable to ``[..., N, T, S]`` added to the logits.
        score: ``"dot"`` (scaled dot product), a score object (``scores.Dot(scale)``,
            ``scores.Additive(w)``) or any callable ``score(q, k) -> [..., N, T, S]``, e.g.
            ``functools.partial(attnlab.scores.additive, w=w)``.
        scale: logit scale for ``score="dot"``; default ``1/sqrt(H)``.
        implementation: ``None`` (choose), a name, or a sequence of names (the first that supports
            the call wins): ``"reference"`` (dense, fp32), ``"xla"`` (``jax.nn.dot_product_attention``;
            dot score, Hv == H), ``"blockwise"`` (``attnlab.kernels.blockwise_attention``: flash-style,
            skips empty mask tiles, O(T + S) memory; dot score; bias None or a callable of positions),
            ``"sparse"`` (``attnlab.kernels.sparse_attention``: segment softmax over a
            ``masks.graph_edges`` edge list, O(E)), ``"cudnn"`` (cuDNN's fused kernel on a GPU:
            bf16/fp16, causal / left-window / padding masks), ``"pallas"`` (GPU) and ``"splash"``
            (TPU) when their modules are present. ``None`` takes the first in
            ``attnlab.dispatch.ORDER[backend]`` that supports the call and pays off there; on CPU:

            1. ``"sparse"`` for a ``masks.graph_edges`` mask (with no bias and a dot/additive score);
            2. ``"blockwise"`` for the dot score when the bias is None or callable and either the
               mask's block layout has an EMPTY tile (window, causal, block-sparse graph, also with
               traced padding lengths) or there are at least ``BLOCKWISE_MIN_PAIRS`` = 512 x 512 pairs;
            3. ``"xla"`` for the dot score with Hv == H (small dense cases);
            4. ``"reference"`` otherwise.

            ``attnlab.explain(q, k, v, ...)`` shows the choice and the reasons, for any backend.

    Returns:
        ``[..., T, N, Hv]`` in q's dtype. Softmax is computed in fp32 for every input dtype.

    Raises:
        ValueError: bad shapes or dtypes of q/k/v, N not divisible by K, a mask or bias that does
            not broadcast to ``[..., N, T, S]``, a non-bool mask array, an unknown implementation
            or one that does not support the call (the message says why).

    Example:
        >>> q = k = v = jnp.ones((2, 5, 4, 8))           # [B, T, N, H]
        >>> attention(q, k, v, mask=masks_lib.causal()).shape
        (2, 5, 4, 8)
    """
    fn = "attention"
    _check_qkv(q, k, v, fn)
    score_obj = scores.as_score(score, scale, fn=fn)
    if implementation == "reference":  # the dense path checks its own arguments
        return attention_reference(q, k, v, mask=mask, bias=bias, score=score_obj)
    m = masks_lib.as_mask(mask, "mask")
    _check_mask_for_kernel(m, q, k)  # a mask of the wrong size fails here with its own message
    name = dispatch.choose(q, k, v, mask=m, bias=bias, score=score_obj, implementation=implementation, fn=fn)
    return dispatch.IMPLEMENTATIONS[name].run(q, k, v, mask=m, bias=bias, score=score_obj)
