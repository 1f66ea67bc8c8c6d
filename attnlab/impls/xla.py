"""Dense XLA attention: ``jax.nn.dot_product_attention(implementation="xla")``'s program as an attnlab implementation.

Dot score, Hv == H. The same einsums and fp32 softmax as jax.nn (``dense_attention``), with attnlab's
conventions: a masked logit is ``-inf`` (jax.nn fills it with a finite ``-0.7 * max``, which would beat
an allowed logit of ``finfo.min``), a ``-inf`` bias means "not allowed", and a row with nothing to
attend to returns zeros with zero gradients (jax.nn spreads it uniformly, or gives NaN when a bias
empties it).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import numerics, platform
from attnlab.call import Call
from attnlab.impls.base import Implementation
from attnlab.impls.reference import dense_bias
from attnlab.kernels import tile_core

__all__ = [
    "XLA",
    "XLA_MAX_LOGITS_BYTES",
    "FUSED_MAX_ROWS",
    "KEY_MAJOR_SIZES",
    "FORMS",
    "dense_form",
    "dense_attention",
]

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


def _dense_one_group(q, k, v, bias, allowed, empty, scale):
    """One query head per key head: ``q [B, T, K, H]``, ``k, v [B, S, K, H]``, ``bias`` / ``allowed``
    ``[B|1, K|1, T|1, S|1]``, ``empty [B|1, K|1, T|1, 1]`` (each may be None)."""
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32)
    logits = logits * jnp.asarray(scale, jnp.float32)
    if bias is not None:
        logits = logits + bias
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)  # a select in the logits' kernel, as jax.nn's mask
    if empty is None:
        return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)
    probs = tile_core.softmax_rows(logits, empty)
    out = jnp.einsum("BNTS,BSNH->BTNH", probs.astype(v.dtype), v)
    return jnp.where(jnp.swapaxes(empty, 1, 2), 0.0, out)  # [B|1, T|1, K|1, 1]


def _dense_key_major(q, k, v, bias, allowed, empty, scale):
    """Few query rows: both products with the keys and values in their own ``[B, S, K*H]`` layout.

    jax.nn's products take k and v heads-first (``[B, K, S, H]``), a copy of each that, with few query
    rows, costs more than the products (docs/kernels.md, "Dense XLA: few query rows"). Here the queries
    become a block-diagonal ``[B, K*H, T*N]`` matrix (query head n's H values in key head kv(n)'s rows,
    zeros elsewhere), so the logits are one matmul ``k @ q_bd`` ``[B, S, T*N]`` and the output ``p @ v``
    ``[B, T*N, K*Hv]`` of which each head keeps its own key head's block: K times the products' work, on
    arrays that stay where they are. Same arguments as ``_dense_one_group``, any number of query heads per
    key head. The products meet every key head's values with zeros, so a NaN in one key head's k or v
    reaches the other heads' rows too (docs/conventions.md, "Non-finite keys and values")."""
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    own = (jnp.arange(N) // (N // K))[:, None] == jnp.arange(K)[None, :]  # [N, K]: head n reads key head kv(n)
    q_bd = jnp.where(own[:, :, None], q[:, :, :, None, :], jnp.zeros((), q.dtype))  # [B, T, N, K, H]
    q_bd = q_bd.transpose(0, 3, 4, 1, 2).reshape(B, K * H, T * N)
    logits = jnp.einsum("BSC,BCM->BSM", k.reshape(B, S, K * H), q_bd, preferred_element_type=jnp.float32)
    logits = logits.reshape(B, S, T, N).transpose(0, 3, 2, 1) * jnp.asarray(scale, jnp.float32)  # [B, N, T, S]
    if bias is not None:
        logits = logits + bias
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1) if empty is None else tile_core.softmax_rows(logits, empty)
    out = jnp.einsum(
        "BMS,BSC->BMC", probs.reshape(B, N * T, S).astype(v.dtype), v.reshape(B, S, K * Hv),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    out = jnp.einsum("BNTKH,NK->BTNH", out.reshape(B, N, T, K, Hv), own.astype(jnp.float32)).astype(v.dtype)
    return out if empty is None else jnp.where(jnp.swapaxes(empty, 1, 2), 0.0, out)  # [B|1, T|1, N|1, 1]


# On the CPU, a call with one query head per key head written without jax.nn's map over the group
# compiles to one XLA:CPU kernel for both products and the softmax. With a batch of two rows or more and
# at most this many query rows over its batch and heads (B * N * T), that kernel was faster than jax.nn's
# at most calls of `make dense-fusion` (docs/kernels.md) and at most 13% slower at the others; with one
# row, up to 17% slower; beyond this size, up to 1.75x slower at some shapes and faster at others, with
# no rule of shapes that told them apart.
FUSED_MAX_ROWS = 3072

# On the CPU, the key-major form (``_dense_key_major``) for a call of at most T query rows per head whose
# k holds at least this many elements B * S * K * H: (T, elements) pairs, the first that T fits. Smaller
# k stays in cache, where jax.nn's copies are cheap and the key-major form's K-fold products cost more.
# `make dense-fusion`'s few-queries grid (docs/kernels.md, two runs, N = K = 8, H = 64): every call these
# bounds admit is faster key-major in both runs, forward and forward+backward; from T = 8, or at T = 4
# below 2**22 elements, forward+backward was slower in a run.
KEY_MAJOR_SIZES = ((2, 2**20), (4, 2**22))

FORMS = ("mapped", "fused", "key_major")


def dense_form(B: int, N: int, K: int, T: int, S: int, H: int, backend: str | None = None) -> str:
    """The form ``dense_attention`` runs, from shapes (leading dims flattened into ``B``) and the backend
    (default ``attnlab.platform.target()``): on the CPU, ``"key_major"`` for few query rows over a large k
    (``KEY_MAJOR_SIZES``); else ``"fused"`` for one query head per key head, two or more batch rows and at
    most ``FUSED_MAX_ROWS`` query rows ``B * N * T``; else, and on GPU and TPU, jax.nn's ``"mapped"``
    program."""
    if platform.normalize(backend) != "cpu":
        return "mapped"
    if any(T <= t and B * S * K * H >= size for t, size in KEY_MAJOR_SIZES):
        return "key_major"
    if K == N and B >= 2 and B * N * T <= FUSED_MAX_ROWS:
        return "fused"
    return "mapped"


def dense_attention(q, k, v, bias=None, allowed=None, empty=None, scale=None, *, form=None):
    """jax.nn's XLA program, with attnlab's empty rows: ``q [B, T, N, H]``, ``k, v [B, S, K, H]``, an fp32
    ``bias`` and a bool ``allowed`` ``[B|1, N|1, T|1, S|1]`` and ``empty [B|1, N|1, T|1, 1]`` (the rows
    with no allowed key above a -inf bias; None only when no row is empty) -> ``[B, T, N, H]``.

    ``form`` (default ``dense_form(...)``, the measured rule) picks one of three programs, each with the
    fp32 softmax and the mask as a select on the logits:

    - ``"mapped"``: jax.nn's (``jax.nn.dot_product_attention(implementation="xla")``): the same einsums and
      layouts, one key head per query head mapped over the G query heads of a key head, so XLA fuses them
      alike;
    - ``"fused"``: with one query head per key head, no map over the group, which XLA:CPU compiles to one
      kernel for both products and the softmax;
    - ``"key_major"``: few query rows, k and v read in their own layout (``_dense_key_major``).

    An empty row is zeroed after the product (``tile_core.softmax_rows``), a select on the output where a
    guarded softmax would split XLA:CPU's fused logits kernel.

    Raises:
        ValueError: an unknown ``form``; ``form="fused"`` with several query heads per key head.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    if form is None:
        form = dense_form(B, N, K, T, S, H)
    if form not in FORMS:
        raise ValueError(f"dense_attention: form must be one of {FORMS}, got {form!r}")
    if form == "key_major":
        return _dense_key_major(q, k, v, bias, allowed, empty, scale)
    one = functools.partial(_dense_one_group, scale=scale)
    if form == "fused":
        if K != N:
            raise ValueError(f"dense_attention: form='fused' needs one query head per key head, got N={N}, K={K}")
        return one(q, k, v, bias, allowed, empty)
    extras, axes = [], []
    for x in (bias, allowed, empty):
        grouped = x is not None and x.shape[1] != 1
        extras.append(x.reshape(x.shape[0], K, N // K, *x.shape[2:]) if grouped else x)
        axes.append(2 if grouped else None)
    group = jax.vmap(lambda qg, xs: one(qg, k, v, *xs), in_axes=(3, tuple(axes)), out_axes=3)
    return group(q.reshape(B, T, K, N // K, H), tuple(extras)).reshape(B, T, N, -1)


# A mask known at trace time (no traced data) is evaluated then, up to this many pairs, to find its empty
# rows: with none, the call compiles to jax.nn's program with no zeroing at all.
STATIC_ROWS_PAIRS = 2**22


def _static_empty_rows(call: Call):
    """numpy bool ``[..., T, 1]``, True on the rows the (static) mask empties, or None when it empties none."""
    with jax.ensure_compile_time_eval():
        has = np.asarray(jnp.any(call.mask.dense(call.T, call.S), axis=-1, keepdims=True))
    return None if has.all() else ~has


def run_xla(call: Call):
    if call.empty:  # T = 0 or S = 0: jax.nn cannot reshape empty arrays
        return call.zeros()
    lead, dtype = call.lead, call.dtype
    bias = dense_bias(call)
    b4 = None if bias is None else _to_bnts(bias.astype(jnp.float32), lead)  # [B|1, N|1, T|1, S|1], fp32 as jax.nn
    a4 = None if call.mask is None or call.mask.is_full else _to_bnts(call.mask.dense(call.T, call.S), lead)
    empty4 = None  # a -inf bias means "not allowed", as in the reference; a row with nothing allowed is zeroed
    if b4 is None and a4 is not None:
        if call.mask.is_static and call.T * call.S <= STATIC_ROWS_PAIRS:  # found now: nothing at run time
            empty = _static_empty_rows(call)
            empty4 = None if empty is None else jnp.asarray(_to_bnts(empty, lead))
        else:  # traced mask data: one reduction at run time
            empty4 = ~jnp.any(a4, axis=-1, keepdims=True)  # [B|1, N|1, T|1, 1]
    elif b4 is not None:  # a float max: one vectorised reduction (NaN stays NaN: not empty)
        allowed = b4 if a4 is None else jnp.where(a4, b4, -jnp.inf)
        empty4 = jnp.max(allowed, axis=-1, keepdims=True) == -jnp.inf
    # XLA:CPU has no fp16 x fp16 -> fp32 dot and its small-shape bf16 emitter rejects a BF16_BF16_F32
    # dot: half precision is computed in fp32 there.
    compute = numerics.compute_dtype(dtype)
    q4, k4, v4 = (x.astype(compute).reshape((-1,) + x.shape[-3:]) for x in (call.q, call.k, call.v))  # [B, T, N, H]
    out = dense_attention(q4, k4, v4, b4, a4, empty4, call.score.scale)
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
