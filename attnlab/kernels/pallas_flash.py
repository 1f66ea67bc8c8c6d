"""Block-sparse flash attention as a Pallas kernel (Triton backend on GPU, interpret mode on CPU).

The same tiling as ``attnlab.kernels.blockwise`` (FlashAttention, Dao et al. 2022, arXiv
2205.14135; online softmax, Milakov & Gimelshein 2018, arXiv 1805.02867), but each (batch, head,
query block) is one kernel program that loops over *its own list* of non-empty key blocks:

* the mask's ``block_layout(T, S, bq, bk)`` becomes a schedule ``[nq, 2, J]`` (key block index,
  kind) passed to the kernel as an ordinary int32 input (the Triton backend has no scalar
  prefetch); EMPTY tiles are not in the list, so they are never loaded;
* FULL tiles run without any mask; PARTIAL tiles evaluate the mask per element: structural masks
  (causal, window, chunks, dilated, block band, 2-D window, and their ``&``/``|``) are evaluated
  inside the kernel from ``iota`` positions; data masks (graph adjacency, dense arrays, global
  tokens, random blocks) become per-tile int8 bitmaps ``[Bm, Nm, nq, J, bq, bk]`` made outside the
  kernel for the visited tiles only; padding lengths (concrete or traced) are a kernel input
  ``[B, 2]`` (q_len, kv_len), so a traced length never recompiles and never densifies the layout
  of the structural part; a PARTIAL tile found empty at run time is skipped;
* a short last key block (odd S) is PARTIAL and its tail masked; T and S are padded to whole
  blocks, head dims to a power of two >= 16 (Triton's tensor sizes are powers of two);
* statistics and accumulation in fp32 whatever the input dtype (bf16/fp16/fp32); a row with no
  allowed key returns zeros, with zero gradients;
* backward (``jax.custom_vjp``): a dq kernel over query blocks (same schedule) and a dk/dv kernel
  over key blocks (the transposed schedule), both recomputing probabilities from the stored
  log-sum-exp. GQA: query head n reads kv head n // G through the index maps; the dk/dv kernel
  runs per (batch, kv head, key block) and loops over its G query heads, so dk/dv are accumulated
  in registers once per kv head (no G x buffer, no reduction afterwards).

Kernel or interpreter is chosen per *lowering platform* with ``jax.lax.platform_dependent``: on
CPU the kernel runs in Pallas interpret mode (so the tests check the kernel's own logic), on CUDA
and ROCm it lowers to the Triton custom call, so ``jax.export(..., platforms=["cuda"])`` from a CPU
host contains the real kernel.

Shape legend (as ``jax.nn.dot_product_attention``):
    B    batch (leading dims flattened)      T, S  query / key length
    N    query heads, K kv heads, G = N // K H, Hv  head dims (Hp, Hvp padded)
    nq, nk  query / key blocks              bq, bk  block sizes   J, I  schedule widths
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from attnlab import masks as masks_lib
from attnlab.kernels import _tiles
from attnlab.kernels._support import dot_call_reason

__all__ = ["supports", "pallas_attention", "DEFAULT_BLOCK"]

_NEG = -0.7 * float(np.finfo(np.float32).max)
LENGTHS = 3  # schedule kind: a tile the mask fills (FULL) that only padding lengths may cut
DEFAULT_BLOCK = 64  # bq = bk on GPU: 64 x 64 tiles fit Triton's shared memory for H <= 256
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_HEAD_DIM = 256

# Masks whose __call__ is plain integer arithmetic on the positions (no arrays, no constants):
# evaluated inside the kernel. Everything else becomes per-tile bitmaps.
_STRUCTURAL = (
    masks_lib.Full,
    masks_lib.Causal,
    masks_lib.Window,
    masks_lib.Chunks,
    masks_lib.Dilated,
    masks_lib.BlockBand,
    masks_lib.Window2D,
)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ------------------------------------------------------------------------------------------
# What the kernel supports (shapes only)


def supports(q, k, v, *, mask=None, bias=None, score="dot", backend=None) -> str | None:
    """None when ``pallas_attention`` can run this call, else the reason it cannot.

    Looks at shapes and dtypes only, so it works on ``jax.ShapeDtypeStruct``s and for a backend
    other than the current one (``"gpu"``: the Triton kernel; ``"cpu"``: the same kernel in
    Pallas interpret mode, slow, for tests; ``"tpu"``: not this kernel, use splash).
    """
    del mask  # every attnlab mask works: structural ones in-kernel, the rest as tile bitmaps
    backend = jax.default_backend() if backend is None else backend
    if backend == "tpu":
        return "pallas: the Triton kernel is for GPUs; on TPU use 'splash'"
    if backend not in ("gpu", "cuda", "rocm", "cpu"):
        return f"pallas: unknown backend {backend!r}"
    reason = dot_call_reason(
        "pallas", q, k, v, score=score, bias=bias, dtypes=_DTYPES, bias_hint=" (use 'blockwise' for a callable bias)"
    )
    if reason is not None:
        return reason
    if max(q.shape[-1], v.shape[-1]) > _MAX_HEAD_DIM:
        return f"pallas: head dims up to {_MAX_HEAD_DIM} (got H={q.shape[-1]}, Hv={v.shape[-1]})"
    return None


# ------------------------------------------------------------------------------------------
# Mask decomposition: padding lengths, an in-kernel structural part, a bitmap data part


def _is_structural(m) -> bool:
    if isinstance(m, (masks_lib.And, masks_lib.Or)):
        return _is_structural(m.a) and _is_structural(m.b)
    return isinstance(m, _STRUCTURAL)


def _factors(m):
    if isinstance(m, masks_lib.And):
        return _factors(m.a) + _factors(m.b)
    return [m]


def _and_all(ms):
    return functools.reduce(lambda a, b: a & b, ms) if ms else None


def _split(m):
    """mask -> (list of Padding factors, structural mask or None, data mask or None)."""
    pads, struct, data = [], [], []
    for f in _factors(m) if m is not None else []:
        if isinstance(f, masks_lib.Padding):
            pads.append(f)
        elif isinstance(f, masks_lib.Full):
            continue
        elif _is_structural(f):
            struct.append(f)
        elif isinstance(f, masks_lib.GraphEdges):  # scatter the edges once, not once per tile
            data.append(masks_lib.Graph(f.adjacency()))
        else:
            data.append(f)
    return pads, _and_all(struct), _and_all(data)


def _lengths(pads, lead, T, S):
    """Padding factors -> int32 [B, 2] (q_len, kv_len), the minimum over factors."""
    B = math.prod(lead)
    ql = jnp.full(lead, T, jnp.int32)
    kl = jnp.full(lead, S, jnp.int32)

    def fit(x, name):
        x = jnp.asarray(x, jnp.int32)
        extra = x.ndim - len(lead)
        if extra > 0:
            if any(d != 1 for d in x.shape[:extra]):
                raise ValueError(f"padding {name} of shape {x.shape} does not match the batch dims {lead}")
            x = x.reshape(x.shape[extra:])
        try:
            return jnp.broadcast_to(x, lead)
        except ValueError:
            raise ValueError(f"padding {name} of shape {x.shape} does not match the batch dims {lead}") from None

    for p in pads:
        if p.q_lengths is not None:
            ql = jnp.minimum(ql, fit(p.q_lengths, "q_lengths"))
        if p.kv_lengths is not None:
            kl = jnp.minimum(kl, fit(p.kv_lengths, "kv_lengths"))
    return jnp.stack([ql.reshape(B), kl.reshape(B)], -1)


def _tile_bitmaps(data, qb, kb, st):
    """data mask on tiles (qb[p], kb[p]) -> int8 [Bm, Nm, P, bq, bk] (Bm in {1, B}, Nm in {1, N})."""
    nl = len(st.lead)

    def one(i, j):
        q_pos = jnp.minimum(i * st.bq + jnp.arange(st.bq, dtype=jnp.int32), st.T - 1)
        k_pos = jnp.minimum(j * st.bk + jnp.arange(st.bk, dtype=jnp.int32), st.S - 1)
        x = data(q_pos, k_pos)
        x = x.reshape((1,) * (nl + 3 - x.ndim) + tuple(x.shape))  # -> [*lead|1, N|1, bq, bk]
        if any(d != 1 for d in x.shape[:nl]):
            x = jnp.broadcast_to(x, st.lead + x.shape[nl:])
        x = x.reshape((-1,) + x.shape[nl:])  # [Bm, Nm, bq, bk]
        return jnp.broadcast_to(x, x.shape[:2] + (st.bq, st.bk)).astype(jnp.int8)

    out = jax.vmap(one)(jnp.asarray(qb), jnp.asarray(kb))  # [P, Bm, Nm, bq, bk]
    return jnp.moveaxis(out, 0, 2)


def _schedule(layout, J=None):
    """layout int [n_rows, n_cols] -> int32 [n_rows, 2, J] (column index; kind), J a power of two."""
    index, kind = _tiles.layout_rows(layout)
    J = _next_pow2(index.shape[1]) if J is None else J
    sched = np.zeros((layout.shape[0], 2, J), np.int32)
    sched[:, 0, : index.shape[1]] = index
    sched[:, 1, : kind.shape[1]] = kind
    return sched


# ------------------------------------------------------------------------------------------
# The kernels


@dataclasses.dataclass(frozen=True)
class _Static:
    T: int
    S: int
    bq: int
    bk: int
    lead: tuple
    N: int
    K: int
    H: int
    Hv: int
    scale: float
    struct: object  # structural mask (hashable, no leaves) or None
    has_bitmap: bool
    bm_shape: tuple  # (Bm, Nm)
    kinds: tuple  # kinds present in the forward schedule, e.g. (2,) for full attention
    kinds_t: tuple
    fp32: bool
    num_warps: int
    num_stages: int

    @property
    def groups(self) -> int:
        return self.N // self.K  # G


def _dot(a, b, st, *, ta=False, tb=False):
    """fp32 a @ b (a^T / b^T when ta / tb), fp32 accumulation."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = jax.lax.Precision.HIGHEST if st.fp32 else None
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _allowed(st, q_pos, k_pos, lens_ref, bm_ref, bm_idx, with_mask=True):
    """bool [bq, bk] for a PARTIAL tile: in range, within the lengths, the mask, the bitmap.

    ``with_mask=False`` (a LENGTHS tile: the mask is FULL there, only padding may cut it) checks the
    lengths alone.
    """
    q_len, kv_len = lens_ref[0], lens_ref[1]
    ok = (k_pos < jnp.minimum(kv_len, st.S))[None, :] & (q_pos < q_len)[:, None]
    if with_mask and st.struct is not None:
        ok = ok & st.struct(q_pos, k_pos)
    if with_mask and st.has_bitmap:
        ok = ok & (bm_ref[bm_idx] != 0)
    return ok


def _visit(st, kinds, kd, tile, carry, ok_fn):
    """Runs ``tile(carry, ok)`` for the tile's kind: FULL (ok=None), PARTIAL (mask and lengths) or
    LENGTHS (lengths only); a masked tile found all False at run time is skipped."""

    def full(c):
        return tile(c, None)

    def masked(c, with_mask):
        ok = ok_fn(with_mask)
        any_ok = jnp.max(ok.astype(jnp.int32)) > 0
        return jax.lax.cond(any_ok, lambda c: tile(c, ok), lambda c: c, c)

    branches = {
        masks_lib.PARTIAL: functools.partial(masked, with_mask=True),
        masks_lib.FULL: full,
        LENGTHS: functools.partial(masked, with_mask=False),
    }
    live = [x for x in kinds if x != 0]
    if len(live) == 1:
        return branches[live[0]](carry)
    # kinds are 1..3 here (the loop stops before the schedule's padding entries)
    return jax.lax.switch(kd - 1, [branches[masks_lib.PARTIAL], branches[masks_lib.FULL], branches[LENGTHS]], carry)


def _count(sched_ref):
    return jnp.sum((sched_ref[1, :] != 0).astype(jnp.int32))


def _fwd_kernel(q_ref, k_ref, v_ref, sched_ref, lens_ref, *rest, st: _Static):
    bm_ref = rest[0] if st.has_bitmap else None
    o_ref, lse_ref = rest[-2:]
    i = pl.program_id(2)
    q = q_ref[...]  # [bq, Hp]
    q_pos = i * st.bq + jnp.arange(st.bq, dtype=jnp.int32)
    bq, Hvp = st.bq, o_ref.shape[-1]

    def body(slot, carry):
        kb, kd = sched_ref[0, slot], sched_ref[1, slot]

        def tile(c, ok):
            m, l, acc = c
            s = _dot(q, k_ref[pl.ds(kb * st.bk, st.bk), :], st, tb=True) * st.scale  # [bq, bk]
            if ok is not None:
                s = jnp.where(ok, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.exp(s - m_new[:, None])
            if ok is not None:
                p = jnp.where(ok, p, 0.0)
            alpha = jnp.exp(m - m_new)
            v = v_ref[pl.ds(kb * st.bk, st.bk), :]
            acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, st)
            return m_new, l * alpha + jnp.sum(p, axis=1), acc

        k_pos = kb * st.bk + jnp.arange(st.bk, dtype=jnp.int32)
        return _visit(st, st.kinds, kd, tile, carry, lambda w: _allowed(st, q_pos, k_pos, lens_ref, bm_ref, (slot,), w))

    init = (
        jnp.full((bq,), _NEG, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, Hvp), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, _count(sched_ref), body, init)
    nonempty = l > 0
    safe_l = jnp.where(nonempty, l, 1.0)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m + jnp.log(safe_l), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sched_ref, lens_ref, *rest, st: _Static):
    bm_ref = rest[0] if st.has_bitmap else None
    dq_ref = rest[-1]
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = i * st.bq + jnp.arange(st.bq, dtype=jnp.int32)

    def body(slot, dq):
        kb, kd = sched_ref[0, slot], sched_ref[1, slot]

        def tile(dq, ok):
            k = k_ref[pl.ds(kb * st.bk, st.bk), :]
            v = v_ref[pl.ds(kb * st.bk, st.bk), :]
            s = _dot(q, k, st, tb=True) * st.scale
            p = jnp.exp(s - lse[:, None])
            if ok is not None:
                p = jnp.where(ok, p, 0.0)
            ds = p * (_dot(do, v, st, tb=True) - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k, st)

        k_pos = kb * st.bk + jnp.arange(st.bk, dtype=jnp.int32)
        return _visit(st, st.kinds, kd, tile, dq, lambda w: _allowed(st, q_pos, k_pos, lens_ref, bm_ref, (slot,), w))

    dq = jax.lax.fori_loop(0, _count(sched_ref), body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq * st.scale


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sched_ref, lens_ref, *rest, st: _Static):
    """One (batch, kv head, key block): dk, dv summed over the G query heads that share the kv head.

    q_ref [Tp, G, Hp], do_ref [Tp, G, Hvp], lse_ref / delta_ref [G, Tp], k_ref [bk, Hp],
    v_ref [bk, Hvp]; bitmaps [I, bq, bk] (one for all heads) or [G, I, bq, bk] (per head).
    """
    bm_ref = rest[0] if st.has_bitmap else None
    dk_ref, dv_ref = rest[-2:]
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]  # [bk, Hp], [bk, Hvp]
    k_pos = j * st.bk + jnp.arange(st.bk, dtype=jnp.int32)
    per_head_bitmap = st.bm_shape[1] > 1

    def body(slot, carry):
        qb, kd = sched_ref[0, slot], sched_ref[1, slot]
        rows = pl.ds(qb * st.bq, st.bq)
        q_pos = qb * st.bq + jnp.arange(st.bq, dtype=jnp.int32)
        for g in range(st.groups):  # static: the query heads of this kv head

            def tile(c, ok, g=g):
                dk, dv = c
                q, do = q_ref[rows, g, :], do_ref[rows, g, :]
                lse, delta = lse_ref[g, rows], delta_ref[g, rows]
                s = _dot(q, k, st, tb=True) * st.scale  # [bq, bk]
                p = jnp.exp(s - lse[:, None])
                if ok is not None:
                    p = jnp.where(ok, p, 0.0)
                dv = dv + _dot(p.astype(do.dtype), do, st, ta=True)  # [bk, Hvp]
                ds = p * (_dot(do, v, st, tb=True) - delta[:, None])
                return dk + _dot(ds.astype(q.dtype), q, st, ta=True), dv

            bm_idx = (g, slot) if per_head_bitmap else (slot,)
            carry = _visit(
                st,
                st.kinds_t,
                kd,
                tile,
                carry,
                lambda w, bm_idx=bm_idx: _allowed(st, q_pos, k_pos, lens_ref, bm_ref, bm_idx, w),
            )
        return carry

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(0, _count(sched_ref), body, init)
    dk_ref[...] = dk * st.scale
    dv_ref[...] = dv


def _on_platform(call, *args):
    """Pallas interpret mode when lowering for CPU (or an unknown platform), the Triton kernel on GPUs."""
    return jax.lax.platform_dependent(
        *args,
        cpu=functools.partial(call, interpret=True),
        cuda=functools.partial(call, interpret=False),
        rocm=functools.partial(call, interpret=False),
        default=functools.partial(call, interpret=True),
    )


def _params(st, interpret):
    if interpret:
        return {}
    with warnings.catch_warnings():  # jax 0.11 deprecates the Triton backend: a known, documented choice
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415 (only for the GPU lowering)

    return {"compiler_params": plgpu.CompilerParams(num_warps=st.num_warps, num_stages=st.num_stages)}


def _bm_spec(st, J):
    """BlockSpec of the bitmaps [Bm, Nm, n_rows, J, bq, bk] for grid (b, n, row)."""
    Bm, Nm = st.bm_shape
    return pl.BlockSpec(
        (None, None, None, J, st.bq, st.bk),
        lambda b, n, r: (b if Bm > 1 else 0, n if Nm > 1 else 0, r, 0, 0, 0),
    )


def _fwd_call(q, k, v, sched, lens, bm, *, st: _Static, interpret: bool):
    B, Tp, N, Hp = q.shape
    Sp, Hvp = k.shape[1], v.shape[-1]
    nq, J = sched.shape[0], sched.shape[-1]
    G = st.groups
    in_specs = [
        pl.BlockSpec((None, st.bq, None, Hp), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, Hvp), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, 2, J), lambda b, n, i: (i, 0, 0)),
        pl.BlockSpec((None, 2), lambda b, n, i: (b, 0)),
    ]
    args = [q, k, v, sched, lens]
    if st.has_bitmap:
        in_specs.append(_bm_spec(st, J))
        args.append(bm)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=st),
        grid=(B, N, nq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, st.bq, None, Hvp), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, st.bq), lambda b, n, i: (b, n, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Tp, N, Hvp), q.dtype),
            jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
        ],
        interpret=interpret,
        name="attnlab_flash_fwd",
        **_params(st, interpret),
    )(*args)


def _dq_call(q, k, v, do, lse, delta, sched, lens, bm, *, st: _Static, interpret: bool):
    B, Tp, N, Hp = q.shape
    Sp, Hvp = k.shape[1], v.shape[-1]
    nq, J = sched.shape[0], sched.shape[-1]
    G = st.groups
    in_specs = [
        pl.BlockSpec((None, st.bq, None, Hp), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, Hvp), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, st.bq, None, Hvp), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, None, st.bq), lambda b, n, i: (b, n, i)),
        pl.BlockSpec((None, None, st.bq), lambda b, n, i: (b, n, i)),
        pl.BlockSpec((None, 2, J), lambda b, n, i: (i, 0, 0)),
        pl.BlockSpec((None, 2), lambda b, n, i: (b, 0)),
    ]
    args = [q, k, v, do, lse, delta, sched, lens]
    if st.has_bitmap:
        in_specs.append(_bm_spec(st, J))
        args.append(bm)
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=(B, N, nq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, st.bq, None, Hp), lambda b, n, i: (b, i, n, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, N, Hp), jnp.float32),
        interpret=interpret,
        name="attnlab_flash_dq",
        **_params(st, interpret),
    )(*args)


def _dkv_call(q, k, v, do, lse, delta, sched_t, lens, bm_t, *, st: _Static, interpret: bool):
    B, Tp, N, Hp = q.shape
    Sp, K, Hvp = k.shape[1], st.K, v.shape[-1]
    nk, I = sched_t.shape[0], sched_t.shape[-1]
    G = st.groups
    in_specs = [
        pl.BlockSpec((None, Tp, None, G, Hp), lambda b, h, j: (b, 0, h, 0, 0)),
        pl.BlockSpec((None, st.bk, None, Hp), lambda b, h, j: (b, j, h, 0)),
        pl.BlockSpec((None, st.bk, None, Hvp), lambda b, h, j: (b, j, h, 0)),
        pl.BlockSpec((None, Tp, None, G, Hvp), lambda b, h, j: (b, 0, h, 0, 0)),
        pl.BlockSpec((None, None, G, Tp), lambda b, h, j: (b, h, 0, 0)),
        pl.BlockSpec((None, None, G, Tp), lambda b, h, j: (b, h, 0, 0)),
        pl.BlockSpec((None, 2, I), lambda b, h, j: (j, 0, 0)),
        pl.BlockSpec((None, 2), lambda b, h, j: (b, 0)),
    ]
    # [B, Tp, N, D] -> [B, Tp, K, G, D]; [B, N, Tp] -> [B, K, G, Tp] (free reshapes)
    args = [
        q.reshape(B, Tp, K, G, Hp),
        k,
        v,
        do.reshape(B, Tp, K, G, Hvp),
        lse.reshape(B, K, G, Tp),
        delta.reshape(B, K, G, Tp),
        sched_t,
        lens,
    ]
    if st.has_bitmap:
        Bm, Nm = st.bm_shape
        bmb = (lambda b: b) if Bm > 1 else (lambda b: 0)
        if Nm > 1:  # [Bm, N, nk, I, bq, bk] -> [Bm, K, G, nk, I, bq, bk]
            in_specs.append(
                pl.BlockSpec((None, None, G, None, I, st.bq, st.bk), lambda b, h, j: (bmb(b), h, 0, j, 0, 0, 0))
            )
            args.append(bm_t.reshape(Bm, K, G, nk, I, st.bq, st.bk))
        else:
            in_specs.append(pl.BlockSpec((None, None, None, I, st.bq, st.bk), lambda b, h, j: (bmb(b), 0, j, 0, 0, 0)))
            args.append(bm_t)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, st=st),
        grid=(B, K, nk),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, st.bk, None, Hp), lambda b, h, j: (b, j, h, 0)),
            pl.BlockSpec((None, st.bk, None, Hvp), lambda b, h, j: (b, j, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Sp, K, Hp), jnp.float32),
            jax.ShapeDtypeStruct((B, Sp, K, Hvp), jnp.float32),
        ],
        interpret=interpret,
        name="attnlab_flash_dkv",
        **_params(st, interpret),
    )(*args)


# ------------------------------------------------------------------------------------------
# custom_vjp over the padded, heads-last arrays [B, Tp, N, Hp]


def _float0_like(x):
    return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, lens, sched, sched_t, bm, bm_t):
    return _on_platform(functools.partial(_fwd_call, st=st), q, k, v, sched, lens, bm)[0]


def _flash_fwd(st, q, k, v, lens, sched, sched_t, bm, bm_t):
    out, lse = _on_platform(functools.partial(_fwd_call, st=st), q, k, v, sched, lens, bm)
    return out, (q, k, v, lens, sched, sched_t, bm, bm_t, out, lse)


def _flash_bwd(st, res, do):
    q, k, v, lens, sched, sched_t, bm, bm_t, out, lse = res
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [B, Tp, N]
    delta = jnp.transpose(delta, (0, 2, 1))  # -> [B, N, Tp], like lse
    do = do.astype(q.dtype)
    dq = _on_platform(functools.partial(_dq_call, st=st), q, k, v, do, lse, delta, sched, lens, bm)
    dk, dv = _on_platform(functools.partial(_dkv_call, st=st), q, k, v, do, lse, delta, sched_t, lens, bm_t)
    zeros = jax.tree_util.tree_map(_float0_like, (lens, sched, sched_t, bm, bm_t))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *zeros)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------
# Public entry point


def _check(q, k, v):
    for name, x, want in (("q", q, "[..., T, N, H]"), ("k", k, "[..., S, K, H]"), ("v", v, "[..., S, K, Hv]")):
        if not hasattr(x, "shape") or x.ndim < 3:
            raise ValueError(f"pallas_attention: {name} must be {want}, got {getattr(x, 'shape', type(x).__name__)}")
    if k.shape[:-3] != q.shape[:-3] or v.shape[:-1] != k.shape[:-1] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"pallas_attention: q {q.shape} [..., T, N, H], k {k.shape} [..., S, K, H] and v {v.shape} "
            f"[..., S, K, Hv] must agree in batch dims, S, K and H"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"pallas_attention: q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    reason = supports(q, k, v, backend="cpu")
    if reason is not None:
        raise ValueError(reason)


def check_mask_shape(m, lead, N, T, S, fn):
    """ValueError unless mask ``m`` (or None) broadcasts to the logits' shape ``[*lead, N, T, S]``."""
    if m is None:
        return
    target = (*lead, N, T, S)
    shape = tuple(jax.eval_shape(lambda: m.dense(T, S)).shape)
    try:
        ok = jnp.broadcast_shapes(shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{fn}: mask of shape {shape} does not broadcast to the logits' [..., N, T, S] = {target}")


def pallas_attention(q, k, v, *, mask=None, bias=None, scale=None, block_q=None, block_k=None):
    """Block-sparse flash attention in one Pallas kernel per (batch, head, query block).

    Args:
        q: ``[..., T, N, H]`` queries (float32, bfloat16 or float16).
        k: ``[..., S, K, H]`` keys, N % K == 0 (GQA).
        v: ``[..., S, K, Hv]`` values.
        mask: an ``attnlab.masks`` object or bool array (True = attend), or None. Its block
            layout decides the tiles visited; padding lengths may be traced.
        bias: must be None (no bias in this kernel; see ``supports``).
        scale: logit scale; default ``1/sqrt(H)``.
        block_q, block_k: tile sizes (powers of two >= 16); default ``min(64, next_pow2(T|S))``.

    Returns:
        ``[..., T, N, Hv]`` in q's dtype (fp32 softmax statistics and accumulation). Rows with
        no allowed key are zeros, with zero gradients.

    Raises:
        ValueError: on shapes, dtypes, a bias, or block sizes the kernel cannot take.

    Example:
        >>> q = k = v = jnp.ones((100, 2, 16))                  # [T, N, H]
        >>> pallas_attention(q, k, v, mask=masks_lib.causal()).shape
        (100, 2, 16)
    """
    _check(q, k, v)
    if bias is not None:
        raise ValueError("pallas_attention: bias must be None (this kernel has no bias; use 'blockwise')")
    *lead, T, N, H = q.shape
    S, K, Hv = v.shape[-3:]
    lead = tuple(lead)
    if T == 0 or S == 0:
        return jnp.zeros((*lead, T, N, Hv), q.dtype)
    m = masks_lib.as_mask(mask, "mask")
    check_mask_shape(m, lead, N, T, S, "pallas_attention")
    bq = _block(block_q, T, "block_q")
    bk = _block(block_k, S, "block_k")
    nq, nk = -(-T // bq), -(-S // bk)

    layout = np.full((nq, nk), masks_lib.FULL, np.int8) if m is None else m.block_layout(T, S, bq, bk)
    layout = _tiles.adjust_layout(layout, S, bk)
    pads, struct, data = _split(m)
    if pads:  # tiles that only the padding lengths make PARTIAL check the lengths alone
        rest = _and_all([x for x in (struct, data) if x is not None])
        rest_layout = np.full_like(layout, masks_lib.FULL) if rest is None else rest.block_layout(T, S, bq, bk)
        rest_layout = _tiles.adjust_layout(rest_layout, S, bk)
        layout = np.where((layout == masks_lib.PARTIAL) & (rest_layout == masks_lib.FULL), LENGTHS, layout)
    sched = _schedule(layout)
    sched_t = _schedule(layout.T)

    Hp, Hvp = max(16, _next_pow2(H)), max(16, _next_pow2(Hv))
    B = math.prod(lead)
    lens = _lengths(pads, lead, T, S)
    st = _Static(
        T=T,
        S=S,
        bq=bq,
        bk=bk,
        lead=lead,
        N=N,
        K=K,
        H=H,
        Hv=Hv,
        scale=_tiles.default_scale(H, scale),
        struct=struct,
        has_bitmap=data is not None,
        bm_shape=(1, 1),
        kinds=tuple(np.unique(sched[:, 1]).tolist()),
        kinds_t=tuple(np.unique(sched_t[:, 1]).tolist()),
        fp32=jnp.dtype(q.dtype) == jnp.float32,
        num_warps=4 if max(Hp, Hvp) <= 64 else 8,
        num_stages=2,
    )
    bm = bm_t = jnp.zeros((1,), jnp.int8)
    if data is not None:
        J, I = sched.shape[-1], sched_t.shape[-1]
        qb = np.repeat(np.arange(nq), J)
        bm = _tile_bitmaps(data, qb, sched[:, 0].reshape(-1), st)  # [Bm, Nm, nq*J, bq, bk]
        kb = np.repeat(np.arange(nk), I)
        bm_t = _tile_bitmaps(data, sched_t[:, 0].reshape(-1), kb, st)
        st = dataclasses.replace(st, bm_shape=tuple(bm.shape[:2]))
        bm = bm.reshape(bm.shape[:2] + (nq, J, bq, bk))
        bm_t = bm_t.reshape(bm_t.shape[:2] + (nk, I, bq, bk))

    # [*lead, T, N, H] -> [B, Tp, N, Hp] (zero padding: padded keys are masked, padded rows dropped)
    qp = jnp.pad(q.reshape(B, T, N, H), ((0, 0), (0, nq * bq - T), (0, 0), (0, Hp - H)))
    kp = jnp.pad(k.reshape(B, S, K, H), ((0, 0), (0, nk * bk - S), (0, 0), (0, Hp - H)))
    vp = jnp.pad(v.reshape(B, S, K, Hv), ((0, 0), (0, nk * bk - S), (0, 0), (0, Hvp - Hv)))
    out = _flash(st, qp, kp, vp, lens, jnp.asarray(sched), jnp.asarray(sched_t), bm, bm_t)
    return out[:, :T, :, :Hv].reshape(*lead, T, N, Hv)


def _block(b, length, name):
    if b is None:
        return max(16, min(DEFAULT_BLOCK, _next_pow2(length)))
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 16 or b & (b - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {b!r}")
    return int(b)
