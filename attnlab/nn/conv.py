"""A convolution is a restricted self-attention: build one exactly from the other.

The course note says a CNN is a simplified self-attention: a convolution looks at a fixed
neighbourhood with fixed weights per offset, self-attention chooses its neighbourhood and weights
from the data. Cordonnier, Loukas and Jaggi ("On the relationship between self-attention and
convolutional layers", ICLR 2020) make it constructive: multi-head self-attention with one head per
kernel offset, each head's relative-position attention putting all its weight on its own offset,
computes any convolution, with the kernel carried by the value/output projections.

``conv_as_attention(kernel)`` is that construction on attnlab's own ``multi_head_attention``:

- one head per offset ``δ`` of the kernel (k heads in 1-D, k² on a 2-D grid);
- query/key projections of zeros (width C_in, so every implementation takes the call): the content
  part of every score is 0, so attention is decided by the relative-position bias alone: ``0`` at
  the head's offset, ``-inf`` elsewhere (the limit of the paper's quadratic relative encoding as
  its sharpness grows; attnlab treats a ``-inf`` bias as "not allowed");
- at the borders the offset falls outside the sequence, the head's row is empty and attnlab returns
  zeros for it: exactly the zero padding of a ``'SAME'`` convolution;
- value projection = identity per head, output projection of head ``δ`` = ``kernel[δ]``, so
  ``y_t = Σ_δ x_{t+δ} kernel[δ]``: the cross-correlation ``jax.lax.conv_general_dilated`` computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import heads

__all__ = ["conv_as_attention", "conv_offsets"]


def conv_offsets(kernel_shape, grid=None) -> np.ndarray:
    """The relative offset of each head, in sequence positions: ``[k]`` (1-D) or ``[k*k, 2]`` (2-D)."""
    if grid is None:
        (k,) = kernel_shape
        return np.arange(k) - (k - 1) // 2
    kh, kw = kernel_shape
    dr, dc = np.meshgrid(np.arange(kh) - (kh - 1) // 2, np.arange(kw) - (kw - 1) // 2, indexing="ij")
    return np.stack([dr.ravel(), dc.ravel()], axis=-1)


def _check_kernel(kernel, grid):
    if not hasattr(kernel, "shape") or not hasattr(kernel, "dtype"):
        raise ValueError(f"conv_as_attention: kernel must be an array, got {type(kernel).__name__}")
    spatial = 1 if grid is None else 2
    if kernel.ndim != spatial + 2:
        want = "[k, C_in, C_out]" if grid is None else "[k, k, C_in, C_out] (grid given)"
        raise ValueError(f"conv_as_attention: kernel must have shape {want}, got {kernel.shape}")
    sizes = kernel.shape[:spatial]
    if any(s % 2 == 0 or s < 1 for s in sizes):
        raise ValueError(f"conv_as_attention: kernel sizes must be odd ('SAME' padding), got {sizes}")
    if not jnp.issubdtype(kernel.dtype, jnp.floating):
        raise ValueError(f"conv_as_attention: kernel must be floating point, got dtype {kernel.dtype}")
    if grid is not None and (len(grid) != 2 or any(int(g) < 1 for g in grid)):
        raise ValueError(f"conv_as_attention: grid must be (height, width) >= 1, got {grid}")


def _offset_bias(offsets, grid):
    """bias(q_idx, k_idx) -> [heads, T, S]: 0 where k - q is the head's offset, -inf elsewhere."""
    if grid is None:
        off = jnp.asarray(offsets, jnp.int32)

        def bias(q_idx, k_idx):
            rel = k_idx[None, None, :] - q_idx[None, :, None]  # [1, T, S]
            return jnp.where(rel == off[:, None, None], 0.0, -jnp.inf).astype(jnp.float32)

        return bias

    h, w = (int(g) for g in grid)
    dr = jnp.asarray(offsets[:, 0], jnp.int32)[:, None, None]
    dc = jnp.asarray(offsets[:, 1], jnp.int32)[:, None, None]

    def bias(q_idx, k_idx):
        qr, qc = (q_idx // w)[None, :, None], (q_idx % w)[None, :, None]
        kr, kc = (k_idx // w)[None, None, :], (k_idx % w)[None, None, :]
        # same row/column arithmetic as the image: no wrap-around from one row's end to the next
        hit = (kr - qr == dr) & (kc - qc == dc) & (qr < h) & (kr < h)
        return jnp.where(hit, 0.0, -jnp.inf).astype(jnp.float32)

    return bias


def conv_as_attention(kernel: jax.Array, *, grid: tuple[int, int] | None = None, implementation=None):
    """Turn a convolution kernel into an exactly equal multi-head self-attention layer.

    Args:
        kernel: ``[k, C_in, C_out]`` (1-D, odd k) or, with ``grid``, ``[k, k', C_in, C_out]``
            (odd sizes), as ``jax.lax.conv_general_dilated`` takes it in ``'WIO'`` / ``'HWIO'``.
        grid: ``(height, width)`` when the sequence is an image flattened row by row
            (``T = height * width``); ``None`` for a 1-D sequence.
        implementation: passed to ``attnlab.attention`` (default: the dispatcher's choice).

    Returns:
        ``(layer, params)``: ``layer(x)`` maps ``[..., T, C_in] -> [..., T, C_out]`` and equals the
        ``'SAME'``, stride-1 convolution of ``x`` with ``kernel``; ``params`` is the
        ``multi_head_attention`` parameter pytree it runs (one head per offset), for inspection.

    Example:
        >>> kernel = jnp.ones((3, 2, 4))
        >>> layer, _ = conv_as_attention(kernel)
        >>> layer(jnp.ones((1, 5, 2))).shape
        (1, 5, 4)
    """
    _check_kernel(kernel, grid)
    spatial = 1 if grid is None else 2
    cin, cout = kernel.shape[spatial:]
    offsets = conv_offsets(kernel.shape[:spatial], grid)
    n = len(offsets)
    dtype = kernel.dtype
    params = {
        "wq": jnp.zeros((cin, n, cin), dtype),  # content scores are all zero:
        "wk": jnp.zeros((cin, n, cin), dtype),  # the relative-position bias decides alone
        "wv": jnp.broadcast_to(jnp.eye(cin, dtype=dtype)[:, None, :], (cin, n, cin)),  # identity per head
        "wo": kernel.reshape(n, cin, cout),  # head δ's output projection is kernel[δ]
    }
    bias = _offset_bias(offsets, grid)

    def layer(x):
        if not hasattr(x, "ndim") or x.ndim < 2 or x.shape[-1] != cin:
            raise ValueError(
                f"conv_as_attention layer: x must have shape [..., T, {cin}] (C_in of the kernel), "
                f"got {getattr(x, 'shape', type(x).__name__)}"
            )
        if grid is not None and x.shape[-2] != grid[0] * grid[1]:
            raise ValueError(
                f"conv_as_attention layer: x has T = {x.shape[-2]} positions but grid {tuple(grid)} "
                f"has {grid[0] * grid[1]}"
            )
        return heads.multi_head_attention(params, x, bias=bias, implementation=implementation)

    return layer, params
