"""The speech experiment's results, described: ``report`` (tables and figures from the results folder
alone), the docs' tables (``headline``: CER by encoder window and decoding speed; ``pilots``), and the
two small pieces the run shares with them (``monotonicity`` of a cross-attention map, the window
names' order and labels).

``report(folder)`` reads ``results.jsonl``, ``decoding.jsonl`` (+ the two ``decoding-*.npy``),
``scaling.jsonl`` and ``maps-<window>.npz`` and writes ``summary.md``, ``cer_vs_window.png``,
``scaling.png``, ``alignment.png`` and ``encoder_maps.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from experiments import common
from experiments.tables import markdown_table, mean_std

HEADLINE = ("test_greedy_cer", "test_beam4_cer", "test_greedy_wer", "new_voice_greedy_cer", "new_voice_beam4_cer")


def monotonicity(cross: np.ndarray) -> float:
    """Pearson correlation of decoder step and attention centroid (frame) of a ``[U, S]`` cross-attention map."""
    cross = np.asarray(cross, np.float64)
    centroid = (cross * np.arange(cross.shape[1])).sum(1) / np.maximum(cross.sum(1), 1e-12)
    if len(centroid) < 2 or np.std(centroid) == 0:
        return 0.0
    return float(np.corrcoef(np.arange(len(centroid)), centroid)[0, 1])


def window_order(w):
    """Sort key of window names: full first, then the widest window first."""
    return (0, 0) if w == "full" else (1, -int(w))


def window_label(w) -> str:
    """``"full"`` or ``"±w"``."""
    return "full" if w == "full" else f"±{w}"


# ------------------------------------------------------------------------------------------
# summary.md


def _error_table(results: list[dict], windows: list) -> str:
    cols = [k for k in results[0] if k.endswith("_cer") or k.endswith("_wer")]
    rows = []
    for w in windows:
        rs = [r for r in results if r["window"] == w]
        cells = [mean_std(common.summarize(rs, ("window",), k)[(w,)], scale=100) for k in cols]
        rows.append([window_label(w), *cells, str(len(rs)), f"{np.mean([r['train_time_s'] for r in rs]):.0f}"])
    header = [
        "encoder attention",
        *(k.replace("_", " ").replace(" cer", " CER %").replace(" wer", " WER %") for k in cols),
    ]
    return markdown_table([*header, "seeds", "train s"], rows)


def _decoding_line(folder: Path) -> str:
    dec = {r["method"]: r for r in common.read_jsonl(folder / "decoding.jsonl")}
    if len(dec) != 2:
        return ""
    same = bool(np.array_equal(*(np.load(folder / f"decoding-{m}.npy") for m in ("cached", "recompute"))))
    c, r = dec["cached"], dec["recompute"]
    return (
        f"\n\nGreedy decoding of {c['tokens']} tokens (batch {c['batch']}): cached "
        f"{c['seconds']:.3f} s, recomputed {r['seconds']:.3f} s: "
        f"{r['seconds'] / c['seconds']:.1f}x faster; identical tokens: {same}."
    )


def _scaling_table(scaling: list[dict]) -> str:
    if not scaling:
        return ""
    rows = [
        [r["window"], r["frames"], r["encoder_frames"], f"{r['step_s']:.3f}", f"{1e3 * r['step_s_per_frame']:.2f}",
         f"{r['peak_bytes'] / 2**20:.1f}"]
        for r in sorted(scaling, key=lambda r: (window_order(r["window"]), r["frames"]))
    ]  # fmt: skip
    header = ["encoder", "input frames", "encoder frames", "step s", "ms / encoder frame", "compiled MiB"]
    return "\n\n" + markdown_table(header, rows)


def _alignment_text(results: list[dict], windows: list, mono: dict) -> str:
    text = ""
    if mono:
        text += "\n\nCross-attention of test utterance 0 (last decoder block, head mean): correlation of the decoder "
        text += "step with the attended frame (centroid), 1 = a monotonic alignment: "
        text += ", ".join(f"{window_label(w)} {m:.2f}" for w, m in mono.items()) + "."
    with_alignment = [r for r in results if "test_alignment_mean" in r]
    if with_alignment:
        seeds = sorted({r["seed"] for r in with_alignment})
        n_utt = sorted({r["test_alignment_utterances"] for r in with_alignment})
        text += "\n\nThe same correlation over every test utterance (mean over utterances, then mean ± sd over "
        text += f"seeds {', '.join(map(str, seeds))}; {'/'.join(map(str, n_utt))} utterances per model; "
        text += "min: the lowest single utterance of any seed): "
        means = common.summarize(with_alignment, ("window",), "test_alignment_mean")
        lows = {w: min(r["test_alignment_min"] for r in with_alignment if r["window"] == w) for (w,) in means}
        parts = [
            f"{window_label(w)} {mean_std(means[(w,)], digits=3)} (min {lows[w]:.2f})" for w in windows if (w,) in means
        ]
        text += ", ".join(parts) + "."
    return text


def report(folder: Path) -> str:
    """``summary.md`` and the figures of a results folder, from its files alone; returns the summary."""
    folder = Path(folder)
    results = common.read_jsonl(folder / "results.jsonl")
    if not results:
        raise FileNotFoundError(f"no results in {folder / 'results.jsonl'}: run the experiment first")
    windows = sorted({r["window"] for r in results}, key=window_order)
    scaling = common.read_jsonl(folder / "scaling.jsonl")
    maps = {w: np.load(folder / f"maps-{w}.npz") for w in windows if (folder / f"maps-{w}.npz").exists()}
    mono = {w: monotonicity(z["cross"]) for w, z in maps.items()}
    text = _error_table(results, windows) + _decoding_line(folder) + _scaling_table(scaling)
    text += _alignment_text(results, windows, mono)
    (folder / "summary.md").write_text(text + "\n")
    _figures(folder, results, windows, scaling, maps, mono)
    return text


# ------------------------------------------------------------------------------------------
# Figures


def _figures(folder: Path, results, windows, scaling, maps, mono) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    x = np.arange(len(windows))
    for k in ("test_greedy_cer", "new_voice_greedy_cer"):
        ax.plot(x, [100 * np.mean([r[k] for r in results if r["window"] == w]) for w in windows], "o-", label=k[:-4])
    ax.set_xticks(x, [window_label(w) for w in windows])
    ax.set(xlabel="encoder self-attention", ylabel="CER (%)")
    ax.legend()
    common.save_figure(fig, folder / "cer_vs_window.png")
    if scaling:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for w in sorted({r["window"] for r in scaling}, key=window_order):
            rs = sorted((r for r in scaling if r["window"] == w), key=lambda r: r["frames"])
            ax.plot([r["frames"] for r in rs], [1e3 * r["step_s_per_frame"] for r in rs], "o-", label=window_label(w))
        ax.set(xlabel="input frames (10 ms)", ylabel="encoder step ms / frame")
        ax.legend()
        common.save_figure(fig, folder / "scaling.png")
    if maps:
        fig, axes = plt.subplots(1, len(maps), figsize=(3.2 * len(maps), 3), squeeze=False)
        for a, (w, z) in zip(axes[0], maps.items(), strict=True):
            a.imshow(z["cross"], aspect="auto", cmap="viridis")
            a.set(xlabel="encoder frame", title=f"{window_label(w)}: r = {mono[w]:.2f}")
        axes[0, 0].set_ylabel("decoder step")
        fig.suptitle(f"cross-attention (last decoder block, head mean): {maps[next(iter(maps))]['text']}")
        common.save_figure(fig, folder / "alignment.png")
        fig, axes = plt.subplots(1, len(maps), figsize=(3 * len(maps), 3), squeeze=False)
        for a, (w, z) in zip(axes[0], maps.items(), strict=True):
            a.imshow(z["encoder"], cmap="viridis")
            a.set_title(window_label(w) if w == "full" else f"window ±{w}")
        common.save_figure(fig, folder / "encoder_maps.png")


# ------------------------------------------------------------------------------------------
# The docs' tables


def headline(folder, *, decoding: bool = True) -> str:
    """README's speech table: CER by encoder window (greedy and beam, seen and held-out voice), decoding speed."""
    folder = Path(folder)
    results = common.read_jsonl(folder / "results.jsonl")
    rows = []
    for w in sorted({r["window"] for r in results}, key=window_order):
        stats = {k: common.summarize(results, ("window",), k)[(w,)] for k in (*HEADLINE, "train_time_s")}
        seeds = stats["train_time_s"][2]  # (mean, population sd, seeds)
        cells = [mean_std(v, scale=100) if seeds > 1 else f"{100 * v[0]:.1f}" for v in stats.values()]
        ms = "" if w == "full" else f" ({4 * int(w) * 10} ms)"  # 4x subsampled 10 ms frames
        rows.append([window_label(w) + ms, *cells[:-1], str(seeds), f"{stats['train_time_s'][0]:.0f}"])
    header = ["encoder self-attention", "CER % greedy", "CER % beam 4", "WER % greedy", "new voice CER % greedy"]
    text = markdown_table([*header, "new voice CER % beam 4", "seeds", "train s"], rows) + "\n"
    if not decoding:
        return text
    dec = {d["method"]: d for d in common.read_jsonl(folder / "decoding.jsonl")}
    c, r = dec["cached"], dec["recompute"]
    return text + (
        f"\nGreedy decoding of {c['tokens']} tokens (batch {c['batch']}): KV cache {c['seconds']:.2f} s, recomputing "
        f"the prefix {r['seconds']:.2f} s: **{r['seconds'] / c['seconds']:.1f}x** (same tokens).\n"
    )


PILOTS = (
    ("cmvn", "CMVN, random batches"),
    ("cmvn_ctc", "CMVN + 0.3 CTC, random batches"),
    ("default_1000steps", "CMVN + 0.3 CTC, similar-length batches"),
)


def pilots(folder) -> str:
    """The speech pilots, full attention (``<folder>/<pilot>/results.jsonl``; commands in its run.json)."""
    rows = []
    for name, what in PILOTS:
        r = common.read_jsonl(Path(folder) / name / "results.jsonl")[0]
        steps = json.loads((Path(folder) / name / "config.json").read_text())["train"]["num_steps"]
        cells = [f"{100 * r[k]:.1f}" for k in ("test_greedy_cer", "test_beam4_cer", "new_voice_greedy_cer")]
        rows.append([what, str(steps), *cells, f"{r['final_train_loss']:.3f}", f"{r['train_time_s']:.0f}"])
    header = ["full attention", "steps", "CER % greedy", "CER % beam 4", "new voice CER % greedy"]
    return markdown_table([*header, "final train loss", "train s"], rows) + "\n"
