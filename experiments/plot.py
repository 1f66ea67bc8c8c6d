"""Figures and a markdown summary from a sweep's results.jsonl alone (no rerun needed).

Command (what `make plots` runs):

    python -m experiments.plot --results results/sweep/results.jsonl --out results/sweep

Writes into ``--out``:
    time_vs_n.png     time per call vs N, log-log; one panel per (mode, mask), one line per
                      implementation, at the largest head count
    gflops_vs_n.png   useful GFLOP/s (allowed pairs only) vs N, same panels
    memory_vs_n.png   memory of the compiled program vs N (see each record's memory_source)
    time_vs_heads.png time vs head count at the largest N, one panel per mode
    summary.md        every cell as a markdown table (status, ms, GFLOP/s, steps/s, memory)
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from attnlab import train as train_lib
from experiments.figures import pyplot, save_figure

FLAGS = flags.FLAGS
if __name__ == "__main__":
    flags.DEFINE_string("results", "results/sweep/results.jsonl", "A sweep's results.jsonl.")
    flags.DEFINE_string("out", None, "Output folder (default: next to --results).")


class BadResultsLineError(ValueError):
    """A line of a results.jsonl that is not one JSON object; names the file and the line."""


def read_results(path: str) -> tuple[list[dict], list[tuple[int, str, str]]]:
    """-> (the records of a results.jsonl, its bad lines as (line number, text, why)): ``attnlab.train.scan_jsonl``."""
    return train_lib.scan_jsonl(path)


def describe_bad_lines(path: str, bad) -> str:
    """One line per bad line: file:line, why, and the start of its text."""
    return "\n".join(f"  {path}:{n}: {why}: {text[:80]!r}" for n, text, why in bad)


def load_results(path: str, *, skip_bad: bool = False) -> list[dict]:
    """The records of a results.jsonl (empty when the file does not exist yet).

    Raises:
        BadResultsLineError: a line is not a JSON object (unless ``skip_bad``: then it is left out
            with a warning on stderr naming the file and line).
    """
    records, bad = read_results(path)
    if bad and not skip_bad:
        raise BadResultsLineError(f"results: {len(bad)} bad line(s) in {path}:\n{describe_bad_lines(path, bad)}")
    if bad:
        print(f"warning: skipped {len(bad)} bad line(s):\n{describe_bad_lines(path, bad)}", file=sys.stderr)
    return records


def _machine(records) -> str:
    r = records[0]
    return f"{r.get('backend')} ({r.get('device_kind')}, {r.get('host_cpus')} host CPUs), jax {r.get('jax')}"


def _panels(records):
    modes = sorted({r["mode"] for r in records})
    mask_list = sorted({r["mask"] for r in records}, key=lambda m: (m != "full", m))
    return modes, mask_list


def _line_plot(records, metric, ylabel, path, title, *, logy=True):
    plt = pyplot()

    modes, mask_list = _panels(records)
    fig, axes = plt.subplots(
        len(modes),
        len(mask_list),
        figsize=(4.2 * len(mask_list), 3.4 * len(modes)),
        squeeze=False,
        sharex=True,
    )
    impls = sorted({r["implementation"] for r in records})
    heads = max(r["num_heads"] for r in records)
    for i, mode in enumerate(modes):
        for j, m in enumerate(mask_list):
            ax = axes[i][j]
            for c, impl in enumerate(impls):
                rs = sorted(
                    (
                        r
                        for r in records
                        if r["mode"] == mode
                        and r["mask"] == m
                        and r["implementation"] == impl
                        and r["num_heads"] == heads
                        and r.get(metric) is not None
                    ),
                    key=lambda r: r["seq_len"],
                )
                if rs:
                    ax.plot(
                        [r["seq_len"] for r in rs],
                        [r[metric] for r in rs],
                        marker="o",
                        color=f"C{c}",
                        label=impl,
                    )
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            ax.set_title(f"{mode}, mask {m}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(modes) - 1:
                ax.set_xlabel("sequence length N (T = S)")
            if j == 0:
                ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)
    r0 = records[0]
    fig.suptitle(
        f"{title}: {heads} heads, H={r0['head_dim']}, B={r0['batch']}, {r0['dtype']}\n{_machine(records)}",
        fontsize=10,
    )
    save_figure(fig, path, dpi=110)


def _heads_plot(records, path):
    plt = pyplot()

    modes, _ = _panels(records)
    n = max(r["seq_len"] for r in records)
    mask0 = "full" if any(r["mask"] == "full" for r in records) else records[0]["mask"]
    fig, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 3.4), squeeze=False)
    for i, mode in enumerate(modes):
        ax = axes[0][i]
        for c, impl in enumerate(sorted({r["implementation"] for r in records})):
            rs = sorted(
                (
                    r
                    for r in records
                    if r["mode"] == mode
                    and r["seq_len"] == n
                    and r["mask"] == mask0
                    and r["implementation"] == impl
                    and r.get("min_ms") is not None
                ),
                key=lambda r: r["num_heads"],
            )
            if rs:
                ax.plot(
                    [r["num_heads"] for r in rs],
                    [r["min_ms"] for r in rs],
                    marker="o",
                    color=f"C{c}",
                    label=impl,
                )
        ax.set(xlabel="number of heads", ylabel="time per call (ms, best)", title=f"{mode}, N={n}, mask {mask0}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_machine(records), fontsize=9)
    save_figure(fig, path, dpi=110)


def summary_markdown(records) -> str:
    lines = [
        f"# Sweep summary\n\nMachine: {_machine(records)}\n",
        "| impl | mask | mode | dtype | N | heads | status | min ms | median ms | GFLOP/s | steps/s | "
        "memory MiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    for r in records:
        mem = r.get("memory_bytes")
        lines.append(
            f"| {r['implementation']} | {r['mask']} | {r['mode']} | {r['dtype']} | {r['seq_len']} | "
            f"{r['num_heads']} | {r['status']} | {f(r.get('min_ms'), '.2f')} | {f(r.get('median_ms'), '.2f')} | "
            f"{f(r.get('useful_gflops'), '.1f')} | {f(r.get('steps_per_s'), '.2f')} | "
            f"{f(None if mem is None else mem / 2**20, '.1f')} | {f(r.get('compile_s'), '.2f')} |"
        )
    sources = sorted({r.get("memory_source") for r in records if r.get("memory_source")})
    lines.append(
        f"\nMemory: {', '.join(sources) or 'not recorded'} (XLA's analysis of the compiled program: "
        "arguments + outputs + temporaries)."
    )
    errors = [r for r in records if r["status"] in ("error", "oom") or (r["status"] != "ok" and r.get("error"))]
    if errors:
        lines.append("\nFailed cells:\n")
        lines += [
            f"- {r['implementation']} {r['mask']} {r['mode']} N={r['seq_len']}: {r['status']} "
            f"{(r.get('error') or '')[:200]}"
            for r in errors
        ]
    return "\n".join(lines) + "\n"


def make_plots(results_path: str, out: str | None = None) -> list[str]:
    """Draws every figure and summary.md from `results_path`; returns the files written."""
    out = out or os.path.dirname(results_path)
    os.makedirs(out, exist_ok=True)
    records = load_results(results_path, skip_bad=True)  # drawing reads only: skip, with a warning
    if not records:
        raise ValueError(f"results: no records in {results_path}")
    # a score other than the dot product is drawn as its own line: "blockwise (softcap:30)"
    records = [
        {**r, "implementation": f"{r['implementation']} ({r['score']})"} if r.get("score", "dot") != "dot" else r
        for r in records
    ]
    ok = [r for r in records if r["status"] in ("ok", "timeout")]
    files = []
    if ok:
        specs = [
            ("min_ms", "time per call (ms, best)", "time_vs_n.png", "Attention time", True),
            ("useful_gflops", "useful GFLOP/s", "gflops_vs_n.png", "Useful throughput", False),
            ("memory_bytes", "compiled memory (bytes)", "memory_vs_n.png", "Memory", True),
        ]
        for metric, ylabel, name, title, logy in specs:
            path = os.path.join(out, name)
            _line_plot(ok, metric, ylabel, path, title, logy=logy)
            files.append(path)
        path = os.path.join(out, "time_vs_heads.png")
        _heads_plot(ok, path)
        files.append(path)
    path = os.path.join(out, "summary.md")
    with open(path, "w") as f:
        f.write(summary_markdown(records))
    files.append(path)
    return files


def main(argv):
    del argv
    for path in make_plots(FLAGS.results, FLAGS.out):
        print("wrote", path)


if __name__ == "__main__":
    sys.exit(app.run(main))
