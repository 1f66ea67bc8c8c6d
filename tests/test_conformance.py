"""Every registered implementation through the one conformance base (tests/conformance.py).

One subclass per name in ``attnlab.IMPLEMENTATIONS``: each runs every case of the base (every mask
family, score and convention) or skips it with the implementation's own ``supports`` reason.
Kernel-specific behaviour (tile sizes, schedules, the cuDNN flag mapping, interpret-mode details)
stays in each kernel's own test file; what every implementation must do is here, once.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from conformance import Conformance

import attnlab
from attnlab.kernels import cudnn, pallas_flash


class TestReference(Conformance):
    IMPL = "reference"


class TestXla(Conformance):
    IMPL = "xla"


class TestBlockwise(Conformance):
    IMPL = "blockwise"


class TestSparse(Conformance):
    IMPL = "sparse"


class TestCudnn(Conformance):
    """cuDNN's flags, run through jax.nn's own XLA path on this CPU (the fused kernel needs a GPU).

    The stand-in computes half-precision inputs in fp32 and casts back, as attnlab's own "xla" path does
    on XLA:CPU (docs/conventions.md, "Half precision on CPU"): XLA:CPU has no fp16 x fp16 -> fp32 dot and
    rejects jax.nn's bf16 dot at tiny shapes under jit; what is checked here is the mapping of masks to
    cuDNN's flags, and cuDNN's own numerics are checked on a GPU (benchmarks/gpu_check.py).
    """

    IMPL = "cudnn"
    BACKEND = "gpu"

    def run(self, call):
        up = dataclasses.replace(
            call, q=call.q.astype(jnp.float32), k=call.k.astype(jnp.float32), v=call.v.astype(jnp.float32)
        )
        return cudnn.attend(up, implementation="xla").astype(call.dtype)


class TestPallas(Conformance):
    """The Triton kernel's own logic in Pallas interpret mode, on 16 x 16 tiles: every case spans several
    tiles per row (EMPTY, PARTIAL and FULL ones, a short last one), as on a GPU at its sizes; the same
    programs' time as one tile at these sizes (interpret mode is bound by compiling, not by the grid)."""

    IMPL = "pallas"

    def run(self, call):
        return pallas_flash.attend(call, config=pallas_flash.PallasConfig(block_q=16, block_k=16))


class TestMosaic(Conformance):
    """The Hopper forward takes bf16/fp16 at head dims that are multiples of 64: the suite's cases (H = 8)
    skip with its reason; tests/test_mosaic.py runs it in the GPU interpreter against the reference."""

    IMPL = "mosaic"


class TestSplash(Conformance):
    """jax's TPU splash kernel fed by attnlab masks, in Pallas interpret mode."""

    IMPL = "splash"


def test_every_implementation_has_a_conformance_class():
    tested = {cls.IMPL for cls in Conformance.__subclasses__()}
    assert tested == set(attnlab.IMPLEMENTATIONS)
