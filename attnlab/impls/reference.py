"""The dense fp32 reference: the obviously-correct attention every fast path is tested against.

The course note's recipe, for every query position t at once (the matrix form):

1. relevance ``α'[t, s] = score(q_t, k_s)`` (dot product or additive, see ``attnlab.scores``),
   plus an optional ``bias[t, s]``, restricted by a ``mask`` (True = attend);
2. ``α[t, :] = softmax(α'[t, :])`` over the allowed keys, in fp32;
3. ``b_t = Σ_s α[t, s] v_s``.

It materialises ``[..., N, T, S]`` and imports nothing from any kernel (dropout hashing and dtype
rules come from the neutral ``attnlab.numerics``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attnlab import numerics
from attnlab.call import Call
from attnlab.impls.base import Implementation

__all__ = ["REFERENCE", "masked_softmax", "weights_lse", "run_reference"]


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
    return softmax_lse(logits, mask)[0]


def softmax_lse(logits, mask):
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


def dense_bias(call: Call):
    """The bias as an array broadcastable to ``[..., N, T, S]`` (a callable evaluated on all positions), or None."""
    if call.bias_kind == "callable":
        return call.bias(jnp.arange(call.T), jnp.arange(call.S))
    return call.bias


def logits(call: Call) -> jax.Array:
    """fp32 logits ``[..., N, T, S]`` = score(q, k) + bias."""
    out = call.score(call.q, call.k)
    if tuple(out.shape) != call.logits_shape:
        raise ValueError(f"{call.fn}: score(q, k) must return [..., N, T, S] = {call.logits_shape}, got {out.shape}")
    out = out.astype(jnp.float32)
    bias = dense_bias(call)
    return out if bias is None else out + bias.astype(jnp.float32)


def weights_lse(call: Call):
    """(α fp32 ``[..., N, T, S]``, lse fp32 ``[..., N, T]``) of a bound call (no dropout)."""
    dense = None if call.mask is None else call.mask.dense(call.T, call.S)
    return softmax_lse(logits(call), dense)


def _dropout(weights, rate, seed):
    """Drops each weight [..., N, T, S] with probability ``rate``, scaling the kept ones by 1/(1-rate).

    The decision for (b, n, t, s) is ``numerics.dropout_keep`` of its position, the same one the
    blockwise kernel draws tile by tile.
    """
    *lead, n, t, s = weights.shape
    b = jnp.arange(math.prod(lead), dtype=jnp.uint32).reshape(*lead, 1, 1, 1)  # flat batch index
    heads = jnp.arange(n, dtype=jnp.uint32)[:, None, None]
    rows = (b * n + heads) * t + jnp.arange(t, dtype=jnp.uint32)[:, None]  # [..., N, T, 1]
    keep = numerics.dropout_keep(seed, rate, rows, jnp.arange(s, dtype=jnp.uint32))
    return jnp.where(keep, weights * jnp.float32(1.0 / (1.0 - rate)), 0.0)


def _weighted_sum(weights, v):
    """weights fp32 [..., N, T, S], v [..., S, K, Hv] -> fp32 [..., T, N, Hv]."""
    *lead, n, t, s = weights.shape
    kh = v.shape[-2]
    w = weights.reshape(*lead, kh, n // kh, t, s)  # [..., N, T, S] -> [..., K, G, T, S]
    out = jnp.einsum("...KGTS,...SKH->...TKGH", w, v.astype(jnp.float32))
    return out.reshape(*lead, t, n, v.shape[-1])  # [..., T, K, G, Hv] -> [..., T, N, Hv]


def run_reference(call: Call):
    """Dense attention of a bound call: ``[..., T, N, Hv]`` in q's dtype (and lse ``[..., T, N]``)."""
    weights, lse = weights_lse(call)
    if call.dropout_rate:
        weights = _dropout(weights, call.dropout_rate, call.dropout_seed)
    out = _weighted_sum(weights, call.v).astype(call.dtype)
    return (out, jnp.swapaxes(lse, -1, -2)) if call.return_lse else out  # lse [..., N, T] -> [..., T, N]


class Reference(Implementation):
    """Dense fp32: any mask, bias, score; dropout and the lse; O(T * S) memory."""

    name = "reference"
    features = frozenset({"dropout", "lse"})

    def run(self, call):
        return run_reference(call)


REFERENCE = Reference()
