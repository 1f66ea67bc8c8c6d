"""DETR, images as sequences: a small Detection Transformer on synthetic canvases of 1-4 items.

The course note's last claim: a transformer can read an image as a sequence of patch vectors and
answer with a *set* (DETR, Carion et al. 2020, arXiv 2005.12872). Canvases of 64 x 64 pixels hold
1-4 Fashion-MNIST items (``attnlab.data.canvases``); ``attnlab.nn.DETR`` encodes the 8 x 8 patches
with 2-D positions, 8 learned object queries read them through cross-attention, and each query says
a class (or "no object") and a box. Training matches queries to items with the Hungarian algorithm
(scipy on the host) and minimises class CE + L1 + GIoU on the matched pairs.

Commands:

    python -m experiments.detr --config experiments/configs/detr.py:default --out results/detr
    python -m experiments.detr --report results/detr

Each run (item range, e.g. ``1-2``) goes to ``<out>/<variant>/items<range>/``: ``config.json``,
``metrics.jsonl`` (train loss every ``log_every`` steps; dev AP@0.5 every ``eval_every``),
``checkpoints/`` (resume), ``examples.npz`` (a few test canvases: ground truth, predictions, each
query's cross-attention of the last decoder block, head mean) and ``result.json`` (AP@0.5 over all
held-out canvases and per item count, per-count accuracy), also appended to
``<out>/<variant>/results.jsonl``. ``--report`` writes ``summary.md``, ``predictions.png``,
``attention.png`` and ``learning_curve.png`` from those files alone.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from attnlab import inspect
from attnlab import train as train_lib
from attnlab.data import canvases, fashion_mnist
from attnlab.nn import detr as detr_lib
from experiments import common
from experiments.detr_report import CLASS_NAMES, report, run_name  # noqa: F401  (report: the CLI's)

# ------------------------------------------------------------------------------------------
# Data


def load_items(dataset: str) -> dict:
    """``{"train": (uint8 [n, h, w], labels [n]), "test": ...}``: the items pasted on canvases."""
    match dataset:
        case "fashion_mnist":
            return {"train": fashion_mnist.load("train"), "test": fashion_mnist.load("test")}
        case "digits":
            return fashion_mnist.load_digits()
        case _:
            raise ValueError(f"dataset must be 'fashion_mnist' or 'digits', got {dataset!r}")


def parse_range(spec: str) -> tuple[int, int]:
    """``"1-2"`` -> ``(1, 2)``."""
    lo, _, hi = str(spec).partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise ValueError(f"item range must be 'lo-hi' with 1 <= lo <= hi, got {spec!r}")
    return lo, hi


def canvas_fn(cfg, items, lo: int, hi: int, seed: int):
    """``(num, start) -> canvases`` of ``lo``-``hi`` items with the config's canvas settings."""
    c = cfg.canvas
    return functools.partial(
        canvases.make_canvases, *items, seed=seed, size=c.size, min_items=lo, max_items=hi,
        scale=(c.scale_lo, c.scale_hi),
    )  # fmt: skip


def to_batch(cv: dict, max_items: int) -> dict:
    """Canvases -> the model's batch: images float32 in [0, 1], classes / boxes padded to ``max_items``."""
    pad = max_items - cv["classes"].shape[1]
    return {
        "images": cv["images"].astype(np.float32) / 255.0,
        "classes": np.pad(cv["classes"], ((0, 0), (0, pad)), constant_values=-1),
        "boxes": np.pad(cv["boxes"], ((0, 0), (0, pad), (0, 0))),
    }


# ------------------------------------------------------------------------------------------
# Model, loss, evaluation


def build_model(cfg, num_classes: int, seed: int) -> detr_lib.DETR:
    m = cfg.model
    return detr_lib.DETR(
        num_classes=num_classes, image_size=cfg.canvas.size, backbone=m.backbone, patch=m.patch,
        cnn_layers=m.cnn_layers, cnn_channels=m.cnn_channels, d_model=m.d_model, num_heads=m.num_heads,
        mlp_dim=m.mlp_dim, encoder_layers=m.encoder_layers, decoder_layers=m.decoder_layers,
        num_queries=m.num_queries, dropout_rate=m.dropout, rngs=nnx.Rngs(seed),
    )  # fmt: skip


def make_loss_fn(eos_coef: float, w_class: float, w_l1: float, w_giou: float, aux: bool = False):
    """The set loss of the last decoder block, or (``aux``) summed over every block (``deep_set_loss``)."""
    weights = dict(eos_coef=eos_coef, w_class=w_class, w_l1=w_l1, w_giou=w_giou)

    def loss_fn(model, batch, key):
        logits, boxes = model(batch["images"], dropout_key=key, all_layers=aux)
        fn = detr_lib.deep_set_loss if aux else detr_lib.set_loss
        return fn(logits, boxes, batch["classes"], batch["boxes"], **weights)

    return loss_fn


@nnx.jit
def _forward(model, images):
    return model(images)


@nnx.jit
def _forward_weights(model, images):
    cap = inspect.capture(model, images, record=("weights",))
    logits, boxes = cap.output
    return logits, boxes, cap.select("*cross_attn")[-1].weights.mean(1)  # last decoder block, head mean: [B, Q, S]


def predict(model, images: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``[n, S, S]`` float images -> logits ``[n, Q, C+1]``, boxes ``[n, Q, 4]`` (numpy)."""
    out = common.predict(lambda x: jnp.concatenate(_forward(model, x), -1), [images], batch_size)
    return out[..., :-4], out[..., -4:]


def _no_object_prob(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z[..., -1] / z.sum(-1)


def evaluate(model, batch: dict, batch_size: int) -> dict:
    """AP@0.5 (all canvases and per item count) and per-count accuracy on held-out canvases."""
    logits, boxes = predict(model, batch["images"], batch_size)
    scores, pred_cls, is_obj = detr_lib.detections(logits, boxes)
    gt_cls, gt_box = batch["classes"], batch["boxes"]
    ap, per_class = detr_lib.average_precision(scores, pred_cls, boxes, gt_cls, gt_box, iou=0.5)
    counts = (gt_cls >= 0).sum(-1)
    ap_by_count = {}
    for k in np.unique(counts):
        sel = counts == k
        ap_by_count[str(int(k))] = detr_lib.average_precision(
            scores[sel], pred_cls[sel], boxes[sel], gt_cls[sel], gt_box[sel], iou=0.5
        )[0]
    ap_by_range = {}
    for name, sel in (("1-2", counts <= 2), ("3-4", (counts >= 3) & (counts <= 4))):
        if sel.any():
            ap_by_range[name] = detr_lib.average_precision(
                scores[sel], pred_cls[sel], boxes[sel], gt_cls[sel], gt_box[sel], iou=0.5
            )[0]
    # class-agnostic: every item and detection one class (is localisation or classification the limit?)
    prob_obj = 1.0 - _no_object_prob(logits)  # [n, Q]: the score of "some object here"
    agnostic = detr_lib.average_precision(
        prob_obj, np.zeros_like(pred_cls), boxes, np.where(gt_cls >= 0, 0, -1), gt_box
    )[0]
    acc = detr_lib.count_accuracy(is_obj, pred_cls, gt_cls)
    return {
        "ap50": ap,
        "ap50_per_class": {str(k): v for k, v in per_class.items()},
        "ap50_by_count": ap_by_count,
        "ap50_by_items": ap_by_range,
        "ap50_class_agnostic": agnostic,
        "mean_object_prob": float(prob_obj.mean()),
        "count_accuracy": {str(k): v[0] for k, v in acc.items()},
        "count_images": {str(k): v[1] for k, v in acc.items()},
        "count_accuracy_all": float(np.mean([v[0] * v[1] for v in acc.values()]) * len(acc) / len(counts)),
        "mean_predicted_objects": float(is_obj.sum(-1).mean()),
    }


# ------------------------------------------------------------------------------------------
# Runs


TEST_SEED = 1000  # the held-out (dev and test) canvases: the same for every training seed


def run_one(cfg, spec: str, items: dict, out: Path, *, seed: int = 0, verbose=True) -> dict:
    lo, hi = parse_range(spec)
    if hi > cfg.model.num_queries:
        raise ValueError(f"run {spec!r}: up to {hi} items needs num_queries >= {hi}, got {cfg.model.num_queries}")
    workdir = out / cfg.variant / run_name(spec, seed)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(
        json.dumps({"items": spec, "seed": seed, "config": cfg.to_dict()}, indent=2, default=str)
    )
    num_classes = int(max(items["train"][1].max(), items["test"][1].max())) + 1
    train_canvas = canvas_fn(cfg, items["train"], lo, hi, seed=seed)  # the training stream, init and dropout
    test_canvas = canvas_fn(cfg, items["test"], lo, hi, seed=TEST_SEED)
    dev = to_batch(test_canvas(cfg.dev_canvases, start=10**6), hi)  # held out, apart from the test canvases
    test = to_batch(test_canvas(cfg.test_canvases, start=0), hi)
    t = cfg.train

    def batch_fn(step):
        return to_batch(train_canvas(t.batch_size, start=(step - 1) * t.batch_size), hi)

    model = build_model(cfg, num_classes, seed)
    tx = train_lib.adamw_cosine(t.learning_rate, t.warmup_steps, t.num_steps, t.weight_decay, end_fraction=0.05)
    loss_fn = make_loss_fn(**cfg.loss.to_dict())

    def eval_fn(m):
        r = evaluate(m, dev, cfg.eval_batch_size)
        return {
            "dev_ap50": r["ap50"],
            "dev_count_accuracy": r["count_accuracy_all"],
            **{f"dev_ap50_items{k}": v for k, v in r["ap50_by_items"].items()},
        }

    t0 = time.perf_counter()
    model, records = train_lib.train(
        model, tx, loss_fn, batch_fn, num_steps=t.num_steps, seed=seed, workdir=workdir, eval_fn=eval_fn,
        eval_every=t.eval_every, checkpoint_every=t.checkpoint_every, log_every=t.log_every, verbose=verbose,
    )  # fmt: skip
    train_time = max((r["time_s"] for r in records if r["split"] == "train"), default=time.perf_counter() - t0)
    result = {
        "items": spec,
        "seed": seed,
        "variant": cfg.variant,
        "dataset": cfg.dataset,
        "steps": t.num_steps,
        "batch_size": t.batch_size,
        "params": train_lib.num_params(model),
        "train_time_s_last_session": round(train_time, 1),
        "final_loss": next(r["loss"] for r in reversed(records) if r["split"] == "train"),
        "test_canvases": cfg.test_canvases,
        **evaluate(model, test, cfg.eval_batch_size),
        **common.env(),
    }
    n = cfg.examples
    logits, boxes, attn = _forward_weights(model, jnp.asarray(test["images"][:n]))
    np.savez_compressed(
        workdir / "examples.npz", images=test["images"][:n], classes=test["classes"][:n], boxes=test["boxes"][:n],
        logits=np.asarray(logits), pred_boxes=np.asarray(boxes), attention=np.asarray(attn),
        grid=np.asarray(model.grid),
    )  # fmt: skip
    (workdir / "result.json").write_text(json.dumps(result, indent=2))
    common.log(verbose, "items %s: AP@0.5 %.3f, count accuracy %s", spec, result["ap50"], result["count_accuracy"])
    return result


def run(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    """One training run per item range of ``cfg.runs`` and seed of ``cfg.seeds``; finished runs are read
    back from results.jsonl."""
    cells = [{"items": s, "seed": seed} for seed in common.ints(cfg.seeds) for s in common.names(cfg.runs)]
    path = Path(out) / cfg.variant / "results.jsonl"
    items = load_items(cfg.dataset) if common.pending(path, cells) else None
    return common.run_grid(
        path, cells, lambda c: run_one(cfg, c["items"], items, Path(out), seed=c["seed"], verbose=verbose),
        verbose=verbose, name=f"detr:{cfg.variant}",
    )  # fmt: skip


if __name__ == "__main__":
    common.launch(run, report, config="experiments/configs/detr.py:default", out="results/detr")
