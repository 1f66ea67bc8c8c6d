"""attnlab as Flax's ``attention_fn``: one line adopts it in a stock ``nnx.MultiHeadAttention`` or linen
``MultiHeadDotProductAttention``.

::

    from flax import nnx
    import attnlab.flax

    layer = nnx.MultiHeadAttention(8, 512, decode=False, attention_fn=attnlab.flax.attention_fn, rngs=nnx.Rngs(0))
    y = layer(x, mask=nnx.make_causal_mask(tokens))          # the module's own masks, as before
    y = layer(x, mask=masks.document(ids) & masks.causal())   # or any attnlab mask, through the call

``attention_fn`` takes what the modules pass (query, key, value, bias, mask, broadcast_dropout,
dropout_rng, dropout_rate, deterministic, dtype, precision, module, is_causal, and linen's
force_fp32_for_softmax / einsum overrides) and runs one ``attnlab.attention`` call, so the
dispatcher picks a kernel that skips what the mask leaves out. Flax's float masks
(``make_causal_mask``, ``make_attention_mask``: nonzero = attend) and bool masks are arrays whose
empty tiles are found on device (``attnlab.dropin.ArrayMask``); ``is_causal`` is ``masks.causal()``.
``make_attention_fn(mask=, score=, implementation=, empty_rows=)`` bakes in a mask ANDed with every
call's (a window, say) and a score (``scores.SoftCap(30)``, a ``ScoreMod``) for the layer.

Where it differs from stock Flax, by choice (docs/adopt.md has the whole list):

* a query row with no key (a padded query under ``make_attention_mask``) is zeros with
  ``empty_rows="zeros"`` (default); stock Flax gives the mean of the values there, which
  ``empty_rows="mean"`` reproduces;
* dropout draws one keep/drop decision per (batch, head, query, key) from ``dropout_rng`` (attnlab's
  position-hashed mask, ``attnlab.numerics.dropout_keep``), with Flax's rate and ``1 / (1 - rate)``
  scaling: each weight has the same distribution as stock Flax's, and the same expectation, but
  ``broadcast_dropout=True`` (Flax's default: one mask shared across batch and heads) is not
  reproduced: attnlab's masks are independent across batch and heads;
* ``module`` (``sow_weights=True``) is supported: the weights ``[..., N, T, S]`` are computed densely
  (``attnlab.attention_weights``, an extra O(T * S) per head) and sown as stock Flax does (NNX:
  ``nnx.Intermediate`` 'attention_weights'; linen: 'intermediates');
* ``precision``: on the CPU attnlab computes every fp32 product exactly whatever the precision (and
  half precision in fp32), so it is accepted as is; on a GPU or TPU a precision other than the
  default runs the dense implementations ("xla", else "reference") under
  ``jax.default_matmul_precision``, forward and backward (the fused kernels take no precision);
* linen's ``qk_attn_weights_einsum`` / ``attn_weights_value_einsum`` (AQT's quantized einsums) are a
  ValueError: attnlab's kernels do their own products.

This module imports flax only to tell an NNX module from a linen one when sowing weights.

Shape legend: query ``[..., T, N, H]``, key ``[..., S, K, H]``, value ``[..., S, K, Hv]``, masks and
biases broadcastable to ``[..., N, T, S]``.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from attnlab import dispatch
from attnlab import masks as masks_lib
from attnlab.attention import attention_weights
from attnlab.dropin import as_array_mask, attend, check_empty_rows, check_implementation

__all__ = ["attention_fn", "make_attention_fn", "precision_plan"]

_FN = "attnlab.flax.attention_fn"


def precision_plan(precision, implementation, backend=None):
    """``(implementation, context)`` for Flax's ``precision`` on ``backend`` (default: jax's).

    None / DEFAULT (or any precision on the CPU, where fp32 products are exact): the implementation as
    given and no context. Otherwise ``jax.default_matmul_precision(name)`` as the context and, when
    the implementation was left to attnlab, the dense ones whose every product (forward and backward)
    is traced inside it: ``("xla", "reference")``.

    Raises:
        ValueError: a precision that is not a ``jax.lax.Precision``, a name jax's
            ``default_matmul_precision`` takes, a ``DotAlgorithmPreset`` or a pair of equal ones.

    Example:
        >>> precision_plan(jax.lax.Precision.HIGHEST, None, backend="gpu")[0]
        ('xla', 'reference')
        >>> precision_plan(jax.lax.Precision.HIGHEST, None, backend="cpu")[0] is None
        True
    """
    name = precision
    if isinstance(name, (tuple, list)):
        if len(name) != 2 or name[0] != name[1]:
            raise ValueError(f"{_FN}: precision must be one value or a pair of equal ones, got {precision!r}")
        name = name[0]
    if name is not None and not isinstance(name, str):
        name = getattr(name, "name", None)  # lax.Precision.HIGHEST -> 'HIGHEST'; DotAlgorithmPreset -> its name
        if name is None:
            raise ValueError(f"{_FN}: precision must be a jax.lax.Precision, a string or None, got {precision!r}")
    if name is not None and name.lower() in ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32"):
        name = name.lower()
    if name in (None, "default", "fastest"):
        return implementation, contextlib.nullcontext()
    try:
        context = jax.default_matmul_precision(name)
        with context:
            pass
    except ValueError as e:
        raise ValueError(f"{_FN}: precision {precision!r} is not a jax.default_matmul_precision ({e})") from None
    if dispatch.normalize_backend(backend) == "cpu":
        return implementation, contextlib.nullcontext()
    return ("xla", "reference") if implementation is None else implementation, jax.default_matmul_precision(name)


def _promote(query, key, value, dtype):
    """Flax's ``promote_dtype``: all three to ``dtype``, or to their common inexact type."""
    dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.promote_types(dtype, jnp.float32)
    return tuple(jnp.asarray(x, dtype) for x in (query, key, value))


def _sow(module, weights):
    """Sows the weights as stock Flax does: NNX ``nnx.Intermediate``, linen the 'intermediates' collection."""
    from flax import nnx  # noqa: PLC0415 (flax only when weights are sown)

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    *,
    score=None,
    implementation=None,
    empty_rows: str = "zeros",
    extra_mask=None,
):
    """Flax's ``dot_product_attention`` contract on attnlab's kernels: pass it as ``attention_fn=``.

    Args:
        query: ``[..., T, N, H]`` (any leading batch dims, or none).
        key: ``[..., S, K, H]``; N % K == 0 (GQA as ``nnx.MultiHeadAttention(num_kv_heads=)``).
        value: ``[..., S, K, Hv]``.
        bias: optional float array broadcastable to ``[..., N, T, S]``, added to the logits.
        mask: optional array broadcastable to ``[..., N, T, S]`` (bool, or Flax's float masks: nonzero
            = attend), or an ``attnlab.masks`` object passed through the module call.
        broadcast_dropout: accepted; attnlab's dropout masks are independent across batch and heads
            (see the module docstring).
        dropout_rng: the dropout key (required when dropout is on).
        dropout_rate: attention dropout on the weights, as Flax (kept weights scaled by ``1/(1-rate)``).
        deterministic: True turns dropout off.
        dtype: the computation's dtype (Flax's ``promote_dtype``); softmax is fp32 always.
        precision: see ``precision_plan``.
        module: the module to sow the weights into (``sow_weights=True``), or None.
        is_causal: ``masks.causal()`` (``nnx.MultiHeadAttention(..., is_causal=True)`` at call time).
        force_fp32_for_softmax: accepted (attnlab's softmax is fp32 for every dtype).
        qk_attn_weights_einsum, attn_weights_value_einsum: must be None.
        score: an ``attnlab.scores`` score for the logits (default: the scaled dot product).
        implementation: None (attnlab chooses) or attnlab implementation name(s).
        empty_rows: ``"zeros"`` (attnlab) or ``"mean"`` (stock Flax: the mean of the values).
        extra_mask: an ``attnlab.masks`` object ANDed with ``mask`` (``make_attention_fn(mask=)``).

    Returns:
        ``[..., T, N, Hv]`` in the computation's dtype.

    Raises:
        ValueError: bad shapes or masks (attnlab's checks, naming the argument), dropout on without
            ``dropout_rng``, an einsum override, an unknown ``empty_rows``, ``implementation`` or
            ``precision``.

    Example:
        >>> from flax import nnx
        >>> layer = nnx.MultiHeadAttention(2, 8, attention_fn=attention_fn, rngs=nnx.Rngs(0))
        >>> x = jnp.ones((1, 5, 8))                          # [B, T, D]
        >>> layer(x, mask=nnx.make_causal_mask(jnp.ones((1, 5))), decode=False).shape
        (1, 5, 8)
    """
    empty_rows = check_empty_rows(empty_rows, _FN)
    implementation = check_implementation(implementation, _FN)
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise ValueError(
            f"{_FN}: qk_attn_weights_einsum / attn_weights_value_einsum (custom or quantized einsums) are not "
            f"supported: attnlab's kernels compute their own products; use flax's dot_product_attention"
        )
    q, k, v = _promote(query, key, value, dtype)
    parts = []
    if mask is not None:
        if not isinstance(mask, masks_lib.Mask) and jnp.asarray(mask).dtype != bool:
            mask = jnp.asarray(mask).astype(bool)  # Flax's float masks: nonzero = attend
        parts.append(as_array_mask(mask, "mask"))
    if extra_mask is not None:
        parts.append(masks_lib.as_mask(extra_mask, "extra_mask"))
    if is_causal:
        parts.append(masks_lib.causal())
    m = masks_lib.and_all(parts)
    dropout = not deterministic and dropout_rate > 0.0
    if dropout and dropout_rng is None:
        raise ValueError(f"{_FN}: dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng")
    implementation, context = precision_plan(precision, implementation)
    with context:
        if module is not None:  # sow_weights=True: the weights before dropout, as stock Flax
            weights = attention_weights(q, k, mask=m, bias=bias, score="dot" if score is None else score)
            if empty_rows == "mean":  # stock Flax's empty row: uniform over all S keys
                s = weights.shape[-1]
                weights = jnp.where(jnp.sum(weights, axis=-1, keepdims=True) > 0, weights, 1.0 / max(s, 1))
            _sow(module, weights.astype(q.dtype))
        out, _ = attend(
            q, k, v, mask=m, bias=bias, score=score, implementation=implementation,
            dropout_rate=float(dropout_rate) if dropout else 0.0, dropout_key=dropout_rng if dropout else None,
            empty_rows=empty_rows, fn=_FN,
        )  # fmt: skip
    return out


def make_attention_fn(*, mask=None, score=None, implementation=None, empty_rows: str = "zeros"):
    """An ``attention_fn`` with a mask (ANDed with each call's), a score, an implementation or an
    empty-row convention baked in, for ``nnx.MultiHeadAttention(attention_fn=...)`` / linen's.

    Args:
        mask: an ``attnlab.masks`` object for every call (a structural one: ``masks.window(128, 128)``,
            ``masks.causal()``; masks that carry per-batch data go through the module call's ``mask=``).
        score: an ``attnlab.scores`` score (``scores.SoftCap(30.0)``, ``scores.ScoreMod(...)``).
        implementation: None or attnlab implementation name(s).
        empty_rows: ``"zeros"`` or ``"mean"`` (stock Flax's convention).

    Returns:
        a function with ``attention_fn``'s signature (linen reads its parameters).

    Example:
        >>> from flax import nnx
        >>> fn = make_attention_fn(mask=masks_lib.window(2, 0))
        >>> layer = nnx.MultiHeadAttention(2, 8, attention_fn=fn, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((1, 5, 8)), decode=False).shape
        (1, 5, 8)
    """
    check_empty_rows(empty_rows, "make_attention_fn")
    check_implementation(implementation, "make_attention_fn")
    if mask is not None and not isinstance(mask, masks_lib.Mask):
        raise ValueError(f"make_attention_fn: mask must be an attnlab.masks object, got {type(mask).__name__}")
    return functools.partial(
        attention_fn, score=score, implementation=implementation, empty_rows=empty_rows, extra_mask=mask
    )
