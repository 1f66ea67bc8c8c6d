"""cuDNN's fused flash attention (through ``jax.nn``) as an implementation: ``attnlab.kernels.cudnn``."""

from __future__ import annotations

from attnlab.impls.base import Implementation
from attnlab.kernels import cudnn as kernel

__all__ = ["CUDNN"]


class Cudnn(Implementation):
    """GPU only: bf16/fp16, H % 8 == 0, masks with a flag form (causal, left windows, padding)."""

    name = "cudnn"

    def supports(self, call, backend):
        return kernel.supports_call(call, backend)

    def run(self, call):
        return kernel.attend(call)


CUDNN = Cudnn()
