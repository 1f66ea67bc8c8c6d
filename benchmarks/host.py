"""What every benchmark records about its host, and its one timing rule (best of N after a warm-up)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import jax

__all__ = ["best_of", "cpu_info", "host_devices"]


def cpu_info() -> dict:
    """The host CPU's model name and the SIMD flags that move CPU ratios (AVX2, AVX-512)."""
    model, flags_ = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags_:
                flags_ = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = sorted(f for f in flags_ if f.startswith(("avx", "fma", "amx")))
    return {"cpu_model": model, "cpu_simd_flags": simd, "host_cpus": os.cpu_count(), "platform": platform.platform()}


def host_devices(requested: int, cpus: int, heads: int) -> int:
    """How many CPU host devices a benchmark splits the heads over (1 = none; its ``--host_devices``).

    ``requested < 0``: the largest divisor of ``heads`` not above ``cpus``; otherwise ``requested``,
    which must divide ``heads`` (more devices than cores is allowed). XLA:CPU runs a small tile
    matmul on one core, so one host device per core is how a JAX program uses the other cores.
    """
    from absl import app  # noqa: PLC0415 (benchmarks only)

    if requested < 0:
        return max(d for d in range(1, max(1, min(cpus, heads)) + 1) if heads % d == 0)
    if requested > 1 and heads % requested:
        raise app.UsageError(f"--host_devices={requested} must divide --heads={heads}")
    return max(requested, 1)


def best_of(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)
