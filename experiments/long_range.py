"""Cutting attention's cost: efficient attention on ListOps, an LRA Table-2 efficiency table, attention vs RNN.

Three parts (``--config.parts``), each resumable (records already in its JSONL are skipped):

1. **ListOps** (Long Range Arena's hierarchical task, ``attnlab.data.listops``): full attention,
   local attention (``masks.chunks``), BigBird (``masks.bigbird``), linear attention (elu+1),
   Performer (FAVOR+) and a bidirectional GRU, all with the same encoder width, steps, batch and
   optimizer; test accuracy -> ``listops.jsonl`` (training curves in ``listops/<model>/metrics.jsonl``).
2. **Efficiency** in the shape of LRA's Table 2: training steps/s and peak memory of one training
   step (forward, backward, AdamW update) at N = 256 .. 4K for each model, plus ``full_dense``
   (full attention through XLA's dense kernel, i.e. the [N, N] matrix LRA's vanilla Transformer
   builds; ``full`` uses attnlab's blockwise kernel, O(N) memory). One warm-up step, then the median
   of ``repeats`` timed steps. Memory is XLA's buffer assignment of the compiled step
   (``compiled.memory_analysis()``: temp + arguments + outputs - aliased), not a measured RSS
   -> ``efficiency.jsonl``. The same data gives figure (1): wall time per training step vs N for
   attention (parallel over positions) and the GRU (``lax.scan``, sequential).
3. **Recall** at a distance (figure 2): a key token at position 0, distractors, and a query token at
   position d; the model reads its output at the query and must name the key (chance 1/num_keys).
   One model per (kind, distance), trained with the same steps -> ``recall.jsonl``.

Commands:

    make listops     # = python -m experiments.long_range --config experiments/configs/long_range.py:default \
                     #       --out results/long_range   (~10 min CPU time; 15-20 min on a quiet 2-core CPU)
    python -m experiments.long_range --report results/long_range   # tables + figures from the JSONL only

The report writes ``summary.md`` (three tables), ``listops_accuracy.png``, ``efficiency.png``
(steps/s and memory vs N), ``time_vs_n.png`` (attention vs GRU per training step) and ``recall.png``.

Measured (ListOps: 3 seeds per model; efficiency and recall: one run each): docs/efficiency.md, tables
generated from docs/results/long_range/ (commands and times in its ``run.json``).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from attnlab import masks, nn, positional
from attnlab import train as train_lib
from attnlab.data import listops
from experiments import common
from experiments.long_range_report import LABELS, outlook_points, report, tables  # noqa: F401  (re-exported)

# ------------------------------------------------------------------------------------------
# Models


def build_backbone(
    kind: str,
    m: ml_collections.ConfigDict,
    *,
    vocab_size: int,
    max_len: int,
    local_chunk: int,
    bigbird_block: int,
    bigbird_random: int,
    seed: int,
):
    """The encoder (or GRU) for one model kind; every kind has the same width and depth."""
    rngs = nnx.Rngs(seed)
    if kind == "gru":
        return nn.BiRNN(
            cell="gru", d_model=m.d_model, hidden=m.d_model // 2, num_layers=m.num_layers, vocab_sizes=vocab_size,
            dropout_rate=m.dropout, rngs=rngs,
        )  # fmt: skip
    options = dict(attention=nn.Softmax(), attention_mask=None)
    match kind:
        case "full":
            pass
        case "full_dense":
            options["attention"] = nn.Softmax("xla")
        case "local":
            options["attention_mask"] = masks.chunks(local_chunk)
        case "bigbird":
            options["attention_mask"] = masks.bigbird(
                max_len, block_size=bigbird_block, window_blocks=3, num_global=2, num_random=bigbird_random, seed=seed
            )
        case "linear":
            options["attention"] = nn.Linear()
        case "performer":
            options["attention"] = nn.Performer(m.num_features)
        case _:
            raise ValueError(f"model kind must be one of {sorted(LABELS)}, got {kind!r}")
    return nn.Encoder(
        vocab_sizes=vocab_size,
        d_model=m.d_model,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        mlp_dim=m.mlp_dim,
        posenc=positional.Sinusoidal(max_len),
        dropout_rate=m.dropout,
        rngs=rngs,
        **options,
    )


class LastToken(nnx.Module):
    """Classifies a sequence from the backbone's output at its last position: ``[B, T] -> [B, C]``."""

    def __init__(self, backbone: nnx.Module, num_classes: int, *, rngs: nnx.Rngs):
        self.backbone = backbone
        self.head = nnx.Linear(backbone.features, num_classes, rngs=rngs)

    def __call__(self, inputs, lengths=None, *, dropout_key=None):
        h = self.backbone(inputs, lengths, dropout_key=dropout_key)  # [B, T, F]
        return self.head(h[:, -1])


def _classification_loss(m, batch, key):
    return common.classification_loss(m(batch["inputs"], batch.get("lengths"), dropout_key=key), batch["labels"])


@nnx.jit
def _predict(model, inputs, lengths):
    return model(inputs, lengths).argmax(-1)


def _accuracy(model, ids, lengths, labels, batch_size=250) -> float:
    pred = common.predict(lambda x, n: _predict(model, x, n), [ids, lengths], batch_size, pad=False)
    return int((pred == labels).sum()) / len(ids)


# ------------------------------------------------------------------------------------------
# Part 1: ListOps


def run_listops(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    lc, m = cfg.listops, cfg.model
    path = out / "listops.jsonl"
    seeds = common.ints(lc.seeds)
    cells = [{"model": k, "seed": s} for s in seeds for k in common.names(cfg.models)]
    if not common.pending(path, cells):
        return common.read_jsonl(path)
    t0 = time.perf_counter()
    splits = listops.make_splits(lc.data, seed=cfg.seed)
    data = {name: listops.encode(ex, lc.max_len) for name, ex in splits.items()}
    lengths = np.array([len(t) for t, _ in splits["train"]])
    common.log(
        verbose, "[listops:%s] %d train examples, lengths %d-%d (mean %.0f), generated in %.1f s", lc.data,
        len(splits["train"]), lengths.min(), lengths.max(), lengths.mean(), time.perf_counter() - t0,
    )  # fmt: skip
    ids, lens, labels = data["train"]
    n = len(ids)

    def batch_fn_for(seed):  # a fixed permutation per epoch, from the seed: deterministic in the step
        def batch_fn(step):
            epoch, i = divmod((step - 1) * lc.batch_size, n)
            idx = np.random.default_rng([seed, epoch]).permutation(n)[i : i + lc.batch_size]
            return {"inputs": ids[idx], "lengths": lens[idx], "labels": labels[idx]}

        return batch_fn

    dev = tuple(x[: lc.max_eval] for x in data["dev"])

    def run_cell(cell):
        kind, seed = cell["model"], cell["seed"]
        backbone = build_backbone(
            kind, m, vocab_size=len(listops.VOCAB), max_len=lc.max_len, local_chunk=m.local_chunk,
            bigbird_block=m.bigbird_block, bigbird_random=m.bigbird_random, seed=seed,
        )  # fmt: skip
        model = nn.SequenceClassifier(backbone, 10, rngs=nnx.Rngs(seed + 1))
        tx = train_lib.adamw_cosine(lc.learning_rate, lc.warmup_steps, lc.num_steps, lc.weight_decay)
        workdir = out / "listops" / (kind if seed == 0 else f"{kind}_seed{seed}")
        model, records = train_lib.train(
            model, tx, _classification_loss, batch_fn_for(seed), num_steps=lc.num_steps, seed=seed,
            workdir=workdir, eval_fn=lambda mod: {"accuracy": _accuracy(mod, *dev)},
            eval_every=lc.eval_every, log_every=lc.log_every, verbose=verbose,
        )  # fmt: skip
        test_acc = _accuracy(model, *data["test"])
        common.log(verbose, "[listops] %s seed %d: test accuracy %.2f%%", kind, seed, 100 * test_acc)
        return {
            "data": lc.data,
            "test_accuracy": test_acc,
            "dev_accuracy": [r for r in records if r["split"] == "dev"][-1]["accuracy"],
            "steps": lc.num_steps,
            "batch_size": lc.batch_size,
            "max_len": lc.max_len,
            "train_time_s": round(common.train_time(records), 1),
            "params": train_lib.num_params(model),
            "majority_class": float(np.bincount(data["test"][2], minlength=10).max() / len(data["test"][2])),
            "backend": jax.default_backend(),
        }

    common.run_grid(path, cells, run_cell, verbose=verbose, name="listops")
    return common.read_jsonl(path)


# ------------------------------------------------------------------------------------------
# Part 2: efficiency (LRA Table 2)


def measure_step(model, batch, *, repeats: int, max_step_s: float | None = None) -> dict:
    """Compile the trainer's training step (loss, grads, AdamW update), then time it: compile s, step s, memory."""
    return common.measure_train_step(
        model, optax.adamw(1e-4), _classification_loss, batch, repeats=repeats, max_step_s=max_step_s
    )


def run_efficiency(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    e, m = cfg.efficiency, cfg.model
    rng = np.random.default_rng(cfg.seed)
    too_slow = set()  # a model whose step failed or took longer than max_step_s skips the longer lengths

    def run_cell(cell):
        kind, n = cell["model"], cell["seq_len"]
        if kind in too_slow:
            return {"status": "skipped"}
        backbone = build_backbone(
            kind, m, vocab_size=len(listops.VOCAB), max_len=n, local_chunk=e.local_chunk,
            bigbird_block=e.bigbird_block, bigbird_random=e.bigbird_random, seed=cfg.seed,
        )  # fmt: skip
        model = nn.SequenceClassifier(backbone, 10, rngs=nnx.Rngs(cfg.seed + 1))
        batch = {
            "inputs": jnp.asarray(rng.integers(1, len(listops.VOCAB), (e.batch_size, n)), jnp.int32),
            "lengths": jnp.full((e.batch_size,), n, jnp.int32),
            "labels": jnp.asarray(rng.integers(0, 10, (e.batch_size,)), jnp.int32),
        }
        try:
            res, status = measure_step(model, batch, repeats=e.repeats, max_step_s=e.max_step_s), "ok"
            common.log(
                verbose, "[efficiency] %10s N=%5d: %8.1f ms/step, %7.1f MiB, compile %.1f s", kind, n,
                res["step_s"] * 1e3, res["peak_bytes"] / 2**20, res["compile_s"],
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a failed cell is recorded, the table goes on
            res, status = {"error": f"{type(err).__name__}: {str(err)[:300]}"}, "error"
            common.log(verbose, "[efficiency] %s N=%d: %s", kind, n, res["error"])
        if status != "ok" or res["step_s"] > e.max_step_s:
            too_slow.add(kind)
        return {
            "batch_size": e.batch_size,
            "status": status,
            **res,
            "params": train_lib.num_params(model),
            **common.env(),
        }

    cells = [{"model": k, "seq_len": n} for k in common.names(e.models) for n in e.seq_lens]
    common.run_grid(out / "efficiency.jsonl", cells, run_cell, verbose=verbose, name="efficiency")
    return common.read_jsonl(out / "efficiency.jsonl")


# ------------------------------------------------------------------------------------------
# Part 3: recall at a distance


def recall_data(rng: np.random.Generator, n: int, distance: int, num_keys: int, num_distractors: int):
    """``n`` sequences of length distance + 1: key at 0, distractors, query token at ``distance``.

    Vocabulary: 0 pad (unused), 1 query, 2 .. 1 + num_keys keys, then the distractors.
    Returns int32 ids ``[n, distance + 1]`` and labels ``[n]`` (the key's index).
    """
    if distance < 1:
        raise ValueError(f"recall_data: distance must be >= 1, got {distance}")
    labels = rng.integers(0, num_keys, n)
    ids = 2 + num_keys + rng.integers(0, num_distractors, (n, distance + 1))
    ids[:, 0] = 2 + labels
    ids[:, -1] = 1
    return ids.astype(np.int32), labels.astype(np.int32)


def run_recall(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    r = cfg.recall
    vocab = 2 + r.num_keys + r.num_distractors
    mcfg = ml_collections.ConfigDict(
        dict(d_model=r.d_model, num_layers=r.num_layers, num_heads=r.num_heads, mlp_dim=2 * r.d_model, dropout=0.0)
    )
    mcfg.num_features = cfg.model.num_features

    def run_cell(cell):
        kind, d = cell["model"], cell["distance"]
        backbone = build_backbone(
            kind, mcfg, vocab_size=vocab, max_len=d + 1, local_chunk=d + 1, bigbird_block=8,
            bigbird_random=1, seed=cfg.seed,
        )  # fmt: skip
        model = LastToken(backbone, r.num_keys, rngs=nnx.Rngs(cfg.seed + 1))

        def batch_fn(step):
            rng = np.random.default_rng([cfg.seed, d, step])
            ids, labels = recall_data(rng, r.batch_size, d, r.num_keys, r.num_distractors)
            return {"inputs": ids, "labels": labels}

        t0 = time.perf_counter()
        model, records = train_lib.train(
            model, optax.adam(r.learning_rate), _classification_loss, batch_fn, num_steps=r.num_steps,
            seed=cfg.seed, log_every=max(1, r.num_steps // 10), verbose=verbose,
        )  # fmt: skip
        train_s = time.perf_counter() - t0
        rng = np.random.default_rng([cfg.seed, d, 10**9])
        ids, labels = recall_data(rng, r.num_eval, d, r.num_keys, r.num_distractors)
        acc = _accuracy(model, ids, None, labels)
        common.log(verbose, "[recall] %s distance %d: accuracy %.1f%%", kind, d, 100 * acc)
        return {
            "accuracy": acc,
            "chance": 1.0 / r.num_keys,
            "steps": r.num_steps,
            "final_train_loss": records[-1]["loss"],
            "train_time_s": round(train_s, 1),
            "params": train_lib.num_params(model),
        }

    cells = [{"model": k, "distance": d} for k in common.names(r.models) for d in r.distances]
    common.run_grid(out / "recall.jsonl", cells, run_cell, verbose=verbose, name="recall")
    return common.read_jsonl(out / "recall.jsonl")


def run(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> str:
    """Runs the parts of ``cfg.parts`` into ``out`` and returns the report's tables."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    common.save_config(cfg, out / f"config_{cfg.variant}.json")
    parts = common.names(cfg.parts)
    unknown = set(parts) - {"listops", "efficiency", "recall"}
    if unknown:
        raise ValueError(f"parts must be listops, efficiency and/or recall, got {sorted(unknown)}")
    for name, fn in (("listops", run_listops), ("efficiency", run_efficiency), ("recall", run_recall)):
        if name in parts:
            fn(cfg, out, verbose=verbose)
    return report(out)


if __name__ == "__main__":
    common.launch(run, report, config="experiments/configs/long_range.py:default", out="results/long_range")
