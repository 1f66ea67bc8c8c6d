"""Every implementation through the one conformance suite (tests/conformance.py).

Kernel-specific behaviour (tile sizes, schedules, the cuDNN flag mapping, interpret-mode details)
stays in each kernel's own test file; what every implementation must do is here, once.
"""

from __future__ import annotations

from conformance import Conformance

import attnlab
from attnlab.kernels import cudnn


class TestReference(Conformance):
    IMPL = "reference"


class TestXla(Conformance):
    IMPL = "xla"


class TestBlockwise(Conformance):
    IMPL = "blockwise"


class TestSparse(Conformance):
    IMPL = "sparse"


class TestCudnn(Conformance):
    """cuDNN's flags, run through jax.nn's own XLA path on this CPU (the fused kernel needs a GPU)."""

    IMPL = "cudnn"
    BACKEND = "gpu"

    def run(self, call):
        return cudnn.attend(call, implementation="xla")


class TestPallas(Conformance):
    """The Triton kernel's own logic in Pallas interpret mode."""

    IMPL = "pallas"


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
