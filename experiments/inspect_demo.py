"""attnlab.inspect on a trained model: a small committed checkpoint, its heads' maps and importance.

Commands:

    make inspect-demo           # = python -m experiments.inspect_demo --out results/inspect
    python -m experiments.inspect_demo --out docs/results/inspect     # the committed copy
    python -m experiments.inspect_demo --report docs/results/inspect    # figures from the results files alone

The model is the positional-encoding experiment's (``experiments/posenc.py``, config ``default``):
an ``nn.Encoder`` with RoPE, d_model 32, 2 layers, 4 heads, trained 600 steps on the shift task
(output the token 3 places to the left; the answer is a relative position). ``--out`` gets:

* ``shift_rope.npz``: the trained parameters (``nnx.state(model, nnx.Param)`` flattened by path,
  ~80 KB) and ``shift_rope.json`` (the config, the command, the accuracy): the committed checkpoint
  ``notebooks/inspect.ipynb`` loads with ``load_checkpoint``;
* ``heads.json``: per layer and head, ``inspect.summarise`` of the weights on the 256 eval
  sequences of length 32 (entropy, mean distance, mass on offsets -3..0, first token) and the eval
  accuracy with that head zero- and mean-ablated (``inspect.head_sweep``, one vmapped program each);
* ``weights.npz``: the weights of the first eval sequence, ``[L, N, T, T]``;
* ``attention_grid.png`` (layer x head) and ``head_importance.png`` (accuracy drop per head),
  drawn from the two files above by ``report``;
* ``run.json``: the command, date, machine (``--machine``), wall and CPU time and load of the run, the
  analysis time and the checkpoint's own command and training time (``experiments.provenance``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab import inspect, nn
from attnlab import train as train_lib
from experiments import common, posenc, provenance
from experiments.configs import posenc as posenc_config

SCHEME, SEED, OFFSETS = "rope", 0, (-3, -2, -1, 0)
PATCHES = (((1, 0),), ((1, 1),), ((1, 0), (1, 1)), ((0, 2), (0, 3)))  # head sets patched from the source batch
NAME = "shift_rope"


def config():
    return posenc_config.get_config("default")


def _flat_params(model) -> dict[str, np.ndarray]:
    state = nnx.state(model, nnx.Param)
    return {"/".join(str(p) for p in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(state)}


def save_checkpoint(model, folder: Path, meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(folder / f"{NAME}.npz", **_flat_params(model))
    (folder / f"{NAME}.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_checkpoint(folder) -> tuple[nn.TokenClassifier, dict]:
    """The committed model: ``posenc.build_model(default, "rope", 0)`` with the saved parameters.

    Raises:
        ValueError: the file's parameters do not match the model's (names or shapes).
    """
    folder = Path(folder)
    meta = json.loads((folder / f"{NAME}.json").read_text())
    model = posenc.build_model(config(), SCHEME, SEED)
    saved = dict(np.load(folder / f"{NAME}.npz"))
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    names = {"/".join(str(p) for p in path) for path, _ in flat}
    if names != set(saved):
        raise ValueError(f"load_checkpoint: {folder} holds parameters {sorted(set(saved) ^ names)} the model lacks")
    for path, v in flat:
        key = "/".join(str(p) for p in path)
        if saved[key].shape != v[...].shape:
            raise ValueError(f"load_checkpoint: {key} has shape {saved[key].shape}, the model {v[...].shape}")
        v[...] = jnp.asarray(saved[key])
    nnx.update(model, state)
    return model, meta


def eval_batch(cfg=None) -> dict:
    """The 256 eval sequences of length L = 32 (``posenc.eval_sets``): inputs, targets, lengths."""
    cfg = config() if cfg is None else cfg
    return posenc.eval_sets(cfg)[cfg.task.train_length]


def source_batch(batch: dict, vocab: int) -> dict:
    """Other random tokens with the same lengths (seed 1), and their shift-task targets."""
    x = np.random.default_rng(1).integers(0, vocab, batch["inputs"].shape)
    k = config().task.shift
    targets = np.where(np.arange(x.shape[1]) >= k, np.roll(x, k, axis=1), batch["targets"])  # x[t - k]; blank for t < k
    return {"inputs": x, "targets": targets, "lengths": batch["lengths"]}


def accuracy_of(targets, lengths):
    """``logits -> token accuracy`` on these targets (a function of the model's output only, for head_sweep)."""
    targets, valid = jnp.asarray(targets), nn.sequence_mask(jnp.asarray(lengths), targets.shape[1])

    def accuracy(logits):
        return jnp.sum((logits.argmax(-1) == targets) & valid) / jnp.sum(valid)

    return accuracy


def analyse(model, batch: dict) -> tuple[dict, np.ndarray]:
    """-> (the heads.json record, the first sequence's weights [L, N, T, T])."""
    x, lengths = jnp.asarray(batch["inputs"]), jnp.asarray(batch["lengths"])
    accuracy = accuracy_of(batch["targets"], lengths)
    src = source_batch(batch, config().task.vocab)
    k = config().task.shift
    graphdef, state = nnx.split(model)

    def agree(logits, targets):  # positions t >= k, where source and target answers differ by construction
        return jnp.mean((logits.argmax(-1) == jnp.asarray(targets))[:, k:])

    @jax.jit
    def run(state, x, lengths, src_x):
        m = nnx.merge(graphdef, state)
        cap = inspect.capture(m, x, lengths, record=("weights",))
        stats = [inspect.summarise(c.weights, offsets=OFFSETS, lengths=lengths) for c in cap.layers]
        sets = inspect.single_heads(m)
        zero = inspect.head_sweep(m, sets, x, lengths, fn=accuracy)
        mean = inspect.head_sweep(m, sets, x, lengths, kind="mean", fn=accuracy)
        patched = [inspect.patch(m, list(p), (src_x, lengths), (x, lengths)) for p in PATCHES]
        patched = [(agree(o, src["targets"]), agree(o, batch["targets"])) for o in patched]
        return accuracy(cap.output), stats, zero, mean, [c.weights[0] for c in cap.layers], patched

    t0 = time.perf_counter()
    base, stats, zero, mean, first, patched = run(state, x, lengths, jnp.asarray(src["inputs"]))
    seconds = time.perf_counter() - t0
    names, counts = inspect.layers(model), inspect.num_heads(model)
    heads, i = [], 0
    for layer, (name, n) in enumerate(zip(names, counts, strict=True)):
        for h in range(n):
            s = {k: np.asarray(v)[h] for k, v in stats[layer].items()}
            heads.append(
                {
                    "layer": layer,
                    "name": name,
                    "head": h,
                    "entropy": round(float(s["entropy"]), 4),
                    "distance": round(float(s["distance"]), 4),
                    "offset_mass": {str(d): round(float(m), 4) for d, m in zip(OFFSETS, s["offset_mass"], strict=True)},
                    "first": round(float(s["first"]), 4),
                    "zero_ablated_accuracy": round(float(zero[i]), 4),
                    "mean_ablated_accuracy": round(float(mean[i]), 4),
                }
            )
            i += 1
    record = {"accuracy": round(float(base), 4), "sequences": int(x.shape[0]), "length": int(x.shape[1])}
    record |= {"offsets": list(OFFSETS), "analysis_s": round(seconds, 1), "heads": heads}
    record["patching"] = [
        {"heads": [list(h) for h in p], "source_answers": round(float(a), 4), "target_answers": round(float(b), 4)}
        for p, (a, b) in zip(PATCHES, patched, strict=True)
    ]
    return record, np.stack([np.asarray(w) for w in first])


# ------------------------------------------------------------------------------------------
# Figures from the results files


def attention_grid(weights: np.ndarray, path, *, title: str = "") -> None:
    """One panel per (layer, head): weights ``[L, N, T, S]`` as images (query rows, key columns)."""
    plt = common.pyplot()
    L, N = weights.shape[:2]
    fig, axes = plt.subplots(L, N, figsize=(2.2 * N, 2.2 * L), squeeze=False)
    for layer in range(L):
        for h in range(N):
            ax = axes[layer, h]
            ax.imshow(weights[layer, h], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(f"layer {layer}, head {h}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[layer, 0].set_ylabel("query t")
    for h in range(N):
        axes[-1, h].set_xlabel("key s")
    if title:
        fig.suptitle(title, fontsize=9)
    common.save_figure(fig, path)


def head_importance(heads: list[dict], base: float, path, *, key: str = "zero_ablated_accuracy") -> None:
    """Heatmap layer x head of the accuracy drop ``base - accuracy with that head ablated``."""
    plt = common.pyplot()
    L = 1 + max(h["layer"] for h in heads)
    N = 1 + max(h["head"] for h in heads)
    drop = np.full((L, N), np.nan)
    for h in heads:
        drop[h["layer"], h["head"]] = 100 * (base - h[key])  # points
    fig, ax = plt.subplots(figsize=(1.1 * N + 1.5, 1.0 * L + 1.0))
    im = ax.imshow(drop, cmap="magma_r", vmin=0.0, vmax=max(1e-6, float(np.nanmax(drop))))
    for (layer, h), d in np.ndenumerate(drop):
        ax.text(h, layer, f"{d:.0f}", ha="center", va="center", fontsize=9, color="tab:blue")
    ax.set_xticks(range(N))
    ax.set_yticks(range(L))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"accuracy drop (points) when one head is {key.split('_')[0]}-ablated", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05, label="points")
    common.save_figure(fig, path)


def table(folder) -> str:
    """The per-head table of ``heads.json`` (markdown; no side effects: ``make docs`` calls it)."""
    record = json.loads((Path(folder) / "heads.json").read_text())
    rows = [
        [h["layer"], h["head"], f"{h['entropy']:.2f}", f"{h['distance']:.2f}", f"{h['offset_mass']['-3']:.2f}",
         f"{100 * h['zero_ablated_accuracy']:.1f}", f"{100 * h['mean_ablated_accuracy']:.1f}"]
        for h in record["heads"]
    ]  # fmt: skip
    header = ["layer", "head", "entropy", "distance", "mass on t-3", "acc. zero-ablated %", "acc. mean-ablated %"]
    patch_rows = [
        [
            ", ".join(f"({a}, {b})" for a, b in p["heads"]),
            f"{100 * p['source_answers']:.1f}",
            f"{100 * p['target_answers']:.1f}",
        ]
        for p in record["patching"]
    ]
    patching = common.markdown_table(
        ["patched (layer, head)", "answers the source's token %", "the target's %"], patch_rows
    )
    return f"Accuracy {100 * record['accuracy']:.1f}% on {record['sequences']} sequences of length " + (
        f"{record['length']}.\n\n" + common.markdown_table(header, rows) + "\n\nActivation patching from "
        "other random tokens (positions t >= 3):\n\n" + patching
    )


def report(folder) -> str:
    """Draws ``attention_grid.png`` and ``head_importance.png`` from the results files; returns ``table``."""
    folder = Path(folder)
    record = json.loads((folder / "heads.json").read_text())
    weights = np.load(folder / "weights.npz")["weights"]
    attention_grid(weights, folder / "attention_grid.png", title="shift task (RoPE): eval sequence 0")
    head_importance(record["heads"], record["accuracy"], folder / "head_importance.png")
    return table(folder)


def main(argv) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/inspect", help="folder for the checkpoint, results and figures")
    parser.add_argument("--report", default=None, help="only redraw the figures from this folder's results")
    parser.add_argument("--retrain", action="store_true", help="train again even if --out holds the checkpoint")
    parser.add_argument("--machine", default=None, help="how run.json describes the machine (default: its CPU)")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report))
        return
    started = provenance.start()
    out = Path(args.out)
    cfg = config()
    if args.retrain or not (out / f"{NAME}.npz").exists():
        train_and_save(cfg, out)
    model, meta = load_checkpoint(out)  # what the notebook gets
    record, weights = analyse(model, eval_batch(cfg))
    (out / "heads.json").write_text(json.dumps(record, indent=1) + "\n")
    np.savez_compressed(out / "weights.npz", weights=weights.astype(np.float32))
    checkpoint = {"command": meta["command"], "train_time_s": meta["train_time_s"]}
    run = provenance.finish(started, command=provenance.command("experiments.inspect_demo", argv), machine=args.machine)
    provenance.write(out, {**run, "analysis_s": record["analysis_s"], "checkpoint": checkpoint})
    print(report(out))


def train_and_save(cfg, out: Path) -> None:
    """600 AdamW steps of the posenc default config with RoPE (about 10 s), saved to ``out``."""
    model = posenc.build_model(cfg, SCHEME, SEED)
    t = cfg.train
    tx = train_lib.adamw_cosine(t.learning_rate, t.warmup_steps, t.num_steps, t.weight_decay)

    def loss_fn(m, batch, key):
        logits = m(batch["inputs"], batch["lengths"], dropout_key=key)
        return train_lib.masked_cross_entropy(logits, batch["targets"], batch["lengths"])

    model, records = train_lib.train(
        model, tx, loss_fn, posenc.make_batch_fn(cfg, SEED), num_steps=t.num_steps, seed=SEED, log_every=t.log_every
    )
    acc = posenc.evaluate(model, posenc.eval_sets(cfg), cfg.task.train_length)
    meta = {
        "command": f"python -m experiments.inspect_demo --retrain --out {out}",
        "model": f"experiments.posenc.build_model(posenc default config, {SCHEME!r}, seed={SEED})",
        "steps": t.num_steps,
        "train_time_s": round(common.train_time(records), 1),
        "accuracy": acc,
        "config": json.loads(cfg.to_json_best_effort()),
    }
    save_checkpoint(model, out, meta)


if __name__ == "__main__":
    main(sys.argv[1:])
