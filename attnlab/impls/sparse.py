"""The O(E) edge-list kernel as an implementation: ``attnlab.kernels.sparse``."""

from __future__ import annotations

import math

from attnlab.impls.base import Implementation
from attnlab.impls.blockwise import visited_share
from attnlab.kernels import sparse as kernel

__all__ = ["SPARSE", "MIN_PAIRS_PER_EDGE", "min_pairs_per_edge"]

# On the CPU the edge-list kernel pays off where the blockwise kernel would visit at least this many (query,
# key) pairs (its non-empty 64 x 64 tiles) per edge, by head dimension: (the largest H a row covers, pairs per
# edge). The blockwise kernel's work per pair (the softmax's) does not shrink with H as the edges' gathers do.
# `make edges-crossover` (fwd+bwd, dot and SoftCap, two runs per head shape; docs/kernels.md): at 4 heads of 16
# sparse 1.41x or more ahead from 20 pairs per edge, blockwise ahead or even at 16; at 4 heads of 32 sparse
# ahead at 46 and 62, blockwise at 60 and at 4-20; at 8 heads of 64 and 2 of 128 sparse 1.85x or more ahead
# from 88, either kernel ahead at 46-62 (the rule costs up to 1.64x there), blockwise at 4-20.
MIN_PAIRS_PER_EDGE = ((16, 16), (32, 32), (math.inf, 64))


def min_pairs_per_edge(head_dim: int) -> int:
    """The pairs per edge from which the edge-list kernel pays off on the CPU at head dimension ``head_dim``."""
    return next(pairs for largest, pairs in MIN_PAIRS_PER_EDGE if head_dim <= largest)


class Sparse(Implementation):
    """Segment softmax along a graph's edge list (``masks.graph_edges``)."""

    name = "sparse"

    def supports(self, call, backend):
        """None when the edge-list kernel can run the bound call, else why not (shapes only)."""
        edges = None if call.mask is None else call.mask.edge_list()
        if edges is None:
            got = "None" if call.mask is None else type(call.mask).__name__
            return f"needs mask=masks.graph_edges(...) (an edge list), got mask {got}"
        if call.bias is not None:
            return "takes no bias (per-edge biases are not supported yet)"
        if call.score.edge_form() is None:
            return (
                "needs a score with a per-edge form (Dot, Additive, SoftCap, ScoreMod with head_axes), "
                f"got score {type(call.score).__name__}"
            )
        if (edges[2], edges[2]) != (call.T, call.S):
            return f"mask: graph_edges has num_nodes={edges[2]} but attention is {call.T}x{call.S}"
        return None

    def pays_off(self, call, backend):
        """On the CPU: where the blockwise kernel would visit ``min_pairs_per_edge(H)`` pairs per edge or more
        (from the shapes and the edges' block layout; traced edges: every pair). Elsewhere always."""
        if backend != "cpu":
            return None
        edges = call.mask.edge_list()[0].shape[0]
        pairs = visited_share(call.mask, call.T, call.S, backend) * call.T * call.S
        threshold = min_pairs_per_edge(call.H)
        if pairs >= threshold * edges:
            return None
        return (
            f"pays off on cpu from {threshold} pairs per edge (at H = {call.H}) in the blockwise kernel's non-empty "
            f"tiles (here {pairs / max(edges, 1):.1f}: {edges} edges among {call.T} nodes): blockwise or dense is "
            "faster"
        )

    def run(self, call):
        return kernel.attend(call)


SPARSE = Sparse()
