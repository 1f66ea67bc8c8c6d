"""A Hopper (sm90) flash attention in Pallas Mosaic GPU: warp-specialised, TMA, wgmma; on the tile core.

The Triton kernel (``pallas_flash``) is one program per query block that loads its own tiles. On a
Hopper GPU the fastest attention kernels (FlashAttention-3, arXiv 2407.08608; jax's
``attention_mgpu.py``) split a thread block's warpgroups by role instead, and this module does the
same with attnlab's schedules:

* one thread block per (query head, pair of query blocks, batch); three warpgroups: a **producer**
  that issues TMA copies of the key and value tiles the schedule lists into a ring of
  ``max_concurrent_steps`` shared-memory slots, and two **consumers**, each owning one query block
  of ``block_q`` rows, that run ``wgmma`` for ``q k^T`` and ``p v`` and the online softmax between
  them (the tile core's ``softmax_step``, base 2 with the scale and log2(e) folded into the queries);
* the schedule is ``attnlab.kernels.schedule``'s, built for the thread block's ``2 * block_q`` rows:
  its FULL tiles, then its PARTIAL ones; the consumers run the first ``n_full`` steps with no mask
  code, then the PARTIAL steps with the mask (its ``interval()`` form ``t + lo <= s <= t + hi`` from
  ``iota`` positions, the padding lengths, and a document mask's segment ids: the consumers load their
  rows' ids once, the producer streams each key tile's ids beside it); EMPTY tiles are never loaded,
  and a schedule refined on device from traced lengths or ids is read the same way;
* scores: the dot product and elementwise mods (``SoftCap``); masks: padding lengths, an interval form
  (full, causal, windows) and one document mask (H <= 128: its backward is the Mosaic one, since the
  Triton kernels read documents from tile bitmaps); bf16 / fp16, head dims that are multiples of 64 up
  to 256, Hv == H. Everything else goes to the Triton kernel (``supports`` says why).

The backward (``MosaicConfig.backward``) is either the Triton dq and dk/dv kernels of ``pallas_flash`` on
the forward's output and base-2 log-sum-exp (the same conventions; the default, the one measured on a
GPU) or two Mosaic kernels built as the forward (``MosaicBackward``): a dq kernel whose producer streams
the schedule's ``k^T``, ``v^T`` and ``k`` tiles to two consumers of 64 query rows, and a dk/dv kernel
whose producer streams the transposed schedule's query blocks (``q``, ``do``, their transposes, the
log-sum-exp and ``delta``) to two consumers of 64 keys; both H <= 128 (shared memory,
``backward_smem_bytes``).
The keys are handed to the kernel transposed, ``[B, K, H, S]``, so the ``q k^T`` product reads its B
operand as it lies in shared memory (no transposed view of the tile, which Pallas' GPU interpret
mode lacks): the kernel runs on a CPU in that interpret mode, which is how it is tested here.

Shape legend: B batch, T / S query / key length (Tp, Sp padded), N / K query / kv heads, G = N // K,
H head dim; bq, bk the tile sizes (block_q, block_kv).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from attnlab import masks as masks_lib
from attnlab import platform
from attnlab.call import Call
from attnlab.impls.mosaic import mosaic_mask
from attnlab.kernels import pallas_flash, pallas_mask_info, schedule
from attnlab.kernels import tile_core as core

__all__ = ["MosaicConfig", "MosaicBackward", "attend", "default_config"]


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415 (heavy; only when planned)

    return plgpu


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """The Mosaic kernel's tunable parameters.

    Attributes:
        block_q: rows per consumer warpgroup (a thread block holds two: ``2 * block_q`` rows); 64.
        block_kv: keys per tile, a multiple of 64.
        max_concurrent_steps: key/value tiles in flight (shared-memory slots), at least 2.
        backward: the backward's kernels: a ``MosaicBackward`` (the Mosaic dq and dk/dv kernels, H <= 128)
            or a ``pallas_flash.PallasConfig`` (the Triton ones, the default: measured on an H200).
    """

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2
    backward: pallas_flash.PallasConfig | MosaicBackward = pallas_flash.PallasConfig(64, 64, 4, 2)

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"block_q must be 64 (one wgmma row block per consumer), got {self.block_q!r}")
        if not isinstance(self.block_kv, int) or self.block_kv <= 0 or self.block_kv % 64:
            raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv!r}")
        if not isinstance(self.max_concurrent_steps, int) or self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be an int >= 2, got {self.max_concurrent_steps!r}")
        if not isinstance(self.backward, (pallas_flash.PallasConfig, MosaicBackward)):
            raise ValueError(f"backward must be a MosaicBackward or a pallas_flash.PallasConfig, got {self.backward!r}")


def default_config(call: Call) -> MosaicConfig:
    """128-key tiles and two slots in flight (jax's ``attention_mgpu`` tuning for H <= 128), 64-key tiles
    above H = 128 (shared memory)."""
    return MosaicConfig(64, 128 if call.H <= 128 else 64, 2)


@dataclasses.dataclass(frozen=True)
class _Static:
    core: core.TileSpec
    bq: int
    bk: int
    steps: int  # max_concurrent_steps
    N: int
    K: int
    H: int
    interval: tuple | None  # (lo, hi) of the mask's interval form, or None (no mask beyond lengths)
    doc: tuple | None  # (padding_id,) with a document mask (segment ids compared per tile), else None
    kinds: frozenset
    interpret: bool


def _row_layout(plgpu):
    layout = plgpu.Layout.WGMMA
    return getattr(plgpu.Layout, "WGMMA_ROW", None) or layout.reduce(1)


def _kernel_call(plgpu, body, out_type, **kw):
    """``plgpu.kernel`` with the output argument named as this jax names it (``out_type``; older: ``out_shape``)."""
    params = inspect.signature(plgpu.kernel).parameters
    key = "out_type" if "out_type" in params else "out_shape"
    return plgpu.kernel(body, **{key: out_type}, **kw)


def _lane_semantics(plgpu) -> dict:
    """The per-lane lowering (explicit register layouts), which these kernels are written for and checked in:
    jax 0.11 made per-warpgroup lowering the default, so it is asked for by name where jax has the choice."""
    semantics = getattr(plgpu, "LoweringSemantics", None)
    return {} if semantics is None else {"lowering_semantics": semantics.Lane}


def _launch(plgpu, st: _Static, kernel, scratch, grid, grid_names, out_type, *args):
    """``kernel(*refs, scoped)`` on ``grid`` with three warpgroups (two consumers, one producer) and the
    run-scoped ``scratch`` (shared memory, barriers) they share; in Pallas' GPU interpreter off a GPU."""
    kw = dict(grid=grid, grid_names=grid_names, num_threads=3, thread_name="wg")
    if st.interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415 (tests only)

        kw["interpret"] = InterpretGPUParams()
    else:
        kw["compiler_params"] = plgpu.CompilerParams(approx_math=True, **_lane_semantics(plgpu))

    def entry(*refs):
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), *scratch, collective_axes="wg")

    return _kernel_call(plgpu, entry, out_type, **kw)(*args)


def _tiles(plgpu):
    """The shared-memory transforms of a bf16/fp16 operand tile (8 x 64 tiles, 128-byte swizzle)."""
    return dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def _producer(plgpu, copies, done, total, C):
    """The producer warpgroup's loop: fill the ``C`` slots, then reload each slot once both consumers are
    done with it, then observe the last steps' consumption (every barrier phase is waited on once: the
    GPU interpreter checks it).

    ``copies(s)``: step ``s``'s TMA copies as ``(gmem view, smem slots, barriers)``, each landing in
    ``slots.at[slot]`` and signalling ``barriers.at[slot]``; ``done``: the barriers (one per slot each) the
    consumers arrive at when they no longer read a slot."""

    def load(s, slot):
        for src, slots, bars in copies(s):
            plgpu.copy_gmem_to_smem(src, slots.at[slot], bars.at[slot])

    def wait_done(slot):
        for bars in done:
            plgpu.barrier_wait(bars.at[slot])

    for s in range(C):

        @pl.when(s < total)
        def _(s=s):
            load(s, s)

    @pl.loop(C, jnp.maximum(total, C))
    def _(s):
        slot = lax.rem(s, C)
        wait_done(slot)
        load(s, slot)

    @pl.loop(jnp.maximum(total - C, 0), total)
    def _(s):
        wait_done(lax.rem(s, C))


def _iota(plgpu, st: _Static, shape, axis):
    """int32 positions along ``axis`` of a ``shape`` tile in the wgmma accumulator's layout."""
    if st.interpret:
        return jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def _program(counts_ref, axis: str):
    """This thread block's (batch, head, block along ``axis``), its warpgroup, and its schedule row's
    FULL count and total steps."""
    b, h, i = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index(axis)
    n_full = counts_ref[i, 0]
    return b, h, i, lax.axis_index("wg"), n_full, n_full + counts_ref[i, 1]


def _two_loops(st: _Static, n_full, total, step, carry):
    """Steps ``[0, n_full)`` (FULL tiles: no mask code) then ``[n_full, total)`` (PARTIAL), each loop only
    where the schedule holds that kind: ``step(s, carry, partial)``."""
    if masks_lib.FULL in st.kinds:
        carry = lax.fori_loop(0, n_full, lambda s, c: step(s, c, False), carry)
    if masks_lib.PARTIAL in st.kinds:
        carry = lax.fori_loop(n_full, total, lambda s, c: step(s, c, True), carry)
    return carry


def _allowed(st: _Static, q_pos, k_pos, q_len, kv_len, q_ids=None, k_ids=None):
    """A PARTIAL tile's element mask: inside the lengths, the mask's interval ``lo <= s - t <= hi`` and, with
    a document mask, the same segment id (``q_ids``, ``k_ids``: the ids broadcast to the tile)."""
    ok = (k_pos < jnp.minimum(kv_len, st.core.S)) & (q_pos < q_len)
    if st.interval is not None:
        lo, hi = st.interval
        if lo is not None:
            ok = ok & (k_pos - q_pos >= lo)
        if hi is not None:
            ok = ok & (k_pos - q_pos <= hi)
    if st.doc is not None:
        ok = ok & (q_ids == k_ids)
        if st.doc[0] is not None:
            ok = ok & (q_ids != st.doc[0])
    return ok


def _vec(plgpu, st: _Static, ref, layout):
    """A vector from shared memory in a register layout (as it is in the GPU interpreter). The whole ref: jax
    0.10 asks for its index (``()``), jax 0.11 deprecates passing one."""
    if st.interpret:
        return ref[...]
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _along(x, like, axis: int):
    """A vector broadcast along the other axis of a 2-D tile ``like`` (``axis`` 0: one value per row)."""
    return lax.broadcast_in_dim(x, like.shape, (axis,))


def _fwd(q, kt, v, ids, index, counts, lens, *, st: _Static):
    """q [B, Tp, N, H], kt [B, K, H, Sp], v [B, Sp, K, H] (bf16/fp16; q pre-scaled by the core's factor),
    index [nq2, J], counts [nq2, 2] int32 (the schedule for 2*bq-row blocks), lens [B, 2] int32
    -> out [B, Tp, N, H] (input dtype), lse [B, N, Tp] fp32 (base 2; +inf on empty rows)."""
    plgpu = _plgpu()
    B, Tp, N, H = q.shape
    bq, bk, C = st.bq, st.bk, st.steps
    G = st.N // st.K
    dtype = q.dtype
    row = _row_layout(plgpu)
    wgmma = plgpu.Layout.WGMMA

    def lay(x, layout):  # register layouts: a hint the GPU interpreter has no rule for
        return x if st.interpret else plgpu.layout_cast(x, layout)

    def iota(axis):
        return _iota(plgpu, st, (bq, bk), axis)

    col = plgpu.Layout.WGMMA.reduce(0)

    def kernel(q_ref, kt_ref, v_ref, ids_ref, index_ref, counts_ref, lens_ref, out_ref, lse_ref, scoped):
        smem, bars, consumed = scoped
        qo_smem2, kt_smem, v_smem, lse_smem2, p_smem2, qid_smem2, kid_smem = smem
        kt_bar, v_bar, q_bar, kid_bar = bars
        kt_done, v_done = consumed
        b, h, i, wg, n_full, total = _program(counts_ref, "q_seq")

        @pl.when(wg < 2)
        def _consumer():
            qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
            base = i * (2 * bq) + wg * bq
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(base, bq), h], qo_smem, q_bar.at[wg])
            if st.doc is not None:
                plgpu.copy_gmem_to_smem(ids_ref.at[b, 0, pl.ds(base, bq)], qid_smem2.at[wg], q_bar.at[2 + wg])
                plgpu.barrier_wait(q_bar.at[2 + wg])
            plgpu.barrier_wait(q_bar.at[wg])
            qid = _vec(plgpu, st, qid_smem2.at[wg], row) if st.doc is not None else None
            q_len, kv_len = lens_ref[b, 0], lens_ref[b, 1]

            def step(s, carry, partial):
                acc, m, l = carry
                slot = lax.rem(s, C)
                plgpu.barrier_wait(kt_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, kt_smem.at[slot])
                    return acc_ref[...]

                t = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(kt_done.at[slot])
                kb = index_ref[i, s]
                if st.core.form == "mod":  # an elementwise mod (SoftCap), natural units
                    t = st.core.score(()).tile_form().mod(t)
                ids = (None, None)
                if st.doc is not None:  # every step waits for its slot's key ids (one barrier phase per load)
                    plgpu.barrier_wait(kid_bar.at[slot])
                    ids = (_along(qid, t, 0), _along(_vec(plgpu, st, kid_smem.at[slot], col), t, 1))
                ok = None
                if partial:
                    ok = _allowed(st, iota(0) + base, iota(1) + kb * bk, q_len, kv_len, *ids)
                m, l, alpha, p = core.softmax_step(m, l, t, ok, base2=st.core.base2)
                acc = acc * core.rows(alpha, acc)
                plgpu.barrier_wait(v_bar.at[slot])

                p16 = p.astype(dtype)
                if st.interpret:  # the GPU interpreter's wgmma reads its A operand from shared memory only
                    p_smem2.at[wg][...] = p16
                    plgpu.commit_smem()
                    p16 = p_smem2.at[wg]

                def pv(acc_ref):  # p v into a fresh accumulator, added below (GPU interpret mode has no run_state)
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, H), jnp.float32))
                plgpu.barrier_arrive(v_done.at[slot])
                return acc, m, l

            acc = lay(jnp.zeros((bq, H), jnp.float32), wgmma)
            m = lay(jnp.full((bq,), -jnp.inf, jnp.float32), row)
            l = lay(jnp.zeros((bq,), jnp.float32), row)
            carry = _two_loops(st, n_full, total, step, (acc, m, l))
            out, (m, log_l) = core.softmax_finalize(*carry[1:], carry[0], base2=st.core.base2)
            qo_smem[...] = out.astype(dtype)
            lse_smem[...] = m + log_l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(base, bq), h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(base, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer_wg():
            kvh = lax.div(h, G)

            def copies(s):
                keys = pl.ds(index_ref[i, s] * bk, bk)
                out = [(kt_ref.at[b, kvh, :, keys], kt_smem, kt_bar), (v_ref.at[b, keys, kvh], v_smem, v_bar)]
                return out + ([(ids_ref.at[b, 1, keys], kid_smem, kid_bar)] if st.doc is not None else [])

            # a slot is free once both tiles are consumed (k^T early, after q k^T; v after p v)
            _producer(plgpu, copies, (kt_done, v_done), total, C)

    tiles = _tiles(plgpu)
    smem = (
        plgpu.SMEM((2, bq, H), dtype, **tiles),
        plgpu.SMEM((C, H, bk), dtype, **tiles),
        plgpu.SMEM((C, bk, H), dtype, **tiles),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.SMEM((2, bq, bk), dtype, **tiles) if st.interpret else None,
        plgpu.SMEM((2, bq), jnp.int32),
        plgpu.SMEM((C, bk), jnp.int32),
    )
    bars = (
        plgpu.Barrier(num_barriers=C), plgpu.Barrier(num_barriers=C), plgpu.Barrier(num_barriers=4),
        plgpu.Barrier(num_barriers=C),
    )  # fmt: skip
    consumed = (plgpu.Barrier(num_arrivals=2, num_barriers=C), plgpu.Barrier(num_arrivals=2, num_barriers=C))
    out_type = (jax.ShapeDtypeStruct((B, Tp, N, H), dtype), jax.ShapeDtypeStruct((B, N, Tp), jnp.float32))
    grid = (N, Tp // (2 * bq), B)
    return _launch(
        plgpu, st, kernel, (smem, bars, consumed), grid, ("heads", "q_seq", "batch"), out_type, q, kt, v, ids,
        index, counts, lens,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# The Mosaic backward: a dq kernel and a dk/dv kernel, warp-specialised as the forward


@dataclasses.dataclass(frozen=True)
class MosaicBackward:
    """The Mosaic backward's tunable parameters (``MosaicConfig.backward``; a ``PallasConfig`` there
    selects the Triton dq and dk/dv kernels instead).

    The dq kernel gives each consumer warpgroup 64 query rows (a thread block 128, as the forward) and
    steps over ``block_kv_dq`` keys; the dk/dv kernel gives each consumer 64 keys (a thread block 128)
    and steps over ``block_q_dkv`` query rows. Both write their results in the inputs' dtype through the
    shared memory their operands used (dk and dv per query head, summed over the G heads of a kv head in
    fp32 outside), which keeps a slot's tiles within Hopper's 227 KB at H = 128 with two slots: H above
    128 takes the Triton backward.

    Attributes:
        block_kv_dq: keys per step of the dq kernel, a multiple of 64.
        block_q_dkv: query rows per step of the dk/dv kernel, a multiple of 64.
        max_concurrent_steps: tiles in flight (shared-memory slots) in both kernels, at least 2.
    """

    block_kv_dq: int = 64
    block_q_dkv: int = 64
    max_concurrent_steps: int = 2

    def __post_init__(self):
        if not isinstance(self.block_kv_dq, int) or self.block_kv_dq <= 0 or self.block_kv_dq % 64:
            raise ValueError(f"block_kv_dq must be a positive multiple of 64, got {self.block_kv_dq!r}")
        if not isinstance(self.block_q_dkv, int) or self.block_q_dkv <= 0 or self.block_q_dkv % 64:
            raise ValueError(f"block_q_dkv must be a positive multiple of 64, got {self.block_q_dkv!r}")
        if not isinstance(self.max_concurrent_steps, int) or self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be an int >= 2, got {self.max_concurrent_steps!r}")


_BK_DKV = 64  # keys per consumer warpgroup in the dk/dv kernel (one wgmma row block)
SMEM_BYTES = 227 * 1024  # a Hopper thread block's shared memory


def backward_smem_bytes(cfg: MosaicBackward, bq: int, H: int, itemsize: int = 2) -> tuple[int, int]:
    """Shared memory of the (dq, dk/dv) kernels on a GPU: each consumer's own rows (q and do; k and v) plus
    ``max_concurrent_steps`` slots of the tiles the producer streams (k^T, v^T, k; q, do, q^T, do^T) and
    the per-row statistics."""
    C = cfg.max_concurrent_steps
    dq = (2 * 2 * bq * H + C * 3 * cfg.block_kv_dq * H) * itemsize + 2 * 2 * bq * 4
    dkv = (2 * 2 * _BK_DKV * H + C * 4 * cfg.block_q_dkv * H) * itemsize + C * 2 * cfg.block_q_dkv * 4
    return dq, dkv


def _mod_vjp(st: _Static, t):
    """The score's elementwise mod on raw logits ``t`` and its pullback (identity for the dot product).

    The mod is elementwise, so its derivative is one forward-mode tangent of ones (``jax.jvp``): the
    pullback is a product, with no transposed program (whose ``add_any`` Mosaic GPU does not lower)."""
    if st.core.form != "mod":
        return t, lambda ds: ds
    t, slope = jax.jvp(st.core.score(()).tile_form().mod, (t,), (jnp.ones_like(t),))
    return t, lambda ds: ds * slope


def _dq(q, do, kt, vt, k, lse, delta, ids, index, counts, lens, *, st: _Static, bk: int, C: int):
    """q (pre-scaled), do [B, N, Tp, H]; kt, vt [B, K, H, Sp] (keys and values transposed), k [B, Sp, K, H];
    lse / delta [B, N, Tp] fp32 (lse in the forward's units); ids the segment ids ([B, 2, L] int32: the
    queries', the keys'; read with a document mask); the schedule of 2*bq-row blocks and
    ``bk``-key tiles -> dq [B, Tp, N, H] (input dtype), w.r.t. the unscaled queries."""
    plgpu = _plgpu()
    B, N, Tp, H = q.shape
    bq = st.bq
    G = st.N // st.K
    dtype = q.dtype
    row, col, wgmma = _row_layout(plgpu), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA

    def vec(ref):
        return _vec(plgpu, st, ref, row)

    def iota(axis):
        return _iota(plgpu, st, (bq, bk), axis)

    def kernel(q_ref, do_ref, kt_ref, vt_ref, k_ref, lse_ref, delta_ref, ids_ref, index_ref, counts_ref,
               lens_ref, dq_ref, scoped):  # fmt: skip
        smem, bars, done = scoped
        q_smem2, do_smem2, lse_smem2, delta_smem2, kt_smem, vt_smem, k_smem, ds_smem2, qid_smem2, kid_smem = smem
        row_bar, kt_bar, vt_bar, k_bar, kid_bar = bars
        b, h, i, wg, n_full, total = _program(counts_ref, "q_seq")

        @pl.when(wg < 2)
        def _consumer():
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
            base = i * (2 * bq) + wg * bq
            rows = pl.ds(base, bq)
            pairs = ((q_ref, q_smem), (do_ref, do_smem), (lse_ref, lse_smem), (delta_ref, delta_smem))
            pairs = [(src.at[b, h, rows], dst) for src, dst in pairs]
            if st.doc is not None:
                pairs.append((ids_ref.at[b, 0, rows], qid_smem2.at[wg]))
            for n, (src, dst) in enumerate(pairs):
                plgpu.copy_gmem_to_smem(src, dst, row_bar.at[2 * n + wg])
            for n in range(len(pairs)):
                plgpu.barrier_wait(row_bar.at[2 * n + wg])
            lse, delta = vec(lse_smem), vec(delta_smem)
            qid = vec(qid_smem2.at[wg]) if st.doc is not None else None
            q_len, kv_len = lens_ref[b, 0], lens_ref[b, 1]

            def step(s, dq, partial):
                slot = lax.rem(s, C)
                plgpu.barrier_wait(kt_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, kt_smem.at[slot])
                    return acc_ref[...]

                t, pull = _mod_vjp(st, pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32)))
                plgpu.barrier_wait(vt_bar.at[slot])

                def dov(acc_ref):
                    plgpu.wgmma(acc_ref, do_smem, vt_smem.at[slot])
                    return acc_ref[...]

                dp = pl.run_scoped(dov, plgpu.ACC((bq, bk), jnp.float32))
                ids = (None, None)
                if st.doc is not None:  # every step waits for its slot's key ids (one barrier phase per load)
                    plgpu.barrier_wait(kid_bar.at[slot])
                    ids = (_along(qid, t, 0), _along(_vec(plgpu, st, kid_smem.at[slot], col), t, 1))
                ok = None
                if partial:
                    ok = _allowed(st, iota(0) + base, iota(1) + index_ref[i, s] * bk, q_len, kv_len, *ids)
                p = core.probs(t, core.rows(lse, t), 0.0, ok, base2=st.core.base2)
                ds = pull(core.dlogits(p, dp, delta)).astype(dtype)
                if st.interpret:  # the GPU interpreter's wgmma reads its A operand from shared memory only
                    ds_smem2.at[wg][...] = ds
                    plgpu.commit_smem()
                    ds = ds_smem2.at[wg]
                plgpu.barrier_wait(k_bar.at[slot])

                def dsk(acc_ref):
                    plgpu.wgmma(acc_ref, ds, k_smem.at[slot])
                    return acc_ref[...]

                dq = dq + pl.run_scoped(dsk, plgpu.ACC((bq, H), jnp.float32))
                plgpu.barrier_arrive(done.at[slot])
                return dq

            dq = jnp.zeros((bq, H), jnp.float32)
            dq = dq if st.interpret else plgpu.layout_cast(dq, wgmma)
            dq = _two_loops(st, n_full, total, step, dq)
            q_smem[...] = (dq * (st.core.grad_scale * st.core.q_factor)).astype(dtype)  # the queries' slot, free now
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer_wg():
            kvh = lax.div(h, G)

            def copies(s):
                keys = pl.ds(index_ref[i, s] * bk, bk)
                out = [
                    (kt_ref.at[b, kvh, :, keys], kt_smem, kt_bar), (vt_ref.at[b, kvh, :, keys], vt_smem, vt_bar),
                    (k_ref.at[b, keys, kvh], k_smem, k_bar),
                ]  # fmt: skip
                return out + ([(ids_ref.at[b, 1, keys], kid_smem, kid_bar)] if st.doc is not None else [])

            _producer(plgpu, copies, (done,), total, C)

    tiles = _tiles(plgpu)
    smem = (
        plgpu.SMEM((2, bq, H), dtype, **tiles),
        plgpu.SMEM((2, bq, H), dtype, **tiles),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.SMEM((C, H, bk), dtype, **tiles),
        plgpu.SMEM((C, H, bk), dtype, **tiles),
        plgpu.SMEM((C, bk, H), dtype, **tiles),
        plgpu.SMEM((2, bq, bk), dtype, **tiles) if st.interpret else None,
        plgpu.SMEM((2, bq), jnp.int32),
        plgpu.SMEM((C, bk), jnp.int32),
    )
    bars = (plgpu.Barrier(num_barriers=10), *(plgpu.Barrier(num_barriers=C) for _ in range(4)))
    done = plgpu.Barrier(num_arrivals=2, num_barriers=C)
    out_type = jax.ShapeDtypeStruct((B, Tp, N, H), dtype)
    grid = (N, Tp // (2 * bq), B)
    return _launch(
        plgpu, st, kernel, (smem, bars, done), grid, ("heads", "q_seq", "batch"), out_type, q, do, kt, vt, k, lse,
        delta, ids, index, counts, lens,
    )  # fmt: skip


def _dkv(q, do, qt, dot, k, v, ld, ids, index_t, counts_t, lens, *, st: _Static, bq: int, C: int):
    """q (pre-scaled), do [B, N, Tp, H]; qt, dot [B, N, H, Tp] (the same transposed); k, v [B, K, Sp, H];
    ld [B, N, 2, Tp] fp32 (lse in the forward's units, delta); ids the segment ids ([B, 2, L] int32: the
    queries', the keys'; read with a document mask); the transposed schedule (128-key blocks,
    ``bq``-row query blocks) -> dk, dv [B, Sp, N, H] per query head in the input dtype (the caller sums the
    G heads of a kv head)."""
    plgpu = _plgpu()
    B, N, Tp, H = q.shape
    Sp = k.shape[2]
    bk = _BK_DKV
    G = st.N // st.K
    dtype = q.dtype
    row, col, wgmma = _row_layout(plgpu), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA

    def vec(ref):
        return _vec(plgpu, st, ref, col)

    def iota(axis):
        return _iota(plgpu, st, (bk, bq), axis)

    def cols(x, like):  # per-column values [bq] along the rows of like [bk, bq]
        return _along(x, like, 1)

    def kernel(q_ref, do_ref, qt_ref, dot_ref, k_ref, v_ref, ld_ref, ids_ref, index_ref, counts_ref,
               lens_ref, dk_ref, dv_ref, scoped):  # fmt: skip
        smem, bars, done = scoped
        k_smem2, v_smem2, q_smem, do_smem, qt_smem, dot_smem, ld_smem, p_smem2, kid_smem2, qid_smem = smem
        kv_bar, q_bar, do_bar, qt_bar, dot_bar, ld_bar, qid_bar = bars
        b, h, j, wg, n_full, total = _program(counts_ref, "kv_seq")

        @pl.when(wg < 2)
        def _consumer():
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            kbase = j * (2 * bk) + wg * bk
            keys, kvh = pl.ds(kbase, bk), lax.div(h, G)
            plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, keys], k_smem, kv_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, kvh, keys], v_smem, kv_bar.at[2 + wg])
            if st.doc is not None:
                plgpu.copy_gmem_to_smem(ids_ref.at[b, 1, keys], kid_smem2.at[wg], kv_bar.at[4 + wg])
                plgpu.barrier_wait(kv_bar.at[4 + wg])
            plgpu.barrier_wait(kv_bar.at[wg])
            plgpu.barrier_wait(kv_bar.at[2 + wg])
            kid = _vec(plgpu, st, kid_smem2.at[wg], row) if st.doc is not None else None
            q_len, kv_len = lens_ref[b, 0], lens_ref[b, 1]

            def step(s, carry, partial):
                dk, dv = carry
                slot = lax.rem(s, C)
                plgpu.barrier_wait(qt_bar.at[slot])

                def kq(acc_ref):  # s^T = k q^T
                    plgpu.wgmma(acc_ref, k_smem, qt_smem.at[slot])
                    return acc_ref[...]

                tt, pull = _mod_vjp(st, pl.run_scoped(kq, plgpu.ACC((bk, bq), jnp.float32)))
                plgpu.barrier_wait(dot_bar.at[slot])

                def vdo(acc_ref):  # dp^T = v do^T
                    plgpu.wgmma(acc_ref, v_smem, dot_smem.at[slot])
                    return acc_ref[...]

                dpt = pl.run_scoped(vdo, plgpu.ACC((bk, bq), jnp.float32))
                plgpu.barrier_wait(ld_bar.at[slot])
                lse, delta = vec(ld_smem.at[slot, 0]), vec(ld_smem.at[slot, 1])
                ids = (None, None)
                if st.doc is not None:  # every step waits for its slot's query ids (one barrier phase per load)
                    plgpu.barrier_wait(qid_bar.at[slot])
                    ids = (cols(vec(qid_smem.at[slot]), tt), _along(kid, tt, 0))
                ok = None
                if partial:
                    ok = _allowed(st, iota(1) + index_ref[j, s] * bq, iota(0) + kbase, q_len, kv_len, *ids)
                pt = core.probs(tt, cols(lse, tt), 0.0, ok, base2=st.core.base2)
                dst = pull(pt * (dpt - cols(delta, dpt))).astype(dtype)
                pt = pt.astype(dtype)
                if st.interpret:  # the GPU interpreter's wgmma reads its A operand from shared memory only
                    p_smem2.at[wg, 0][...] = pt
                    p_smem2.at[wg, 1][...] = dst
                    plgpu.commit_smem()
                    pt, dst = p_smem2.at[wg, 0], p_smem2.at[wg, 1]
                plgpu.barrier_wait(do_bar.at[slot])

                def pdo(acc_ref):  # dv += p^T do
                    plgpu.wgmma(acc_ref, pt, do_smem.at[slot])
                    return acc_ref[...]

                dv = dv + pl.run_scoped(pdo, plgpu.ACC((bk, H), jnp.float32))
                plgpu.barrier_wait(q_bar.at[slot])

                def dsq(acc_ref):  # dk += ds^T q
                    plgpu.wgmma(acc_ref, dst, q_smem.at[slot])
                    return acc_ref[...]

                dk = dk + pl.run_scoped(dsq, plgpu.ACC((bk, H), jnp.float32))
                plgpu.barrier_arrive(done.at[slot])
                return dk, dv

            zero = jnp.zeros((bk, H), jnp.float32)
            zero = zero if st.interpret else plgpu.layout_cast(zero, wgmma)
            dk, dv = _two_loops(st, n_full, total, step, (zero, zero))
            k_smem[...] = (dk * st.core.grad_scale).astype(dtype)  # the keys' and values' slots, free now
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, keys, h])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, keys, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer_wg():
            def copies(s):
                rows = pl.ds(index_ref[j, s] * bq, bq)
                out = [
                    (qt_ref.at[b, h, :, rows], qt_smem, qt_bar), (dot_ref.at[b, h, :, rows], dot_smem, dot_bar),
                    (ld_ref.at[b, h, :, rows], ld_smem, ld_bar), (do_ref.at[b, h, rows], do_smem, do_bar),
                    (q_ref.at[b, h, rows], q_smem, q_bar),
                ]  # fmt: skip
                return out + ([(ids_ref.at[b, 0, rows], qid_smem, qid_bar)] if st.doc is not None else [])

            _producer(plgpu, copies, (done,), total, C)

    tiles = _tiles(plgpu)
    smem = (
        plgpu.SMEM((2, bk, H), dtype, **tiles),
        plgpu.SMEM((2, bk, H), dtype, **tiles),
        plgpu.SMEM((C, bq, H), dtype, **tiles),
        plgpu.SMEM((C, bq, H), dtype, **tiles),
        plgpu.SMEM((C, H, bq), dtype, **tiles),
        plgpu.SMEM((C, H, bq), dtype, **tiles),
        plgpu.SMEM((C, 2, bq), jnp.float32),
        plgpu.SMEM((2, 2, bk, bq), dtype, **tiles) if st.interpret else None,
        plgpu.SMEM((2, bk), jnp.int32),
        plgpu.SMEM((C, bq), jnp.int32),
    )
    bars = (plgpu.Barrier(num_barriers=6), *(plgpu.Barrier(num_barriers=C) for _ in range(6)))
    done = plgpu.Barrier(num_arrivals=2, num_barriers=C)
    out_type = (jax.ShapeDtypeStruct((B, Sp, N, H), dtype),) * 2
    grid = (N, Sp // (2 * bk), B)
    return _launch(
        plgpu, st, kernel, (smem, bars, done), grid, ("heads", "kv_seq", "batch"), out_type, q, do, qt, dot, k, v,
        ld, ids, index_t, counts_t, lens,
    )  # fmt: skip


def _mosaic_backward(st, cfg: MosaicBackward, q, k, v, ids, lens, sched_dq, sched_dkv, out, lse, do):
    """dq, dk, dv from the forward's residuals with the two Mosaic kernels (dk, dv summed over G in fp32)."""
    B, Tp, N, H = q.shape
    K, G, Sp = st.K, st.N // st.K, k.shape[1]
    C = cfg.max_concurrent_steps
    delta = jnp.transpose(core.softmax_delta(out, do), (0, 2, 1))  # [B, Tp, N] -> [B, N, Tp]
    qs = jnp.transpose((q.astype(jnp.float32) * st.core.q_factor).astype(q.dtype), (0, 2, 1, 3))  # [B, N, Tp, H]
    dos = jnp.transpose(do.astype(q.dtype), (0, 2, 1, 3))
    kt, vt = jnp.transpose(k, (0, 2, 3, 1)), jnp.transpose(v, (0, 2, 3, 1))  # [B, K, H, Sp]
    dq = _dq(qs, dos, kt, vt, k, lse, delta, ids, *sched_dq, lens, st=st, bk=cfg.block_kv_dq, C=C)
    kh, vh = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))  # [B, K, Sp, H]
    ld = jnp.stack([lse, delta], 2)  # [B, N, 2, Tp]
    dk, dv = _dkv(
        qs, dos, jnp.swapaxes(qs, -1, -2), jnp.swapaxes(dos, -1, -2), kh, vh, ld, ids, *sched_dkv, lens, st=st,
        bq=cfg.block_q_dkv, C=C,
    )  # fmt: skip
    dk, dv = (x.astype(jnp.float32).reshape(B, Sp, K, G, H).sum(3) for x in (dk, dv))  # G heads per kv head
    return dq, dk, dv


# ------------------------------------------------------------------------------------------
# custom_vjp: the Mosaic forward; the Mosaic or the Triton backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(st, bwd, q, k, v, ids, lens, sched, sched_bwd):
    """bwd: ``("mosaic", MosaicBackward)`` or ``("triton", pallas_flash._Static)``; ids the segment ids
    ``[B, 2, L]`` int32 (queries', keys'; read with a document mask); sched_bwd the pair of schedules the backward's
    two kernels read: (dq's rows, dk/dv's transposed rows)."""
    return _forward(st, q, k, v, ids, lens, sched)[0]


def _forward(st, q, k, v, ids, lens, sched):
    qs = (q.astype(jnp.float32) * st.core.q_factor).astype(q.dtype)
    kt = jnp.transpose(k, (0, 2, 3, 1))  # [B, Sp, K, H] -> [B, K, H, Sp]: the q k^T product's B operand
    return _fwd(qs, kt, v, ids, *sched, lens, st=st)


def _flash_fwd(st, bwd, q, k, v, ids, lens, sched, sched_bwd):
    out, lse = _forward(st, q, k, v, ids, lens, sched)
    return out, (q, k, v, ids, lens, sched, sched_bwd, out, lse)


def _flash_bwd(st, bwd, res, do):
    q, k, v, ids, lens, sched, sched_bwd, out, lse = res
    (index, counts), (index_t, counts_t) = sched_bwd
    kind, cfg = bwd
    if kind == "mosaic":
        dq, dk, dv = _mosaic_backward(
            st, cfg, q, k, v, ids, lens, (index, counts), (index_t, counts_t), out, lse, do
        )  # fmt: skip
    else:
        delta = jnp.transpose(core.softmax_delta(out, do), (0, 2, 1))  # [B, Tp, N] -> [B, N, Tp]
        do = do.astype(q.dtype)
        interpret = not cfg.on_gpu
        dq, *_ = pallas_flash._dq_call(
            q, k, v, do, lse, delta, (index, counts), lens, None, (), st=cfg, interpret=interpret
        )
        dk, dv = pallas_flash._dkv_call(
            q, k, v, do, lse, delta, (index_t, counts_t), lens, None, (), st=cfg, interpret=interpret
        )
    zeros = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, jax.dtypes.float0), (ids, lens, sched, sched_bwd))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *zeros)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _segment_ids(doc, lead, T: int, S: int, L: int):
    """A document mask's ids as one int32 ``[B, 2, L]`` (row 0 the queries', row 1 the keys', each padded to L;
    zeros without one): one operand for the three kernels; the padded tails are outside the lengths."""
    B = math.prod(lead)
    if doc is None:
        return jnp.zeros((B, 2, L), jnp.int32)

    def one(ids, n):
        ids = jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (*lead, n)).reshape(B, n)
        return jnp.pad(ids, ((0, 0), (0, L - n)))

    return jnp.stack([one(doc.q_ids, T), one(doc.kv_ids, S)], 1)


def attend(call: Call, *, config: MosaicConfig | None = None):
    """The Mosaic forward (and the Mosaic or Triton backward, ``config.backward``) on a bound call the
    implementation supports."""
    if call.empty:
        return call.zeros()
    config = default_config(call) if config is None else config
    backend = platform.target()
    lead, T, S, N, K, H = call.lead, call.T, call.S, call.N, call.K, call.H
    bq, bk = config.block_q, config.block_kv
    form = mosaic_mask(call)
    if form is None:
        raise ValueError(f"mask: the Mosaic kernels take padding, an interval and a document mask, got {call.mask}")
    pads, bounds, doc = form
    bwd = config.backward
    if doc is not None and not isinstance(bwd, MosaicBackward):  # the Triton kernels read documents as bitmaps
        bwd = MosaicBackward()  # (H <= 128: ``supports`` says so for documents above)
    mosaic_bwd = isinstance(bwd, MosaicBackward)
    if mosaic_bwd and H > 128:
        raise ValueError(
            f"config: the Mosaic backward takes H <= 128 (shared memory), got H = {H}; use a PallasConfig backward"
        )
    if mosaic_bwd and backend == "gpu" and max(backward_smem_bytes(bwd, bq, H, call.q.dtype.itemsize)) > SMEM_BYTES:
        dq_b, dkv_b = backward_smem_bytes(bwd, bq, H, call.q.dtype.itemsize)
        raise ValueError(
            f"config: {bwd} needs {dq_b // 1024} KB (dq) and {dkv_b // 1024} KB (dk/dv) of shared memory at H = {H}, "
            f"over {SMEM_BYTES // 1024} KB: fewer slots or smaller tiles"
        )
    if mosaic_bwd:  # dq: 2*bq-row blocks, block_kv_dq keys; dk/dv: 2*64-key blocks, block_q_dkv rows
        q_blocks, k_blocks = (2 * bq, bwd.block_q_dkv), (bwd.block_kv_dq, 2 * _BK_DKV)
    else:
        q_blocks, k_blocks = (bwd.block_q,), (bwd.block_k,)
    align_q, align_k = np.lcm.reduce([2 * bq, *q_blocks]), np.lcm.reduce([bk, *k_blocks])
    Tp, Sp = -(-T // align_q) * align_q, -(-S // align_k) * align_k
    m = call.mask

    def plan(bq_, bk_, transposed=False):
        """The schedule of (bq_, bk_) tiles over the padded lengths (refined on device for traced masks)."""
        info = pallas_mask_info.mask_info(m, lead, T, S, bq_, bk_)
        rt = None if m is None or m.is_static else m.runtime_layout(T, S, bq_, bk_)
        nq_, nk_ = Tp // bq_, Sp // bk_
        return schedule.Schedule(
            _padded(info.layout, nq_, nk_), S, bk_, runtime=_padded_rt(rt, nq_, nk_), transposed=transposed,
            pow2=transposed,
        ), info  # fmt: skip

    fwd_sched, _ = plan(2 * bq, bk)
    st = _Static(
        core=core.tile_spec(call.score, H, T, S),
        bq=bq,
        bk=bk,
        steps=config.max_concurrent_steps,
        N=N,
        K=K,
        H=H,
        interval=bounds,
        doc=None if doc is None else (doc.padding_id,),
        kinds=fwd_sched.kinds,
        interpret=backend != "gpu",
    )
    if mosaic_bwd:
        dq_sched, _ = plan(2 * bq, bwd.block_kv_dq)
        dkv_sched, _ = plan(bwd.block_q_dkv, 2 * _BK_DKV, transposed=True)
        # one kinds set for both kernels: a loop for a kind either schedule holds
        kinds_b = dq_sched.kinds | dkv_sched.kinds
        bwd_arg = ("mosaic", bwd)
        st = dataclasses.replace(st, kinds=st.kinds | kinds_b)
        rows_dq, rows_dkv = (dq_sched.index, dq_sched.counts), (dkv_sched.index_t, dkv_sched.counts_t)
    else:
        bwd_sched, bwd_info = plan(bwd.block_q, bwd.block_k, transposed=True)
        bwd_arg = ("triton", pallas_flash._Static(
            core=st.core,
            bq=bwd.block_q,
            bk=bwd.block_k,
            N=N,
            K=K,
            fp32=False,
            kinds=bwd_sched.kinds,
            kinds_t=frozenset(set(np.unique(bwd_sched.layout.T).tolist()) - {masks_lib.EMPTY}) | bwd_sched.kinds,
            struct=bwd_info.struct,
            num_warps=bwd.num_warps,
            num_stages=bwd.num_stages,
            on_gpu=backend == "gpu",
        ))  # fmt: skip
        rows_dq, rows_dkv = (bwd_sched.index, bwd_sched.counts), (bwd_sched.index_t, bwd_sched.counts_t)
    B = call.batch
    ql, kl = masks_lib.padding_lengths(pads, lead, T, S)
    lens = jnp.stack([ql, kl], -1)
    qp = jnp.pad(call.q.reshape(B, T, N, H), ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
    kp = jnp.pad(call.k.reshape(B, S, K, H), ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    vp = jnp.pad(call.v.reshape(B, S, K, H), ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    sched = (jnp.asarray(fwd_sched.index), jnp.asarray(fwd_sched.counts))
    sched_bwd = tuple(tuple(jnp.asarray(x) for x in r) for r in (rows_dq, rows_dkv))
    ids = _segment_ids(doc, lead, T, S, max(Tp, Sp))
    out = _flash(st, bwd_arg, qp, kp, vp, ids, lens, sched, sched_bwd)
    return out[:, :T].reshape(*lead, T, N, H).astype(call.q.dtype)


def _padded(layout, nq, nk):
    """A layout [nq0, nk0] grown to [nq, nk] with EMPTY blocks (rows and keys past the padded lengths)."""
    out = np.zeros((nq, nk), np.int8)
    out[: layout.shape[0], : layout.shape[1]] = layout
    return out


def _padded_rt(runtime, nq, nk):
    if runtime is None:
        return None
    return jnp.pad(runtime, ((0, nq - runtime.shape[0]), (0, nk - runtime.shape[1])))
