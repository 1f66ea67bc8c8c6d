"""The course note's remaining claims about self-attention, measured (issue 19, items 1-3 and 4b).

1. Multi-head: "like several convolution kernels, each head extracts one kind of relation". A heads
   ablation (1, 2, 4, 8 heads at fixed d_model) and a per-head analysis of each trained model.
2. Relevance: the dot product against the additive (tanh) score in the same models.
3. One-hot vs word embedding: "embeddings carry meaning: similar words lie close".
4b. "A CNN is a simplified self-attention", the reverse direction: how far a trained attention layer
   is from any convolution (``attnlab.nn.conv_as_attention`` is the forward, exact direction).

Two tasks, reused (not copied) from their experiments: the shift task of ``experiments/posenc.py``
(output the token k places to the left; RoPE) and Brown POS tagging of ``experiments/pos_tagging.py``.

Commands:

    python -m experiments.claims --config experiments/configs/claims.py:default --out results/claims
    python -m experiments.claims --report results/claims   # summary.md + figures from the JSONL only

Each cell (task, heads, score, input, seed) appends one record to ``<out>/results.jsonl``: accuracy,
the median train step time, the implementation the dispatcher picks per backend, and per (layer,
head): ``offset_mass`` (the mean attention weight a query puts on the key at each relative offset
-R .. R), ``entropy`` (nats, mean over queries; ``uniform_entropy`` is that of uniform attention
over the same rows), ``top_offset`` / ``top_offset_mass`` (the offset with most mass, and that mass:
a convolution head has 1.0), ``r2_offset`` (R² of the best fit of the weights by a function of the
offset s - t alone: 1.0 for any convolution-like head, 0 for weights that ignore the offset) and
``ablated_accuracy`` (accuracy with this head's output projection zeroed at test time). Embedding
cells add the neighbour agreement (how often a word's nearest neighbours share its majority tag) and,
for the learned table, a neighbours table and a 2-D PCA of frequent words.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

import attnlab
from attnlab import heads, inspect, nn
from attnlab import train as train_lib
from attnlab.data import brown
from experiments import common, pos_tagging, posenc
from experiments.claims_report import BACKENDS, report  # noqa: F401  (report: the CLI's)

# ------------------------------------------------------------------------------------------
# Model surgery through the modules' own seams: the score and the frozen embedding


def with_score(model: nn.TokenClassifier, score: str, seed: int) -> nn.TokenClassifier:
    """The model with each block's attention replaced by a fresh ``MultiHeadAttention(score=score)``.

    The task builders (``posenc.build_model``, ``pos_tagging.build_model``) take no score; this swaps
    the attention modules after building, keeping every other parameter as built.
    """
    if score == "dot":
        return model
    rngs = nnx.Rngs(seed + 1000)
    for block in model.backbone.blocks:
        wq = block.attn.wq[...]  # [D, N, H]
        block.attn = nn.MultiHeadAttention(wq.shape[0], wq.shape[1], score=score, rngs=rngs)
    return model


def one_hot_codes(vocab_size: int, d_model: int, seed: int) -> np.ndarray:
    """``[V, D]`` fixed codes standing for one-hot inputs through a frozen projection: random signs
    ``± 1``, so every word has the same norm and distinct words are near-orthogonal (cosine
    ~ N(0, 1/D)): no word is closer to another by construction, as with one-hot vectors."""
    rng = np.random.default_rng([seed, 17])
    return rng.choice(np.array([-1.0, 1.0], np.float32), size=(vocab_size, d_model))


def freeze_word_table(model: nn.TokenClassifier, codes: np.ndarray) -> None:
    """Replace the word embedding (channel 0) by ``codes`` held as a non-trainable variable."""
    emb = model.backbone.embed.embeds[0]
    if emb.embedding[...].shape != codes.shape:
        raise ValueError(f"freeze_word_table: codes {codes.shape} != table {emb.embedding[...].shape}")
    emb.embedding = nnx.Variable(jnp.asarray(codes))  # not an nnx.Param: the trainer holds it fixed


def dispatch_choice(model, inputs, lengths) -> dict[str, str]:
    """The implementation ``attnlab.explain`` gives the model's first attention layer per backend."""
    block = model.backbone.blocks[0]
    B, T = inputs.shape[:2]
    wq = block.attn.wq[...]
    D, N, H = wq.shape
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)  # [B, T, N, H]
    score = heads.resolve_score(block.attn.score, block.attn.params())
    mask = model.backbone.mask(jnp.asarray(lengths))
    return {b: attnlab.explain(q, q, q, mask=mask, score=score, backend=b).implementation for b in BACKENDS}


@nnx.jit
def _weights(model, inputs, lengths):
    return [c.weights for c in inspect.capture(model.backbone, inputs, lengths, record=("weights",)).layers]


def layer_statistics(weights, lengths, max_offset: int) -> dict[str, np.ndarray]:
    """One layer's per-head statistics over the real query rows of a batch: ``attnlab.inspect``'s (a row
    counts when its query is real and it has a nonzero weight).

    ``inspect.summarise`` (``offset_mass`` on offsets -R .. R, ``entropy``, ``uniform_entropy``) and
    ``inspect.offset_profile`` (``top_offset`` over all offsets, ``top_offset_mass``, ``r2_offset``) of
    weights ``[B, N, T, S]`` with real lengths ``[B]``, as numpy arrays ``[N]`` (``offset_mass [N, 2R+1]``).
    """
    w, n = jnp.asarray(weights), jnp.asarray(lengths)
    stats = inspect.summarise(w, offsets=range(-max_offset, max_offset + 1), lengths=n)
    stats |= inspect.offset_profile(w, lengths=n)
    return {k: np.asarray(v) for k, v in stats.items()}


def analyse_heads(model, inputs, lengths, max_offset: int, accuracy_fn) -> tuple[list[dict], list]:
    """Per (layer, head): the statistics of ``layer_statistics`` and the accuracy with that head ablated.

    The weights come from ``attnlab.inspect.capture``; the ablation is ``accuracy_fn`` of
    ``inspect.ablated(model, [(layer, head)])`` (the head's output zeroed before the output
    projection: the same as zeroing its slice ``wo[head]``).
    """
    weights = [np.asarray(w) for w in _weights(model, jnp.asarray(inputs), jnp.asarray(lengths))]
    out = []
    for layer, w in enumerate(weights):
        stats = layer_statistics(w, lengths, max_offset)
        for h in range(w.shape[1]):
            ablated = accuracy_fn(inspect.ablated(model, [(layer, h)]))
            out.append(
                {
                    "layer": layer,
                    "head": h,
                    "offset_mass": np.round(stats["offset_mass"][h], 5).tolist(),
                    "entropy": float(stats["entropy"][h]),
                    "uniform_entropy": float(stats["uniform_entropy"][h]),
                    "top_offset": int(stats["top_offset"][h]),
                    "top_offset_mass": float(stats["top_offset_mass"][h]),
                    "r2_offset": float(stats["r2_offset"][h]),
                    "ablated_accuracy": float(ablated),
                }
            )
    return out, weights


# ------------------------------------------------------------------------------------------
# Tasks: train one cell


def _train(model, tcfg, loss_fn, batch_fn, seed, workdir, verbose, **kw):
    tx = train_lib.adamw_cosine(tcfg.learning_rate, tcfg.warmup_steps, tcfg.num_steps, tcfg.weight_decay)
    model, records = train_lib.train(
        model, tx, loss_fn, batch_fn, num_steps=tcfg.num_steps, seed=seed, workdir=workdir,
        log_every=tcfg.log_every, verbose=verbose, **kw,
    )  # fmt: skip
    train = [r for r in records if r["split"] == "train"]
    final = train[-1]
    # step time from the training log, past the first logged step (which holds the compile)
    span = final["step"] - train[0]["step"]
    final = {**final, "log_step_s": (final["time_s"] - train[0]["time_s"]) / span if span else float("nan")}
    return model, tx, final


def step_time(cfg, model, tx, loss_fn, batch, final) -> float:
    """Median compiled train step (``common.measure_train_step``); ``step_repeats=0``: from the training log."""
    if cfg.step_repeats == 0:
        return final["log_step_s"]
    return common.measure_train_step(model, tx, loss_fn, batch, repeats=cfg.step_repeats)["step_s"]


def run_shift(cfg, cell, out, verbose) -> dict:
    scfg = copy.deepcopy(cfg.shift)
    scfg.model.num_heads = cell["heads"]
    seed = cell["seed"]
    model = with_score(posenc.build_model(scfg, scfg.posenc, seed), cell["score"], seed)

    def loss_fn(m, batch, key):
        logits = m(batch["inputs"], batch["lengths"], dropout_key=key)
        return train_lib.masked_cross_entropy(logits, batch["targets"], batch["lengths"])

    batch_fn = posenc.make_batch_fn(scfg, seed)
    workdir = out / "runs" / _cell_name(cell)
    model, tx, final = _train(model, scfg.train, loss_fn, batch_fn, seed, workdir, verbose)
    L = scfg.task.train_length
    sets = posenc.eval_sets(scfg)
    evalset = {L: sets[L]}
    acc = posenc.evaluate(model, sets, L)
    batch = jax.tree.map(jnp.asarray, batch_fn(1))
    step_s = step_time(cfg, model, tx, loss_fn, batch, final)
    heads, _ = analyse_heads(
        model, evalset[L]["inputs"], evalset[L]["lengths"], cfg.analysis.max_offset,
        lambda m: posenc.evaluate(m, evalset, L)[f"acc@{L}"],
    )  # fmt: skip
    return {
        "accuracy": acc[f"acc@{L}"],
        **{k: v for k, v in acc.items() if k != f"acc@{L}"},
        "posenc": scfg.posenc,
        "d_model": scfg.model.d_model,
        "steps": scfg.train.num_steps,
        "params": train_lib.num_params(model),
        "train_time_s": round(final["time_s"], 1),
        "step_s": step_s,
        "dispatch": dispatch_choice(model, batch["inputs"], batch["lengths"]),
        "heads_analysis": heads,
    }


_POS_DATA: dict = {}


def _pos_data(pcfg):
    key = pcfg.data.to_json_best_effort()
    if key not in _POS_DATA:
        _POS_DATA.clear()
        _POS_DATA[key] = pos_tagging.load_data(pcfg)
    return _POS_DATA[key]


def _word_only(examples):
    return [(x[:, :1], y) for x, y in examples]  # [T, 3] -> [T, 1]: the word id channel


def run_pos(cfg, cell, out, verbose) -> dict:
    pcfg = copy.deepcopy(cfg.pos)
    pcfg.model.num_heads = cell["heads"]
    pcfg.seed = seed = cell["seed"]
    data = _pos_data(pcfg)
    word_only = cell["input"] != "features"
    sizes = data["vocab"].sizes[:1] if word_only else data["vocab"].sizes
    splits = {k: _word_only(data[k]) if word_only else data[k] for k in ("train", "dev", "test")}
    view = {**data, **splits}
    model = pos_tagging.build_model(pcfg, sizes, len(data["tagmap"].tags))
    model = with_score(model, cell["score"], seed)
    if cell["input"] == "word_onehot":
        freeze_word_table(model, one_hot_codes(sizes[0], pcfg.model.d_model, seed))

    def loss_fn(m, batch, key):
        logits = m(batch["inputs"], batch["lengths"], dropout_key=key)
        return train_lib.masked_cross_entropy(logits, batch["tags"], batch["lengths"])

    batch_fn, steps_per_epoch = pos_tagging.make_batch_fn(splits["train"], pcfg.train.batch_size, seed, data["buckets"])
    workdir = out / "runs" / _cell_name(cell)
    model, tx, final = _train(
        model, pcfg.train, loss_fn, batch_fn, seed, workdir, verbose, checkpoint_every=pcfg.train.checkpoint_every
    )
    test = pos_tagging.evaluate(model, splits["test"], data["raw"]["test"], view)
    batch = jax.tree.map(jnp.asarray, batch_fn(1))
    step_s = step_time(cfg, model, tx, loss_fn, batch, final)

    a = cfg.analysis  # attention statistics on short test sentences, padded to one length
    idx = [i for i, (_, y) in enumerate(splits["test"]) if len(y) <= a.pos_max_len][: a.pos_sentences]
    sample = [splits["test"][i] for i in idx]
    padded = brown.pad_batch(sample, buckets=(a.pos_max_len,))
    raw = [data["raw"]["test"][i] for i in idx]

    def accuracy_fn(m):
        return pos_tagging.evaluate(m, sample, raw, view)["accuracy"]

    heads, _ = analyse_heads(model, padded["inputs"], padded["lengths"], a.max_offset, accuracy_fn)
    record = {
        "accuracy": test["accuracy"],
        "ambiguous_accuracy": test["ambiguous_accuracy"],
        "oov_accuracy": test["oov_accuracy"],
        "analysis_accuracy": accuracy_fn(model),  # the base of the ablation drops
        "posenc": pcfg.model.posenc,
        "d_model": pcfg.model.d_model,
        "steps": pcfg.train.num_steps,
        "epochs": round(pcfg.train.num_steps / steps_per_epoch, 2),
        "max_files": pcfg.data.max_files,
        "params": train_lib.num_params(model),
        "train_time_s": round(final["time_s"], 1),
        "step_s": step_s,
        "dispatch": dispatch_choice(model, batch["inputs"], batch["lengths"]),
        "heads_analysis": heads,
    }
    if word_only:
        table = np.asarray(model.backbone.embed.embeds[0].embedding[...])
        record.update(embedding_analysis(table, data, a, learned=cell["input"] == "word_learned"))
    return record


# ------------------------------------------------------------------------------------------
# Embedding analysis


def majority_tags(raw_sentences, tagmap) -> tuple[dict[str, str], dict[str, int]]:
    """Each lowercased word's most frequent (mapped) tag in the sentences, and its count."""
    counts: dict[str, dict[str, int]] = {}
    for sent in raw_sentences:
        for w, t in sent:
            c = counts.setdefault(w.lower(), {})
            tag = tagmap.map(t)
            c[tag] = c.get(tag, 0) + 1
    major = {w: max(c, key=lambda t: (c[t], t)) for w, c in counts.items()}
    return major, {w: sum(c.values()) for w, c in counts.items()}


def nearest(table: np.ndarray, ids: np.ndarray, query: int, k: int) -> list[int]:
    """The k rows of ``ids`` (excluding ``query``) with the highest cosine similarity to ``table[query]``."""
    t = table[ids] / np.maximum(np.linalg.norm(table[ids], axis=1, keepdims=True), 1e-12)
    q = table[query] / max(np.linalg.norm(table[query]), 1e-12)
    sims = t @ q
    order = [int(ids[i]) for i in np.argsort(-sims, kind="stable") if ids[i] != query]
    return order[:k]


def pca_2d(x: np.ndarray) -> np.ndarray:
    """``[n, D]`` -> ``[n, 2]``: projections on the two leading principal components (numpy SVD)."""
    xc = x - x.mean(0)
    _, _, vt = np.linalg.svd(xc, full_matrices=False)
    return xc @ vt[:2].T


def embedding_analysis(table: np.ndarray, data: dict, a: ml_collections.ConfigDict, *, learned: bool) -> dict:
    """Neighbour agreement (and, for a learned table, neighbours of probe words and a 2-D PCA)."""
    major, count = majority_tags(data["raw"]["train"], data["tagmap"])
    vocab = data["vocab"].words  # word -> id
    frequent = sorted((w for w in vocab if w in count), key=lambda w: (-count[w], w))
    pool = frequent[: a.neighbour_pool]
    ids = np.array([vocab[w] for w in pool])
    inv = {i: w for w, i in vocab.items()}
    agree = [np.mean([major[inv[j]] == major[w] for j in nearest(table, ids, vocab[w], a.neighbours)]) for w in pool]
    tags = [major[w] for w in pool]
    chance = sum((tags.count(t) / len(tags)) ** 2 for t in set(tags))  # two random pool words share a tag
    out = {"neighbour_tag_agreement": float(np.mean(agree)), "neighbour_tag_chance": float(chance)}
    if learned:
        probes = [w for w in common.names(a.probe_words) if w in vocab]
        out["neighbours"] = {w: [inv[j] for j in nearest(table, ids, vocab[w], a.neighbours)] for w in probes}
        words = frequent[: a.pca_words]
        xy = pca_2d(table[[vocab[w] for w in words]])
        xy = np.round(xy, 4).tolist()
        out["pca"] = [[w, major[w], x, y] for w, (x, y) in zip(words, xy, strict=True)]
    return out


# ------------------------------------------------------------------------------------------
# The grid


def _cell_name(cell: dict) -> str:
    return f"{cell['task']}-h{cell['heads']}-{cell['score']}-{cell['input']}-s{cell['seed']}"


def cells(cfg: ml_collections.ConfigDict) -> list[dict]:
    """The cells of ``cfg.parts`` over ``cfg.tasks``, each once, in run order (shift first: cheap)."""
    parts, tasks = common.names(cfg.parts), common.names(cfg.tasks)
    out = []
    for task in ("shift", "pos"):
        if task not in tasks:
            continue
        seeds = common.ints(cfg[task].seeds)
        inp = "tokens" if task == "shift" else "features"
        for seed in seeds:
            if "heads" in parts:
                out += [dict(task=task, heads=n, score="dot", input=inp, seed=seed) for n in common.ints(cfg.heads)]
            if "score" in parts:
                out += [
                    dict(task=task, heads=cfg.score_heads, score=s, input=inp, seed=seed) for s in ("dot", "additive")
                ]
            if "embed" in parts and task == "pos":
                out += [
                    dict(task=task, heads=cfg.score_heads, score="dot", input=i, seed=seed)
                    for i in ("word_learned", "word_onehot")
                ]
    unique = []
    for c in out:
        if c not in unique:
            unique.append(c)
    return unique


def run(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    """Every cell of the config not yet in ``<out>/results.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.to_json_best_effort(indent=2))

    def run_cell(cell):
        t0 = time.perf_counter()
        fn = run_shift if cell["task"] == "shift" else run_pos
        record = fn(cfg, cell, out, verbose)
        return {**record, "variant": cfg.variant, "cell_time_s": round(time.perf_counter() - t0, 1), **common.env()}

    return common.run_grid(out / "results.jsonl", cells(cfg), run_cell, verbose=verbose, name="claims")


if __name__ == "__main__":
    common.launch(run, report, config="experiments/configs/claims.py:default", out="results/claims")
