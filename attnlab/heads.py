"""Multi-head attention on a params pytree: the matrix form Q = X Wq, K = X Wk, V = X Wv.

The course note's matrix form, with heads (Vaswani et al. 2017, arXiv 1706.03762, sec. 3.2.2):

    Q = X_q Wq + bq        [..., T, D] @ [D, N*H]   -> split into N heads [..., T, N, H]
    K = X_kv Wk + bk       [..., S, Dkv] @ [Dkv, K*H] -> [..., S, K, H]
    V = X_kv Wv + bv       [..., S, Dkv] @ [Dkv, K*Hv] -> [..., S, K, Hv]
    O = attention(Q, K, V)                              [..., T, N, Hv]
    Y = merge(O) Wo + bo   [..., T, N*Hv] @ [N*Hv, D]   -> [..., T, D]

Weights are stored per head (``wq`` ``[D, N, H]``, ``wo`` ``[N, Hv, D]``, as flax's
``DenseGeneral``), so the head counts can be read off the shapes; ``wq.reshape(D, N*H)`` is the
note's single matrix Wq.

Legend: D model dim, Dkv source dim (cross-attention), N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attnlab import scores as scores_lib
from attnlab.attention import attention, attention_weights

__all__ = [
    "split_heads",
    "merge_heads",
    "init_multi_head_params",
    "resolve_score",
    "project_qkv",
    "multi_head_attention",
]


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    """``[..., T, N*H] -> [..., T, N, H]``.

    Example:
        >>> split_heads(jnp.arange(6.0).reshape(1, 6), 2).tolist()
        [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]]
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"split_heads: num_heads must be a positive int, got {num_heads!r}")
    if not hasattr(x, "ndim") or x.ndim < 2:
        raise ValueError(f"split_heads: x must have shape [..., T, N*H], got {getattr(x, 'shape', x)}")
    if x.shape[-1] % num_heads:
        raise ValueError(
            f"split_heads: last dim of x ({x.shape[-1]}) must be divisible by "
            f"num_heads={num_heads}; x has shape {x.shape}"
        )
    return x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads)


def merge_heads(x: jax.Array) -> jax.Array:
    """``[..., T, N, H] -> [..., T, N*H]``, the inverse of ``split_heads``."""
    if not hasattr(x, "ndim") or x.ndim < 3:
        raise ValueError(f"merge_heads: x must have shape [..., T, N, H], got {getattr(x, 'shape', x)}")
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"init_multi_head_params: {name} must be a positive int, got {value!r}")
    return value


def init_multi_head_params(
    key,
    d_model,
    num_heads,
    *,
    num_kv_heads=None,
    head_dim=None,
    kv_dim=None,
    use_bias=True,
    score="dot",
    dtype=jnp.float32,
):
    """Initial parameters for ``multi_head_attention`` (LeCun-normal weights, zero biases).

    Args:
        key: a ``jax.random`` key.
        d_model: D, width of the query input and of the output.
        num_heads: N query heads.
        num_kv_heads: K key/value heads (default N); N % K == 0. K == 1 is multi-query attention.
        head_dim: H (default D // N).
        kv_dim: Dkv, width of the key/value input for cross-attention (default D).
        use_bias: include ``bq, bk, bv, bo``.
        score: ``"dot"``, ``"additive"`` (adds ``w_score`` ``[N, H]`` for the tanh score), or an
            ``attnlab.scores.Score`` object such as ``scores.Dot(scale)`` or ``scores.Additive(w)``,
            which carries its own weights (no ``w_score`` is added).
        dtype: parameter dtype.

    Returns:
        dict with ``wq [D, N, H]``, ``wk [Dkv, K, H]``, ``wv [Dkv, K, H]``, ``wo [N, H, D]`` and,
        when requested, ``bq [N, H]``, ``bk [K, H]``, ``bv [K, H]``, ``bo [D]``, ``w_score [N, H]``.

    Example:
        >>> p = init_multi_head_params(jax.random.key(0), 16, 4, num_kv_heads=2)
        >>> p["wq"].shape, p["wk"].shape, p["wo"].shape
        ((16, 4, 4), (16, 2, 4), (4, 4, 16))
    """
    d = _positive("d_model", d_model)
    n = _positive("num_heads", num_heads)
    kh = _positive("num_kv_heads", n if num_kv_heads is None else num_kv_heads)
    if n % kh:
        raise ValueError(f"init_multi_head_params: num_heads={n} must be a multiple of num_kv_heads={kh}")
    if head_dim is None:
        if d % n:
            raise ValueError(
                f"init_multi_head_params: d_model={d} is not divisible by num_heads={n}; pass head_dim explicitly"
            )
        head_dim = d // n
    h = _positive("head_dim", head_dim)
    dkv = _positive("kv_dim", d if kv_dim is None else kv_dim)
    if isinstance(score, str) and score not in ("dot", "additive"):
        raise ValueError(f"init_multi_head_params: score must be 'dot' or 'additive', got {score!r}")
    if not isinstance(score, (str, scores_lib.Score)):
        raise ValueError(
            "init_multi_head_params: score must be 'dot', 'additive' or an attnlab.scores.Score "
            f"(e.g. scores.Additive(w)), got {type(score).__name__}"
        )

    kq, kk, kv, ko, ks = jax.random.split(key, 5)

    def lecun(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    params = {
        "wq": lecun(kq, (d, n, h), d),
        "wk": lecun(kk, (dkv, kh, h), dkv),
        "wv": lecun(kv, (dkv, kh, h), dkv),
        "wo": lecun(ko, (n, h, d), n * h),
    }
    if use_bias:
        params |= {
            "bq": jnp.zeros((n, h), dtype),
            "bk": jnp.zeros((kh, h), dtype),
            "bv": jnp.zeros((kh, h), dtype),
            "bo": jnp.zeros((d,), dtype),
        }
    if isinstance(score, str) and score == "additive":
        params["w_score"] = lecun(ks, (n, h), h)
    return params


def resolve_score(score, params):
    """The score ``multi_head_attention`` computes with these params.

    The string ``"additive"`` becomes ``scores.Additive(params["w_score"])`` (the one place it does);
    ``"dot"``, a score object or a callable is returned as given (``attnlab.attention`` takes them).

    Raises:
        ValueError: ``"additive"`` and params without ``w_score``.

    Example:
        >>> p = init_multi_head_params(jax.random.key(0), 8, 2, score="additive")
        >>> type(resolve_score("additive", p)).__name__, resolve_score("dot", p)
        ('Additive', 'dot')
    """
    if not (isinstance(score, str) and score == "additive"):
        return score  # "dot", a score object or a callable: attnlab.attention resolves it
    if "w_score" not in params:
        raise ValueError(
            "multi_head_attention: score='additive' needs params['w_score'] [N, H]; "
            "create params with init_multi_head_params(..., score='additive') or pass score=scores.Additive(w)"
        )
    return scores_lib.Additive(params["w_score"])


def _check_param(params, name, legend):
    w = params.get(name) if hasattr(params, "get") else None
    if w is None or not hasattr(w, "shape") or len(w.shape) != 3:
        got = "missing" if w is None else f"shape {getattr(w, 'shape', type(w).__name__)}"
        raise ValueError(f"multi_head_attention: params['{name}'] must have shape {legend}, got {got}")
    return w


def _project(x, w, b, name):
    # [..., T, Din] @ [Din, M*H] -> [..., T, M*H] -> split -> [..., T, M, H]
    din, m, h = w.shape
    if x.shape[-1] != din:
        raise ValueError(
            f"multi_head_attention: {name} has width {x.shape[-1]} but params expect {din} (input shape {x.shape})"
        )
    y = x @ w.reshape(din, m * h)
    if b is not None:
        y = y + b.reshape(m * h)
    return split_heads(y, m)


def project_qkv(params, x_q, x_kv=None):
    """The matrix form's projections: ``Q = X_q Wq + bq``, ``K = X_kv Wk + bk``, ``V = X_kv Wv + bv``, per head.

    Args:
        params: ``wq [D, N, H]``, ``wk [Dkv, K, H]``, ``wv [Dkv, K, Hv]`` and optional ``bq, bk, bv``.
        x_q: ``[..., T, D]``.
        x_kv: ``[..., S, Dkv]``; default ``x_q``.

    Returns:
        ``(q [..., T, N, H], k [..., S, K, H], v [..., S, K, Hv])``.

    Raises:
        ValueError: an input's width does not match its weight.

    Example:
        >>> p = init_multi_head_params(jax.random.key(0), 16, 4, num_kv_heads=2)
        >>> [a.shape for a in project_qkv(p, jnp.ones((7, 16)))]
        [(7, 4, 4), (7, 2, 4), (7, 2, 4)]
    """
    x_kv = x_q if x_kv is None else x_kv
    q = _project(x_q, params["wq"], params.get("bq"), "x_q")  # [..., T, N, H]
    k = _project(x_kv, params["wk"], params.get("bk"), "x_kv")  # [..., S, K, H]
    v = _project(x_kv, params["wv"], params.get("bv"), "x_kv")  # [..., S, K, Hv]
    return q, k, v


def multi_head_attention(
    params,
    x_q,
    x_kv=None,
    *,
    mask=None,
    bias=None,
    score="dot",
    scale=None,
    implementation=None,
    return_weights=False,
    attention_fn=None,
    rotary=None,
):
    """Multi-head self-attention (``x_kv=None``) or cross-attention on a params pytree.

    Args:
        params: from ``init_multi_head_params`` (or any dict of the same shapes).
        x_q: ``[..., T, D]`` the sequence that asks.
        x_kv: ``[..., S, Dkv]`` the sequence attended to; default ``x_q`` (self-attention).
        mask, bias, scale, implementation: as ``attnlab.attention``.
        score: ``"dot"``, ``"additive"`` (``scores.Additive(params["w_score"])``), a score object
            (``scores.Dot(scale)``, ``scores.Additive(w)``) or a callable ``score(q, k)``.
        return_weights: also return the attention weights ``[..., N, T, S]`` (fp32).
        attention_fn: optional ``(q, k, v) -> [..., T, N, Hv]`` used instead of ``attnlab.attention``
            (e.g. ``functools.partial(attnlab.efficient.linear_attention, kv_lengths=lengths)``);
            then mask, bias and return_weights must be left unset (the function owns its masking).
        rotary: None, or a function ``[..., T, N, H] -> [..., T, N, H]`` applied to the projected
            queries and keys before the scores, e.g. ``attnlab.positional.rope`` (RoPE).

    Returns:
        ``[..., T, D]`` (and the weights when asked).

    Example:
        >>> p = init_multi_head_params(jax.random.key(0), 16, 4)
        >>> x = jnp.ones((2, 7, 16))                 # [B, T, D]
        >>> multi_head_attention(p, x).shape
        (2, 7, 16)
    """
    for name, x in (("x_q", x_q), ("x_kv", x_kv)):
        if x is not None and (not hasattr(x, "ndim") or x.ndim < 2):
            raise ValueError(
                f"multi_head_attention: {name} must have shape [..., T, D], got {getattr(x, 'shape', type(x).__name__)}"
            )
    x_kv = x_q if x_kv is None else x_kv
    if x_q.shape[:-2] != x_kv.shape[:-2]:
        raise ValueError(f"multi_head_attention: x_q {x_q.shape} and x_kv {x_kv.shape} must have the same batch dims")
    wq = _check_param(params, "wq", "[D, N, H]")
    wv = _check_param(params, "wv", "[Dkv, K, Hv]")
    _check_param(params, "wk", "[Dkv, K, H]")
    wo = _check_param(params, "wo", "[N, Hv, D]")
    if wo.shape[:2] != (wq.shape[1], wv.shape[2]):
        raise ValueError(
            f"multi_head_attention: params['wo'] must have shape [N, Hv, D] = [{wq.shape[1]}, {wv.shape[2]}, D] "
            f"(N from wq {wq.shape}, Hv from wv {wv.shape}), got {wo.shape}"
        )
    q, k, v = project_qkv(params, x_q, x_kv)  # [..., T, N, H], [..., S, K, H], [..., S, K, Hv]
    if rotary is not None:
        q, k = rotary(q), rotary(k)  # e.g. RoPE: rotate q and k by their positions
    score = resolve_score(score, params)
    if attention_fn is not None:
        if mask is not None or bias is not None or return_weights:
            raise ValueError(
                "multi_head_attention: with attention_fn, mask, bias and return_weights must be unset "
                "(pass masking to the attention function itself)"
            )
        o = attention_fn(q, k, v)  # [..., T, N, Hv]
    else:
        o = attention(
            q, k, v, mask=mask, bias=bias, score=score, scale=scale, implementation=implementation
        )  # [..., T, N, Hv]
    n, hv, d = wo.shape
    y = merge_heads(o) @ wo.reshape(n * hv, d)  # [..., T, N*Hv] @ [N*Hv, D] -> [..., T, D]
    if params.get("bo") is not None:
        y = y + params["bo"]
    if return_weights:
        return y, attention_weights(q, k, mask=mask, bias=bias, score=score, scale=scale)
    return y
