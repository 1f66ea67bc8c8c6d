"""Regenerates the results tables in README.md and docs/*.md from committed result files.

Commands::

    python -m experiments.docs --write   # rewrite every generated table (make docs)
    python -m experiments.docs --check   # exit 1 naming each table that differs (make docs-check)

A generated table sits between two markers in a markdown page::

    <!-- begin generated: sweep-n2048 -->
    | mask | mode | reference | xla | blockwise |
    ...
    <!-- end generated: sweep-n2048 -->

The name after ``generated:`` is a key of ``TABLES``. This module knows which committed results
folder each table reads and which function describes it, nothing of the results themselves: every
table is written by a function of the experiment or benchmark that made the results (its
``report``, or a table function beside it: ``experiments.sweep_report.pivot``,
``experiments.bench_tables.suite``, ...), called on the committed folder. ``FILES`` are whole
generated files, such as the sweep's ``summary.md``.

To publish a new experiment's table: commit its small results file under ``docs/results/<experiment>/``,
add one ``table(...)`` or ``report(...)`` entry here naming the function and the folder, and put the two
markers in its page; then ``make docs`` fills it in and ``tests/test_docs.py`` keeps it in step.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from absl import app, flags

from experiments import figures

ROOT = Path(__file__).resolve().parent.parent
SWEEP = "docs/results/sweep"
BENCH = "benchmarks/results/cpu-2core-shared"
H200 = "benchmarks/results/h200"
PAGES = ("README.md", "docs/*.md")
BENCH_RUN = "bench.json"  # make bench: every suite in one run, 2026-12-06
# make profile-window: two runs on the AVX-512 Xeon (2026-12-06), two on the AVX2 EPYC (2026-12-07)
PROFILE_RUNS = ("profile_window16k.json", "profile_window16k_run2.json")
PROFILE_RUNS_AVX2 = ("profile_window16k_avx2.json", "profile_window16k_avx2_run2.json")

MARKERS = re.compile(
    r"(?P<begin><!-- begin generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(?P<end><!-- end generated: (?P=name) -->)",
    re.DOTALL,
)


@dataclasses.dataclass(frozen=True)
class Table:
    """One generated table: ``function(root / folder, **options)``, ``function`` named ``"module:name"``.

    ``copy``: the function runs on a temporary copy of the folder (an experiment's report writes
    summary.md into the folder it reads, so it never runs on the committed one), its text stripped of
    blank lines at the ends; ``only``: copy just these files of the folder (one report, two tables on
    two pages). ``fenced``: the text goes in a code block. Only the text is kept, so the figures a
    report draws are closed unsaved (``experiments.figures.discarded``).
    """

    function: str
    folder: str = ""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    copy: bool = False
    only: tuple[str, ...] = ()
    fenced: bool = False

    def __call__(self, root: Path) -> str:
        with figures.discarded():  # only the text is kept: the figures a report draws would be thrown away
            return self._text(Path(root))

    def _text(self, root: Path) -> str:
        module, name = self.function.split(":")
        fn = getattr(importlib.import_module(module), name)
        if self.fenced:
            return "```\n" + fn(**self.options).strip("\n") + "\n```\n"
        if not self.copy:
            text = fn(Path(root) / self.folder, **self.options)
            return text if text.endswith("\n") else text + "\n"  # the end marker starts a line
        folder = Path(root) / self.folder
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / folder.name
            if self.only:
                copy.mkdir()
                for name in self.only:
                    shutil.copy(folder / name, copy / name)
            else:
                shutil.copytree(folder, copy)
            return fn(copy, **self.options).strip("\n") + "\n"


def table(function: str, folder: str = "", **options) -> Table:
    """A table written by ``function`` (``"module:name"``) from the committed ``folder``."""
    return Table(function, folder, options)


def report(module: str, folder: str, *, function: str = "report", only: tuple[str, ...] = (), **options) -> Table:
    """An experiment's report (``experiments.<module>.<function>``) of a copy of the committed ``folder``."""
    return Table(f"experiments.{module}:{function}", folder, options, copy=True, only=only)


# name -> a function of the repository root returning the markdown between the markers
TABLES: dict[str, Callable[[Path], str]] = {
    "sweep-run": table("experiments.sweep_report:run_lines", SWEEP),
    "sweep-n2048": table("experiments.sweep_report:pivot", SWEEP),
    "sweep-reading": table("experiments.sweep_report:reading", SWEEP),
    "lra-table2": table("experiments.sweep_report:lra_table2", "docs/results/lra"),
    "bench-full": table("experiments.bench_tables:suite", BENCH, file=BENCH_RUN, suite="full fwd"),
    "bench-full-bwd": table("experiments.bench_tables:suite", BENCH, file=BENCH_RUN, suite="full fwd+bwd"),
    "bench-window": table(
        "experiments.bench_tables:suite", BENCH, file=BENCH_RUN, suite="window ±128 fwd", per_token=True
    ),
    "bench-window-bwd": table(
        "experiments.bench_tables:suite", BENCH, file=BENCH_RUN, suite="window ±128 fwd+bwd", per_token=True
    ),
    "bench-graph": table("experiments.bench_tables:graph", BENCH, file=BENCH_RUN),
    # make bench on the AVX-512 Xeon (2026-12-06) and twice on the AVX2 EPYC (2026-12-07): attnlab's ratios
    "bench-hosts": table(
        "experiments.bench_tables:ratios_by_host",
        BENCH,
        files=(BENCH_RUN, "bench_avx2host.json", "bench_avx2host_run2.json"),
    ),
    # make bench's memory suite, rerun with the one forward+backward (2026-12-07)
    "bench-memory": table("experiments.bench_tables:memory", BENCH, file="bench_memory.json"),
    "ring-memory": table("experiments.bench_tables:ring_memory", BENCH),
    "compare-main": table("experiments.bench_tables:compare", BENCH, name="compare_160a7db.json"),
    "compare-plan": table("experiments.bench_tables:compare_trace", BENCH, name="compare_plan.json"),
    # the sparse kernel's repeated edges dropped (sorted edges), same process, twice (2026-12-07)
    "compare-edges": table("experiments.bench_tables:compare", BENCH, name="compare_63cb7e9_edges.json"),
    "compare-edges-run2": table("experiments.bench_tables:compare", BENCH, name="compare_63cb7e9_edges_run2.json"),
    # make compare-plan-ids, twice (2026-12-07): known document ids in any order and for cross-attention
    "compare-plan-ids": table("experiments.bench_tables:compare_trace", BENCH, name="compare_plan_ids.json"),
    "compare-plan-ids-run2": table("experiments.bench_tables:compare_trace", BENCH, name="compare_plan_ids_run2.json"),
    "compare-core": table("experiments.bench_tables:compare", BENCH, name="compare_a437441.json"),
    "compare-wide": table("experiments.bench_tables:compare", BENCH, name="compare_wide.json"),
    "compare-tilecore": table("experiments.bench_tables:compare", BENCH, name="compare_04a795f.json"),
    "compare-tilecore-run2": table("experiments.bench_tables:compare", BENCH, name="compare_04a795f_run2.json"),
    "compare-tilecore-avx2": table("experiments.bench_tables:compare", BENCH, name="compare_04a795f_avx2.json"),
    "compare-tilecore-avx2-run2": table(
        "experiments.bench_tables:compare", BENCH, name="compare_04a795f_avx2_run2.json"
    ),
    "compare-tilecore-avx2-same-process": table(
        "experiments.bench_tables:compare", BENCH, name="compare_04a795f_avx2_same_process.json"
    ),
    "compare-flat-kv": table("experiments.bench_tables:compare", BENCH, name="compare_2dd3877_flat_kv.json"),
    "compare-flat-kv-run2": table("experiments.bench_tables:compare", BENCH, name="compare_2dd3877_flat_kv_run2.json"),
    "compare-flat-kv-04a795f": table(
        "experiments.bench_tables:compare", BENCH, name="compare_04a795f_avx2_same_process_flat_kv.json"
    ),
    "compare-bisect-avx2": table(
        "experiments.bench_tables:compare_steps",
        BENCH,
        names=tuple(
            f"bisect_window16k_{step}.json"
            for step in ("04a795f_0938d59", "0938d59_f13c103", "f13c103_740154a", "740154a_84faa47")
        ),
    ),
    "compare-flex": table(
        "experiments.bench_tables:compare_bench",
        BENCH,
        names=("compare_flex_04a795f.json", "compare_flex_04a795f_run2.json"),
    ),  # fmt: skip
    "compare-graph": table("experiments.bench_tables:compare", BENCH, name="compare_04a795f_graph.json"),
    "compare-dense-before": table("experiments.bench_tables:compare", BENCH, name="compare_04a795f_dense_before.json"),
    "compare-dense": table("experiments.bench_tables:compare", BENCH, name="compare_04a795f_dense.json"),
    "compare-decode": table("experiments.bench_tables:compare", BENCH, name="compare_c443d7a_decode.json"),
    "compare-same-process": table("experiments.bench_tables:compare", BENCH, name="compare_04a795f_same_process.json"),
    "compare-same-process-run2": table(
        "experiments.bench_tables:compare", BENCH, name="compare_04a795f_same_process_run2.json"
    ),
    "compare-unroll": table("experiments.bench_tables:compare", BENCH, name="compare_ee32ec5_unroll.json"),
    "compare-unroll-run2": table("experiments.bench_tables:compare", BENCH, name="compare_ee32ec5_unroll_run2.json"),
    "adopt": table("experiments.bench_tables:adopt", BENCH, names=("adopt.json", "adopt_run2.json")),
    "profile-window": table("experiments.bench_tables:profile_ops", BENCH, names=PROFILE_RUNS),
    "dense-fusion": table(
        "experiments.dispatch_tables:dense_fusion",
        BENCH,
        names=(
            "dense_fusion.json",
            "dense_fusion_run2.json",
            "dense_fusion_between.json",
            "dense_fusion_between_run2.json",
        ),
    ),
    "dense-fusion-avx2": table("experiments.dispatch_tables:dense_fusion", BENCH, names=("dense_fusion_avx2.json",)),
    "dense-fusion-cross": table(
        "experiments.dispatch_tables:dense_fusion",
        BENCH,
        names=("dense_fusion_cross.json", "dense_fusion_cross_run2.json"),
    ),
    "dense-key-major": table(
        "experiments.dispatch_tables:dense_key_major",
        BENCH,
        names=("dense_key_major.json", "dense_key_major_run2.json"),
    ),
    "tune-cpu": table(
        "experiments.dispatch_tables:tune_cpu", BENCH, names=("tune_cpu_avx2.json", "tune_cpu_avx2_run2.json")
    ),
    "crossover": table(
        "experiments.dispatch_tables:crossover", BENCH, names=("crossover_ct.json", "crossover_ct_run2.json")
    ),
    "edges-crossover": table(
        "experiments.dispatch_tables:edges_crossover",
        BENCH,
        names=("edges_crossover/edges_crossover.json", "edges_crossover_run2/edges_crossover.json"),
    ),
    "edges-crossover-shapes": table(
        "experiments.dispatch_tables:edges_crossover",
        BENCH,
        names=tuple(
            f"edges_crossover_{shape}{run}/edges_crossover.json"
            for shape in ("4x16", "4x32", "2x128")
            for run in ("", "_run2")
        ),
    ),
    "compare-edge-scores": table(
        "experiments.bench_tables:compare_bench",
        BENCH,
        names=tuple(f"compare_edge_scores{run}/compare_scores-graph.json" for run in ("", "_run2", "_run3")),
        times=("sparse_s",),
    ),
    "compare-edge-dot": table(
        "experiments.bench_tables:compare", BENCH, name="compare_083f454_graph_same_process.json"
    ),
    "profile-window-costs": table("experiments.bench_tables:call_costs", BENCH, names=PROFILE_RUNS),
    "profile-window-avx2": table("experiments.bench_tables:profile_ops", BENCH, names=PROFILE_RUNS_AVX2),
    "profile-window-costs-avx2": table("experiments.bench_tables:call_costs", BENCH, names=PROFILE_RUNS_AVX2),
    "packed-docs": table("experiments.bench_tables:packed_docs", BENCH),
    "scores": table("experiments.bench_tables:scores", BENCH),
    "flex": table("experiments.bench_tables:flex", BENCH),
    "flex-avx2": table("experiments.bench_tables:flex", BENCH, name="flex_avx2cap.json"),
    "flex-avx2-host": table("experiments.bench_tables:flex", BENCH, name="flex_avx2host.json"),
    "traced-padding": table("experiments.bench_tables:traced_padding", BENCH),
    "ring-balance": table("experiments.bench_tables:ring_balance", BENCH),
    "inspect-memory": table("experiments.bench_tables:inspect_memory", BENCH),
    "gpu-h200-speed": table("experiments.gpu_tables:speed", H200),
    "gpu-h200-headline": table("experiments.gpu_tables:headline", H200),
    "gpu-h200-blocks": table("experiments.gpu_tables:blocks", H200),
    "gpu-h200-correctness": table("experiments.gpu_tables:correctness", H200),
    "inspect-demo": table("experiments.inspect_demo:table", "docs/results/inspect"),
    "molecules": report("molecules_report", "docs/results/molecules", only=("results.jsonl", "baselines.json")),
    "molecules-karate": report("molecules_report", "docs/results/molecules", only=("karate.json",)),
    "posenc": report("posenc", "docs/results/posenc"),
    "lm": table("experiments.lm_report:table", "docs/results/lm"),
    "lm-seeds": table("experiments.lm_report:per_seed", "docs/results/lm"),
    "lm-reading": table("experiments.lm_report:reading", "docs/results/lm"),
    "images": report("images_report", "docs/results/images"),
    "pos": report("pos_tagging_report", "docs/results/pos"),
    "pos-zh": report("pos_tagging_report", "docs/results/pos-zh"),
    "long-range": report("long_range_report", "docs/results/long_range"),
    "speech": report("speech_report", "docs/results/speech"),
    "speech-headline": table("experiments.speech_report:headline", "docs/results/speech"),
    "speech-pilots": table("experiments.speech_report:pilots", "docs/results/speech-pilots"),
    "speech-sentences": table("experiments.speech_report:headline", "docs/results/speech-sentences", decoding=False),
    "detr": report("detr_report", "docs/results/detr", function="docs_report", shown="docs/results/detr"),
    "detr-pilots": report("detr_report", "docs/results/detr-pilots"),
    "claims": report("claims_report", "docs/results/claims"),
    "claims-heads-by-seed": table("experiments.claims_report:heads_by_seed", "docs/results/claims"),
    "explain": Table("attnlab.dispatch:_demo", fenced=True),
}

# whole generated files: path -> function of the repository root returning the file's text
FILES: dict[str, Callable[[Path], str]] = {
    f"{SWEEP}/summary.md": table("experiments.sweep_report:summary", SWEEP),
}


def pages(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in PAGES for p in root.glob(pattern)})


def regenerate(text: str, root: Path = ROOT, *, page: str = "") -> str:
    """`text` with every generated block replaced by a fresh one; an unknown name is a ValueError."""

    def fill(m: re.Match) -> str:
        name = m["name"]
        if name not in TABLES:
            raise ValueError(f"{page}: generated block {name!r} is not in experiments.docs.TABLES: {sorted(TABLES)}")
        return m["begin"] + TABLES[name](root) + m["end"]

    return MARKERS.sub(fill, text)


def blocks(text: str) -> list[str]:
    """Names of the generated blocks in `text`, in order."""
    return [m["name"] for m in MARKERS.finditer(text)]


def _compare(root: Path, *, rewrite: bool) -> list[str]:
    """What differs from its regenerated form ('page: block' for tables, the path for whole files),
    each table and file generated once; ``rewrite`` writes the fresh forms in place."""
    out = []
    for path in pages(root):
        text = path.read_text()
        fresh = regenerate(text, root, page=str(path.relative_to(root)))
        old_blocks = {m["name"]: m["body"] for m in MARKERS.finditer(text)}
        new_blocks = {m["name"]: m["body"] for m in MARKERS.finditer(fresh)}
        out += [f"{path.relative_to(root)}: {n}" for n in old_blocks if old_blocks[n] != new_blocks[n]]
        if rewrite and fresh != text:
            path.write_text(fresh)
    for rel, make in FILES.items():
        path, fresh = root / rel, make(root)
        if not path.exists() or path.read_text() != fresh:
            out.append(rel)
            if rewrite:
                path.write_text(fresh)
    return out


def stale(root: Path = ROOT) -> list[str]:
    """What differs from its regenerated form: 'page: block' for tables, the path for whole files."""
    return _compare(root, rewrite=False)


def write(root: Path = ROOT) -> list[str]:
    """Regenerates every table and file in place; returns what changed."""
    return _compare(root, rewrite=True)


FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_bool("write", False, "Rewrite the generated tables and files in place.")
    flags.DEFINE_bool("check", False, "Exit 1 if a generated table or file differs from its results.")


def main(argv):
    del argv
    if FLAGS.write == FLAGS.check:
        raise app.UsageError("give exactly one of --write and --check")
    if FLAGS.write:
        changed = write()
        print("\n".join(f"rewrote {c}" for c in changed) or "every generated table was up to date")
        return 0
    differ = stale()
    if differ:
        print("out of date (run `make docs`):\n" + "\n".join(f"  {d}" for d in differ))
        return 1
    print(f"{sum(len(blocks(p.read_text())) for p in pages())} generated tables and {len(FILES)} files up to date")
    return 0


if __name__ == "__main__":
    define_flags()
    sys.exit(app.run(main))
