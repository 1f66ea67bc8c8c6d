"""What the sweep's committed runs say: the docs' sweep tables, a line per run, and their reading.

A sweep results folder (``docs/results/sweep/``) holds one run, ``results.jsonl`` + ``run.json``,
and may hold more runs of the same command in ``run2/``, ``run3/``, ... (each its own
``results.jsonl`` + ``run.json``; ``make sweep-repeat RUN=2`` writes one). Every function here reads
all of them:

* ``run_lines(folder)``: the command, cells, wall time and machine of each run;
* ``pivot(folder)``: best time (ms) per mask x mode and implementation at one N and head count:
  the one run's value, or the smallest and largest over the runs (``755-838``);
* ``reading(folder)``: the prose that reads that table, generated so that it states only what
  holds in every run: which implementation is the fastest in every row, and a mask's effect on an
  implementation's time only where every run puts it at least ``MARGIN`` times from its
  full-attention time (smaller differences are within what one cell moves between runs);
* ``summary(folder)``: the first run's ``summary.md`` (every cell), as ``make plots`` writes it;
* ``lra_table2(folder)``: the ``:lra_table2`` variant's run as LRA's Table 2.

``experiments/docs.py`` calls them on the committed folders.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from experiments import plot
from experiments.tables import markdown_table, size_label, span

MARGIN = 2.0  # a mask's effect is read where every run is at least this factor from full attention


def run_folders(folder) -> list[Path]:
    """The folder itself, then its ``run<k>/`` subfolders in order of k (each holding a results.jsonl)."""
    folder = Path(folder)
    extra = [p for p in folder.glob("run*") if re.fullmatch(r"run\d+", p.name) and (p / "results.jsonl").exists()]
    return [folder, *sorted(extra, key=lambda p: int(p.name[3:]))]


def load_runs(folder) -> list[tuple[dict, list[dict]]]:
    """``(run.json, records)`` of every run under ``folder`` (``run_folders``), in order."""
    return [
        (json.loads((f / "run.json").read_text()), plot.load_results(str(f / "results.jsonl")))
        for f in run_folders(folder)
    ]


def _run_line(run: dict, records: list[dict]) -> str:
    ok = sum(r["status"] == "ok" for r in records)
    r0 = records[0]
    minutes, seconds = divmod(round(run["wall_s"]), 60)
    return (
        f"`{run['command']}` ({r0['variant']} variant, {len(records)} cells, {ok} ok) took "
        f"{minutes} min {seconds:02d} s of wall time ({run['cpu_s']:.0f} s of CPU) on {run['machine']}, "
        f"{run['date']}, load average {run['load']}; jax {r0['jax']}, backend {r0['backend']}, "
        f"{r0['host_cpus']} host CPUs."
        + (f" It ran {run['cells_run']} of the cells (the others were in the folder already)."
           if run.get("cells_run") not in (None, len(records)) else "")
    )  # fmt: skip


def run_lines(folder) -> str:
    """One line on each committed run: command, cells, wall time, machine (from run.json + the JSONL)."""
    runs = load_runs(folder)
    if len(runs) == 1:
        return _run_line(*runs[0]) + "\n"
    lines = [f"- run {i}: " + _run_line(*run) for i, run in enumerate(runs, 1)]
    return f"{len(runs)} runs of the same cells:\n\n" + "\n".join(lines) + "\n"


def _cells(runs, seq_len: int, num_heads: int) -> tuple[list[str], list[str], list[str], dict]:
    """The masks, modes and implementations at (N, heads, fp32), and ``(mask, mode, impl) -> one
    record per run that has the cell``."""
    cells: dict[tuple, list[dict]] = {}
    for _, records in runs:
        for r in records:
            if r["seq_len"] == seq_len and r["num_heads"] == num_heads and r["dtype"] == "float32":
                cells.setdefault((r["mask"], r["mode"], r["implementation"]), []).append(r)
    masks, modes, impls = (list(dict.fromkeys(k[i] for k in cells)) for i in range(3))
    return masks, modes, impls, cells


def _times(rs: list[dict]) -> list[float]:
    return [r["min_ms"] for r in rs if r["status"] == "ok"]


def pivot(folder, seq_len: int = 2048, num_heads: int = 8) -> str:
    """Best time (ms) per mask x mode (rows) and implementation (columns) at one N and head count;
    with several runs, the smallest and largest over them. A cell no run timed shows its status."""
    masks, modes, impls, cells = _cells(load_runs(folder), seq_len, num_heads)
    rows = []
    for mode in modes:
        for mask in masks:
            row = [mask, mode]
            for impl in impls:
                rs = cells.get((mask, mode, impl), [])
                times = _times(rs)
                row.append(span(times) if times else "/".join(dict.fromkeys(r["status"] for r in rs)))
            rows.append(row)
    return markdown_table(["mask", "mode", *impls], rows) + "\n"


def _ratio(values) -> str:
    return span(values, lambda v: f"{v:.2g}") + "x"


def _ratios(cells, runs: int, mask: str, mode: str, impl: str, base: str) -> list[float] | None:
    """``time(mask) / time(base)`` of one implementation, one value per run (None unless every run has both)."""
    a, b = cells.get((mask, mode, impl), []), cells.get((base, mode, impl), [])
    if len(_times(a)) != runs or len(_times(b)) != runs:
        return None
    return [x / y for x, y in zip(_times(a), _times(b), strict=True)]


def _fastest(cells, runs, masks, modes, impls) -> str:
    """Who is the fastest in every row of every run, and by how much over the next."""
    leaders, leads = set(), []
    for mask in masks:
        for mode in modes:
            per_run = [[(_times(cells.get((mask, mode, i), []))[k], i) for i in impls
                        if len(_times(cells.get((mask, mode, i), []))) == runs] for k in range(runs)]  # fmt: skip
            for timed in per_run:
                if len(timed) < 2:
                    return ""
                (t0, first), (t1, _) = sorted(timed)[:2]
                leaders.add(first)
                leads.append(t1 / t0)
    if len(leaders) != 1:
        return "no implementation is the fastest in every row of every run."
    where = "in every row" + (" of every run" if runs > 1 else "")
    return f"{where}, {leaders.pop()} is the fastest, {_ratio(leads)} ahead of the next."


def _mask_effects(cells, runs, masks, modes, impls) -> str:
    """Each implementation's masked rows against its full-attention rows: read only beyond MARGIN."""
    base = "full"
    if base not in masks:
        return ""
    read, within = [], []
    for impl in impls:
        found, lower = [], []
        for mask in [m for m in masks if m != base]:
            per_mode = {mode: _ratios(cells, runs, mask, mode, impl, base) for mode in modes}
            per_mode = {mode: v for mode, v in per_mode.items() if v}
            if per_mode and all(max(v) <= 1 / MARGIN or min(v) >= MARGIN for v in per_mode.values()):
                found.append(f"{mask} " + " and ".join(f"{_ratio(v)} ({mode})" for mode, v in per_mode.items()))
                lower += [max(v) <= 1 / MARGIN for v in per_mode.values()]
            else:
                within += [x for v in per_mode.values() for x in v]
        if found:
            verb = "falls" if all(lower) else "rises" if not any(lower) else "moves"
            read.append(f"{impl}'s time {verb} with the mask: " + "; ".join(found) + " of its full-attention time.")
    text = " ".join(read)
    if within:
        text += (
            f" The other masked rows stay within {MARGIN:g}x of their implementation's full-attention row "
            f"({_ratio(within)}{' over the runs' if runs > 1 else ''}): too close to read as an effect of the mask."
        )
    return text.strip()


def reading(folder, seq_len: int = 2048, num_heads: int = 8) -> str:
    """The prose that reads ``pivot``'s table, stating only what holds in every committed run."""
    runs = load_runs(folder)
    masks, modes, impls, cells = _cells(runs, seq_len, num_heads)
    dates = ", ".join(dict.fromkeys(str(run["date"]) for run, _ in runs))
    n = len(runs)
    runs_read = "the one committed run" if n == 1 else f"the {n} committed runs"
    head = f"Read from {runs_read} ({dates}; N = {seq_len}, {num_heads} heads):"
    parts = [head, _fastest(cells, n, masks, modes, impls), _mask_effects(cells, n, masks, modes, impls)]
    if n == 1:
        parts.append(
            "One run gives no spread across runs: `make sweep-repeat RUN=2` (and `RUN=3`) adds runs; the table "
            "then shows each cell's smallest and largest time, and this reading keeps only what holds in all of them."
        )
    return " ".join(p for p in parts if p) + "\n"


def summary(folder) -> str:
    """The first run's own summary.md (every cell), as ``make plots`` writes it."""
    return plot.summary_markdown(plot.load_results(str(Path(folder) / "results.jsonl")))


def lra_table2(folder) -> str:
    """The sweep's ``:lra_table2`` run as LRA's Table 2: steps/s (fwd+bwd) and MiB per (mask, implementation)."""
    records = [r for r in plot.load_results(str(Path(folder) / "results.jsonl")) if r["mode"] == "fwd_bwd"]
    lens = sorted({r["seq_len"] for r in records})
    cells = {(r["mask"], r["implementation"], r["seq_len"]): r for r in records}
    rows = []
    for mask in dict.fromkeys(r["mask"] for r in records):
        for impl in dict.fromkeys(r["implementation"] for r in records):
            rs = [cells.get((mask, impl, n)) for n in lens]
            if not any(rs):
                continue
            speed = ["-" if r is None else f"{r['steps_per_s']:.2f}" if r["status"] == "ok" else r["status"]
                     for r in rs]  # fmt: skip
            mem = [
                "-" if r is None or r["status"] != "ok" or r.get("memory_bytes") is None
                else f"{r['memory_bytes'] / 2**20:,.0f}"
                for r in rs
            ]  # fmt: skip
            rows.append([mask, impl, *speed, *mem])
    header = ["mask", "implementation", *(f"steps/s {size_label(x)}" for x in lens)]
    header += [f"MiB {size_label(x)}" for x in lens]
    r0 = records[0]
    return (
        f"fwd+bwd of one attention call, {r0['num_heads']} heads of {r0['head_dim']}, batch {r0['batch']}, "
        f"{r0['dtype']}; steps/s from the best of {r0['repeats']}, memory from XLA's analysis of the compiled "
        "program:\n\n" + markdown_table(header, rows) + "\n"
    )


_COLUMNS = [  # (field, header, width, format)
    ("implementation", "impl", 10, "s"),
    ("mask", "mask", 14, "s"),
    ("mode", "mode", 7, "s"),
    ("seq_len", "N", 6, "d"),
    ("num_heads", "heads", 5, "d"),
    ("min_ms", "min ms", 9, ".2f"),
    ("median_ms", "med ms", 9, ".2f"),
    ("useful_gflops", "GF/s", 7, ".1f"),
    ("compile_s", "compile", 7, ".2f"),
]


def format_table(records: list[dict]) -> str:
    """The sweep's console table: one line per record."""
    lines = [" ".join(f"{name:>{w}s}" for _, name, w, _ in _COLUMNS) + "  status"]
    for r in records:
        cells = [f"{r[c]:>{w}{fmt}}" if r.get(c) is not None else f"{'-':>{w}s}" for c, _, w, fmt in _COLUMNS]
        lines.append(" ".join(cells) + f"  {r['status']}")
    return "\n" + "\n".join(lines)
