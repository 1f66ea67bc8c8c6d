"""Tuned kernel configurations: ``autotune`` searches on the device it runs on, a JSON table keeps the result.

A tiled kernel's speed depends on its tunable parameters (tile sizes, and on a GPU warps and pipelining
stages) and the best choice depends on the device, the dtype, the head dims, the mask and whether the
backward runs too. ``autotune(q, k, v, mask=..., implementation="pallas")`` times every candidate
configuration of an implementation on the device this process runs on and records the fastest under a
``Key`` (implementation, device kind, dtype, head dims, mask family, direction, length bucket) in a JSON
table. ``lookup`` is what the implementations call when they run: it reads the user's table
(``cache_path()``: ``$ATTNLAB_TUNING_CACHE``, else ``~/.cache/attnlab/tuning.json``) and then the table
committed with attnlab (``attnlab/tuning_table.json``: the devices we measured), and returns the
configuration of the closest entry, or None, in which case the kernel uses its defaults. So a user's GPU
tunes itself where we never had one, and one line in a training script pays for itself::

    >>> import jax, jax.numpy as jnp, attnlab
    >>> x = jnp.ones((1, 256, 2, 16))
    >>> result = attnlab.autotune(x, x, x, mask=attnlab.masks.causal(), implementation="blockwise",
    ...                           repeats=1, save=False, verbose=False)
    >>> result.best is not None
    True

The search spaces and configurations are each implementation's own (``Implementation.tunable``:
``BlockSizes`` for blockwise, ``PallasConfig`` for Pallas); the table stores them as plain JSON.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from attnlab import platform

__all__ = [
    "Key", "TuneResult", "autotune", "lookup", "cache_path", "device_kind", "mask_family", "key_of", "load",
    "load_timed", "store", "output_cotangent",
]  # fmt: skip

DIRECTIONS = ("fwd", "fwd_bwd")
_DEFAULT_TABLE = Path(__file__).with_name("tuning_table.json")


def cache_path() -> Path:
    """The user's tuning table: ``$ATTNLAB_TUNING_CACHE``, else ``~/.cache/attnlab/tuning.json``."""
    env = os.environ.get("ATTNLAB_TUNING_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "attnlab" / "tuning.json"


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name and its widest vector extension (AVX-512 and AVX2 hosts tune differently)."""
    model, flags = platform.host_cpu()
    if not model:
        import platform as host  # noqa: PLC0415

        model = host.processor() or host.machine()
    simd = next((f for f in ("avx512f", "avx2", "neon", "asimd") if f in flags), None)
    return f"{model} [{simd}]" if simd else model


def device_kind(backend: str | None = None) -> str:
    """The device a tuning applies to: the accelerator's kind (``"NVIDIA H200"``), or ``"cpu: <model>"``
    (CPUs differ more than their backend name says: AVX2 or AVX-512, cache sizes)."""
    backend = platform.normalize(backend)
    if backend == "cpu":
        return f"cpu: {_cpu_model()}"
    try:
        return jax.devices(backend)[0].device_kind
    except RuntimeError:  # planning for a backend this process lacks (attnlab.lowering_for)
        return f"{backend}: unknown"


def mask_family(mask) -> str:
    """A mask's family for tuning: its ``&`` factors' kinds, sorted (``"causal&padding"``), ``"full"`` for none."""
    if mask is None or mask.is_full:
        return "full"
    return "&".join(sorted(type(f).__name__.lower() for f in mask.conjuncts())) or "full"


@dataclasses.dataclass(frozen=True)
class Key:
    """What a tuned configuration applies to."""

    implementation: str
    device: str
    dtype: str
    head_dims: tuple  # (H, Hv)
    mask: str  # mask_family
    direction: str  # "fwd" or "fwd_bwd"
    length: int  # the power of two at or above max(T, S)

    def as_json(self) -> dict:
        return dataclasses.asdict(self) | {"head_dims": list(self.head_dims)}

    @classmethod
    def from_json(cls, d: dict) -> Key:
        return cls(**{**d, "head_dims": tuple(d["head_dims"])})


def key_of(implementation: str, call, backend: str | None = None, direction: str = "fwd_bwd") -> Key:
    """The key of a bound call (``attnlab.call.bind``) for ``implementation`` on ``backend``."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    return Key(
        implementation=implementation,
        device=device_kind(backend),
        dtype=call.dtype.name,
        head_dims=(call.H, call.Hv),
        mask=mask_family(call.mask),
        direction=direction,
        length=1 << max(0, max(call.T, call.S) - 1).bit_length(),
    )


@functools.cache
def _read(path: str, mtime: float) -> tuple:
    """The entries of a table file: ``((Key, config dict, ms or None), ...)`` (cached per file version)."""
    try:
        rows = json.loads(Path(path).read_text())["entries"]
    except (OSError, ValueError, KeyError):
        return ()
    return tuple((Key.from_json(r["key"]), r["config"], r.get("ms")) for r in rows)


def load_timed(path: Path | str | None = None) -> tuple:
    """The entries of a table (default: the user's, then the committed one), as ``(Key, config dict, ms)``."""
    paths = [Path(path)] if path is not None else [cache_path(), _DEFAULT_TABLE]
    out = []
    for p in paths:
        if p.exists():
            out.extend(_read(str(p), p.stat().st_mtime))
    return tuple(out)


def load(path: Path | str | None = None) -> tuple:
    """The entries of a table as ``(Key, config dict)`` pairs (``load_timed`` without the times)."""
    return tuple((key, config) for key, config, _ in load_timed(path))


def lookup(implementation: str, call, backend: str | None = None, direction: str | None = None):
    """The tuned configuration for a bound call, or None (the kernel then uses its defaults).

    ``direction`` None prefers an entry tuned for ``"fwd_bwd"`` (training), then ``"fwd"``. Among the
    entries of the same implementation, device, dtype, head dims and mask family, the one whose length
    bucket is nearest (in log2) wins; the user's table before the committed one.
    """
    from attnlab.dispatch import IMPLEMENTATIONS  # noqa: PLC0415 (dispatch imports the impls, which import this)

    tunable = getattr(IMPLEMENTATIONS.get(implementation), "tunable", None)
    if tunable is None:
        return None
    want = key_of(implementation, call, backend)
    for d in (direction,) if direction else ("fwd_bwd", "fwd"):
        best = None
        for key, config in load():
            same = dataclasses.replace(key, length=want.length, direction=d) == dataclasses.replace(want, direction=d)
            if same and key.direction == d:
                gap = abs(math.log2(key.length) - math.log2(want.length))
                if best is None or gap < best[0]:
                    best = (gap, config)
        if best is not None:
            return tunable.from_json(best[1])
    return None


@dataclasses.dataclass
class TuneResult:
    """What ``autotune`` measured: every candidate's time (or error), the best, and its key."""

    key: Key
    best: object
    best_ms: float
    rows: list  # dicts: config, ms (or None), compile_s, error

    def table(self) -> str:
        lines = [f"{self.key}", "config | ms | compile s | error", "---|---|---|---"]
        for r in sorted(self.rows, key=lambda r: math.inf if r["ms"] is None else r["ms"]):
            ms = "" if r["ms"] is None else f"{r['ms']:.3f}"
            lines.append(f"{r['config']} | {ms} | {r['compile_s']:.2f} | {r['error'] or ''}")
        return "\n".join(lines)


def _compile(fn, args) -> tuple:
    """(the compiled program, seconds to lower and compile it)."""
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _best_ms(fn, args, repeats: int) -> float:
    """Best of ``repeats`` calls after one untimed call, in ms."""
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def autotune(
    q, k, v, *, mask=None, score="dot", scale=None, implementation="pallas", direction="fwd_bwd",
    candidates=None, repeats: int = 5, budget_s: float | None = None, save: bool | str | Path = True,
    verbose: bool = True, compile_workers: int = 1,
) -> TuneResult:  # fmt: skip
    """Times every candidate configuration of ``implementation`` on this call and keeps the fastest.

    Args:
        q, k, v, mask, score, scale: the call to tune for, as in ``attnlab.attention`` (real arrays:
            they are run). Its dtype, head dims, mask family and length bucket form the key.
        implementation: a registered implementation with a ``tunable`` (``"blockwise"``, ``"pallas"``).
        direction: ``"fwd"`` times the forward, ``"fwd_bwd"`` the forward and the gradients of q, k, v.
        candidates: configurations to try (default: the implementation's search space for this call
            and backend).
        repeats: timed calls per candidate after a first (compiling) one; the best counts.
        budget_s: stop trying new candidates after this many seconds (the best so far is kept).
        save: True writes the best into the user's table (``cache_path()``), a path into that file,
            False nowhere.
        verbose: print each candidate's time as it finishes.
        compile_workers: threads compiling candidates ahead of the one being timed (XLA and Triton
            compile on the host's CPUs while the device times; 1: one after the other). Candidates not
            yet compiling when the budget runs out are dropped.

    Returns:
        a ``TuneResult``; ``best`` is None when every candidate failed.

    Raises:
        ValueError: an unknown implementation or direction, one without a ``tunable``, or one that does
            not support the call.
    """
    from attnlab.call import bind  # noqa: PLC0415
    from attnlab.dispatch import IMPLEMENTATIONS  # noqa: PLC0415

    impl = IMPLEMENTATIONS.get(implementation)
    tunable = getattr(impl, "tunable", None)
    if tunable is None:
        tunables = sorted(n for n, i in IMPLEMENTATIONS.items() if getattr(i, "tunable", None) is not None)
        raise ValueError(f"autotune: implementation must be one of {tunables}, got {implementation!r}")
    backend = platform.target()
    call = bind(q, k, v, mask=mask, score=score, scale=scale, fn="autotune")
    if (why := impl.supports(call, backend)) is not None:
        raise ValueError(f"autotune: implementation={implementation!r} {why}")
    key = key_of(implementation, call, backend, direction)
    configs = list(tunable.space(call, backend) if candidates is None else candidates)
    rows, t_start = [], time.perf_counter()
    args = _args(call, direction)
    workers = max(1, compile_workers)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        ahead = None  # with workers > 1: every candidate's compile, queued at once
        if workers > 1:
            ahead = [pool.submit(_compile, _program(tunable, call, c, direction), args) for c in configs]
        for i, config in enumerate(configs):
            if budget_s is not None and time.perf_counter() - t_start > budget_s:
                for f in ahead or ():
                    f.cancel()
                break
            row = {"config": tunable.to_json(config), "ms": None, "compile_s": 0.0, "error": None}
            try:
                compiled, row["compile_s"] = (
                    ahead[i].result() if ahead else _compile(_program(tunable, call, config, direction), args)
                )
                row["ms"] = _best_ms(compiled, args, repeats)
            except Exception as e:  # noqa: BLE001 (a candidate the device rejects: out of shared memory, ...)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            if verbose:
                ms = f"{row['ms']:.3f} ms" if row["ms"] is not None else row["error"]
                print(f"autotune {implementation} {row['config']}: {ms}", flush=True)
    ok = [r for r in rows if r["ms"] is not None]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    result = TuneResult(key, None if best is None else tunable.from_json(best["config"]), best and best["ms"], rows)
    if best is not None and save:
        store(key, best["config"], cache_path() if save is True else Path(save), ms=best["ms"])
    return result


def _program(tunable, call, config, direction):
    """A jitted function running the call with ``config``: the forward of (q, k, v), or the gradients of q, k
    and v for an output cotangent passed last (``_args``), as training computes them."""

    def fwd(q, k, v):
        return tunable.run(dataclasses.replace(call, q=q, k=k, v=v), config)

    if direction == "fwd":
        return jax.jit(fwd)

    def fwd_bwd(q, k, v, ct):
        _, vjp = jax.vjp(fwd, q, k, v)
        return vjp(ct)

    return jax.jit(fwd_bwd)


def output_cotangent(shape: tuple, dtype) -> jax.Array:
    """The output cotangent a forward+backward is timed with (here and in every benchmark, through
    ``benchmarks.harness.cotangent``): normal, fixed. Not ones: the gradient of ``sum(out)`` lets XLA simplify
    the backward it compiles, so a choice timed on it can be wrong for training."""
    return jax.random.normal(jax.random.key(7), shape, jnp.float32).astype(dtype)


def _args(call, direction) -> tuple:
    """The arguments of ``_program``: (q, k, v), and for ``"fwd_bwd"`` the ``output_cotangent`` of the
    output's shape ``[..., T, N, Hv]`` and dtype."""
    qkv = (call.q, call.k, call.v)
    if direction == "fwd":
        return qkv
    return (*qkv, output_cotangent((*call.q.shape[:-1], call.Hv), call.q.dtype))


def store(key: Key, config: dict, path: Path | str, *, ms: float | None = None, source: str | None = None) -> None:
    """Writes ``config`` under ``key`` into the table at ``path`` (replacing an entry with the same key)."""
    path = Path(path)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {"entries": []}
    entries = [e for e in table.get("entries", []) if Key.from_json(e["key"]) != key]
    entry = {"key": key.as_json(), "config": config, "ms": None if ms is None else round(float(ms), 4)}
    if source:
        entry["source"] = source
    entries.append(entry)
    entries.sort(key=lambda e: json.dumps(e["key"], sort_keys=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({**table, "entries": entries}, indent=1) + "\n")
    os.replace(tmp, path)


def entries_from_gpu_check(result: dict) -> list[tuple[Key, dict, float]]:
    """The fastest Pallas tile shape per (mask, head dim, direction) of a ``benchmarks/gpu_check.py`` result's
    ``blocks`` section, as table entries ``(key, config, ms)`` (warps and stages as that run used them: the
    kernel's defaults then, 4 warps up to head dim 64 and 8 above, 2 stages)."""
    meta, best = result["meta"], {}
    for r in result.get("blocks", []):
        if r.get("implementation") != "pallas" or r.get("status") != "ok":
            continue
        direction = "fwd" if r["direction"] == "fwd" else "fwd_bwd"
        key = Key("pallas", meta["device_kind"], r["dtype"], (r["H"], r["H"]), r["mask"], direction, int(r["T"]))
        config = {
            "block_q": r["block_q"],
            "block_k": r["block_k"],
            "num_warps": 4 if r["H"] <= 64 else 8,
            "num_stages": 2,
        }
        if key not in best or r["ms"] < best[key][1]:
            best[key] = (config, r["ms"])
    return [(k, c, ms) for k, (c, ms) in best.items()]
