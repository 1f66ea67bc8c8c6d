r"""The GPU check in one go: every GPU implementation against the reference, then speed against the peers.

Needs jax (CUDA), flax, optax, chex and absl-py, and for the peers torch with Triton (and tokamax
where its wheels travel with the run); run from the repository root:

    PYTHONPATH=. python -m benchmarks.gpu_check --out results/gpu_check.json       # ~6 min on an H100
    PYTHONPATH=. python -m benchmarks.gpu_check --smoke --out /tmp/gpu_check.json  # same code, toy sizes, any backend

(``make gpu-check``; on the lent device machine ``bash benchmarks/gpu_run.sh``, which installs the
carried wheels and writes under ``$OUT``). Sections, each with its own time budget (``--minutes``;
rows past it are recorded as skipped), in this order:

a. **correctness** (``benchmarks.correctness``): every registered implementation but the dense
   reference (``attnlab.IMPLEMENTATIONS``) against ``attention_reference`` in fp32 with matmul
   precision "highest": outputs and ``jax.vjp`` gradients at ``attnlab.testing``'s GPU tolerance
   (``harness.compare``), bf16 and fp32, H = 64 and 128; B=2, T=1000, N=8, K=2; masks full / causal
   / window(128, 0) / window(64, 64) / traced padding with empty rows / a 1% graph (an
   implementation runs the first form of a mask it supports: the graph as adjacency or as an edge
   list), then SoftCap(30), ALiBi as a ``ScoreMod`` and ``Additive(w)``, causal, with the gradients
   of the score's arrays; the additive cells at the largest T whose dense ``[B, N, T, S, H]``
   reference fits ``dense_ref_bytes``. Empty rows must be exactly zero. A cell an implementation
   does not support carries ``explain``'s reason.
b. **autotune**: ``attnlab.autotune`` (fwd+bwd) for every registered implementation with a tile search
   that takes the call (Mosaic on Hopper, Pallas) on full, causal, documents and SoftCap at the
   shorter speed length and the larger head dim; the section's time is shared between them. The
   winners go into ``tuning.json`` beside ``out`` (attnlab.tuning's table format), which the speed
   section then reads (``$ATTNLAB_TUNING_CACHE``): the speed rows time the tuned tiles.
   ``python -m benchmarks.tuning_table --from_tuning <tuning.json>`` adds them to the committed table.
c. **speed**: bf16, B=1, N=16, H = 64 and 128, T = 4K and 16K, forward and forward+backward, the
   cases of ``benchmarks.cases.speed_cases`` (full, causal, causal window(128, 0), window ±128, 16
   packed documents with ids traced, SoftCap(30), ALiBi; additive at H=64, T=4K) on every contender:
   ours from the registry (``benchmarks.contenders``), cuDNN through ``jax.nn``, tokamax where it
   imports, and torch's compiled ``flex_attention`` and SDPA (``benchmarks.torch_peers``, in worker
   processes that compile while this one runs). ms (best and median of ``--repeats`` after a
   warm-up), useful TFLOP/s (``harness.useful_flops``), ``vs_cudnn`` (cuDNN's ms on the case's
   baseline / ms) and ``vs_flex`` (flex's ms on the same case / ms): > 1 is faster. A contender
   more than ``--slow_factor`` times the fastest at the shorter length is not timed at the longer
   one, nor a program that needs more than ``--max_cell_memory`` of the device.
d. **memory**: compiled forward+backward memory (arguments + outputs + temporaries) at the largest
   length, per registered implementation.
e. **blocks** (not run by default: ``--sections``): ``pallas_attention`` per ``(block_q, block_k)``.

Adding a section: a function ``f(ctx: Context) -> None`` that adds rows to ``ctx.recorder(name)``
(and may write a side file, ``ctx.side_file(name)``), one entry in ``SECTIONS`` and, if it runs by
default, in ``DEFAULT_SECTIONS`` and ``Options.minutes``. A new registered implementation needs no
change: correctness, speed and memory take their lists from the registry.

Writes ``--out`` (JSON: ``meta`` with the run record, then one list of rows per section), rewritten
after every row; torch's rows also go to ``<out stem>.torch.jsonl`` as they finish. Rows keep the
fields of the earlier results (``experiments/docs.py`` reads them): ``implementation``, ``mask``,
``score``, ``T``, ``H``, ``direction``, ``status``, ``ms``, ``tflops``, ``vs_cudnn``; new ones are
``case``, ``median_ms``, ``runs``, ``first_call_s``, ``compile_s``, ``vs_flex`` and, correctness,
``out_tol_ratio`` / ``grad_tol_ratio``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
from absl import app, flags

import attnlab
from benchmarks import contenders, harness, torch_peers
from benchmarks import correctness as check
from benchmarks.cases import Case, speed_cases

# ------------------------------------------------------------------------------------------
# Options, sizes, the run's context


@dataclasses.dataclass(frozen=True)
class Options:
    """The command line (flags are defined only when this file runs as a program)."""

    contenders: tuple | None = None  # None: every registered implementation and every peer
    cases: tuple | None = None  # speed cases by name; None: all
    repeats: int = 5
    # per section; the default run fits ~6 min with start-up (the device lends 10 min per command)
    minutes: tuple = (("correctness", 1.75), ("autotune", 1.0), ("speed", 2.5), ("memory", 0.25), ("blocks", 1.0))
    # compiles share the host's cores (timings have it alone): half to JAX's threads, half to the torch workers
    compile_workers: int = max(1, min(8, (os.cpu_count() or 1) // 2))
    torch_jobs: int = max(1, min(4, (os.cpu_count() or 1) // 4))  # torch worker processes
    max_cell_s: float = 3.0  # seconds of timed calls per speed cell at most (fewer repeats)
    slow_factor: float = 10.0
    max_cell_memory: float = 0.4  # of the device's memory, for one speed cell's compiled program
    check_len: int = 4096  # peers' outputs compared with a dense computation up to this length

    def budget(self, section: str) -> float:
        return dict(self.minutes).get(section, 1.0)

    def contender_names(self) -> tuple[str, ...]:
        return self.contenders or contenders.ours() + contenders.PEERS


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each section runs at (the issues' sizes, or toy ones for --smoke)."""

    corr_shape: tuple  # (B, T, N, K)
    corr_heads: tuple  # H values
    window: int  # window(window, 0)
    window2: int  # window(window2, window2)
    speed_lengths: tuple
    speed_heads: tuple
    speed_n: int
    speed_window: int  # window ±speed_window, and cuDNN's causal window(speed_window, 0)
    docs: int = 16  # packed documents per row
    additive_at: tuple = ((64, 4096),)  # (H, T) of the additive speed case
    corr_scores: tuple = ("softcap", "alibi_mod", "additive")
    corr_dtypes: tuple = ("bfloat16", "float32")
    corr_masks: tuple | None = None  # the correctness cases' mask names to run (None: every case)
    dense_ref_bytes: int = 2**31  # the additive reference's [B, N, T, S, H] fp32 tensor at most
    blocks: tuple = ((64, 64), (128, 64), (64, 128), (128, 128))  # (block_q, block_k) of the blocks section


FULL = Sizes((2, 1000, 8, 2), (64, 128), 128, 64, (4096, 16384), (64, 128), 16, 128)
# the smoke run checks this script's code; the kernels' correctness on a CPU is the conformance suite's
SMOKE = Sizes(
    (2, 40, 4, 2), (8,), 6, 3, (64, 128), (8,), 2, 8, docs=4, additive_at=((8, 64),), corr_scores=("additive",),
    corr_dtypes=("bfloat16",), dense_ref_bytes=2**20, blocks=((16, 32),),
)  # fmt: skip


@dataclasses.dataclass
class Context:
    """What a section gets: sizes, options, the result (rewritten to ``out``), the device lock, the deadline."""

    sz: Sizes
    opts: Options
    result: dict
    out: str | None
    lock: harness.DeviceLock
    deadline: float
    torch: dict = dataclasses.field(default_factory=dict)  # the torch workers: procs, rows file, deadline

    def recorder(self, section: str) -> harness.Recorder:
        return harness.Recorder(section, self.opts.budget(section), self.result, self.out, self.deadline)

    def side_file(self, name: str) -> str | None:
        """A file beside ``out`` (a section's own JSON), or None without ``out``."""
        return None if not self.out else os.path.join(os.path.dirname(self.out) or ".", name)


# ------------------------------------------------------------------------------------------
# (a) correctness


def correctness(ctx: Context) -> None:
    """Every registered implementation (cuDNN's wrapper too) against the reference (``benchmarks.correctness``)."""
    names = [n for n in ctx.opts.contender_names() if n in contenders.registered()]
    names += [v for v, (base, _) in check.VARIANTS.items() if base in names]  # the Mosaic forward with its own backward
    check.check_all(ctx.sz, names, ctx.recorder("correctness"), ctx.lock, ctx.opts.compile_workers)


# ------------------------------------------------------------------------------------------
# (b) autotune


AUTOTUNE_CASES = ("full", "causal", "documents", "softcap")


def autotune(ctx: Context) -> None:
    """``attnlab.autotune`` on this device (see the module docstring), one row per (implementation, case)."""
    rec = ctx.recorder("autotune")
    table = ctx.side_file("tuning.json")
    if table:  # the speed section (this process) then runs the tuned configurations
        os.environ["ATTNLAB_TUNING_CACHE"] = os.path.abspath(table)
    T, H, N = min(ctx.sz.speed_lengths), max(ctx.sz.speed_heads), ctx.sz.speed_n
    cases = [c for c in speed_cases(ctx.sz.speed_window, ctx.sz.docs) if c.name in AUTOTUNE_CASES]
    names = [n for n in ctx.opts.contender_names() if n in contenders.registered()]
    tunable = [n for n in names if getattr(attnlab.dispatch.IMPLEMENTATIONS[n], "tunable", None)]
    jobs = [(name, case) for name in tunable if name != "blockwise" for case in cases]
    results = []
    for i, (name, case) in enumerate(jobs):
        row = dict(implementation=name, case=case.name, T=T, H=H, N=N, dtype="bfloat16", direction="fwd+bwd")
        budget = rec.seconds_left() / (len(jobs) - i)
        if budget <= 0:
            rec.add(row | dict(status="skipped", reason="time budget"))
            continue
        q, k, v = contenders.inputs(T, N, H)
        ids = jnp.asarray(case.ids(T)) if case.mask == "documents" else None
        try:
            with ctx.lock.exclusive():
                res = attnlab.autotune(
                    q, k, v, mask=contenders.attnlab_mask(case, ids), score=contenders.attnlab_score(case, N, H),
                    implementation=name, direction="fwd_bwd", budget_s=budget, save=table or False, verbose=False,
                    compile_workers=ctx.opts.compile_workers,
                )  # fmt: skip
        except ValueError as e:  # the implementation does not take this call on this device
            rec.add(row | dict(status="unsupported", reason=str(e)))
            continue
        ok = [r for r in res.rows if r["ms"] is not None]
        rec.add(row | dict(status="ok" if res.best is not None else "error", best=_config_json(res.best),
                           ms=None if res.best is None else round(res.best_ms, 3), tried=len(res.rows),
                           failed=len(res.rows) - len(ok)))  # fmt: skip
        tried = [r | {"config": _config_json(r["config"])} for r in res.rows]
        results.append(dict(row, key=res.key.as_json(), rows=tried))
    if ctx.side_file("autotune.json"):
        harness.write_json(ctx.side_file("autotune.json"), dict(run=harness.run_record(), results=results))


def _config_json(config):
    """A tuned configuration as JSON (a dataclass's fields), or None."""
    if config is None or isinstance(config, dict):
        return config
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else str(config)


# ------------------------------------------------------------------------------------------
# (c) speed


@dataclasses.dataclass(frozen=True)
class SpeedCell:
    H: int
    T: int
    direction: str
    case: Case
    contender: str

    def row(self, N: int) -> dict:
        """The row's fields; attnlab's document rows are ``document<n>_traced`` (their ids are a jit argument, as
        the earlier results named them), the peers' ``document<n>``."""
        mask = self.case.mask_label
        if self.case.mask == "documents" and self.contender in contenders.ours():
            mask += "_traced"
        return dict(case=self.case.name, mask=mask, score=self.case.score_label, T=self.T, H=self.H, N=N, B=1,
                    dtype="bfloat16", implementation=self.contender, direction=self.direction)  # fmt: skip


def speed_cells(sz: Sizes, opts: Options) -> list[SpeedCell]:
    """Every speed cell in the order it runs: per H, the shorter length first (the slow rule reads it)."""
    cases = speed_cases(sz.speed_window, sz.docs, sz.additive_at)
    cases = [c for c in cases if opts.cases is None or c.name in opts.cases]
    return [
        SpeedCell(H, T, direction, case, name)
        for H in sorted(sz.speed_heads, reverse=True)
        for T in sorted(sz.speed_lengths)
        for direction in ("fwd", "fwd+bwd")
        for case in cases
        if case.runs_at(H, T)
        for name in opts.contender_names()
    ]


def _too_slow(cell: SpeedCell, seen: dict, factor: float) -> str | None:
    """Why not to time ``cell``: over ``factor`` times the fastest at a shorter length (same H, case, direction)."""
    for (H, T, d, case, name), ms in seen.items():
        if (H, d, case, name) == (cell.H, cell.direction, cell.case.name, cell.contender) and T < cell.T:
            fastest = min(m for (h, t, dd, c, _), m in seen.items() if (h, t, dd, c) == (H, T, d, case))
            if ms > factor * fastest:
                return f"{ms / fastest:.0f}x the fastest at T={T} (> --slow_factor {factor:g})"
    return None


def _device_bytes() -> int | None:
    try:
        return int(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # noqa: BLE001  (XLA:CPU keeps no statistics)
        return None


def speed(ctx: Context) -> None:
    """JAX contenders compiled in batches in a thread pool and timed one at a time; then the torch workers' rows."""
    rec = ctx.recorder("speed")
    N, seen = ctx.sz.speed_n, {}
    cells = [c for c in speed_cells(ctx.sz, ctx.opts) if c.contender not in contenders.TORCH_PEERS]
    step = 2 * max(1, ctx.opts.compile_workers)
    for start in range(0, len(cells), step):
        todo = []
        for cell in cells[start : start + step]:
            row = cell.row(N)
            why = None if rec.left() else "time budget"
            why = why or _too_slow(cell, seen, ctx.opts.slow_factor)
            if why:
                rec.add(row | dict(status="skipped", reason=why))
                continue
            try:
                fn, args = contenders.build(cell.contender, cell.case, cell.T, N, cell.H, cell.direction)
            except contenders.UnsupportedError as e:
                rec.add(row | dict(status="unsupported", reason=str(e)))
                continue
            todo.append((cell, row, fn, args))
        with ctx.lock.compiling():  # side by side with the torch workers' compiles
            compiled = harness.compile_all([(fn, args) for _, _, fn, args in todo], ctx.opts.compile_workers)
        with ctx.lock.exclusive():  # the batch's timings, with no compile or other run on the machine
            for (cell, row, _, args), (exe, compile_s) in zip(todo, compiled, strict=True):
                ms = _time_cell(ctx, rec, cell, row | dict(compile_s=round(compile_s, 2)), exe, args)
                if ms is not None:
                    seen[cell.H, cell.T, cell.direction, cell.case.name, cell.contender] = ms
    if ctx.torch:
        problems = torch_peers.finish(ctx.torch["procs"], deadline=ctx.torch["deadline"])
        rec.rows.extend(torch_peers.collect(ctx.torch["rows"]))
        for p in problems:
            rec.add(dict(status="error", implementation="torch workers", reason=p))
    add_ratios(rec.rows, speed_cases(ctx.sz.speed_window, ctx.sz.docs, ctx.sz.additive_at))
    rec.save()


def _time_cell(ctx: Context, rec: harness.Recorder, cell: SpeedCell, row: dict, exe, args) -> float | None:
    """Times one compiled cell; records its row; its best ms, or None."""
    if isinstance(exe, Exception):
        rec.error(row, exe)
        return None
    limit, ma = _device_bytes(), exe.memory_analysis()
    need = 0 if ma is None else ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
    if limit and need > ctx.opts.max_cell_memory * limit:
        rec.add(row | dict(status="skipped", reason=f"needs {need / 2**30:.1f} GiB > --max_cell_memory of the device"))
        return None
    if not rec.left():
        rec.add(row | dict(status="skipped", reason="time budget"))
        return None
    try:  # the caller holds the device lock
        timing = harness.time_call(harness.blocking(exe, *args), repeats=ctx.opts.repeats, max_s=ctx.opts.max_cell_s)
    except Exception as e:  # noqa: BLE001  (report and go on)
        rec.error(row, e)
        return None
    pairs, flops = contenders.cost(cell.case, cell.T, row["N"], cell.H, cell.direction)
    tflops = float(f"{flops / timing.best_s / 1e12:.3g}")
    rec.add(row | dict(status="ok", **timing.record(), tflops=tflops, pairs=pairs))
    return 1e3 * timing.best_s


def add_ratios(rows: list[dict], cases) -> None:
    """``vs_cudnn`` (cuDNN's ms on the case's baseline / ms) and ``vs_flex`` (flex's ms on the same case / ms), and
    TFLOP/s where a worker's row lacks them; > 1 is faster. Rows without their reference row in the run get None.
    ``cases``: the run's ``Case`` objects (their baselines and sizes)."""
    cases = {c.name: c for c in cases}
    baseline = {name: c.baseline for name, c in cases.items()}
    ok = [r for r in rows if r.get("status") == "ok" and r.get("case") in cases]
    ms = {(r["H"], r["T"], r["direction"], r["case"], r["implementation"]): r["ms"] for r in ok}
    for r in ok:
        at = (r["H"], r["T"], r["direction"])
        cudnn, flex = ms.get((*at, baseline.get(r["case"], r["case"]), "cudnn")), ms.get((*at, r["case"], "flex"))
        r["vs_cudnn"] = None if cudnn is None else round(cudnn / r["ms"], 3)
        r["vs_flex"] = None if flex is None else round(flex / r["ms"], 3)
        if "tflops" not in r:
            r["pairs"], flops = contenders.cost(cases[r["case"]], r["T"], r["N"], r["H"], r["direction"])
            r["tflops"] = float(f"{flops / r['ms'] / 1e9:.3g}")


def start_torch(ctx: Context, seconds: float) -> None:
    """Starts the torch workers for the speed section's torch cells: they compile from the run's start and stop
    timing ``seconds`` later (when the speed section's budget ends)."""
    cells = [
        torch_peers.Cell(c.contender, c.case, c.T, ctx.sz.speed_n, c.H, c.direction)
        for c in speed_cells(ctx.sz, ctx.opts)
        if c.contender in contenders.TORCH_PEERS
    ]
    if not cells:
        return
    workdir = tempfile.mkdtemp(prefix="gpu_check_torch_")
    rows = os.path.splitext(ctx.out)[0] + ".torch.jsonl" if ctx.out else os.path.join(workdir, "torch.jsonl")
    deadline = min(time.time() + seconds, ctx.deadline)
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    procs = torch_peers.launch(
        cells, jobs=ctx.opts.torch_jobs, out=rows, lock_path=ctx.lock.path, deadline=deadline,
        repeats=ctx.opts.repeats, max_cell_s=ctx.opts.max_cell_s, check_len=ctx.opts.check_len, device=device,
        workdir=workdir,
    )  # fmt: skip
    ctx.torch.update(procs=procs, rows=rows, deadline=deadline)


# ------------------------------------------------------------------------------------------
# (d) memory and (e) blocks


def memory(ctx: Context) -> None:
    """Compiled fwd+bwd memory of each registered implementation at the largest length (full attention; cuDNN
    through jax.nn, the kernel its wrapper calls)."""
    rec = ctx.recorder("memory")
    T, H, N = max(ctx.sz.speed_lengths), ctx.sz.speed_heads[0], ctx.sz.speed_n
    full = speed_cases()[0]
    for name in [n for n in ctx.opts.contender_names() if n in contenders.registered()]:
        row = dict(T=T, H=H, N=N, B=1, dtype="bfloat16", implementation=name, direction="fwd+bwd", mask="full")
        if not rec.left():
            rec.add(row | dict(status="skipped", reason="time budget"))
            continue
        try:
            fn, args = contenders.build(name, full, T, N, H, "fwd+bwd")
            sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
            with ctx.lock.compiling():
                ma = jax.jit(fn).lower(*sds).compile().memory_analysis()
        except contenders.UnsupportedError as e:
            rec.add(row | dict(status="unsupported", reason=str(e)))
            continue
        except Exception as e:  # noqa: BLE001
            rec.error(row, e)
            continue
        total = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
        temp = ma.temp_size_in_bytes
        rec.add(row | dict(status="ok", temp_bytes=temp, total_bytes=total, total_mib=round(total / 2**20, 1)))


def blocks(ctx: Context) -> None:
    """``pallas_attention`` per ``(block_q, block_k)``, full and causal, against cuDNN in the same run."""
    rec = ctx.recorder("blocks")
    T = max(t for t in ctx.sz.speed_lengths if t <= max(16384, min(ctx.sz.speed_lengths)))
    N = ctx.sz.speed_n
    for H in ctx.sz.speed_heads:
        for case in speed_cases()[:2]:  # full, causal
            for direction in ("fwd", "fwd+bwd"):
                row = dict(mask=case.mask_label, case=case.name, T=T, H=H, N=N, dtype="bfloat16", direction=direction)
                ref = None
                for bq, bk in ((None, None), *ctx.sz.blocks):
                    r = row | dict(implementation="cudnn" if bq is None else "pallas", block_q=bq, block_k=bk)
                    try:
                        fn, args = _block_fn(case, T, N, H, direction, bq, bk)
                    except contenders.UnsupportedError as e:
                        rec.add(r | dict(status="unsupported", reason=str(e)))
                        continue
                    ms = _time_block(ctx, rec, r, fn, args)
                    ref = ms if bq is None else ref
                    if ms and ref:
                        rec.rows[-1]["vs_cudnn"] = round(ref / ms, 3)


def _block_fn(case: Case, T: int, N: int, H: int, direction: str, bq, bk):
    """cuDNN's ``(fn, args)`` for ``bq`` None, else ``pallas_attention`` with those tiles (the public kernel)."""
    if bq is None:
        return contenders.build("cudnn", case, T, N, H, direction)
    pallas = getattr(attnlab.kernels, "pallas_attention", None)
    pallas = pallas or importlib.import_module("attnlab.kernels.pallas_flash").pallas_attention
    mask = contenders.attnlab_mask(case)

    def fwd(q, k, v):
        return pallas(q, k, v, mask=mask, block_q=bq, block_k=bk)

    return harness.with_direction(fwd, direction, contenders.inputs(T, N, H))


def _time_block(ctx: Context, rec, row, fn, args) -> float | None:
    if not rec.left():
        rec.add(row | dict(status="skipped", reason="time budget"))
        return None
    with ctx.lock.compiling():
        ((exe, compile_s),) = harness.compile_all([(fn, args)], 1)
    if isinstance(exe, Exception):
        rec.error(row, exe)
        return None
    try:
        with ctx.lock.exclusive():
            timing = harness.time_call(harness.blocking(exe, *args), repeats=ctx.opts.repeats)
    except Exception as e:  # noqa: BLE001
        rec.error(row, e)
        return None
    row = row | dict(compile_s=round(compile_s, 2))
    rec.add(row | dict(status="ok", **timing.record()))
    return 1e3 * timing.best_s


# ------------------------------------------------------------------------------------------
# The run

SECTIONS = {"correctness": correctness, "autotune": autotune, "speed": speed, "memory": memory, "blocks": blocks}
DEFAULT_SECTIONS = ("correctness", "autotune", "speed", "memory")
TABLES = {
    "correctness": ["H", "T", "mask", "dtype", "implementation", "score", "status", "out_rel_err", "grad_rel_err"],
    "autotune": ["implementation", "case", "T", "H", "status", "ms", "tried", "best"],
    "speed": ["case", "T", "H", "direction", "implementation", "status", "ms", "tflops", "vs_cudnn", "vs_flex"],
    "memory": ["T", "H", "implementation", "status", "temp_bytes", "total_mib"],
    "blocks": ["mask", "T", "H", "direction", "implementation", "block_q", "block_k", "status", "ms", "vs_cudnn"],
}


def run(smoke: bool, sections, out: str | None, opts: Options = Options(), sizes: dict | None = None) -> dict:
    """Runs ``sections`` (in ``SECTIONS``' order); ``sizes`` overrides fields of the Sizes (e.g. speed_lengths)."""
    sz = dataclasses.replace(SMOKE if smoke else FULL, **(sizes or {}))
    if unknown := [s for s in sections if s not in SECTIONS]:
        raise ValueError(f"sections must be among {tuple(SECTIONS)}, got {unknown}")
    names = opts.contender_names()
    known = contenders.ours() + contenders.PEERS
    if unknown := [n for n in names if n not in known]:
        raise ValueError(f"contenders must be among {known}, got {unknown}")
    torch_runs = "speed" in sections and any(n in contenders.TORCH_PEERS for n in names)
    if torch_runs:  # before JAX starts its backend: leave device memory to the torch workers
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    record = harness.Run()
    minutes = sum(opts.budget(s) for s in sections)
    result = {"meta": record.record | dict(smoke=smoke, sizes=dataclasses.asdict(sz), contenders=list(names),
                                           repeats=opts.repeats, minutes=dict(opts.minutes))}  # fmt: skip
    lock = harness.DeviceLock(os.path.join(tempfile.gettempdir(), f"gpu_check.{os.getpid()}.lock"))
    ctx = Context(sz, opts, result, out, lock, deadline=time.time() + 60 * minutes + 15)
    if torch_runs:  # until the speed section's budget ends
        start_torch(
            ctx, 60 * sum(opts.budget(s) for s in list(SECTIONS)[: list(SECTIONS).index("speed") + 1] if s in sections)
        )
    try:
        for name in SECTIONS:
            if name in sections:
                s = time.perf_counter()
                SECTIONS[name](ctx)
                result["meta"][f"{name}_s"] = round(time.perf_counter() - s, 1)
    finally:  # a section that raised must not leave the workers on the device
        for p in ctx.torch.get("procs", ()):
            if p.poll() is None:
                p.kill()
    result["meta"] |= {k: v for k, v in record.finish().items() if k not in record.record}
    if out:
        harness.write_json(out, result)
    return result


def _minutes(values) -> tuple:
    """``["speed=3", "blocks=0.5"]`` -> the default budgets with those replaced."""
    minutes = dict(Options.minutes)
    for item in values:
        name, _, value = item.partition("=")
        if name not in SECTIONS or not value:
            raise ValueError(f"--minutes: expected section=minutes with a section in {tuple(SECTIONS)}, got {item!r}")
        minutes[name] = float(value)
    return tuple(minutes.items())


def print_tables(result: dict) -> None:
    """One markdown table per section (``experiments.common``'s writer; without it, the rows stay in the JSON)."""
    for name in SECTIONS:
        if name in result:
            try:
                print(harness.rows_table(name, result[name], TABLES[name] + ["reason"]))
            except ImportError as e:
                print(f"## {name}: {len(result[name])} rows in the JSON (no table: {e})")
                break


def main(_):
    # jax 0.11 warns at each Pallas Triton kernel's lowering (hundreds of lines in a run): a known choice
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)
    ints = lambda values: tuple(int(x) for x in values)  # noqa: E731
    opts = Options(
        contenders=tuple(FLAGS.contenders) or None, cases=tuple(FLAGS.cases) or None, repeats=FLAGS.repeats,
        minutes=_minutes(FLAGS.minutes), torch_jobs=FLAGS.torch_jobs,
        compile_workers=FLAGS.compile_workers or Options.compile_workers,
    )  # fmt: skip
    sizes = {f: ints(FLAGS[f].value) for f in ("corr_heads", "speed_lengths", "speed_heads") if FLAGS[f].value}
    if FLAGS.corr_dtypes:
        sizes["corr_dtypes"] = tuple(FLAGS.corr_dtypes)
    result = run(FLAGS.smoke, FLAGS.sections, FLAGS.out, opts, sizes)
    print(json.dumps({k: v for k, v in result["meta"].items() if k != "sizes"}, indent=1))
    print_tables(result)
    fails = [r for r in result.get("correctness", []) if r["status"] in ("FAIL", "error")]
    print(f"\n{len(fails)} correctness failures; wrote {FLAGS.out}")


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (defined only when run as a program: importing the module defines none)."""
    flags.DEFINE_string("out", "results/gpu_check.json", "JSON file to write.")
    flags.DEFINE_bool("smoke", False, "Toy sizes (runs on CPU in seconds): the same code path.")
    flags.DEFINE_list("sections", list(DEFAULT_SECTIONS), f"Sections to run, of {list(SECTIONS)}.")
    flags.DEFINE_list("contenders", [], "Registered implementations and peers to run (default: all).")
    flags.DEFINE_list("cases", [], "Speed cases to run (default: all of benchmarks.cases.speed_cases).")
    flags.DEFINE_integer("repeats", 5, "Timed calls per speed cell (best and median reported).")
    flags.DEFINE_list("minutes", [], f"Time per section, e.g. speed=3,memory=0.5 (defaults {dict(Options.minutes)}).")
    flags.DEFINE_integer("torch_jobs", Options.torch_jobs, "torch worker processes (default: CPUs / 4, <= 4).")
    flags.DEFINE_integer("compile_workers", 0, "Threads compiling JAX cells (0: half the CPUs, <= 8).")
    flags.DEFINE_list("corr_heads", [], "Head dims of the correctness section (default 64,128).")
    flags.DEFINE_list("corr_dtypes", [], "dtypes of the correctness section (default bfloat16,float32).")
    flags.DEFINE_list("speed_lengths", [], "Lengths of the speed section (default 4096,16384).")
    flags.DEFINE_list("speed_heads", [], "Head dims of the speed section (default 64,128).")


if __name__ == "__main__":
    define_flags()
    app.run(main)
