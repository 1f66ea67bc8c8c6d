"""cuDNN's fused flash attention (through ``jax.nn``) as an implementation: ``attnlab.kernels.cudnn``."""

from __future__ import annotations

from attnlab.impls.base import Implementation, static_scale_reason
from attnlab.kernels import cudnn as kernel

__all__ = ["CUDNN"]


class Cudnn(Implementation):
    """GPU only: bf16/fp16, H % 8 == 0, masks with a flag form (causal, left windows, padding)."""

    name = "cudnn"

    def supports(self, call, backend):
        """None when cuDNN's fused attention can run the bound call on ``backend``, else the reason (shapes only)."""
        if backend != "gpu":
            return f"needs a GPU backend (this is {backend})"
        if (reason := static_scale_reason("cudnn", call)) is not None:
            return reason
        if not call.score.is_dot:
            return f"supports score='dot' only (got score {type(call.score).__name__})"
        if call.bias is not None:
            return "takes no bias here (not mapped to cuDNN; xla and blockwise take one)"
        if call.dtype.name not in kernel.CUDNN_DTYPES:
            return f"takes bf16/fp16 (cuDNN flash attention), got dtype {call.dtype.name}"
        H, Hv = call.H, call.Hv
        if H % 8 or H > kernel.CUDNN_MAX_HEAD_DIM:
            return f"needs a head dim that is a multiple of 8 up to {kernel.CUDNN_MAX_HEAD_DIM}, got H={H}"
        if Hv != H:
            return f"needs Hv == H, got Hv={Hv}, H={H}"
        flags = kernel.cudnn_flags(call.mask)
        return flags if isinstance(flags, str) else None

    def run(self, call):
        return kernel.attend(call)


CUDNN = Cudnn()
