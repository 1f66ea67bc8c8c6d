"""Fast attention kernels, each tested against ``attnlab.attention_reference``.

* ``blockwise``: flash-style online softmax over the non-empty tiles of a mask's block layout,
  O(T + S) memory forward and backward (``attention(..., implementation="blockwise")``).
* ``sparse``: attention along a graph's edge list with a segment softmax, O(E)
  (``attention(..., mask=masks.graph_edges(...), implementation="sparse")``).
"""

from attnlab.kernels.blockwise import BlockSizes, block_schedule, blockwise_attention, default_block_sizes
from attnlab.kernels.sparse import sparse_attention

__all__ = ["BlockSizes", "block_schedule", "blockwise_attention", "default_block_sizes", "sparse_attention"]
