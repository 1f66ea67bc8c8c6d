"""One attention call, checked once: ``bind(q, k, v, ...) -> Call``.

Every public entry point (``attnlab.attention``, ``attention_reference``, ``explain``, and the
kernels' own functions such as ``blockwise_attention``) starts by binding its arguments. ``bind``
runs every check of the public boundary, once, and raises a ``ValueError`` that names the argument;
what it returns is a frozen ``Call`` that the implementations (``attnlab.impls``) read and trust:

* ``call.mask`` is an ``attnlab.masks`` object or None (bool arrays are wrapped), already known to
  broadcast to the logits' ``[..., N, T, S]``;
* ``call.bias`` is None, a float array that broadcasts to the logits, or a callable
  ``bias(q_idx, k_idx)`` of positions whose output does;
* ``call.score`` is an ``attnlab.scores.Score`` (``scale`` folded in);
* ``call.dropout_rate`` is a float in [0, 1), with ``call.dropout_seed`` (uint32 [2]) when > 0.

q, k, v (and an array bias) may be ``jax.ShapeDtypeStruct``s: a bound call describes shapes only
until an implementation runs it, which is how ``explain`` decides for a backend this process lacks.

Shape legend: q ``[..., T, N, H]``, k ``[..., S, K, H]``, v ``[..., S, K, Hv]``; N % K == 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from attnlab import masks as masks_lib
from attnlab import numerics
from attnlab import scores as scores_lib

__all__ = ["Call", "bind", "check_broadcast"]


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """A checked attention call (see the module docstring); ``dataclasses.replace`` makes variants.

    Attributes:
        q, k, v: the arrays (or shape structs), ``[..., T, N, H]``, ``[..., S, K, H]``, ``[..., S, K, Hv]``.
        mask: an ``attnlab.masks.Mask`` or None.
        bias: None, a float array broadcastable to ``[..., N, T, S]``, or a callable of positions.
        score: an ``attnlab.scores.Score``.
        dropout_rate: the attention dropout rate (0.0: none).
        dropout_seed: uint32 ``[2]`` from ``dropout_key`` when ``dropout_rate > 0``, else None.
        dropout_key: the key as given (None without dropout).
        return_lse: the caller wants ``(out, lse)``.
        fn: the public function that bound the call (it starts every error message).
    """

    q: Any
    k: Any
    v: Any
    mask: masks_lib.Mask | None = None
    bias: Any = None
    score: scores_lib.Score = dataclasses.field(default_factory=scores_lib.Dot)
    dropout_rate: float = 0.0
    dropout_seed: Any = None
    dropout_key: Any = None
    return_lse: bool = False
    fn: str = "attention"

    # ---- shapes
    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-3])

    @property
    def batch(self) -> int:
        """B: the product of the leading dims (1 when there are none)."""
        return math.prod(self.lead)

    @property
    def T(self) -> int:  # noqa: N802 (the shape legend's names)
        return self.q.shape[-3]

    @property
    def S(self) -> int:  # noqa: N802 (the shape legend's names)
        return self.k.shape[-3]

    @property
    def N(self) -> int:  # noqa: N802 (the shape legend's names)
        return self.q.shape[-2]

    @property
    def K(self) -> int:  # noqa: N802 (the shape legend's names)
        return self.k.shape[-2]

    @property
    def H(self) -> int:  # noqa: N802 (the shape legend's names)
        return self.q.shape[-1]

    @property
    def Hv(self) -> int:  # noqa: N802 (the shape legend's names)
        return self.v.shape[-1]

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.q.dtype)

    @property
    def logits_shape(self) -> tuple[int, ...]:
        """``[..., N, T, S]``."""
        return (*self.lead, self.N, self.T, self.S)

    @property
    def empty(self) -> bool:
        """T = 0 or S = 0: the result is all zeros (lse -inf)."""
        return self.T == 0 or self.S == 0

    # ---- what the call asks for
    @property
    def needs(self) -> frozenset[str]:
        """The features beyond plain attention the call uses: ``"dropout"``, ``"lse"``."""
        return frozenset(({"dropout"} if self.dropout_rate else set()) | ({"lse"} if self.return_lse else set()))

    @property
    def bias_kind(self) -> str:
        """``"none"``, ``"array"`` or ``"callable"``."""
        if self.bias is None:
            return "none"
        return "array" if hasattr(self.bias, "shape") else "callable"

    @property
    def tile_mask(self) -> masks_lib.Mask | None:
        """The mask in its per-tile form (``mask.for_tiles()``), None for no mask or ``full()``."""
        if self.mask is None or self.mask.is_full:
            return None
        return self.mask.for_tiles()

    def zeros(self):
        """The result of an empty call (T = 0 or S = 0): zeros ``[..., T, N, Hv]`` (and lse -inf)."""
        out = jnp.zeros((*self.lead, self.T, self.N, self.Hv), self.dtype)
        return (out, jnp.full((*self.lead, self.T, self.N), -jnp.inf, jnp.float32)) if self.return_lse else out


def check_broadcast(name: str, shape, target) -> None:
    """``shape`` must broadcast to ``target`` without changing ``target`` (no silent broadcast)."""
    try:
        out = jnp.broadcast_shapes(tuple(shape), tuple(target))
    except ValueError:
        out = None
    if out != tuple(target):
        raise ValueError(
            f"{name} of shape {tuple(shape)} does not broadcast to the logits' shape [..., N, T, S] = {tuple(target)}"
        )


def _check_qkv(q, k, v, fn: str) -> None:
    # K = 0 or H = 0 would divide by zero deeper down (N % K, 1/sqrt(H)): name them here.
    # (T = 0 and S = 0 are fine: the result is [..., T, N, Hv], zeros where S = 0.)
    for name, x, legend in (("k", k, "[..., S, K, H]"), ("q", q, "[..., T, N, H]")):
        if hasattr(x, "shape") and len(x.shape) >= 3 and x.shape[-1] == 0:
            raise ValueError(f"{fn}: the head dim H must be >= 1, got {name} of shape {x.shape} ({legend})")
    if hasattr(k, "shape") and len(k.shape) >= 3 and k.shape[-2] == 0:
        raise ValueError(f"{fn}: the number of key heads K must be >= 1, got k of shape {k.shape} ([..., S, K, H])")
    scores_lib.check_qk(q, k, fn=fn)
    if v is None:
        return
    if not hasattr(v, "shape") or len(v.shape) != len(k.shape):
        raise ValueError(
            f"{fn}: v must have shape [..., S, K, Hv] like k {k.shape}, got {getattr(v, 'shape', type(v).__name__)}"
        )
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(
            f"{fn}: v must match k in batch dims, S and K: k {k.shape} "
            f"([..., S, K, H]) vs v {v.shape} ([..., S, K, Hv])"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_mask(mask, target):
    m = masks_lib.as_mask(mask, "mask")
    if m is None:
        return None
    T, S = target[-2], target[-1]
    dense = jax.eval_shape(lambda mm: mm.dense(T, S), m)
    if dense.dtype != bool:
        raise ValueError(f"mask must evaluate to bool, got dtype {dense.dtype}")
    check_broadcast("mask", dense.shape, target)
    return m


def _check_bias(bias, target):
    if bias is None:
        return None
    T, S = target[-2], target[-1]
    if callable(bias) and not hasattr(bias, "shape"):
        # a function of positions, bias(q_idx, k_idx) -> [..., N, len(q_idx), len(k_idx)]
        pos = (jax.ShapeDtypeStruct((T,), jnp.int32), jax.ShapeDtypeStruct((S,), jnp.int32))
        out = jax.eval_shape(lambda q_idx, k_idx: bias(q_idx, k_idx), *pos)
    elif hasattr(bias, "shape") and hasattr(bias, "dtype"):
        out = bias
    else:
        raise ValueError(
            f"bias must be an array broadcastable to {tuple(target)} or a callable "
            f"bias(q_idx, k_idx), got {type(bias).__name__}"
        )
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"bias must be floating point, got dtype {out.dtype}")
    check_broadcast("bias", out.shape, target)
    return bias


def bind(
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
    fn: str = "attention",
) -> Call:
    """Checks an attention call's arguments once and returns the ``Call`` the implementations run.

    Arguments as in ``attnlab.attention``; ``v`` may be None for weights-only calls
    (``attention_weights``). ``fn`` names the public function in error messages.

    Raises:
        ValueError: bad shapes or dtypes of q/k/v, N not divisible by K, a mask or bias that does
            not broadcast to ``[..., N, T, S]``, a non-bool mask, a bad score / scale / dropout.
    """
    _check_qkv(q, k, v, fn)
    score = scores_lib.as_score(score, scale, fn=fn)
    rate, seed = numerics.check_dropout(dropout_rate, dropout_key, fn)
    *lead, T, N, _ = q.shape
    target = (*lead, N, T, k.shape[-3])
    return Call(
        q=q,
        k=k,
        v=v,
        mask=_check_mask(mask, target),
        bias=_check_bias(bias, target),
        score=score,
        dropout_rate=rate,
        dropout_seed=seed,
        dropout_key=dropout_key if rate else None,
        return_lse=bool(return_lse),
        fn=fn,
    )
