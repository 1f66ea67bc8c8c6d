"""Positional encodings (the part needed by ``attnlab.nn.Encoder``; issue 4 grows this file).

Self-attention is permutation-equivariant: without a position signal, "the dog bit the man" and
"the man bit the dog" give each word the same output. A positional encoding adds where a token is.

Legend: P number of positions, D model dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["sinusoidal"]


def sinusoidal(num_positions: int, d_model: int, *, base: float = 10000) -> jax.Array:
    """Fixed sine/cosine table of Vaswani et al. 2017 (arXiv 1706.03762, sec. 3.5).

    ``pe[p, 2i] = sin(p / base^(2i/D))`` and ``pe[p, 2i+1] = cos(p / base^(2i/D))``.

    Args:
        num_positions: P, the number of positions (0 .. P-1).
        d_model: D, an even model width.
        base: the wavelength base (10000 in the paper).

    Returns:
        float32 ``[P, D]``.

    Raises:
        ValueError: P < 1, D not a positive even int, or base <= 1.

    Example:
        >>> sinusoidal(3, 4)[1].round(4).tolist()    # sin 1, cos 1, sin 0.01, cos 0.01
        [0.8415, 0.5403, 0.01, 0.9999]
    """
    for name, value in (("num_positions", num_positions), ("d_model", d_model)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"sinusoidal: {name} must be a positive int, got {value!r}")
    if d_model % 2:
        raise ValueError(f"sinusoidal: d_model must be even, got {d_model}")
    if not base > 1:
        raise ValueError(f"sinusoidal: base must be > 1, got {base!r}")
    pos = jnp.arange(num_positions, dtype=jnp.float32)[:, None]  # [P, 1]
    inv_freq = base ** (-jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model)  # [D/2]
    angles = pos * inv_freq  # [P, D/2]
    # [P, D/2, 2] (sin, cos interleaved) -> [P, D]
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(num_positions, d_model)
