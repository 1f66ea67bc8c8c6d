"""The Pallas (Triton) flash kernel as an implementation: ``attnlab.kernels.pallas_flash``, loaded lazily.

GPU: block-sparse flash attention in Triton, every attnlab mask, fp32/bf16/fp16, no bias (interpret
mode when lowered for CPU).
"""

from attnlab.impls.base import LazyImplementation

__all__ = ["PALLAS"]

PALLAS = LazyImplementation("pallas", "attnlab.kernels.pallas_flash")
