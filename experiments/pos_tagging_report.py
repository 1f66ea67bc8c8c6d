"""The POS-tagging experiment's results, described: ``report`` (``summary.md``, ``accuracy.png``,
``window.png`` and ``attention_map.png`` from ``results.jsonl`` and the runs' ``attention_map.json``
alone), for Brown (``make pos``) and People's Daily (``make pos-zh``: the note's word and sentence too).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from absl import logging

from experiments import common
from experiments.tables import markdown_table


def _focus_cells(r: dict) -> list[str]:
    """A Chinese run's columns: the note's word right in dev+test, words containing it, its example sentence."""
    if "focus_word" not in r:
        return ["", "", ""]
    ex = r["example"]
    return [
        f"{r['focus_correct']}/{r['focus_tokens']}",
        f"{r['focus_substring_correct']}/{r['focus_substring_tokens']}",
        " ".join(f"{w}/{t}" for w, t in zip(ex["words"], ex["pred"], strict=True)),
    ]


def table(results: list[dict]) -> str:
    """The summary's table: accuracy on all, ambiguous and OOV tokens per model (+ the note's word in Chinese)."""
    header = ["model", "test acc", "ambiguous acc", "OOV acc", "train time (s)", "steps", "params"]
    rows = [
        [r["variant"], f"{100 * r['test_accuracy']:.2f}", f"{100 * r['test_ambiguous_accuracy']:.2f}",
         f"{100 * r['test_oov_accuracy']:.2f}", f"{r['train_time_s']:.0f}", r["steps"], f"{r['params']:,}"]
        for r in results
    ]  # fmt: skip
    if not any("focus_word" in r for r in results):
        return markdown_table(header, rows)
    word = next(r["focus_word"] for r in results if "focus_word" in r)
    header += [f"{word} in dev+test", f"words containing {word}", "example sentence (predicted tags)"]
    rows = [row + _focus_cells(r) for row, r in zip(rows, results, strict=True)]
    text = markdown_table(header, rows)
    golds = {" ".join(r["example"]["gold"]) for r in results if r.get("example", {}).get("gold")}
    return text + (f"\n\nExample gold (the note's reading, PKU tags): {golds.pop()}" if golds else "")


def report(folder: Path) -> str:
    """``summary.md`` (``table``) and the figures of a results folder, from its files alone."""
    folder = Path(folder)
    results = sorted(common.read_jsonl(folder / "results.jsonl"), key=lambda r: r["variant"])
    if not results:
        raise FileNotFoundError(f"no results.jsonl under {folder}: run the experiment first")
    text = table(results)
    (folder / "summary.md").write_text(text + "\n")
    plt = common.pyplot()
    _accuracy_figure(plt, results, folder / "accuracy.png")
    _window_figure(plt, results, folder / "window.png")
    maps = sorted(folder.glob("*/attention_map.json"), key=lambda p: p.parent.name != "attention")
    if maps:  # the full-attention model's when there is one
        _attention_map_figure(plt, maps[0], folder / "attention_map.png")
    return text


def _accuracy_figure(plt, results: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(1.2 * len(results) + 2, 3.5))
    x = np.arange(len(results))
    bars = [("test_accuracy", "all tokens"), ("test_ambiguous_accuracy", "ambiguous"), ("test_oov_accuracy", "OOV")]
    for i, (key, label) in enumerate(bars):
        ax.bar(x + (i - 1) * 0.27, [100 * r[key] for r in results], 0.27, label=label)
    ax.set_xticks(x, [r["variant"] for r in results], rotation=20)
    ax.set_ylim(60, 100)
    ax.set_ylabel("test accuracy (%)")
    pku_run = any(r["tagset"] == "pku" for r in results)
    ax.set_title("People's Daily POS tagging, 44 PKU tags" if pku_run else "Brown POS tagging, universal tags")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
    common.save_figure(fig, path)


def _window_figure(plt, results: list[dict], path: Path) -> None:
    """Accuracy against the attention window (full attention at the right), the MLP and CNN as lines."""
    attention = [r for r in results if r["model"] == "attention" and r["posenc"] != "none"]
    windowed = sorted((r["window"], r) for r in attention if r["window"] is not None)
    full = [r for r in results if r["variant"] == "attention"]
    if not (windowed or full):
        return
    pts = [(str(w), r) for w, r in windowed] + [("full", r) for r in full]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for key, label in [("test_accuracy", "all tokens"), ("test_ambiguous_accuracy", "ambiguous")]:
        ax.plot([p for p, _ in pts], [100 * r[key] for _, r in pts], "o-", label=label)
    for r in [r for r in results if r["model"] in ("mlp", "cnn")]:
        ax.axhline(100 * r["test_accuracy"], color="gray", ls=":" if r["model"] == "mlp" else "--", lw=1)
        ax.annotate(f"{r['variant']} (all tokens)", (0, 100 * r["test_accuracy"]), fontsize=7, color="gray",
                    xytext=(2, 2), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("attention window (+- words)")
    ax.set_ylabel("test accuracy (%)")
    ax.legend()
    common.save_figure(fig, path)


def _attention_map_figure(plt, amap_path: Path, path: Path) -> None:
    """Each layer's head-averaged attention of one sentence; rows: queries with their predicted tags."""
    amap = json.loads(amap_path.read_text())
    layers = amap["weights"]
    _use_cjk_font(plt, amap["words"])
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 4.4))
    axes = np.atleast_1d(axes)
    labels = [f"{w} ({p})" for w, p in zip(amap["words"], amap["pred"], strict=True)]
    for li, (ax, w) in enumerate(zip(axes, layers, strict=True)):
        ax.imshow(np.asarray(w), cmap="viridis")
        rotation = 90 if all(w.isascii() for w in amap["words"]) else 0  # short Chinese words: upright
        ax.set_xticks(range(len(labels)), amap["words"], rotation=rotation, fontsize=7)
        ax.set_yticks(range(len(labels)), labels if li == 0 else amap["words"], fontsize=7)
        ax.set_title(f"layer {li + 1} (mean over heads)")
    what = f"a sentence with ambiguous '{amap['word']}'" if "word" in amap else "the example sentence"
    fig.suptitle(f"model '{amap_path.parent.name}': attention for {what}; rows: query (predicted tag)")
    common.save_figure(fig, path)


def _use_cjk_font(plt, words):
    """Prefer an installed CJK font (make zh-font) when the labels are not ASCII, so Chinese shows."""
    if all(w.isascii() for w in words):
        return
    from matplotlib import font_manager

    known = ("WenQuanYi Micro Hei", "Noto Sans CJK SC", "Noto Sans SC", "SimHei")
    names = {f.name for f in font_manager.fontManager.ttflist}
    if not names & set(known):  # installed after matplotlib built its font cache
        for path in font_manager.findSystemFonts():
            if any(k in path.lower() for k in ("wqy", "cjk", "simhei")):
                font_manager.fontManager.addfont(path)
        names = {f.name for f in font_manager.fontManager.ttflist}
    cjk = [n for n in known if n in names]
    if cjk:
        plt.rcParams["font.sans-serif"] = cjk + list(plt.rcParams["font.sans-serif"])
    else:
        logging.warning("no CJK font found (run `make zh-font`): Chinese labels will show as boxes")
