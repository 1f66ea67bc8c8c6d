"""A language model on packed text: the same documents in packed rows and in padded rows.

A small decoder-only LM (``nn.Encoder`` under a causal mask, ``nn.TokenClassifier`` over the
vocabulary) learns Brown's paragraphs word by word (``experiments/configs/lm.py`` says how the
documents, the vocabulary and the chunks are made). Each step takes the next ``docs_per_step``
documents of one seeded order and lays them out in one of two ways:

* packed: first-fit into rows of ``row_len`` (``attnlab.data.packing.pack``), the mask
  ``masks.document(segment_ids) & masks.causal()``, positions restarting at 0 in each document;
* padded: one document per row, padded to ``row_len``, the mask ``masks.padding(lengths) &
  masks.causal()``.

Both compute the loss as the mean cross-entropy over the step's real next-token targets (padding
carries no target), so the same seed gives the same model in both layouts up to rounding, and
what packing changes is the work per step: rows of padding are not computed.

Commands:

    make lm                 # 3 seeds x (packed, padded), alternating, then the report
    python -m experiments.lm --config experiments/configs/lm.py:smoke --out /tmp/lm
    python -m experiments.lm --report docs/results/lm   # table + figure from the JSONL alone

Writes ``<out>/results.jsonl`` (one line per (seed, layout): held-out loss per token, tokens/s,
train, compile and wall seconds, padding share, the training curve), ``config.json``,
``run.json`` (``experiments.provenance``: command, machine, load) and the report's
``summary.md`` and ``lm.png``. Rerunning skips the (seed, layout) pairs already in the JSONL.
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
from attnlab.data import brown, packing
from experiments import common, provenance
from experiments.lm_report import report  # noqa: F401  (the CLI's)

LAYOUTS = ("packed", "padded")

# ------------------------------------------------------------------------------------------
# Data: documents -> (input, target) chunks -> packed or padded rows


def load_data(cfg: ml_collections.ConfigDict) -> dict:
    """Training and held-out chunks (int32 ``[n, 2]``: input id, target id), and the vocabulary size."""
    d = cfg.data
    parts = brown.split(brown.load_paragraphs(max_files=d.max_files))
    vocab = brown.Vocab.build([s for p in parts["train"] for s in p], min_count=d.min_count)
    bos = vocab.sizes[0]  # ids: 0 padding, 1 OOV, 2.. words, then BOS and EOS
    held = parts["test"][: d.max_eval_docs]
    out = {"vocab_size": bos + 2, "train": [], "heldout": []}
    for name, paras in (("train", parts["train"]), ("heldout", held)):
        for para in paras:
            ids = vocab.ids([w for s in para for w, _ in s])[:, 0]  # [n] word ids
            out[name] += chunks(ids, bos=bos, eos=bos + 1, row_len=d.row_len)
    held_ids = np.concatenate([c[:, 1] for c in out["heldout"]])
    out["heldout_oov"] = float((held_ids == 1).mean())
    lengths = np.array([sum(map(len, p)) + 1 for p in parts["train"]])  # (input, target) pairs per paragraph
    out["whole_share"] = float((lengths <= d.row_len).mean())  # paragraphs that fit one row uncut
    return out


def chunks(ids, *, bos: int, eos: int, row_len: int) -> list[np.ndarray]:
    """A document's ``[BOS, w_1 .. w_n]`` -> ``[w_1 .. w_n, EOS]`` pairs, cut into ``row_len`` pieces.

    Example:
        >>> [c.tolist() for c in chunks([5, 6, 7], bos=1, eos=2, row_len=3)]
        [[[1, 5], [5, 6], [6, 7]], [[7, 2]]]
    """
    seq = np.concatenate([[bos], np.asarray(ids, np.int32), [eos]]).astype(np.int32)
    pairs = np.stack([seq[:-1], seq[1:]], axis=-1)  # [n + 1, 2]: input, next-token target
    return [pairs[i : i + row_len] for i in range(0, len(pairs), row_len)]


def packed_batch(docs, row_len: int, *, row_multiple: int = 1) -> dict:
    """Documents (``[n, 2]`` chunks) packed into rows: inputs, targets, segment ids, positions ``[R, row_len]``.

    ``R`` is the rows first-fit decreasing needs, rounded up to a multiple of ``row_multiple``
    with rows of padding (``PAD_SEGMENT``: they attend to nothing and carry no target).
    """
    p = packing.pack(docs, row_len)
    extra = -len(p.tokens) % row_multiple  # rows of padding: [R', T] -> [R, T]
    out = {"inputs": p.tokens[..., 0], "targets": p.tokens[..., 1], "positions": p.positions}
    out = {k: np.pad(a, ((0, extra), (0, 0))) for k, a in out.items()}
    out["segment_ids"] = np.pad(p.segment_ids, ((0, extra), (0, 0)), constant_values=packing.PAD_SEGMENT)
    out["valid"] = out["segment_ids"] != packing.PAD_SEGMENT
    return out


def padded_batch(docs, row_len: int) -> dict:
    """One document per row, padded to ``row_len``: inputs, targets ``[B, row_len]``, lengths ``[B]``."""
    B = len(docs)
    inputs, targets = np.zeros((B, row_len), np.int32), np.zeros((B, row_len), np.int32)
    for b, d in enumerate(docs):
        inputs[b, : len(d)], targets[b, : len(d)] = d[:, 0], d[:, 1]
    lengths = np.array([len(d) for d in docs], np.int32)
    return {"inputs": inputs, "targets": targets, "lengths": lengths, "valid": np.arange(row_len) < lengths[:, None]}


def step_docs(n_docs: int, per_step: int, seed: int, num_steps: int) -> list[np.ndarray]:
    """The document indices of steps 1 .. num_steps: consecutive slices of seeded epoch permutations."""
    epochs = -(-num_steps * per_step // n_docs)
    order = np.concatenate([np.random.default_rng([seed, e]).permutation(n_docs) for e in range(epochs)])
    return [order[s * per_step : (s + 1) * per_step] for s in range(num_steps)]


def batches(docs, layout: str, cfg: ml_collections.ConfigDict, seed: int) -> list[dict]:
    """Every step's batch of one run (the same documents per step for both layouts)."""
    t, L = cfg.train, cfg.data.row_len
    out = []
    for idx in step_docs(len(docs), t.docs_per_step, seed, t.num_steps):
        chosen = [docs[i] for i in idx]
        out.append(
            packed_batch(chosen, L, row_multiple=t.row_multiple) if layout == "packed" else padded_batch(chosen, L)
        )
    return out


# ------------------------------------------------------------------------------------------
# Model and loss


def build_model(cfg: ml_collections.ConfigDict, vocab_size: int, seed: int) -> nnx.Module:
    m = cfg.model
    rngs = nnx.Rngs(seed)
    encoder = nn.Encoder(
        vocab_sizes=vocab_size, d_model=m.d_model, num_layers=m.num_layers, num_heads=m.num_heads,
        mlp_dim=m.mlp_dim, posenc=positional.Sinusoidal(cfg.data.row_len), rngs=rngs,
    )  # fmt: skip
    return nn.TokenClassifier(encoder, vocab_size, rngs=rngs)


def batch_mask(batch: dict) -> masks.Mask:
    """``document(segment_ids) & causal()`` for a packed batch, ``padding(lengths) & causal()`` for a padded one."""
    if "segment_ids" in batch:
        return masks.document(batch["segment_ids"], padding_id=packing.PAD_SEGMENT) & masks.causal()
    return masks.padding(batch["lengths"], batch["lengths"]) & masks.causal()


def token_losses(model, batch: dict) -> jax.Array:
    """fp32 next-token cross-entropy ``[R, T]``, zero where ``batch["valid"]`` is False."""
    logits = model(batch["inputs"], mask=batch_mask(batch), positions=batch.get("positions"))  # [R, T, V]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return jnp.where(batch["valid"], ce, 0.0)


def loss_fn(model, batch, key):
    """Mean cross-entropy over the batch's real targets (the same for both layouts of the same documents)."""
    del key  # no dropout
    return token_losses(model, batch).sum() / jnp.maximum(batch["valid"].sum(), 1), {}


@nnx.jit
def _row_sums(model, batch):
    return token_losses(model, batch).sum(-1), batch["valid"].sum(-1)  # [R], [R]


def heldout_loss(model, docs, cfg: ml_collections.ConfigDict) -> float:
    """Loss per real token (nats) over the held-out documents, packed into rows of ``row_len``."""
    b = packed_batch(docs, cfg.data.row_len)
    keys = ("inputs", "targets", "segment_ids", "positions", "valid")

    def apply(*arrays):
        ce, n = _row_sums(model, dict(zip(keys, arrays, strict=True)))
        return jnp.stack([ce, n.astype(jnp.float32)], -1)  # [R, 2]

    sums = common.predict(apply, [b[k] for k in keys], cfg.train.eval_rows).sum(0)
    return float(sums[0] / sums[1])


# ------------------------------------------------------------------------------------------
# Training and the grid


def compile_shapes(model, tx, run_batches: list[dict]) -> float:
    """Compiles the trainer's step as the run will call it; returns the seconds.

    The first step takes the optimizer's initial state, the later ones the step's own outputs (their
    types differ: two programs), each for every distinct batch shape of the run.
    """
    graphdef, params_state, rest = nnx.split(model, nnx.Param, ...)
    leaves, params_def = jax.tree.flatten(params_state)
    step = train_lib.make_step(graphdef, params_def, rest, tx, loss_fn)
    t0 = time.perf_counter()
    params = [jnp.array(x, copy=True) for x in leaves]  # the step donates them
    state = step(params, tx.init(params), run_batches[0], jax.random.key(0))[:2]
    for shape in dict.fromkeys(b["inputs"].shape for b in run_batches):
        batch = next(b for b in run_batches if b["inputs"].shape == shape)
        state = step(*state, batch, jax.random.key(0))[:2]
    jax.block_until_ready(state)
    return time.perf_counter() - t0


def run_one(cfg, data: dict, seed: int, layout: str, *, verbose: bool = True) -> dict:
    """Trains one (seed, layout) and evaluates it; returns the result record."""
    t0 = time.perf_counter()
    t = cfg.train
    run_batches = batches(data["train"], layout, cfg, seed)
    model = build_model(cfg, data["vocab_size"], seed)

    def make_tx():
        return train_lib.adamw_cosine(t.learning_rate, t.warmup_steps, t.num_steps, t.weight_decay)

    # a fresh, equal optimizer for the trainer: optax's cosine schedule turns its int decay_steps into a
    # float on first use, which would change the warmed-up one's cache key (attnlab.train.ByValue)
    compile_s = compile_shapes(model, make_tx(), run_batches)
    model, records = train_lib.train(
        model, make_tx(), loss_fn, lambda s: run_batches[s - 1], num_steps=t.num_steps, seed=seed,
        log_every=t.log_every, verbose=verbose,
    )  # fmt: skip
    train_s = common.train_time(records)
    real = sum(int(b["valid"].sum()) for b in run_batches)
    slots = sum(b["valid"].size for b in run_batches)
    curve = [[r["step"], r["time_s"], round(r["loss"], 4)] for r in records if r["split"] == "train"]
    return {
        "variant": cfg.variant,
        "steps": t.num_steps,
        "params": train_lib.num_params(model),
        "heldout_loss": heldout_loss(model, data["heldout"], cfg),
        "train_tokens": real,
        "padding_share": round(1 - real / slots, 4),
        "rows_per_step": round(slots / cfg.data.row_len / t.num_steps, 2),
        "shapes": len({b["inputs"].shape for b in run_batches}),
        "tokens_per_s": real / train_s,
        "train_s": round(train_s, 2),
        "compile_s": round(compile_s, 2),
        "wall_s": round(time.perf_counter() - t0, 2),
        "final_train_loss": curve[-1][2],
        "curve": curve,
        "heldout_oov": round(data["heldout_oov"], 4),
        "whole_share": round(data["whole_share"], 4),
        "vocab_size": data["vocab_size"],
        "chunks": [len(data["train"]), len(data["heldout"])],
        **common.env(),
    }


def run(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    """Every (seed, layout) of the config not yet in ``<out>/results.jsonl``, layouts alternating."""
    started = provenance.start()
    out.mkdir(parents=True, exist_ok=True)
    common.save_config(cfg, out / "config.json")
    layouts = common.names(cfg.layouts)
    if unknown := set(layouts) - set(LAYOUTS):
        raise ValueError(f"layouts must be among {LAYOUTS}, got {sorted(unknown)}")
    cells = [{"seed": s, "layout": layout} for s in common.ints(cfg.seeds) for layout in layouts]
    path = out / "results.jsonl"
    if not common.pending(path, cells):
        return common.run_grid(path, cells, None, verbose=verbose, name="lm")
    common.log(verbose, "[lm] loading Brown's paragraphs")
    data = load_data(cfg)
    common.log(verbose, "[lm] %d training chunks, %d held out, vocabulary %d", len(data["train"]),
               len(data["heldout"]), data["vocab_size"])  # fmt: skip
    records = common.run_grid(
        path, cells, lambda c: run_one(cfg, data, c["seed"], c["layout"], verbose=verbose), verbose=verbose, name="lm"
    )
    machine = f"{provenance.cpu_model()}, shared with other jobs (see load)"
    provenance.write(out, provenance.finish(started, command=provenance.command("experiments.lm"), machine=machine))
    return records


if __name__ == "__main__":
    common.launch(run, report, config="experiments/configs/lm.py:default", out="results/lm")
