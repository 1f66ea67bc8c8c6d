"""The DETR experiment's results, described: ``report`` (``summary.md``, ``learning_curve.png``,
``predictions.png`` and ``attention.png`` from a results folder alone), ``seed_spread``, and
``docs_report`` (the report without its long dev curve, for ``docs/detr.md``).

A results folder holds ``<variant>/results.jsonl`` and ``<variant>/items<range>[_seed<k>]/``
(``run_name``) with ``metrics.jsonl`` and ``examples.npz``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnlab.data import canvases, fashion_mnist
from attnlab.nn import detr as detr_lib
from experiments import common

CLASS_NAMES = {"fashion_mnist": fashion_mnist.CLASSES, "digits": tuple(str(i) for i in range(10))}


def run_name(items: str, seed: int) -> str:
    """A run's folder under ``<out>/<variant>/``: ``items1-2`` for seed 0, ``items1-2_seed1`` for others."""
    return f"items{items}" if seed == 0 else f"items{items}_seed{seed}"


def _draw_boxes(ax, boxes, size, labels, color, ls="-"):
    import matplotlib.patches as mpatches

    for (x0, y0, x1, y1), text in zip(canvases.boxes_to_pixels(boxes, size), labels, strict=True):
        ax.add_patch(mpatches.Rectangle((x0 - 0.5, y0 - 0.5), x1 - x0, y1 - y0, fill=False, ec=color, lw=1.2, ls=ls))
        ax.text(x0, y0 - 1, text, color=color, fontsize=5, va="bottom")


def report(folder: Path) -> str:
    plt = common.pyplot()
    folder = Path(folder)
    results = [r for p in sorted(folder.glob("*/results.jsonl")) for r in common.read_jsonl(p)]
    runs = sorted(p.parent for p in folder.glob("*/items*/metrics.jsonl"))
    if not runs:
        raise FileNotFoundError(f"no */items*/metrics.jsonl under {folder}: run the experiment first")
    header = ["variant", "items", "seed", "steps", "train s", "params", "AP@0.5 (all)", "AP@0.5 on 1-2 / 3-4 items"]
    header += ["AP@0.5 by count", "count accuracy"]
    rows = []
    for r in results:
        by = ", ".join(f"{k}: {v:.3f}" for k, v in r["ap50_by_count"].items())
        acc = ", ".join(f"{k}: {v:.3f}" for k, v in r["count_accuracy"].items())
        ranges = " / ".join(f"{v:.3f}" for v in r["ap50_by_items"].values())
        rows.append([r["variant"], r["items"], r.get("seed", 0), r["steps"], r["train_time_s_last_session"],
                     f"{r['params']:,}", f"{r['ap50']:.3f}", ranges, by, acc])  # fmt: skip
    table = common.markdown_table(header, rows)
    spread = seed_spread(results)
    if spread:
        table += "\n\nOver seeds (mean ± sample sd; the held-out canvases are the same for every seed):\n\n"
        table += spread
    curves = {}
    for run_dir in runs:
        dev = [r for r in common.read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "dev"]
        curves[f"{run_dir.parent.name}/{run_dir.name}"] = dev
    curve_rows = [
        [name, r["step"], r["time_s"], f"{r['dev_ap50']:.3f}", f"{r['dev_count_accuracy']:.3f}"]
        for name, dev in curves.items()
        for r in dev
    ]
    table += "\n\nDev curve (held-out dev canvases, evaluated during training):\n\n"
    table += common.markdown_table(["run", "step", "time s", "dev AP@0.5", "dev count accuracy"], curve_rows)
    (folder / "summary.md").write_text(table + "\n")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, dev in curves.items():
        ax.plot([r["step"] for r in dev], [r["dev_ap50"] for r in dev], marker="o", label=name)
    ax.axhline(0.7, color="gray", ls=":", lw=1, label="target 0.7 (1-2 items)")
    ax.set_xlabel("step")
    ax.set_ylabel("dev AP@0.5")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    common.save_figure(fig, folder / "learning_curve.png")

    examples = [(d, np.load(d / "examples.npz")) for d in runs if (d / "examples.npz").exists()]
    if examples:
        dataset = results[0]["dataset"] if results else "fashion_mnist"
        best = max(results, key=lambda r: r["ap50"]) if results else None
        best_run = best and f"{best['variant']}/{run_name(best['items'], best.get('seed', 0))}"
        _figures(plt, examples, CLASS_NAMES[dataset], folder, best=best_run)
    return table


def seed_spread(results: list[dict]) -> str:
    """A table of AP@0.5 (all) and count accuracy, mean ± sample sd, for each (variant, items) with 2+ seeds."""
    ap = common.summarize(results, ["variant", "items"], "ap50", ddof=1)
    count = common.summarize(results, ["variant", "items"], "count_accuracy_all", ddof=1)
    rows = []
    for (variant, items), stat in ap.items():
        if stat[2] < 2:
            continue
        runs = sorted(
            (r for r in results if (r["variant"], r["items"]) == (variant, items)), key=lambda r: r.get("seed", 0)
        )
        seeds = ", ".join(str(r.get("seed", 0)) for r in runs)
        per_seed = ", ".join(f"{r['ap50']:.3f}" for r in runs)
        c = count.get((variant, items))
        c = common.mean_std(c, digits=3) if c and c[2] > 1 else "-"
        rows.append([variant, items, seeds, common.mean_std(stat, digits=3), per_seed, c])
    header = ["variant", "items", "seeds", "AP@0.5 (all)", "per seed", "count accuracy"]
    return common.markdown_table(header, rows) if rows else ""


def _figures(plt, examples, class_names, folder, *, best: str | None = None):
    n = max(len(ex["images"]) for _, ex in examples)
    fig, axes = plt.subplots(len(examples), n, figsize=(1.9 * n, 2.1 * len(examples)), squeeze=False)
    for row, (d, ex) in zip(axes, examples, strict=True):
        scores, cls, is_obj = detr_lib.detections(ex["logits"], ex["pred_boxes"])
        size = ex["images"].shape[-1]
        for i, ax in enumerate(row):
            ax.axis("off")
            if i >= len(ex["images"]):
                continue
            ax.imshow(ex["images"][i], cmap="gray")
            gt = ex["classes"][i] >= 0
            _draw_boxes(ax, ex["boxes"][i][gt], size, [""] * int(gt.sum()), "lime", "--")
            keep = is_obj[i]
            labels = [f"{class_names[c][:7]} {s:.2f}" for c, s in zip(cls[i][keep], scores[i][keep], strict=True)]
            _draw_boxes(ax, ex["pred_boxes"][i][keep], size, labels, "red")
            truth = ",".join(class_names[c][:5] for c in ex["classes"][i][gt])
            ax.set_title(f"{d.parent.name}/{d.name}: truth {truth}", fontsize=5)
    fig.suptitle("held-out canvases: truth (green, dashed), predictions (red: class, score)", fontsize=8)
    common.save_figure(fig, folder / "predictions.png")

    # Cross-attention of each query (last decoder block, mean over heads): the best run's first canvases.
    d, ex = next((e for e in examples if f"{e[0].parent.name}/{e[0].name}" == best), examples[-1])
    shown = min(3, len(ex["images"]))
    q = ex["attention"].shape[1]
    gh, gw = (int(v) for v in ex["grid"])
    size = ex["images"].shape[-1]
    scores, cls, is_obj = detr_lib.detections(ex["logits"], ex["pred_boxes"])
    fig, axes = plt.subplots(shown, q + 1, figsize=(1.6 * (q + 1), 1.8 * shown), squeeze=False)
    for i in range(shown):
        axes[i, 0].imshow(ex["images"][i], cmap="gray")
        axes[i, 0].set_title("canvas", fontsize=6)
        for j in range(q):
            ax = axes[i, j + 1]
            att = ex["attention"][i, j].reshape(gh, gw)
            ax.imshow(ex["images"][i], cmap="gray")
            ax.imshow(att, cmap="inferno", alpha=0.6, extent=(-0.5, size - 0.5, size - 0.5, -0.5))
            if is_obj[i, j]:
                _draw_boxes(ax, ex["pred_boxes"][i, j][None], size, [""], "cyan")
                ax.set_title(f"q{j}: {class_names[cls[i, j]][:7]} {scores[i, j]:.2f}", fontsize=6)
            else:
                ax.set_title(f"q{j}: no object", fontsize=6)
        for ax in axes[i]:
            ax.axis("off")
    title = "each query's cross-attention over the image (last block, head mean)"
    fig.suptitle(f"{d.parent.name}/{d.name}: {title}", fontsize=8)
    common.save_figure(fig, folder / "attention.png")


def docs_report(folder, *, shown: str) -> str:
    """``report`` of ``folder`` without its long dev curve (every evaluation of every run), which stays in the
    folder's ``summary.md``: the page links it as ``<shown>/summary.md``. Writes into ``folder`` as ``report``."""
    head, sep, _ = report(folder).partition("Dev curve (held-out dev canvases, evaluated during training):")
    if not sep:
        return head
    return head.rstrip("\n") + f"\n\nThe dev curve of every run (each evaluation): `{shown}/summary.md`.\n"
