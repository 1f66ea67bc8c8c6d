"""The Hopper (sm90) Mosaic GPU kernels as an implementation: ``attnlab.kernels.mosaic_gpu``, loaded lazily.

GPU (Hopper): a warp-specialised forward (TMA producer, two wgmma consumers) on attnlab's schedules,
with the Triton dq and dk/dv kernels as its backward or (``MosaicBackward``, H <= 128) Mosaic ones;
bf16/fp16, head dims that are multiples of 64 up to 256, Hv == H, the dot product or SoftCap, masks that
are padding lengths, an interval (full, causal, windows) and one document mask (H <= 128). Planned for a
CPU it runs in Pallas' GPU interpret mode (slow: for tests).

Dispatch tries it before the Triton kernel on a GPU, and takes it where it pays off: where a tuning
table (``attnlab.tuning``: the user's, then the committed one) holds a time for this device, dtype,
head dims, mask family and length that beats the Triton kernel's time for the same key. Until it has
been measured faster on a device, ``implementation="mosaic"`` runs it and ``None`` goes on to
``pallas``.
"""

from __future__ import annotations

import jax.numpy as jnp

from attnlab import masks as masks_lib
from attnlab import scores as scores_lib
from attnlab import tuning
from attnlab.impls.base import LazyImplementation, static_scale_reason
from attnlab.impls.pallas import dtype_reason

__all__ = ["MOSAIC", "Mosaic"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def mosaic_mask(call):
    """The call's mask as ``(padding factors, interval bounds or None, document or None)``, or None when it has
    no such form: padding lengths, an interval (full, causal, windows) and at most one document mask."""
    if call.mask is None:
        return (), None, None
    pads, rest = call.mask.split_padding()
    if rest is None or rest.is_full:
        return pads, None, None
    parts = rest.conjuncts()
    docs = [c for c in parts if isinstance(c, masks_lib.Document)]
    others = masks_lib.and_all([c for c in parts if not isinstance(c, masks_lib.Document)])
    if len(docs) > 1:
        return None
    bounds = None if others is None or others.is_full else others.interval()
    if others is not None and not others.is_full and bounds is None:
        return None
    return pads, bounds, (docs[0] if docs else None)


def mask_reason(call) -> str | None:
    """None when the mask is padding lengths, an interval (``t + lo <= s <= t + hi``) and at most one document
    mask (at H <= 128: documents take the Mosaic backward), else why not."""
    form = mosaic_mask(call)
    if form is None:
        _, rest = call.mask.split_padding()
        return (
            "mosaic: masks with an interval form (causal, windows), one document mask and padding lengths only "
            f"(got {type(rest).__name__}: 'pallas' takes every mask)"
        )
    if form[2] is not None and call.H > 128:
        return f"mosaic: a document mask at H <= 128 (its backward is the Mosaic one), got H = {call.H}"
    return None


class Mosaic(LazyImplementation):
    """The Mosaic GPU forward (``attnlab.kernels.mosaic_gpu``) with the Triton or the Mosaic backward."""

    def __init__(self):
        super().__init__("mosaic", "attnlab.kernels.mosaic_gpu")

    def check(self, call, backend):
        """None when the kernel can run the bound call on ``backend`` (``"gpu"``: Hopper; ``"cpu"``: the GPU
        interpreter), else why not. Shapes only."""
        if (reason := static_scale_reason("mosaic", call)) is not None:
            return reason
        if backend not in ("gpu", "cuda", "cpu"):
            return f"mosaic: a Hopper GPU kernel (backend {backend!r})"
        form = call.score.tile_form()
        if not (isinstance(form, scores_lib.DotTile) or (isinstance(form, scores_lib.ModTile) and form.elementwise)):
            return f"mosaic: the dot product or SoftCap only (got score {type(call.score).__name__}; 'pallas' takes it)"
        if call.bias is not None:
            return "mosaic: no bias"
        reason = dtype_reason("mosaic", call, _DTYPES)
        if reason is not None:
            return reason
        if call.H % 64 or call.H > 256 or call.Hv != call.H:
            return f"mosaic: head dims a multiple of 64 up to 256 with Hv == H (got H={call.H}, Hv={call.Hv})"
        return mask_reason(call)

    def pays_off(self, call, backend):
        """``implementation=None`` only: where a tuning table times this kernel faster than the Triton kernel
        for the call's key (device, dtype, head dims, mask family, length); otherwise not (yet)."""
        if backend == "cpu":
            return "mosaic: on a CPU it runs in the GPU interpreter (tests only)"
        mine, triton = _best_ms("mosaic", call, backend), _best_ms("pallas", call, backend)
        if mine is not None and triton is not None and mine < triton:
            return None
        device = tuning.device_kind(backend)
        return (
            f"mosaic: not measured faster than pallas on {device} for this call (attnlab.autotune with "
            f"implementation='mosaic' and 'pallas' records both); implementation='mosaic' runs it"
        )

    def run(self, call):
        return self.run_with(call, tuning.lookup(self.name, call))

    def run_with(self, call, config):
        mod = self.kernel.load()
        if mod is None:
            raise ValueError(f"implementation={self.name!r}: {self.kernel.why}")
        return mod.attend(call, config=config)


def _best_ms(implementation, call, backend):
    """The table's time for the call's key (either direction, the nearest length), or None."""
    want = tuning.key_of(implementation, call, backend)
    best = None
    for key, _, ms in tuning.load_timed():
        if ms is None or key.implementation != implementation:
            continue
        same = (key.device, key.dtype, key.head_dims, key.mask) == (want.device, want.dtype, want.head_dims, want.mask)
        if same and key.length == want.length:
            best = ms if best is None else min(best, ms)
    return best


class MosaicTuning:
    """The Mosaic kernel's tunable parameters (``mosaic_gpu.MosaicConfig``): key tile, slots in flight, and the
    backward (the Mosaic kernels' or the Triton ones' configuration)."""

    def _module(self):
        from attnlab.kernels import mosaic_gpu  # noqa: PLC0415 (loaded lazily)

        return mosaic_gpu

    def space(self, call, backend):
        """Key tiles x slots in flight x backward kernels: two Triton configurations and, at H <= 128,
        the Mosaic backward (64-key dq tiles, 64-row dk/dv steps, 2 slots: what fits in shared memory)."""
        mg = self._module()
        bwd = [mg.pallas_flash.PallasConfig(64, 64, 4, 2), mg.pallas_flash.PallasConfig(128, 64, 8, 2)]
        if call.H <= 128:
            bwd.append(mg.MosaicBackward(64, 64, 2))
        kv = (64, 128) if call.H <= 128 else (64,)
        return [mg.MosaicConfig(64, bk, c, b) for bk in kv for c in (2, 3, 4) for b in bwd]

    def run(self, call, config):
        return MOSAIC.run_with(call, config)

    def to_json(self, config):
        """The backward as ``[block_q, block_k, num_warps, num_stages]`` (Triton) or ``{"mosaic": [block_kv_dq,
        block_q_dkv, max_concurrent_steps]}``."""
        b = config.backward
        if isinstance(b, self._module().MosaicBackward):
            backward = {"mosaic": [b.block_kv_dq, b.block_q_dkv, b.max_concurrent_steps]}
        else:
            backward = [b.block_q, b.block_k, b.num_warps, b.num_stages]
        return {
            "block_q": config.block_q, "block_kv": config.block_kv, "max_concurrent_steps": config.max_concurrent_steps,
            "backward": backward,
        }  # fmt: skip

    def from_json(self, d):
        mg = self._module()
        b = d["backward"]
        if isinstance(b, dict):
            bwd = mg.MosaicBackward(*(int(x) for x in b["mosaic"]))
        else:
            bwd = mg.pallas_flash.PallasConfig(*(int(x) for x in b))
        return mg.MosaicConfig(int(d["block_q"]), int(d["block_kv"]), int(d["max_concurrent_steps"]), bwd)


Mosaic.tunable = MosaicTuning()
MOSAIC = Mosaic()
