"""Attention masks as structured objects.

A mask says which (query position t, key position s) pairs may attend: **True = attend**. Every
mask can give

* ``mask.dense(T, S)``: a boolean array broadcastable to ``[..., N, T, S]`` (the logits' shape);
* ``mask.block_layout(T, S, block_q, block_k)``: a numpy int8 array ``[ceil(T/bq), ceil(S/bk)]``
  with ``EMPTY = 0`` (no pair in the block may attend, for any batch element), ``PARTIAL = 1``
  and ``FULL = 2`` (every in-range pair in the block may attend, for every batch element). This
  is what fast kernels use to skip work. The layout is always *safe*: a block is only called
  EMPTY or FULL when that is certain. Masks whose structure is only known at run time (padding
  with traced lengths, a traced adjacency) mark such blocks PARTIAL.
* ``mask(q_idx, k_idx)``: the same boolean values for arbitrary 1-D position vectors, so that a
  kernel can evaluate the mask on one block at a time without forming ``[T, S]``.

Masks compose with ``&`` (both must allow) and ``|`` (either allows).

Masks are JAX pytrees: their structure (window sizes, causal offset) is static metadata and
their arrays (padding lengths, adjacency, edge lists) are leaves. So a mask can be passed as an
ordinary argument to a ``jax.jit``-ed function; changing a window size recompiles, changing the
lengths does not.

Shape legend (as ``jax.nn.dot_product_attention``): B batch (any number of leading dims), T query
length, S key length, N heads. Position t of the queries and s of the keys are both counted from
0, so ``causal()`` is top-left aligned like ``jax.nn``; use ``offset`` to align queries with the
end of a longer key sequence (decoding with a cache).

Example:
    >>> m = causal() & window(2, 0)          # each query sees itself and the 2 keys before it
    >>> m.dense(4, 4).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]
    >>> m.block_layout(8, 8, 4, 4).tolist()    # 0 = empty, 1 = partial, 2 = full
    [[1, 0], [1, 1]]

Layout of the package (each constructor beside its class):

* ``base``: ``Mask``, layouts, ``And``/``Or``, ``Dense``, ``as_mask`` (``bool_mask_hint``), ``leaf``/``mask_class``;
* ``structural``: full, causal, window, window_2d;
* ``graph``: padding, prefix_lm, document, graph, graph_edges (data-carrying);
* ``sparse``: chunks, dilated, global_tokens, random_blocks, bigbird;
* ``predicate``: masks from a function of positions (and arrays);
* ``spec``: ``from_spec`` strings.

What a mask says about itself, for the kernels (none of them lists mask classes):
``conjuncts()``, ``split_padding()``, ``is_full``, ``is_padding``, ``interval()`` (the ``t + lo <= s
<= t + hi`` form that flag-driven kernels take), ``in_kernel`` (evaluable from positions alone),
``for_tiles()``, ``edge_list()``, ``block_layout`` and ``runtime_layout`` (the layout from traced data, on device).

A new mask: a ``@mask_class`` subclass of ``Mask`` with array fields declared ``leaf()``, its
constructor beside it, both exported here; set ``in_kernel`` / override ``interval`` where they
hold (see docs/design.md).
"""

from attnlab.masks.base import (
    EMPTY,
    FULL,
    PARTIAL,
    And,
    Dense,
    Mask,
    Or,
    and_all,
    as_mask,
    bool_mask_hint,
    is_concrete,
    leaf,
    mask_class,
)
from attnlab.masks.graph import (
    Document,
    Graph,
    GraphEdges,
    Padding,
    PrefixLM,
    document,
    graph,
    graph_edges,
    padding,
    padding_lengths,
    prefix_lm,
    with_self_loops,
)
from attnlab.masks.predicate import Predicate, predicate
from attnlab.masks.sparse import (
    BlockBand,
    Chunks,
    Dilated,
    GlobalTokens,
    RandomBlocks,
    bigbird,
    chunks,
    dilated,
    global_tokens,
    random_blocks,
)
from attnlab.masks.spec import from_spec
from attnlab.masks.structural import Causal, Full, Window, Window2D, causal, full, window, window_2d

__all__ = [
    "EMPTY",
    "PARTIAL",
    "FULL",
    "Mask",
    "Full",
    "Causal",
    "Window",
    "Padding",
    "Graph",
    "GraphEdges",
    "Dense",
    "And",
    "Or",
    "full",
    "causal",
    "window",
    "padding",
    "graph",
    "graph_edges",
    "with_self_loops",
    "as_mask",
    "bool_mask_hint",
    "and_all",
    "is_concrete",
    "padding_lengths",
    "PrefixLM",
    "prefix_lm",
    "Document",
    "document",
    "Chunks",
    "Dilated",
    "GlobalTokens",
    "BlockBand",
    "RandomBlocks",
    "chunks",
    "dilated",
    "global_tokens",
    "random_blocks",
    "bigbird",
    "Window2D",
    "window_2d",
    "from_spec",
    "Predicate",
    "predicate",
    "leaf",
    "mask_class",
]
