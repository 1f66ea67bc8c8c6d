"""The long-range experiment's results, described: ``tables`` (ListOps accuracy, the LRA Table-2 style
efficiency table, recall at a distance, the efficiency outlook) and ``report`` (``summary.md`` and
``listops_accuracy.png``, ``efficiency.png``, ``time_vs_n.png``, ``outlook.png``, ``recall.png``), from
``listops.jsonl``, ``efficiency.jsonl`` and ``recall.jsonl`` alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments import common, figures
from experiments.tables import markdown_table, mean_std, size_label

LRA_TRANSFORMER_LISTOPS = 36.37  # Tay et al. 2020, Table 1: vanilla Transformer test accuracy on ListOps (%)
LABELS = {
    "full": "full attention",
    "full_dense": "full (dense XLA)",
    "local": "local (chunks)",
    "bigbird": "BigBird",
    "linear": "linear (elu+1)",
    "performer": "Performer",
    "gru": "GRU",
}


def _listops_table(acc: list[dict]) -> str:
    caption = (
        f"ListOps (`{acc[0]['data']}` variant, max length {acc[0]['max_len']}); LRA's vanilla Transformer on "
        f"LRA's ListOps: {LRA_TRANSFORMER_LISTOPS}%; majority class of this test split: "
        f"{100 * acc[0]['majority_class']:.1f}%; mean ± sd over seeds (sample sd; 0.0 for one seed); train times "
        "in seed order (seeds may have run on differently loaded machines: see run.json)"
    )
    test, dev = (common.summarize(acc, ["model"], f, ddof=1) for f in ("test_accuracy", "dev_accuracy"))
    first, secs = {}, {}
    for r in sorted(acc, key=lambda r: r.get("seed", 0)):
        first.setdefault(r["model"], r)
        secs.setdefault(r["model"], []).append(f"{r['train_time_s']:.0f}")
    header = ["model", "test acc %", "dev acc %", "seeds", "steps", "train time (s) per seed", "params"]
    rows = [
        [LABELS.get(k, k), mean_std(test[(k,)], scale=100), mean_std(dev[(k,)], scale=100),
         test[(k,)][2], r["steps"], "/".join(secs[k]), f"{r['params']:,}"]
        for k, r in first.items()
    ]  # fmt: skip
    return caption + "\n\n" + markdown_table(header, rows)


def _efficiency_table(eff: list[dict], table_lens) -> str:
    by = {(r["model"], r["seq_len"]): r for r in eff}
    lens = [n for n in table_lens if any(k[1] == n for k in by)] or sorted({k[1] for k in by})
    caption = (
        f"Training step (fwd + bwd + AdamW), batch {eff[0]['batch_size']}: steps/s (speed-up vs full "
        f"attention) and peak memory (MiB, XLA memory analysis of the compiled step)"
    )
    header = ["model"] + [f"steps/s {size_label(n)}" for n in lens] + [f"MiB {size_label(n)}" for n in lens]
    rows = []
    for mname in dict.fromkeys(r["model"] for r in eff):
        speed, mem = [], []
        for n in lens:
            r, f = by.get((mname, n)), by.get(("full", n))
            rel = f" ({r['steps_per_s'] / f['steps_per_s']:.1f}x)" if r and f and mname != "full" else ""
            speed.append(f"{r['steps_per_s']:.2f}{rel}" if r else "-")
            mem.append(f"{r['peak_bytes'] / 2**20:.1f}" if r else "-")
        rows.append([LABELS.get(mname, mname), *speed, *mem])
    return caption + "\n\n" + markdown_table(header, rows)


def _recall_table(rec: list[dict]) -> str:
    dists = sorted({r["distance"] for r in rec})
    by = {(r["model"], r["distance"]): r for r in rec}
    caption = (
        f"Recall at a distance (key at 0, query at d; chance {100 * rec[0]['chance']:.1f}%, "
        f"{rec[0]['steps']} steps each); test accuracy %"
    )
    rows = [
        [LABELS.get(m, m)] + [f"{100 * by[(m, d)]['accuracy']:.1f}" if (m, d) in by else "-" for d in dists]
        for m in dict.fromkeys(r["model"] for r in rec)
    ]
    return caption + "\n\n" + markdown_table(["model"] + [f"d={d}" for d in dists], rows)


def _outlook_table(points: list[dict], acc: list[dict], eff: list[dict]) -> str:
    caption = (
        f"Efficiency outlook (LRA Figure 3 style): ListOps test accuracy (length <= {acc[0]['max_len']}) "
        f"against training steps/s and memory at N = {size_label(points[0]['seq_len'])} (batch "
        f"{eff[0]['batch_size']}); `outlook.png` draws it, memory as the marker's area"
    )
    rows = [
        [LABELS.get(p["model"], p["model"]), f"{100 * p['accuracy']:.1f} ± {100 * p['accuracy_sd']:.1f}",
         f"{p['steps_per_s']:.2f}", f"{p['mib']:.1f}"]
        for p in points
    ]  # fmt: skip
    return caption + "\n\n" + markdown_table(["model", "ListOps acc % (mean ± sd)", "steps/s", "MiB"], rows)


def _load(folder: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """The ListOps records, the efficiency cells that ran, the recall records."""
    acc = common.read_jsonl(folder / "listops.jsonl")
    eff = [r for r in common.read_jsonl(folder / "efficiency.jsonl") if r.get("status") == "ok"]
    return acc, eff, common.read_jsonl(folder / "recall.jsonl")


def tables(folder: Path, table_lens=(1024, 2048, 3072, 4096)) -> str:
    """The summary's tables: ListOps, efficiency (at ``table_lens``), recall, outlook (each if it ran)."""
    acc, eff, rec = _load(Path(folder))
    points = outlook_points(acc, eff)
    parts = [
        _listops_table(acc) if acc else "",
        _efficiency_table(eff, table_lens) if eff else "",
        _recall_table(rec) if rec else "",
        _outlook_table(points, acc, eff) if points else "",
    ]
    if not any(parts):
        raise FileNotFoundError(f"no listops/efficiency/recall JSONL under {folder}: run the experiment first")
    return "\n\n".join(p for p in parts if p)


def outlook_points(acc: list[dict], eff: list[dict]) -> list[dict]:
    """One point per model with both a ListOps accuracy and a step measured at the longest N all share.

    ``accuracy`` is the mean over the seeds in ``acc`` and ``accuracy_sd`` their sample sd (0.0 for
    one seed). ``full_dense`` is the ``full`` model run through XLA's dense kernel: the same accuracy,
    its own speed and memory.
    """
    stats = common.summarize(acc, ["model"], "test_accuracy", ddof=1)
    accuracy = {k: v[0] for (k,), v in stats.items()}
    spread = {k: v[1] for (k,), v in stats.items()}
    accuracy.setdefault("full_dense", accuracy.get("full"))
    spread.setdefault("full_dense", spread.get("full"))
    models = [m for m in dict.fromkeys(r["model"] for r in eff) if accuracy.get(m) is not None]
    lens = [n for n in sorted({r["seq_len"] for r in eff}) if all(any(
        r["model"] == m and r["seq_len"] == n for r in eff) for m in models)]  # fmt: skip
    if not models or not lens:
        return []
    by = {(r["model"], r["seq_len"]): r for r in eff}
    return [
        dict(model=m, accuracy=accuracy[m], accuracy_sd=spread[m], seq_len=lens[-1],
             steps_per_s=by[(m, lens[-1])]["steps_per_s"], mib=by[(m, lens[-1])]["peak_bytes"] / 2**20)
        for m in models
    ]  # fmt: skip


def _outlook_figure(plt, points: list[dict], path: Path) -> None:
    """Accuracy (y) against speed (x), marker area proportional to memory: Tay et al. 2020, Figure 3."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    biggest = max(p["mib"] for p in points)
    for p in points:
        ax.scatter(p["steps_per_s"], 100 * p["accuracy"], s=30 + 1500 * p["mib"] / biggest, alpha=0.5)
        ax.errorbar(p["steps_per_s"], 100 * p["accuracy"], yerr=100 * p["accuracy_sd"], color="k", lw=1, capsize=3)
        label = f"{LABELS.get(p['model'], p['model'])}\n{p['mib']:.0f} MiB"
        ax.annotate(label, (p["steps_per_s"], 100 * p["accuracy"]), fontsize=7, ha="center", va="center")
    ax.set_xscale("log")
    ax.set_xlabel(f"training steps / s at N = {size_label(points[0]['seq_len'])} (log)")
    ax.set_ylabel("ListOps test accuracy (%)")
    ax.set_title("accuracy vs speed; marker area = memory of the compiled step")
    ax.margins(0.25)
    common.save_figure(fig, path)


def _series(records: list[dict], x: str, y, models) -> dict:
    """label -> (x values, y values) per model, sorted by x; ``y`` a function of a record."""
    out = {}
    for m in models:
        pts = sorted((r[x], r) for r in records if r["model"] == m)
        out[LABELS.get(m, m)] = ([v for v, _ in pts], [y(r) for _, r in pts])
    return out


def _listops_figure(plt, acc: list[dict], path: Path) -> None:
    """Mean ± sd per model, every seed as a dot over its bar, LRA's Transformer and the majority class."""
    stats = common.summarize(acc, ["model"], "test_accuracy", ddof=1)
    kinds = [k for (k,) in stats]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    x = np.arange(len(kinds))
    ax.bar(x, [100 * stats[(k,)][0] for k in kinds], yerr=[100 * stats[(k,)][1] for k in kinds],
           color="tab:blue", capsize=3)  # fmt: skip
    for k, xi in zip(kinds, x, strict=True):
        vals = [100 * r["test_accuracy"] for r in acc if r["model"] == k]
        ax.plot([xi] * len(vals), vals, "k.", ms=4)
    ax.axhline(LRA_TRANSFORMER_LISTOPS, color="k", ls="--", lw=1, label="LRA Transformer (LRA ListOps)")
    ax.axhline(100 * acc[0]["majority_class"], color="gray", ls=":", lw=1, label="majority class")
    ax.set_xticks(x, [LABELS.get(k, k) for k in kinds], rotation=20)
    ax.set_ylabel("test accuracy (%)")
    n_seeds = max(v[2] for v in stats.values())
    ax.set_title(
        f"ListOps `{acc[0]['data']}` (length <= {acc[0]['max_len']}), {acc[0]['steps']} steps, "
        f"{n_seeds} seed(s): mean ± sd, dots = seeds"
    )
    ax.legend(fontsize=7)
    common.save_figure(fig, path)


def _efficiency_figures(plt, eff: list[dict], folder: Path) -> None:
    """``efficiency.png`` (steps/s and memory vs N) and ``time_vs_n.png`` (attention vs GRU per step)."""
    models = list(dict.fromkeys(r["model"] for r in eff))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, y, label, legend in [
        (axes[0], lambda r: r["steps_per_s"], "training steps / s", 7),
        (axes[1], lambda r: r["peak_bytes"] / 2**20, "peak memory (MiB, XLA analysis)", None),
    ]:
        figures.lines(ax, _series(eff, "seq_len", y, models), xlog2=True, ylog=True, xlabel="sequence length N",
                      ylabel=label, legend=legend)  # fmt: skip
    fig.suptitle(f"LRA Table-2 style, batch {eff[0]['batch_size']}, {eff[0].get('backend', '?')}")
    common.save_figure(fig, folder / "efficiency.png")
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    shown = [k for k in ("full", "full_dense", "linear", "gru") if k in models]
    figures.lines(ax, _series(eff, "seq_len", lambda r: 1e3 * r["step_s"], shown), xlog2=True, ylog=True,
                  xlabel="sequence length N", ylabel="wall time per training step (ms)",
                  title="attention (parallel) vs GRU (lax.scan), this CPU", legend=8)  # fmt: skip
    common.save_figure(fig, folder / "time_vs_n.png")


def _recall_figure(plt, rec: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    models = dict.fromkeys(r["model"] for r in rec)
    figures.lines(ax, _series(rec, "distance", lambda r: 100 * r["accuracy"], models))
    ax.axhline(100 * rec[0]["chance"], color="gray", ls=":", lw=1, label="chance")
    ax.set_ylim(0, 105)
    figures.style(ax, xlog2=True, xlabel="distance between key and query (tokens)", ylabel="test accuracy (%)",
                  title=f"recall at a distance, {rec[0]['steps']} steps per model", legend=8)  # fmt: skip
    common.save_figure(fig, path)


def report(folder: Path) -> str:
    """``summary.md`` (``tables``) and the figures of a results folder, from its JSONL alone."""
    folder = Path(folder)
    text = tables(folder)
    (folder / "summary.md").write_text(text + "\n")
    plt = common.pyplot()
    acc, eff, rec = _load(folder)
    if acc:
        _listops_figure(plt, acc, folder / "listops_accuracy.png")
    if eff:
        _efficiency_figures(plt, eff, folder)
    points = outlook_points(acc, eff)
    if points:
        _outlook_figure(plt, points, folder / "outlook.png")
    if rec:
        _recall_figure(plt, rec, folder / "recall.png")
    return text
