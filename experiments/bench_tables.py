"""The committed benchmark results (``benchmarks/results/cpu-2core-shared/``) as the docs' tables.

One function per benchmark, each taking the results folder and the committed file's name and
returning markdown: ``suite`` / ``graph`` / ``memory`` / ``ratios_by_host`` (``make bench``), ``ring_memory``,
``traced_padding``, ``ring_balance``, ``inspect_memory``, ``compare`` (``make compare-main``),
``compare_trace`` (``make compare-plan``), ``packed_docs``, ``scores``, ``flex``, ``adopt`` (``make adopt-bench``),
``profile_ops``, ``call_costs``
(``make profile-window``); the CPU dispatch rules' tables are ``experiments.dispatch_tables``. Each table
ends with the host of its runs (``host_line``, from the files). ``experiments/docs.py`` calls them; what
each benchmark records is described in its own module under ``benchmarks/``.
"""

from __future__ import annotations

import json
from pathlib import Path

from attnlab.train import read_jsonl
from experiments.tables import markdown_table, ms


def _md(header, rows) -> str:
    return markdown_table(header, rows) + "\n"


def _records(folder, name: str) -> list[dict]:
    return json.loads((Path(folder) / name).read_text())["records"]


def host_line(runs, extra: str = "") -> str:
    """ "Host: model, CPUs (SIMD); jax, dates." from the committed files' run records, one per distinct host
    (so a table can not name another host than its runs'); ``extra`` goes before the dates."""
    hosts: dict[str, list] = {}
    for d in (r.get("meta", r) for r in runs):  # compare_commits keeps its run record in "meta"
        if "host" not in d:  # files written before the run record
            continue
        simd = ", ".join(f for f in d["host"]["cpu_simd_flags"] if f in ("avx2", "avx512f", "amx_tile"))
        key = f"{d['host']['cpu_model']}, {d['host']['host_cpus']} CPUs ({simd}); jax {d['jax']}{extra}"
        hosts.setdefault(key, []).append(d["date"])
    return " ".join(f"Host: {k}, {', '.join(dict.fromkeys(v))}." for k, v in hosts.items())


_IMPL_NAMES = {"attnlab.blockwise": "attnlab (1 device)", "attnlab.blockwise/2dev": "attnlab (2 host devices)"}


def suite(folder, file: str, suite: str, per_token: bool = False) -> str:
    """One suite of a bench JSON: a row per N; each implementation's ms, then attnlab's ratios to peers.

    A ratio is peer time / attnlab time (above 1: attnlab faster), as bench_attention records it.
    """
    records = [r for r in _records(folder, file) if r["suite"] == suite]
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
    return _md(header, rows) + _host(folder, file)


def _host(folder, file: str) -> str:
    host = host_line([json.loads((Path(folder) / file).read_text())["meta"]])
    return f"\n{host}\n" if host else ""


def ratios_by_host(folder, files: tuple[str, ...]) -> str:
    """attnlab's ratios to its peers in each ``make bench`` file (one column per file, named by its host):
    peer time / attnlab time, above 1 attnlab faster; only the cells every file has."""
    runs = [json.loads((Path(folder) / f).read_text()) for f in files]
    cells = [
        {(r["suite"], r["N"], r["impl"], k[5:]): v for r in run["records"] for k, v in r.items() if k[:5] == "x_vs_"}
        for run in runs
    ]
    header = ["suite", "N", "attnlab", "vs"]
    for run in runs:
        simd = "AVX-512" if "avx512f" in run["meta"]["host"]["cpu_simd_flags"] else "AVX2"
        label = f"{run['meta']['host']['cpu_model'].split(' Processor')[0]} ({simd})"
        same = sum(h.startswith(label) for h in header)
        header.append(label + (f" run {same + 1}" if same else ""))
    rows = [
        [suite, f"{n // 1024}K" if n < 10**6 else f"{n:,} edges", _IMPL_NAMES.get(impl, impl), peer]
        + [f"{c[(suite, n, impl, peer)]:.2f}x" for c in cells]
        for (suite, n, impl, peer) in cells[0]
        if all((suite, n, impl, peer) in c for c in cells)
    ]
    return _md(header, rows) + f"\n{host_line([run['meta'] for run in runs])}\n"


def graph(folder, file: str) -> str:
    records = [r for r in _records(folder, file) if r["suite"].startswith("graph")]
    rows = []
    for r in records:
        ratio = next((f"{v:.2f}x vs {k[len('x_vs_') :]}" for k, v in r.items() if k.startswith("x_vs_")), "")
        temp = f"{r['temp_mb']:.0f}" if "temp_mb" in r else ""
        rows.append([r["impl"], f"{r['ms']:,.0f}", temp, ratio])
    return f"{records[0]['suite']}:\n\n" + _md(["implementation", "ms", "temp MB", "ratio"], rows) + _host(folder, file)


def memory(folder, file: str) -> str:
    records = [r for r in _records(folder, file) if r["suite"].startswith("memory")]
    rows = [
        [f"{r['N'] // 1024}K", f"{r['temp_mb']:.0f}", f"{r['args_out_mb']:.0f}", f"{r['dense_logits_mb']:,.0f}"]
        for r in records
    ]
    header = ["N", "blockwise temp MB", "arguments + outputs MB", "one dense fp32 [N, T, S] logits array MB"]
    return _md(header, rows) + _host(folder, file)


def ring_memory(folder) -> str:
    """make ring-memory: per-device MiB of ring (sp=8) and one-device blockwise, and the largest N in budget."""
    records = read_jsonl(Path(folder) / "ring_memory.jsonl")
    summary = json.loads((Path(folder) / "ring_memory_summary.json").read_text())
    mib = {(r["method"], r["seq_len"]): r["per_device_bytes"] / 2**20 for r in records}
    devices = summary["devices"]
    lens = sorted({n for (m, n) in mib if m == "ring" and ("blockwise", n) in mib})
    rows = []
    for n in lens:
        ring, one = mib[("ring", n)], mib[("blockwise", n)]
        rows.append([f"{n // 1024}K", f"{ring:.1f}", f"{one:.1f}", f"{one / ring:.1f}x"])
    table = _md(["N", f"ring, per device (sp={devices}), MiB", "blockwise, 1 device, MiB", "ratio"], rows)
    b, r = summary["largest_n_blockwise"], summary["largest_n_ring"]
    return table + (
        f"\nLargest N in {summary['budget_gib']:g} GiB per device: **blockwise on one device {b:,}; "
        f"ring on {devices} devices {r:,} ({r / b:.1f}x)**.\n"
    )


def traced_padding(folder) -> str:
    """``make traced-padding``: attention with traced vs concrete padding lengths, one row per labelled run."""
    rows, runs = [], json.loads((Path(folder) / "traced_padding.json").read_text())
    for r in runs:
        t, ms, x = r["tiles"]["traced"], r["best_ms"], r["traced_over_concrete"]
        rows.append(
            [r["label"], f"{t['block_q']} × {t['block_k']}", f"{100 * t['visited']:.0f}%",
             f"{ms['fwd/concrete']:.1f} ms", f"{ms['fwd/traced']:.1f} ms", f"{x['fwd']:.2f}x",
             f"{ms['fwd+bwd/concrete']:.1f} ms", f"{ms['fwd+bwd/traced']:.1f} ms", f"{x['fwd+bwd']:.2f}x"]
        )  # fmt: skip
    header = ["code", "tiles (traced)", "visited", "fwd concrete", "fwd traced", "ratio", "fwd+bwd concrete"]
    host = host_line(runs)  # the runs written before the run record name no host
    return _md([*header, "fwd+bwd traced", "ratio"], rows) + (f"\n{host}\n" if host else "")


def ring_balance(folder) -> str:
    """``make ring-balance``: tiles per device of the contiguous and zig-zag ring layouts, and the step times."""
    rows, data = [], json.loads((Path(folder) / "ring_balance.json").read_text())
    for r in data["rows"]:
        tiles = r["tiles_per_device"]
        per = f"{tiles[0]} each" if len(set(tiles)) == 1 else " ".join(map(str, tiles))
        step = f"{1e3 * r['step_s_median']:.0f} ms ({1e3 * r['step_s_best']:.0f})" if "step_s_median" in r else "-"
        compile_s = f"{r['compile_s']:.1f} s" if "compile_s" in r else "-"
        rows.append([r["mask"], r["layout"], per, f"{r['max_over_mean']:.2f}",
                     f"{r['critical_path_tiles']} ({r['ideal_tiles']:.0f})", step, compile_s])  # fmt: skip
    header = ["mask", "layout", "tiles per device (d = 0..7)", "max/mean", "lockstep critical path (ideal)"]
    host = host_line([data["environment"]]) if "environment" in data else ""
    return _md([*header, "fwd+bwd median (best)", "compile"], rows) + (f"\n{host}\n" if host else "")


def inspect_memory(folder) -> str:
    """``make inspect-memory``: one-row capture of a 32K-token encoder layer vs its forward (XLA buffers, peak RSS)."""
    data = json.loads((Path(folder) / "inspect_memory.json").read_text())
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
    return _md(header, rows)


def compare(folder, name: str) -> str:
    """``make compare-main`` (``benchmarks.compare_commits``): the same attention calls on two commits, best ms
    and the ratio, from the committed ``name`` JSON; the header names the forward+backward cells' cotangent."""
    data = json.loads((Path(folder) / name).read_text())
    rows = [[r["cell"], f"{r['base_ms']:.1f}", f"{r['head_ms']:.1f}", f"{r['ratio']:.2f}"] for r in data["rows"]]
    # the forward+backward cells' output cotangent (runs before ``--cotangent`` took the gradient of out.sum())
    ct = data["meta"].get("cotangent", "ones")
    cell = f"cell (fwd+bwd cotangent: {ct})" if any("bwd" in r["cell"] for r in data["rows"]) else "cell"
    header = [cell, f"{data['meta']['base']} ms", "after ms", "after / before"]
    if data["meta"].get("same_process"):  # --same_process: each round's ratio, its median and range
        header.append("per round: median (range)")
        for row, r in zip(rows, data["rows"], strict=True):
            row.append(_rounds(r))
    return _md(header, rows) + (f"\n{host}\n" if (host := host_line([data])) else "")


def compare_trace(folder, name: str) -> str:
    """``make compare-plan`` (``compare_commits --measure trace``): each cell's first trace on two commits, in
    fresh processes: the best seconds over the rounds, the rounds' range, and the ratio of the bests."""
    data = json.loads((Path(folder) / name).read_text())
    span = {s: {c: [run[c]["trace_s"] for run in data["runs"][s]] for c in data["runs"][s][0]} for s in data["runs"]}

    def secs(x):  # two decimals, three under 0.1 s
        return f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"

    rows = [[r["cell"], f"{secs(r['base_trace_s'])} ({secs(max(span['base'][r['cell']]))})",
             f"{secs(r['head_trace_s'])} ({secs(max(span['head'][r['cell']]))})", f"{r['ratio']:.3f}"]
            for r in data["rows"]]  # fmt: skip
    header = ["cell", f"{data['meta']['base']}: s (slowest round)", "after: s (slowest round)", "after / before"]
    return _md(header, rows) + f"\n{data['meta']['rounds']} rounds. {host_line([data])}\n"


def _rounds(row: dict) -> str:
    """A ``--same_process`` cell's per-round ratios: "median (min-max)"."""
    return "{median:.2f} ({min:.2f}-{max:.2f})".format(**row["round_ratios"])


def compare_steps(folder, names: tuple) -> str:
    """Consecutive ``compare_commits --same_process`` runs, one commit step each (a bisection of a change in
    time): per step and cell the best ms of both commits, their ratio and each round's ratio (median, range)."""
    runs = [json.loads((Path(folder) / n).read_text()) for n in names]
    rows = [
        [f"{run['meta']['base']} -> {run['meta']['head']}", r["cell"], f"{r['base_ms']:.1f}", f"{r['head_ms']:.1f}",
         f"{r['ratio']:.2f}", _rounds(r)]
        for run in runs
        for r in run["rows"]
    ]  # fmt: skip
    header = ["step (before -> after)", "cell", "before ms", "after ms", "after / before", "per round: median (range)"]
    return _md(header, rows) + f"\n{host_line(runs)}\n"


def compare_bench(folder, names: tuple, times: tuple = ()) -> str:
    """``make compare-flex`` (``compare_commits --bench``): per record and ratio (and each of ``times``, seconds),
    base and head in each run (the runs side by side), from the committed ``names`` JSON."""
    runs = [json.loads((Path(folder) / n).read_text()) for n in names]
    base, keys = runs[0]["meta"]["base"], [k for k in runs[0]["rows"][0] if k not in ("base", "head", "ratios")]
    rows = []
    for i, r in enumerate(runs[0]["rows"]):
        label = " ".join(f"{r[k]:,}" if isinstance(r[k], int) else str(r[k]) for k in keys)
        for t in times:  # the best seconds of each tree, and after / before ("-": a record the base did not write)
            sides = [(run["rows"][i]["base"].get(t), run["rows"][i]["head"][t]) for run in runs]
            rows.append([label, t, *(f"- / {h:.3f}" if b is None else f"{b:.3f} / {h:.3f} ({h / b:.2f})"
                                     for b, h in sides)])  # fmt: skip
        for ratio in r.get("ratios", {}):
            cells = [f"{run['rows'][i]['ratios'][ratio]['base']:.2f} / {run['rows'][i]['ratios'][ratio]['head']:.2f}"
                     for run in runs]  # fmt: skip
            rows.append([label, ratio, *cells])
    header = [
        ", ".join(keys),
        "seconds or ratio" if times else "ratio",
        *(f"run {k + 1}: {base} / after" for k in range(len(runs))),
    ]
    return _md(header, rows) + f"\n{host_line(runs)}\n"


def packed_docs(folder) -> str:
    """``make packed-docs``: packed documents with traced vs concrete ids vs dense XLA, and the scaling rows."""
    data = json.loads((Path(folder) / "packed.json").read_text())
    rows = []
    for r in data["records"]:
        if r["suite"] == "compare":
            rows.append(
                [r["mask"], f"{r['docs']} in {r['T']:,}", f"{r['traced_s']:.2f}", f"{r['concrete_s']:.2f}",
                 f"{r['traced_over_concrete']:.2f}x", f"{r['xla_s']:.1f}", f"{r['xla_over_traced']:.1f}x"]
            )  # fmt: skip
    header = ["mask", "documents", "traced ids s", "concrete ids s", "traced / concrete", "dense XLA s"]
    table = _md([*header, "XLA / traced"], rows)
    scaling = [r for r in data["records"] if r["suite"] == "scaling"]
    table += "\n" + _md(
        ["documents in one row", "sum of len²", "fwd+bwd s (traced ids)"],
        [[str(r["docs"]), f"{r['sum_len_sq']:,}", f"{r['traced_s']:.2f}"] for r in scaling],
    )
    retrace = next(r for r in data["records"] if r["suite"] == "retrace")
    return (
        table + f"\nTraces over {retrace['batches']} batches of new ids: **{retrace['traces']}**. {host_line([data])}\n"
    )


def scores(folder) -> str:
    """``make scores``: per-element scores (SoftCap, an ALiBi ScoreMod) and additive attention, blockwise."""
    data = json.loads((Path(folder) / "scores.json").read_text())
    rows = [
        [r["score"], r["mask"], r["mode"], f"{r['T']:,}", f"{1e3 * r['dot_s']:.0f}", f"{1e3 * r['score_s']:.0f}",
         f"{r['score_over_dot']:.2f}x"]
        for r in data["records"]
    ]  # fmt: skip
    table = _md(["score", "mask", "mode", "T", "dot ms", "score ms", "score / dot"], rows)
    a = data["additive"]
    add = _md(
        ["T", "heads x H", "additive s", "additive GFLOP/s", "dot s", "dot GFLOP/s", "tiled temp GiB",
         f"tiled temp GiB at {2 * a['T']:,}", "dense reference temp GiB"],
        [[f"{a['T']:,}", f"{a['heads']} x {a['H']}", f"{a['additive_s']:.1f}", f"{a['additive_gflops']:.1f}",
          f"{a['dot_s']:.1f}", f"{a['dot_gflops']:.1f}", f"{a['tiled_temp_gib']:.3f}", f"{a['tiled_temp_gib_2T']:.3f}",
          f"{a['dense_temp_gib']:,.0f}"]],
    )  # fmt: skip
    return table + "\nAdditive (tanh) attention, fwd+bwd, no mask:\n\n" + add + f"\n{host_line([data])}\n"


def flex(folder, name: str = "flex.json") -> str:
    """``make flex``: the blockwise kernel against torch.compile(flex_attention) on the CPU, forward."""
    data = json.loads((Path(folder) / name).read_text())
    dev = next((r["host_devices"] for r in data["records"] if "attnlab_devices_s" in r), None)
    rows = []
    for r in data["records"]:
        name = f"document ({r['docs']} docs, ids traced)" if r["mask"] == "document" else f"window ±{r['window']}"
        row = [name, f"{r['T']:,}", f"{1e3 * r['attnlab_s']:.0f}", f"{1e3 * r['flex_s']:.0f}"]
        row.append(f"{r['flex_over_attnlab']:.2f}x")
        row += [f"{1e3 * r['attnlab_devices_s']:.0f}", f"{r['flex_over_attnlab_devices']:.2f}x"] if dev else []
        rows.append(row + [f"{r['flex_block_mask_s']:.1f}", f"{r['max_abs_diff']:.0e}"])
    header = ["mask", "T", "attnlab ms", "flex ms", "flex / attnlab"]
    if dev:
        header += [f"attnlab ms, heads on {dev} host devices", "flex / that"]
    table = _md(header + ["flex block mask s", "max abs diff"], rows)
    host = host_line([data], f", torch {data['torch']} ({data['torch_threads']} threads)")
    cap = f" Generated code capped at {data['cap_isa'].upper()} (`--cap_isa`)." if data.get("cap_isa") else ""
    return table + f"\n{host}{cap}\n"


def adopt(folder, names: tuple[str, ...] = ("adopt.json",)) -> str:
    """``make adopt-bench`` (``benchmarks.adopt``): per row, the first run's best ms on each side and every run's
    ratio (peer / attnlab: > 1 is attnlab faster), with the implementation attnlab ran;
    on the small rows, jax.nn against a second copy of itself in each run (the A/A ratio: the noise)."""
    files = [json.loads((Path(folder) / name).read_text()) for name in names]
    runs = [d["records"] for d in files]
    ratios = [{(r["case"], r["mode"]): r["ratio"] for r in records} for records in runs]
    controls = [{(r["case"], r["mode"]): r.get("control_ratio") for r in records} for records in runs]
    rows = []
    for r in runs[0]:
        theirs = r["jax_nn_ms"] if r["suite"] == "jax_nn" else r["stock_ms"]
        peer = "jax.nn" if r["suite"] == "jax_nn" else "stock Flax"
        runs_on = r["implementation"] if r["suite"] == "jax_nn" else ""
        key = (r["case"], r["mode"])
        per_run = [f"{rs[key]:.2f}" for rs in ratios]
        aa = [cs.get(key) for cs in controls]
        control = ", ".join(f"{c:.2f}" for c in aa) if all(c is not None for c in aa) else ""
        rows.append([r["case"], r["mode"], peer, ms(theirs), ms(r["attnlab_ms"]), *per_run, control, runs_on])
    head = ["peer / attnlab"] if len(runs) == 1 else [f"peer / attnlab, run {i + 1}" for i in range(len(runs))]
    aa_head = "A/A: jax.nn / jax.nn" + ("" if len(runs) == 1 else ", runs")
    header = ["case", "direction", "peer", "peer ms", "attnlab ms", *head, aa_head, "attnlab runs"]
    return _md(header, rows) + f"\n{host_line(files)}\n"


def profile_ops(folder, names: tuple) -> str:
    """``make profile-window`` (``benchmarks.profile_ops``): the profiled call's time per kind of op, each
    run's ms and share of the ops' total, from the committed ``names`` JSON."""
    runs = [json.loads((Path(folder) / n).read_text()) for n in names]
    totals = [sum(r["kinds_ms"].values()) for r in runs]
    rows = []
    for kind in sorted(runs[0]["kinds_ms"], key=lambda k: -runs[0]["kinds_ms"][k]):
        rows.append(
            [
                kind,
                *(
                    f"{r['kinds_ms'][kind]:.0f} ({r['kinds_ms'][kind] / t:.0%})"
                    for r, t in zip(runs, totals, strict=True)
                ),
            ]
        )
    rows.append(["all ops", *(f"{t:.0f}" for t in totals)])
    return _md(["kind of op", *(f"run {i + 1}: ms (share)" for i in range(len(runs)))], rows) + f"\n{host_line(runs)}\n"


_COSTS = {
    "wall_ms": "wall time, untraced (ms)",
    "user_ms": "user CPU time, all threads (ms)",
    "sys_ms": "system CPU time (ms)",
    "fault_mib": "pages first touched (MiB)",
    "temp_mib": "XLA temporaries (MiB)",
    "output_mib": "outputs (MiB)",
}


def call_costs(folder, names: tuple) -> str:
    """``make profile-window``'s ``call_costs`` (``harness.call_costs``): what one untraced call costs the
    host per call, one column per committed run ``names``, and beside it the same call with freed memory
    kept by the C library (``call_costs_pages_kept``) where the run has it."""
    runs, heads, files = [], [], []
    for i, n in enumerate(names):
        d = json.loads((Path(folder) / n).read_text())
        files.append(d)
        runs.append(d["call_costs"])
        heads.append(f"run {i + 1}")
        if "call_costs_pages_kept" in d:
            runs.append(d["call_costs_pages_kept"])
            heads.append(f"run {i + 1}, pages kept")
    rows = [[label, *(f"{r[key]:.0f}" for r in runs)] for key, label in _COSTS.items()]
    return _md(["per call", *heads], rows) + f"\n{host_line(files)}\n"
