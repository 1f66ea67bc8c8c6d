"""The course note's remaining claims, measured: heads, relevance functions, embeddings, conv distance.

Command (every part, shift task at its default size, POS at the reduced budget below):

    python -m experiments.claims --config experiments/configs/claims.py:default --out results/claims
    python -m experiments.claims --report results/claims     # tables + figures from the JSONL alone

Parts (``parts``), each a set of cells of one grid keyed by (task, heads, score, input, seed):
    heads   1, 2, 4, 8 heads at fixed d_model (dot score) on the shift task (experiments/posenc.py,
            RoPE, d = 32) and Brown POS (experiments/pos_tagging.py, sinusoidal, d = 64); every
            trained model also gets the per-head analysis: attention mass by relative offset,
            entropy, mass on the top offset (a convolution puts 1.0 there), R² of the best
            offset-only fit, and the accuracy with one head ablated (its output projection zeroed).
    score   the additive (tanh) score in the same models at ``score_heads`` heads, against the dot
            score of the heads part; accuracy, train step time, and which implementation the
            dispatcher (attnlab.explain) gives each score on cpu / gpu / tpu.
    embed   POS from the word id alone: a learned embedding table against one-hot codes through a
            frozen random projection (identity-like: V >> D, so the codes are random near-orthogonal
            rows, fixed); nearest neighbours and a PCA of frequent words in the learned table.

Variants:
    default  shift: posenc's default task and training (V = 16, k = 3, L = 32, 600 steps of 32),
             seeds 0, 1, 2. POS (reduced budget, stated): the first 100 of 500 Brown files, 200 steps
             of 32 sentences padded to 64 or 256 words, dev/test capped at 500 sentences, the attention
             statistics on 128 test sentences, seeds 0, 1, 2. Train step times: median of 3 steps.
             This is the run committed in docs/results/claims/ (its run.json).
    shift    only the shift task (the cheap part).
    pos      only the POS task.
    smoke    tiny everything: seconds; used by tests/test_claims.py.

Every field can be overridden, e.g. `--config.pos.train.num_steps=2500 --config.pos.data.max_files=500`
(all Brown files).
"""

import ml_collections

from experiments.configs import pos_tagging as pos_config
from experiments.configs import posenc as posenc_config

PARTS = ("heads", "score", "embed")


def get_config(variant: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.parts = ",".join(PARTS)
    c.tasks = "shift,pos"
    c.heads = "1,2,4,8"
    c.score_heads = 4  # the head count at which dot and additive are compared
    c.step_repeats = 3  # timed train steps (median) per model; 0: the mean step of the training log

    c.shift = posenc_config.get_config("default")
    c.shift.posenc = "rope"  # relative positions: the offsets the analysis measures
    c.shift.seeds = "0,1,2"

    c.pos = pos_config.get_config("attention")
    c.pos.seeds = "0,1,2"
    c.pos.data.max_files = 100
    c.pos.data.max_eval_sentences = 500
    c.pos.data.buckets = (64, 256)
    c.pos.train.update(batch_size=32, num_steps=200, warmup_steps=20, eval_every=600, checkpoint_every=100)

    c.analysis = ml_collections.ConfigDict(
        dict(
            max_offset=8,  # offsets -8 .. 8 in the per-head profiles
            pos_sentences=128,  # test sentences (<= pos_max_len words) for the attention statistics
            pos_max_len=64,
            probe_words="the,he,said,city,good,quickly,two,in,and,would,water,john",
            neighbours=5,
            neighbour_pool=2000,  # neighbours among the most frequent train words
            pca_words=300,
        )
    )
    match variant:
        case "default":
            pass
        case "shift":
            c.tasks = "shift"
            c.parts = "heads,score"
        case "pos":
            c.tasks = "pos"
        case "smoke":
            c.heads = "2"
            c.score_heads = 2
            c.step_repeats = 0  # step time from the training log: no second compile
            c.shift = posenc_config.get_config("smoke")
            c.shift.posenc = "rope"
            c.shift.seeds = "0"
            c.pos = pos_config.get_config("smoke")
            c.pos.seeds = "0"
            c.shift.train.update(num_steps=10, log_every=5)
            # 3 files: 248 train sentences (31 full batches of 8: no smaller last batch, so no second
            # train-step compile), none longer than 59 words: one padded length of 64, not 256
            c.pos.data.update(max_files=3, max_eval_sentences=50, buckets=(64,))
            c.pos.train.update(batch_size=8, num_steps=10, log_every=5, eval_every=10, checkpoint_every=10)
            c.analysis.update(pos_sentences=16, neighbour_pool=200, pca_words=40, max_offset=3)
        case _:
            raise ValueError(f"unknown claims variant {variant!r}: use one of ('default', 'shift', 'pos', 'smoke')")
    return c
