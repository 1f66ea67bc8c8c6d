"""``attnlab.dot_product_attention``: ``jax.nn.dot_product_attention``'s signature on attnlab's kernels.

A model written against ``jax.nn.dot_product_attention`` adopts attnlab by changing one name::

    out = jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True)      # before
    out = attnlab.dot_product_attention(q, k, v, bias, mask, is_causal=True)     # after

The arguments mean what they mean in jax.nn (``query``/``key``/``value`` ``[B, T, N, H]`` or
``[T, N, H]``, a boolean ``mask``, an additive ``bias``, ``scale``, ``is_causal``,
``query_seq_lengths``, ``key_value_seq_lengths``, ``local_window_size``, ``implementation``,
``return_residual``) and every argument jax.nn rejects is rejected here with a ``ValueError`` that
names it. They become one ``attnlab.attention`` call: ``is_causal`` is ``masks.causal()``,
``local_window_size=(l, r)`` is ``masks.window(l, r)``, the lengths are ``masks.padding(...)``, a mask
array is a mask whose empty tiles the blockwise kernel finds on device (``ArrayMask``), all ANDed,
so ``attnlab.dispatch`` can pick a kernel that skips the tiles they empty (a ±128 window at 8K is
not computed densely). attnlab's extras are keywords: ``mask=`` may be an ``attnlab.masks`` object
(documents, predicates, BigBird, ...), ``score=`` an ``attnlab.scores`` score, ``implementation=``
any of attnlab's names. Where attnlab runs dense XLA (small calls), that is jax.nn's program written
out (``attnlab.impls.xla``) with attnlab's empty rows; ``explain(...)`` says which implementation a call
runs.

The one place attnlab and jax.nn disagree is a query row with no key to attend to (a mask row of
all False, ``key_value_seq_lengths`` of 0): jax.nn spreads it uniformly over all S keys (the mean
of the values; NaN when ``-inf`` biases empty it), attnlab returns zeros with zero gradients.
``empty_rows="zeros"`` (default) is attnlab's convention, ``empty_rows="mean"`` reproduces jax.nn's.
Both zero the rows past ``query_seq_lengths``, as jax.nn does. See docs/adopt.md.

Shape legend (as ``jax.nn.dot_product_attention``):
    B  batch      T  query length    S  key/value length
    N  query heads   K  key/value heads, N % K == 0, G = N // K    H  head dim
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import dispatch
from attnlab import masks as masks_lib
from attnlab.call import bind
from attnlab.impls.reference import weights_lse
from attnlab.masks.base import EMPTY, FULL, PARTIAL, Dense, mask_class

__all__ = ["dot_product_attention", "explain", "ArrayMask", "EMPTY_ROWS", "JAX_NN_IMPLEMENTATIONS"]

#: The conventions for a query row with no key: attnlab's zeros, or jax.nn's / Flax's mean of the values.
EMPTY_ROWS = ("zeros", "mean")

#: jax.nn's ``implementation`` values; ``"xla"`` and ``"cudnn"`` are attnlab implementation names too.
JAX_NN_IMPLEMENTATIONS = (None, "xla", "cudnn")

_FN = "dot_product_attention"


# ------------------------------------------------------------------------------------------
# A mask array whose empty tiles are found on device


@mask_class
class ArrayMask(Dense):
    """A bool array broadcastable to ``[..., N, T, S]`` (True = attend) as a mask with a runtime layout.

    ``masks.Dense`` with one more answer: when the array is traced (a mask built inside ``jit``, such
    as Flax's ``make_causal_mask`` or a padding mask from lengths), ``runtime_layout`` reduces it per
    tile on device, so the blockwise kernel skips the tiles it empties and drops the element mask on
    the tiles it fills, with no recompile for new values. The reduction reads the array once
    (O(B * T * S) booleans, small beside the O(B * N * T * S * H) attention).

    Example:
        >>> m = ArrayMask(jnp.tril(jnp.ones((4, 4), bool)))
        >>> m.block_layout(4, 4, 2, 2).tolist()      # concrete: the static layout is exact
        [[1, 0], [2, 1]]
    """

    def runtime_layout(self, T, S, bq, bk):
        if self.is_static:
            return None  # the static layout (by evaluation) is exact
        a = self.dense(T, S)
        a = jnp.broadcast_to(a, a.shape[:-2] + (T, S)).reshape(-1, T, S)  # every batch and head
        nq, nk = -(-T // bq), -(-S // bk)
        pad = ((0, 0), (0, nq * bq - T), (0, nk * bk - S))
        tiles = (-1, nq, bq, nk, bk)
        # past T or S: never allowed (for "any") and never spoiling "all allowed" (for "all")
        some = jnp.pad(a, pad, constant_values=False).reshape(tiles).any((0, 2, 4))
        every = jnp.pad(a, pad, constant_values=True).reshape(tiles).all((0, 2, 4))
        return jnp.where(~some, EMPTY, jnp.where(every, FULL, PARTIAL)).astype(jnp.int8)


def as_array_mask(mask, name: str = "mask"):
    """A bool array -> ``ArrayMask`` (a Mask or None is returned as is).

    Raises:
        ValueError: a non-bool array (naming ``name``).
    """
    if mask is None or isinstance(mask, masks_lib.Mask):
        return mask
    m = masks_lib.as_mask(mask, name)  # the dtype check and the rank-0/1 broadcast
    return ArrayMask(m.array)


# ------------------------------------------------------------------------------------------
# The shared core (also under attnlab.flax): bind -> choose -> run, then the empty-row convention


def check_empty_rows(empty_rows, fn: str) -> str:
    if empty_rows not in EMPTY_ROWS:
        raise ValueError(f"{fn}: empty_rows must be one of {EMPTY_ROWS}, got {empty_rows!r}")
    return empty_rows


def check_implementation(implementation, fn: str):
    """None, a name or a sequence of names of ``attnlab.IMPLEMENTATIONS`` (jax.nn's 'xla', 'cudnn' among them)."""
    names = tuple(dispatch.IMPLEMENTATIONS)
    expected = (
        f"{fn}: implementation must be None (attnlab chooses), one of jax.nn's 'xla' / 'cudnn' or attnlab's "
        f"{names}, or a sequence of attnlab's names"
    )
    if implementation is None:
        return None
    if isinstance(implementation, str):
        if implementation not in names:
            raise ValueError(f"{expected}; got {implementation!r}")
        return implementation
    if isinstance(implementation, Sequence) and implementation and all(isinstance(n, str) for n in implementation):
        bad = [n for n in implementation if n not in names]
        if bad:
            raise ValueError(f"{expected}; got {tuple(implementation)!r} ({bad[0]!r} unknown)")
        return tuple(implementation)
    raise ValueError(f"{expected}; got {implementation!r}")


def _row_has_key(call) -> jax.Array:
    """bool ``[..., T, N]``: the row has at least one key its mask allows with a bias above -inf (dense)."""
    allowed = None if call.mask is None or call.mask.is_full else call.mask.dense(call.T, call.S)
    if call.bias is not None:
        finite = jnp.asarray(call.bias) > -jnp.inf
        allowed = finite if allowed is None else allowed & finite
    shape = call.logits_shape[:-1]  # [..., N, T]
    if allowed is None:
        return jnp.ones(shape[:-2] + (call.T, call.N), bool)
    has = jnp.broadcast_to(jnp.any(allowed, axis=-1), shape)
    return jnp.swapaxes(has, -1, -2)  # [..., N, T] -> [..., T, N]


def _mean_of_values(v, num_heads: int) -> jax.Array:
    """fp32 ``[..., 1, N, Hv]``: each query head's mean of its key head's values over all S keys."""
    mean = jnp.mean(v.astype(jnp.float32), axis=-3)  # [..., S, K, Hv] -> [..., K, Hv]
    mean = jnp.repeat(mean, num_heads // v.shape[-2], axis=-2)  # -> [..., N, Hv]: query head n uses n // G
    return mean[..., None, :, :]


def attend(
    q, k, v, *, mask=None, bias=None, score=None, scale=None, implementation=None, dropout_rate=0.0,
    dropout_key=None, empty_rows="zeros", return_lse=False, fn=_FN,
):  # fmt: skip
    """``attnlab.attention`` with an empty-row convention: returns ``(out [..., T, N, Hv], lse [..., T, N] | None)``.

    ``empty_rows="mean"``: a row with no allowed key (mask all False, or every allowed bias -inf)
    gets the mean of the values over all S keys (jax.nn's and Flax's convention), and the gradient
    that mean carries to ``v``; ``"zeros"``: attnlab's zeros. The lse (fp32, -inf on empty rows) is
    returned when asked, from the implementation when it has one, else from the dense reference.
    """
    call = bind(
        q, k, v, mask=mask, bias=bias, score="dot" if score is None else score, scale=scale,
        dropout_rate=dropout_rate, dropout_key=dropout_key, fn=fn,
    )  # fmt: skip
    impl = dispatch.choose(call, implementation=implementation)
    lse = None
    if (return_lse or empty_rows == "mean") and "lse" in impl.features:
        out, lse = impl.run(dataclasses.replace(call, return_lse=True))
    else:
        out = impl.run(call)
    if empty_rows == "mean" and not call.empty:
        has_key = _row_has_key(call) if lse is None else lse > -jnp.inf
        out = jnp.where(has_key[..., None], out, _mean_of_values(call.v, call.N).astype(out.dtype))
    if return_lse and lse is None:
        lse = jnp.swapaxes(weights_lse(call)[1], -1, -2)  # [..., N, T] -> [..., T, N]
    return out, lse


# ------------------------------------------------------------------------------------------
# jax.nn.dot_product_attention's boundary


def _as_4d(x, name):
    """jax.nn's ``_ensure_4d``: rank <= 4, leading 1s added; rank > 4 is a ValueError naming ``name``."""
    if x.ndim > 4:
        raise ValueError(
            f"{_FN}: {name} must have rank <= 4 ([B, T, N, H] or [T, N, H] for query/key/value, "
            f"[B|1, N|1, T|1, S|1] for bias/mask, as jax.nn.dot_product_attention), got shape {x.shape}; "
            f"for more leading dims use attnlab.attention or jax.vmap"
        )
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))


def _check_heads_axis(x, name, N):
    # jax.nn groups a bias/mask's head axis as [K, G]: it must be 1 or N (other sizes fail an assert there)
    if x.shape[1] not in (1, N):
        raise ValueError(f"{_FN}: {name} of shape {x.shape} ([B|1, N|1, T|1, S|1]) must have 1 or N = {N} heads")


def _check_lengths(lengths, name, B):
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (B,) or lengths.dtype != jnp.int32:
        raise ValueError(
            f"{_FN}: {name} must be an int32 array of shape (B,) = ({B},), "
            f"got dtype {lengths.dtype} shape {lengths.shape}"
        )
    return jnp.maximum(lengths, 0)  # jax.nn compares positions with them: a negative length is 0


def _window_pair(local_window_size) -> tuple[int, int]:
    """jax.nn's ``local_window_size``: one int (both sides) or a pair of ints (left, right)."""
    if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
        local_window_size = (local_window_size, local_window_size)
    ok = (
        isinstance(local_window_size, Sequence)
        and len(local_window_size) == 2
        and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in local_window_size)
    )
    if not ok:
        raise ValueError(
            f"{_FN}: local_window_size must be an int or a pair of ints (left, right), got {local_window_size!r}"
        )
    return int(local_window_size[0]), int(local_window_size[1])


def _window_mask(window):
    """jax.nn's window ``t - left <= s <= t + right`` as ``masks.window`` (negative sizes move its offset)."""
    left, right = window
    if left + right < 0:  # no key in any row's window
        return masks_lib.Dense(np.zeros((1, 1), bool))
    offset = -left if left < 0 else (right if right < 0 else 0)  # window(l', r', offset=o): t+o-l' <= s <= t+o+r'
    return masks_lib.window(left + offset, right - offset, offset=offset)


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual=False,
    score=None,
    empty_rows="zeros",
):
    """``jax.nn.dot_product_attention``, computed by attnlab's kernels: same arguments, same results.

    ``softmax(scale * q·k + bias | mask) v`` per head, softmax in fp32; with GQA/MQA when K < N
    (query head n uses key head n // G).

    Args:
        query: ``[B, T, N, H]`` or ``[T, N, H]``.
        key: ``[B, S, K, H]`` or ``[S, K, H]``, N % K == 0.
        value: the shape and dtype of ``key``.
        bias: optional float array broadcastable to ``[B, N, T, S]`` (rank <= 4, head axis 1 or N),
            added to the logits (kept in fp32).
        mask: optional bool array broadcastable to ``[B, N, T, S]`` (rank <= 4, head axis 1 or N),
            True = attend; or an ``attnlab.masks`` object (``masks.document(ids) & masks.causal()``, ...).
        scale: logit scale, one number; default ``1/sqrt(H)``.
        is_causal: ``masks.causal()`` (top-left aligned: key s <= query t).
        query_seq_lengths: int32 ``[B]``: queries t >= length have no key, and their rows are zero.
        key_value_seq_lengths: int32 ``[B]``: keys s >= length are masked.
        local_window_size: ``(left, right)`` or one int for both: query t sees keys
            ``t - left <= s <= t + right`` (``masks.window(left, right)``).
        implementation: ``None`` (attnlab chooses, ``attnlab.explain`` says why; jax.nn's None means
            its XLA path), ``"xla"`` (jax.nn's XLA computation, with attnlab's conventions), ``"cudnn"``
            (cuDNN's fused kernel on a GPU), or any of ``attnlab.IMPLEMENTATIONS`` (``"blockwise"``,
            ``"reference"``, ...) or a sequence of them (the first that supports the call).
        return_residual: also return the rows' log-sum-exp ``[B, T, N]`` (``[T, N]``) in the key's
            dtype, without gradient, as jax.nn; ``-inf`` on empty rows with ``empty_rows="zeros"``,
            jax.nn's ``-0.7 * finfo(float32).max`` with ``"mean"``.
        score: an ``attnlab.scores`` score (``scores.SoftCap(30)``, ``scores.ScoreMod(fn, ...)``, ...)
            instead of the scaled dot product (``scale`` then must be None).
        empty_rows: ``"zeros"`` (attnlab: a row with no key returns zeros, zero gradients) or
            ``"mean"`` (jax.nn: the mean of the values over all S keys). Rows past
            ``query_seq_lengths`` are zero either way, as in jax.nn.

    Returns:
        ``[B, T, N, H]`` (the query's shape) in the query's dtype; with ``return_residual``,
        ``(out, lse)``.

    Raises:
        ValueError: whatever jax.nn rejects (ranks above 4, value's shape or dtype not the key's,
            query's batch or head dim not the key's, a non-bool mask array, lengths not int32 ``[B]``,
            N % K != 0, a head axis of bias/mask other than 1 or N, an unknown implementation), a
            non-scalar scale, a callable bias, and attnlab's own checks (the message names the argument).

    Example:
        >>> q = k = v = jnp.ones((2, 8, 4, 16))                   # [B, T, N, H]
        >>> out = dot_product_attention(q, k, v, is_causal=True, local_window_size=(2, 0))
        >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(2, 0))))
        True
    """
    empty_rows = check_empty_rows(empty_rows, _FN)
    implementation = check_implementation(implementation, _FN)
    c = _translate(
        query, key, value, bias, mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
    )  # fmt: skip
    out, lse = attend(
        c.q, c.k, c.v, mask=c.mask, bias=c.bias, score=score, scale=scale, implementation=implementation,
        empty_rows=empty_rows, return_lse=return_residual,
    )  # fmt: skip
    if c.q_len is not None and empty_rows == "mean":  # jax.nn zeroes the rows past the query lengths
        valid = jnp.arange(c.q.shape[1])[None, :] < c.q_len[:, None]  # [B, T]
        out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    out = out.reshape(c.out_shape)
    if not return_residual:
        return out
    if empty_rows == "mean":  # jax.nn's log-sum-exp of a row of masked logits: its finite fill value
        lse = jnp.where(lse > -jnp.inf, lse, jnp.float32(-0.7 * np.finfo(np.float32).max))
    return out, jax.lax.stop_gradient(lse.astype(c.k.dtype)).reshape(c.out_shape[:-1])


def explain(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    score=None,
    backend=None,
):
    """Which implementation ``dot_product_attention`` with these arguments runs, and why not the others.

    The same translation as ``dot_product_attention`` (``attnlab.explain`` on the resulting call).

    Example:
        >>> x = jnp.zeros((1, 8192, 8, 64))
        >>> explain(x, x, x, local_window_size=128, backend="cpu").implementation
        'blockwise'
    """
    implementation = check_implementation(implementation, "explain")
    c = _translate(
        query, key, value, bias, mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
    )  # fmt: skip
    return dispatch.explain(
        c.q, c.k, c.v, mask=c.mask, bias=c.bias, score="dot" if score is None else score, scale=scale,
        backend=backend, implementation=implementation,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Translated:
    """jax.nn's arguments as one attnlab call: 4-D q, k, v, one mask, a 4-D bias, the query lengths."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    mask: masks_lib.Mask | None
    bias: jax.Array | None
    q_len: jax.Array | None
    out_shape: tuple


def _translate(
    query, key, value, bias, mask, *, is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size
):
    """jax.nn's checks (each failure a ValueError naming the argument), then its arguments as attnlab's."""
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    out_shape = q.shape
    q, k, v = _as_4d(q, "query"), _as_4d(k, "key"), _as_4d(v, "value")
    B, S, K, H = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(
            f"{_FN}: value must have the shape and dtype of key {k.shape} {k.dtype} ([B, S, K, H]), "
            f"got {v.shape} {v.dtype}"
        )
    if q.shape[0] != B or q.shape[-1] != H or q.dtype != k.dtype:
        raise ValueError(
            f"{_FN}: query must be [B, T, N, H] with the key's B = {B}, H = {H} and dtype {k.dtype}, "
            f"got {q.shape} {q.dtype}"
        )
    N = q.shape[2]
    if N % K:
        raise ValueError(f"{_FN}: the number of query heads N = {N} must be a multiple of the key heads K = {K}")
    parts = []
    if mask is not None and not isinstance(mask, masks_lib.Mask):
        mask = jnp.asarray(mask)
        if mask.dtype != bool:
            raise ValueError(
                f"{_FN}: mask must be a bool array (True = attend; an additive mask goes in bias), "
                f"got dtype {mask.dtype}"
            )
        mask = _as_4d(mask, "mask")
        _check_heads_axis(mask, "mask", N)
        parts.append(ArrayMask(mask))
    elif mask is not None:
        parts.append(mask)
    if bias is not None:
        if callable(bias) and not hasattr(bias, "shape"):
            raise ValueError(
                f"{_FN}: bias must be an array (jax.nn's bias); for a bias of positions use "
                f"score=attnlab.scores.ScoreMod(...) or attnlab.attention(bias=callable)"
            )
        bias = jnp.asarray(bias)
        bias = _as_4d(bias if jnp.issubdtype(bias.dtype, jnp.floating) else bias.astype(jnp.float32), "bias")
        _check_heads_axis(bias, "bias", N)
    if isinstance(is_causal, jax.core.Tracer) or not isinstance(is_causal, (bool, int, np.bool_, np.integer)):
        raise ValueError(f"{_FN}: is_causal must be a Python bool, got {type(is_causal).__name__}")
    if is_causal:
        parts.append(masks_lib.causal())
    if local_window_size is not None:
        parts.append(_window_mask(_window_pair(local_window_size)))
    q_len = _check_lengths(query_seq_lengths, "query_seq_lengths", B)
    kv_len = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", B)
    if q_len is not None or kv_len is not None:
        parts.append(masks_lib.padding(q_lengths=q_len, kv_lengths=kv_len))
    return _Translated(q, k, v, masks_lib.and_all(parts), bias, q_len, out_shape)
