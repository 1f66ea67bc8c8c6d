"""Per-head statistics of attention weights: ``summarise`` (entropy, distance, mass on offsets, the
diagonal, the first token, graph edges) and ``offset_profile`` (how well a head is described by the
relative offset alone: the convolution-like heads).

Both average over the counted query rows of a batch: a row counts when it has any nonzero weight (an
empty row, e.g. a padded query or a query with nothing to attend to, is all zeros) and, with
``lengths``, when its query is real. Legend: N heads, T query rows, S keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["offset_profile", "summarise"]


def _rows(weights, rows, lengths, fn: str):
    """The checked weights fp32 ``[..., N, T, S]``, the batch shape, the query positions ``[T]``, the
    counted rows bool ``[..., N, T]`` and the real keys bool ``[..., S]`` (all True without lengths)."""
    if not hasattr(weights, "ndim") or weights.ndim < 3:
        raise ValueError(
            f"{fn}: weights must be [..., N, T, S], got {getattr(weights, 'shape', type(weights).__name__)}"
        )
    w = jnp.asarray(weights).astype(jnp.float32)
    *lead, _, t, s = w.shape
    lead = tuple(lead)
    pos = jnp.arange(t) if rows is None else jnp.asarray(rows)
    if pos.shape != (t,):
        raise ValueError(f"{fn}: rows must be [T] = [{t}] query positions, got shape {pos.shape}")
    valid = jnp.any(w != 0, axis=-1)  # [..., N, T]
    real_keys = jnp.ones((*lead, s), bool)
    if lengths is not None:
        lengths = jnp.asarray(lengths)
        if lengths.shape != lead:
            raise ValueError(f"{fn}: lengths must have the batch shape {list(lead)}, got {lengths.shape}")
        valid = valid & (pos < lengths[..., None])[..., None, :]
        real_keys = jnp.arange(s) < lengths[..., None]
    return w, lead, pos, valid, real_keys


def _mean_over_rows(valid, lead):
    """``per_row [..., N, T] -> [N]``: the mean over the counted rows (0 where a head has none)."""
    axes = tuple(range(len(lead))) + (-1,)
    count = valid.sum(axes).astype(jnp.float32)  # [N]

    def mean(per_row):
        return jnp.where(valid, per_row, 0.0).sum(axes) / jnp.maximum(count, 1.0)

    return mean, count


def summarise(
    weights,
    *,
    offsets: Sequence[int] = (-1, 0, 1),
    rows=None,
    lengths=None,
    adjacency=None,
) -> dict[str, jax.Array]:
    """Per-head statistics of attention weights, averaged over the counted query rows of a batch.

    Args:
        weights: ``[..., N, T, S]`` (``LayerCapture.weights``; dense or the rows of ``rows``).
        offsets: the relative offsets d for ``offset_mass`` (the weight on key t + d).
        rows: the query positions of the T rows (a rows capture's ``rows``); default ``0 .. T-1``.
        lengths: int ``[...]`` real lengths per example: queries at or past them are left out, and
            keys past them are not real (``uniform_entropy``).
        adjacency: bool ``[..., T, S]`` graph edges (True = edge; the same rows as ``weights``) for
            ``edge_mass`` / ``non_edge_mass``.

    Returns:
        dict of fp32 arrays: ``entropy [N]`` (nats), ``uniform_entropy [N]`` (the entropy of uniform
        attention over each counted row's real keys: log S, or log of the example's length),
        ``distance [N]`` (mean ``Σ_s w[t, s] |s - t|``), ``offset_mass [N, len(offsets)]``, ``diagonal
        [N]`` (weight on s = t), ``first [N]`` (on s = 0), ``rows [N]`` (rows counted) and with
        ``adjacency`` ``edge_mass [N]`` and ``non_edge_mass [N]``.

    Raises:
        ValueError: weights not ``[..., N, T, S]``, or ``rows`` / ``lengths`` / ``adjacency`` whose
            shapes do not fit them (the message names the argument).

    Example:
        >>> w = jnp.eye(3)[None]                          # one head attending to itself
        >>> s = summarise(w, offsets=(0,))
        >>> {k: round(float(v[0]), 4) for k, v in s.items() if k != "offset_mass"}
        {'entropy': 0.0, 'uniform_entropy': 1.0986, 'distance': 0.0, 'diagonal': 1.0, 'first': 0.3333, 'rows': 3.0}
    """
    fn = "inspect.summarise"
    w, lead, pos, valid, real_keys = _rows(weights, rows, lengths, fn)
    *_, n, t, s = w.shape
    try:
        offsets = tuple(int(d) for d in offsets)
    except TypeError:
        raise ValueError(f"{fn}: offsets must be a sequence of ints, got {offsets!r}") from None
    mean, count = _mean_over_rows(valid, lead)
    keys = jnp.arange(s)
    plogp = jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)), 0.0)
    dist = jnp.abs(keys[None, :] - pos[:, None]).astype(jnp.float32)  # [T, S]
    at = keys[None, :] - pos[:, None]  # [T, S]: the offset s - t of each pair
    n_keys = real_keys.sum(-1).astype(jnp.float32)[..., None, None]  # [..., 1, 1]
    out = {
        "entropy": mean(-plogp.sum(-1)),
        "uniform_entropy": mean(jnp.broadcast_to(jnp.log(jnp.maximum(n_keys, 1.0)), valid.shape)),
        "distance": mean((w * dist).sum(-1)),
        "offset_mass": jnp.stack([mean((w * (at == d)).sum(-1)) for d in offsets], axis=-1)
        if offsets
        else jnp.zeros((n, 0)),
        "diagonal": mean((w * (at == 0)).sum(-1)),
        "first": mean(w[..., 0]),
        "rows": count,
    }
    if adjacency is not None:
        adj = jnp.asarray(adjacency)
        if adj.shape != (*lead, t, s) or adj.dtype != bool:
            raise ValueError(
                f"{fn}: adjacency must be bool [..., T, S] = {[*lead, t, s]}, got {adj.dtype}{list(adj.shape)}"
            )
        a = adj[..., None, :, :]  # [..., 1, T, S]
        out["edge_mass"] = mean(jnp.where(a, w, 0.0).sum(-1))
        out["non_edge_mass"] = mean(jnp.where(a, 0.0, w).sum(-1))
    return out


def offset_profile(weights, *, rows=None, lengths=None) -> dict[str, jax.Array]:
    """How far each head is from a convolution: its mass by relative offset ``d = s - t`` and how well
    a function of ``d`` alone fits its weights.

    Over the counted query rows (as ``summarise``) and their real keys (``s < length``): ``mass[d]``
    is the mean over rows of the weight on key t + d; the best fit by a function of the offset alone
    is each offset's mean weight over its (row, key) pairs, and ``r2_offset`` is that fit's R² (1.0 for
    any convolution-like head, whose weights depend on the offset only; about 0 for weights that
    ignore it; 1.0 too when the weights do not vary at all).

    Args:
        weights: ``[..., N, T, S]``.
        rows: the query positions of the T rows, concrete ints (a rows capture's ``rows``); default
            ``0 .. T-1``.
        lengths: int ``[...]`` real lengths per example.

    Returns:
        dict: ``top_offset`` int32 ``[N]`` (the offset with the most mass, the smallest on a tie, among
        the offsets some counted row has a real key at), ``top_offset_mass [N]`` (its mass; a
        convolution head has 1.0), ``r2_offset [N]``.

    Raises:
        ValueError: as ``summarise``, and ``rows`` that are traced (their range sets the offsets).

    Example:
        >>> w = jnp.eye(4, k=-1)[None]                      # one head on the key to the left (row 0 empty)
        >>> {k: v.tolist() for k, v in offset_profile(w).items()}
        {'top_offset': [-1], 'top_offset_mass': [1.0], 'r2_offset': [1.0]}
    """
    fn = "inspect.offset_profile"
    if rows is not None:
        try:
            rows = np.asarray(rows, np.int64)
        except Exception:  # a traced array
            raise ValueError(f"{fn}: rows must be concrete ints (a capture's rows), not traced") from None
    w, lead, pos, valid, real_keys = _rows(weights, rows, lengths, fn)
    *_, n, t, s = w.shape
    shift = t - 1 if rows is None else int(rows.max())  # offsets run from -shift to S - 1 - min(pos)
    span = shift + s - (0 if rows is None else int(rows.min()))
    ids = (jnp.arange(s)[None, :] - pos[:, None] + shift).reshape(-1)  # [T*S] offset class of each pair
    pairs = (valid[..., :, None] & real_keys[..., None, None, :]).astype(jnp.float32)  # [..., N, T, S]
    flat = lambda x: x.reshape(-1, n, t * s).sum(0)  # noqa: E731  [..., N, T, S] -> [N, T*S], batch summed
    by_offset = lambda x: jax.ops.segment_sum(x.T, ids, num_segments=span).T  # noqa: E731  [N, T*S] -> [N, D]
    total, count = by_offset(flat(w * pairs)), by_offset(flat(pairs))  # [N, D]
    rows_counted = _mean_over_rows(valid, lead)[1]  # [N]
    mass = total / jnp.maximum(rows_counted, 1.0)[:, None]
    top = jnp.argmax(jnp.where(count > 0, mass, -1.0), axis=-1)  # [N]
    fit = jnp.take_along_axis(total / jnp.maximum(count, 1.0), jnp.broadcast_to(ids, (n, t * s)), -1)
    fit = fit.reshape(n, t, s)  # the offset-only fit of each pair
    resid = ((w - fit) ** 2 * pairs).sum(tuple(range(len(lead))) + (-2, -1))
    w_mean = (w * pairs).sum(tuple(range(len(lead))) + (-2, -1)) / jnp.maximum(
        pairs.sum(tuple(range(len(lead))) + (-2, -1)), 1.0
    )
    total_var = ((w - w_mean[:, None, None]) ** 2 * pairs).sum(tuple(range(len(lead))) + (-2, -1))
    return {
        "top_offset": (top - shift).astype(jnp.int32),
        "top_offset_mass": jnp.take_along_axis(mass, top[:, None], -1)[:, 0],
        "r2_offset": 1.0 - resid / jnp.maximum(total_var, 1e-30),
    }
