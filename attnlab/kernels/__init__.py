"""Fast attention kernels, each tested against ``attnlab.attention_reference``.

* ``blockwise``: flash-style online softmax over the non-empty tiles of a mask's block layout,
  O(T + S) memory forward and backward (``attention(..., implementation="blockwise")``).
* ``sparse``: attention along a graph's edge list with a segment softmax, O(E)
  (``attention(..., mask=masks.graph_edges(...), implementation="sparse")``).
* ``ring``: ring attention across devices (the blockwise block step over key/value shards that
  travel with ``lax.ppermute``); called through ``attnlab.parallel.attention(..., seq_axis=...)``.
"""

from attnlab.kernels.blockwise import BlockSizes, blockwise_attention, default_block_sizes
from attnlab.kernels.schedule import Schedule
from attnlab.kernels.sparse import sparse_attention

__all__ = ["BlockSizes", "Schedule", "blockwise_attention", "default_block_sizes", "sparse_attention"]
