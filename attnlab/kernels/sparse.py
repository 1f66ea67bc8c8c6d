"""Graph attention along an edge list: a segment softmax in O(E) time and memory.

For a graph given as ``masks.graph_edges(senders, receivers, num_nodes)`` (edge e: receiver
``r_e`` = query attends to sender ``s_e`` = key), attention never needs the ``[T, S]`` logits:

1. gather ``q[r_e]`` and ``k[s_e]`` and score each edge and head: ``α'_e`` (the score's edge form: dot,
   additive, soft-capped, a score_mod);
2. softmax over the edges that share a receiver: ``segment_max`` / ``segment_sum`` over ``r``;
3. gather ``v[s_e]``, weight it by ``α_e`` and ``segment_sum`` the messages into the receivers.

This is the message-passing form of graph attention (GAT, Veličković et al. 2017,
arXiv 1710.10903; jraph's ``segment_softmax``). It equals dense attention with
``masks.graph(adjacency)`` on the same graph: an edge listed twice counts once, as in the
adjacency (``_valid_edges`` drops the repeats; PyG's message passing would count it twice).
A node with no incoming edge gets zeros, with zero gradients.

Shape legend: B batch (leading dims), T = S = num_nodes, N query heads, K kv heads, G = N // K,
H head dim, Hv value head dim, E edges.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import masks as masks_lib
from attnlab import platform
from attnlab.call import Call, bind

__all__ = ["sparse_attention", "attend"]


# Edges per chunk of the dot-product path: bounds the gathered [chunk, N, H] temporaries.
EDGE_CHUNK = 32768


def _chunks(senders, receivers, T, S, chunk):
    """Pads the edge list to a multiple of `chunk` -> [nc, chunk] index arrays.

    Padded edges get the out-of-range segment id (T for receivers, S for senders), which
    ``segment_sum``/``segment_max`` drop; gathers use the clipped ids, and their alpha is 0.
    """
    E = senders.shape[0]
    nc = max(1, -(-E // chunk))
    pad = nc * chunk - E
    r_seg = jnp.pad(receivers, (0, pad), constant_values=T).reshape(nc, chunk)
    s_seg = jnp.pad(senders, (0, pad), constant_values=S).reshape(nc, chunk)
    return s_seg, r_seg, jnp.minimum(s_seg, S - 1), jnp.minimum(r_seg, T - 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _dot_graph(q, k, v, senders, receivers, scale, chunk):
    """Dot-product graph attention over edge chunks, with a hand-written chunked backward.

    q [T, K, G, H], k [S, K, H], v [S, K, Hv] (fp32); senders/receivers [E] -> [T, K, G, Hv].
    Memory: O(E * N) for the per-edge logits and weights, O((T + S) * N * H) for inputs and
    gradients, and O(chunk * N * H) for the gathered rows of one chunk: autodiff of the plain
    form would keep q[r], k[s] and v[s] for all E edges at once.
    """
    return _dot_graph_fwd(q, k, v, senders, receivers, scale, chunk)[0]


def _dot_graph_fwd(q, k, v, senders, receivers, scale, chunk):
    T, K, G, _ = q.shape
    S, Hv = k.shape[0], v.shape[-1]
    s_seg, r_seg, s_idx, r_idx = _chunks(senders, receivers, T, S, chunk)
    # pass 1: per-edge logits, one chunk at a time -> [nc, chunk, K, G]
    logits = jax.lax.map(lambda sr: jnp.einsum("ekgh,ekh->ekg", q[sr[1]], k[sr[0]]) * scale, (s_idx, r_idx))
    r_flat = r_seg.reshape(-1)
    logits = logits.reshape(-1, K, G)  # [E', K, G]
    m = jax.ops.segment_max(logits, r_flat, num_segments=T)  # [T, K, G]; -inf where no edge
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    valid = (r_flat < T)[:, None, None]
    p = jnp.where(valid, jnp.exp(logits - m[jnp.minimum(r_flat, T - 1)]), 0.0)
    denom = jax.ops.segment_sum(p, r_flat, num_segments=T)  # [T, K, G], > 0 wherever an edge ends
    alpha = (p / jnp.where(valid, denom[jnp.minimum(r_flat, T - 1)], 1.0)).reshape(*s_seg.shape, K, G)

    # pass 2: out = sum over a receiver's edges of alpha_e v[s_e]
    def add_chunk(c, out):
        msg = alpha[c][..., None] * v[s_idx[c]][:, :, None, :]  # [chunk, K, G, Hv]
        return out + jax.ops.segment_sum(msg, r_seg[c], num_segments=T)

    out = jax.lax.fori_loop(0, s_seg.shape[0], add_chunk, jnp.zeros((T, K, G, Hv), jnp.float32))
    return out, (q, k, v, senders, receivers, alpha, out)


def _dot_graph_bwd(scale, chunk, res, dout):
    q, k, v, senders, receivers, alpha, out = res
    T, S = q.shape[0], k.shape[0]
    s_seg, r_seg, s_idx, r_idx = _chunks(senders, receivers, T, S, chunk)
    delta = jnp.sum(dout * out, -1)  # [T, K, G] = sum over a receiver's edges of alpha * dalpha

    def add_chunk(c, grads):
        dq, dk, dv = grads
        a, s_i, r_i = alpha[c], s_idx[c], r_idx[c]
        dout_e = dout[r_i]  # [chunk, K, G, Hv]
        dalpha = jnp.einsum("ekgd,ekd->ekg", dout_e, v[s_i])  # d out / d alpha_e
        dlogit = a * (dalpha - delta[r_i]) * scale  # softmax backward, per receiver
        dv = dv + jax.ops.segment_sum(jnp.einsum("ekg,ekgd->ekd", a, dout_e), s_seg[c], num_segments=S)
        dq = dq + jax.ops.segment_sum(dlogit[..., None] * k[s_i][:, :, None, :], r_seg[c], num_segments=T)
        dk = dk + jax.ops.segment_sum(jnp.einsum("ekg,ekgh->ekh", dlogit, q[r_i]), s_seg[c], num_segments=S)
        return dq, dk, dv

    zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
    dq, dk, dv = jax.lax.fori_loop(0, s_seg.shape[0], add_chunk, zeros)
    zero = np.zeros(senders.shape, jax.dtypes.float0)
    return dq, dk, dv, zero, zero


_dot_graph.defvjp(_dot_graph_fwd, _dot_graph_bwd)


def _one_graph(q, k, v, senders, receivers, *, score_e, scale_dot=None):
    """q [T, N, H], k [S, K, H], v [S, K, Hv]; senders/receivers [E] -> [T, N, Hv] fp32."""
    T, N, H = q.shape
    S, K = k.shape[0], k.shape[1]
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))  # fp32 throughout (XLA:CPU has no half dots)
    if score_e is None:  # the dot product, with its own backward
        scale = 1.0 / math.sqrt(H) if scale_dot is None else float(scale_dot)
        chunk = min(EDGE_CHUNK, max(1, senders.shape[0]))
        out = _dot_graph(q.reshape(T, K, N // K, H), k, v, senders, receivers, scale, chunk)
        return out.reshape(T, N, -1)  # [T, K, G, Hv] -> [T, N, Hv]
    # dropped edges carry the ids (S, T): segment ops ignore them, gathers use clipped ids
    valid = (receivers < T)[:, None, None]  # [E, 1, 1]
    r_c, s_c = jnp.minimum(receivers, T - 1), jnp.minimum(senders, S - 1)
    q_e = q[r_c].reshape(-1, K, N // K, H)  # [E, N, H] -> [E, K, G, H]
    k_e = k[s_c]  # [E, K, H]
    logits = score_e(q_e, k_e, r_c, s_c)  # [E, K, G] fp32
    m = jax.ops.segment_max(logits, receivers, num_segments=T)  # [T, K, G]; -inf where no edge
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(valid, jnp.exp(logits - m[r_c]), 0.0)  # [E, K, G]
    denom = jax.ops.segment_sum(p, receivers, num_segments=T)  # [T, K, G]
    # each receiver's weights sum to 1; denom is 0 only where every edge's logit is -inf (a score that masks)
    alpha = p / jnp.where(valid & (denom[r_c] > 0), denom[r_c], 1.0)
    msg = alpha[..., None] * v[s_c][:, :, None, :]  # [E, K, G, Hv]
    out = jax.ops.segment_sum(msg, receivers, num_segments=T)  # [T, K, G, Hv]
    return out.reshape(T, N, -1)  # [T, K, G, Hv] -> [T, N, Hv]


def _valid_edges(senders, receivers, T, S):
    """int32 senders, receivers [E] with every edge outside [0, S) x [0, T), and every repeat of an edge, sent
    to (S, T).

    (S, T) is the padding edge of ``_chunks``: segment sums drop it and its weight is 0. So an edge counts
    once however often it is listed, and an out-of-range edge is dropped, as in the dense adjacency
    (``GraphEdges.dense``; the reference and blockwise kernels). The edges come back sorted by (receiver,
    sender): with numpy at trace time when they are known, else with one sort on device. Concrete indices out
    of range are an error instead (``graph_edges`` checks them; a hand-made ``GraphEdges`` is checked here).
    """
    for name, x, n in (("senders", senders, S), ("receivers", receivers, T)):
        if masks_lib.is_concrete(x) and np.size(x):
            vals = np.asarray(x)
            if vals.min() < 0 or vals.max() >= n:
                raise ValueError(f"mask: {name} has node indices outside [0, {n}): min {vals.min()}, max {vals.max()}")
    known = masks_lib.is_concrete(senders) and masks_lib.is_concrete(receivers)
    xp = np if known else jnp
    s, r = xp.asarray(senders, xp.int32), xp.asarray(receivers, xp.int32)
    order = xp.lexsort((s, r))
    s, r = s[order], r[order]
    repeat = xp.concatenate([xp.zeros(min(1, s.shape[0]), bool), (s[1:] == s[:-1]) & (r[1:] == r[:-1])])
    ok = ~repeat & (s >= 0) & (s < S) & (r >= 0) & (r < T)
    return jnp.asarray(xp.where(ok, s, S), jnp.int32), jnp.asarray(xp.where(ok, r, T), jnp.int32)


def sparse_attention(q, k, v, *, mask, score="dot", scale=None, bias=None):
    """Attention along the edges of ``mask = masks.graph_edges(...)``: O(E) time and memory.

    Args:
        q: ``[..., T, N, H]`` queries, T = num_nodes.
        k: ``[..., S, K, H]`` keys, S = num_nodes.
        v: ``[..., S, K, Hv]`` values.
        mask: a ``masks.GraphEdges`` (``masks.graph_edges(senders, receivers, num_nodes)``);
            the same edge list for every batch element. Edges may be traced arrays.
        score: ``"dot"``, ``scores.Dot(scale)``, ``scores.Additive(w)`` (or
            ``functools.partial(attnlab.scores.additive, w=w)``), ``scores.SoftCap(cap)``, or a
            ``scores.ScoreMod`` with its ``head_axes`` (ALiBi, a Graphormer-style per-pair table): any
            score with an edge form, evaluated on each edge's receiver and sender.
        scale: logit scale for ``score="dot"``; default ``1/sqrt(H)``.
        bias: must be None (per-edge biases are not supported yet).

    Returns:
        ``[..., T, N, Hv]`` in q's dtype (computed in fp32); nodes with no incoming edge get zeros.

    Raises:
        ValueError: ``mask`` is not an edge list, T or S differ from num_nodes, a bias is given,
            or ``score`` has no per-edge form.

    Example:
        >>> m = masks_lib.graph_edges(senders=[0, 1, 2], receivers=[1, 2, 0], num_nodes=3)
        >>> q = k = v = jnp.ones((3, 2, 4))           # [T=3, N=2, H=4]
        >>> sparse_attention(q, k, v, mask=m).shape
        (3, 2, 4)
    """
    call = bind(q, k, v, mask=mask, score=score, scale=scale, bias=bias, fn="sparse_attention")
    from attnlab.impls.sparse import SPARSE  # noqa: PLC0415 (the protocol lives with the implementation)

    if (why := SPARSE.supports(call, platform.target())) is not None:
        raise ValueError(f"{call.fn}: {why}")
    return attend(call)


def attend(call: Call):
    """The edge-list kernel on a bound call (``attnlab.call.bind``) that the implementation supports."""
    senders, receivers, _ = call.mask.edge_list()
    q, k, v, score = call.q, call.k, call.v, call.score
    *lead, T, N, H = q.shape
    S, K, Hv = call.S, call.K, call.Hv
    if score.is_dot:  # the dot product: the chunked custom-vjp path
        score_e, scale = None, score.scale
    else:  # any other edge form (additive, soft-capped, a score_mod), differentiated by jax
        score_e, scale = score.edge_form(), None
    senders, receivers = _valid_edges(senders, receivers, T, S)
    one = functools.partial(_one_graph, senders=senders, receivers=receivers, score_e=score_e, scale_dot=scale)
    # [..., T, N, H] -> [B, T, N, H]; vmap adds the batch (the edge list is shared)
    qb, kb, vb = q.reshape(-1, T, N, H), k.reshape(-1, S, K, H), v.reshape(-1, S, K, Hv)
    out = jax.vmap(one)(qb, kb, vb)
    return out.reshape(*lead, T, N, Hv).astype(q.dtype)
