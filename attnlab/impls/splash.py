"""jax's TPU splash kernel as an implementation: ``attnlab.kernels.splash``, loaded lazily.

TPU: splash attention fed by attnlab masks (static structure, traced padding lengths), fp32/bf16,
Hv == H, no bias (interpret mode when lowered for CPU).
"""

from attnlab.impls.base import LazyImplementation

__all__ = ["SPLASH"]

SPLASH = LazyImplementation("splash", "attnlab.kernels.splash")
