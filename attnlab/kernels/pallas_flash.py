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
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.extend import core as jax_core

from attnlab import masks as masks_lib
from attnlab.call import Call, bind
from attnlab.kernels import _tiles, pallas_mask_info
from attnlab.kernels._support import dot_call_reason
from attnlab.kernels._tiles import Static
from attnlab.kernels.pallas_mask_info import LENGTHS

__all__ = ["call_reason", "pays_off", "pallas_attention", "attend", "default_block_q", "DEFAULT_BLOCK"]

_NEG = -0.7 * float(np.finfo(np.float32).max)
DEFAULT_BLOCK = 64  # bq = bk on GPU: 64 x 64 tiles fit Triton's shared memory for H <= 256
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_HEAD_DIM = 256


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ------------------------------------------------------------------------------------------
# What the kernel supports (shapes only)


def call_reason(call: Call, backend: str) -> str | None:
    """None when the kernel can run the bound call on ``backend``, else the reason it cannot.

    Looks at shapes and dtypes only, so it works on ``jax.ShapeDtypeStruct``s and for a backend
    other than the current one (``"gpu"``: the Triton kernel; ``"cpu"``: the same kernel in
    Pallas interpret mode, slow, for tests; ``"tpu"``: not this kernel, use splash). Every attnlab
    mask works: in-kernel arithmetic, tile bitmaps and padding lengths (``pallas_mask_info``).
    """
    if backend == "tpu":
        return "pallas: the Triton kernel is for GPUs; on TPU use 'splash'"
    if backend not in ("gpu", "cuda", "rocm", "cpu"):
        return f"pallas: unknown backend {backend!r}"
    reason = dot_call_reason(
        "pallas", call, dtypes=_DTYPES, bias_hint=" (use 'blockwise' for a callable bias)", mods=True
    )
    if reason is not None:
        return reason
    if max(call.H, call.Hv) > _MAX_HEAD_DIM:
        return f"pallas: head dims up to {_MAX_HEAD_DIM} (got H={call.H}, Hv={call.Hv})"
    return _leaves_reason(call, backend)


def _leaf_layout(call: Call) -> list[tuple[tuple, jnp.dtype, int | None]]:
    """(shape, dtype, head axis) of each array leaf of the score as the kernels take it (a 0-d leaf as
    [1]); works on arrays and ``jax.ShapeDtypeStruct``s alike."""
    if call.score.is_dot:
        return []
    leaves = jax.tree_util.tree_leaves(call.score)
    axes = call.score.leaf_head_axes() if leaves else ()
    return [
        (tuple(np.shape(x)) or (1,), jnp.dtype(x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype), a)
        for x, a in zip(leaves, axes, strict=True)
    ]


def _leaves_reason(call: Call, backend: str) -> str | None:
    """Why the score's array leaves cannot be kernel inputs, or None (shapes only)."""
    if call.score.is_dot:
        return None
    for i, (shape, _, a) in enumerate(_leaf_layout(call)):
        if a is not None and shape[a] != call.N:
            return f"pallas: score array {i} has {shape[a]} entries on head axis {a} (shape {shape}), not N={call.N}"
        block = list(shape)
        if a is not None:
            block[a] = call.N // call.K  # the dk/dv kernel reads the G query heads of one kv head
        if backend != "cpu" and any(d & (d - 1) for d in block):
            return (
                f"pallas: Triton blocks are powers of two: score array {i} of shape {shape} (head axis {a}) "
                f"would need a block {tuple(block)}"
            )
    if not call.score.elementwise_mod:
        try:
            jaxpr = _mod_jaxpr(call)
        except Exception as e:  # noqa: BLE001 (a probe: fn assumes all N heads; the full-head kernels still run it)
            form = "one-head pair form" if call.score.head_pair_form else "fn"
            return (
                f"pallas: the score's {form} fails on one head's tile [1, t, s] with its arrays sliced per head "
                f"({type(e).__name__}: {str(e).splitlines()[0]})"
            )
        used = _primitives(jaxpr.jaxpr) & (_NO_TRITON if backend != "cpu" else frozenset())
        if used:
            return (
                f"pallas: the score's fn uses {', '.join(sorted(used))} (forward or backward), which the Triton "
                f"backend cannot lower; index tables arithmetically (e.g. a sum of table[j] * (rel == j)) or use "
                f"'blockwise'"
            )
    return None


# primitives Pallas' Triton lowering lacks (a table lookup is a gather, its gradient a scatter-add)
_NO_TRITON = frozenset({"gather", "scatter", "scatter-add", "scatter_add", "dynamic_slice", "dynamic_update_slice",
                        "sort", "cumsum", "cumprod", "cummax", "argsort"})  # fmt: skip


def _mod_jaxpr(call: Call):
    """The score's one-head tile form on a 16 x 16 tile, forward and backward, traced on shapes (a
    ClosedJaxpr): ``tile_mod`` and its vjp, or the pair form's ``head_pair_vjp``."""
    treedef = jax.tree_util.tree_structure(call.score)
    specs = [
        jax.ShapeDtypeStruct(shape if a is None else shape[:a] + (1,) + shape[a + 1 :], dtype)
        for shape, dtype, a in _leaf_layout(call)
    ]
    pos = jnp.arange(16, dtype=jnp.int32)
    tile = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    if call.score.head_pair_form:
        rows = jax.ShapeDtypeStruct((16, max(16, _next_pow2(call.H))), call.dtype)

        def pair(q, k, *ls):
            s, back = treedef.unflatten(ls).head_pair_vjp(q, k)
            return s, back(s)

        return jax.make_jaxpr(pair)(rows, rows, *specs)

    def f(s, *ls):
        return treedef.unflatten(ls).tile_mod(s[None], pos, pos)[0]

    def fwd_bwd(s, *ls):
        out, vjp = jax.vjp(lambda s: f(s, *ls), s)
        return out, vjp(out)

    return jax.make_jaxpr(fwd_bwd)(tile, *specs)


def _primitives(jaxpr) -> set[str]:
    """The names of every primitive in ``jaxpr`` and in the jaxprs of its equations' params."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


# ------------------------------------------------------------------------------------------
# The kernels


def _dot(a, b, st, *, ta=False, tb=False):
    """fp32 a @ b (a^T / b^T when ta / tb), fp32 accumulation; fp32 inputs at about fp32 accuracy (``_fp32_dot``)."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = _fp32_dot(st.on_gpu) if st.fp32 else None
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _fp32_dot(on_gpu: bool):
    """How an fp32 tile product runs: exact fp32 in interpret mode; on a GPU three TF32 tensor-core passes
    (``TF32_TF32_F32_X3``, about fp32's accuracy): with Triton's exact fp32 product ("ieee", no tensor cores) the
    first fwd+bwd call, compile included, took 97 s on an H200 (docs/pallas.md).
    ``jax.default_matmul_precision("highest")`` asks for the exact product on a GPU too."""
    if not on_gpu or str(jax.config.jax_default_matmul_precision).lower() in ("highest", "float32", "fp32"):
        return jax.lax.Precision.HIGHEST
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _mod(st, s, q_pos, k_pos, leaves):
    """The score's ``tile_mod`` on one head's tile ``s`` [bq, bk]: elementwise (SoftCap) as is, else
    (ScoreMod) on ``[1, bq, bk]`` with the leaves sliced to this head (``_leaves``)."""
    score = st.tile_score(tuple(leaves))
    if score.elementwise_mod:
        return score.tile_mod(s, None, None)
    return score.tile_mod(s[None], q_pos, k_pos)[0]


def _pair(st, leaves):
    """The score object when its tile form is the one-head pair form (``Additive``), else None."""
    score = st.tile_score(tuple(leaves)) if st.score else None
    return score if score is not None and score.pair_form else None


def _scaled(st, q):
    return q if st.scale == 1.0 else (q.astype(jnp.float32) * st.scale).astype(q.dtype)


def _logits(st, q, k, q_pos, k_pos, leaves):
    """The tile's fp32 logits [bq, bk]: scale * q . k, then the score's mod (SoftCap, ScoreMod); or the
    score's one-head pair form (``Additive``) of the scaled queries and the keys."""
    if (pair := _pair(st, leaves)) is not None:
        return pair.head_pair_vjp(_scaled(st, q), k, dq=False, dk=False, leaf_grads=False)[0]
    s = _dot(q, k, st, tb=True) * st.scale
    return _mod(st, s, q_pos, k_pos, leaves) if st.score else s


def _logits_vjp(st, q, k, q_pos, k_pos, leaves, *, want="q", leaf_grads=False):
    """(logits, back): ``back(ds)`` -> (this tile's part of dq or dk, as ``want`` says, unscaled: the
    kernel multiplies its sum by ``st.scale`` once; grads of the score's floating leaves or ())."""
    if (pair := _pair(st, leaves)) is not None:
        s, pull = pair.head_pair_vjp(_scaled(st, q), k, dq=want == "q", dk=want == "k", leaf_grads=leaf_grads)

        def back_pair(ds):
            gq, gk, gl = pull(ds)
            # dq of the scaled queries is scale * d(scaled q): the kernel's final * scale; dk is exact: / scale
            g = gq if want == "q" else gk / st.scale
            if not leaf_grads:
                return g, ()
            return g, tuple(x for x, (_, floating) in zip(gl, st.score_leaves, strict=True) if floating)

        return s, back_pair
    s = _dot(q, k, st, tb=True) * st.scale

    def grad_qk(ds):  # ds [bq, bk] of the scaled dot product
        return _dot(ds.astype(k.dtype), k, st) if want == "q" else _dot(ds.astype(q.dtype), q, st, ta=True)

    if not st.score:
        return s, lambda ds: (grad_qk(ds), ())
    idx = [i for i, (_, floating) in enumerate(st.score_leaves) if floating] if leaf_grads else []

    def f(x, *diff):
        ls = list(leaves)
        for i, d in zip(idx, diff, strict=True):
            ls[i] = d
        return _mod(st, x, q_pos, k_pos, ls)

    out, vjp = jax.vjp(f, s, *[leaves[i] for i in idx])

    def back(ds):
        ds_s, *d_leaves = vjp(ds)
        return grad_qk(ds_s), tuple(d_leaves)

    return out, back


def _leaves(st, refs, g=None):
    """The score's leaves for this program's head: per-head leaves come as a length-1 slice on their
    head axis (the BlockSpec picks it), or as the G heads of a kv head, of which ``g`` picks one."""
    out = []
    for ref, (axis, _) in zip(refs, st.score_leaves, strict=True):
        if g is None or axis is None:
            out.append(ref[...])
        else:
            out.append(ref[tuple(pl.ds(g, 1) if d == axis else slice(None) for d in range(len(ref.shape)))])
    return out


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


def _fwd_kernel(q_ref, k_ref, v_ref, sched_ref, lens_ref, *rest, st: Static):
    nl = len(st.score_leaves)
    leaves = _leaves(st, rest[:nl])
    bm_ref = rest[nl] if st.has_bitmap else None
    o_ref, lse_ref = rest[-2:]
    i = pl.program_id(2)
    q = q_ref[...]  # [bq, Hp]
    q_pos = i * st.bq + jnp.arange(st.bq, dtype=jnp.int32)
    bq, Hvp = st.bq, o_ref.shape[-1]

    def body(slot, carry):
        kb, kd = sched_ref[0, slot], sched_ref[1, slot]

        k_pos = kb * st.bk + jnp.arange(st.bk, dtype=jnp.int32)

        def tile(c, ok):
            m, l, acc = c
            s = _logits(st, q, k_ref[pl.ds(kb * st.bk, st.bk), :], q_pos, k_pos, leaves)  # [bq, bk]
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

        return _visit(
            st, st.kinds_used, kd, tile, carry, lambda w: _allowed(st, q_pos, k_pos, lens_ref, bm_ref, (slot,), w)
        )

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


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sched_ref, lens_ref, *rest, st: Static):
    """One (batch, head, query block): dq, and this program's share of the score's leaf gradients
    (summed over its key tiles; the caller sums the shares)."""
    nl = len(st.score_leaves)
    leaves = _leaves(st, rest[:nl])
    bm_ref = rest[nl] if st.has_bitmap else None
    n_grads = sum(floating for _, floating in st.score_leaves)
    dq_ref, dleaf_refs = rest[-1 - n_grads], rest[len(rest) - n_grads :]
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = i * st.bq + jnp.arange(st.bq, dtype=jnp.int32)

    def body(slot, carry):
        kb, kd = sched_ref[0, slot], sched_ref[1, slot]
        k_pos = kb * st.bk + jnp.arange(st.bk, dtype=jnp.int32)

        def tile(c, ok):
            dq, dls = c
            k = k_ref[pl.ds(kb * st.bk, st.bk), :]
            v = v_ref[pl.ds(kb * st.bk, st.bk), :]
            s, back = _logits_vjp(st, q, k, q_pos, k_pos, leaves, leaf_grads=True)
            p = jnp.exp(s - lse[:, None])
            if ok is not None:
                p = jnp.where(ok, p, 0.0)
            dq_j, d_leaves = back(p * (_dot(do, v, st, tb=True) - delta[:, None]))
            dls = tuple(a + b.astype(jnp.float32) for a, b in zip(dls, d_leaves, strict=True))
            return dq + dq_j, dls

        return _visit(
            st, st.kinds_used, kd, tile, carry, lambda w: _allowed(st, q_pos, k_pos, lens_ref, bm_ref, (slot,), w)
        )

    init_leaves = tuple(
        jnp.zeros(x.shape, jnp.float32) for x, (_, floating) in zip(leaves, st.score_leaves, strict=True) if floating
    )
    dq, dls = jax.lax.fori_loop(0, _count(sched_ref), body, (jnp.zeros(q.shape, jnp.float32), init_leaves))
    dq_ref[...] = dq * st.scale
    for ref, d in zip(dleaf_refs, dls, strict=True):
        ref[...] = d


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sched_ref, lens_ref, *rest, st: Static):
    """One (batch, kv head, key block): dk, dv summed over the G query heads that share the kv head.

    q_ref [Tp, G, Hp], do_ref [Tp, G, Hvp], lse_ref / delta_ref [G, Tp], k_ref [bk, Hp],
    v_ref [bk, Hvp]; bitmaps [I, bq, bk] (one for all heads) or [G, I, bq, bk] (per head).
    """
    nl = len(st.score_leaves)
    leaf_refs = rest[:nl]
    bm_ref = rest[nl] if st.has_bitmap else None
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
                s, back = _logits_vjp(st, q, k, q_pos, k_pos, _leaves(st, leaf_refs, g), want="k")  # [bq, bk]
                p = jnp.exp(s - lse[:, None])
                if ok is not None:
                    p = jnp.where(ok, p, 0.0)
                dv = dv + _dot(p.astype(do.dtype), do, st, ta=True)  # [bk, Hvp]
                dk_j, _ = back(p * (_dot(do, v, st, tb=True) - delta[:, None]))
                return dk + dk_j, dv

            bm_idx = (g, slot) if per_head_bitmap else (slot,)
            carry = _visit(
                st,
                st.kinds_used_t,
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


def _leaf_spec(x, axis, heads_per_block):
    """BlockSpec of one score leaf for a grid whose axis 1 is the head (``heads_per_block`` query heads
    per program: 1, or G in the dk/dv kernel): its slice on the head axis, or the whole leaf."""
    shape = tuple(x.shape)
    if axis is None:
        return pl.BlockSpec(shape, lambda b, n, r: (0,) * len(shape))
    block = shape[:axis] + (heads_per_block,) + shape[axis + 1 :]
    return pl.BlockSpec(block, lambda b, n, r: tuple(n if d == axis else 0 for d in range(len(shape))))


def _leaf_specs(st, leaves, heads_per_block=1):
    return [_leaf_spec(x, a, heads_per_block) for x, (a, _) in zip(leaves, st.score_leaves, strict=True)]


def _fwd_call(q, k, v, sched, lens, bm, leaves, *, st: Static, interpret: bool):
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
        *_leaf_specs(st, leaves),
    ]
    args = [q, k, v, sched, lens, *leaves]
    if st.has_bitmap:
        in_specs.append(_bm_spec(st, J))
        args.append(bm)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=dataclasses.replace(st, on_gpu=not interpret)),
        grid=(B, N, nq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, st.bq, None, Hvp), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, st.bq), lambda b, n, i: (b, n, i)),
        ],
        out_shape=[  # fp32 out (cast by the caller): the backward's delta = rowsum(do * out) from unrounded out
            jax.ShapeDtypeStruct((B, Tp, N, Hvp), jnp.float32),
            jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
        ],
        interpret=interpret,
        name="attnlab_flash_fwd",
        **_params(st, interpret),
    )(*args)


def _dq_call(q, k, v, do, lse, delta, sched, lens, bm, leaves, *, st: Static, interpret: bool):
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
        *_leaf_specs(st, leaves),
    ]
    args = [q, k, v, do, lse, delta, sched, lens, *leaves]
    if st.has_bitmap:
        in_specs.append(_bm_spec(st, J))
        args.append(bm)
    out_specs = [pl.BlockSpec((None, st.bq, None, Hp), lambda b, n, i: (b, i, n, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, Tp, N, Hp), jnp.float32)]
    for x, (axis, floating) in zip(leaves, st.score_leaves, strict=True):
        if not floating:
            continue
        # one share per program: [B, nq, *leaf] (a head's slice, written at its head), or [B, N, nq, *leaf]
        spec = _leaf_spec(x, axis, 1)
        imap = spec.index_map
        if axis is None:
            out_shape.append(jax.ShapeDtypeStruct((B, N, nq, *x.shape), jnp.float32))
            block, where = (None, None, None, *spec.block_shape), lambda b, n, i, f=imap: (b, n, i, *f(b, n, i))
        else:
            out_shape.append(jax.ShapeDtypeStruct((B, nq, *x.shape), jnp.float32))
            block, where = (None, None, *spec.block_shape), lambda b, n, i, f=imap: (b, i, *f(b, n, i))
        out_specs.append(pl.BlockSpec(block, where))
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=dataclasses.replace(st, on_gpu=not interpret)),
        grid=(B, N, nq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="attnlab_flash_dq",
        **_params(st, interpret),
    )(*args)


def _dkv_call(q, k, v, do, lse, delta, sched_t, lens, bm_t, leaves, *, st: Static, interpret: bool):
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
        *_leaf_specs(st, leaves, G),
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
        *leaves,
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
        functools.partial(_dkv_kernel, st=dataclasses.replace(st, on_gpu=not interpret)),
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
def _flash(st, q, k, v, lens, sched, sched_t, bm, bm_t, leaves):
    return _on_platform(functools.partial(_fwd_call, st=st), q, k, v, sched, lens, bm, leaves)[0]


def _flash_fwd(st, q, k, v, lens, sched, sched_t, bm, bm_t, leaves):
    out, lse = _on_platform(functools.partial(_fwd_call, st=st), q, k, v, sched, lens, bm, leaves)
    return out, (q, k, v, lens, sched, sched_t, bm, bm_t, leaves, out, lse)


def _flash_bwd(st, res, do):
    q, k, v, lens, sched, sched_t, bm, bm_t, leaves, out, lse = res
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [B, Tp, N]
    delta = jnp.transpose(delta, (0, 2, 1))  # -> [B, N, Tp], like lse
    do = do.astype(q.dtype)
    dq, *shares = _on_platform(functools.partial(_dq_call, st=st), q, k, v, do, lse, delta, sched, lens, bm, leaves)
    dk, dv = _on_platform(functools.partial(_dkv_call, st=st), q, k, v, do, lse, delta, sched_t, lens, bm_t, leaves)
    zeros = jax.tree_util.tree_map(_float0_like, (lens, sched, sched_t, bm, bm_t))
    d_leaves, shares = [], iter(shares)
    for x, (axis, floating) in zip(leaves, st.score_leaves, strict=True):
        if not floating:
            d_leaves.append(_float0_like(x))
            continue
        share = next(shares)  # [B, nq, *leaf] or, for a leaf all heads read, [B, N, nq, *leaf]
        d_leaves.append(share.sum(axis=(0, 1) if axis is not None else (0, 1, 2)).astype(x.dtype))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *zeros, tuple(d_leaves))


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------
# Public entry point


def pallas_attention(q, k, v, *, mask=None, bias=None, scale=None, score="dot", block_q=None, block_k=None):
    """Block-sparse flash attention in one Pallas kernel per (batch, head, query block).

    Args:
        q: ``[..., T, N, H]`` queries (float32, bfloat16 or float16).
        k: ``[..., S, K, H]`` keys, N % K == 0 (GQA).
        v: ``[..., S, K, Hv]`` values.
        mask: an ``attnlab.masks`` object or bool array (True = attend), or None. Its block
            layout decides the tiles visited; padding lengths may be traced.
        bias: must be None (no bias in this kernel; see ``call_reason``).
        scale: logit scale; default ``1/sqrt(H)``.
        score: ``"dot"``, ``scores.SoftCap(cap, scale)`` or ``scores.ScoreMod(fn, *arrays,
            head_axes=...)``: the kernel applies the score's ``tile_mod`` to each tile of one head
            (a ScoreMod's ``fn`` sees ``[1, bq, bk]`` and its per-head arrays sliced to that head),
            forward and backward; the arrays' gradients are summed from the dq kernel's programs.
            ``scores.Additive(w)`` runs through its one-head form (``head_pair_vjp``: a loop over the
            head dim on ``[bq, bk]`` tiles), w's gradient likewise.
        block_q, block_k: tile sizes (powers of two >= 16); default ``min(64, next_pow2(T|S))``, block_q
            128 on a GPU for bf16/fp16 head dims of 65-128 (``default_block_q``).

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
    call = bind(q, k, v, mask=mask, bias=bias, scale=scale, score=score, fn="pallas_attention")
    return attend(call, block_q=block_q, block_k=block_k, check=True)


def attend(call: Call, *, block_q=None, block_k=None, check: bool = False):
    """``pallas_attention`` on a bound call (``attnlab.call.bind``); ``check`` raises ``call_reason``."""
    if check and (why := call_reason(call, "cpu")) is not None:
        raise ValueError(f"{call.fn}: {why}")
    if call.empty:
        return call.zeros()
    lead, T, S, N, K, H, Hv = call.lead, call.T, call.S, call.N, call.K, call.H, call.Hv
    Hp, Hvp = max(16, _next_pow2(H)), max(16, _next_pow2(Hv))
    bq = _block(block_q, T, "block_q", default_block_q(Hp, Hvp, call.dtype, call.score.head_pair_form))
    bk = _block(block_k, S, "block_k")
    nq, nk = -(-T // bq), -(-S // bk)
    info = pallas_mask_info.mask_info(call.mask, lead, T, S, bq, bk)
    sched, sched_t = info.sched, info.sched_t
    kinds = set(np.unique(sched[:, 1]).tolist())
    kinds_t = set(np.unique(sched_t[:, 1]).tolist())
    m = call.mask
    runtime = None
    if m is not None and not m.is_static and kinds & {masks_lib.PARTIAL, LENGTHS}:
        runtime = m.runtime_layout(T, S, bq, bk)  # traced data: refine the schedules on device
    if runtime is not None:
        sched, sched_t = pallas_mask_info.runtime_schedules(info, runtime, S, bk)
        kinds, kinds_t = kinds | {masks_lib.FULL}, kinds_t | {masks_lib.FULL}
    B = call.batch
    leaves, score_leaves = _score_leaves(call)
    st = Static(
        T=T,
        S=S,
        bq=bq,
        bk=bk,
        lead=lead,
        N=N,
        K=K,
        scale=_tiles.default_scale(H, call.score.tile_scale(H)),
        score=() if call.score.is_dot else (jax.tree_util.tree_structure(call.score),),
        score_leaves=score_leaves,
        has_bias=False,
        kinds_used=tuple(sorted(kinds)),
        kinds_used_t=tuple(sorted(kinds_t)),
        compute_dtype=call.dtype.name,
        H=H,
        Hv=Hv,
        struct=info.struct,
        has_bitmap=info.data is not None,
        num_warps=4 if max(Hp, Hvp) <= 64 else 8,
        num_stages=2,
    )
    bm = bm_t = jnp.zeros((1,), jnp.int8)
    if info.data is not None:
        J, I = sched.shape[-1], sched_t.shape[-1]
        qb = np.repeat(np.arange(nq), J)
        bm = pallas_mask_info.tile_bitmaps(info.data, qb, sched[:, 0].reshape(-1), st)  # [Bm, Nm, nq*J, bq, bk]
        kb = np.repeat(np.arange(nk), I)
        bm_t = pallas_mask_info.tile_bitmaps(info.data, sched_t[:, 0].reshape(-1), kb, st)
        st = dataclasses.replace(st, bm_shape=tuple(bm.shape[:2]))
        bm = bm.reshape(bm.shape[:2] + (nq, J, bq, bk))
        bm_t = bm_t.reshape(bm_t.shape[:2] + (nk, I, bq, bk))

    # [*lead, T, N, H] -> [B, Tp, N, Hp] (zero padding: padded keys are masked, padded rows dropped)
    qp = jnp.pad(call.q.reshape(B, T, N, H), ((0, 0), (0, nq * bq - T), (0, 0), (0, Hp - H)))
    kp = jnp.pad(call.k.reshape(B, S, K, H), ((0, 0), (0, nk * bk - S), (0, 0), (0, Hp - H)))
    vp = jnp.pad(call.v.reshape(B, S, K, Hv), ((0, 0), (0, nk * bk - S), (0, 0), (0, Hvp - Hv)))
    out = _flash(st, qp, kp, vp, info.lens, jnp.asarray(sched), jnp.asarray(sched_t), bm, bm_t, leaves)
    return out[:, :T, :, :Hv].reshape(*lead, T, N, Hv).astype(call.q.dtype)


def _score_leaves(call: Call) -> tuple[tuple, tuple]:
    """The score's array leaves (0-d ones as [1]) and their (head axis, is floating) entries."""
    if call.score.is_dot:
        return (), ()
    layout = _leaf_layout(call)
    leaves = tuple(
        jnp.asarray(x).reshape(shape)
        for x, (shape, _, _) in zip(jax.tree_util.tree_leaves(call.score), layout, strict=True)
    )
    return leaves, tuple((a, bool(jnp.issubdtype(dtype, jnp.floating))) for _, dtype, a in layout)


def default_block_q(Hp: int, Hvp: int, dtype, pair_form: bool = False, backend: str | None = None) -> int:
    """block_q when none is given: 128 on a GPU for 16-bit inputs with padded head dims of 65-128 and a
    dot-product tile (plain, SoftCap, ScoreMod), else ``DEFAULT_BLOCK``.

    From ``benchmarks/gpu_check.py`` on an H200 (bf16, 16 heads, one run each; docs/pallas.md): at H = 128
    and T = 16K, (128, 64) tiles ran full fwd+bwd in 31.5 ms against 55.9 ms for (64, 64), causal in 19.6
    against 34.4 ms; at H = 64 the two tile shapes were within 12% of each other either way. fp32 at
    H = 128 with (128, 64) tiles asked for more shared memory than the H200 has (262144 > 232448 bytes),
    and the additive pair form ran slower with them (1733 against 1189 ms forward at 16K): both keep 64.
    """
    backend = jax.default_backend() if backend is None else backend
    wide = jnp.dtype(dtype).itemsize == 2 and not pair_form and 64 < max(Hp, Hvp) <= 128
    return 128 if backend in ("gpu", "cuda", "rocm") and wide else DEFAULT_BLOCK


def pays_off(call: Call, backend: str) -> str | None:
    """``implementation=None`` only: on a GPU, additive (tanh) scores go on to blockwise, which ran them
    faster than this kernel's one-head pair form on an H200 (T = 4K, H = 128; docs/pallas.md has the
    runs). ``implementation="pallas"`` still runs them."""
    if backend in ("gpu", "cuda", "rocm") and call.score.head_pair_form:
        return (
            "pallas: additive (tanh) scores ran faster in blockwise on an H200 (docs/pallas.md); "
            "implementation='pallas' still runs them"
        )
    return None


def _block(b, length, name, default=DEFAULT_BLOCK):
    if b is None:
        return max(16, min(default, _next_pow2(length)))
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 16 or b & (b - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {b!r}")
    return int(b)
