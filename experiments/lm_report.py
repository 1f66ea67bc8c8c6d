"""The packed-LM experiment's results, described: ``report`` writes ``summary.md`` (``table``, ``per_seed``,
``reading``) and ``lm.png`` (training loss against training seconds, every run) from ``results.jsonl`` alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments import common, figures
from experiments.tables import markdown_table, span

LAYOUTS = ("packed", "padded")


def _results(folder: Path) -> list[dict]:
    results = common.read_jsonl(Path(folder) / "results.jsonl")
    if not results:
        raise FileNotFoundError(f"no results in {Path(folder) / 'results.jsonl'}: run the experiment first")
    return results


def _pairs(results: list[dict]) -> dict[int, dict[str, dict]]:
    """``{seed: {layout: record}}`` for the seeds that ran both layouts."""
    by_seed: dict[int, dict[str, dict]] = {}
    for r in results:
        by_seed.setdefault(r["seed"], {})[r["layout"]] = r
    return {s: runs for s, runs in sorted(by_seed.items()) if all(k in runs for k in LAYOUTS)}


def _mean(runs: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in runs]))


def table(folder: Path) -> str:
    """Per layout, mean ± std over seeds: held-out loss per token, tokens/s; means of the times and shares."""
    results = _results(folder)
    header = ["layout", "held-out loss / token (nats)", "tokens/s (train)", "train s", "compile s", "wall s",
              "padding share", "rows / step", "shapes", "seeds"]  # fmt: skip
    rows = []
    for layout in LAYOUTS:
        runs = [r for r in results if r["layout"] == layout]
        if not runs:
            continue
        loss, speed = (common.summarize(runs, ("layout",), k)[(layout,)] for k in ("heldout_loss", "tokens_per_s"))
        rows.append(
            [layout, common.mean_std(loss, digits=4), common.mean_std(speed, digits=0)]
            + [f"{_mean(runs, k):.1f}" for k in ("train_s", "compile_s", "wall_s")]
            + [f"{100 * _mean(runs, 'padding_share'):.1f}%", f"{_mean(runs, 'rows_per_step'):.1f}"]
            + [max(r["shapes"] for r in runs), len(runs)]
        )
    return markdown_table(header, rows)


def per_seed(folder: Path) -> str:
    """Per seed: both layouts' held-out loss, their difference, and packed's speed-up in tokens/s and wall time."""
    rows = []
    for seed, runs in _pairs(_results(folder)).items():
        p, q = runs["packed"], runs["padded"]
        losses = [
            f"{p['heldout_loss']:.4f}",
            f"{q['heldout_loss']:.4f}",
            f"{p['heldout_loss'] - q['heldout_loss']:+.1e}",
        ]
        speed = [f"{p['tokens_per_s'] / q['tokens_per_s']:.2f}x", f"{q['wall_s'] / p['wall_s']:.2f}x"]
        rows.append([seed, *losses, *speed])
    header = ["seed", "packed loss", "padded loss", "packed - padded", "tokens/s packed / padded",
              "wall time padded / packed"]  # fmt: skip
    return markdown_table(header, rows)


def _seeds(seeds) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds)) if seeds else "none"


def reading(folder: Path) -> str:
    """What holds in every seed: the loss difference against the seed spread, the range of the speed-up."""
    results = _results(folder)
    pairs = _pairs(results)
    if not pairs:
        return "No seed ran both layouts yet.\n"
    diffs = [abs(r["packed"]["heldout_loss"] - r["padded"]["heldout_loss"]) for r in pairs.values()]
    spread = [common.summarize(results, ("layout",), "heldout_loss")[(k,)] for k in LAYOUTS]
    ratios = [r["packed"]["tokens_per_s"] / r["padded"]["tokens_per_s"] for r in pairs.values()]
    share = np.mean([r["padded"]["padding_share"] for r in pairs.values()])
    packed_share = np.mean([r["packed"]["padding_share"] for r in pairs.values()])
    rows = [r["padded"]["rows_per_step"] / r["packed"]["rows_per_step"] for r in pairs.values()]
    r0, pct = results[0], lambda x: f"{100 * x:.1f}%"
    met = [s for s, r in zip(pairs, ratios, strict=True) if r >= 1.5]
    target = "in every seed" if len(met) == len(pairs) else f"in {len(met)} of {len(pairs)} seeds ({_seeds(met)})"
    sentences = [
        f"Read from {len(pairs)} seeds ({', '.join(map(str, pairs))}), each layout once per seed, alternating in "
        "one process.",
        f"Held-out loss: packed and padded differ by at most {max(diffs):.1e} nats/token within a seed, against a "
        f"spread over seeds (std) of {spread[0][1]:.1e} (packed) and {spread[1][1]:.1e} (padded).",
        f"Tokens/s, packed over padded: {span(ratios, lambda x: f'{x:.2f}')}x, so the 1.5x target is met {target}.",
        f"Padded rows are {pct(share)} padding, packed rows {pct(packed_share)} (the last row of a step, and the "
        f"row count rounded up to a compiled shape): a padded step has {span(rows, lambda x: f'{x:.2f}')}x the rows "
        "of a packed one, the speed-up to expect where a step's cost follows its rows.",
        f"Data: {r0['chunks'][0]:,} training and {r0['chunks'][1]:,} held-out chunks; {pct(r0['whole_share'])} of "
        f"the training paragraphs fit one row whole; vocabulary {r0['vocab_size']:,}, {pct(r0['heldout_oov'])} of "
        "the held-out targets OOV.",
    ]
    return " ".join(sentences) + "\n"


def report(folder: Path) -> str:
    """``summary.md`` (the tables and the reading) and ``lm.png``; returns the summary's text."""
    folder = Path(folder)
    text = f"{table(folder)}\n\n{per_seed(folder)}\n\n{reading(folder)}"
    (folder / "summary.md").write_text(text)
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    results, labels = _results(folder), set()
    for r in sorted(results, key=lambda r: (r["layout"], r["seed"])):
        c = np.asarray(r["curve"], dtype=float)  # [n, 3]: step, seconds, loss
        style = "-" if r["layout"] == "packed" else "--"
        color = {"packed": "tab:blue", "padded": "tab:orange"}[r["layout"]]
        label = f"{r['layout']} (seeds {', '.join(str(x['seed']) for x in results if x['layout'] == r['layout'])})"
        ax.plot(c[:, 1], c[:, 2], style, color=color, label=label if label not in labels else None, alpha=0.8)
        labels.add(label)
    figures.style(ax, xlabel="training seconds", ylabel="training loss / token (nats)",
                         title="same documents per step: packed vs padded rows", legend=7)  # fmt: skip
    common.save_figure(fig, folder / "lm.png")
    return text
