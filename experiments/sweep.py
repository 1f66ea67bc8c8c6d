"""The sweep harness: sequence length x head count x implementation x mask x mode x dtype.

Command (what `make sweep` runs; about 3 minutes on a 2-core CPU):

    python -m experiments.sweep --config experiments/configs/sweep.py:default --out results/sweep

Variants live in ``experiments/configs/sweep.py`` (``default``, ``smoke``, ``long``, ``lra_table2``);
plain flags override them, e.g.

    python -m experiments.sweep --seq_lens=1024,4096 --num_heads=8 --masks=full,window:128:128 \
        --implementations=xla,jax.nn --modes=fwd_bwd --out results/mine

Each cell is compiled once, called once to warm up, then timed ``repeats`` times. One JSON line per
cell goes to ``<out>/results.jsonl`` (rewritten atomically after every cell) with: the cell's
config, status (ok / timeout / oom / error + message), median and min time, compile time, useful
FLOPs (only the (t, s) pairs the mask allows) and GFLOP/s, steps/s, memory (``memory_source`` says
whether it is XLA's memory analysis of the compiled program or the device's own peak), backend,
device kind, jax/jaxlib versions and host CPU count. Running the same command again skips cells
already done (resume); ``--force`` redoes them. A cell that fails is recorded and the sweep goes on.
When it ends, the sweep writes ``<out>/run.json``: the command, date, machine (``--machine`` describes
it), wall and CPU time and load (``experiments.provenance``).

Faults (docs/harness.md): a line of results.jsonl that is not a JSON record stops the rerun with
its file and line named; ``--skip_bad_lines`` sets such lines aside into ``results.jsonl.bad`` and
reruns their cells. One sweep at a time writes into an ``--out`` (a second one is refused, naming
the first's pid and command). ``--cell_hard_timeout_s=S`` runs the cells in a subprocess and kills
it when a cell passes S seconds (status ``timeout``; the next cell gets a new subprocess), so a hung
call cannot stall the sweep; the soft ``cell_timeout_s`` of the config only skips the repeats of a
slow cell. ``--fresh_process_per_cell`` starts a new subprocess for every cell.

Backends: ``--dtypes=auto`` is bfloat16 on GPU/TPU and float32 on CPU. ``memory_bytes`` is the
device's own peak where it belongs to the cell (always with ``--fresh_process_per_cell``), XLA's
analysis of the compiled program otherwise (CPU keeps no device statistics).
``experiments/plot.py`` then draws the figures and a markdown summary from the JSONL alone (the
sweep calls it at the end; ``--report FOLDER`` only redraws them and prints the table).

Figure to expect from ``default`` on a 2-core CPU (``results/sweep/time_vs_n.png``): every dense
implementation grows as N^2 (slope 2 on the log-log plot) for every mask, including the window;
"xla" (``jax.nn.dot_product_attention`` inside attnlab) is faster than the fp32 reference;
forward+backward costs about 2-3x forward.

Implementations: every name in ``attnlab.IMPLEMENTATIONS`` (through ``attnlab.attention``), and the
peer ``jax.nn`` (``jax.nn.dot_product_attention`` called directly with its own mask flags).
A cell of attnlab's runs only where ``attnlab.explain`` says its implementation can run that call on
the backend (``sparse``, the edge-list kernel, only on ``graph:`` masks, which it receives as an edge
list; ``cudnn`` only on GPU); other combinations are left out of the sweep.
Masks: ``full``, ``causal``, ``window:L:R``, ``graph:DENSITY`` (random graph, fixed seed,
self-loops), ``padding:FRACTION`` (the last FRACTION of every sequence is padding).

Several devices: ``--mesh=sp=8`` (ring attention over the sequence), ``--mesh=heads=4`` (head
parallelism) or ``--mesh=heads=4,sp=2`` (both) runs every cell through ``attnlab.parallel.attention``
with q/k/v sharded over that mesh; with an ``sp`` axis only ``blockwise`` cells run (the ring uses
its block step), and the peer ``jax.nn`` and head counts the ``heads`` axis does not divide are
left out. Memory is then per device. On CPU the sweep presents as many host devices as the mesh
needs (``attnlab.parallel.use_host_devices``; ``XLA_FLAGS=--xla_force_host_platform_device_count``
takes precedence when set):

    python -m experiments.sweep --config experiments/configs/sweep.py:smoke --implementations=blockwise \
        --mesh=sp=8 --out results/sweep-sp8
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
from absl import flags

import attnlab
from attnlab import parallel
from experiments import common, provenance
from experiments.common import (
    CellWorker,
    OutLockedError,  # noqa: F401  (run_sweep raises it)
    failure_record,
    lock_out,
    memory_record,  # noqa: F401  (re-exported)
    write_jsonl,
)
from experiments.plot import BadResultsLineError, describe_bad_lines, load_results, make_plots, read_results
from experiments.sweep_cells import (  # noqa: F401  (re-exported: the sweep's cell, its mask and its timing)
    ACCELERATORS,
    DTYPES,
    Cell,
    build,
    default_dtype,
    for_implementation,
    make_mask,
    parse_mask,
    resolve_dtypes,
    time_cell,
    useful_flops,
    window_pairs,
)
from experiments.sweep_report import format_table

_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "sweep.py")
FLAGS = flags.FLAGS


def define_flags():
    """The sweep's flags beside ``common.launch``'s --config, --out and --report (only when run as a program)."""
    flags.DEFINE_list("seq_lens", None, "Sequence lengths N (T = S = N); overrides the config.")
    flags.DEFINE_list("num_heads", None, "Head counts; overrides the config.")
    flags.DEFINE_list("implementations", None, "Implementations; overrides the config.")
    flags.DEFINE_list("masks", None, "Masks: full, causal, window:L:R, graph:DENSITY, padding:FRACTION.")
    flags.DEFINE_list("modes", None, "fwd and/or fwd_bwd; overrides the config.")
    flags.DEFINE_list("scores", None, "Scores: dot, softcap:CAP, alibi, additive (attnlab.scores.from_spec).")
    flags.DEFINE_list(
        "dtypes", None, "float32, bfloat16, float16 or auto (bfloat16 on GPU/TPU, float32 on CPU); overrides the config"
    )
    flags.DEFINE_integer("head_dim", None, "Head dimension H; overrides the config.")
    flags.DEFINE_integer("batch", None, "Batch size B; overrides the config.")
    flags.DEFINE_integer("repeats", None, "Timed calls per cell after one warm-up; overrides the config.")
    flags.DEFINE_bool("force", False, "Redo cells already in results.jsonl (bad lines in it are set aside).")
    flags.DEFINE_bool(
        "skip_bad_lines",
        False,
        "Set aside lines of results.jsonl that are not JSON records (into results.jsonl.bad, with a "
        "warning) and rerun the cells they held, instead of stopping.",
    )
    flags.DEFINE_bool("plot", True, "Draw the plots and summary.md at the end.")
    flags.DEFINE_float(
        "cell_hard_timeout_s",
        None,
        "Run each cell in its own subprocess and kill it after this many seconds (a hung cell is "
        "recorded as timeout and the sweep goes on); 0 = in this process (default: the config's).",
    )
    flags.DEFINE_bool(
        "fresh_process_per_cell",
        False,
        "With --cell_hard_timeout_s: a new subprocess for every cell (JAX starts each time) instead of "
        "one reused until a cell is killed; the device's peak memory is then each cell's own.",
    )
    flags.DEFINE_string("mesh", None, "Device mesh, e.g. sp=8, heads=4 or heads=4,sp=2; overrides the config.")
    flags.DEFINE_string(
        "machine",
        None,
        "How run.json describes the machine, e.g. 'the 2-core development CPU, quiet' (default: its CPU).",
    )


PEERS = ("jax.nn",)
MODES = ("fwd", "fwd_bwd")


def mesh_advice(spec: str, backend: str, num_devices: int, cpus: int | None = None) -> str:
    """What a `--mesh` means on this backend; raises ValueError when the backend cannot hold it.

    On CPU a mesh is made of host devices (as many as asked: they share the cores, so it tests the
    sharded code, and beyond the core count it does not add speed). On GPU and TPU each mesh
    device is a real chip, so the mesh must fit in the devices there are.
    """
    need = math.prod(parallel.parse_mesh(spec).values())
    if backend == "cpu":
        cpus = cpus or os.cpu_count() or 1
        advice = (
            f"mesh {spec} on CPU: {need} host devices sharing {cpus} cores; this checks the sharded code "
            f"path, and speed grows only up to one device per core (heads={cpus} is what the bench uses)"
        )
        return advice + ("" if need <= cpus else f"; {need} > {cpus} cores: expect no speed-up over {cpus}")
    chip = "TPU core" if backend == "tpu" else "GPU"
    if need > num_devices:
        raise ValueError(
            f"mesh: {spec!r} needs {need} devices, the {backend} backend has {num_devices} ({chip}s); "
            f"use a mesh of at most {num_devices}, e.g. --mesh=heads={num_devices} or --mesh=sp={num_devices}"
        )
    return (
        f"mesh {spec} on {backend}: one {chip} per mesh device ({need} of {num_devices}); heads= needs no "
        "communication inside attention, sp= (ring) passes K/V blocks between neighbours: use it when one "
        f"{chip}'s memory cannot hold the sequence"
    )


def expand(config, backend: str | None = None) -> list[Cell]:
    """All cells of a config, in the order they run (small N first within each group).

    An attnlab cell is left out where ``attnlab.explain`` says its implementation cannot run that
    call on ``backend`` (default: JAX's; it also resolves the dtype "auto"); the peer ``jax.nn``
    runs everywhere but on a mesh."""
    for mode in config.modes:
        if mode not in MODES:
            raise ValueError(f"modes: unknown mode {mode!r}, expected one of {MODES}")
    for impl in config.implementations:
        if impl not in attnlab.IMPLEMENTATIONS + PEERS:
            raise ValueError(f"implementations: unknown {impl!r}, expected one of {attnlab.IMPLEMENTATIONS + PEERS}")
    for spec in config.masks:  # validate each spec before any cell runs
        make_mask(spec, min(config.seq_lens), 1)
    score_specs = list(config.get("scores", ["dot"]) or ["dot"])
    for spec in score_specs:
        attnlab.scores.from_spec(spec, num_heads=1, head_dim=int(config.head_dim))
    mesh = config.get("mesh", "") or ""
    axes = parallel.parse_mesh(mesh) if mesh else {}
    if set(axes) - {"sp", "heads"}:
        raise ValueError(f"mesh: axes must be named 'sp' (sequence) and/or 'heads', got {mesh!r}")
    backend = backend or jax.default_backend()
    dtypes = resolve_dtypes(config.dtypes, backend)

    def runs(impl, spec, n, h, dt, sc) -> bool:
        if mesh and (impl in PEERS or ("sp" in axes and impl != "blockwise") or h % axes.get("heads", 1)):
            return False  # the ring uses the blockwise step; peers do not take a mesh
        if impl in PEERS:
            return sc == "dot"  # jax.nn computes the dot product only
        if mesh and sc != "dot":
            return False  # parallel.attention's ring streams the dot product only
        x = jax.ShapeDtypeStruct((int(config.batch), n, h, int(config.head_dim)), dt)  # [B, T, N, H]
        mask = for_implementation(impl, make_mask(spec, n, int(config.batch), config.seed), n)
        score = attnlab.scores.from_spec(sc, num_heads=h, head_dim=int(config.head_dim))
        why = attnlab.explain(x, x, x, mask=mask, score=score, implementation=impl, backend=backend)
        return why.implementation is not None

    prod = itertools.product(
        config.modes, dtypes, score_specs, config.masks, config.num_heads, config.implementations, config.seq_lens
    )
    return [
        Cell(impl, m, int(n), int(h), int(config.head_dim), int(config.batch), mode, dt, mesh, sc)
        for mode, dt, sc, m, h, impl, n in prod
        if runs(impl, m, int(n), int(h), dt, sc)
    ]


# ------------------------------------------------------------------------------------------
# The sweep


def record_key(r: dict) -> tuple:
    return tuple(r.get(f.name, f.default) for f in dataclasses.fields(Cell))


def _load_previous(path: str, *, set_aside: bool) -> list[dict]:
    """The records of an earlier run; bad lines stop the sweep, or with `set_aside` move to `<path>.bad`."""
    previous, bad = read_results(path)
    if not bad:
        return previous
    where = describe_bad_lines(path, bad)
    if not set_aside:
        raise BadResultsLineError(
            f"sweep: {len(bad)} line(s) of {path} are not JSON records (torn or overwritten):\n{where}\n"
            f"Rerun with --skip_bad_lines to set them aside in {path}.bad and rerun the cells they held, "
            "or with --force to redo every cell."
        )
    with open(path + ".bad", "a") as f:
        for lineno, text, why in bad:
            f.write(json.dumps({"line": lineno, "why": why, "text": text, "set_aside_at": time.time()}) + "\n")
    print(f"warning: set aside {len(bad)} bad line(s) into {path}.bad:\n{where}", file=sys.stderr, flush=True)
    write_jsonl(path, previous)  # the file holds only good records from here on
    return previous


def _host_devices(cell: Cell) -> int:
    """CPU host devices a cell's subprocess needs (its mesh size on CPU; 1 otherwise)."""
    if cell.mesh and jax.default_backend() == "cpu":
        return math.prod(parallel.parse_mesh(cell.mesh).values())
    return 1


def run_sweep(
    config,
    out: str,
    *,
    force: bool = False,
    plot: bool = True,
    skip_bad_lines: bool = False,
    run_info: dict | None = None,
) -> list[dict]:
    """Runs every cell of `config` not already done in `<out>/results.jsonl`; returns this sweep's records.

    The sweep holds a lock on `<out>` (``common.lock_out``) while it runs; cells run in this
    process, or each in a subprocess (``common.CellWorker``) killed after
    ``config.cell_hard_timeout_s`` seconds when that is > 0. ``plot``: draw the figures after.
    ``run_info``: fields of ``<out>/run.json`` (``command``, ``machine``; ``experiments.provenance``),
    written with the run's wall and CPU time, date and load when the sweep ends.

    Raises:
        OutLockedError: another sweep is writing into `<out>` (the message names its process).
        BadResultsLineError: `<out>/results.jsonl` has a line that is not a JSON record (the message
            names the file and line) and neither `skip_bad_lines` nor `force` is set.
    """
    os.makedirs(out, exist_ok=True)
    started = provenance.start()
    cells = expand(config)
    with lock_out(out):
        records, ran = _run_locked(config, cells, out, force=force, skip_bad_lines=skip_bad_lines)
    info = {"command": "experiments.sweep.run_sweep", **(run_info or {})}
    provenance.write(out, provenance.finish(started, **info, cells=len(cells), cells_run=ran))
    if plot:
        files = make_plots(os.path.join(out, "results.jsonl"), out)
        print("wrote " + ", ".join([os.path.join(out, "results.jsonl")] + files))
    return records


def _run_locked(config, cells, out, *, force, skip_bad_lines):
    path = os.path.join(out, "results.jsonl")
    fields = [f.name for f in dataclasses.fields(Cell) if f.default is dataclasses.MISSING]
    previous = _load_previous(path, set_aside=force or skip_bad_lines)
    by_key = {record_key(r): r for r in previous if all(name in r for name in fields)}
    if len(by_key) < len(previous):
        print(f"sweep: dropping {len(previous) - len(by_key)} records of an older format from {path}")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config.to_dict() if hasattr(config, "to_dict") else dict(config), f, indent=2)
    env = common.env()
    hard_timeout_s = float(config.get("cell_hard_timeout_s", 0) or 0)
    fresh, worker = bool(config.get("fresh_process_per_cell", False)), None
    process = ("fresh subprocess" if fresh else "subprocess") if hard_timeout_s > 0 else "in-process"
    todo = [c for c in cells if force or by_key.get(c.key(), {}).get("status") in (None, "error")]
    print(
        f"sweep: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run "
        f"on {env['backend']} ({env['device_kind']})",
        flush=True,
    )
    start = time.perf_counter()
    try:
        for i, cell in enumerate(todo, 1):
            kwargs = dict(repeats=config.repeats, timeout_s=config.cell_timeout_s, seed=config.seed)
            if hard_timeout_s > 0:
                worker = worker or CellWorker(time_cell, host_devices=_host_devices(cell), fresh=fresh)
                rec = worker.run(cell, hard_timeout_s=hard_timeout_s, **kwargs)
            else:
                try:
                    rec = time_cell(cell, **kwargs)
                except Exception as e:  # record and go on: one bad cell must not end the sweep
                    rec = failure_record(e)
            rec = {**dataclasses.asdict(cell), **rec, **env, "variant": config.get("variant", "custom")}
            rec["cell_process"] = process
            by_key[cell.key()] = rec
            write_jsonl(path, by_key.values())
            elapsed = time.perf_counter() - start
            eta = elapsed / i * (len(todo) - i)
            what = (
                f"{rec['min_ms']:9.2f} ms {rec['useful_gflops']:7.1f} GF/s"
                if rec.get("min_ms") is not None
                else rec["status"].upper() + (f" ({rec['error'][:80]})" if rec.get("error") else "")
            )
            print(
                f"[{i}/{len(todo)}] {cell.implementation:>9s} {cell.mask:>14s} {cell.mode:>7s} N={cell.seq_len:<6d} "
                f"heads={cell.num_heads:<3d} {what}  (elapsed {elapsed:.0f}s, ETA {eta:.0f}s)",
                flush=True,
            )
    finally:
        if worker is not None:
            worker.close()
    return [by_key[c.key()] for c in cells], len(todo)


def report(folder, *, plot: bool = True) -> str:
    """The table of `<folder>/results.jsonl` (its records in file order); with ``plot``, its figures
    and summary.md redrawn (``experiments.plot``) and named in the last line."""
    path = os.path.join(folder, "results.jsonl")
    text = format_table(load_results(path))
    if plot:
        text += "\nwrote " + ", ".join([path] + make_plots(path, str(folder)))
    return text


def configure(c) -> None:
    """Applies the plain flags to the config; with a mesh, presents its host devices on CPU (before
    JAX's first computation) and prints what the mesh means on this backend."""
    for name in ("seq_lens", "num_heads"):
        if FLAGS[name].value is not None:
            c[name] = [int(x) for x in FLAGS[name].value]
    for name in ("implementations", "masks", "scores", "modes", "dtypes"):
        if FLAGS[name].value is not None:
            c[name] = list(FLAGS[name].value)
    for name in ("head_dim", "batch", "repeats", "mesh"):
        if FLAGS[name].value is not None:
            c[name] = FLAGS[name].value
    with c.unlocked():
        if FLAGS.cell_hard_timeout_s is not None:
            c.cell_hard_timeout_s = FLAGS.cell_hard_timeout_s
        if FLAGS.fresh_process_per_cell:
            c.fresh_process_per_cell = True
    if c.get("mesh"):
        parallel.use_host_devices(math.prod(parallel.parse_mesh(c.mesh).values()))
        print(mesh_advice(c.mesh, jax.default_backend(), jax.device_count()), flush=True)


def _run(config, out: Path) -> None:
    info = {"command": provenance.command("experiments.sweep"), "machine": FLAGS.machine}
    run_sweep(config, str(out), force=FLAGS.force, plot=False, skip_bad_lines=FLAGS.skip_bad_lines, run_info=info)


if __name__ == "__main__":
    common.launch(
        _run,
        lambda folder: report(folder, plot=FLAGS.plot),
        config=f"{_CONFIGS}:default",
        out="results/sweep",
        extra_flags=define_flags,
        configure=configure,
    )
