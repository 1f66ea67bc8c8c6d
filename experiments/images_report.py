"""The images experiment's results, described: ``report`` (``summary.md``, ``accuracy_vs_size.png``,
``attention_distance.png`` from ``<variant>/results.jsonl`` alone), ``summarize`` (mean ± std over seeds
per variant, model and size) and ``gap_table`` (the CNN's lead over the ViT).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments import common
from experiments.tables import markdown_table, mean_std


def _load_results(folder: Path) -> list[dict]:
    return [r for p in sorted(folder.glob("*/results.jsonl")) for r in common.read_jsonl(p)]


def summarize(results: list[dict]) -> list[dict]:
    """One row per (variant, model, size): mean and std (ddof=1) of the test accuracy over seeds."""
    key = ("variant", "model_name", "size")
    stats = common.summarize(results, key, "test_accuracy", ddof=1)
    rows = []
    for group, (mean, std, n) in sorted(stats.items()):
        rs = [r for r in results if tuple(r[k] for k in key) == group]
        first = rs[0]
        rows.append(
            {
                **dict(zip(("variant", "model", "size"), group, strict=True)),
                "seeds": n, "mean": mean, "std": std,
                "train_accuracy": float(np.mean([r["train_accuracy"] for r in rs])),
                **{k: first[k] for k in ("steps", "epochs", "params")},
                "train_time_s": float(np.mean([r["train_time_s"] for r in rs])),
            }
        )  # fmt: skip
    return rows


def report(folder: Path) -> str:
    plt = common.pyplot()

    folder = Path(folder)
    results = _load_results(folder)
    if not results:
        raise FileNotFoundError(f"no */results.jsonl under {folder}: run the experiment first")
    rows = summarize(results)
    header = ["variant", "model", "train images", "seeds", "test acc % (mean +- std)", "train acc %", "steps"]
    header += ["epochs", "params", "train time (s)"]
    table = markdown_table(
        header,
        [
            [r["variant"], r["model"], f"{r['size']:,}", r["seeds"],
             mean_std((r["mean"], r["std"]), scale=100, digits=2, sep=" +- "),
             f"{100 * r['train_accuracy']:.1f}", r["steps"], r["epochs"], f"{r['params']:,}",
             f"{r['train_time_s']:.0f}"]
            for r in rows
        ],
    )  # fmt: skip
    gap = gap_table(rows)
    if gap:
        table += "\n" + gap
    (folder / "summary.md").write_text(table + "\n")

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for (variant, name), style in _series(rows):
        pts = [r for r in rows if r["variant"] == variant and r["model"] == name]
        ax.errorbar(
            [r["size"] for r in pts],
            [100 * r["mean"] for r in pts],
            yerr=[100 * r["std"] for r in pts],
            capsize=3,
            label=f"{name} ({pts[0]['params']:,} params)" + ("" if variant == "default" else f", {variant}"),
            **style,
        )
    ax.set_xscale("log")
    ax.set_xlabel("training images")
    ax.set_ylabel("test accuracy (%)  (mean +- std over seeds)")
    ax.set_title(f"{results[0]['dataset']}: attention vs CNN")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    common.save_figure(fig, folder / "accuracy_vs_size.png")

    attn = [r for r in results if r.get("attention_distance")]
    if attn:
        _distance_figure(plt, attn, folder / "attention_distance.png")
    return table


def gap_table(rows: list[dict]) -> str:
    """CNN minus ViT test accuracy per (variant, size), for the variants that ran both ('' if none)."""
    by = {(r["variant"], r["model"], r["size"]): r for r in rows}
    out = []
    for variant, size in dict.fromkeys((r["variant"], r["size"]) for r in rows):
        cnn, vit = by.get((variant, "cnn", size)), by.get((variant, "vit", size))
        if cnn and vit:
            out.append([variant, f"{size:,}", vit["epochs"], f"{vit['steps']:,}", f"{100 * cnn['mean']:.2f}",
                        f"{100 * vit['mean']:.2f}", f"{100 * (cnn['mean'] - vit['mean']):+.2f}"])  # fmt: skip
    if not out:
        return ""
    header = ["variant", "train images", "epochs", "steps", "CNN %", "ViT %", "CNN - ViT (points)"]
    return "\nThe CNN's lead over the ViT (test accuracy, mean over seeds):\n\n" + markdown_table(header, out)


def _series(rows):
    styles = {"vit": dict(marker="o", ls="-"), "cnn": dict(marker="s", ls="--"), "pixel": dict(marker="^", ls=":")}
    seen = []
    for r in rows:
        key = (r["variant"], r["model"])
        if key not in seen:
            seen.append(key)
    return [(k, styles.get(k[1], dict(marker="x", ls="-"))) for k in seen]


def _distance_figure(plt, attn, path):
    # Left: per layer and head, for the ViT on the most data (seed 0, or the first seed) and the pixel model.
    panels = []
    for kind in ("vit", "pixel"):
        rs = [r for r in attn if r["model"] == kind]
        if rs:
            big = max(r["size"] for r in rs)
            panels.append(min((r for r in rs if r["size"] == big), key=lambda r: r["seed"]))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.6 * (len(panels) + 1), 3.8))
    for ax, r in zip(axes, panels, strict=False):
        d, d0 = np.asarray(r["attention_distance"]), np.asarray(r["attention_distance_init"])
        layers = np.arange(1, d.shape[0] + 1)
        for h in range(d.shape[1]):
            ax.scatter(layers + 0.06 * (h - d.shape[1] / 2), d[:, h], s=18, color=f"C{h}", label=f"head {h + 1}")
        ax.plot(layers, d0.mean(1), "k+", ms=9, label="at initialisation (head mean)")
        for j, (name, val) in enumerate(r["reference_distance"].items()):
            ax.axhline(val, color="gray", ls=[":", "--"][j % 2], lw=1, label=f"{name.replace('_', ' ')}: {val:.1f} px")
        ax.set_xticks(layers)
        ax.set_xlabel("layer")
        ax.set_ylabel("mean attention distance (pixels)")
        ax.set_title(f"{r['model_name']}, {r['size']:,} images, seed {r['seed']}", fontsize=9)
        ax.legend(fontsize=6)
    # Right: the ViT's per-layer mean (over heads and seeds) against training-set size.
    ax = axes[-1]
    vit = [r for r in attn if r["model"] == "vit"]
    sizes = sorted({r["size"] for r in vit})
    if vit:
        num_layers = len(vit[0]["attention_distance"])
        for layer in range(num_layers):
            per = [[np.mean(r["attention_distance"][layer]) for r in vit if r["size"] == s] for s in sizes]
            ax.errorbar(
                sizes,
                [np.mean(p) for p in per],
                yerr=[np.std(p) for p in per],
                marker="o",
                capsize=3,
                label=f"layer {layer + 1}",
            )
        ref = vit[0]["reference_distance"]
        for j, (name, val) in enumerate(ref.items()):
            ax.axhline(val, color="gray", ls=[":", "--"][j % 2], lw=1, label=name.replace("_", " "))
        ax.set_xscale("log")
    ax.set_xlabel("training images")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_title("ViT: head-mean distance per layer vs data", fontsize=9)
    ax.legend(fontsize=6)
    common.save_figure(fig, path)
