"""The checks every fused dot-product kernel's ``supports(...)`` starts with (Pallas, splash)."""

from __future__ import annotations

import jax.numpy as jnp


def dot_call_reason(kernel: str, q, k, v, *, score, bias, dtypes, bias_hint: str = "") -> str | None:
    """None when ``q, k, v`` are a dot-product call ``kernel`` can take, else why not (shapes only).

    Checks: the dot score, no bias, each of q/k/v in ``dtypes``, ranks ``[..., T, N, H]``,
    ``[..., S, K, H]``, ``[..., S, K, Hv]``, and N a multiple of K.
    """
    if not (getattr(score, "is_dot", False) or (isinstance(score, str) and score in ("dot", "dot_product"))):
        return f"{kernel}: dot-product score only"
    if bias is not None:
        return f"{kernel}: no bias{bias_hint}"
    names = [jnp.dtype(d).name for d in dtypes]
    wanted = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in dtypes:
            return f"{kernel}: {name} dtype {jnp.dtype(x.dtype).name} (needs {wanted})"
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        return f"{kernel}: q, k, v must be [..., T, N, H], [..., S, K, H], [..., S, K, Hv]"
    N, K = q.shape[-2], k.shape[-2]
    if K == 0 or N % K:
        return f"{kernel}: N={N} query heads must be a multiple of K={K} kv heads"
    return None
