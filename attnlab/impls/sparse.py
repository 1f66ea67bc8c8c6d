"""The O(E) edge-list kernel as an implementation: ``attnlab.kernels.sparse``."""

from __future__ import annotations

from attnlab.impls.base import Implementation
from attnlab.kernels import sparse as kernel

__all__ = ["SPARSE"]


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

    def run(self, call):
        return kernel.attend(call)


SPARSE = Sparse()
