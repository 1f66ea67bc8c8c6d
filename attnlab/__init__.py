"""attnlab: self-attention as pure, jit-able JAX functions.

Layout follows ``jax.nn.dot_product_attention``: queries ``[..., T, N, H]``, keys and values
``[..., S, K, H]``. See README.md for a tour.
"""

from attnlab import dispatch, efficient, kernels, masks, parallel, positional, scores
from attnlab.attention import (
    IMPLEMENTATIONS,
    attention,
    attention_reference,
    attention_weights,
    masked_softmax,
)
from attnlab.dispatch import explain
from attnlab.heads import init_multi_head_params, merge_heads, multi_head_attention, split_heads

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATIONS",
    "attention",
    "attention_reference",
    "attention_weights",
    "dispatch",
    "efficient",
    "explain",
    "kernels",
    "init_multi_head_params",
    "masked_softmax",
    "masks",
    "merge_heads",
    "multi_head_attention",
    "parallel",
    "positional",
    "scores",
    "split_heads",
]
