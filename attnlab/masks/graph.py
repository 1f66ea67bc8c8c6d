"""Data-carrying masks (arrays are pytree leaves): padding, graph adjacency, graph edge lists."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.masks.base import (
    EMPTY,
    FULL,
    PARTIAL,
    Mask,
    _check_int,
    _check_lengths,
    _num_blocks,
    is_concrete,
    leaf,
    mask_class,
)


@mask_class
class Padding(Mask):
    """Per-example valid lengths: query t is valid iff t < q_lengths[b], key s iff s < kv_lengths[b].

    A pair may attend iff both are valid. ``dense`` has shape ``[*B, 1, T, S]``.
    """

    q_lengths: Any = leaf(default=None)
    kv_lengths: Any = leaf(default=None)
    is_padding = True

    def runtime_layout(self, T, S, bq, bk):
        if self.is_static:
            return None  # the static layout is exact
        return _padding_layout(self.q_lengths, self.kv_lengths, T, S, bq, bk, jnp)

    def __call__(self, q_idx, k_idx):
        ok = jnp.ones((q_idx.shape[0], k_idx.shape[0]), bool)
        if self.q_lengths is not None:
            lq = jnp.asarray(self.q_lengths)[..., None, None, None]  # [*B] -> [*B, 1, 1, 1]
            ok = ok & (q_idx[:, None] < lq)
        if self.kv_lengths is not None:
            lk = jnp.asarray(self.kv_lengths)[..., None, None, None]
            ok = ok & (k_idx[None, :] < lk)
        return ok

    def _layout(self, T, S, bq, bk):
        if not self.is_static:
            return np.full((_num_blocks(T, bq), _num_blocks(S, bk)), PARTIAL, np.int8)
        return _padding_layout(self.q_lengths, self.kv_lengths, T, S, bq, bk, np)


def _padding_layout(q_lengths, kv_lengths, T, S, bq, bk, xp):
    """Padding's block layout int8 [nq, nk] from its lengths: ``xp`` numpy (concrete lengths, at
    trace time) or jax.numpy (traced lengths, on device: ``runtime_layout``)."""

    def axis_state(lengths, n, block, size):  # -> per example [B, n]: 0 none valid, 2 all (in range), 1 some
        start = xp.arange(n) * block
        stop = xp.minimum(start + block, size)
        if lengths is None:
            return xp.full((1, n), FULL, xp.int8)
        ln = xp.asarray(lengths).reshape(-1, 1)
        return xp.where(ln <= start, EMPTY, xp.where(ln >= stop, FULL, PARTIAL))

    sq = axis_state(q_lengths, _num_blocks(T, bq), bq, T)[:, :, None]  # [B, nq, 1]
    sk = axis_state(kv_lengths, _num_blocks(S, bk), bk, S)[:, None, :]  # [B, 1, nk]
    per = xp.where((sq == EMPTY) | (sk == EMPTY), EMPTY, xp.where((sq == FULL) & (sk == FULL), FULL, PARTIAL))
    return xp.where((per == EMPTY).all(0), EMPTY, xp.where((per == FULL).all(0), FULL, PARTIAL)).astype(xp.int8)


@mask_class
class Graph(Mask):
    """Attention along the edges of a graph: ``adjacency[..., i, j]`` = node i attends to node j.

    ``adjacency`` is bool ``[T, S]`` or ``[*B, T, S]``; ``dense`` is ``[T, S]`` or ``[*B, 1, T, S]``.
    """

    adjacency: Any = leaf()

    def __call__(self, q_idx, k_idx):
        adj = jnp.asarray(self.adjacency)
        out = jnp.take(jnp.take(adj, q_idx, axis=-2), k_idx, axis=-1)
        return out if adj.ndim == 2 else out[..., None, :, :]  # [*B, T', S'] -> [*B, 1, T', S']

    def dense(self, T, S):
        _check_lengths(T, S)
        shape = tuple(self.adjacency.shape[-2:])
        if shape != (T, S):
            raise ValueError(
                f"graph mask: adjacency is {shape[0]}x{shape[1]} but attention is "
                f"{T}x{S} (T queries x S keys); they must be equal"
            )
        adj = jnp.asarray(self.adjacency)
        return adj if adj.ndim == 2 else adj[..., None, :, :]

    def _layout(self, T, S, bq, bk):
        nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
        if not self.is_static:
            return np.full((nq, nk), PARTIAL, np.int8)
        adj = np.asarray(self.adjacency, bool).reshape((-1,) + tuple(self.adjacency.shape[-2:]))
        adj = adj[:, :T, :S]
        pad = np.zeros((adj.shape[0], nq * bq, nk * bk), np.int32)
        pad[:, :T, :S] = adj
        counts = pad.reshape(adj.shape[0], nq, bq, nk, bk).sum((2, 4))  # [B, nq, nk]
        rows = np.minimum(np.arange(nq) * bq + bq, T) - np.arange(nq) * bq
        cols = np.minimum(np.arange(nk) * bk + bk, S) - np.arange(nk) * bk
        sizes = rows[:, None] * cols[None, :]
        all_empty = (counts == 0).all(0)
        all_full = (counts == sizes).all(0)
        return np.where(all_empty, EMPTY, np.where(all_full, FULL, PARTIAL)).astype(np.int8)


@mask_class
class GraphEdges(Mask):
    """A graph as an edge list: edge e carries a message from ``senders[e]`` to ``receivers[e]``.

    The receiver (query) attends to the sender (key), so ``dense()[r, s]`` is True for each edge.
    This is the input of the O(E) sparse kernel; ``dense`` scatters it into ``[num_nodes, num_nodes]``.
    """

    senders: Any = leaf()
    receivers: Any = leaf()
    num_nodes: int = 0

    def __call__(self, q_idx, k_idx):
        adj = self.adjacency()
        return jnp.take(jnp.take(adj, q_idx, axis=0), k_idx, axis=1)

    def for_tiles(self):
        if self.is_static:  # concrete edges: a concrete adjacency (exact layouts, even inside jit)
            with jax.ensure_compile_time_eval():
                return Graph(self.adjacency())
        return Graph(self.adjacency())

    def edge_list(self):
        return self.senders, self.receivers, self.num_nodes

    def adjacency(self) -> jax.Array:
        """bool ``[num_nodes, num_nodes]``: ``adjacency[r, s]`` is True iff an edge s -> r exists."""
        n = self.num_nodes
        adj = jnp.zeros((n, n), bool)
        # an edge outside [0, n) (possible only with traced indices) is dropped, negative ones too
        r, s = (jnp.asarray(x) for x in (self.receivers, self.senders))
        r, s = jnp.where(r < 0, n, r), jnp.where(s < 0, n, s)
        return adj.at[r, s].set(True, mode="drop")

    def dense(self, T, S):
        _check_lengths(T, S)
        if (T, S) != (self.num_nodes, self.num_nodes):
            raise ValueError(
                f"graph_edges mask: num_nodes={self.num_nodes} but attention is "
                f"{T}x{S} (T queries x S keys); both must equal num_nodes"
            )
        return self.adjacency()

    def _layout(self, T, S, bq, bk):
        nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
        if not self.is_static:
            return np.full((nq, nk), PARTIAL, np.int8)
        r = np.asarray(self.receivers)
        s = np.asarray(self.senders)
        keep = (r < T) & (s < S)
        # one key per edge, sorted, repeats dropped (np.unique hashes them: 5x slower at 1M edges)
        pairs = np.sort(r[keep].astype(np.int64) * S + s[keep])
        pairs = pairs[np.concatenate([np.ones(min(1, pairs.size), bool), pairs[1:] != pairs[:-1]])]
        counts = np.bincount((pairs // S // bq) * nk + pairs % S // bk, minlength=nq * nk).reshape(nq, nk)
        rows = np.minimum(np.arange(nq) * bq + bq, T) - np.arange(nq) * bq
        cols = np.minimum(np.arange(nk) * bk + bk, S) - np.arange(nk) * bk
        sizes = rows[:, None] * cols[None, :]
        return np.where(counts == 0, EMPTY, np.where(counts == sizes, FULL, PARTIAL)).astype(np.int8)


def padding_lengths(pads, lead, T: int, S: int):
    """Padding factors -> ``(q_len, kv_len)``, int32 ``[B]`` each (B = prod(lead)): the minimum over the factors.

    Lengths may be traced. Each factor's lengths must broadcast to the batch dims ``lead``
    (leading 1s allowed); a factor without ``q_lengths`` / ``kv_lengths`` leaves T / S.

    Raises:
        ValueError: lengths that do not match the batch dims (named).
    """
    lead = tuple(lead)
    ql = jnp.full(lead, T, jnp.int32)
    kl = jnp.full(lead, S, jnp.int32)

    def fit(x, name):
        x = jnp.asarray(x).astype(jnp.int32)
        extra = x.ndim - len(lead)
        bad = ValueError(f"padding {name} of shape {x.shape} does not match the batch dims {lead}")
        if extra > 0:
            if any(d != 1 for d in x.shape[:extra]):
                raise bad
            x = x.reshape(x.shape[extra:])
        try:
            return jnp.broadcast_to(x, lead)
        except ValueError:
            raise bad from None

    for p in pads:
        if p.q_lengths is not None:
            ql = jnp.minimum(ql, fit(p.q_lengths, "q_lengths"))
        if p.kv_lengths is not None:
            kl = jnp.minimum(kl, fit(p.kv_lengths, "kv_lengths"))
    return ql.reshape(-1), kl.reshape(-1)


def _check_lengths_array(name, lengths):
    if lengths is None:
        return None
    arr = lengths if isinstance(lengths, jax.Array) else np.asarray(lengths)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of per-example lengths, got dtype {arr.dtype}")
    if is_concrete(arr) and np.any(np.asarray(arr) < 0):
        raise ValueError(f"{name} must be >= 0, got {np.asarray(arr).tolist()}")
    return arr


def padding(q_lengths=None, kv_lengths=None) -> Mask:
    """Variable-length sequences: only the first ``q_lengths[b]`` queries and ``kv_lengths[b]`` keys are real.

    Args:
        q_lengths: int ``[*B]`` (may be a traced array under jit), or None for no query padding.
        kv_lengths: int ``[*B]``, or None for no key padding.

    Padded query rows have no key to attend to, so attention returns zeros there.

    Example:
        >>> padding(kv_lengths=jnp.array([2])).dense(2, 3).astype(int).tolist()
        [[[[1, 1, 0], [1, 1, 0]]]]
    """
    if q_lengths is None and kv_lengths is None:
        raise ValueError("padding() needs q_lengths, kv_lengths or both")
    q = _check_lengths_array("q_lengths", q_lengths)
    k = _check_lengths_array("kv_lengths", kv_lengths)
    if q is not None and k is not None and q.shape != k.shape:
        raise ValueError(f"q_lengths and kv_lengths must have the same batch shape, got {q.shape} and {k.shape}")
    return Padding(q, k)


@mask_class
class PrefixLM(Mask):
    """Prefix LM: every query sees the first ``prefix_lengths[b]`` keys (bidirectional) and, beyond, keys s <= t.

    ``dense`` has shape ``[*B, 1, T, S]`` (``[1, T, S]`` for one Python int). The lengths are a
    pytree leaf (traced values reuse the compiled program); with concrete lengths the block layout
    is exact, with traced ones every tile is PARTIAL (safe).
    """

    prefix_lengths: Any = leaf()

    def __call__(self, q_idx, k_idx):
        p = jnp.asarray(self.prefix_lengths)[..., None, None, None]  # [*B] -> [*B, 1, 1, 1]
        return (k_idx[None, :] < p) | (k_idx[None, :] <= q_idx[:, None])


def prefix_lm(prefix_lengths) -> Mask:
    """A prefix-LM mask (T5's / UniLM's): the prefix is attended bidirectionally, the rest causally.

    Args:
        prefix_lengths: int ``[*B]`` (one per example; may be traced under jit), or a Python int.

    Example:
        >>> prefix_lm(2).dense(4, 4)[0].astype(int).tolist()      # [N=1, T, S]: one head for all
        [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """
    arr = _check_lengths_array("prefix_lengths", prefix_lengths)
    if arr is None:
        raise ValueError("prefix_lm: prefix_lengths must be an int or an integer array [*B], got None")
    return PrefixLM(arr)


@mask_class
class Document(Mask):
    """Packed documents: query t attends to key s iff they carry the same segment id (and it is not the padding id).

    ``q_ids`` ``[*B, T]`` and ``kv_ids`` ``[*B, S]`` are pytree leaves: traced ids reuse the compiled
    program, and ``runtime_layout`` finds the empty tiles on device from each block's id range
    (exact for ids that do not decrease along the row, as packing makes them; safe for any ids).
    Known ids give the exact static layout from the ids each block holds, in any order and for
    cross-attention too (no evaluation of the mask).
    ``dense`` has shape ``[*B, 1, T, S]``.
    """

    q_ids: Any = leaf()
    kv_ids: Any = leaf()
    padding_id: int | None = None

    def __call__(self, q_idx, k_idx):
        qi = jnp.take(jnp.asarray(self.q_ids), q_idx, axis=-1)[..., None, :, None]  # [*B, 1, T', 1]
        ki = jnp.take(jnp.asarray(self.kv_ids), k_idx, axis=-1)[..., None, None, :]  # [*B, 1, 1, S']
        ok = qi == ki
        if self.padding_id is not None:
            ok = ok & (qi != self.padding_id)
        return ok

    def dense(self, T, S):
        _check_lengths(T, S)
        for name, ids, n, what in (
            ("q_segment_ids", self.q_ids, T, "T queries"),
            ("kv_segment_ids", self.kv_ids, S, "S keys"),
        ):
            if np.shape(ids)[-1] != n:
                raise ValueError(
                    f"document mask: {name} has length {np.shape(ids)[-1]} but attention has {n} ({what}); "
                    "they must be equal"
                )
        return super().dense(T, S)

    def runtime_layout(self, T, S, bq, bk):
        if self.is_static:
            return None  # exact at trace time (``_layout``)
        return self._range_layout(T, S, bq, bk)

    def _layout(self, T, S, bq, bk):
        if self.is_static and np.shape(self.q_ids)[-1] == T and np.shape(self.kv_ids)[-1] == S:
            return self._id_layout(T, S, bq, bk)
        return super()._layout(T, S, bq, bk)  # traced ids: all PARTIAL (ids of other lengths: dense() rejects them)

    def _id_layout(self, T, S, bq, bk):
        """The exact layout of known ids, from the ids each block holds (in any order, cross-attention too): a
        tile may attend where its two blocks share an id in some example, and is FULL where, in every example,
        both blocks hold one and the same id and no padding. Its cost is the pairs of blocks that meet on an id,
        not a pass over every pair of positions."""
        nq, nk = _num_blocks(T, bq), _num_blocks(S, bk)
        q = np.asarray(self.q_ids).reshape(-1, T)
        k = np.asarray(self.kv_ids).reshape(-1, S)
        ids, codes = np.unique(np.concatenate([q.ravel(), k.ravel()]), return_inverse=True)
        codes = codes.reshape(-1)  # ids numbered 0..D-1, the queries' then the keys'
        pad = ids == self.padding_id if self.padding_id is not None else np.zeros(ids.size, bool)
        q_block, q_key, q_one, q_id = _ids_per_block(codes[: q.size].reshape(q.shape), pad, nq, bq)
        k_block, k_key, k_one, k_id = _ids_per_block(codes[q.size :].reshape(k.shape), pad, nk, bk)
        shared = _blocks_meet(q_block, q_key, k_block, k_key, nq, nk)  # the blocks share an id in some example
        # FULL: in every example both blocks hold one id and no padding, and it is the same id
        _, group = np.unique(np.concatenate([q_id.T, k_id.T]), axis=0, return_inverse=True)
        group = group.reshape(-1)
        same = group[:nq, None] == group[None, nq:]
        full = q_one.all(0)[:, None] & k_one.all(0)[None, :] & same
        return np.where(full, FULL, np.where(shared, PARTIAL, EMPTY)).astype(np.int8)

    def _range_layout(self, T, S, bq, bk):
        """The layout of traced ids, on device, from each block's id range (min, max outside the padding): safe
        for any ids; exact where queries and keys share one row of ids that never decreases outside the padding
        (packing makes them so), since two blocks of one sorted row share an id exactly when their ranges meet."""
        big = np.iinfo(np.int32).max

        def ranges(ids, n, block):  # ids [*B, L] -> per block (min, max, has_pad) [B, n]
            ids = jnp.asarray(ids, jnp.int32)
            ids = ids.reshape(-1, ids.shape[-1])
            L = ids.shape[-1]
            pad = ids == self.padding_id if self.padding_id is not None else jnp.zeros(ids.shape, bool)
            fill = n * block - L  # the short last block: filled with padding entries
            ids = jnp.pad(ids, ((0, 0), (0, fill)))
            pad = jnp.pad(pad, ((0, 0), (0, fill)), constant_values=True)
            ids, pad = ids.reshape(-1, n, block), pad.reshape(-1, n, block)
            lo = jnp.where(pad, big, ids).min(-1)
            hi = jnp.where(pad, -big, ids).max(-1)
            # a short last block's fill is out of range, not padding: it never spoils FULL
            real_pad = pad & (jnp.arange(n * block) < L).reshape(n, block)
            return lo, hi, real_pad.any(-1)

        qlo, qhi, qpad = ranges(self.q_ids, _num_blocks(T, bq), bq)
        klo, khi, kpad = ranges(self.kv_ids, _num_blocks(S, bk), bk)
        qlo, qhi, qpad = qlo[:, :, None], qhi[:, :, None], qpad[:, :, None]
        klo, khi, kpad = klo[:, None, :], khi[:, None, :], kpad[:, None, :]
        empty = (qhi < klo) | (khi < qlo)  # disjoint id ranges (an all-padding block: lo > hi)
        full = (qlo == qhi) & (klo == khi) & (qlo == klo) & ~qpad & ~kpad
        empty, full = empty.all(0), full.all(0)
        return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)


def _ids_per_block(codes, pad, n, block):
    """Which ids each block holds: ``codes`` int ``[B, L]`` (ids numbered 0..D-1), ``pad`` bool ``[D]`` (the
    padding id) -> per distinct (example, block, id): the block and the key example * D + id; ``[B, n]`` True
    where the block holds exactly one id and no padding; ``[B, n]`` that id."""
    B, L = codes.shape
    D = pad.size
    slot = np.arange(B)[:, None] * n + np.arange(L) // block  # example * n + block, int64
    real = ~pad[codes]
    keys = np.unique(slot[real] * D + codes[real])  # B * n * D stays far below 2**63
    slot_of, the_id = keys // D, keys % D
    distinct = np.bincount(slot_of, minlength=B * n)
    padded = np.bincount(slot[~real], minlength=B * n) > 0
    only = np.zeros(B * n, np.int64)
    only[slot_of] = the_id  # meaningful where the block holds one id
    one = (distinct == 1) & ~padded
    return slot_of % n, slot_of // n * D + the_id, one.reshape(B, n), only.reshape(B, n)


def _blocks_meet(q_block, q_key, k_block, k_key, nq, nk, chunk=1 << 22):
    """bool ``[nq, nk]``: True where a query block and a key block hold a common key (example, id). A join on the
    keys: its work is the pairs of blocks that meet (never more than a dense product over the keys), in chunks
    of about ``chunk`` pairs."""
    order = np.argsort(k_key, kind="stable")
    k_key, k_block = k_key[order], k_block[order]
    lo = np.searchsorted(k_key, q_key, "left")
    count = np.searchsorted(k_key, q_key, "right") - lo
    ends = np.cumsum(count)
    meet = np.zeros((nq, nk), bool)
    start = 0
    while start < q_key.size:
        stop = max(int(np.searchsorted(ends, ends[start] - count[start] + chunk, "right")), start + 1)
        c = count[start:stop]
        pair = np.repeat(np.arange(start, stop), c)
        at = lo[pair] + np.arange(pair.size) - np.repeat(np.cumsum(c) - c, c)
        meet[q_block[pair], k_block[at]] = True
        start = stop
    return meet


def document(q_segment_ids, kv_segment_ids=None, *, padding_id: int | None = None) -> Mask:
    """Packed sequences: several documents in one row, each attending only within itself.

    Args:
        q_segment_ids: int ``[*B, T]``, the document of each query position (may be traced).
        kv_segment_ids: int ``[*B, S]`` for the keys; default the same as the queries (self-attention).
        padding_id: an id that marks padding: positions with it attend to nothing and are attended
            by nothing (their rows return zeros). None: every id is a document.

    ``document(ids) & causal()`` is the packed causal LM.

    Example:
        >>> document(jnp.array([0, 0, 1])).dense(3, 3)[0].astype(int).tolist()
        [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    """
    q = _check_ids("q_segment_ids", q_segment_ids)
    k = q if kv_segment_ids is None else _check_ids("kv_segment_ids", kv_segment_ids)
    if q.shape[:-1] != k.shape[:-1]:
        raise ValueError(
            f"q_segment_ids {q.shape} ([*B, T]) and kv_segment_ids {k.shape} ([*B, S]) must have the same batch dims"
        )
    if padding_id is not None:
        padding_id = _check_int("padding_id", padding_id)
    return Document(q, k, padding_id)


def _check_ids(name, ids):
    arr = ids if isinstance(ids, jax.Array) else np.asarray(ids)
    if arr.ndim < 1 or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array [*B, length] of segment ids, got {arr.dtype} {arr.shape}")
    return arr


def _check_adjacency(adjacency, *, square: bool):
    adj = adjacency if isinstance(adjacency, jax.Array) else np.asarray(adjacency)
    if adj.dtype != bool:
        raise ValueError(f"adjacency must be a bool array (True = attend), got dtype {adj.dtype}")
    if adj.ndim < 2:
        raise ValueError(f"adjacency must be [T, S] or [*B, T, S], got shape {adj.shape}")
    if square and adj.shape[-1] != adj.shape[-2]:
        raise ValueError(f"adjacency must be square [..., n, n] for self-loops, got shape {adj.shape}")
    return adj


def with_self_loops(adjacency):
    """Adds self-loops (node i attends to itself) to a square adjacency ``[..., n, n]``."""
    adj = _check_adjacency(adjacency, square=True)
    eye = np.eye(adj.shape[-1], dtype=bool)
    return (adj | eye) if isinstance(adj, np.ndarray) else jnp.logical_or(adj, eye)


def graph(adjacency, *, self_loops: bool = False) -> Mask:
    """Graph attention: ``adjacency[..., i, j]`` True means node i attends to node j (its neighbour).

    Args:
        adjacency: bool ``[T, S]`` or ``[*B, T, S]`` (numpy or jax; traced arrays allowed).
        self_loops: also let every node attend to itself (requires T == S).

    Example:
        >>> import numpy as np
        >>> path = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], bool)  # 0 - 1 - 2
        >>> graph(path, self_loops=True).dense(3, 3).astype(int).tolist()
        [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
    """
    adj = _check_adjacency(adjacency, square=self_loops)
    if self_loops:
        adj = with_self_loops(adj)
    return Graph(adj)


def graph_edges(senders, receivers, num_nodes: int) -> Mask:
    """A graph given as an edge list (for the O(E) sparse kernel): receiver r attends to sender s.

    Args:
        senders: int ``[E]`` source node of each edge (the key).
        receivers: int ``[E]`` target node of each edge (the query).
        num_nodes: number of nodes n (T = S = n).

    Example:
        >>> graph_edges([0, 1], [1, 2], 3).dense(3, 3).astype(int).tolist()
        [[0, 0, 0], [1, 0, 0], [0, 1, 0]]
    """
    n = _check_int("num_nodes", num_nodes, minimum=1)
    out = []
    for name, idx in (("senders", senders), ("receivers", receivers)):
        arr = idx if isinstance(idx, jax.Array) else np.asarray(idx)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be a 1-D int array [E], got shape {arr.shape}")
        if arr.size and not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
        arr = arr.astype(np.int32)
        if is_concrete(arr) and arr.size:
            vals = np.asarray(arr)
            if vals.min() < 0 or vals.max() >= n:
                raise ValueError(f"{name} has node indices outside [0, {n}): min {vals.min()}, max {vals.max()}")
        out.append(arr)
    if out[0].shape != out[1].shape:
        raise ValueError(
            f"senders and receivers must have the same length, got {out[0].shape[0]} and {out[1].shape[0]}"
        )
    return GraphEdges(out[0], out[1], n)
