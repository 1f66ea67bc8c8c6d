"""Compiled memory and step timing: what a compiled XLA program holds, and how long a compiled step takes.

``compiled_memory`` is the one formula for a program's peak bytes from XLA's buffer assignment;
``memory_record`` prefers the device's own peak where it belongs to the run; ``time_steps`` and
``measure_train_step`` time the trainer's own compiled step. ``experiments.common`` re-exports them
(``common.measure_train_step`` ...), where the experiments find them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import train as train_lib

__all__ = ["compiled_memory", "memory_stats", "memory_record", "time_steps", "measure_train_step"]


def compiled_memory(compiled) -> dict:
    """Peak bytes of a compiled XLA program from its buffer assignment (not a measured RSS):
    temporaries + arguments + outputs - aliased (donated arguments reused as outputs)."""
    ma = compiled.memory_analysis()
    peak = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    return {"peak_bytes": int(peak), "temp_bytes": int(ma.temp_size_in_bytes), "memory_source": "xla_memory_analysis"}


def memory_stats() -> dict | None:
    """The first device's ``memory_stats()`` (``bytes_in_use``, ``peak_bytes_in_use``, ...), None
    where the backend keeps none (XLA:CPU)."""
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (backends without stats)
        return None


def memory_record(compiled, before: dict | None = None, after: dict | None = None, *, isolated: bool = False) -> dict:
    """A run's memory: the device's own peak where it is the run's, XLA's analysis otherwise.

    Args:
        compiled: the compiled program (``compiled_memory``: arguments + outputs + temporaries).
        before, after: ``memory_stats()`` before building the run and after it (None where the
            backend keeps none, as XLA:CPU).
        isolated: the process ran only this (a subprocess per cell), so its peak is the run's.

    ``memory_bytes`` is the device peak when it can be attributed to this run (isolated, or the
    process-wide peak rose during it: then the peak minus what was in use before it), else the
    compiled analysis; ``memory_source`` says which.
    """
    rec = {}
    try:
        cm = compiled_memory(compiled)
        rec.update(
            memory_bytes=cm["peak_bytes"],
            compiled_memory_bytes=cm["peak_bytes"],
            temp_bytes=cm["temp_bytes"],
            memory_source=cm["memory_source"],
        )
    except Exception:  # noqa: BLE001  (some backends give no analysis)
        rec.update(memory_bytes=None, memory_source="unavailable")
    after = after or {}
    if "peak_bytes_in_use" not in after:
        return rec
    peak, prev_peak = int(after["peak_bytes_in_use"]), int((before or {}).get("peak_bytes_in_use", 0))
    if isolated:
        rec.update(device_peak_bytes=peak, memory_bytes=peak, memory_source="device_peak (cell in its own process)")
    elif peak > prev_peak:
        cell_peak = peak - int((before or {}).get("bytes_in_use", 0))
        rec.update(
            device_peak_bytes=cell_peak,
            memory_bytes=cell_peak,
            memory_source="device_peak (reached during this cell, above the bytes in use before it)",
        )
    else:  # an earlier cell peaked higher: this cell's own peak is not visible in process-wide stats
        rec["memory_source"] += " (device peak not attributable: --fresh_process_per_cell gives every cell its own)"
    return rec


def time_steps(step: Callable, state: tuple, *, repeats: int, max_step_s: float | None = None) -> tuple[dict, Any]:
    """Times ``state = step(*state)`` (a compiled step whose last output is a scalar): one warm-up
    call, then the median of ``repeats`` calls. A warm-up slower than ``max_step_s`` is kept as the
    only time. Returns ``({"step_s", "steps_per_s", "timed_steps"}, last outputs)``."""
    times = []
    for i in range(1 + repeats):
        t0 = time.perf_counter()
        state = step(*state)
        jax.block_until_ready(state[-1])
        if i:
            times.append(time.perf_counter() - t0)
        elif max_step_s is not None and time.perf_counter() - t0 > max_step_s:
            times.append(time.perf_counter() - t0)  # too slow to repeat: keep the warm-up time
            break
    step_s = float(np.median(times))
    return {"step_s": step_s, "steps_per_s": 1.0 / step_s, "timed_steps": len(times)}, state


def measure_train_step(model, tx, loss_fn, batch, *, repeats: int, max_step_s: float | None = None) -> dict:
    """Compiles the trainer's step (``attnlab.train.make_step``) for one batch, then times it.

    Returns compile seconds, the timing of ``time_steps``, the compiled memory of
    ``compiled_memory`` and whether the last loss is finite.
    """
    from flax import nnx

    graphdef, params_state, rest = nnx.split(model, nnx.Param, ...)
    leaves, params_def = jax.tree.flatten(params_state)
    leaves = [jnp.array(x, copy=True) for x in leaves]  # donated by the step
    opt_state = tx.init(leaves)
    step = train_lib.make_step(graphdef, params_def, rest, tx, loss_fn)
    key = jax.random.key(0)
    t0 = time.perf_counter()
    compiled = step.func.lower(*step.args, leaves, opt_state, batch, key).compile()
    compile_s = time.perf_counter() - t0

    def one(params, opt_state, _loss):
        params, opt_state, loss, _ = compiled(rest, params, opt_state, batch, key)
        return params, opt_state, loss

    timing, (_, _, loss) = time_steps(one, (leaves, opt_state, None), repeats=repeats, max_step_s=max_step_s)
    return {
        **timing,
        "compile_s": compile_s,
        **compiled_memory(compiled),
        "finite": bool(np.isfinite(float(loss))),
    }
