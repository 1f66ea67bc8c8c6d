"""Positional encoding ablation: the same encoder with each scheme, on a task where order matters.

The course note says self-attention alone has no notion of position, that the original fix adds a
hand-made vector e_i to each input, and that "there are many methods and no clear best one". Here
every sequence scheme of ``attnlab.positional`` (``--config.schemes``, the names of
``positional.SCHEMES`` that are not 2-D grids: none, sinusoidal, learned, rope, alibi, t5) trains
the same small ``nn.Encoder`` on a generated copy-with-offset task ("shift": output the token k
places to the left), several seeds each, and is evaluated at the training length L and at 2L and
4L (length generalisation).

Commands:

    make posenc                    # every scheme x seed of the default config, then the report
    python -m experiments.posenc --config experiments/configs/posenc.py:default --out results/posenc
    python -m experiments.posenc --posenc=rope --out results/posenc   # one scheme (3 seeds)
    python -m experiments.posenc --report results/posenc   # figures + table from the JSONL only

Each run writes ``<out>/runs/<scheme>/seed<s>/`` (``metrics.jsonl``, a final checkpoint) and
appends one line to ``<out>/results.jsonl``: scheme, seed, accuracy at each eval length,
training time, parameter count. Rerunning skips the (scheme, seed) pairs already in the JSONL.
The report writes ``summary.md`` (mean +- std over seeds per scheme and length),
``accuracy.png`` (bar plot of accuracy +- std at length L) and ``length.png`` (accuracy against
evaluation length, L / 2L / 4L).

Measured (default config, 3 seeds): docs/positional.md, the table generated from
docs/results/posenc/results.jsonl.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags
from flax import nnx

from attnlab import nn, positional
from attnlab import train as train_lib
from experiments import common
from experiments.configs.posenc import SCHEMES


def _names(text) -> list[str]:
    names = common.names(str(text))
    for n in names:
        if positional.scheme(n).grid:  # an unknown name: ValueError naming the choices
            raise ValueError(f"posenc {n!r} is for 2-D grids; the shift task takes one of {SCHEMES}")
    return names


# ------------------------------------------------------------------------------------------
# Task


def shift_task(rng: np.random.Generator, batch: int, length: int, *, vocab: int, shift: int, lengths=None) -> dict:
    """Copy with offset: ``inputs [B, T]`` uniform in ``[0, V)``; ``targets[b, t] = inputs[b, t - k]``, or V for t < k.

    Args:
        rng: numpy generator (the batch is a function of its state).
        batch, length: B, T (the padded length).
        vocab, shift: V, k.
        lengths: int ``[B]`` real lengths (positions t >= lengths[b] are padding), default all T.

    Returns:
        dict of int32 ``inputs [B, T]``, ``targets [B, T]``, ``lengths [B]``.
    """
    if shift < 1 or shift >= length:
        raise ValueError(f"shift_task: shift must be in [1, length), got shift={shift}, length={length}")
    x = rng.integers(0, vocab, (batch, length))
    y = np.full_like(x, vocab)  # blank: there is no token k places to the left
    y[:, shift:] = x[:, :-shift]
    lengths = np.full(batch, length) if lengths is None else np.asarray(lengths)
    return {"inputs": x.astype(np.int32), "targets": y.astype(np.int32), "lengths": lengths.astype(np.int32)}


def make_batch_fn(cfg: ml_collections.ConfigDict, seed: int):
    t = cfg.task

    def batch_fn(step):  # a deterministic batch per (seed, step): exact resume
        rng = np.random.default_rng([seed, step])
        lengths = rng.integers(t.shift + 1, t.train_length + 1, cfg.train.batch_size)
        return shift_task(rng, cfg.train.batch_size, t.train_length, vocab=t.vocab, shift=t.shift, lengths=lengths)

    return batch_fn


def eval_sets(cfg: ml_collections.ConfigDict) -> dict[int, dict]:
    """Fixed evaluation sets (full-length sequences) at L, 2L, 4L; the same for every scheme and seed."""
    t = cfg.task
    out = {}
    for m in common.ints(t.eval_multiples):
        length = m * t.train_length
        out[length] = shift_task(
            np.random.default_rng([10_000, length]), t.eval_sequences, length, vocab=t.vocab, shift=t.shift
        )
    return out


# ------------------------------------------------------------------------------------------
# Model, training, evaluation


def build_model(cfg: ml_collections.ConfigDict, scheme: str, seed: int) -> nnx.Module:
    m, t = cfg.model, cfg.task
    rngs = nnx.Rngs(seed)
    encoder = nn.Encoder(
        vocab_sizes=t.vocab,
        d_model=m.d_model,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        mlp_dim=m.mlp_dim,
        dropout_rate=m.dropout,
        posenc=positional.encoding(
            scheme,
            max_len=max(common.ints(t.eval_multiples)) * t.train_length,  # the absolute tables cover the eval lengths
            num_buckets=m.t5_buckets,
            max_distance=m.t5_max_distance,
        ),
        rngs=rngs,
    )
    return nn.TokenClassifier(encoder, t.vocab + 1, rngs=rngs)


@nnx.jit
def _correct(model, inputs, targets, lengths):
    pred = model(inputs, lengths).argmax(-1)  # [B, T]
    return (pred == targets) & nn.sequence_mask(lengths, inputs.shape[1])


def evaluate(model, sets: dict[int, dict], train_length: int) -> dict:
    """Token accuracy per eval length, and (for lengths > L) accuracy on the positions t >= L only.

    All sets are padded to the longest length and run as one batch (one compile); padding never
    changes the real positions (``tests/test_nn.py``), so this equals evaluating each set alone.
    """
    T = max(sets)
    padded = {
        k: np.concatenate([np.pad(b[k], ((0, 0), (0, T - n))) for n, b in sets.items()]) for k in ("inputs", "targets")
    }
    padded["lengths"] = np.concatenate([b["lengths"] for b in sets.values()])
    ok = np.asarray(_correct(model, *(jnp.asarray(padded[k]) for k in ("inputs", "targets", "lengths"))))
    out, row = {}, 0
    for length, b in sets.items():
        rows = ok[row : row + len(b["lengths"]), :length]
        row += len(b["lengths"])
        out[f"acc@{length}"] = float(rows.mean())
        if length > train_length:
            out[f"acc_beyond_L@{length}"] = float(rows[:, train_length:].mean())
    return out


def run_one(cfg: ml_collections.ConfigDict, scheme: str, seed: int, out: Path, *, verbose: bool = True) -> dict:
    """Train one (scheme, seed) and evaluate it; returns the result record."""
    model = build_model(cfg, scheme, seed)
    t = cfg.train
    tx = train_lib.adamw_cosine(t.learning_rate, t.warmup_steps, t.num_steps, t.weight_decay)

    def loss_fn(m, batch, key):
        logits = m(batch["inputs"], batch["lengths"], dropout_key=key)
        return train_lib.masked_cross_entropy(logits, batch["targets"], batch["lengths"])

    workdir = out / "runs" / scheme / f"seed{seed}"
    model, records = train_lib.train(
        model, tx, loss_fn, make_batch_fn(cfg, seed), num_steps=t.num_steps, seed=seed, workdir=workdir,
        log_every=t.log_every, verbose=verbose,
    )  # fmt: skip
    final = [r for r in records if r["split"] == "train"][-1]
    return {
        "scheme": scheme,
        "seed": seed,
        "variant": cfg.variant,
        "train_length": cfg.task.train_length,
        "steps": t.num_steps,
        "params": train_lib.num_params(model),
        "train_time_s": round(common.train_time(records), 1),
        "final_train_loss": final["loss"],
        "final_train_accuracy": final.get("accuracy"),
        **evaluate(model, eval_sets(cfg), cfg.task.train_length),
        **common.env(),
    }


def run(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    """Every (scheme, seed) of the config not yet in ``<out>/results.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    common.save_config(cfg, out / "config.json")
    cells = [{"scheme": s, "seed": seed} for s in _names(cfg.schemes) for seed in common.ints(cfg.seeds)]
    return common.run_grid(
        out / "results.jsonl", cells, lambda c: run_one(cfg, c["scheme"], c["seed"], out, verbose=verbose),
        verbose=verbose, name="posenc",
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# Report: table and figures from results.jsonl alone


def summarize(results: list[dict], prefix: str = "acc@") -> dict:
    """``{scheme: {length: (mean, std, n)}}`` of the ``<prefix><length>`` fields over seeds, schemes in
    ``positional.SCHEMES`` order; std is numpy's population std (ddof=0)."""
    keys = sorted({k for r in results for k in r if k.startswith(prefix)}, key=lambda k: int(k.split("@")[1]))
    stats = {k: common.summarize(results, ("scheme",), k) for k in keys}
    return {
        s: {int(k.split("@")[1]): stats[k][(s,)] for k in keys if (s,) in stats[k]}
        for s in positional.SCHEMES
        if any(r["scheme"] == s for r in results)
    }


def report(folder: Path) -> str:
    plt = common.pyplot()

    results = common.read_jsonl(folder / "results.jsonl")
    if not results:
        raise FileNotFoundError(f"no results in {folder / 'results.jsonl'}: run the experiment first")
    table = summarize(results)
    beyond = summarize(results, "acc_beyond_L@")
    lengths = sorted({n for row in table.values() for n in row})
    longer = sorted({n for row in beyond.values() for n in row})
    L = min(lengths)
    header = ["posenc", *(f"acc @ {n} ({n // L}L)" for n in lengths), *(f"t >= L @ {n // L}L" for n in longer)]
    header += ["seeds", "train time (s)"]
    rows = []
    for scheme, row in table.items():
        times = [r["train_time_s"] for r in results if r["scheme"] == scheme]
        cells = [common.mean_std(row[n], scale=100) for n in lengths]
        cells += [common.mean_std(beyond[scheme][n], scale=100) for n in longer]
        rows.append([scheme, *cells, row[L][2], f"{np.mean(times):.0f}"])
    text = common.markdown_table(header, rows)
    (folder / "summary.md").write_text(
        text + "\n\nToken accuracy (%), mean ± std (ddof=0) over seeds; 't >= L': only the positions beyond the "
        "training length. Chance is about 1/V.\n"
    )

    schemes = list(table)
    x = np.arange(len(schemes))
    fig, ax = plt.subplots(figsize=(1.0 * len(schemes) + 2, 3.4))
    ax.bar(x, [100 * table[s][L][0] for s in schemes], yerr=[100 * table[s][L][1] for s in schemes], capsize=4)
    ax.set_xticks(x, schemes)
    ax.set_ylim(0, 100)
    ax.set_ylabel(f"token accuracy at L = {L} (%)")
    ax.set_title(f"shift task, mean ± std over {max(v[2] for v in table[schemes[0]].values())} seeds")
    common.save_figure(fig, folder / "accuracy.png")

    fig, ax = plt.subplots(figsize=(1.0 * len(schemes) + 3, 3.4))
    width = 0.8 / len(lengths)
    for i, n in enumerate(lengths):
        ax.bar(
            x + (i - (len(lengths) - 1) / 2) * width,
            [100 * table[s][n][0] for s in schemes],
            width,
            yerr=[100 * table[s][n][1] for s in schemes],
            capsize=3,
            label=f"eval length {n} ({n // L}L)",
        )
    ax.set_xticks(x, schemes)
    ax.set_ylim(0, 100)
    ax.set_ylabel("token accuracy (%)")
    ax.set_title(f"length generalisation: trained at L = {L}")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
    common.save_figure(fig, folder / "length.png")
    return text


def _scheme_flag():
    flags.DEFINE_string("posenc", None, "scheme(s) to run, comma-separated, of " + "|".join(SCHEMES))


def _configure(cfg):
    if flags.FLAGS.posenc:
        cfg.schemes = ",".join(_names(flags.FLAGS.posenc))


if __name__ == "__main__":
    common.launch(
        run, report, config="experiments/configs/posenc.py:default", out="results/posenc",
        extra_flags=_scheme_flag, configure=_configure,
    )  # fmt: skip
