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
arbitrary mask). Legend: B batch, T/S lengths, N/K heads, H head dim; q ``[..., T, N, H]``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax

from attnlab import attention as attention_lib
from attnlab import efficient

__all__ = ["AttentionFn", "Softmax", "Linear", "Performer", "Function", "as_attention", "KINDS"]

KINDS = ("softmax", "linear", "performer")


class AttentionFn:
    """Base class: subclass it (a frozen dataclass) to inject a new attention into the models.

    Implement ``__call__(q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None) -> o``;
    set ``takes_mask = False`` if padding should arrive as ``kv_lengths`` instead of a mask; set
    ``state_name`` and ``init`` for a fixed per-layer array (kept as a non-trained ``nnx.Variable``).
    """

    takes_mask: ClassVar[bool] = True
    state_name: ClassVar[str | None] = None

    def init(self, key, *, head_dim: int) -> jax.Array | None:
        del key, head_dim
        return None

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        raise NotImplementedError

    def mha_kwargs(self, *, mask, bias, kv_lengths, state) -> dict[str, Any]:
        """Keyword arguments for ``attnlab.heads.multi_head_attention`` (default: an ``attention_fn``)."""
        if self.takes_mask and kv_lengths is not None:
            raise ValueError(f"{type(self).__name__} takes padding as a mask, not kv_lengths")
        fn = functools.partial(self, mask=mask, bias=bias, kv_lengths=kv_lengths, state=state)
        return {"attention_fn": fn}


@dataclasses.dataclass(frozen=True)
class Softmax(AttentionFn):
    """``attnlab.attention`` (any mask, bias and score; ``implementation`` as there)."""

    implementation: str | None = None

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        if kv_lengths is not None:
            raise ValueError("Softmax takes padding as a mask, not kv_lengths")
        return attention_lib.attention(q, k, v, mask=mask, bias=bias, implementation=self.implementation)

    def mha_kwargs(self, *, mask, bias, kv_lengths, state):
        if kv_lengths is not None:
            raise ValueError("MultiHeadAttention: kind='softmax' takes padding as a mask, not kv_lengths")
        # multi_head_attention's own path: it also applies the score and can return the weights
        return {"mask": mask, "bias": bias, "implementation": self.implementation}


@dataclasses.dataclass(frozen=True)
class Linear(AttentionFn):
    """elu+1 linear attention (``attnlab.efficient.linear_attention``); padding as ``kv_lengths``."""

    takes_mask: ClassVar[bool] = False

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        return efficient.linear_attention(q, k, v, kv_lengths=kv_lengths)

    def mha_kwargs(self, *, mask, bias, kv_lengths, state):
        # mask/bias go through so that multi_head_attention refuses them with its message
        fn = functools.partial(efficient.linear_attention, kv_lengths=kv_lengths)
        return {"attention_fn": fn, "mask": mask, "bias": bias}


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

    def mha_kwargs(self, *, mask, bias, kv_lengths, state):
        fn = functools.partial(efficient.performer_attention, projection=state, kv_lengths=kv_lengths)
        return {"attention_fn": fn, "mask": mask, "bias": bias}


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
