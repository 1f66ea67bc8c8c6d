"""attnlab: self-attention as pure, jit-able JAX functions.

Layout follows ``jax.nn.dot_product_attention``: queries ``[..., T, N, H]``, keys and values
``[..., S, K, H]``. See README.md for a tour.
"""

from attnlab import dispatch, efficient, kernels, masks, parallel, platform, positional, scores, tuning
from attnlab import flax as flax  # attnlab.flax.attention_fn: Flax's attention_fn (imports flax only to sow weights)
from attnlab.attention import (
    IMPLEMENTATIONS,
    attention,
    attention_reference,
    attention_weights,
    masked_softmax,
)
from attnlab.dispatch import explain
from attnlab.dropin import dot_product_attention
from attnlab.heads import init_multi_head_params, merge_heads, multi_head_attention, split_heads
from attnlab.platform import lowering_for
from attnlab.tuning import autotune

__version__ = "0.1.0"

# Loaded on first use (`attnlab.nn.Encoder`, `attnlab.train.train`, `attnlab.inspect.capture`, ...): they
# pull in flax, optax, orbax and the data libraries, which the attention functions above do not need.
# `import attnlab.nn` works too.
_LAZY_MODULES = ("data", "decoding", "inspect", "nn", "testing", "train")


def __getattr__(name):
    if name in _LAZY_MODULES:
        import importlib

        module = importlib.import_module(f"attnlab.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY_MODULES})


__all__ = [  # the lazily loaded modules are not in __all__: `from attnlab import *` stays light
    "IMPLEMENTATIONS",
    "attention",
    "attention_reference",
    "attention_weights",
    "autotune",
    "dispatch",
    "dot_product_attention",
    "efficient",
    "explain",
    "kernels",
    "init_multi_head_params",
    "lowering_for",
    "masked_softmax",
    "masks",
    "merge_heads",
    "multi_head_attention",
    "parallel",
    "platform",
    "positional",
    "scores",
    "split_heads",
    "tuning",
]
