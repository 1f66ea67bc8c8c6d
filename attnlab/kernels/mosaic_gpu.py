"""A Hopper (sm90) flash-attention forward in Pallas Mosaic GPU: warp-specialised, TMA, wgmma; on the tile core.

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
  ``iota`` positions, and the padding lengths); EMPTY tiles are never loaded, and a schedule refined
  on device from traced padding lengths is read the same way;
* scores: the dot product and elementwise mods (``SoftCap``); masks: padding lengths and masks with
  an interval form (full, causal, windows); bf16 / fp16, head dims that are multiples of 64 up to
  256, Hv == H. Everything else goes to the Triton kernel (``supports`` says why).

The backward runs the Triton dq and dk/dv kernels of ``pallas_flash`` on the forward's output and
base-2 log-sum-exp (the same conventions), so ``jax.grad`` works; a Mosaic backward is not written.
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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from attnlab import masks as masks_lib
from attnlab import platform
from attnlab.call import Call
from attnlab.kernels import pallas_flash, pallas_mask_info, schedule
from attnlab.kernels import tile_core as core

__all__ = ["MosaicConfig", "attend", "default_config"]


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
        backward: the Triton configuration of the dq and dk/dv kernels.
    """

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2
    backward: pallas_flash.PallasConfig = pallas_flash.PallasConfig(64, 64, 4, 2)

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"block_q must be 64 (one wgmma row block per consumer), got {self.block_q!r}")
        if not isinstance(self.block_kv, int) or self.block_kv <= 0 or self.block_kv % 64:
            raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv!r}")
        if not isinstance(self.max_concurrent_steps, int) or self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be an int >= 2, got {self.max_concurrent_steps!r}")


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


def _fwd(q, kt, v, index, counts, lens, *, st: _Static):
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
        if st.interpret:
            return jax.lax.broadcasted_iota(jnp.int32, (bq, bk), axis)
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), axis, layout=wgmma)

    def kernel(q_ref, kt_ref, v_ref, index_ref, counts_ref, lens_ref, out_ref, lse_ref, scoped):
        smem, bars, consumed = scoped
        qo_smem2, kt_smem, v_smem, lse_smem2, p_smem2 = smem
        kt_bar, v_bar, q_bar = bars
        kt_done, v_done = consumed
        b, h, i = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
        wg = lax.axis_index("wg")
        n_full, n_part = counts_ref[i, 0], counts_ref[i, 1]
        total = n_full + n_part

        @pl.when(wg < 2)
        def _consumer():
            qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
            base = i * (2 * bq) + wg * bq
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(base, bq), h], qo_smem, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
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
                ok = None
                if partial:
                    q_pos = iota(0) + base
                    k_pos = iota(1) + kb * bk
                    ok = (k_pos < jnp.minimum(kv_len, st.core.S)) & (q_pos < q_len)
                    if st.interval is not None:
                        lo, hi = st.interval
                        if lo is not None:
                            ok = ok & (k_pos - q_pos >= lo)
                        if hi is not None:
                            ok = ok & (k_pos - q_pos <= hi)
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
            carry = (acc, m, l)
            if masks_lib.FULL in st.kinds:
                carry = lax.fori_loop(0, n_full, lambda s, c: step(s, c, False), carry)
            if masks_lib.PARTIAL in st.kinds:
                carry = lax.fori_loop(n_full, total, lambda s, c: step(s, c, True), carry)
            out, (m, log_l) = core.softmax_finalize(*carry[1:], carry[0], base2=st.core.base2)
            qo_smem[...] = out.astype(dtype)
            lse_smem[...] = m + log_l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(base, bq), h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(base, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer():
            kvh = lax.div(h, G)

            def load(s, slot):
                kb = index_ref[i, s]
                plgpu.copy_gmem_to_smem(kt_ref.at[b, kvh, :, pl.ds(kb * bk, bk)], kt_smem.at[slot], kt_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(kb * bk, bk), kvh], v_smem.at[slot], v_bar.at[slot])

            for s in range(C):  # the prologue fills the slots (as far as the row has tiles)

                @pl.when(s < total)
                def _(s=s):
                    load(s, s)

            @pl.loop(C, jnp.maximum(total, C))
            def _(s):
                slot = lax.rem(s, C)
                plgpu.barrier_wait(kt_done.at[slot])
                plgpu.barrier_wait(v_done.at[slot])
                load(s, slot)

            # observe the last steps' consumption too (every barrier phase is waited on once: the GPU
            # interpreter checks it; on the device the producer has nothing left to do)
            @pl.loop(jnp.maximum(total - C, 0), total)
            def _(s):
                slot = lax.rem(s, C)
                plgpu.barrier_wait(kt_done.at[slot])
                plgpu.barrier_wait(v_done.at[slot])

    def entry(q_ref, kt_ref, v_ref, index_ref, counts_ref, lens_ref, out_ref, lse_ref):
        tiling, swizzle = plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)
        smem = (
            plgpu.SMEM((2, bq, H), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((C, H, bk), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((C, bk, H), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, bq, bk), dtype, transforms=(tiling, swizzle)) if st.interpret else None,
        )
        bars = (plgpu.Barrier(num_barriers=C), plgpu.Barrier(num_barriers=C), plgpu.Barrier(num_barriers=2))
        consumed = (plgpu.Barrier(num_arrivals=2, num_barriers=C), plgpu.Barrier(num_arrivals=2, num_barriers=C))
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, kt_ref, v_ref, index_ref, counts_ref, lens_ref, out_ref, lse_ref, scoped),
            smem,
            bars,
            consumed,
            collective_axes="wg",
        )

    kw = dict(
        grid=(N, Tp // (2 * bq), B),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
    )
    if st.interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415 (tests only)

        kw["interpret"] = InterpretGPUParams()
    else:
        kw["compiler_params"] = plgpu.CompilerParams(approx_math=True)
    out_type = (jax.ShapeDtypeStruct((B, Tp, N, H), dtype), jax.ShapeDtypeStruct((B, N, Tp), jnp.float32))
    return _kernel_call(plgpu, entry, out_type, **kw)(q, kt, v, index, counts, lens)


# ------------------------------------------------------------------------------------------
# custom_vjp: the Mosaic forward, the Triton backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(st, bst, q, k, v, lens, sched, sched_bwd):
    return _forward(st, q, k, v, lens, sched)[0]


def _forward(st, q, k, v, lens, sched):
    qs = (q.astype(jnp.float32) * st.core.q_factor).astype(q.dtype)
    kt = jnp.transpose(k, (0, 2, 3, 1))  # [B, Sp, K, H] -> [B, K, H, Sp]: the q k^T product's B operand
    return _fwd(qs, kt, v, *sched, lens, st=st)


def _flash_fwd(st, bst, q, k, v, lens, sched, sched_bwd):
    out, lse = _forward(st, q, k, v, lens, sched)
    return out, (q, k, v, lens, sched, sched_bwd, out, lse)


def _flash_bwd(st, bst, res, do):
    q, k, v, lens, sched, sched_bwd, out, lse = res
    (index, counts), (index_t, counts_t) = sched_bwd
    delta = jnp.transpose(core.softmax_delta(out, do), (0, 2, 1))  # [B, Tp, N] -> [B, N, Tp]
    do = do.astype(q.dtype)
    interpret = not bst.on_gpu
    dq, *_ = pallas_flash._dq_call(
        q, k, v, do, lse, delta, (index, counts), lens, None, (), st=bst, interpret=interpret
    )
    dk, dv = pallas_flash._dkv_call(
        q, k, v, do, lse, delta, (index_t, counts_t), lens, None, (), st=bst, interpret=interpret
    )
    zeros = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, jax.dtypes.float0), (lens, sched, sched_bwd))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *zeros)


_flash.defvjp(_flash_fwd, _flash_bwd)


def interval_mask(call: Call):
    """The call's mask as (padding factors, interval bounds or None), or None when it has no such form."""
    if call.mask is None:
        return (), None
    pads, rest = call.mask.split_padding()
    if rest is None or rest.is_full:
        return pads, None
    bounds = rest.interval()
    return (pads, bounds) if bounds is not None else None


def attend(call: Call, *, config: MosaicConfig | None = None):
    """The Mosaic forward (and the Triton backward) on a bound call the implementation supports."""
    if call.empty:
        return call.zeros()
    config = default_config(call) if config is None else config
    backend = platform.target()
    lead, T, S, N, K, H = call.lead, call.T, call.S, call.N, call.K, call.H
    bq, bk = config.block_q, config.block_kv
    bwd = config.backward
    align = np.lcm.reduce([2 * bq, bwd.block_q])
    Tp, Sp = -(-T // align) * align, -(-S // np.lcm(bk, bwd.block_k)) * np.lcm(bk, bwd.block_k)
    pads, bounds = interval_mask(call)
    m = call.mask
    fwd_info = pallas_mask_info.mask_info(m, lead, T, S, 2 * bq, bk)
    runtime = None
    if m is not None and not m.is_static:
        runtime = m.runtime_layout(T, S, 2 * bq, bk)
    nq_f, nk_f = Tp // (2 * bq), Sp // bk
    fwd_sched = schedule.Schedule(_padded(fwd_info.layout, nq_f, nk_f), S, bk, runtime=_padded_rt(runtime, nq_f, nk_f))
    st = _Static(
        core=core.tile_spec(call.score, H, T, S),
        bq=bq,
        bk=bk,
        steps=config.max_concurrent_steps,
        N=N,
        K=K,
        H=H,
        interval=bounds,
        kinds=fwd_sched.kinds,
        interpret=backend != "gpu",
    )
    bwd_info = pallas_mask_info.mask_info(m, lead, T, S, bwd.block_q, bwd.block_k)
    bwd_rt = None if m is None or m.is_static else m.runtime_layout(T, S, bwd.block_q, bwd.block_k)
    nq_b, nk_b = Tp // bwd.block_q, Sp // bwd.block_k
    bwd_sched = schedule.Schedule(
        _padded(bwd_info.layout, nq_b, nk_b), S, bwd.block_k, runtime=_padded_rt(bwd_rt, nq_b, nk_b), transposed=True,
        pow2=True,
    )  # fmt: skip
    bst = pallas_flash._Static(
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
    )
    B = call.batch
    ql, kl = masks_lib.padding_lengths(pads, lead, T, S)
    lens = jnp.stack([ql, kl], -1)
    qp = jnp.pad(call.q.reshape(B, T, N, H), ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
    kp = jnp.pad(call.k.reshape(B, S, K, H), ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    vp = jnp.pad(call.v.reshape(B, S, K, H), ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    sched = (jnp.asarray(fwd_sched.index), jnp.asarray(fwd_sched.counts))
    sched_bwd = (
        (jnp.asarray(bwd_sched.index), jnp.asarray(bwd_sched.counts)),
        (jnp.asarray(bwd_sched.index_t), jnp.asarray(bwd_sched.counts_t)),
    )
    out = _flash(st, bst, qp, kp, vp, lens, sched, sched_bwd)
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
