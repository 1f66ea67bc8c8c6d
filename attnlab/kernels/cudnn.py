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

__all__ = ["CudnnFlags", "cudnn_flags", "cudnn_attention", "supports"]

# cuDNN's flash attention: bf16/fp16, H a multiple of 8 up to 256 (128 before Hopper), Hv == H.
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class CudnnFlags:
    """The static part of the mapping; the lengths (possibly traced) travel beside it."""

    is_causal: bool = False
    window: tuple[int, int] | None = None  # jax.nn's local_window_size (left, right)
    padding: masks_lib.Padding | None = None


def _parts(m):
    """The conjuncts of an ``&`` tree."""
    if isinstance(m, masks_lib.And):
        return _parts(m.a) + _parts(m.b)
    return [m]


def cudnn_flags(mask) -> CudnnFlags | str:
    """The cuDNN flags for ``mask`` (an attnlab mask or None), or the reason there are none."""
    m = masks_lib.as_mask(mask, "mask")
    causal, window, padding = False, None, None
    for p in [] if m is None else _parts(m):
        if isinstance(p, masks_lib.Full):
            continue
        if isinstance(p, masks_lib.Causal) and p.offset == 0:
            causal = True
        elif isinstance(p, masks_lib.Window) and p.offset == 0:
            window = (p.left, p.right) if window is None else (min(window[0], p.left), min(window[1], p.right))
        elif isinstance(p, masks_lib.Padding) and padding is None:
            padding = p
        else:
            return f"has no flag for mask part {_describe(p)} (cuDNN: causal, left windows, padding lengths)"
    if window is not None:
        if window[1] < 0 or window[0] < 0:
            return f"needs a window with left, right >= 0 (window{window} excludes the diagonal)"
        if causal or window[1] == 0:
            # causal & window(l, r) = window(l, 0) & causal; a left window alone is the same thing
            return CudnnFlags(True, (window[0], 0), padding)
        return f"covers left windows only, not window(left={window[0]}, right={window[1]}) without causal"
    return CudnnFlags(causal, None, padding)


def _describe(p) -> str:
    if isinstance(p, (masks_lib.Causal, masks_lib.Window)):
        return repr(p)
    return type(p).__name__


def supports(q, k, v, *, mask, bias, score, backend) -> str | None:
    """None when cuDNN's fused attention can run this call on ``backend``, else the reason (shapes only)."""
    if backend != "gpu":
        return f"needs a GPU backend (this is {backend})"
    if not getattr(score, "is_dot", False):
        return f"supports score='dot' only (got score {type(score).__name__})"
    if bias is not None:
        return "takes no bias here (not mapped to cuDNN; xla and blockwise take one)"
    if jnp.dtype(q.dtype).name not in CUDNN_DTYPES:
        return f"takes bf16/fp16 (cuDNN flash attention), got dtype {jnp.dtype(q.dtype).name}"
    H, Hv = q.shape[-1], v.shape[-1]
    if H % 8 or H > CUDNN_MAX_HEAD_DIM:
        return f"needs a head dim that is a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}, got H={H}"
    if Hv != H:
        return f"needs Hv == H, got Hv={Hv}, H={H}"
    flags = cudnn_flags(mask)
    return flags if isinstance(flags, str) else None


def _lengths(x, lead, default):
    """Padding lengths broadcastable to the batch dims ``lead`` -> int32 ``[B]``."""
    if x is None:
        return jnp.full((max(1, _prod(lead)),), default, jnp.int32)
    return jnp.broadcast_to(jnp.asarray(x).astype(jnp.int32), lead).reshape(-1)


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


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
    flags = cudnn_flags(mask)
    if isinstance(flags, str):
        raise ValueError(f"mask: cudnn_attention {flags}")
    *lead, T, N, H = q.shape
    lead = tuple(lead)
    S = k.shape[-3]
    B = max(1, _prod(lead))
    q4, k4, v4 = (x.reshape((B,) + x.shape[-3:]) for x in (q, k, v))  # [..., T, N, H] -> [B, T, N, H]
    q_len = kv_len = None
    if flags.padding is not None:
        q_len = _lengths(flags.padding.q_lengths, lead, T)
        kv_len = _lengths(flags.padding.kv_lengths, lead, S)
    out = jax.nn.dot_product_attention(
        q4,
        k4,
        v4,
        scale=scale,
        is_causal=flags.is_causal,
        query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len,
        local_window_size=flags.window,
        implementation=implementation,
    )
    nonempty = _nonempty_rows(flags, T, S, q_len, kv_len)  # [B|1, T]
    if nonempty is not None:
        out = jnp.where(nonempty[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(lead + out.shape[1:]).astype(q.dtype)


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
