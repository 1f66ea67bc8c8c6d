"""Attention implementations, one object per file, all with one signature (``attnlab.impls.base``).

======================  =====================================================================
``reference``           dense fp32, any mask / bias / score, dropout and lse (the judge)
``xla``                 ``jax.nn.dot_product_attention`` (XLA), dot score, Hv == H
``blockwise``           flash-style, skips the mask's EMPTY tiles, O(T + S) memory, dropout, lse
``sparse``              segment softmax along a ``masks.graph_edges`` edge list, O(E)
``cudnn``               cuDNN's fused kernel through jax.nn (GPU; causal, left windows, padding)
``mosaic``              a Hopper forward in Mosaic GPU (TMA, wgmma) + the Triton backward, loaded lazily
``pallas``              block-sparse flash attention in Triton (GPU), loaded lazily
``splash``              jax's TPU splash kernel, loaded lazily
======================  =====================================================================

Ring attention (``attnlab.kernels.ring``) runs across devices and is reached through
``attnlab.parallel.attention(..., seq_axis=...)``, not through this registry.
"""

from attnlab.impls.base import Implementation, LazyImplementation, LazyKernel
from attnlab.impls.blockwise import BLOCKWISE, BLOCKWISE_GQA_MIN_PAIRS, BLOCKWISE_MAX_VISITED, BLOCKWISE_MIN_PAIRS
from attnlab.impls.cudnn import CUDNN
from attnlab.impls.mosaic import MOSAIC
from attnlab.impls.pallas import PALLAS
from attnlab.impls.reference import REFERENCE
from attnlab.impls.sparse import SPARSE
from attnlab.impls.splash import SPLASH
from attnlab.impls.xla import XLA, XLA_MAX_LOGITS_BYTES

ALL: tuple[Implementation, ...] = (REFERENCE, XLA, BLOCKWISE, SPARSE, CUDNN, MOSAIC, PALLAS, SPLASH)

__all__ = [
    "ALL",
    "BLOCKWISE",
    "BLOCKWISE_MAX_VISITED",
    "BLOCKWISE_GQA_MIN_PAIRS",
    "BLOCKWISE_MIN_PAIRS",
    "CUDNN",
    "Implementation",
    "LazyImplementation",
    "LazyKernel",
    "MOSAIC",
    "PALLAS",
    "REFERENCE",
    "SPARSE",
    "SPLASH",
    "XLA",
    "XLA_MAX_LOGITS_BYTES",
]
