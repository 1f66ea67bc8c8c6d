"""The O(E) edge-list kernel as an implementation: ``attnlab.kernels.sparse``."""

from __future__ import annotations

from attnlab.impls.base import Implementation
from attnlab.kernels import sparse as kernel

__all__ = ["SPARSE"]


class Sparse(Implementation):
    """Segment softmax along a graph's edge list (``masks.graph_edges``)."""

    name = "sparse"

    def supports(self, call, backend):
        return kernel.call_reason(call)

    def run(self, call):
        return kernel.attend(call)


SPARSE = Sparse()
