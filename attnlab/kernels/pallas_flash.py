"""Block-sparse flash attention as a Pallas kernel (Triton on GPUs, interpret mode on CPU), on the tile core.

The same tiles as ``attnlab.kernels.blockwise`` (FlashAttention, Dao et al. 2022, arXiv 2205.14135;
online softmax, Milakov & Gimelshein 2018, arXiv 1805.02867), but each (batch, head, query block) is
one kernel program that loops over *its own list* of non-empty key blocks. What one tile computes
(logits in base 2 with the scale folded into the queries, the score's mod or one-head pair form, the
mask, the online-softmax step, the backward tile) is ``attnlab.kernels.tile_core``'s (``OneHeadView``);
this module owns the programs, their memory movement and their tuning:

* the schedule (``attnlab.kernels.schedule``) comes as kernel inputs ``index [nq, J]`` and
  ``counts [nq, 2]``: per query block its FULL tiles, then its PARTIAL tiles. A program runs two plain
  loops: the FULL tiles with no mask code, no branch in the body (so Triton pipelines the loads:
  FlexAttention's full / partial block lists), then the PARTIAL tiles, which evaluate the mask; EMPTY
  tiles are not listed, so never loaded;
* the mask on a PARTIAL tile: structural masks (causal, window, chunks, dilated, block band, 2-D
  window, their ``&``/``|``) from ``iota`` positions in the kernel; data masks (graph adjacency, dense
  arrays, global tokens, random blocks) as per-tile int8 bitmaps made outside for the listed tiles;
  padding lengths (concrete or traced) as an input ``[B, 2]`` (``pallas_mask_info``), so a traced
  length never recompiles;
* T and S are padded to whole blocks (a short last key block is PARTIAL, its tail masked), head dims
  to a power of two >= 16 (Triton's tensor sizes);
* backward (``jax.custom_vjp``): a dq kernel over query blocks (same schedule) and a dk/dv kernel over
  key blocks (the transposed schedule), both recomputing probabilities from the stored base-2
  log-sum-exp. GQA: query head n reads kv head n // G through the index maps; the dk/dv kernel runs
  per (batch, kv head, key block) and loops over its G query heads.

The tunable parameters are ``PallasConfig`` (tiles, warps, stages); ``attnlab.autotune`` searches them
per device and dispatch reads its table. The plan is for the backend the trace is for
(``attnlab.platform.target()``): the Triton lowering on a GPU, Pallas interpret mode elsewhere (so the
tests check the kernel's own logic on CPU); ``with attnlab.lowering_for("gpu")`` exports the real
kernel from a CPU host.

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

from attnlab import masks as masks_lib
from attnlab import platform
from attnlab import scores as scores_lib
from attnlab.call import Call, bind
from attnlab.kernels import pallas_mask_info, schedule
from attnlab.kernels import tile_core as core

__all__ = ["PallasConfig", "pallas_attention", "attend", "default_config", "default_block_q", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 64  # bq = bk on GPU: 64 x 64 tiles fit Triton's shared memory for H <= 256


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class PallasConfig:
    """The Pallas kernel's tunable parameters (Python ints; a new value is a new program).

    Attributes:
        block_q, block_k: tile rows and columns (powers of two >= 16).
        num_warps: warps per program (Triton).
        num_stages: software-pipelining stages of the key loop (Triton).
    """

    block_q: int = DEFAULT_BLOCK
    block_k: int = DEFAULT_BLOCK
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            b = getattr(self, name)
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 16 or b & (b - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {b!r}")
        for name, lo in (("num_warps", 1), ("num_stages", 1)):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < lo:
                raise ValueError(f"{name} must be a positive int, got {x!r}")


def default_block_q(Hp: int, Hvp: int, dtype, pair_form: bool = False, backend: str | None = None) -> int:
    """block_q when none is given: 128 on a GPU for 16-bit inputs with padded head dims of 65-128 and a
    dot-product tile (plain, SoftCap, ScoreMod), else ``DEFAULT_BLOCK``.

    From ``benchmarks/gpu_check.py`` on an H200 (bf16, 16 heads, one run each; docs/pallas.md): at H = 128
    and T = 16K, (128, 64) tiles ran full fwd+bwd in 31.5 ms against 55.9 ms for (64, 64), causal in 19.6
    against 34.4 ms; at H = 64 the two tile shapes were within 12% of each other either way. fp32 at
    H = 128 with (128, 64) tiles asked for more shared memory than the H200 has (262144 > 232448 bytes),
    and the additive pair form ran slower with them (1733 against 1189 ms forward at 16K): both keep 64.
    """
    backend = platform.normalize(backend)
    wide = jnp.dtype(dtype).itemsize == 2 and not pair_form and 64 < max(Hp, Hvp) <= 128
    return 128 if backend == "gpu" and wide else DEFAULT_BLOCK


def default_config(call: Call, backend: str | None = None) -> PallasConfig:
    """The untuned configuration of a call: ``default_block_q`` rows, ``DEFAULT_BLOCK`` columns (both at
    most the next power of two of T / S), 4 warps for padded head dims up to 64 and 8 above, 2 stages."""
    Hp, Hvp = max(16, next_pow2(call.H)), max(16, next_pow2(call.Hv))
    pair = isinstance(call.score.tile_form(), scores_lib.PairTile)
    bq = default_block_q(Hp, Hvp, call.dtype, pair, backend)
    return PallasConfig(
        block_q=max(16, min(bq, next_pow2(call.T))),
        block_k=max(16, min(DEFAULT_BLOCK, next_pow2(call.S))),
        num_warps=4 if max(Hp, Hvp) <= 64 else 8,
        num_stages=2,
    )


# ------------------------------------------------------------------------------------------
# The kernels' statics, products and masks


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the programs need to know as Python values, beside the tile core's spec."""

    core: core.TileSpec
    bq: int
    bk: int
    N: int
    K: int
    fp32: bool
    kinds: frozenset  # tile kinds of the forward schedule (FULL, PARTIAL)
    kinds_t: frozenset  # of the transposed schedule
    struct: object = None  # the in-kernel (arithmetic) part of the mask, or None
    has_bitmap: bool = False  # the data part of the mask comes as per-tile bitmaps
    bm_shape: tuple = (1, 1)  # (Bm, Nm) of those bitmaps
    num_warps: int = 4
    num_stages: int = 2
    on_gpu: bool = False  # traced for the Triton lowering (not interpret mode): fp32 dots as TF32x3
    leaf_axes: tuple = ()  # per score leaf: (head axis or None, is floating)

    @property
    def groups(self) -> int:
        return self.N // self.K


def _fp32_dot(on_gpu: bool):
    """How an fp32 tile product runs: exact fp32 in interpret mode; on a GPU three TF32 tensor-core passes
    (``TF32_TF32_F32_X3``, about fp32's accuracy): with Triton's exact fp32 product ("ieee", no tensor cores) the
    first fwd+bwd call, compile included, took 97 s on an H200 (docs/pallas.md).
    ``jax.default_matmul_precision("highest")`` asks for the exact product on a GPU too."""
    if not on_gpu or str(jax.config.jax_default_matmul_precision).lower() in ("highest", "float32", "fp32"):
        return jax.lax.Precision.HIGHEST
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _dot(a, b, st, *, ta=False, tb=False):
    """fp32 a @ b (a^T / b^T when ta / tb), fp32 accumulation; fp32 inputs at about fp32 accuracy."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = _fp32_dot(st.on_gpu) if st.fp32 else None
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Dots:
    """The tile products of one head's ``[bq, H]`` x ``[bk, H]`` tile (the tile core's ``dots``)."""

    st: _Static

    def qk(self, q, k):
        return _dot(q, k, self.st, tb=True)

    def dq(self, ds, k):
        return _dot(ds.astype(k.dtype), k, self.st)

    def dk(self, ds, q):
        return _dot(ds.astype(q.dtype), q, self.st, ta=True)

    def orient_dk(self, dk):
        return dk


_VIEW = core.OneHeadView()


def _allowed(st, q_pos, k_pos, lens_ref, bm_ref, bm_idx):
    """bool ``[bq, bk]`` for a PARTIAL tile: in range, within the lengths, the mask, the bitmap."""
    q_len, kv_len = lens_ref[0], lens_ref[1]
    ok = (k_pos < jnp.minimum(kv_len, st.core.S))[None, :] & (q_pos < q_len)[:, None]
    if st.struct is not None:
        ok = ok & st.struct(q_pos, k_pos)
    if st.has_bitmap:
        ok = ok & (bm_ref[bm_idx] != 0)
    return ok


def _leaves(st, refs, g=None):
    """The score's leaves for this program's head: per-head leaves come as a length-1 slice on their
    head axis (the BlockSpec picks it), or as the G heads of a kv head, of which ``g`` picks one."""
    out = []
    for ref, (axis, _) in zip(refs, st.leaf_axes, strict=True):
        if g is None or axis is None:
            out.append(ref[...])
        else:
            out.append(ref[tuple(pl.ds(g, 1) if d == axis else slice(None) for d in range(len(ref.shape)))])
    return out


def _scaled(st, q):
    """The queries pre-scaled by the tile core's factor, in their own dtype (the products' operands)."""
    return (q.astype(jnp.float32) * st.core.q_factor).astype(q.dtype)


def _two_loops(kinds, counts_ref, tile, carry):
    """The schedule row's FULL tiles ``[0, n_full)`` (no mask code), then its PARTIAL ones."""
    n_full = counts_ref[0]
    if masks_lib.FULL in kinds:
        carry = jax.lax.fori_loop(0, n_full, lambda slot, c: tile(c, slot, False), carry)
    if masks_lib.PARTIAL in kinds:
        carry = jax.lax.fori_loop(n_full, n_full + counts_ref[1], lambda slot, c: tile(c, slot, True), carry)
    return carry


# ------------------------------------------------------------------------------------------
# The programs: forward, dq, dk/dv


def _fwd_kernel(q_ref, k_ref, v_ref, index_ref, counts_ref, lens_ref, *rest, st: _Static):
    nl = len(st.leaf_axes)
    leaves = _leaves(st, rest[:nl])
    bm_ref = rest[nl] if st.has_bitmap else None
    o_ref, lse_ref = rest[-2:]
    i = pl.program_id(2)
    q = _scaled(st, q_ref[...])  # [bq, Hp]
    q_pos = i * st.bq + jnp.arange(st.bq, dtype=jnp.int32)
    dots = _Dots(st)

    def tile(carry, slot, partial):
        m, l, acc = carry
        kb = index_ref[slot]
        k_pos = kb * st.bk + jnp.arange(st.bk, dtype=jnp.int32)
        t = core.logits(st.core, _VIEW, dots.qk, q, k_ref[pl.ds(kb * st.bk, st.bk), :], q_pos, k_pos, leaves)
        ok = _allowed(st, q_pos, k_pos, lens_ref, bm_ref, (slot,)) if partial else None
        m, l, alpha, p = core.softmax_step(m, l, t, ok, base2=st.core.base2)
        v = v_ref[pl.ds(kb * st.bk, st.bk), :]
        return m, l, acc * alpha[:, None] + _dot(p.astype(v.dtype), v, st)

    m, l = core.softmax_init((st.bq,))
    m, l, acc = _two_loops(st.kinds, counts_ref, tile, (m, l, jnp.zeros((st.bq, o_ref.shape[-1]), jnp.float32)))
    out, (m, log_l) = core.softmax_finalize(m, l, acc, base2=st.core.base2)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = m + log_l  # in the tile's units; +inf on a row with nothing allowed (recomputes to p = 0)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, index_ref, counts_ref, lens_ref, *rest, st: _Static):
    """One (batch, head, query block): dq, and this program's share of the score's leaf gradients
    (summed over its key tiles; the caller sums the shares)."""
    nl = len(st.leaf_axes)
    leaves = _leaves(st, rest[:nl])
    bm_ref = rest[nl] if st.has_bitmap else None
    floating = [f for _, f in st.leaf_axes]
    n_grads = sum(floating)
    dq_ref, dleaf_refs = rest[-1 - n_grads], rest[len(rest) - n_grads :]
    i = pl.program_id(2)
    q, do = _scaled(st, q_ref[...]), do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = i * st.bq + jnp.arange(st.bq, dtype=jnp.int32)
    dots = _Dots(st)
    wants = ("q", "leaves") if n_grads else ("q",)

    def tile(carry, slot, partial):
        dq, dls = carry
        kb = index_ref[slot]
        k_pos = kb * st.bk + jnp.arange(st.bk, dtype=jnp.int32)
        k, v = k_ref[pl.ds(kb * st.bk, st.bk), :], v_ref[pl.ds(kb * st.bk, st.bk), :]
        t, pull = core.logits_vjp(st.core, _VIEW, dots, q, k, q_pos, k_pos, leaves, wants=wants)
        ok = _allowed(st, q_pos, k_pos, lens_ref, bm_ref, (slot,)) if partial else None
        p = core.probs(t, lse[:, None], 0.0, ok, base2=st.core.base2)
        dq_j, _, d_leaves, _ = pull(core.dlogits(p, _dot(do, v, st, tb=True), delta))
        d_leaves = [core.f32_cotangent(d, x) for d, x, f in zip(d_leaves, leaves, floating, strict=True) if f]
        return dq + dq_j, tuple(a + b for a, b in zip(dls, d_leaves, strict=True))

    init_leaves = tuple(jnp.zeros(x.shape, jnp.float32) for x, f in zip(leaves, floating, strict=True) if f)
    dq, dls = _two_loops(st.kinds, counts_ref, tile, (jnp.zeros(q.shape, jnp.float32), init_leaves))
    dq_ref[...] = dq * (st.core.grad_scale * st.core.q_factor)  # w.r.t. the unscaled queries
    for ref, d in zip(dleaf_refs, dls, strict=True):
        ref[...] = d


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, index_ref, counts_ref, lens_ref, *rest, st: _Static):
    """One (batch, kv head, key block): dk, dv summed over the G query heads that share the kv head.

    q_ref [Tp, G, Hp], do_ref [Tp, G, Hvp], lse_ref / delta_ref [G, Tp], k_ref [bk, Hp],
    v_ref [bk, Hvp]; bitmaps [I, bq, bk] (one for all heads) or [G, I, bq, bk] (per head).
    """
    nl = len(st.leaf_axes)
    leaf_refs = rest[:nl]
    bm_ref = rest[nl] if st.has_bitmap else None
    dk_ref, dv_ref = rest[-2:]
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]  # [bk, Hp], [bk, Hvp]
    k_pos = j * st.bk + jnp.arange(st.bk, dtype=jnp.int32)
    per_head_bitmap = st.bm_shape[1] > 1
    dots = _Dots(st)

    def tile(carry, slot, partial):
        qb = index_ref[slot]
        rows = pl.ds(qb * st.bq, st.bq)
        q_pos = qb * st.bq + jnp.arange(st.bq, dtype=jnp.int32)
        for g in range(st.groups):  # static: the query heads of this kv head
            dk, dv = carry
            q, do = _scaled(st, q_ref[rows, g, :]), do_ref[rows, g, :]
            lse, delta = lse_ref[g, rows], delta_ref[g, rows]
            leaves = _leaves(st, leaf_refs, g)
            t, pull = core.logits_vjp(st.core, _VIEW, dots, q, k, q_pos, k_pos, leaves, wants=("k",))
            ok = None
            if partial:
                ok = _allowed(st, q_pos, k_pos, lens_ref, bm_ref, (g, slot) if per_head_bitmap else (slot,))
            p = core.probs(t, lse[:, None], 0.0, ok, base2=st.core.base2)
            dv = dv + _dot(p.astype(do.dtype), do, st, ta=True)  # [bk, Hvp]
            _, dk_j, _, _ = pull(core.dlogits(p, _dot(do, v, st, tb=True), delta))
            carry = (dk + dk_j, dv)
        return carry

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = _two_loops(st.kinds_t, counts_ref, tile, init)
    dk_ref[...] = dk * st.core.grad_scale
    dv_ref[...] = dv


# ------------------------------------------------------------------------------------------
# pallas_call wrappers


def _params(st, interpret):
    if interpret:
        return {}
    # jax 0.11 deprecates the Triton backend (a known choice: docs/pallas.md): some versions warn on this
    # import, 0.11 when it lowers each kernel (gpu_check and the test settings filter that message)
    with warnings.catch_warnings():
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
    return [_leaf_spec(x, a, heads_per_block) for x, (a, _) in zip(leaves, st.leaf_axes, strict=True)]


def _sched_specs(J):
    """BlockSpecs of a schedule row (index [J], counts [2]) for grid axis 2 = the row."""
    return [pl.BlockSpec((None, J), lambda b, n, r: (r, 0)), pl.BlockSpec((None, 2), lambda b, n, r: (r, 0))]


def _fwd_call(q, k, v, sched, lens, bm, leaves, *, st: _Static, interpret: bool):
    B, Tp, N, Hp = q.shape
    Sp, Hvp = k.shape[1], v.shape[-1]
    index, counts = sched
    nq, J = index.shape
    G = st.groups
    in_specs = [
        pl.BlockSpec((None, st.bq, None, Hp), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, Hvp), lambda b, n, i: (b, 0, n // G, 0)),
        *_sched_specs(J),
        pl.BlockSpec((None, 2), lambda b, n, i: (b, 0)),
        *_leaf_specs(st, leaves),
    ]
    args = [q, k, v, index, counts, lens, *leaves]
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
        out_shape=[  # fp32 out (cast by the caller): the backward's delta = rowsum(do * out) from unrounded out
            jax.ShapeDtypeStruct((B, Tp, N, Hvp), jnp.float32),
            jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
        ],
        interpret=interpret,
        name="attnlab_flash_fwd",
        **_params(st, interpret),
    )(*args)


def _dq_call(q, k, v, do, lse, delta, sched, lens, bm, leaves, *, st: _Static, interpret: bool):
    B, Tp, N, Hp = q.shape
    Sp, Hvp = k.shape[1], v.shape[-1]
    index, counts = sched
    nq, J = index.shape
    G = st.groups
    in_specs = [
        pl.BlockSpec((None, st.bq, None, Hp), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, Hvp), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, st.bq, None, Hvp), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, None, st.bq), lambda b, n, i: (b, n, i)),
        pl.BlockSpec((None, None, st.bq), lambda b, n, i: (b, n, i)),
        *_sched_specs(J),
        pl.BlockSpec((None, 2), lambda b, n, i: (b, 0)),
        *_leaf_specs(st, leaves),
    ]
    args = [q, k, v, do, lse, delta, index, counts, lens, *leaves]
    if st.has_bitmap:
        in_specs.append(_bm_spec(st, J))
        args.append(bm)
    out_specs = [pl.BlockSpec((None, st.bq, None, Hp), lambda b, n, i: (b, i, n, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, Tp, N, Hp), jnp.float32)]
    for x, (axis, floating) in zip(leaves, st.leaf_axes, strict=True):
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
        functools.partial(_dq_kernel, st=st),
        grid=(B, N, nq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="attnlab_flash_dq",
        **_params(st, interpret),
    )(*args)


def _dkv_call(q, k, v, do, lse, delta, sched_t, lens, bm_t, leaves, *, st: _Static, interpret: bool):
    B, Tp, N, Hp = q.shape
    Sp, K, Hvp = k.shape[1], st.K, v.shape[-1]
    index_t, counts_t = sched_t
    nk, I = index_t.shape
    G = st.groups
    in_specs = [
        pl.BlockSpec((None, Tp, None, G, Hp), lambda b, h, j: (b, 0, h, 0, 0)),
        pl.BlockSpec((None, st.bk, None, Hp), lambda b, h, j: (b, j, h, 0)),
        pl.BlockSpec((None, st.bk, None, Hvp), lambda b, h, j: (b, j, h, 0)),
        pl.BlockSpec((None, Tp, None, G, Hvp), lambda b, h, j: (b, 0, h, 0, 0)),
        pl.BlockSpec((None, None, G, Tp), lambda b, h, j: (b, h, 0, 0)),
        pl.BlockSpec((None, None, G, Tp), lambda b, h, j: (b, h, 0, 0)),
        *_sched_specs(I),
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
        index_t,
        counts_t,
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
def _flash(st, q, k, v, lens, sched, sched_t, bm, bm_t, leaves):
    return _fwd_call(q, k, v, sched, lens, bm, leaves, st=st, interpret=not st.on_gpu)[0]


def _flash_fwd(st, q, k, v, lens, sched, sched_t, bm, bm_t, leaves):
    out, lse = _fwd_call(q, k, v, sched, lens, bm, leaves, st=st, interpret=not st.on_gpu)
    return out, (q, k, v, lens, sched, sched_t, bm, bm_t, leaves, out, lse)


def _flash_bwd(st, res, do):
    q, k, v, lens, sched, sched_t, bm, bm_t, leaves, out, lse = res
    interpret = not st.on_gpu
    delta = core.softmax_delta(out, do)  # [B, Tp, N]
    delta = jnp.transpose(delta, (0, 2, 1))  # -> [B, N, Tp], like lse
    do = do.astype(q.dtype)
    dq, *shares = _dq_call(q, k, v, do, lse, delta, sched, lens, bm, leaves, st=st, interpret=interpret)
    dk, dv = _dkv_call(q, k, v, do, lse, delta, sched_t, lens, bm_t, leaves, st=st, interpret=interpret)
    zeros = jax.tree_util.tree_map(_float0_like, (lens, sched, sched_t, bm, bm_t))
    d_leaves, shares = [], iter(shares)
    for x, (axis, floating) in zip(leaves, st.leaf_axes, strict=True):
        if not floating:
            d_leaves.append(_float0_like(x))
            continue
        share = next(shares)  # [B, nq, *leaf] or, for a leaf all heads read, [B, N, nq, *leaf]
        d_leaves.append(share.sum(axis=(0, 1) if axis is not None else (0, 1, 2)).astype(x.dtype))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *zeros, tuple(d_leaves))


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------
# Public entry point


def pallas_attention(
    q, k, v, *, mask=None, bias=None, scale=None, score="dot", block_q=None, block_k=None, config=None
):
    """Block-sparse flash attention in one Pallas kernel per (batch, head, query block).

    Args:
        q: ``[..., T, N, H]`` queries (float32, bfloat16 or float16).
        k: ``[..., S, K, H]`` keys, N % K == 0 (GQA).
        v: ``[..., S, K, Hv]`` values.
        mask: an ``attnlab.masks`` object or bool array (True = attend), or None. Its block
            layout decides the tiles visited; padding lengths may be traced.
        bias: must be None (no bias in this kernel; use 'blockwise' for a callable bias).
        scale: logit scale; default ``1/sqrt(H)``.
        score: ``"dot"``, ``scores.SoftCap(cap, scale)`` or ``scores.ScoreMod(fn, *arrays,
            head_axes=...)``: the kernel applies the score's mod to each tile of one head
            (a ScoreMod's ``fn`` sees ``[1, bq, bk]`` and its per-head arrays sliced to that head),
            forward and backward; the arrays' gradients are summed from the dq kernel's programs.
            ``scores.Additive(w)`` runs through its one-head form (``PairTile.head_pair_vjp``: a loop
            over the head dim on ``[bq, bk]`` tiles), w's gradient likewise.
        block_q, block_k: tile sizes (powers of two >= 16); they override ``config``'s.
        config: a ``PallasConfig`` (tiles, warps, stages); default: the tuned entry for this device
            and call (``attnlab.autotune``), else ``default_config``.

    Returns:
        ``[..., T, N, Hv]`` in q's dtype (fp32 softmax statistics and accumulation). Rows with
        no allowed key are zeros, with zero gradients.

    Raises:
        ValueError: on shapes, dtypes, a bias, or a configuration the kernel cannot take.

    Example:
        >>> q = k = v = jnp.ones((100, 2, 16))                  # [T, N, H]
        >>> pallas_attention(q, k, v, mask=masks_lib.causal()).shape
        (100, 2, 16)
    """
    call = bind(q, k, v, mask=mask, bias=bias, scale=scale, score=score, fn="pallas_attention")
    from attnlab.impls.pallas import PALLAS  # noqa: PLC0415 (the protocol lives with the implementation)

    if (why := PALLAS.supports(call, platform.target())) is not None:
        raise ValueError(f"{call.fn}: {why}")
    if config is None:
        from attnlab import tuning  # noqa: PLC0415

        config = tuning.lookup("pallas", call)
    if block_q is not None or block_k is not None:
        base = config if config is not None else default_config(call)
        config = dataclasses.replace(
            base,
            block_q=base.block_q if block_q is None else block_q,
            block_k=base.block_k if block_k is None else block_k,
        )
    return attend(call, config=config)


def attend(call: Call, *, config: PallasConfig | None = None):
    """``pallas_attention`` on a bound call (``attnlab.call.bind``) that the implementation supports."""
    if config is not None and not isinstance(config, PallasConfig):
        raise ValueError(f"config must be an attnlab.kernels.pallas_flash.PallasConfig, got {config!r}")
    if call.empty:
        return call.zeros()
    backend = platform.target()
    if config is None:
        config = default_config(call, backend)
    lead, T, S, N, K, H, Hv = call.lead, call.T, call.S, call.N, call.K, call.H, call.Hv
    Hp, Hvp = max(16, next_pow2(H)), max(16, next_pow2(Hv))
    bq, bk = min(config.block_q, max(16, next_pow2(T))), min(config.block_k, max(16, next_pow2(S)))
    nq, nk = -(-T // bq), -(-S // bk)
    info = pallas_mask_info.mask_info(call.mask, lead, T, S, bq, bk)
    m = call.mask
    runtime = None
    static = schedule.adjust_layout(info.layout, S, bk)
    if m is not None and not m.is_static and (static == masks_lib.PARTIAL).any():
        runtime = m.runtime_layout(T, S, bq, bk)  # traced data: refine the schedules on device
    sc = schedule.Schedule(info.layout, S, bk, runtime=runtime, transposed=True, pow2=True)
    kinds_t = set(np.unique(sc.layout.T).tolist()) - {masks_lib.EMPTY} | ({masks_lib.FULL} if sc.refined else set())
    B = call.batch
    leaves, leaf_axes = _score_leaves(call)
    st = _Static(
        core=core.tile_spec(call.score, H, T, S),
        bq=bq,
        bk=bk,
        N=N,
        K=K,
        fp32=call.dtype == jnp.float32,
        kinds=sc.kinds,
        kinds_t=frozenset(kinds_t),
        struct=info.struct,
        has_bitmap=info.data is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        on_gpu=backend == "gpu",
        leaf_axes=leaf_axes,
    )
    bm = bm_t = jnp.zeros((1,), jnp.int8)
    if info.data is not None:
        J, I = sc.index.shape[-1], sc.index_t.shape[-1]
        geom = dict(T=T, S=S, bq=bq, bk=bk, lead=lead)
        qb = np.repeat(np.arange(nq), J)
        bm = pallas_mask_info.tile_bitmaps(info.data, qb, jnp.asarray(sc.index).reshape(-1), **geom)
        kb = np.repeat(np.arange(nk), I)
        bm_t = pallas_mask_info.tile_bitmaps(info.data, jnp.asarray(sc.index_t).reshape(-1), kb, **geom)
        st = dataclasses.replace(st, bm_shape=tuple(bm.shape[:2]))
        bm = bm.reshape(bm.shape[:2] + (nq, J, bq, bk))
        bm_t = bm_t.reshape(bm_t.shape[:2] + (nk, I, bq, bk))

    # [*lead, T, N, H] -> [B, Tp, N, Hp] (zero padding: padded keys are masked, padded rows dropped)
    qp = jnp.pad(call.q.reshape(B, T, N, H), ((0, 0), (0, nq * bq - T), (0, 0), (0, Hp - H)))
    kp = jnp.pad(call.k.reshape(B, S, K, H), ((0, 0), (0, nk * bk - S), (0, 0), (0, Hp - H)))
    vp = jnp.pad(call.v.reshape(B, S, K, Hv), ((0, 0), (0, nk * bk - S), (0, 0), (0, Hvp - Hv)))
    sched = (jnp.asarray(sc.index), jnp.asarray(sc.counts))
    sched_t = (jnp.asarray(sc.index_t), jnp.asarray(sc.counts_t))
    out = _flash(st, qp, kp, vp, info.lens, sched, sched_t, bm, bm_t, leaves)
    return out[:, :T, :, :Hv].reshape(*lead, T, N, Hv).astype(call.q.dtype)


def _score_leaves(call: Call) -> tuple[tuple, tuple]:
    """The score's array leaves (0-d ones as [1]) and their (head axis, is floating) entries."""
    if call.score.is_dot:
        return (), ()
    layout = core.leaf_layout(call.score)
    leaves = tuple(
        jnp.asarray(x).reshape(shape)
        for x, (shape, _, _) in zip(jax.tree_util.tree_leaves(call.score), layout, strict=True)
    )
    return leaves, tuple((a, bool(jnp.issubdtype(dtype, jnp.floating))) for _, dtype, a in layout)
