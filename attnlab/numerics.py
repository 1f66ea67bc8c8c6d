"""Numerical conventions shared by the reference and every kernel: dtypes, scale, attention dropout.

A neutral module: the dense reference (``attnlab.impls.reference``) and the tiled kernels
(``attnlab.kernels``) both import from here, and neither imports the other.
"""

from __future__ import annotations

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from attnlab import scores as scores_lib

__all__ = ["check_dropout", "compute_dtype", "default_scale", "dropout_keep"]


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
    scores_lib.check_scale(scale, fn="attention")
    return 1.0 / math.sqrt(H) if scale is None else float(scale)


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
