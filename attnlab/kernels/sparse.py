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
from attnlab import scores as scores_lib
from attnlab.call import Call, bind
from attnlab.kernels import tile_core

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _graph(q, k, v, score, senders, receivers, scale, chunk):
    """Graph attention over chunks of edges, with a hand-written chunked backward, for any score with an edge
    form.

    q [T, K, G, H], k [S, K, H], v [S, K, Hv] (fp32); senders/receivers [E] -> [T, K, G, Hv].
    Memory: O(E * N) for the per-edge logits and weights, O((T + S) * N * H) for inputs and
    gradients, and O(chunk * N * H) for the gathered rows of one chunk: autodiff of the plain
    form would keep q[r], k[s] and v[s] (and the additive score's tanh) for all E edges at once.
    The backward's softmax and value parts are written out; jax differentiates only each chunk's logits: for a
    score that changes the scaled dot product (``score.edge_mod()``: ``SoftCap``, a ``ScoreMod``) that change
    at the dot products kept from the forward, for any other (``Additive``) its edge form at the chunk's rows.
    Either pullback also gives the cotangents of the score's arrays (slopes, tables, w).
    """
    return _graph_fwd(q, k, v, score, senders, receivers, scale, chunk)[0]


def _edge_dots(q, k, s_i, r_i, scale):
    """The scaled dot product of one chunk's edges (the scores' own ``_dot_edges`` on the gathered rows):
    q [T, K, G, H], k [S, K, H] -> [chunk, K, G]."""
    return scores_lib._dot_edges(q[r_i], k[s_i], scale)


def _graph_fwd(q, k, v, score, senders, receivers, scale, chunk):
    T, K, G, _ = q.shape
    S, Hv = k.shape[0], v.shape[-1]
    s_seg, r_seg, s_idx, r_idx = _chunks(senders, receivers, T, S, chunk)
    # pass 1: each edge's logits, one chunk at a time -> [nc, chunk, K, G]
    if score.edge_mod() is None:  # a score of its own (additive): its edge form on the chunk's rows
        form, dots = score.edge_form(), None
        logits = jax.lax.map(lambda sr: form(q[sr[1]], k[sr[0]], sr[1], sr[0]), (s_idx, r_idx))
    else:  # the scaled dot products, and the score's change of them (kept for the backward)
        logits = dots = jax.lax.map(lambda sr: _edge_dots(q, k, *sr, scale), (s_idx, r_idx))
        if not score.is_dot:
            logits = score.edge_mod()(dots.reshape(-1, K, G), r_idx.reshape(-1), s_idx.reshape(-1))
    r_flat = r_seg.reshape(-1)
    logits = logits.reshape(-1, K, G)  # [E', K, G]
    m = jax.ops.segment_max(logits, r_flat, num_segments=T)  # [T, K, G]; -inf where no edge
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    r_c = jnp.minimum(r_flat, T - 1)
    p = jnp.where((r_flat < T)[:, None, None], jnp.exp(logits - m[r_c]), 0.0)
    denom = jax.ops.segment_sum(p, r_flat, num_segments=T)  # [T, K, G]; 0 only where a score set every logit -inf
    alpha = (p / jnp.where(denom[r_c] > 0, denom[r_c], 1.0)).reshape(*s_seg.shape, K, G)

    # pass 2: out = sum over a receiver's edges of alpha_e v[s_e]
    def add_chunk(c, out):
        msg = alpha[c][..., None] * v[s_idx[c]][:, :, None, :]  # [chunk, K, G, Hv]
        return out + jax.ops.segment_sum(msg, r_seg[c], num_segments=T)

    out = jax.lax.fori_loop(0, s_seg.shape[0], add_chunk, jnp.zeros((T, K, G, Hv), jnp.float32))
    dots = None if score.is_dot else dots  # the dot product's backward needs no logits
    return out, (q, k, v, score, senders, receivers, alpha, out, dots)


def _graph_bwd(scale, chunk, res, dout):
    q, k, v, score, senders, receivers, alpha, out, dots = res
    T, S = q.shape[0], k.shape[0]
    s_seg, r_seg, s_idx, r_idx = _chunks(senders, receivers, T, S, chunk)
    delta = jnp.sum(dout * out, -1)  # [T, K, G] = sum over a receiver's edges of alpha * dalpha
    leaves, tree = jax.tree_util.tree_flatten(score)
    leaves = [jnp.asarray(x) for x in leaves]  # a Python number among a ScoreMod's arrays: shape (), weak dtype
    own_form = score.edge_mod() is None

    def add_chunk(c, grads):
        dq, dk, dv, dleaves = grads
        a, s_i, r_i = alpha[c], s_idx[c], r_idx[c]
        dout_e = dout[r_i]  # [chunk, K, G, Hv]
        dalpha = jnp.einsum("ekgd,ekd->ekg", dout_e, v[s_i])  # d out / d alpha_e
        ds = a * (dalpha - delta[r_i])  # softmax backward, per receiver: d logits
        dv = dv + jax.ops.segment_sum(jnp.einsum("ekg,ekgd->ekd", a, dout_e), s_seg[c], num_segments=S)
        d_ls = ()
        if own_form:  # the edge form's pullback at the chunk's rows

            def form(q_e, k_e, ls):
                return tree.unflatten(ls).edge_form()(q_e, k_e, r_i, s_i)

            dq_e, dk_e, d_ls = jax.vjp(form, q[r_i], k[s_i], leaves)[1](ds)
        else:
            if dots is not None:  # through the score's change of the dot products

                def mod(ls, s):
                    return tree.unflatten(ls).edge_mod()(s, r_i, s_i)

                d_ls, ds = jax.vjp(mod, leaves, dots[c])[1](ds)
            ds = ds * scale
            dq_e, dk_e = ds[..., None] * k[s_i][:, :, None, :], jnp.einsum("ekg,ekgh->ekh", ds, q[r_i])
        dq = dq + jax.ops.segment_sum(dq_e, r_seg[c], num_segments=T)
        dk = dk + jax.ops.segment_sum(dk_e, s_seg[c], num_segments=S)
        dleaves = [acc + tile_core.f32_cotangent(d, x) for acc, d, x in zip(dleaves, d_ls, leaves, strict=True)]
        return dq, dk, dv, dleaves

    zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), [jnp.zeros(x.shape, jnp.float32) for x in leaves])
    dq, dk, dv, dleaves = jax.lax.fori_loop(0, s_seg.shape[0], add_chunk, zeros)
    zero = np.zeros(senders.shape, jax.dtypes.float0)
    return dq, dk, dv, tree.unflatten(tile_core.cast_cotangents(dleaves, leaves)), zero, zero


_graph.defvjp(_graph_fwd, _graph_bwd)


def _one_graph(q, k, v, senders, receivers, *, score):
    """q [T, N, H], k [S, K, H], v [S, K, Hv]; senders/receivers [E] -> [T, N, Hv] fp32."""
    T, N, H = q.shape
    K = k.shape[1]
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))  # fp32 throughout (XLA:CPU has no half dots)
    scale = None if score.edge_mod() is None else score.scale  # the dot product's, where the score has one
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    chunk = min(EDGE_CHUNK, max(1, senders.shape[0]))
    out = _graph(q.reshape(T, K, N // K, H), k, v, score, senders, receivers, scale, chunk)
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
    q, k, v = call.q, call.k, call.v
    *lead, T, N, H = q.shape
    S, K, Hv = call.S, call.K, call.Hv
    senders, receivers = _valid_edges(senders, receivers, T, S)
    one = functools.partial(_one_graph, senders=senders, receivers=receivers, score=call.score)
    # [..., T, N, H] -> [B, T, N, H]; vmap adds the batch (the edge list is shared)
    qb, kb, vb = q.reshape(-1, T, N, H), k.reshape(-1, S, K, H), v.reshape(-1, S, K, Hv)
    out = jax.vmap(one)(qb, kb, vb)
    return out.reshape(*lead, T, N, Hv).astype(q.dtype)
