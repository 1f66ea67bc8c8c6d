"""The O(E) edge-list kernel as an implementation: ``attnlab.kernels.sparse``."""

from __future__ import annotations

from attnlab.impls.base import Implementation
from attnlab.impls.blockwise import visited_share
from attnlab.kernels import sparse as kernel

__all__ = ["SPARSE", "MIN_PAIRS_PER_EDGE"]

# On the CPU the edge-list kernel pays off where the blockwise kernel would visit at least this many (query,
# key) pairs (its non-empty 64 x 64 tiles) per edge: `make edges-crossover` (8 heads, H = 64, fwd+bwd) timed
# sparse ahead at 46 and 62 pairs per edge (up to 1.64x) and blockwise at 60, sparse 1.85x or more ahead from 88
# and blockwise 1.39x or more at 4-20 (docs/kernels.md).
MIN_PAIRS_PER_EDGE = 64


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
        """On the CPU: where the blockwise kernel would visit ``MIN_PAIRS_PER_EDGE`` pairs per edge or more
        (from the shapes and the edges' block layout; traced edges: every pair). Elsewhere always."""
        if backend != "cpu":
            return None
        edges = call.mask.edge_list()[0].shape[0]
        pairs = visited_share(call.mask, call.T, call.S, backend) * call.T * call.S
        if pairs >= MIN_PAIRS_PER_EDGE * edges:
            return None
        return (
            f"pays off on cpu from {MIN_PAIRS_PER_EDGE} pairs per edge in the blockwise kernel's non-empty tiles "
            f"(here {pairs / max(edges, 1):.1f}: {edges} edges among {call.T} nodes): blockwise or dense is faster"
        )

    def run(self, call):
        return kernel.attend(call)


SPARSE = Sparse()
