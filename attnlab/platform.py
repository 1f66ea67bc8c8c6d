"""The backend a trace is for: kernels plan for it alone, dispatch chooses for it.

A kernel's plan (its tiles, its compute dtype, Triton or the Pallas interpreter) depends on the
platform the program will run on. That is ``jax.default_backend()`` unless the program is lowered
for another one, which JAX does not tell a function while it is traced (``jax.export(...,
platforms=["cuda"])`` from a CPU host traces first and lowers after). So attnlab plans for
``target()``: the backend set by the innermost ``lowering_for(...)`` block, else the default backend::

    >>> import jax, attnlab
    >>> x = jax.ShapeDtypeStruct((1, 256, 4, 64), "bfloat16")
    >>> with attnlab.lowering_for("gpu"):                    # plan and dispatch as on a GPU
    ...     exported = jax.export.export(jax.jit(attnlab.attention), platforms=["cuda"])(x, x, x)  # doctest: +SKIP

Each trace then plans one program, for one backend (not one per platform joined by
``lax.platform_dependent``). ``attnlab.explain(..., backend=)`` takes the backend explicitly.

The target is a JAX configuration state that is part of jit's cache key (as ``jax_enable_x64`` is), so
a function traced inside ``lowering_for("gpu")`` is traced again outside it, never reused for the
CPU. (Where this jax has no such state to define, a context variable holds it, and a function jitted
once per target should be wrapped in a fresh ``jax.jit`` for each.)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from pathlib import Path

import jax

__all__ = ["target", "lowering_for", "normalize", "host_cpu"]


def _define_state():
    """A jax config state in the jit cache key and trace context, or None where this jax has no such API."""
    try:
        from jax._src import config as jax_config  # noqa: PLC0415 (a private API: guarded)

        return jax_config.optional_enum_state(
            name="attnlab_target_backend",
            enum_values=["cpu", "gpu", "tpu"],
            default=None,
            help="The backend attnlab plans kernels and dispatches for (attnlab.lowering_for); None: the default.",
            include_in_jit_key=True,
            include_in_trace_context=True,
        )
    except Exception:  # noqa: BLE001 (any change of the private API: fall back to a context variable)
        return None


_STATE = _define_state()
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("attnlab_target_backend", default=None)


def normalize(backend: str | None) -> str:
    """None -> ``target()``; ``"cuda"``/``"rocm"`` -> ``"gpu"``; ``"cpu"``, ``"gpu"``, ``"tpu"`` as they are.

    Raises:
        ValueError: any other name.
    """
    if backend is None:
        return target()
    name = {"cuda": "gpu", "rocm": "gpu"}.get(str(backend).lower(), str(backend).lower())
    if name not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"backend must be 'cpu', 'gpu' (or 'cuda', 'rocm'), 'tpu' or None, got {backend!r}")
    return name


def target() -> str:
    """The backend attnlab plans and dispatches for: the innermost ``lowering_for`` block's, else
    ``jax.default_backend()`` (as ``"cpu"``, ``"gpu"`` or ``"tpu"``)."""
    name = _STATE.value if _STATE is not None else _TARGET.get()
    return name if name is not None else normalize(jax.default_backend())


@contextlib.contextmanager
def lowering_for(backend: str):
    """Within the block, attnlab plans kernels and chooses implementations for ``backend`` (``"cpu"``,
    ``"gpu"``/``"cuda"``/``"rocm"``, ``"tpu"``): for ``jax.export`` to a platform this process lacks.

    Raises:
        ValueError: an unknown backend.
    """
    name = normalize(backend)
    if _STATE is not None:
        with _STATE(name):
            yield
        return
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)


@functools.cache
def host_cpu() -> tuple[str, frozenset[str]]:
    """This host's CPU model name and its feature flags, from ``/proc/cpuinfo`` (``("", frozenset())`` where
    there is none). What tuning keys and benchmark records say about the CPU."""
    model, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags
