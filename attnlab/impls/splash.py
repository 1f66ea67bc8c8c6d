"""jax's TPU splash kernel as an implementation: ``attnlab.kernels.splash``, loaded lazily.

TPU: splash attention fed by attnlab masks (static structure, traced padding lengths), fp32/bf16,
Hv == H, no bias (interpret mode when lowered for CPU). Its whole protocol is here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.impls.base import LazyImplementation, static_scale_reason
from attnlab.impls.pallas import dtype_reason

__all__ = ["SPLASH", "Splash"]

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _structure_reason(rest, N) -> str | None:
    """Why splash cannot take the non-padding part of a mask, or None."""
    if rest is None:
        return None
    if not rest.is_static:
        return "splash: the mask's structure must be known at trace time (only padding lengths may be traced)"
    shape = jax.eval_shape(rest, jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)).shape
    if len(shape) > 3 or (len(shape) == 3 and shape[0] not in (1, N)):
        return f"splash: masks may depend on the head but not on the batch (mask values of shape {shape})"
    return None


class Splash(LazyImplementation):
    """jax's TPU splash attention (``attnlab.kernels.splash``)."""

    def __init__(self):
        super().__init__("splash", "attnlab.kernels.splash")

    def check(self, call, backend):
        """None when splash can run the bound call on ``backend``, else the reason (shapes and mask structure
        only). ``backend="tpu"`` runs the Mosaic kernel, ``"cpu"`` the same kernel in Pallas interpret mode
        (slow, for tests); GPUs are not splash's target (use ``"cudnn"`` or ``"pallas"``)."""
        if (reason := static_scale_reason("splash", call)) is not None:
            return reason
        if backend not in ("tpu", "cpu"):
            return f"splash: a TPU kernel (backend {backend!r}; use 'cudnn' or 'pallas' on GPUs)"
        if not call.score.is_dot:
            return f"splash: dot-product score only (got score {type(call.score).__name__})"
        if call.bias is not None:
            return "splash: no bias"
        reason = dtype_reason("splash", call, _DTYPES)
        if reason is not None:
            return reason
        if call.Hv != call.H:
            return f"splash: needs Hv == H (got H={call.H}, Hv={call.Hv})"
        rest = None if call.mask is None else call.mask.split_padding()[1]
        return _structure_reason(rest, call.N)


SPLASH = Splash()
