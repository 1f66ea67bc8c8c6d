"""Cutting attention's cost with O(N) methods: linear attention, Performer (FAVOR+), Linformer.

The course note ends by asking how to reduce the O(N^2) cost of attention. Besides skipping work
with sparse masks (``attnlab.masks``: window, chunks, dilated, global, BigBird), three families
change the computation itself:

* **linear attention** (Katharopoulos et al. 2020, arXiv 2006.16236): replace exp(q·k) by
  φ(q)·φ(k) with φ(x) = elu(x) + 1; then ``Σ_s φ(q_t)·φ(k_s) v_s = φ(q_t) · (Σ_s φ(k_s) v_s^T)``
  costs O(N) and, causally, is a prefix sum (computed chunk by chunk);
* **Performer FAVOR+** (Choromanski et al. 2020, arXiv 2009.14794): positive orthogonal random
  features whose dot product is an unbiased estimate of exp(q·k / sqrt(H)), so softmax attention
  itself is approximated; more features, less error;
* **Linformer** (Wang et al. 2020, arXiv 2006.04768): project keys and values along the sequence
  to a fixed length P with learned matrices E, F ``[P, S]``, then attend over P positions.

Every method has a dense reference computing the same quantity the O(N^2) way; tests compare them.
Layout as everywhere in attnlab: q ``[..., T, N, H]``, k ``[..., S, K, H]``, v ``[..., S, K, Hv]``,
N % K == 0 (query head n uses kv head n // (N/K)). Computation in fp32, output in q's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from attnlab import scores
from attnlab.attention import attention_reference, attention_weights

__all__ = [
    "elu_plus_one",
    "linear_attention",
    "linear_attention_reference",
    "performer_projection",
    "favor_features",
    "performer_attention",
    "init_linformer",
    "linformer_attention",
    "linear_attention_weights",
    "performer_attention_weights",
    "linformer_attention_weights",
]


def elu_plus_one(x: jax.Array) -> jax.Array:
    """The feature map of Katharopoulos et al.: elu(x) + 1 > 0."""
    return jax.nn.elu(x) + 1.0


def _check(q, k, v, kv_lengths, causal, fn):
    scores.check_qk(q, k, fn=fn)
    if not hasattr(v, "shape") or v.shape[:-1] != k.shape[:-1]:
        raise ValueError(
            f"{fn}: v must have shape [..., S, K, Hv] matching k {k.shape}, got {getattr(v, 'shape', type(v).__name__)}"
        )
    if causal and q.shape[-3] != k.shape[-3]:
        raise ValueError(f"{fn}: causal needs T == S, got q {q.shape} and k {k.shape}")
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths)
        if kv_lengths.shape != q.shape[:-3]:
            raise ValueError(f"{fn}: kv_lengths must have the batch shape {q.shape[:-3]}, got {kv_lengths.shape}")
    return kv_lengths


def _key_valid(k, kv_lengths):
    """[..., S, 1, 1] fp32: 1 for real keys, 0 for padding."""
    if kv_lengths is None:
        return None
    s = jnp.arange(k.shape[-3])
    return (s < kv_lengths[..., None]).astype(jnp.float32)[..., None, None]


def _group(x, kh):
    # [..., T, N, F] -> [..., T, K, G, F]
    return x.reshape(*x.shape[:-2], kh, x.shape[-2] // kh, x.shape[-1])


def _linear_core(phi_q, phi_k, v, *, causal, chunk_size, eps):
    """O(N) attention with positive features. phi_q [..., T, N, F], phi_k [..., S, K, F], v [..., S, K, Hv]."""
    kh = phi_k.shape[-2]
    qg = _group(phi_q, kh)  # [..., T, K, G, F]
    v = v.astype(jnp.float32)
    if not causal:
        kv = jnp.einsum("...SKF,...SKH->...KFH", phi_k, v)  # Σ_s φ(k_s) v_s^T
        z = jnp.sum(phi_k, axis=-3)  # Σ_s φ(k_s): [..., K, F]
        num = jnp.einsum("...TKGF,...KFH->...TKGH", qg, kv)
        den = jnp.einsum("...TKGF,...KF->...TKG", qg, z)[..., None]
        out = num / (den + eps)
        return out.reshape(*out.shape[:-3], -1, out.shape[-1])  # [..., T, K, G, Hv] -> [..., T, N, Hv]

    # Causal: a prefix sum over positions, chunk by chunk. Inside a chunk the C x C masked product
    # is computed directly; across chunks a running state (Σ φ(k) v^T, Σ φ(k)) is carried by lax.scan.
    t = qg.shape[-4]
    c = min(chunk_size, t)
    pad = (-t) % c
    lead = qg.shape[:-4]

    def chunked(x, axis):  # [..., T, ...] -> [T/C, ..., C, ...] (chunk axis first, for scan)
        x = jnp.pad(x, [(0, 0)] * (axis % x.ndim) + [(0, pad)] + [(0, 0)] * (x.ndim - axis % x.ndim - 1))
        shape = x.shape[: axis % x.ndim] + ((t + pad) // c, c) + x.shape[axis % x.ndim + 1 :]
        return jnp.moveaxis(x.reshape(shape), axis % x.ndim, 0)

    qc, kc, vc = chunked(qg, -4), chunked(phi_k, -3), chunked(v, -3)
    tril = jnp.tril(jnp.ones((c, c), bool))

    def step(carry, xs):
        state, z = carry  # [..., K, F, Hv], [..., K, F]
        q_, k_, v_ = xs  # [..., C, K, G, F], [..., C, K, F], [..., C, K, Hv]
        scores_ = jnp.einsum("...TKGF,...SKF->...KGTS", q_, k_) * tril  # within the chunk, s <= t
        num = jnp.einsum("...KGTS,...SKH->...TKGH", scores_, v_) + jnp.einsum("...TKGF,...KFH->...TKGH", q_, state)
        den = jnp.sum(scores_, axis=-1) + jnp.einsum("...TKGF,...KF->...KGT", q_, z)  # [..., K, G, T]
        out = num / (jnp.moveaxis(den, -1, -3)[..., None] + eps)  # den -> [..., T, K, G, 1]
        state = state + jnp.einsum("...SKF,...SKH->...KFH", k_, v_)
        z = z + jnp.sum(k_, axis=-3)
        return (state, z), out

    f, hv = phi_k.shape[-1], v.shape[-1]
    init = (jnp.zeros((*lead, kh, f, hv), jnp.float32), jnp.zeros((*lead, kh, f), jnp.float32))
    _, out = jax.lax.scan(step, init, (qc, kc, vc))  # [T/C, ..., C, K, G, Hv]
    out = jnp.moveaxis(out, 0, -5)  # -> [..., T/C, C, K, G, Hv]
    out = out.reshape(*lead, t + pad, -1, hv)[..., :t, :, :]  # -> [..., T, N, Hv]
    return out


def linear_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    kv_lengths=None,
    feature_map: Callable[[jax.Array], jax.Array] = elu_plus_one,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> jax.Array:
    """Linear attention: ``out_t = Σ_s φ(q_t)·φ(k_s) v_s / Σ_s φ(q_t)·φ(k_s)`` in O(N) time and memory.

    Args:
        q: ``[..., T, N, H]``; k: ``[..., S, K, H]``; v: ``[..., S, K, Hv]``.
        causal: only keys s <= t (needs T == S); computed as a chunked prefix sum.
        kv_lengths: int ``[...]`` valid keys per example (padding beyond is ignored).
        feature_map: a positive map φ applied to q and k (default elu + 1).
        chunk_size: chunk length C of the causal prefix sum (work O(N C), state per chunk).
        eps: added to the normaliser.

    Returns:
        ``[..., T, N, Hv]`` in q's dtype.

    Example:
        >>> q = k = v = jnp.ones((8, 2, 4))
        >>> linear_attention(q, k, v, causal=True).shape
        (8, 2, 4)
    """
    kv_lengths = _check(q, k, v, kv_lengths, causal, "linear_attention")
    phi_q = feature_map(q.astype(jnp.float32))
    phi_k = feature_map(k.astype(jnp.float32))
    valid = _key_valid(k, kv_lengths)
    if valid is not None:
        phi_k = phi_k * valid
    out = _linear_core(phi_q, phi_k, v, causal=causal, chunk_size=chunk_size, eps=eps)
    return out.astype(q.dtype)


def linear_attention_reference(
    q, k, v, *, causal=False, kv_lengths=None, feature_map=elu_plus_one, eps: float = 1e-6
) -> jax.Array:
    """The same quantity the O(N^2) way: weights ``φ(q_t)·φ(k_s)``, masked, normalised per row."""
    kv_lengths = _check(q, k, v, kv_lengths, causal, "linear_attention_reference")
    kh = k.shape[-2]
    phi_q = _group(feature_map(q.astype(jnp.float32)), kh)  # [..., T, K, G, F]
    phi_k = feature_map(k.astype(jnp.float32))
    w = jnp.einsum("...TKGF,...SKF->...KGTS", phi_q, phi_k)
    t, s = q.shape[-3], k.shape[-3]
    if causal:
        w = w * jnp.tril(jnp.ones((t, s)))
    if kv_lengths is not None:
        w = w * (jnp.arange(s) < kv_lengths[..., None])[..., None, None, None, :]
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + eps)
    out = jnp.einsum("...KGTS,...SKH->...TKGH", w, v.astype(jnp.float32))
    return out.reshape(*out.shape[:-3], -1, out.shape[-1]).astype(q.dtype)


# ------------------------------------------------------------------------------------------
# Performer (FAVOR+)


def performer_projection(key, num_features: int, head_dim: int, *, orthogonal: bool = True) -> jax.Array:
    """Random feature directions ``[M, H]``: Gaussian rows, made orthogonal in blocks of H (lower variance).

    Orthogonal rows are rescaled by the norms of independent Gaussian vectors, so each row has the
    same distribution as a Gaussian row (Choromanski et al., sec. 4). Redraw with a new key.
    """
    if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features <= 0:
        raise ValueError(f"performer_projection: num_features must be a positive int, got {num_features!r}")
    kg, kn = jax.random.split(key)
    if not orthogonal:
        return jax.random.normal(kg, (num_features, head_dim), jnp.float32)
    blocks = -(-num_features // head_dim)
    g = jax.random.normal(kg, (blocks, head_dim, head_dim), jnp.float32)
    qmat, _ = jnp.linalg.qr(g)  # orthonormal columns per block
    rows = jnp.swapaxes(qmat, -1, -2).reshape(-1, head_dim)[:num_features]  # [M, H]
    norms = jnp.linalg.norm(jax.random.normal(kn, (num_features, head_dim), jnp.float32), axis=-1)
    return rows * norms[:, None]


def favor_features(x: jax.Array, projection: jax.Array, *, is_query: bool) -> jax.Array:
    """Positive random features ``φ(x) = exp(w·x' - |x'|^2 / 2 - c) / sqrt(M)`` with x' = x / H^(1/4).

    E[φ(q)·φ(k)] = exp(q·k / sqrt(H)) * exp(-c_q - c_k). The stabiliser c is a per-row max for
    queries and one max over all keys; both cancel in attention's normalisation.

    Args:
        x: ``[..., L, N, H]`` queries or keys. projection: ``[M, H]``.

    Returns:
        fp32 ``[..., L, N, M]``.
    """
    h = x.shape[-1]
    xs = x.astype(jnp.float32) * h**-0.25
    proj = jnp.einsum("...LNH,MH->...LNM", xs, projection)
    sq = 0.5 * jnp.sum(xs**2, axis=-1, keepdims=True)
    axes = -1 if is_query else (-3, -2, -1)  # per query row; one constant over all keys
    c = jax.lax.stop_gradient(jnp.max(proj, axis=axes, keepdims=True))
    return jnp.exp(proj - sq - c) / math.sqrt(projection.shape[0]) + 1e-6


def performer_attention(
    q,
    k,
    v,
    *,
    key=None,
    projection=None,
    num_features: int = 256,
    causal: bool = False,
    kv_lengths=None,
    chunk_size: int = 64,
) -> jax.Array:
    """Softmax attention approximated with FAVOR+ random features, in O(N M) time.

    Approximates ``attention(q, k, v)`` with the default scale 1/sqrt(H). Pass either ``key``
    (draws an orthogonal projection with ``num_features`` rows: redraw by passing a new key) or
    a fixed ``projection`` ``[M, H]``.

    Returns:
        ``[..., T, N, Hv]`` in q's dtype.
    """
    kv_lengths = _check(q, k, v, kv_lengths, causal, "performer_attention")
    if (key is None) == (projection is None):
        raise ValueError("performer_attention: pass exactly one of key (to draw features) or projection [M, H]")
    if projection is None:
        projection = performer_projection(key, num_features, q.shape[-1])
    if projection.ndim != 2 or projection.shape[-1] != q.shape[-1]:
        raise ValueError(f"performer_attention: projection must be [M, H={q.shape[-1]}], got {projection.shape}")
    phi_q = favor_features(q, projection, is_query=True)
    phi_k = favor_features(k, projection, is_query=False)
    valid = _key_valid(k, kv_lengths)
    if valid is not None:
        phi_k = phi_k * valid
    out = _linear_core(phi_q, phi_k, v, causal=causal, chunk_size=chunk_size, eps=1e-12)
    return out.astype(q.dtype)


# ------------------------------------------------------------------------------------------
# Linformer


def init_linformer(key, seq_len: int, proj_len: int) -> dict:
    """Projection matrices ``{"e": [P, S], "f": [P, S]}`` with N(0, 1/P) entries (train them with the model)."""
    for name, val in (("seq_len", seq_len), ("proj_len", proj_len)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"init_linformer: {name} must be a positive int, got {val!r}")
    ke, kf = jax.random.split(key)
    std = 1.0 / math.sqrt(proj_len)
    return {
        "e": std * jax.random.normal(ke, (proj_len, seq_len)),
        "f": std * jax.random.normal(kf, (proj_len, seq_len)),
    }


def linformer_attention(q, k, v, params: dict, *, kv_lengths=None, scale: float | None = None) -> jax.Array:
    """Linformer: ``softmax(q (E k)^T * scale) (F v)``, attending over P projected positions, O(N P).

    Args:
        q: ``[..., T, N, H]``; k: ``[..., S, K, H]``; v: ``[..., S, K, Hv]``.
        params: ``{"e": [P, S], "f": [P, S]}`` from ``init_linformer``.
        kv_lengths: padded keys (beyond the length) are zeroed before projection.
    """
    kv_lengths = _check(q, k, v, kv_lengths, False, "linformer_attention")
    e, f = params["e"], params["f"]
    s = k.shape[-3]
    for name, m in (("e", e), ("f", f)):
        if m.ndim != 2 or m.shape[1] != s:
            raise ValueError(f"linformer_attention: params['{name}'] must be [P, S={s}], got {m.shape}")
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    valid = _key_valid(k, kv_lengths)
    if valid is not None:
        kf, vf = kf * valid, vf * valid
    k_proj = jnp.einsum("PS,...SKH->...PKH", e.astype(jnp.float32), kf)  # [..., P, K, H]
    v_proj = jnp.einsum("PS,...SKH->...PKH", f.astype(jnp.float32), vf)
    return attention_reference(q.astype(jnp.float32), k_proj, v_proj, scale=scale).astype(q.dtype)


# ------------------------------------------------------------------------------------------
# Effective weight matrices: what each O(N) method's output is a weighted sum of


def _feature_weights(phi_q, phi_k, *, causal, kv_lengths, eps):
    """``[..., N, T, S]`` fp32: ``φ(q_t)·φ(k_s) / (Σ_s' φ(q_t)·φ(k_s') + eps)`` over the allowed keys."""
    kh = phi_k.shape[-2]
    w = jnp.einsum("...TKGF,...SKF->...KGTS", _group(phi_q, kh), phi_k)  # [..., K, G, T, S]
    t, s = phi_q.shape[-3], phi_k.shape[-3]
    if causal:
        w = w * jnp.tril(jnp.ones((t, s), jnp.float32))
    if kv_lengths is not None:
        w = w * (jnp.arange(s) < kv_lengths[..., None])[..., None, None, None, :]
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + eps)
    return w.reshape(*w.shape[:-4], -1, t, s)  # [..., K, G, T, S] -> [..., N, T, S]


def linear_attention_weights(
    q, k, *, causal: bool = False, kv_lengths=None, feature_map=elu_plus_one, eps: float = 1e-6
) -> jax.Array:
    """The effective weights of ``linear_attention``: ``out_t = Σ_s w[t, s] v_s`` exactly.

    ``w[t, s] = φ(q_t)·φ(k_s) / (Σ_s' φ(q_t)·φ(k_s') + eps)`` over the allowed keys (s < kv_length,
    s <= t when causal); each row sums to 1 - O(eps). O(T S) memory: pass a few query rows ``q``
    ``[..., R, N, H]`` (``causal=False``) to get those rows only.

    Returns:
        fp32 ``[..., N, T, S]``.

    Example:
        >>> q = k = jnp.ones((3, 1, 2))
        >>> linear_attention_weights(q, k).round(3).tolist()[0][0]
        [0.333, 0.333, 0.333]
    """
    kv_lengths = _check(q, k, k, kv_lengths, causal, "linear_attention_weights")
    phi_q = feature_map(q.astype(jnp.float32))
    phi_k = feature_map(k.astype(jnp.float32))
    return _feature_weights(phi_q, phi_k, causal=causal, kv_lengths=kv_lengths, eps=eps)


def performer_attention_weights(q, k, *, projection, causal: bool = False, kv_lengths=None) -> jax.Array:
    """The effective weights of ``performer_attention`` with a fixed ``projection`` ``[M, H]``.

    ``w[t, s] = φ(q_t)·φ(k_s) / Σ_s' φ(q_t)·φ(k_s')`` with FAVOR+ features (``favor_features``): an
    estimate of softmax attention's weights, and ``out_t = Σ_s w[t, s] v_s`` exactly. The keys'
    stabiliser is one max over all keys, as in the attention, so a subset of query rows ``q``
    ``[..., R, N, H]`` (``causal=False``) gives exactly those rows.

    Returns:
        fp32 ``[..., N, T, S]``.
    """
    kv_lengths = _check(q, k, k, kv_lengths, causal, "performer_attention_weights")
    if not hasattr(projection, "ndim") or projection.ndim != 2 or projection.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"performer_attention_weights: projection must be [M, H={q.shape[-1]}], "
            f"got {getattr(projection, 'shape', projection)}"
        )
    phi_q = favor_features(q, projection, is_query=True)
    phi_k = favor_features(k, projection, is_query=False)
    return _feature_weights(phi_q, phi_k, causal=causal, kv_lengths=kv_lengths, eps=1e-12)


def linformer_attention_weights(q, k, params: dict, *, kv_lengths=None, scale: float | None = None) -> jax.Array:
    """The effective weights of ``linformer_attention`` over the S original positions.

    ``out = softmax(q (E k)^T * scale) (F v) = W v`` with ``W = softmax(q (E k)^T * scale) F``
    (F's columns of padded keys zeroed). W is not a probability distribution: F has signed entries.

    Returns:
        fp32 ``[..., N, T, S]``.
    """
    kv_lengths = _check(q, k, k, kv_lengths, False, "linformer_attention_weights")
    e, f = params["e"], params["f"]
    s = k.shape[-3]
    for name, m in (("e", e), ("f", f)):
        if m.ndim != 2 or m.shape[1] != s:
            raise ValueError(f"linformer_attention_weights: params['{name}'] must be [P, S={s}], got {m.shape}")
    kf = k.astype(jnp.float32)
    valid = _key_valid(k, kv_lengths)
    if valid is not None:
        kf = kf * valid
    k_proj = jnp.einsum("PS,...SKH->...PKH", e.astype(jnp.float32), kf)  # [..., P, K, H]
    a = attention_weights(q.astype(jnp.float32), k_proj, scale=scale)  # softmax over P: [..., N, T, P]
    f = f.astype(jnp.float32)
    if kv_lengths is not None:
        f = f * (jnp.arange(s) < kv_lengths[..., None])[..., None, :]  # padded keys' columns: [..., P, S]
    return jnp.einsum("...NTP,...PS->...NTS", a, f)
