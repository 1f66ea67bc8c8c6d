"""The one benchmark harness: timing, the run record, result files, tolerances, FLOPs, tables.

Every program under ``benchmarks/`` builds on these pieces instead of its own copy:

* **timing**: ``op_profile`` (one call's time per compiled op, from a ``jax.profiler`` trace),
  ``time_call`` (warm-up calls apart, then the best and the median of n; the first
  call, compile included, is recorded separately), ``interleaved`` (several contenders timed in
  alternating rounds, so machine load hits all alike), ``blocking`` (a JAX call that waits for
  its result: ``jax.block_until_ready``), ``compile_all`` (ahead-of-time compiles in a thread
  pool: XLA compiles with the GIL released, so a 16-core GPU host compiles many cells at once);
* **forward+backward, one convention**: ``with_direction`` (the gradients of q, k and v for the
  fixed normal output ``cotangent``; not ``sum(out)``'s ones, which XLA simplifies, nor a sum of
  squares, another program: CHANGELOG.md, 2026-12-06); every benchmark takes it but
  ``compare_commits``' worker, which runs against another tree's attnlab and keeps the same convention
  self-contained (``vdot(out, ct)``);
* **the run record**: ``Run`` / ``run_record``: host name, CPU model and SIMD flags (AVX2,
  AVX-512, AMX), load average, jax / jaxlib / torch versions, backend and device kind, date,
  command; every result file carries it;
* **result files**: ``write_json`` (atomic), ``Recorder`` (rows of one section, each printed as it
  finishes and the file rewritten after each, within a time budget);
* **tolerances**: ``compare`` reads ``attnlab.testing`` (the one table) for the backend that ran;
* **FLOPs**: ``useful_flops`` (one convention for every benchmark) and ``allowed_pairs``;
* **tables**: ``markdown_table`` (the experiments' one writer) and ``rows_table``;
* **the device lock**: ``DeviceLock``, shared while processes compile side by side, exclusive while
  one runs work on the device and times it, so a timing never shares the machine.

Example:
    >>> t = time_call(lambda: sum(range(1000)), repeats=3)
    >>> t.runs, t.best_s <= t.median_s
    (3, True)
    >>> useful_flops(pairs=16, N=2, H=8, direction="fwd")   # 4 N H per allowed pair
    1024.0
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import gzip
import importlib.metadata
import json
import math
import os
import platform
import re
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import platform as attnlab_platform  # host_cpu: the CPU model and flags, as tuning reads them
from attnlab import testing, tuning

__all__ = [
    "Timing",
    "time_call",
    "interleaved",
    "alternate_best",
    "progress",
    "best_of",
    "call_costs",
    "blocking",
    "compile_all",
    "DIRECTIONS",
    "cotangent",
    "with_direction",
    "directed",
    "fwd_bwd",
    "cpu_info",
    "host_devices",
    "versions",
    "run_record",
    "Run",
    "write_json",
    "Recorder",
    "sweep",
    "compare",
    "max_abs_diff",
    "useful_flops",
    "allowed_pairs",
    "markdown_table",
    "rows_table",
    "DeviceLock",
]

# ------------------------------------------------------------------------------------------
# Forward+backward: one convention for every benchmark

DIRECTIONS = ("fwd", "fwd+bwd")


@functools.lru_cache(maxsize=8)
def cotangent(shape: tuple, dtype=jnp.bfloat16) -> jax.Array:
    """The output cotangent of every forward+backward cell, as ``attnlab.autotune`` times its candidates
    (``attnlab.tuning.output_cotangent``: normal, fixed; made once per shape here). Not ones: the gradient of
    ``sum(out)`` lets XLA simplify a backward it compiles (CHANGELOG.md, 2026-12-06)."""
    return tuning.output_cotangent(shape, dtype)


def with_direction(fwd: Callable, direction: str, args: tuple) -> tuple[Callable, tuple]:
    """``(fn, args)``: ``fwd(q, k, v, *rest)`` itself (``"fwd"``), or (``"fwd+bwd"``) the gradients of q, k
    and v for the output cotangent ``cotangent(q.shape, q.dtype)`` (the output's shape: Hv = H), passed
    as one more argument after ``rest``.

    Example:
        >>> fn, a = with_direction(lambda q, k, v: q * k * v, "fwd+bwd", (jnp.ones(2),) * 3)
        >>> bool(jnp.array_equal(fn(*a)[0], a[-1])), len(a)
        (True, 4)
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if direction == "fwd":
        return fwd, args
    return fwd_bwd(fwd), (*args, cotangent(args[0].shape, args[0].dtype))


def directed(fwds: Mapping[Any, Callable], direction: str, args: tuple) -> tuple[dict, tuple]:
    """``with_direction`` for several contenders on the same arguments: ``({name: jit(fn)}, args)``."""
    jitted = {name: jax.jit(with_direction(f, direction, args)[0]) for name, f in fwds.items()}
    return jitted, with_direction(lambda *a: None, direction, args)[1]  # the arguments alone: the same for each


def fwd_bwd(fwd: Callable) -> Callable:
    """``fwd(q, k, v, *rest)`` -> ``fn(q, k, v, *rest, ct)``: the gradients of q, k and v for the output
    cotangent ``ct`` (``with_direction``'s forward+backward, for a caller that passes ``ct`` itself)."""

    def fn(q, k, v, *rest_ct):
        *rest, ct = rest_ct
        out, pull = jax.vjp(lambda q, k, v: fwd(q, k, v, *rest), q, k, v)
        return pull(ct.astype(out.dtype))

    return fn


# ------------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one contender: its first call (trace + compile + run for a fresh ``jax.jit``) and
    each timed call after the warm-up."""

    first_s: float
    times: tuple[float, ...]

    @property
    def best_s(self) -> float:
        return min(self.times)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)

    @property
    def runs(self) -> int:
        return len(self.times)

    def record(self, digits: int = 3) -> dict:
        """``ms`` (best), ``median_ms``, ``runs`` and ``first_call_s``, as a result row carries them."""
        return dict(
            ms=round(1e3 * self.best_s, digits),
            median_ms=round(1e3 * self.median_s, digits),
            runs=self.runs,
            first_call_s=round(self.first_s, 3),
        )


def time_call(run: Callable[[], Any], *, repeats: int, warmup: int = 1, max_s: float | None = None) -> Timing:
    """Times ``run()`` (which must block until its work is done: ``blocking`` for JAX).

    Args:
        run: the call; its first call is timed apart (``first_s``: a fresh ``jax.jit`` compiles there).
        repeats: timed calls after the warm-up; the best and the median are what a row reports.
        warmup: untimed calls before them (at least the first call).
        max_s: a budget for the timed calls: fewer repeats (at least one) when one call would
            take it past this (the first call's time is the guess).

    Returns:
        a ``Timing``.
    """
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        run()
    n = max(1, repeats)
    if max_s is not None and first > 0:
        n = max(1, min(n, int(max_s / first)))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return Timing(first, tuple(times))


def interleaved(
    runs: Mapping[Any, Callable[[], Any]],
    *,
    rounds: int,
    repeats: int = 1,
    settle: bool = False,
    rotate: bool = False,
    progress=None,
) -> dict:
    """Times several contenders in alternating rounds: ``{name: Timing}``.

    Each contender's first call is timed apart; then each round times ``repeats`` calls of each in
    turn. ``settle``: one untimed call before each contender's calls in a round (torch's OpenMP pool
    and XLA:CPU's Eigen pool spin for a while after their work, so the first call after the other
    framework finds its cores busy: measured at N = 1K, +25% for attnlab after torch).
    ``rotate``: round r starts with contender r (mod their number), so no contender always follows
    the same one. ``progress``: called with a line before each contender's turn (e.g. ``print``).
    """
    first = {}
    for name, run in runs.items():
        if progress:
            progress(f"first call: {name}")
        t0 = time.perf_counter()
        run()
        first[name] = time.perf_counter() - t0
    times = {name: [] for name in runs}
    order = list(runs.items())
    for r in range(rounds):
        shift = r % len(order) if rotate and order else 0
        for name, run in order[shift:] + order[:shift]:
            if progress:
                progress(f"round {r + 1}/{rounds}: {name}")
            if settle:
                run()
            for _ in range(repeats):
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    return {name: Timing(first[name], tuple(ts)) for name, ts in times.items()}


def alternate_best(fns: Mapping[Any, Callable], args: Sequence, *, rounds: int, repeats: int) -> dict:
    """{name: best seconds} of ``fn(*args)`` for every fn in ``fns``, over alternating rounds (``interleaved``).

    A call under ~0.1 s is repeated more (up to 200 times, ~0.3 s per round; the same count for every
    contender) over at least two rounds per contender, each round starting with the next one: a tiny
    call's best of 3 is mostly the machine's noise, and its place in the round a bias."""
    runs = {name: blocking(fn, *args) for name, fn in fns.items()}
    timings = interleaved(runs, rounds=1, repeats=1)  # first calls apart, then one timed call each
    fastest = min(t.best_s for t in timings.values())
    n = max(repeats, min(200, math.ceil(0.3 / max(fastest, 1e-6))))
    if n > repeats:  # a sub-0.1 s call: more rounds, each starting with another contender (no order bias)
        rounds = max(rounds, 2 * len(runs))
    timings = interleaved(runs, rounds=rounds, repeats=n, rotate=True)
    return {name: t.best_s for name, t in timings.items()}


def progress(line: str) -> None:
    """Prints a progress line at once (``interleaved``'s ``progress``)."""
    print(line, flush=True)


def blocking(fn: Callable, *args) -> Callable[[], Any]:
    """``fn(*args)`` as a call that returns once the device is done (``jax.block_until_ready``)."""
    return lambda: jax.block_until_ready(fn(*args))


def best_of(fn: Callable, args: Sequence, repeats: int) -> float:
    """Seconds of the best of ``repeats`` calls of ``fn(*args)`` after one warm-up call."""
    return time_call(blocking(fn, *args), repeats=repeats).best_s


def op_profile(fn: Callable, *args, warmup: int = 1) -> dict:
    """Where one call of the jitted ``fn(*args)`` spends its time, op by op: ``{"wall_ms", "ops": [{"op",
    "ms", "calls"}, ...]}``, ops by total time, from a ``jax.profiler`` trace of one call after ``warmup``
    untimed ones.

    An op is an instruction of the compiled HLO (``fn.lower(*args).compile().as_text()``) that the runtime
    ran as one unit (on XLA:CPU a thunk: a fusion, a library matmul, a copy); the ops of a loop body count
    once per iteration. Loops and calls themselves (``while``, ``conditional``, ``call``: their time is
    their body's) and the runtime's and Python's events are left out. Tracing adds time per op, so
    compare ops with each other, not ``ms`` with an untraced timing.
    """
    hlo = fn.lower(*args).compile().as_text()
    ops = {m.group(1) for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\(", hlo, re.M)
           if m.group(2) not in ("while", "conditional", "call", "parameter", "constant", "tuple",
                                 "get-tuple-element")}  # fmt: skip
    run = blocking(fn, *args)
    for _ in range(warmup):
        run()
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            run()
        wall = time.perf_counter() - t0
        (trace,) = Path(folder).rglob("*.trace.json.gz")
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    total, calls = {}, {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and name in ops and "dur" in e:
            total[name] = total.get(name, 0.0) + e["dur"] / 1e3
            calls[name] = calls.get(name, 0) + 1
    rows = [{"op": n, "ms": round(ms, 2), "calls": calls[n]} for n, ms in sorted(total.items(), key=lambda x: -x[1])]
    return {"wall_ms": round(wall * 1e3, 1), "ops": rows}


def call_costs(fn: Callable, *args, repeats: int = 3) -> dict:
    """What one call of the jitted ``fn(*args)`` costs the host beyond its wall time, per call over
    ``repeats`` calls after a warm-up: ``wall_ms``, the process's ``user_ms`` and ``sys_ms`` of CPU time (all
    threads: above ``wall_ms`` where the call ran on several cores), ``minor_faults`` and their ``fault_mib``
    (4 KiB pages first touched: on Linux a buffer freshly mapped by the allocator, e.g. XLA's temporaries
    of a call, faults each page once), and the compiled program's ``temp_mib``, ``output_mib`` and
    ``argument_mib`` (XLA's memory analysis)."""
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    run = blocking(compiled, *args)
    run()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(repeats):
        run()
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    faults = (r1.ru_minflt - r0.ru_minflt) / repeats
    mib = 1 / 2**20
    return {
        "wall_ms": round(1e3 * wall / repeats, 1),
        "user_ms": round(1e3 * (r1.ru_utime - r0.ru_utime) / repeats, 1),
        "sys_ms": round(1e3 * (r1.ru_stime - r0.ru_stime) / repeats, 1),
        "minor_faults": round(faults),
        "fault_mib": round(faults * resource.getpagesize() * mib, 1),
        "temp_mib": round(mem.temp_size_in_bytes * mib, 1),
        "output_mib": round(mem.output_size_in_bytes * mib, 1),
        "argument_mib": round(mem.argument_size_in_bytes * mib, 1),
    }


def compile_all(jobs: Sequence[tuple[Callable, Sequence]], workers: int) -> list[tuple[Any, float]]:
    """Compiles ``jax.jit(fn)`` for each ``(fn, args)`` ahead of time in a pool of ``workers`` threads.

    Returns ``(compiled or the exception raised, seconds)`` per job, in order. Tracing holds the
    GIL, XLA's compile does not: on a many-core host the compiles overlap. A job's seconds are its
    wall time in the pool, so they grow with ``workers`` when the cores are shared.
    """

    def one(job):
        fn, args = job
        t0 = time.perf_counter()
        try:
            fn = fn if hasattr(fn, "lower") else jax.jit(fn)
            return fn.lower(*args).compile(), time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001  (reported per job: one broken cell must not hide the others)
            return e, time.perf_counter() - t0

    if workers <= 1 or len(jobs) <= 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))


# ------------------------------------------------------------------------------------------
# The run record


def cpu_info() -> dict:
    """The host: name, CPU model, the SIMD flags that move CPU ratios (AVX2, AVX-512, AMX), CPU
    count, load average (1, 5, 15 min) and OS platform."""
    model, flags_ = attnlab_platform.host_cpu()
    simd = sorted(f for f in flags_ if f.startswith(("avx", "fma", "amx")))
    return {
        "hostname": socket.gethostname(),
        "cpu_model": model,
        "cpu_simd_flags": simd,
        "host_cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
    }


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


def versions(*names: str) -> dict:
    """``{name: version}`` of installed distributions (read from their metadata: nothing is imported);
    None for one that is not installed."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_record(command: str | None = None, *, devices: bool = True) -> dict:
    """What every result file carries about its run.

    ``host`` (``cpu_info``), ``jax``, ``jaxlib``, ``torch`` (None where not installed), ``python``,
    ``date`` (YYYY-MM-DD) and ``started`` (local time, ISO), ``command`` (default: this process's
    ``python -m`` line), and with ``devices`` the backend, device kind and devices (this starts
    JAX's backend: a process that must leave the accelerator alone passes ``devices=False``).
    """
    rec = {"host": cpu_info(), **versions("jax", "jaxlib", "torch"), "python": platform.python_version()}
    rec |= {"date": time.strftime("%Y-%m-%d"), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    rec["command"] = command if command is not None else _command()
    if devices:
        rec |= {
            "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind,
            "devices": [str(d) for d in jax.devices()],
        }
    return rec


def _command() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None and spec.name else f"python {sys.argv[0]}"
    return " ".join([prog, *sys.argv[1:]])


class Run:
    """A benchmark run: its record at the start, and the wall / CPU seconds and end load at ``finish``.

    Example:
        >>> run = Run(command="python -m benchmarks.x", devices=False)
        >>> sorted(k for k in run.finish() if k in ("wall_s", "cpu_s", "load_avg_end", "command"))
        ['command', 'cpu_s', 'load_avg_end', 'wall_s']
    """

    def __init__(self, command: str | None = None, *, devices: bool = True):
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        self.record = run_record(command, devices=devices)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def finish(self) -> dict:
        return self.record | {
            "wall_s": round(self.elapsed(), 1),
            "cpu_s": round(time.process_time() - self.cpu0, 1),
            "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        }


# ------------------------------------------------------------------------------------------
# Result files


def write_json(path, obj) -> None:
    """Writes ``obj`` as indented JSON, atomically (a temporary file, then a rename): a reader never
    sees half a file, and a run killed mid-write keeps the previous version."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def sweep(grid: Sequence[tuple], measure: Callable[..., dict], out, line: Callable[..., str], **meta) -> list[dict]:
    """One record per point of ``grid``: ``measure(*point)``, printed at once as ``[i/n] line(*point, record)``
    (progress), with ``out`` rewritten after each (``Run().finish() | meta | {"records": [...]}``), so a run
    cut short keeps what it measured. Returns the records."""
    run, records = Run(), []
    for i, point in enumerate(grid):
        records.append(measure(*point))
        progress(f"[{i + 1}/{len(grid)}] {line(*point, records[-1])}")
        write_json(out, run.finish() | meta | {"records": records})
    print(f"wrote {out}")
    return records


class Recorder:
    """The rows of one section of a run: each printed as it is added (progress), and the result file
    rewritten after each, so a run cut short keeps what it measured.

    Args:
        section: the key of ``result`` the rows go under.
        budget_minutes: the section's time; ``left()`` turns False past it or past ``deadline``.
        result: the whole result dict (written to ``out`` after each row), or None.
        out: the JSON file, or None (rows kept in memory only).
        deadline: ``time.time()`` past which no section has time left (the run's own limit).
    """

    def __init__(self, section: str, budget_minutes: float, result: dict | None = None, out=None, deadline=None):
        self.section, self.rows, self.result, self.out = section, [], result, out
        self.t0, self.budget, self.deadline = time.perf_counter(), budget_minutes, deadline
        self._errors_seen: set[str] = set()
        if result is not None:
            result[section] = self.rows

    def seconds_left(self) -> float:
        left = self.budget * 60 - (time.perf_counter() - self.t0)
        return left if self.deadline is None else min(left, self.deadline - time.time())

    def left(self) -> bool:
        return self.seconds_left() > 0

    def add(self, row: dict) -> None:
        self.rows.append(row)
        shown = {k: v for k, v in row.items() if k != "reason" or row.get("status") != "unsupported"}
        print(f"[{self.section} {time.perf_counter() - self.t0:6.1f}s] " + json.dumps(shown), flush=True)
        self.save()

    def save(self) -> None:
        if self.out and self.result is not None:
            write_json(self.out, self.result)

    def error(self, row: dict, e: BaseException) -> None:
        """An error row; the first traceback of each kind of error goes to stderr in full."""
        msg = f"{type(e).__name__}: {e}"
        key = msg.splitlines()[0][:120]
        if key not in self._errors_seen:
            self._errors_seen.add(key)
            traceback.print_exception(e, file=sys.stderr)
        self.add(row | dict(status="error", reason=msg[:2000]))


# ------------------------------------------------------------------------------------------
# Tolerances, FLOPs, tables


def compare(actual, expected, dtype, what: str = "out", *, backend: str | None = None) -> dict:
    """``actual`` against the fp32 reference ``expected`` with ``attnlab.testing``'s tolerance.

    Returns ``rel_err`` (max |a - e| over max |e|), ``tol_ratio`` (max over elements of
    |a - e| / (atol + rtol |e|): at most 1 passes, as ``numpy.testing.assert_allclose``) and
    ``ok`` (that, and every element finite). ``backend`` None: JAX's default backend.
    """
    a, e = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (actual, expected))
    tol = testing.tolerance(dtype, what, backend=backend or jax.default_backend())
    diff = np.abs(a - e)
    ratio = float(np.max(diff / (tol["atol"] + tol["rtol"] * np.abs(e)), initial=0.0))
    rel = float(np.max(diff, initial=0.0) / max(1e-6, float(np.max(np.abs(e), initial=0.0))))
    finite = bool(np.isfinite(a).all())
    return {"rel_err": rel, "tol_ratio": ratio, "ok": finite and ratio <= 1.0}


def max_abs_diff(a, b) -> float:
    """The largest ``|a - b|`` over two pytrees of arrays of the same structure, in fp32."""
    return max(
        float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def useful_flops(pairs: int, N: int, H: int, direction: str, score: str = "dot") -> float:
    """FLOPs of one attention call over its allowed (query, key) pairs, the one convention of every benchmark.

    Forward: the logits and the weighted sum, 2H each per pair and head (``4 N H``); an additive
    (tanh) score costs 3H for its logits (add, tanh, multiply-add: ``5 N H``). Forward+backward:
    3.5x the forward for a dot-product score (FlashAttention's count: 5 matmuls backward against
    2 forward), 3x for an additive one. Per-element scores (SoftCap, ScoreMod) count as the dot.
    """
    if direction not in ("fwd", "fwd+bwd"):
        raise ValueError(f"direction must be 'fwd' or 'fwd+bwd', got {direction!r}")
    additive = score == "additive"
    fwd = (5.0 if additive else 4.0) * N * H * pairs
    return fwd if direction == "fwd" else fwd * (3.0 if additive else 3.5)


def allowed_pairs(mask, T: int, S: int | None = None) -> int:
    """(query, key) pairs ``mask`` allows in one ``[T, S]`` row of the batch (None: all of them);
    counted from ``mask.dense`` on the default device."""
    S = T if S is None else S
    if mask is None:
        return T * S
    dense = jnp.asarray(mask.dense(T, S)).reshape(-1, T, S)[0]  # [*B, T, S] -> the first row's [T, S]
    return int(np.asarray(jnp.sum(dense, axis=-1, dtype=jnp.int32)).astype(np.int64).sum())


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """The experiments' one markdown table writer (``experiments.common.markdown_table``).

    Imported on use: ``experiments.common`` needs ``ml_collections``, which a bare GPU image lacks
    (a caller there prints its rows another way when this raises ``ImportError``).
    """
    from experiments.common import markdown_table as table  # noqa: PLC0415

    return table(header, rows)


def rows_table(title: str, rows: Sequence[Mapping], cols: Sequence[str]) -> str:
    """``## title`` and a markdown table of ``rows`` (dicts) over ``cols``, present columns only."""
    cols = [c for c in cols if any(r.get(c) is not None for r in rows)]
    cells = [["" if r.get(c) is None else _cell(r.get(c)) for c in cols] for r in rows]
    return f"## {title}\n" + markdown_table(cols, cells)


def _cell(v) -> str:
    """A float to three significant digits, from 1000 up as a whole number with thousands separators."""
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


# ------------------------------------------------------------------------------------------
# One process on the device at a time


class DeviceLock:
    """Quiet timing for processes that share a machine: compiles side by side, timings alone.

    A readers-writer lock on a file (``fcntl.flock``): ``compiling()`` is shared (any number of
    processes compile at once: CPU work), ``exclusive()`` waits until no one compiles or times and
    keeps everyone else out while the holder runs work on the device and times it, so no timing shares
    the GPU with another process's work or its host's cores with a compiler (a compile beside a timed
    call takes the cores that launch its kernels). A second file is a turnstile:
    a process waiting for ``exclusive()`` holds it, so new compiles wait behind it instead of starving
    it. Not reentrant: a holder must not take the lock again. ``path`` None: a lock that does nothing.
    """

    def __init__(self, path=None):
        self.path = None if path is None else str(path)

    @contextlib.contextmanager
    def _hold(self, mode: int):
        if self.path is None:
            yield
            return
        with open(self.path + ".turnstile", "a") as turn, open(self.path, "a") as f:
            fcntl.flock(turn, fcntl.LOCK_EX)
            try:
                fcntl.flock(f, mode)
            finally:
                fcntl.flock(turn, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def exclusive(self):
        """Held while running work on the device and timing it: no one else compiles or runs meanwhile."""
        return self._hold(fcntl.LOCK_EX)

    def compiling(self):
        """Held while compiling (shared with other compilers; waits while someone holds ``exclusive``)."""
        return self._hold(fcntl.LOCK_SH)
