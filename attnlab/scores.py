"""Relevance scores between query and key positions (the α before the softmax).

The course note gives two ways to measure how relevant key s is to query t:

* **dot product**: ``q_t · k_s``, scaled by ``1/sqrt(H)`` (Vaswani et al. 2017, arXiv 1706.03762);
* **additive**: ``w · tanh(q_t + k_s)`` (Bahdanau et al. 2014, arXiv 1409.0473), where the
  projections W_q a_t and W_k a_s are already folded into q and k.

Any callable ``score(q, k) -> logits [..., N, T, S]`` can stand in for these; pass it as
``attention(..., score=fn)``. For learnable additive weights use
``functools.partial(additive, w=w)`` (w stays a traced array, so ``jax.grad`` reaches it).

Shape legend (as ``jax.nn.dot_product_attention``): T query length, S key length, N query heads,
K key/value heads (N % K == 0; G = N // K query heads share one key head: GQA/MQA), H head dim.
Query head n uses key head n // G.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["dot_product", "additive", "check_qk", "check_scale"]


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
    w = jnp.asarray(w)
    if w.shape not in ((n, h), (h,)):
        raise ValueError(f"additive: w must have shape [N, H] = [{n}, {h}] or [H] = [{h}], got {w.shape}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"additive: w must be floating point, got dtype {w.dtype}")
    w = jnp.broadcast_to(w.astype(jnp.float32), (n, h)).reshape(kh, n // kh, h)  # [K, G, H]
    qg = _group(q, kh).astype(jnp.float32)  # [..., T, K, G, H]
    kf = k.astype(jnp.float32)
    # [..., T, 1, K, G, H] + [..., 1, S, K, 1, H] -> [..., T, S, K, G, H]
    pre = qg[..., :, None, :, :, :] + kf[..., None, :, :, None, :]
    logits = jnp.einsum("...TSKGH,KGH->...KGTS", jnp.tanh(pre), w)
    *lead, _, _, t, s = logits.shape
    return logits.reshape(*lead, n, t, s)  # [..., K, G, T, S] -> [..., N, T, S]
