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

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from attnlab import dispatch, scores
from attnlab import masks as masks_lib
from attnlab.kernels import blockwise as blockwise_lib

__all__ = ["attention", "attention_weights", "attention_reference", "masked_softmax", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = tuple(dispatch.IMPLEMENTATIONS)  # the names; the registry is attnlab.dispatch
BLOCKWISE_MIN_PAIRS = dispatch.BLOCKWISE_MIN_PAIRS

ScoreFn = Callable[[jax.Array, jax.Array], jax.Array]


# ------------------------------------------------------------------------------------------
# Argument checks (at the public boundary; inside we trust the shapes)


def _check_qkv(q, k, v, fn):
    # K = 0 or H = 0 would divide by zero deeper down (N % K, 1/sqrt(H)): name them here.
    # (T = 0 and S = 0 are fine: the result is [..., T, N, Hv], zeros where S = 0.)
    for name, x, legend in (("k", k, "[..., S, K, H]"), ("q", q, "[..., T, N, H]")):
        if hasattr(x, "ndim") and x.ndim >= 3 and x.shape[-1] == 0:
            raise ValueError(f"{fn}: the head dim H must be >= 1, got {name} of shape {x.shape} ({legend})")
    if hasattr(k, "ndim") and k.ndim >= 3 and k.shape[-2] == 0:
        raise ValueError(f"{fn}: the number of key heads K must be >= 1, got k of shape {k.shape} ([..., S, K, H])")
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
    """``"dot"``, a ``scores.Score`` or a callable (and ``scale``, checked) -> a score function."""
    return scores.as_score(score, scale, fn=fn)


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

    Only ``mask == False`` and ``-inf`` logits take an entry out; finite logits, however negative
    (e.g. a bias of ``finfo(float32).min``), are a softmax like any other (a row of equal huge
    negative logits is uniform, as in float64). The row max is taken over the allowed entries only,
    so a masked entry never competes with them; neither the value nor the gradient of an empty row
    is NaN.

    Args:
        logits: ``[..., S]`` float logits.
        mask: bool, broadcastable with ``logits`` (True = attend), or None.

    Raises:
        ValueError: ``mask`` is not boolean.
    """
    return _softmax_lse(logits, mask)[0]


def _softmax_lse(logits, mask):
    """(weights, lse): the masked softmax and its log-sum-exp (fp32; lse -inf on an empty row)."""
    logits = logits.astype(jnp.float32)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != bool:
            raise ValueError(
                f"mask must be a bool array (True = attend), got dtype {mask.dtype}; use `mask != 0` to convert"
            )
    allowed = logits != -jnp.inf  # NaN stays NaN: a bug upstream should show, not vanish
    if mask is not None:
        allowed = allowed & mask
    if allowed.shape[-1] == 0:  # S = 0: nothing to attend anywhere
        return jnp.zeros(allowed.shape, jnp.float32), jnp.full(allowed.shape[:-1], -jnp.inf, jnp.float32)
    x = jnp.where(allowed, logits, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    m = jnp.where(m == -jnp.inf, 0.0, m)  # an empty row: any finite shift (its entries are all 0)
    p = jnp.where(allowed, jnp.exp(x - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    nonempty = denom > 0.0
    safe = jnp.where(nonempty, denom, 1.0)
    lse = jnp.where(nonempty, m + jnp.log(safe), -jnp.inf)[..., 0]
    return p / safe, lse


def _weights(q, k, *, mask, bias, score, scale, fn):
    return _weights_lse(q, k, mask=mask, bias=bias, score=score, scale=scale, fn=fn)[0]


def _weights_lse(q, k, *, mask, bias, score, scale, fn):
    target = _logits_shape(q, k)
    dense = _dense_mask(mask, target)
    bias = _check_bias(bias, target)
    return _softmax_lse(_logits(q, k, bias=bias, score=score, scale=scale, fn=fn), dense)


def _dropout(weights, rate, seed):
    """Drops each weight [..., N, T, S] with probability ``rate``, scaling the kept ones by 1/(1-rate).

    The decision for (b, n, t, s) is ``blockwise_lib.dropout_keep`` of its position, the same
    one the blockwise kernel draws tile by tile.
    """
    *lead, n, t, s = weights.shape
    b = jnp.arange(math.prod(lead), dtype=jnp.uint32).reshape(*lead, 1, 1, 1)  # flat batch index
    heads = jnp.arange(n, dtype=jnp.uint32)[:, None, None]
    rows = (b * n + heads) * t + jnp.arange(t, dtype=jnp.uint32)[:, None]  # [..., N, T, 1]
    keep = blockwise_lib.dropout_keep(seed, rate, rows, jnp.arange(s, dtype=jnp.uint32))
    return jnp.where(keep, weights * jnp.float32(1.0 / (1.0 - rate)), 0.0)


def _weighted_sum(weights, v):
    """weights fp32 [..., N, T, S], v [..., S, K, Hv] -> fp32 [..., T, N, Hv]."""
    *lead, n, t, s = weights.shape
    kh = v.shape[-2]
    w = weights.reshape(*lead, kh, n // kh, t, s)  # [..., N, T, S] -> [..., K, G, T, S]
    out = jnp.einsum("...KGTS,...SKH->...TKGH", w, v.astype(jnp.float32))
    return out.reshape(*lead, t, n, v.shape[-1])  # [..., T, K, G, Hv] -> [..., T, N, Hv]


def attention_reference(
    q,
    k,
    v,
    *,
    mask=None,
    bias=None,
    score="dot",
    scale=None,
    dropout_rate=0.0,
    dropout_key=None,
    return_lse=False,
):
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
        dropout_rate: probability of dropping each attention weight (after the softmax; kept
            weights are scaled by ``1/(1 - rate)``), as flax's ``dropout_rate`` / torch's ``dropout_p``.
        dropout_key: a ``jax.random`` key, required when ``dropout_rate > 0``. The mask is a function
            of the key and the position (b, n, t, s) only: the blockwise kernel draws the same one.
        return_lse: also return the log-sum-exp of each row's allowed logits, fp32 ``[..., T, N]``
            (``-inf`` for a row with nothing to attend), as jax.nn's ``return_residual``.

    Returns:
        ``[..., T, N, Hv]`` in q's dtype (computed in fp32 throughout); with ``return_lse``, the
        pair ``(out, lse)``.

    Raises:
        ValueError: on mismatched shapes, dtypes, masks or biases (the message names the argument).
    """
    fn = "attention_reference"
    _check_qkv(q, k, v, fn)
    rate, seed = blockwise_lib.check_dropout(dropout_rate, dropout_key, fn)
    weights, lse = _weights_lse(q, k, mask=mask, bias=bias, score=score, scale=scale, fn=fn)
    if seed is not None:
        weights = _dropout(weights, rate, seed)
    out = _weighted_sum(weights, v).astype(q.dtype)
    return (out, jnp.swapaxes(lse, -1, -2)) if return_lse else out  # lse [..., N, T] -> [..., T, N]


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
    lead = q.shape[:-3]
    dtype = q.dtype
    if target[-2] == 0 or target[-1] == 0:  # T = 0 or S = 0: jax.nn cannot reshape empty arrays
        return jnp.zeros((*lead, q.shape[-3], q.shape[-2], v.shape[-1]), dtype)
    # As in the reference, the bias stays fp32 (jax.nn adds it to fp32 logits) and a -inf bias
    # means "not allowed". The mask goes in as -inf in that fp32 bias, not as jax.nn's mask: jax.nn
    # fills masked logits with a finite -0.7 * max, which beats an allowed logit of finfo.min.
    allowed = dense
    if bias is not None:
        bias = bias.astype(jnp.float32)
        finite = bias != -jnp.inf
        allowed = finite if allowed is None else allowed & finite
    b4 = None if bias is None else _to_bnts(bias, lead)  # [B|1, N|1, T|1, S|1]
    any4 = None
    if allowed is not None:
        a4 = _to_bnts(allowed, lead)
        any4 = jnp.any(a4, axis=-1, keepdims=True)  # [B|1, N|1, T|1, 1]
        b4 = jnp.where(a4, jnp.float32(0) if b4 is None else b4, -jnp.inf)
        # a row with nothing allowed: any finite row for jax.nn (no NaN), zeroed below
        b4 = jnp.where(any4, b4, 0.0)
    # XLA:CPU has no fp16 x fp16 -> fp32 dot (jax.nn's backward needs it) and its small-shape bf16
    # emitter rejects jax.nn's BF16_BF16_F32 dot ("ALG_DOT_BF16_BF16_F32 not supported" under jit
    # for B = T = S = N = 1): half precision is computed in fp32 there, as in the blockwise kernel.
    compute = blockwise_lib.compute_dtype(dtype)
    q, k, v = (x.astype(compute) for x in (q, k, v))
    # [..., T, N, H] -> [B, T, N, H]
    q4, k4, v4 = (x.reshape((-1,) + x.shape[-3:]) for x in (q, k, v))
    out = jax.nn.dot_product_attention(q4, k4, v4, bias=b4, scale=scale, implementation="xla")
    if any4 is not None:
        # jax.nn spreads an empty row uniformly over all keys; attnlab returns zeros there.
        out = out * jnp.swapaxes(any4[..., 0], -1, -2)[..., None].astype(out.dtype)  # -> [B|1, T|1, N|1, 1]
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


def attention(
    q,
    k,
    v,
    *,
    mask=None,
    bias=None,
    score="dot",
    scale=None,
    implementation=None,
    dropout_rate=0.0,
    dropout_key=None,
    return_lse=False,
):
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
            With dropout or ``return_lse``, only implementations that draw dropout / return the lse
            are candidates ("reference" and "blockwise").
        dropout_rate: attention dropout on the weights (``"reference"`` and ``"blockwise"``), see
            ``attention_reference``; the same key gives the same mask on both.
        dropout_key: a ``jax.random`` key, required when ``dropout_rate > 0``.
        return_lse: also return the rows' log-sum-exp, fp32 ``[..., T, N]`` (-inf on empty rows),
            differentiable (``"reference"`` and ``"blockwise"``).

    Returns:
        ``[..., T, N, Hv]`` in q's dtype, or ``(out, lse)`` with ``return_lse``. Softmax is computed
        in fp32 for every input dtype.

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
    rate, _ = blockwise_lib.check_dropout(dropout_rate, dropout_key, fn)
    extras = {"return_lse": True} if return_lse else {}
    if rate:
        extras |= {"dropout_rate": rate, "dropout_key": dropout_key}
    if implementation == "reference":  # the dense path checks its own arguments
        return attention_reference(q, k, v, mask=mask, bias=bias, score=score_obj, **extras)
    m = masks_lib.as_mask(mask, "mask")
    _check_mask_for_kernel(m, q, k)  # a mask of the wrong size fails here with its own message
    needs = frozenset(({"dropout"} if rate else set()) | ({"lse"} if return_lse else set()))
    name = dispatch.choose(
        q, k, v, mask=m, bias=bias, score=score_obj, implementation=implementation, fn=fn, needs=needs
    )
    return dispatch.IMPLEMENTATIONS[name].run(q, k, v, mask=m, bias=bias, score=score_obj, **extras)
