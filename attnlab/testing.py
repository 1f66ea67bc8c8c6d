"""Tolerances for comparing a fast path with the dense fp32 reference: the one table.

Every comparison of an implementation with ``attnlab.attention_reference`` (the test suite's
conformance cases, ``benchmarks/gpu_check.py`` on a device, a researcher's own check of a kernel)
reads its tolerance here, per input dtype and per quantity (the output, or a gradient):

* ``tolerance(dtype)`` / ``tolerance(dtype, "grad")``: ``dict(atol=, rtol=)`` for
  ``numpy.testing.assert_allclose`` on values of order one (random normal inputs), on the CPU,
  where an fp32 tile product is an exact fp32 product;
* ``tolerance(dtype, backend="gpu")``: the same on a GPU, where fp32 tile products run on tensor
  cores (TF32, three passes: about fp32's accuracy, not its last bits), so fp32 is looser there.

Half-precision inputs are compared after upcasting to fp32 (``assert_close`` does it).

Example:
    >>> tolerance("bfloat16")
    {'atol': 0.03, 'rtol': 0.03}
    >>> assert_close(jnp.ones(3), jnp.ones(3) + 1e-6, "float32")
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["TOLERANCES", "tolerance", "assert_close"]

# (backend, quantity) -> {dtype name: (atol, rtol)}; fp32 tight, half precision loose.
TOLERANCES: dict[tuple[str, str], dict[str, tuple[float, float]]] = {
    ("cpu", "out"): {"float32": (2e-5, 2e-5), "bfloat16": (3e-2, 3e-2), "float16": (4e-3, 4e-3)},
    ("cpu", "grad"): {"float32": (1e-4, 1e-4), "bfloat16": (6e-2, 6e-2), "float16": (1e-2, 1e-2)},
    # fp32 tile products as TF32x3 on tensor cores (docs/pallas.md); 16-bit inputs as on the CPU
    ("gpu", "out"): {"float32": (5e-3, 5e-3), "bfloat16": (4e-2, 4e-2), "float16": (5e-3, 5e-3)},
    ("gpu", "grad"): {"float32": (1e-2, 1e-2), "bfloat16": (8e-2, 8e-2), "float16": (1e-2, 1e-2)},
}


def tolerance(dtype, what: str = "out", *, backend: str = "cpu") -> dict[str, float]:
    """``dict(atol=, rtol=)`` for comparing ``what`` (``"out"`` or ``"grad"``) of an implementation run
    on ``dtype`` inputs against the fp32 reference, on ``backend`` (``"cpu"``, ``"gpu"``; ``"tpu"`` reads
    the GPU row).

    Raises:
        ValueError: an unknown ``what``, ``backend`` or dtype.
    """
    backend = {"cuda": "gpu", "rocm": "gpu", "tpu": "gpu"}.get(backend, backend)
    table = TOLERANCES.get((backend, what))
    if table is None:
        raise ValueError(
            f"tolerance: what must be 'out' or 'grad' and backend 'cpu' or 'gpu', got {what!r}, {backend!r}"
        )
    name = jnp.dtype(dtype).name
    if name not in table:
        raise ValueError(f"tolerance: dtype must be one of {sorted(table)}, got {name}")
    atol, rtol = table[name]
    return {"atol": atol, "rtol": rtol}


def assert_close(actual, expected, dtype, what: str = "out", *, backend: str = "cpu", err_msg: str = "") -> None:
    """``numpy.testing.assert_allclose`` in fp32 with ``tolerance(dtype, what, backend=backend)``."""
    np.testing.assert_allclose(
        np.asarray(jnp.asarray(actual, jnp.float32)),
        np.asarray(jnp.asarray(expected, jnp.float32)),
        err_msg=err_msg,
        **tolerance(dtype, what, backend=backend),
    )
