"""The claims experiment's results, described: ``report`` (``summary.md``, ``heads_<task>.png``,
``heads_accuracy.png`` and ``embedding_pca.png`` from ``results.jsonl`` alone), ``conv_distance``
(how far a model's heads are from convolution heads) and ``heads_by_seed`` (the docs' per-seed table
of the shift task's heads).

Each record of ``results.jsonl`` is one cell (task, heads, score, input, seed) with its accuracy,
step time, the implementation the dispatcher picks per backend, and ``heads_analysis``: per (layer,
head) the statistics of ``attnlab.inspect.summarise`` and the accuracy with that head ablated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments import common
from experiments.tables import markdown_table, mean_std

BACKENDS = ("cpu", "gpu", "tpu")
STEP_HEADER = "train step (ms), per seed"


TASKS = ("shift", "pos")


def _pct(stat) -> str:
    return mean_std(stat, scale=100, digits=1)


def _steps_ms(records) -> str:
    """Each seed's train step time, in seed order: seeds may run on different machines (a mean of
    timings from a loaded and a quiet host would mean nothing); compare times within one seed."""
    return " / ".join(f"{1000 * r['step_s']:.1f}" for r in sorted(records, key=lambda r: r["seed"]))


def conv_distance(record: dict) -> dict:
    """Summary of how far the model's heads are from convolution heads (which have 1.0 on both)."""
    h = record["heads_analysis"]
    base = record.get("analysis_accuracy", record["accuracy"])
    return {
        "top_offset_mass": float(np.mean([x["top_offset_mass"] for x in h])),
        "r2_offset": float(np.mean([x["r2_offset"] for x in h])),
        "conv_like_heads": sum(x["top_offset_mass"] >= 0.9 for x in h),
        "mostly_one_offset": sum(x["top_offset_mass"] >= 0.5 for x in h),
        "needed": sum(base - x["ablated_accuracy"] >= 0.05 for x in h),
        "heads": len(h),
    }


def load(folder: Path) -> list[dict]:
    """The records of ``results.jsonl``; a cell finished twice (two processes) counts once."""
    results, seen = [], set()
    for r in common.read_jsonl(Path(folder) / "results.jsonl"):
        key = tuple(r[k] for k in ("task", "heads", "score", "input", "seed"))
        if key not in seen:
            seen.add(key)
            results.append(r)
    return results


def _heads_ablation(dot: list[dict]) -> str:
    """1. accuracy by head count at fixed d_model."""
    rows = []
    for task in TASKS:
        acc = common.summarize([r for r in dot if r["task"] == task], ("heads",), "accuracy")
        d = next((r["d_model"] for r in dot if r["task"] == task), None)
        for (n,), stat in sorted(acc.items()):
            step = _steps_ms([r for r in dot if r["task"] == task and r["heads"] == n])
            rows.append([task, n, d // n, _pct(stat), stat[2], step])
    if not rows:
        return ""
    header = ["task", "heads", "head dim", "accuracy (%)", "seeds", STEP_HEADER]
    return "### Heads ablation (fixed d_model)\n\n" + markdown_table(header, rows)


def _per_head(dot: list[dict]) -> str:
    """1 + 4b. every head of every dot-score model's first seed."""
    rows = []
    first_seed = {t: min((r["seed"] for r in dot if r["task"] == t), default=None) for t in TASKS}
    for r in sorted(dot, key=lambda r: (r["task"] != "shift", r["heads"], r["seed"])):
        if r["seed"] != first_seed[r["task"]]:
            continue
        base = r.get("analysis_accuracy", r["accuracy"])
        rows += [
            [r["task"], r["heads"], r["seed"], h["layer"], h["head"], h["top_offset"], f"{h['top_offset_mass']:.2f}",
             f"{h['r2_offset']:.2f}", f"{h['entropy']:.2f} / {h['uniform_entropy']:.2f}",
             f"{100 * (base - h['ablated_accuracy']):+.1f}"]
            for h in r["heads_analysis"]
        ]  # fmt: skip
    if not rows:
        return ""
    header = [
        "task", "heads", "seed", "layer", "head", "top offset", "mass on top offset", "R² offset-only fit",
        "entropy / uniform (nats)", "accuracy drop when ablated (points)",
    ]  # fmt: skip
    return "### Per-head analysis (every dot-score model, first seed)\n\n" + markdown_table(header, rows)


def _conv_table(dot: list[dict]) -> str:
    """4b. the heads' distance from convolution heads, per task and head count (every seed)."""
    rows = []
    for task in TASKS:
        for n in sorted({r["heads"] for r in dot if r["task"] == task}):
            rs = [conv_distance(r) for r in dot if r["task"] == task and r["heads"] == n]
            heads = sum(c["heads"] for c in rs)
            rows.append(
                [task, n, f"{np.mean([c['top_offset_mass'] for c in rs]):.2f}",
                 f"{np.mean([c['r2_offset'] for c in rs]):.2f}", f"{sum(c['conv_like_heads'] for c in rs)} / {heads}",
                 f"{sum(c['mostly_one_offset'] for c in rs)} / {heads}", f"{sum(c['needed'] for c in rs)} / {heads}"]
            )  # fmt: skip
    header = ["task", "heads", "mean mass on top offset (conv: 1.00)", "mean R² offset-only (conv: 1.00)",
              "heads with >= 0.9 on one offset", "heads with >= 0.5 on one offset",
              "heads whose ablation costs >= 5 points"]  # fmt: skip
    return "### Distance from a convolution\n\n" + markdown_table(header, rows)


def _dot_vs_additive(results: list[dict]) -> str:
    """2. the two scores at the head count the additive cells ran with."""
    rows = []
    for task in TASKS:
        n = next((r["heads"] for r in results if r["score"] == "additive" and r["task"] == task), None)
        for score in ("dot", "additive"):
            rs = [r for r in results if r["task"] == task and r["score"] == score and r["heads"] == n]
            rs = [r for r in rs if r["input"] not in ("word_learned", "word_onehot")]
            if not rs:
                continue
            acc = common.summarize(rs, ("task",), "accuracy")[(task,)]
            disp = rs[0]["dispatch"]
            rows.append([task, score, n, _pct(acc), acc[2], _steps_ms(rs), *(disp[b] for b in BACKENDS)])
    if not rows:
        return ""
    header = ["task", "score", "heads", "accuracy (%)", "seeds", STEP_HEADER, *(f"dispatch {b}" for b in BACKENDS)]
    return "### Relevance: dot product vs additive\n\n" + markdown_table(header, rows)


def _embeddings(results: list[dict]) -> str:
    """3. one-hot codes against a learned word table."""
    emb = sorted((r for r in results if r["input"].startswith("word_")), key=lambda r: (r["input"], r["seed"]))
    if not emb:
        return ""
    rows = [
        [r["input"], str(r["seed"]), f"{100 * r['accuracy']:.2f}", f"{100 * r['ambiguous_accuracy']:.2f}",
         f"{100 * r['oov_accuracy']:.2f}", f"{r['neighbour_tag_agreement']:.3f}", f"{r['neighbour_tag_chance']:.3f}"]
        for r in emb
    ]  # fmt: skip
    header = ["word input", "seed", "test acc (%)", "ambiguous (%)", "OOV (%)", "5-NN share majority tag", "chance"]
    text = "### One-hot vs learned word embedding (word id only)\n\n" + markdown_table(header, rows)
    learned = next((r for r in emb if "neighbours" in r), None)
    if learned:
        nb = [[w, ", ".join(ns)] for w, ns in learned["neighbours"].items()]
        text += f"\n\nNearest neighbours (cosine) in the learned table (seed {learned['seed']}):\n\n"
        text += markdown_table(["word", "neighbours"], nb)
    return text


def report(folder: Path) -> str:
    """``summary.md`` and the figures of a results folder, from ``results.jsonl`` alone; returns the summary."""
    folder = Path(folder)
    results = load(folder)
    if not results:
        raise FileNotFoundError(f"no results in {folder / 'results.jsonl'}: run the experiment first")
    dot = [r for r in results if r["score"] == "dot" and r["input"] in ("tokens", "features")]
    per_head = _per_head(dot)
    sections = [_heads_ablation(dot), per_head, _conv_table(dot) if per_head else ""]
    sections += [_dot_vs_additive(results), _embeddings(results)]
    text = "\n\n".join(s for s in sections if s)
    (folder / "summary.md").write_text(text + "\n")
    _figures(common.pyplot(), folder, results, dot)
    return text


def _figures(plt, folder, results, dot):
    for task in ("shift", "pos"):  # per-head offset profiles of the 4-head (or largest) model, seed 0
        rs = [r for r in dot if r["task"] == task]
        if not rs:
            continue
        n = 4 if any(r["heads"] == 4 for r in rs) else max(r["heads"] for r in rs)
        r = min((r for r in rs if r["heads"] == n), key=lambda r: r["seed"])
        h = r["heads_analysis"]
        layers = sorted({x["layer"] for x in h})
        R = (len(h[0]["offset_mass"]) - 1) // 2
        fig, axes = plt.subplots(len(layers), n, figsize=(2.3 * n, 1.9 * len(layers)), squeeze=False)
        base = r.get("analysis_accuracy", r["accuracy"])
        for x in h:
            ax = axes[x["layer"], x["head"]]
            ax.bar(np.arange(-R, R + 1), x["offset_mass"], color="C0")
            ax.set_ylim(0, 1)
            ax.set_title(
                f"L{x['layer']} H{x['head']}: H={x['entropy']:.1f}, drop {100 * (base - x['ablated_accuracy']):.1f}",
                fontsize=7,
            )
            ax.tick_params(labelsize=6)
        fig.suptitle(f"{task}: attention mass by offset s - t per head ({n} heads, seed {r['seed']})", fontsize=9)
        common.save_figure(fig, folder / f"heads_{task}.png")

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for task in ("shift", "pos"):
        acc = common.summarize([r for r in dot if r["task"] == task], ("heads",), "accuracy")
        if acc:
            ns = sorted(acc)
            ax.errorbar([n for (n,) in ns], [100 * acc[k][0] for k in ns], [100 * acc[k][1] for k in ns],
                        marker="o", capsize=3, label=task)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("heads (d_model fixed)")
    ax.set_ylabel("accuracy (%)")
    ax.legend()
    common.save_figure(fig, folder / "heads_accuracy.png")

    learned = next((r for r in results if "pca" in r), None)
    if learned:
        tags = sorted({p[1] for p in learned["pca"]})
        fig, ax = plt.subplots(figsize=(7, 5.5))
        for i, t in enumerate(tags):
            pts = [p for p in learned["pca"] if p[1] == t]
            ax.scatter([p[2] for p in pts], [p[3] for p in pts], s=10, color=f"C{i % 10}",
                       marker="o" if i < 10 else "x", label=t)  # fmt: skip
        for p in learned["pca"][:60]:
            ax.annotate(p[0], (p[2], p[3]), fontsize=6)
        ax.set_title(f"learned word embeddings: PCA of the {len(learned['pca'])} most frequent words")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        common.save_figure(fig, folder / "embedding_pca.png")


def heads_by_seed(folder) -> str:
    """The shift task's per-head figures per model and seed (docs/results/claims/results.jsonl).

    The second layer's most concentrated head (its top offset, mass there, entropy, offset-only R² and the
    points its ablation costs), the first layer's entropy range and largest mass on one offset, and how
    many heads put at least half their mass on one offset, with those heads' R² range."""
    records = common.read_jsonl(Path(folder) / "results.jsonl")
    rows = []
    for r in records:
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
    uniform = next(r for r in records if r["task"] == "shift")["heads_analysis"][0]
    note = f"\nUniform attention's entropy on these rows: {uniform['uniform_entropy']:.2f} nats.\n"
    return markdown_table(header, rows) + "\n" + note
