"""Images as sequences of vectors: does self-attention need more data than a CNN?

The course note: an image is a sequence of vectors (patches or pixels), and a CNN is a
simplified self-attention with a fixed window; attention has to learn from data what the
convolution has built in, so it should need more data. Here on Fashion-MNIST (``make data``
installs the Debian package ``dataset-fashion-mnist``): a ViT over 4 x 4 patches and a CNN over
the same patch grid, trained on 1K .. 60K images with several seeds; a pixel-level attention
model with 2-D local attention; and how far each ViT head looks (mean attention distance in
pixels, as in ViT's Figure 7, Dosovitskiy et al. 2020, arXiv 2010.11929).

Commands:

    make images                    # default + pixel variants, then the report (~25 min, 2-core CPU)
    python -m experiments.images --config experiments/configs/images.py:default --out results/images
    python -m experiments.images --config experiments/configs/images.py:pixel --out results/images
    python -m experiments.images --report results/images   # figures + table from the JSON only

Each run (model x size x seed) goes to ``<out>/<variant>/<model>-n<size>-s<seed>/``: ``config.json``,
``metrics.jsonl`` (train loss and batch accuracy every ``log_every`` steps) and ``result.json``
(test accuracy, train-subset accuracy, parameter count, training time, and for attention models
the mean attention distance per layer and head, trained and at initialisation), also appended to
``<out>/<variant>/results.jsonl``; a run with a line there is skipped, so rerunning resumes the sweep.

The report writes ``summary.md`` (accuracy mean +- std over seeds per model and size),
``accuracy_vs_size.png`` (error bars: +- one standard deviation over seeds) and
``attention_distance.png`` (per layer and head for the ViT trained on the most data and for the
pixel model; the layer means against training-set size). Measured numbers: docs/images.md
(generated from docs/results/images/).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from attnlab import inspect, masks, nn, positional
from attnlab import train as train_lib
from attnlab.data import fashion_mnist
from experiments import common
from experiments.images_report import gap_table, report, summarize  # noqa: F401  (re-exported)

# ------------------------------------------------------------------------------------------
# Data


def load_data(dataset: str, eval_count: int | None = None) -> dict:
    """``{"train": (uint8 images [n, Hi, Wi], labels [n]), "test": (...)}``, the dataset's own split."""
    match dataset:
        case "fashion_mnist":
            data = {"train": fashion_mnist.load("train"), "test": fashion_mnist.load("test", count=eval_count)}
        case "digits":
            data = fashion_mnist.load_digits()
        case _:
            raise ValueError(f"dataset must be 'fashion_mnist' or 'digits', got {dataset!r}")
    x, y = data["train"]
    # Normalisation constants of this training split (Fashion-MNIST: fashion_mnist.MEAN / STD).
    data["mean"], data["std"] = float(x.mean() / 255), float(x.std() / 255)
    return data


def subset(num_train: int, size: int, seed: int) -> np.ndarray:
    """Indices of the training subset of ``size`` examples for ``seed`` (all of them when size >= num_train)."""
    if size >= num_train:
        return np.arange(num_train)
    return np.sort(np.random.default_rng([seed, size]).permutation(num_train)[:size])


def make_batch_fn(tokens: np.ndarray, labels: np.ndarray, batch_size: int, seed: int, mean: float, std: float):
    """``step -> {"x": float32 [B, T, F], "y": int32 [B]}``, deterministic in the step.

    The examples are read as a stream of epochs, each a permutation drawn from ``(seed, epoch)``;
    step s takes stream positions ``(s-1) B .. s B - 1`` (a batch may straddle two epochs), so
    every batch has the same shape (one compile) whatever the subset size.
    """
    n = len(labels)
    perms: dict[int, np.ndarray] = {}

    def perm(epoch):
        if epoch not in perms:
            if len(perms) > 2:
                perms.pop(min(perms))
            perms[epoch] = np.random.default_rng([seed, epoch, 7]).permutation(n)
        return perms[epoch]

    def batch_fn(step):
        pos = (step - 1) * batch_size + np.arange(batch_size)
        idx = np.array([perm(e)[i] for e, i in zip(pos // n, pos % n, strict=True)])
        return {
            "x": fashion_mnist.normalize(tokens[idx], mean, std),
            "y": labels[idx].astype(np.int32),
        }

    return batch_fn


# ------------------------------------------------------------------------------------------
# Models


def build_model(m: ml_collections.ConfigDict, image_hw: tuple[int, int], num_classes: int, seed: int) -> nnx.Module:
    """ViT (patches, full attention), CNN (the same patches, 2-D convolutions) or pixel-level local attention."""
    grid = (image_hw[0] // m.patch, image_hw[1] // m.patch)
    rngs = nnx.Rngs(seed)
    common = dict(input_dim=m.patch * m.patch, d_model=m.d_model, num_layers=m.num_layers, dropout_rate=m.dropout)
    match m.kind:
        case "vit" | "pixel":
            attention_mask = masks.window_2d(grid[1], m.radius) if m.kind == "pixel" else None
            backbone = nn.Encoder(
                num_heads=m.num_heads,
                mlp_dim=m.mlp_dim,
                posenc=positional.Sinusoidal2D(*grid),
                attention_mask=attention_mask,
                rngs=rngs,
                **common,
            )
        case "cnn":
            backbone = nn.CNN(kernel_size=m.kernel_size, grid=grid, rngs=rngs, **common)
        case _:
            raise ValueError(f"model kind must be vit, cnn or pixel, got {m.kind!r}")
    return nn.SequenceClassifier(backbone, num_classes, rngs=rngs)


def loss_fn(model, batch, key):
    """Cross-entropy and batch accuracy."""
    return common.classification_loss(model(batch["x"], dropout_key=key), batch["y"])


def make_tx(learning_rate: float, warmup_steps: int, num_steps: int, weight_decay: float):
    """AdamW with warmup + cosine decay (equal settings compile once: the trainer compares by value)."""
    warmup = min(warmup_steps, num_steps // 2)
    return train_lib.adamw_cosine(learning_rate, warmup, num_steps, weight_decay, end_fraction=0.0)


@nnx.jit
def _predict(model, x):
    return model(x).argmax(-1)


def accuracy(model, tokens, labels, batch_size, mean, std) -> float:
    """Accuracy over all examples, in batches of one shape (the last batch padded with repeats)."""
    pred = common.predict(
        lambda t: _predict(model, jnp.asarray(fashion_mnist.normalize(np.asarray(t), mean, std))), [tokens], batch_size
    )
    return int((pred == labels).sum()) / len(labels)


# ------------------------------------------------------------------------------------------
# Mean attention distance


def token_distances(grid: tuple[int, int], patch: int) -> np.ndarray:
    """``[T, T]`` Euclidean distance in pixels between the centres of tokens (patches) t and s."""
    r, c = np.divmod(np.arange(grid[0] * grid[1]), grid[1])
    return patch * np.hypot(r[:, None] - r[None, :], c[:, None] - c[None, :])


def mean_distance(weights: np.ndarray, dist: np.ndarray) -> np.ndarray:
    """Attention weights ``[B, N, T, S]`` -> ``[N]``: the mean over images and queries of ``sum_s w_ts d_ts``."""
    return np.einsum("bnts,ts->n", np.asarray(weights, np.float64), dist) / (weights.shape[0] * weights.shape[2])


@nnx.jit
def _weights(model, x):
    return inspect.capture(model.backbone, x, record=("weights",)).weights  # L x [B, N, T, T]


def attention_distance(model, tokens, mean, std, grid, patch, batch_size=8) -> list[list[float]]:
    """Mean attention distance in pixels per layer and head ``[L][N]`` of an Encoder-backed classifier."""
    dist = token_distances(grid, patch)
    total = None
    for i in range(0, len(tokens), batch_size):
        x = jnp.asarray(fashion_mnist.normalize(tokens[i : i + batch_size], mean, std))
        d = np.stack([mean_distance(np.asarray(w), dist) * len(x) for w in _weights(model, x)])  # [L, N]
        total = d if total is None else total + d
    return (total / len(tokens)).round(3).tolist()


def reference_distances(grid, patch, kernel_size=3) -> dict:
    """Mean distance of uniform attention over the whole image, and over a k x k window (a CNN's kernel)."""
    dist = token_distances(grid, patch)
    window = np.asarray(masks.window_2d(grid[1], kernel_size // 2).dense(len(dist), len(dist)), np.float64)
    return {
        "uniform_full": float(dist.mean()),
        f"uniform_{kernel_size}x{kernel_size}": float(((window * dist).sum(1) / window.sum(1)).mean()),
    }


# ------------------------------------------------------------------------------------------
# Runs


def run_one(cfg, name: str, size: int, num_steps: int, seed: int, data: dict, out: Path, *, verbose=True) -> dict:
    """Trains model ``name`` on ``size`` training images with ``seed``; returns (and writes) its result."""
    m = cfg.models[name]
    workdir = out / cfg.variant / f"{name}-n{size}-s{seed}"
    workdir.mkdir(parents=True, exist_ok=True)
    run_cfg = {"variant": cfg.variant, "model_name": name, "size": size, "seed": seed, "steps": num_steps}
    (workdir / "config.json").write_text(json.dumps({**run_cfg, "config": cfg.to_dict()}, indent=2, default=str))
    x_all, y_all = data["train"]
    hw = x_all.shape[1:]
    grid = (hw[0] // m.patch, hw[1] // m.patch)
    idx = subset(len(y_all), size, seed)
    tokens = fashion_mnist.patchify(x_all[idx], m.patch)  # uint8 [n, T, P*P]
    labels = y_all[idx]
    test_tokens = fashion_mnist.patchify(data["test"][0], m.patch)
    mean, std = data["mean"], data["std"]
    model = build_model(m, hw, 10, seed)
    is_attention = m.kind in ("vit", "pixel")
    dist_imgs = test_tokens[: cfg.distance_images]
    dist_init = attention_distance(model, dist_imgs, mean, std, grid, m.patch) if is_attention else None
    t = cfg.train
    tx = make_tx(t.learning_rate, t.warmup_steps, num_steps, t.weight_decay)
    epochs = round(num_steps * t.batch_size / len(labels), 2)
    common.log(verbose, "%s: %d images, %d steps (%.1f epochs)", workdir.name, len(labels), num_steps, epochs)
    t0 = time.perf_counter()
    # no workdir: a run is short, the sweep resumes run by run (results.jsonl), not from checkpoints
    model, records = train_lib.train(
        model, tx, loss_fn, make_batch_fn(tokens, labels, t.batch_size, seed, mean, std), num_steps=num_steps,
        seed=seed, log_every=t.log_every, verbose=verbose,
    )  # fmt: skip
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    train_time = common.train_time(records, default=time.perf_counter() - t0)
    t1 = time.perf_counter()
    test_acc = accuracy(model, test_tokens, data["test"][1], cfg.eval_batch_size, mean, std)
    n_tr = min(len(labels), 5000)
    train_acc = accuracy(model, tokens[:n_tr], labels[:n_tr], cfg.eval_batch_size, mean, std)
    eval_time = time.perf_counter() - t1
    result = {
        **run_cfg,
        "dataset": cfg.dataset,
        "model": m.kind,
        "params": train_lib.num_params(model),
        "epochs": epochs,
        "test_accuracy": test_acc,
        "test_examples": len(data["test"][1]),
        "train_accuracy": train_acc,
        "final_loss": next(r["loss"] for r in reversed(records) if r["split"] == "train"),
        "train_time_s": round(train_time, 1),
        "eval_time_s": round(eval_time, 1),
        "grid": list(grid),
        "patch": m.patch,
        **common.env(),
    }
    if is_attention:
        result["attention_distance"] = attention_distance(model, dist_imgs, mean, std, grid, m.patch)
        result["attention_distance_init"] = dist_init
        result["distance_images"] = len(dist_imgs)
        result["reference_distance"] = reference_distances(grid, m.patch, 2 * m.radius + 1 if m.kind == "pixel" else 3)
    (workdir / "result.json").write_text(json.dumps(result, indent=2))
    common.log(verbose, "%s: test accuracy %.4f (train %.4f) in %.0f s", workdir.name, test_acc, train_acc, train_time)
    return result


def run(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    """Every (size, model, seed) of the config; runs in ``<out>/<variant>/results.jsonl`` are read back."""
    if len(cfg.train.steps) != len(cfg.sizes):
        raise ValueError(f"train.steps {tuple(cfg.train.steps)} must give one step count per size {tuple(cfg.sizes)}")
    steps = dict(zip(cfg.sizes, cfg.train.steps, strict=True))
    # seed outermost: an interrupted sweep still has whole curves; models sorted by name
    cells = [{"model_name": n, "size": z, "seed": s} for s in cfg.seeds for z in cfg.sizes for n in cfg.models]
    path = Path(out) / cfg.variant / "results.jsonl"
    data = load_data(cfg.dataset, cfg.eval_count) if common.pending(path, cells) else None

    def run_cell(c):
        return run_one(cfg, c["model_name"], c["size"], steps[c["size"]], c["seed"], data, Path(out), verbose=verbose)

    return common.run_grid(path, cells, run_cell, verbose=verbose, name=f"images:{cfg.variant}")


if __name__ == "__main__":
    common.launch(run, report, config="experiments/configs/images.py:default", out="results/images")
