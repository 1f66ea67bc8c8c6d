"""Regenerates the results tables in README.md and docs/*.md from committed result files.

Commands::

    python -m experiments.docs --write   # rewrite every generated table (make docs)
    python -m experiments.docs --check   # exit 1 naming each table that differs (make docs-check)

A generated table sits between two markers in a markdown page::

    <!-- begin generated: sweep-n2048 -->
    | mask | mode | reference | xla | blockwise |
    ...
    <!-- end generated: sweep-n2048 -->

The name after ``generated:`` is a key of ``TABLES``: a function of the repository root that reads the
committed results (``docs/results/<experiment>/`` or ``benchmarks/results/``) and returns the markdown,
through the experiment's own summary function where it has one (``experiments.plot.summary_markdown``
for the sweep). ``FILES`` are whole generated files, such as the sweep's ``summary.md``.

To publish a new experiment's table: commit its small results file under ``docs/results/<experiment>/``,
add a function here that calls the experiment's report on it, and put the two markers in its page; then
``make docs`` fills it in and ``tests/test_docs.py`` keeps it in step.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from absl import app, flags

from experiments.tables import markdown_table, ms

ROOT = Path(__file__).resolve().parent.parent
SWEEP = Path("docs/results/sweep")
BENCH = Path("benchmarks/results/cpu-2core-shared")
PAGES = ("README.md", "docs/*.md")

MARKERS = re.compile(
    r"(?P<begin><!-- begin generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(?P<end><!-- end generated: (?P=name) -->)",
    re.DOTALL,
)


def _table(header: list[str], rows: list[list[str]]) -> str:
    return markdown_table(header, rows) + "\n"


def _jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- the sweep (make sweep): docs/results/sweep/ ------------------------------------------------------


def sweep_records(root: Path) -> list[dict]:
    from experiments import plot

    return plot.load_results(str(root / SWEEP / "results.jsonl"))


def sweep_run(root: Path) -> str:
    """One line on the committed run: command, cells, wall time, machine (from run.json + the JSONL)."""
    run = json.loads((root / SWEEP / "run.json").read_text())
    records = sweep_records(root)
    ok = sum(r["status"] == "ok" for r in records)
    r0 = records[0]
    minutes, seconds = divmod(round(run["wall_s"]), 60)
    return (
        f"`{run['command']}` ({r0['variant']} variant, {len(records)} cells, {ok} ok) took "
        f"{minutes} min {seconds:02d} s of wall time ({run['cpu_s']:.0f} s of CPU) on {run['machine']}, "
        f"{run['date']}, load average {run['load']}; jax {r0['jax']}, backend {r0['backend']}, "
        f"{r0['host_cpus']} host CPUs.\n"
    )


def sweep_pivot(root: Path, seq_len: int = 2048, num_heads: int = 8) -> str:
    """Best time (ms) per mask x mode (rows) and implementation (columns) at one N and head count."""
    records = [
        r
        for r in sweep_records(root)
        if r["seq_len"] == seq_len and r["num_heads"] == num_heads and r["dtype"] == "float32"
    ]
    impls = list(dict.fromkeys(r["implementation"] for r in records))
    cells = {(r["mask"], r["mode"], r["implementation"]): r for r in records}
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in records):
        for mask in dict.fromkeys(r["mask"] for r in records):
            row = [mask, mode]
            for impl in impls:
                r = cells.get((mask, mode, impl))
                row.append("" if r is None else ms(r["min_ms"]) if r["status"] == "ok" else r["status"])
            rows.append(row)
    return _table(["mask", "mode", *impls], rows)


def sweep_summary(root: Path) -> str:
    """The sweep's own summary.md (every cell), as `make plots` writes it."""
    from experiments import plot

    return plot.summary_markdown(sweep_records(root))


def lra_table2(root: Path, folder: Path = Path("docs/results/lra")) -> str:
    """The sweep's ``:lra_table2`` run as LRA's Table 2: steps/s (fwd+bwd) and MiB per (mask, implementation)."""
    from experiments import plot

    records = [r for r in plot.load_results(str(root / folder / "results.jsonl")) if r["mode"] == "fwd_bwd"]
    lens = sorted({r["seq_len"] for r in records})
    cells = {(r["mask"], r["implementation"], r["seq_len"]): r for r in records}
    rows = []
    for mask in dict.fromkeys(r["mask"] for r in records):
        for impl in dict.fromkeys(r["implementation"] for r in records):
            rs = [cells.get((mask, impl, n)) for n in lens]
            if not any(rs):
                continue
            speed = [
                ("-" if r is None else f"{r['steps_per_s']:.2f}" if r["status"] == "ok" else r["status"]) for r in rs
            ]
            mem = [
                "-"
                if r is None or r["status"] != "ok" or r.get("memory_bytes") is None
                else f"{r['memory_bytes'] / 2**20:,.0f}"
                for r in rs
            ]
            rows.append([mask, impl, *speed, *mem])
    n = lambda x: f"{x // 1024}K" if x % 1024 == 0 else str(x)  # noqa: E731
    header = ["mask", "implementation", *(f"steps/s {n(x)}" for x in lens), *(f"MiB {n(x)}" for x in lens)]
    r0 = records[0]
    return (
        f"fwd+bwd of one attention call, {r0['num_heads']} heads of {r0['head_dim']}, batch {r0['batch']}, "
        f"{r0['dtype']}; steps/s from the best of {r0['repeats']}, memory from XLA's analysis of the compiled "
        "program:\n\n" + _table(header, rows)
    )


# ---- experiments with a report(folder) of their own -------------------------------------------------


def experiment_report(module: str, folder: Path, only: tuple[str, ...] = ()) -> str:
    """`experiments.<module>.report(folder)` on a copy of the committed results: the report also draws
    its figures and writes summary.md into the folder it reads, so it never runs in place.

    ``only``: copy just these files of the folder (one report function, two tables on two pages)."""
    report = importlib.import_module(f"experiments.{module}").report
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / folder.name
        if only:
            copy.mkdir()
            for name in only:
                shutil.copy(folder / name, copy / name)
        else:
            shutil.copytree(folder, copy)
        return report(copy).strip("\n") + "\n"


def _fold_dev_curve(text: str, folder: str) -> str:
    """A DETR report without its long dev curve (every evaluation of every run), which stays in the
    folder's summary.md: the page links it."""
    head, sep, _ = text.partition("Dev curve (held-out dev canvases, evaluated during training):")
    if not sep:
        return text
    return head.rstrip("\n") + f"\n\nThe dev curve of every run (each evaluation): `{folder}/summary.md`.\n"


# ---- make bench: benchmarks/results/cpu-2core-shared/*.json -------------------------------------------


def _bench(root: Path, name: str) -> list[dict]:
    return json.loads((root / BENCH / name).read_text())["records"]


_HOST_DEVICES = "session4-host-devices.json"  # all suites but window_bwd, 2026-11-30
_IMPL_NAMES = {"attnlab.blockwise": "attnlab (1 device)", "attnlab.blockwise/2dev": "attnlab (2 host devices)"}


def bench_suite(root: Path, file: str, suite: str, per_token: bool = False) -> str:
    """One suite of a bench JSON: a row per N; each implementation's ms, then attnlab's ratios to peers.

    A ratio is peer time / attnlab time (above 1: attnlab faster), as bench_attention records it.
    """
    records = [r for r in _bench(root, file) if r["suite"] == suite]
    impls = list(dict.fromkeys(r["impl"] for r in records))
    ours = [i for i in impls if i.startswith("attnlab")]
    by = {(r["impl"], r["N"]): r for r in records}
    ratios = sorted({k for r in records for k in r if k.startswith("x_vs_")})
    header = ["N"]
    for impl in impls:
        header.append(f"{_IMPL_NAMES.get(impl, impl)} ms" + (" (µs / token)" if per_token and impl in ours else ""))
    header += [f"{_IMPL_NAMES[ours[0]]} GFLOP/s"] if not per_token else []
    header += [f"{_IMPL_NAMES[i]} vs {k[len('x_vs_') :]}" for k in ratios for i in ours]
    rows = []
    for n in dict.fromkeys(r["N"] for r in records):
        row = [f"{n // 1024}K"]
        for impl in impls:
            r = by.get((impl, n))
            cell = "" if r is None else ms(r["ms"])
            if r is not None and per_token and impl in ours:
                cell += f" ({r['us_per_token']:.1f})"
            row.append(cell)
        if not per_token:
            row.append(f"{by[(ours[0], n)]['gflops']:.0f}")
        for k in ratios:
            for impl in ours:
                r = by.get((impl, n), {})
                row.append(f"{r[k]:.2f}x" if k in r else "")
        rows.append(row)
    return _table(header, rows)


def bench_graph(root: Path, file: str = _HOST_DEVICES) -> str:
    records = [r for r in _bench(root, file) if r["suite"].startswith("graph")]
    rows = []
    for r in records:
        ratio = next((f"{v:.2f}x vs {k[len('x_vs_') :]}" for k, v in r.items() if k.startswith("x_vs_")), "")
        temp = f"{r['temp_mb']:.0f}" if "temp_mb" in r else ""
        rows.append([r["impl"], f"{r['ms']:,.0f}", temp, ratio])
    return f"{records[0]['suite']}:\n\n" + _table(["implementation", "ms", "temp MB", "ratio"], rows)


def bench_memory(root: Path, file: str = _HOST_DEVICES) -> str:
    records = [r for r in _bench(root, file) if r["suite"].startswith("memory")]
    rows = [
        [f"{r['N'] // 1024}K", f"{r['temp_mb']:.0f}", f"{r['args_out_mb']:.0f}", f"{r['dense_logits_mb']:,.0f}"]
        for r in records
    ]
    header = ["N", "blockwise temp MB", "arguments + outputs MB", "one dense fp32 [N, T, S] logits array MB"]
    return _table(header, rows)


def ring_memory(root: Path) -> str:
    """make ring-memory: per-device MiB of ring (sp=8) and one-device blockwise, and the largest N in budget."""
    records = _jsonl(root / BENCH / "ring_memory.jsonl")
    summary = json.loads((root / BENCH / "ring_memory_summary.json").read_text())
    mib = {(r["method"], r["seq_len"]): r["per_device_bytes"] / 2**20 for r in records}
    devices = summary["devices"]
    lens = sorted({n for (m, n) in mib if m == "ring" and ("blockwise", n) in mib})
    rows = []
    for n in lens:
        ring, one = mib[("ring", n)], mib[("blockwise", n)]
        rows.append([f"{n // 1024}K", f"{ring:.1f}", f"{one:.1f}", f"{one / ring:.1f}x"])
    table = _table(["N", f"ring, per device (sp={devices}), MiB", "blockwise, 1 device, MiB", "ratio"], rows)
    b, r = summary["largest_n_blockwise"], summary["largest_n_ring"]
    return table + (
        f"\nLargest N in {summary['budget_gib']:g} GiB per device: **blockwise on one device {b:,}; "
        f"ring on {devices} devices {r:,} ({r / b:.1f}x)**.\n"
    )


def traced_padding(root: Path) -> str:
    """``make traced-padding``: attention with traced vs concrete padding lengths, one row per labelled run."""
    rows = []
    for r in json.loads((root / BENCH / "traced_padding.json").read_text()):
        t, ms, x = r["tiles"]["traced"], r["best_ms"], r["traced_over_concrete"]
        rows.append(
            [r["label"], f"{t['block_q']} × {t['block_k']}", f"{100 * t['visited']:.0f}%",
             f"{ms['fwd/concrete']:.1f} ms", f"{ms['fwd/traced']:.1f} ms", f"{x['fwd']:.2f}x",
             f"{ms['fwd+bwd/concrete']:.1f} ms", f"{ms['fwd+bwd/traced']:.1f} ms", f"{x['fwd+bwd']:.2f}x"]
        )  # fmt: skip
    header = ["code", "tiles (traced)", "visited", "fwd concrete", "fwd traced", "ratio", "fwd+bwd concrete"]
    return _table([*header, "fwd+bwd traced", "ratio"], rows)


def ring_balance(root: Path) -> str:
    """``make ring-balance``: tiles per device of the contiguous and zig-zag ring layouts, and the step times."""
    rows = []
    for r in json.loads((root / BENCH / "ring_balance.json").read_text())["rows"]:
        tiles = r["tiles_per_device"]
        per = f"{tiles[0]} each" if len(set(tiles)) == 1 else " ".join(map(str, tiles))
        step = f"{1e3 * r['step_s_median']:.0f} ms ({1e3 * r['step_s_best']:.0f})" if "step_s_median" in r else "-"
        compile_s = f"{r['compile_s']:.1f} s" if "compile_s" in r else "-"
        rows.append([r["mask"], r["layout"], per, f"{r['max_over_mean']:.2f}",
                     f"{r['critical_path_tiles']} ({r['ideal_tiles']:.0f})", step, compile_s])  # fmt: skip
    header = ["mask", "layout", "tiles per device (d = 0..7)", "max/mean", "lockstep critical path (ideal)"]
    return _table([*header, "fwd+bwd median (best)", "compile"], rows)


def inspect_memory(root: Path) -> str:
    """``make inspect-memory``: one-row capture of a 32K-token encoder layer vs its forward (XLA buffers, peak RSS)."""
    data = json.loads((root / BENCH / "inspect_memory.json").read_text())
    what = {
        "forward": "the forward alone",
        "capture_row": "capture, 1 row: weights + lse",
        "capture_row_all": "capture, 1 row + q, k, v, per-head outputs",
    }
    rows = []
    for name, label in what.items():
        c, r = data["compiled"][name], data.get("run", {}).get(name)
        rss = "-" if r is None else f"{r['peak_rss_bytes'] / 2**20:.0f} ({r['extra_rss_mib']:+.1f})"
        rows.append([label, f"{c['total_bytes'] / 2**20:.1f}", f"{c['extra_mib']:+.1f}", rss])
    header = [f"T = {data['seq_len']:,}, {data['backend']}", "XLA buffers, MiB", "extra, MiB", "peak RSS, MiB (extra)"]
    return _table(header, rows)


def compare_table(root: Path, name: str) -> str:
    """``make compare-main`` (``benchmarks.compare_commits``): the same attention calls on two commits, best ms
    and the ratio, from the committed ``name`` JSON."""
    data = json.loads((root / BENCH / name).read_text())
    rows = [[r["cell"], f"{r['base_ms']:.1f}", f"{r['head_ms']:.1f}", f"{r['ratio']:.2f}"] for r in data["rows"]]
    return _table(["cell", f"{data['meta']['base']} ms", "after ms", "after / before"], rows)


def packed_docs(root: Path) -> str:
    """``make packed-docs``: packed documents with traced vs concrete ids vs dense XLA, and the scaling rows."""
    data = json.loads((root / BENCH / "packed.json").read_text())
    rows = []
    for r in data["records"]:
        if r["suite"] == "compare":
            rows.append(
                [r["mask"], f"{r['docs']} in {r['T']:,}", f"{r['traced_s']:.2f}", f"{r['concrete_s']:.2f}",
                 f"{r['traced_over_concrete']:.2f}x", f"{r['xla_s']:.1f}", f"{r['xla_over_traced']:.1f}x"]
            )  # fmt: skip
    header = ["mask", "documents", "traced ids s", "concrete ids s", "traced / concrete", "dense XLA s"]
    table = _table([*header, "XLA / traced"], rows)
    scaling = [r for r in data["records"] if r["suite"] == "scaling"]
    table += "\n" + _table(
        ["documents in one row", "sum of len²", "fwd+bwd s (traced ids)"],
        [[str(r["docs"]), f"{r['sum_len_sq']:,}", f"{r['traced_s']:.2f}"] for r in scaling],
    )
    retrace = next(r for r in data["records"] if r["suite"] == "retrace")
    simd = ", ".join(f for f in data["host"]["cpu_simd_flags"] if f in ("avx2", "avx512f", "amx_tile"))
    return table + (
        f"\nTraces over {retrace['batches']} batches of new ids: **{retrace['traces']}**. Host: "
        f"{data['host']['cpu_model']}, {data['host']['host_cpus']} CPUs ({simd}); jax {data['jax']}, {data['date']}.\n"
    )


def scores_table(root: Path) -> str:
    """``make scores``: per-element scores (SoftCap, an ALiBi ScoreMod) and additive attention, blockwise."""
    data = json.loads((root / BENCH / "scores.json").read_text())
    rows = [
        [r["score"], r["mask"], r["mode"], f"{r['T']:,}", f"{1e3 * r['dot_s']:.0f}", f"{1e3 * r['score_s']:.0f}",
         f"{r['score_over_dot']:.2f}x"]
        for r in data["records"]
    ]  # fmt: skip
    simd = ", ".join(f for f in data["host"]["cpu_simd_flags"] if f in ("avx2", "avx512f", "amx_tile"))
    table = _table(["score", "mask", "mode", "T", "dot ms", "score ms", "score / dot"], rows)
    a = data["additive"]
    add = _table(
        ["T", "heads x H", "additive s", "additive GFLOP/s", "dot s", "dot GFLOP/s", "tiled temp GiB",
         f"tiled temp GiB at {2 * a['T']:,}", "dense reference temp GiB"],
        [[f"{a['T']:,}", f"{a['heads']} x {a['H']}", f"{a['additive_s']:.1f}", f"{a['additive_gflops']:.1f}",
          f"{a['dot_s']:.1f}", f"{a['dot_gflops']:.1f}", f"{a['tiled_temp_gib']:.3f}", f"{a['tiled_temp_gib_2T']:.3f}",
          f"{a['dense_temp_gib']:,.0f}"]],
    )  # fmt: skip
    host = f"Host: {data['host']['cpu_model']} ({simd}); jax {data['jax']}, {data['date']}."
    return table + "\nAdditive (tanh) attention, fwd+bwd, no mask:\n\n" + add + f"\n{host}\n"


def flex_table(root: Path, name: str = "flex.json") -> str:
    """``make flex``: the blockwise kernel against torch.compile(flex_attention) on the CPU, forward."""
    data = json.loads((root / BENCH / name).read_text())
    dev = next((r["host_devices"] for r in data["records"] if "attnlab_devices_s" in r), None)
    rows = []
    for r in data["records"]:
        name = f"document ({r['docs']} docs, ids traced)" if r["mask"] == "document" else f"window ±{r['window']}"
        row = [name, f"{r['T']:,}", f"{1e3 * r['attnlab_s']:.0f}", f"{1e3 * r['flex_s']:.0f}"]
        row.append(f"{r['flex_over_attnlab']:.2f}x")
        if dev:
            row += [f"{1e3 * r['attnlab_devices_s']:.0f}", f"{r['flex_over_attnlab_devices']:.2f}x"]
        rows.append(row + [f"{r['flex_block_mask_s']:.1f}", f"{r['max_abs_diff']:.0e}"])
    simd = ", ".join(f for f in data["host"]["cpu_simd_flags"] if f in ("avx2", "avx512f", "amx_tile"))
    header = ["mask", "T", "attnlab ms", "flex ms", "flex / attnlab"]
    if dev:
        header += [f"attnlab ms, heads on {dev} host devices", "flex / that"]
    table = _table(header + ["flex block mask s", "max abs diff"], rows)
    return table + (
        f"\nHost: {data['host']['cpu_model']}, {data['host']['host_cpus']} CPUs ({simd}); jax {data['jax']}, "
        f"torch {data['torch']} ({data['torch_threads']} threads), {data['date']}"
        + (f"; generated code capped at {data['cap_isa'].upper()} (`--cap_isa`).\n" if data.get("cap_isa") else ".\n")
    )


# ---- the GPU check on an H200 (benchmarks/gpu_check.py): benchmarks/results/h200/ ------------------------

H200 = Path("benchmarks/results/h200")
_CASES = {  # (mask, score) of gpu_check's speed rows -> the row label
    ("full", "dot"): "full",
    ("causal", "dot"): "causal",
    ("window(128,0)", "dot"): "causal window 128",
    ("window(128,128)", "dot"): "window ±128",
    ("document16", "dot"): "16 documents",
    ("document16_traced", "dot"): "16 documents, ids traced",
    ("full", "softcap:30"): "full, SoftCap(30)",
    ("full", "alibi_mod"): "full, ALiBi ScoreMod",
    ("full", "additive"): "full, additive (tanh)",
}


def _h200(root: Path, name: str) -> dict:
    return json.loads((root / H200 / name).read_text())


def _h200_speed_rows(root: Path) -> list[dict]:
    """The speed rows the current code reproduces: H = 64 from run 1 ((64, 64) tiles, still the default there),
    H = 128 from run 2 (its (128, 64) tiles are the bf16 default now), but additive through pallas at H = 128
    from run 1 (the pair form keeps (64, 64) tiles)."""
    run1 = [dict(r, run=1) for r in _h200(root, "run1_gpu_check.json")["speed"]]
    run2 = [dict(r, run=2) for r in _h200(root, "run2_speed_H128.json")["speed"]]

    def keep(r):
        pallas_additive = r["implementation"] == "pallas" and r["score"] == "additive"
        if r["H"] == 64:
            return r["run"] == 1
        return r["run"] == (1 if pallas_additive else 2)

    return [r for r in run1 + run2 if keep(r) and r["status"] == "ok"]


def gpu_speed(root: Path) -> str:
    """bf16 speed per implementation and case on an H200: ms and the ratio to cuDNN (cuDNN ms / ms)."""
    rows = _h200_speed_rows(root)
    cols = sorted({(r["H"], r["T"]) for r in rows})
    cells = {(r["implementation"], r["mask"], r["score"], r["direction"], r["H"], r["T"]): r for r in rows}
    order = ("cudnn", "pallas", "xla", "blockwise")
    out = []
    for direction in ("fwd", "fwd+bwd"):
        for impl in order:
            for (mask, score), label in _CASES.items():
                rs = [cells.get((impl, mask, score, direction, H, T)) for H, T in cols]
                if not any(rs):
                    continue
                shown = []
                for r in rs:
                    if r is None:
                        shown.append("")
                    elif impl == "cudnn":
                        shown.append(ms(r["ms"]))
                    else:
                        shown.append(f"{ms(r['ms'])} ({r['vs_cudnn']:.2f}x)")
                out.append([direction, impl, label, *shown])
    header = ["direction", "implementation", "case", *(f"H={H}, T={T // 1024}K ms (vs cuDNN)" for H, T in cols)]
    mem = {r["implementation"]: r for r in _h200(root, "run1_gpu_check.json")["memory"] if r["status"] == "ok"}
    m = mem["pallas"]
    return _table(header, out) + (
        "\nH=64 columns and pallas' additive rows at H=128: run 1; the other H=128 cells: run 2 (ratios are "
        "against cuDNN in the same run).\n"
        f"Compiled fwd+bwd memory at T={m['T'] // 1024}K, H={m['H']} (arguments, outputs, temporaries): "
        + ", ".join(f"{k} {v['total_mib']:.0f} MiB" for k, v in mem.items())
        + ".\n"
    )


def gpu_headline(root: Path) -> str:
    """README: pallas against cuDNN at H = 128, T = 16K (bf16, one H200 run): ms, and cuDNN ms / pallas ms."""
    rows = [r for r in _h200_speed_rows(root) if r["H"] == 128 and r["T"] == 16384]
    cells = {(r["implementation"], r["mask"], r["score"], r["direction"]): r for r in rows}
    picks = [  # (pallas case, the cuDNN case it is compared with)
        (("full", "dot"), ("full", "dot")),
        (("causal", "dot"), ("causal", "dot")),
        (("window(128,128)", "dot"), ("window(128,0)", "dot")),
        (("document16", "dot"), ("full", "dot")),
        (("document16_traced", "dot"), ("full", "dot")),
        (("full", "softcap:30"), ("full", "dot")),
    ]
    out = []
    for mine, theirs in picks:
        row = [_CASES[mine], _CASES[theirs]]
        for direction in ("fwd", "fwd+bwd"):
            p, c = cells[("pallas", *mine, direction)], cells[("cudnn", *theirs, direction)]
            row += [ms(c["ms"]), f"{ms(p['ms'])} ({p['vs_cudnn']:.2f}x)"]
        out.append(row)
    header = ["pallas case", "cuDNN case", "cuDNN fwd ms", "pallas fwd ms (vs cuDNN)", "cuDNN fwd+bwd ms",
              "pallas fwd+bwd ms (vs cuDNN)"]  # fmt: skip
    return _table(header, out)


def gpu_blocks(root: Path) -> str:
    """Run 1's blocks section: pallas per (block_q, block_k) at T = 16K, each against cuDNN in the same run."""
    rows = [r for r in _h200(root, "run1_gpu_check.json")["blocks"] if r["status"] == "ok"]
    shapes = list(dict.fromkeys((r["block_q"], r["block_k"]) for r in rows if r["implementation"] == "pallas"))
    out = []
    for key in dict.fromkeys((r["mask"], r["H"], r["direction"]) for r in rows):
        mine = {(r["block_q"], r["block_k"]): r for r in rows if (r["mask"], r["H"], r["direction"]) == key}
        ref = next(r for r in rows if (r["mask"], r["H"], r["direction"]) == key and r["implementation"] == "cudnn")
        cells = [f"{ms(mine[b]['ms'])} ({mine[b]['vs_cudnn']:.2f}x)" if b in mine else "not run" for b in shapes]
        out.append([key[0], str(key[1]), key[2], ms(ref["ms"]), *cells])
    T = rows[0]["T"]
    return _table(["mask", "H", "direction", "cuDNN ms", *(f"({q}, {k})" for q, k in shapes)], out) + (
        f"\nbf16, T={T // 1024}K, 16 heads; ms (cuDNN ms / ms); cells past the section's time budget: not run.\n"
    )


def gpu_correctness(root: Path) -> str:
    """Run 2's correctness cells (H = 64 and 128): per implementation and dtype, what ran and its largest errors."""
    rows = []
    for H in (64, 128):
        for dtype in ("bfloat16", "float32"):
            rows += _h200(root, f"run2_correctness_H{H}_{dtype}.json")["correctness"]
    out = []
    for impl in dict.fromkeys(r["implementation"] for r in rows):
        for dtype in ("bfloat16", "float32"):
            mine = [r for r in rows if r["implementation"] == impl and r["dtype"] == dtype]
            ran = [r for r in mine if r["status"] in ("ok", "FAIL")]
            ok = [r for r in ran if r["status"] == "ok"]
            err = [r for r in mine if r["status"] == "error"]
            if not ran and not err:
                why = {r.get("reason", "") for r in mine if r["status"] == "unsupported"}
                out.append([impl, dtype, "0", "", "", "", "", "unsupported: " + "; ".join(sorted(why))[:80]])
                continue
            first = sorted(r["first_call_s"] for r in ran)
            cases = sorted({f"{r['mask']}" + ("" if r["score"] == "dot" else f" {r['score']}") for r in ran})
            note = f"H={sorted({r['H'] for r in ran})}; " if ran else ""
            if err:
                reasons = sorted({r["reason"].split(", context")[0] for r in err})
                note += f"{len(err)} errors: " + "; ".join(reasons)
            out.append([
                impl, dtype, f"{len(ok)}/{len(ran)}",
                f"{max((r['out_rel_err'] for r in ran), default=0):.1e}",
                f"{max((r['grad_rel_err'] for r in ran), default=0):.1e}",
                f"{first[len(first) // 2]:.1f}" if first else "",
                ", ".join(cases), note,
            ])  # fmt: skip
    header = ["implementation", "dtype", "ok / run", "max out err", "max grad err", "median first call s", "cases",
              "notes"]  # fmt: skip
    return _table(header, out)


def speech_headline(root: Path, folder: Path = Path("docs/results/speech"), *, decoding: bool = True) -> str:
    """README's speech table: CER by encoder window (greedy and beam, seen and held-out voice), decoding speed."""
    speech = importlib.import_module("experiments.speech")
    common = importlib.import_module("experiments.common")
    results = _jsonl(root / folder / "results.jsonl")
    rows = []
    for w in sorted({r["window"] for r in results}, key=speech.window_order):
        stats = {k: common.summarize(results, ("window",), k)[(w,)]  # (mean, population sd, seeds)
                 for k in ("test_greedy_cer", "test_beam4_cer", "test_greedy_wer", "new_voice_greedy_cer",
                           "new_voice_beam4_cer", "train_time_s")}  # fmt: skip
        seeds = stats["train_time_s"][2]
        cells = [common.mean_std(v, scale=100) if seeds > 1 else f"{100 * v[0]:.1f}" for v in stats.values()]
        ms = "" if w == "full" else f" ({4 * int(w) * 10} ms)"  # 4x subsampled 10 ms frames
        rows.append([speech.window_label(w) + ms, *cells[:-1], str(seeds), f"{stats['train_time_s'][0]:.0f}"])
    header = ["encoder self-attention", "CER % greedy", "CER % beam 4", "WER % greedy", "new voice CER % greedy"]
    text = _table([*header, "new voice CER % beam 4", "seeds", "train s"], rows)
    if not decoding:
        return text
    dec = {d["method"]: d for d in _jsonl(root / folder / "decoding.jsonl")}
    c, r = dec["cached"], dec["recompute"]
    return text + (
        f"\nGreedy decoding of {c['tokens']} tokens (batch {c['batch']}): KV cache {c['seconds']:.2f} s, recomputing "
        f"the prefix {r['seconds']:.2f} s: **{r['seconds'] / c['seconds']:.1f}x** (same tokens).\n"
    )


def speech_pilots(root: Path, folder: Path = Path("docs/results/speech-pilots")) -> str:
    """The speech pilots, full attention (docs/results/speech-pilots/*/results.jsonl; commands in its run.json)."""
    rows = []
    for name, what in (
        ("cmvn", "CMVN, random batches"),
        ("cmvn_ctc", "CMVN + 0.3 CTC, random batches"),
        ("default_1000steps", "CMVN + 0.3 CTC, similar-length batches"),
    ):
        r = _jsonl(root / folder / name / "results.jsonl")[0]
        steps = json.loads((root / folder / name / "config.json").read_text())["train"]["num_steps"]
        cells = [f"{100 * r[k]:.1f}" for k in ("test_greedy_cer", "test_beam4_cer", "new_voice_greedy_cer")]
        rows.append([what, str(steps), *cells, f"{r['final_train_loss']:.3f}", f"{r['train_time_s']:.0f}"])
    header = ["full attention", "steps", "CER % greedy", "CER % beam 4", "new voice CER % greedy"]
    return _table([*header, "final train loss", "train s"], rows)


def claims_heads_by_seed(root: Path, folder: Path = Path("docs/results/claims")) -> str:
    """The shift task's per-head figures per model and seed (docs/results/claims/results.jsonl).

    The second layer's most concentrated head (its top offset, mass there, entropy, offset-only R² and the
    points its ablation costs), the first layer's entropy range and largest mass on one offset, and how
    many heads put at least half their mass on one offset, with those heads' R² range."""
    rows = []
    for r in _jsonl(root / folder / "results.jsonl"):
        if r["task"] != "shift" or r["score"] != "dot":
            continue
        heads = r["heads_analysis"]
        first = [h for h in heads if h["layer"] == 0]
        best = max((h for h in heads if h["layer"] == 1), key=lambda h: h["top_offset_mass"])
        sharp = [h for h in heads if h["top_offset_mass"] >= 0.5]
        r2 = [h["r2_offset"] for h in sharp]
        rows.append(
            [str(r["heads"]), str(r["seed"]), f"{100 * r['accuracy']:.1f}", f"{best['top_offset']:+d}",
             f"{best['top_offset_mass']:.2f}", f"{best['entropy']:.2f}", f"{best['r2_offset']:.2f}",
             f"{100 * (r['accuracy'] - best['ablated_accuracy']):.0f}",
             f"{min(h['entropy'] for h in first):.2f}-{max(h['entropy'] for h in first):.2f}",
             f"{max(h['top_offset_mass'] for h in first):.2f}", f"{len(sharp)} of {len(heads)}",
             f"{min(r2):.2f}-{max(r2):.2f}" if r2 else "-"]
        )  # fmt: skip
    rows.sort(key=lambda row: (int(row[0]), int(row[1])))
    header = ["heads", "seed", "acc %", "layer 2 best head: offset", "mass", "entropy (nats)", "R²",
              "ablation cost (points)", "layer 1 entropy", "layer 1 max mass", "heads with mass >= 0.5",
              "their R²"]  # fmt: skip
    uniform = next(r for r in _jsonl(root / folder / "results.jsonl") if r["task"] == "shift")["heads_analysis"][0]
    note = f"\nUniform attention's entropy on these rows: {uniform['uniform_entropy']:.2f} nats.\n"
    return _table(header, rows) + note


# name -> function of the repository root returning the markdown between the markers
TABLES: dict[str, Callable[[Path], str]] = {
    "sweep-run": sweep_run,
    "sweep-n2048": sweep_pivot,
    "bench-full": lambda root: bench_suite(root, _HOST_DEVICES, "full fwd"),
    "bench-full-bwd": lambda root: bench_suite(root, _HOST_DEVICES, "full fwd+bwd"),
    "bench-window": lambda root: bench_suite(root, _HOST_DEVICES, "window ±128 fwd", per_token=True),
    "bench-window-bwd": lambda root: bench_suite(root, "session4-window-bwd.json", "window ±128 fwd+bwd", True),
    "bench-graph": bench_graph,
    "bench-memory": bench_memory,
    "ring-memory": ring_memory,
    "compare-main": lambda root: compare_table(root, "compare_160a7db.json"),
    "compare-core": lambda root: compare_table(root, "compare_a437441.json"),
    "compare-wide": lambda root: compare_table(root, "compare_wide.json"),
    "packed-docs": packed_docs,
    "scores": scores_table,
    "flex": flex_table,
    "flex-avx2": lambda root: flex_table(root, "flex_avx2cap.json"),
    "gpu-h200-speed": gpu_speed,
    "gpu-h200-headline": gpu_headline,
    "gpu-h200-blocks": gpu_blocks,
    "gpu-h200-correctness": gpu_correctness,
    "traced-padding": traced_padding,
    "ring-balance": ring_balance,
    "inspect-memory": inspect_memory,
    "inspect-demo": lambda root: (
        importlib.import_module("experiments.inspect_demo").table(root / "docs/results/inspect") + "\n"
    ),
    "lra-table2": lra_table2,
    "molecules": lambda root: experiment_report(
        "molecules", root / "docs/results/molecules", only=("results.jsonl", "baselines.json")
    ),
    "molecules-karate": lambda root: experiment_report(
        "molecules", root / "docs/results/molecules", only=("karate.json",)
    ),
    "posenc": lambda root: experiment_report("posenc", root / "docs/results/posenc"),
    "images": lambda root: experiment_report("images", root / "docs/results/images"),
    "pos": lambda root: experiment_report("pos_tagging", root / "docs/results/pos"),
    "pos-zh": lambda root: experiment_report("pos_tagging", root / "docs/results/pos-zh"),
    "long-range": lambda root: experiment_report("long_range", root / "docs/results/long_range"),
    "speech": lambda root: experiment_report("speech", root / "docs/results/speech"),
    "speech-headline": speech_headline,
    "speech-pilots": speech_pilots,
    "speech-sentences": lambda root: speech_headline(root, Path("docs/results/speech-sentences"), decoding=False),
    "detr": lambda root: _fold_dev_curve(experiment_report("detr", root / "docs/results/detr"), "docs/results/detr"),
    "detr-pilots": lambda root: experiment_report("detr", root / "docs/results/detr-pilots"),
    "claims": lambda root: experiment_report("claims", root / "docs/results/claims"),
    "claims-heads-by-seed": claims_heads_by_seed,
    "explain": lambda root: "```\n" + importlib.import_module("attnlab.dispatch")._demo().strip("\n") + "\n```\n",
}

# whole generated files: path -> function of the repository root returning the file's text
FILES: dict[str, Callable[[Path], str]] = {
    str(SWEEP / "summary.md"): sweep_summary,
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
