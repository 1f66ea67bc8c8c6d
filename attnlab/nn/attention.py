"""Attention as an injected object: what ``MultiHeadAttention`` does between its projections.

``MultiHeadAttention``, ``TransformerBlock`` and ``Encoder`` take ``attention=`` one of these (or
its name ``"softmax" | "linear" | "performer"``, built with its defaults):

* ``Softmax(implementation=None)``: ``attnlab.attention`` with any mask and bias (the default);
* ``Linear()``: elu+1 linear attention (Katharopoulos et al. 2020, arXiv 2006.16236), O(N);
* ``Performer(num_features=256)``: FAVOR+ (Choromanski et al. 2020, arXiv 2009.14794) with a fixed
  random projection drawn per layer at init;
* any callable ``fn(q, k, v, *, mask, bias) -> o`` (e.g. ``functools.partial(attnlab.attention,
  implementation="blockwise")``), wrapped in ``Function``.

An object says whether it ``takes_mask`` (then the Encoder hands it padding & structure as one
mask, plus any bias) or takes padding as ``kv_lengths`` (the O(N) kinds, which cannot apply an
arbitrary mask), and whether it ``takes_score`` (the module's score, dot product or additive, handed
to it as ``score=``; the others compute the dot product). For inspection (``attnlab.inspect``) a kind
says what its attention weights are: ``weights(q, k, v, ...)``, the matrix ``w`` with ``o = w @ v``
per head (softmax's weights, the effective weights of linear attention and Performer, None for a
plain function), and ``lse(...)``, softmax's per-row log-sum-exp. Legend: B batch, T/S lengths, N/K
heads, H head dim, R query rows; q ``[..., T, N, H]``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from attnlab import efficient
from attnlab.attention import attention as _attention  # from the module: `attnlab.attention` is the function
from attnlab.attention import attention_weights
from attnlab.call import bind

__all__ = ["AttentionFn", "Softmax", "Linear", "Performer", "Function", "as_attention", "KINDS"]

KINDS = ("softmax", "linear", "performer")


class AttentionFn:
    """Base class: subclass it (a frozen dataclass) to inject a new attention into the models.

    Implement ``__call__(q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None) -> o``;
    set ``takes_mask = False`` if padding should arrive as ``kv_lengths`` instead of a mask; set
    ``takes_score = True`` if ``__call__`` takes the module's score as ``score=`` (the others run only
    with ``score="dot"``); set ``state_name`` and ``init`` for a fixed per-layer array (kept as a
    non-trained ``nnx.Variable``). Implement ``weights`` (and, for a softmax, ``lse``) to let
    ``attnlab.inspect`` record the kind's attention weights.
    """

    takes_mask: ClassVar[bool] = True
    takes_score: ClassVar[bool] = False
    state_name: ClassVar[str | None] = None

    def init(self, key, *, head_dim: int) -> jax.Array | None:
        del key, head_dim
        return None

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        raise NotImplementedError

    def mha_kwargs(self, *, mask, bias, kv_lengths, state, score="dot") -> dict[str, Any]:
        """Keyword arguments for ``attnlab.heads.multi_head_attention`` (default: an ``attention_fn``).

        ``score`` (the module's, resolved: ``"dot"`` or a score object) comes only to a kind that ``takes_score``.
        """
        if self.takes_mask and kv_lengths is not None:
            raise ValueError(f"{type(self).__name__} takes padding as a mask, not kv_lengths")
        extra = {"score": score} if self.takes_score else {}
        fn = functools.partial(self, mask=mask, bias=bias, kv_lengths=kv_lengths, state=state, **extra)
        return {"attention_fn": fn}

    def weights(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot", rows=None):
        """The attention weights this kind applies: fp32 ``w [..., N, T, S]`` with ``o = w @ v`` per head.

        Args:
            q, k, v: the per-head queries ``[..., T, N, H]``, keys and values, as ``__call__`` gets them.
            mask, bias, kv_lengths, state, score: as ``__call__`` gets them.
            rows: None, or the query rows to return (a tuple of ints ``< T``): ``[..., N, R, S]``.

        Returns:
            the weights, or None where the kind has no weight matrix attnlab knows (the default).
        """
        del q, k, v, mask, bias, kv_lengths, state, score, rows
        return None

    def lse(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot"):
        """Every query row's log-sum-exp of its logits, fp32 ``[..., T, N]``, for a softmax kind; else None."""
        del q, k, v, mask, bias, kv_lengths, state, score
        return None


def _rows(q, rows):
    """``q [..., T, N, H]`` -> its query rows ``[..., R, N, H]`` (all of them for None)."""
    return q if rows is None else jnp.take(q, jnp.asarray(rows), axis=-3)


@dataclasses.dataclass(frozen=True)
class Softmax(AttentionFn):
    """``attnlab.attention`` (any mask, bias and score; ``implementation`` as there)."""

    implementation: str | None = None
    takes_score: ClassVar[bool] = True

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot"):
        if kv_lengths is not None:
            raise ValueError("Softmax takes padding as a mask, not kv_lengths")
        return _attention(q, k, v, mask=mask, bias=bias, score=score, implementation=self.implementation)

    def mha_kwargs(self, *, mask, bias, kv_lengths, state, score="dot"):
        if kv_lengths is not None:
            raise ValueError("MultiHeadAttention: kind='softmax' takes padding as a mask, not kv_lengths")
        # multi_head_attention's own path: it also applies the (module's) score and can return the weights
        return {"mask": mask, "bias": bias, "implementation": self.implementation}

    def weights(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot", rows=None):
        """The softmax weights (``attnlab.attention_weights``); with ``rows``, only those rows' mask and bias
        are evaluated (O(R S): no ``[T, S]`` array)."""
        if rows is None:
            return attention_weights(q, k, mask=mask, bias=bias, score=score)
        call = bind(q, k, v, mask=mask, bias=bias, score=score, fn="inspect.capture")
        r, keys = jnp.asarray(rows), jnp.arange(call.S)
        row_mask = None if call.mask is None else call.mask(r, keys)
        row_bias = call.bias
        if call.bias_kind == "callable":
            row_bias = call.bias(r, keys)
        elif row_bias is not None:
            b = jnp.asarray(row_bias)
            row_bias = b if b.ndim < 2 or b.shape[-2] == 1 else jnp.take(b, r, axis=-2)
        return attention_weights(_rows(q, rows), k, mask=row_mask, bias=row_bias, score=score)

    def lse(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot"):
        """From ``attnlab.attention(..., return_lse=True)``: O(T) memory (blockwise for long inputs)."""
        return _attention(q, k, v, mask=mask, bias=bias, score=score, return_lse=True)[1]


@dataclasses.dataclass(frozen=True)
class Linear(AttentionFn):
    """elu+1 linear attention (``attnlab.efficient.linear_attention``); padding as ``kv_lengths``."""

    takes_mask: ClassVar[bool] = False

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        return efficient.linear_attention(q, k, v, kv_lengths=kv_lengths)

    def mha_kwargs(self, *, mask, bias, kv_lengths, state, score="dot"):
        # mask/bias go through so that multi_head_attention refuses them with its message
        fn = functools.partial(efficient.linear_attention, kv_lengths=kv_lengths)
        return {"attention_fn": fn, "mask": mask, "bias": bias}

    def weights(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot", rows=None):
        """The effective weights (``attnlab.efficient.linear_attention_weights``)."""
        return efficient.linear_attention_weights(_rows(q, rows), k, kv_lengths=kv_lengths)


@dataclasses.dataclass(frozen=True)
class Performer(AttentionFn):
    """FAVOR+ (``attnlab.efficient.performer_attention``) with ``num_features`` random features M.

    The projection ``[M, H]`` is drawn once per layer at init and kept fixed (``projection``).
    """

    num_features: int = 256
    takes_mask: ClassVar[bool] = False
    state_name: ClassVar[str] = "projection"

    def init(self, key, *, head_dim):
        return efficient.performer_projection(key, self.num_features, head_dim)

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        return efficient.performer_attention(q, k, v, projection=state, kv_lengths=kv_lengths)

    def mha_kwargs(self, *, mask, bias, kv_lengths, state, score="dot"):
        fn = functools.partial(efficient.performer_attention, projection=state, kv_lengths=kv_lengths)
        return {"attention_fn": fn, "mask": mask, "bias": bias}

    def weights(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot", rows=None):
        """The effective weights of the fixed projection ``state`` (``efficient.performer_attention_weights``)."""
        return efficient.performer_attention_weights(_rows(q, rows), k, projection=state, kv_lengths=kv_lengths)


@dataclasses.dataclass(frozen=True)
class Function(AttentionFn):
    """Wraps a plain ``fn(q, k, v, *, mask, bias) -> o [..., T, N, Hv]`` that takes the full mask."""

    fn: Callable

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        if kv_lengths is not None:
            raise ValueError("Function attention takes padding as a mask, not kv_lengths")
        return self.fn(q, k, v, mask=mask, bias=bias)


def as_attention(attention, *, implementation: str | None = None, num_features: int = 256) -> AttentionFn:
    """An ``AttentionFn`` from an object, a callable, or a kind name (``implementation`` /
    ``num_features`` configure the named ``"softmax"`` / ``"performer"`` kinds only).

    Example:
        >>> as_attention("performer", num_features=64)
        Performer(num_features=64)
    """
    if isinstance(attention, AttentionFn):
        return attention
    if isinstance(attention, str):
        match attention:
            case "softmax":
                return Softmax(implementation)
            case "linear":
                return Linear()
            case "performer":
                return Performer(num_features)
        raise ValueError(f"kind must be one of {KINDS} or an attnlab.nn AttentionFn, got {attention!r}")
    if callable(attention):
        return Function(attention)
    raise ValueError(f"attention must be one of {KINDS}, an AttentionFn or a callable, got {attention!r}")
