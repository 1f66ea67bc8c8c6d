"""cuDNN's fused flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) for attnlab masks.

cuDNN does not take a mask array on its fast path: it takes *flags*. This module maps the attnlab
masks that have such a form onto them, and keeps attnlab's conventions on top:

==========================================  ===============================================
attnlab mask (parts of an ``&``)            ``jax.nn.dot_product_attention`` flags
==========================================  ===============================================
``None``, ``full()``                        none
``causal()`` (offset 0)                     ``is_causal=True``
``window(l, 0)``                            ``is_causal=True, local_window_size=(l, 0)``
``causal() & window(l, r)``                 ``is_causal=True, local_window_size=(l, 0)``
``padding(q_lengths, kv_lengths)``          ``query_seq_lengths``, ``key_value_seq_lengths``
                                            (int32 ``[B]``, traced values welcome)
==========================================  ===============================================

Anything else (a right window without causal, offsets, graphs, BigBird, a bias) is not cuDNN's:
``supports`` says why and the dispatcher moves on. A query row with nothing to attend to (a padded
query, a key length of 0, a window that lies past the key length) returns zeros, as everywhere in
attnlab; GQA (K < N) is passed through (cuDNN handles it natively).

The same mapping runs through ``jax.nn``'s own XLA path with ``implementation="xla"``: that is how
the tests check it on a CPU against ``attention_reference``.

Shape legend: B batch (leading dims flattened), T query length, S key length, N query heads,
K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attnlab import masks as masks_lib
from attnlab.call import Call, bind

__all__ = ["CudnnFlags", "cudnn_flags", "cudnn_attention", "attend", "CUDNN_DTYPES", "CUDNN_MAX_HEAD_DIM"]

# cuDNN's flash attention: bf16/fp16, H a multiple of 8 up to 256 (128 before Hopper), Hv == H.
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class CudnnFlags:
    """The static part of the mapping; the lengths (possibly traced) travel beside it."""

    is_causal: bool = False
    window: tuple[int, int] | None = None  # jax.nn's local_window_size (left, right)
    padding: tuple[masks_lib.Mask, ...] | None = None  # the padding factors (their minimum is used)


def cudnn_flags(mask) -> CudnnFlags | str:
    """The cuDNN flags for ``mask`` (an attnlab mask or None), or the reason there are none.

    Asks the mask: its padding factors (``split_padding``) become lengths, and every other factor
    must have the interval form ``t + lo <= s <= t + hi`` (``Mask.interval``) with ``hi = 0``
    (causal) or no bounds at all.
    """
    m = masks_lib.as_mask(mask, "mask")
    if m is None:
        return CudnnFlags()
    pads, rest = m.split_padding()
    lo, hi = None, None
    for part in () if rest is None else rest.conjuncts():
        bounds = part.interval()
        if bounds is None:
            return f"has no flag for mask part {type(part).__name__} (cuDNN: causal, left windows, padding lengths)"
        lo = bounds[0] if lo is None else (lo if bounds[0] is None else max(lo, bounds[0]))
        hi = bounds[1] if hi is None else (hi if bounds[1] is None else min(hi, bounds[1]))
    padding = pads or None
    if hi is None and lo is None:
        return CudnnFlags(False, None, padding)
    if (hi is not None and hi < 0) or (lo is not None and lo > 0):
        window = (None if lo is None else -lo, hi)
        return f"needs a window with left, right >= 0 (window{window} excludes the diagonal)"
    if hi != 0:
        if lo is None:  # causal(offset > 0), or no bound on the left with one on the right
            desc = " & ".join(repr(p) for p in rest.conjuncts())
            return f"has no flag for mask part {desc} (cuDNN: causal, left windows, padding lengths)"
        right = "any" if hi is None else hi
        return f"covers left windows only, not window(left={-lo}, right={right}) without causal"
    return CudnnFlags(True, None if lo is None else (-lo, 0), padding)


def cudnn_attention(q, k, v, *, mask=None, scale=None, implementation="cudnn"):
    """Dot-product attention through ``jax.nn.dot_product_attention`` with flags from ``mask``.

    Args:
        q: ``[..., T, N, H]``; k, v: ``[..., S, K, H]``.
        mask: an attnlab mask with a cuDNN form (see the module docstring), or None.
        scale: logit scale; default ``1/sqrt(H)``.
        implementation: ``"cudnn"`` (the fused kernel, GPU only) or ``"xla"`` (jax.nn's own XLA
            path given the same flags: what the tests use to check the mapping on a CPU).

    Returns:
        ``[..., T, N, H]`` in q's dtype; rows with nothing to attend to are zeros.

    Raises:
        ValueError: ``mask`` has no cuDNN form.
    """
    return attend(bind(q, k, v, mask=mask, scale=scale, fn="cudnn_attention"), implementation=implementation)


def attend(call: Call, *, implementation: str = "cudnn"):
    """``cudnn_attention`` on a bound call (``attnlab.call.bind``)."""
    flags = cudnn_flags(call.mask)
    if isinstance(flags, str):
        raise ValueError(f"mask: {call.fn} {flags}")
    if call.empty:
        return call.zeros()
    T, S, lead = call.T, call.S, call.lead
    q4, k4, v4 = (x.reshape((call.batch,) + x.shape[-3:]) for x in (call.q, call.k, call.v))  # [B, T, N, H]
    q_len = kv_len = None
    if flags.padding is not None:
        q_len, kv_len = masks_lib.padding_lengths(flags.padding, lead, T, S)
    out = jax.nn.dot_product_attention(
        q4,
        k4,
        v4,
        scale=call.score.scale,
        is_causal=flags.is_causal,
        query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len,
        local_window_size=flags.window,
        implementation=implementation,
    )
    nonempty = _nonempty_rows(flags, T, S, q_len, kv_len)  # [B|1, T]
    if nonempty is not None:
        out = jnp.where(nonempty[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(lead + out.shape[1:]).astype(call.dtype)


def _nonempty_rows(flags: CudnnFlags, T: int, S: int, q_len, kv_len):
    """bool ``[B|1, T]``: row t has at least one allowed key (None when every row has one)."""
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    lo = jnp.zeros_like(t)
    hi = jnp.full_like(t, S - 1)
    if flags.is_causal:
        hi = jnp.minimum(hi, t)
    if flags.window is not None:
        lo = jnp.maximum(lo, t - flags.window[0])
        hi = jnp.minimum(hi, t + flags.window[1])
    if kv_len is not None:
        hi = jnp.minimum(hi, kv_len[:, None] - 1)
    ok = lo <= hi
    if q_len is not None:
        ok = ok & (t < q_len[:, None])
    if q_len is None and kv_len is None and T <= S:
        return None  # causal / left windows always keep the diagonal when T <= S
    return ok
