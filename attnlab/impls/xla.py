"""``jax.nn.dot_product_attention(implementation="xla")`` as an attnlab implementation.

Dot score, Hv == H. attnlab's conventions on top of jax.nn: the mask goes in as ``-inf`` in an fp32
bias (jax.nn fills masked logits with a finite ``-0.7 * max``, which would beat an allowed logit of
``finfo.min``), and a row with nothing to attend to returns zeros (jax.nn spreads it uniformly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab import numerics
from attnlab.call import Call
from attnlab.impls.base import Implementation
from attnlab.impls.reference import dense_bias

__all__ = ["XLA", "XLA_MAX_LOGITS_BYTES"]

# On GPU/TPU, implementation=None uses dense XLA only while its fp32 [B, N, T, S] logits take at most
# this many bytes (XLA keeps logits and probabilities, and the backward more): beyond, the tiled kernels.
XLA_MAX_LOGITS_BYTES = 2 * 2**30


def _to_bnts(x, lead):
    """[..., N|1, T|1, S|1] (any rank <= len(lead)+3) -> [B|1, N|1, T|1, S|1] for jax.nn."""
    x = x.reshape((1,) * (len(lead) + 3 - x.ndim) + tuple(x.shape))
    if all(d == 1 for d in x.shape[: len(lead)]):
        return x.reshape((1,) + x.shape[len(lead) :])
    x = jnp.broadcast_to(x, tuple(lead) + x.shape[len(lead) :])
    return x.reshape((-1,) + x.shape[len(lead) :])


def run_xla(call: Call):
    if call.empty:  # T = 0 or S = 0: jax.nn cannot reshape empty arrays
        return call.zeros()
    lead, dtype = call.lead, call.dtype
    allowed = None if call.mask is None or call.mask.is_full else call.mask.dense(call.T, call.S)
    bias = dense_bias(call)
    if bias is not None:
        bias = bias.astype(jnp.float32)  # stays fp32: jax.nn adds it to fp32 logits
        finite = bias != -jnp.inf  # a -inf bias means "not allowed", as in the reference
        allowed = finite if allowed is None else allowed & finite
    b4 = None if bias is None else _to_bnts(bias, lead)  # [B|1, N|1, T|1, S|1]
    any4 = None
    if allowed is not None:
        a4 = _to_bnts(allowed, lead)
        any4 = jnp.any(a4, axis=-1, keepdims=True)  # [B|1, N|1, T|1, 1]
        b4 = jnp.where(a4, jnp.float32(0) if b4 is None else b4, -jnp.inf)
        b4 = jnp.where(any4, b4, 0.0)  # a row with nothing allowed: any finite row (no NaN), zeroed below
    # XLA:CPU has no fp16 x fp16 -> fp32 dot (jax.nn's backward needs it) and its small-shape bf16
    # emitter rejects jax.nn's BF16_BF16_F32 dot: half precision is computed in fp32 there.
    compute = numerics.compute_dtype(dtype)
    q4, k4, v4 = (x.astype(compute).reshape((-1,) + x.shape[-3:]) for x in (call.q, call.k, call.v))  # [B, T, N, H]
    out = jax.nn.dot_product_attention(q4, k4, v4, bias=b4, scale=call.score.scale, implementation="xla")
    if any4 is not None:
        out = out * jnp.swapaxes(any4[..., 0], -1, -2)[..., None].astype(out.dtype)  # -> [B|1, T|1, N|1, 1]
    return out.reshape(lead + out.shape[1:]).astype(dtype)


class Xla(Implementation):
    """jax.nn's XLA attention (dense logits): dot score, Hv == H."""

    name = "xla"

    def supports(self, call, backend):
        if not call.score.is_dot:
            return f"supports score='dot' only (got score {type(call.score).__name__})"
        if call.Hv != call.H:
            return f"needs Hv == H (jax.nn), got q {tuple(call.q.shape)} and v {tuple(call.v.shape)}"
        return None

    def pays_off(self, call, backend):
        if backend == "cpu":
            return None
        size = 4 * call.batch * call.N * call.T * call.S
        if size > XLA_MAX_LOGITS_BYTES:
            limit = XLA_MAX_LOGITS_BYTES / 2**30
            gib = size / 2**30
            return f"dense fp32 logits [B, N, T, S] take {gib:.1f} GiB > XLA_MAX_LOGITS_BYTES = {limit:.0f} GiB"
        return None

    def run(self, call):
        return run_xla(call)


XLA = Xla()
