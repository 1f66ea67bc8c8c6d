"""Scaled attention: the public entry points. One call is bound once, then chosen, then run:

``attention(q, k, v, ...)`` = ``attnlab.call.bind`` (every check, once) -> ``attnlab.dispatch.choose``
(the first implementation of ``attnlab.impls`` that supports the call and pays off) -> its ``run``.

The course note's recipe, for every query position t at once (the matrix form):

1. relevance ``α'[t, s] = score(q_t, k_s)`` (dot product or additive, see ``attnlab.scores``),
   plus an optional ``bias[t, s]``, restricted by a ``mask`` (True = attend);
2. ``α[t, :] = softmax(α'[t, :])`` over the allowed keys, in fp32;
3. ``b_t = Σ_s α[t, s] v_s``.

Shape legend (as ``jax.nn.dot_product_attention``):
    ...  any number of leading batch dims (also none), the same for q, k and v
    T    query (target) length          S    key/value (source) length
    N    query heads                    K    key/value heads, N % K == 0, G = N // K
    H    query/key head dim             Hv   value head dim (usually H)

A query row with no key to attend to (a padded query, an isolated graph node) returns zeros,
and its gradients are zero, never NaN.
"""

from __future__ import annotations

import jax.numpy as jnp  # noqa: F401 (the doctests)

from attnlab import dispatch
from attnlab import masks as masks_lib  # noqa: F401 (the doctests)
from attnlab.call import bind
from attnlab.impls.reference import masked_softmax, run_reference, weights_lse

__all__ = ["attention", "attention_weights", "attention_reference", "masked_softmax", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = tuple(dispatch.IMPLEMENTATIONS)  # the names; the objects are attnlab.impls


def attention_reference(
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
):
    """Dense attention in fp32: the obviously-correct version every fast path is tested against.

    Args:
        q: ``[..., T, N, H]`` queries.
        k: ``[..., S, K, H]`` keys.
        v: ``[..., S, K, Hv]`` values.
        mask: an ``attnlab.masks`` object or a bool array broadcastable to ``[..., N, T, S]``
            (True = attend), or None.
        bias: float array broadcastable to ``[..., N, T, S]``, added to the logits, or a callable
            ``bias(q_idx, k_idx) -> [..., N, len(q_idx), len(k_idx)]`` of positions (evaluated here
            on ``jnp.arange(T), jnp.arange(S)``).
        score: ``"dot"`` or a callable ``score(q, k) -> [..., N, T, S]``.
        scale: logit scale for ``score="dot"``; default ``1/sqrt(H)``.
        dropout_rate: probability of dropping each attention weight (after the softmax; kept
            weights are scaled by ``1/(1 - rate)``), as flax's ``dropout_rate`` / torch's ``dropout_p``.
        dropout_key: a ``jax.random`` key, required when ``dropout_rate > 0``. The mask is a function
            of the key and the position (b, n, t, s) only: the blockwise kernel draws the same one.
        return_lse: also return the log-sum-exp of each row's allowed logits, fp32 ``[..., T, N]``
            (``-inf`` for a row with nothing to attend), as jax.nn's ``return_residual``.

    Returns:
        ``[..., T, N, Hv]`` in q's dtype (computed in fp32 throughout); with ``return_lse``, the
        pair ``(out, lse)``.

    Raises:
        ValueError: on mismatched shapes, dtypes, masks or biases (the message names the argument).
    """
    call = bind(
        q, k, v, mask=mask, bias=bias, score=score, scale=scale, dropout_rate=dropout_rate,
        dropout_key=dropout_key, return_lse=return_lse, fn="attention_reference",
    )  # fmt: skip
    return run_reference(call)


def attention_weights(q, k, *, mask=None, bias=None, score="dot", scale=None):
    """The attention weights α ``[..., N, T, S]`` (fp32), each allowed row summing to 1.

    Arguments as in ``attention``. Rows with no allowed key are all zeros.

    Example:
        >>> q = k = jnp.eye(3)[:, None, :]          # [T=3, N=1, H=3]
        >>> a = attention_weights(q, k, mask=masks_lib.causal())
        >>> a.shape, a[0, 0].tolist()
        ((1, 3, 3), [1.0, 0.0, 0.0])
    """
    return weights_lse(bind(q, k, None, mask=mask, bias=bias, score=score, scale=scale, fn="attention_weights"))[0]


def attention(
    q,
    k,
    v,
    *,
    mask=None,
    bias=None,
    score="dot",
    scale=None,
    implementation=None,
    dropout_rate=0.0,
    dropout_key=None,
    return_lse=False,
):
    """Attention ``softmax(score(q, k) + bias | mask) v`` over any leading batch dims.

    Args:
        q: ``[..., T, N, H]`` queries.
        k: ``[..., S, K, H]`` keys; N % K == 0 (K < N is GQA, K == 1 is MQA).
        v: ``[..., S, K, Hv]`` values.
        mask: an ``attnlab.masks`` object (``causal()``, ``window(l, r)``, ``padding(...)``,
            ``graph(adj)``, combined with ``&``/``|``) or a bool array broadcastable to
            ``[..., N, T, S]``; True = attend.
        bias: float array broadcastable to ``[..., N, T, S]`` added to the logits.
        score: ``"dot"`` (scaled dot product), a score object (``scores.Dot(scale)``,
            ``scores.Additive(w)``) or any callable ``score(q, k) -> [..., N, T, S]``, e.g.
            ``functools.partial(attnlab.scores.additive, w=w)``.
        scale: logit scale for ``score="dot"``; default ``1/sqrt(H)``.
        implementation: ``None`` (choose), a name, or a sequence of names (the first that supports
            the call wins): ``"reference"`` (dense, fp32), ``"xla"`` (``jax.nn.dot_product_attention``;
            dot score, Hv == H), ``"blockwise"`` (``attnlab.kernels.blockwise_attention``: flash-style,
            skips empty mask tiles, O(T + S) memory; dot score; bias None or a callable of positions),
            ``"sparse"`` (``attnlab.kernels.sparse_attention``: segment softmax over a
            ``masks.graph_edges`` edge list, O(E)), ``"cudnn"`` (cuDNN's fused kernel on a GPU:
            bf16/fp16, causal / left-window / padding masks), ``"pallas"`` (GPU) and ``"splash"``
            (TPU) when their modules are present. ``None`` takes the first in
            ``attnlab.dispatch.ORDER[backend]`` that supports the call and pays off there; on CPU:

            1. ``"sparse"`` for a ``masks.graph_edges`` mask (with no bias and a dot/additive score);
            2. ``"blockwise"`` for the dot score when the bias is None or callable and either the
               mask's block layout has an EMPTY tile (window, causal, block-sparse graph, also with
               traced padding lengths) or there are at least ``BLOCKWISE_MIN_PAIRS`` = 512 x 512 pairs
               (below that, only when its non-empty tiles cover at most ``BLOCKWISE_MAX_VISITED`` = half
               the pairs, or with fewer key heads than query heads from ``BLOCKWISE_GQA_MIN_PAIRS`` =
               256 x 256 pairs: dense XLA measured faster forward+backward elsewhere);
            3. ``"xla"`` for the dot score with Hv == H (small dense cases);
            4. ``"reference"`` otherwise.

            ``attnlab.explain(q, k, v, ...)`` shows the choice and the reasons, for any backend.
            With dropout or ``return_lse``, only implementations that draw dropout / return the lse
            are candidates ("reference" and "blockwise").
        dropout_rate: attention dropout on the weights (``"reference"`` and ``"blockwise"``), see
            ``attention_reference``; the same key gives the same mask on both.
        dropout_key: a ``jax.random`` key, required when ``dropout_rate > 0``.
        return_lse: also return the rows' log-sum-exp, fp32 ``[..., T, N]`` (-inf on empty rows),
            differentiable (``"reference"`` and ``"blockwise"``).

    Returns:
        ``[..., T, N, Hv]`` in q's dtype, or ``(out, lse)`` with ``return_lse``. Softmax is computed
        in fp32 for every input dtype.

    Raises:
        ValueError: bad shapes or dtypes of q/k/v, N not divisible by K, a mask or bias that does
            not broadcast to ``[..., N, T, S]``, a non-bool mask array, an unknown implementation
            or one that does not support the call (the message says why).

    Example:
        >>> q = k = v = jnp.ones((2, 5, 4, 8))           # [B, T, N, H]
        >>> attention(q, k, v, mask=masks_lib.causal()).shape
        (2, 5, 4, 8)
    """
    call = bind(
        q, k, v, mask=mask, bias=bias, score=score, scale=scale, dropout_rate=dropout_rate,
        dropout_key=dropout_key, return_lse=return_lse, fn="attention",
    )  # fmt: skip
    return dispatch.choose(call, implementation=implementation).run(call)
