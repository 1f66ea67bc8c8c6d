"""A word-level language model on Brown's paragraphs, trained on packed rows and on padded rows.

Command (the whole run, about 5-10 minutes on the 2-core CPU; its wall and CPU time and the load:
docs/results/lm/run.json):

    make lm
    # = python -m experiments.lm --config experiments/configs/lm.py:default --out docs/results/lm
    python -m experiments.lm --report docs/results/lm     # table + figure from the JSONL alone

Data: Brown's 15,667 paragraphs (``brown.load_paragraphs``) are the documents, split by
``brown.split`` (paragraph i: i % 10 == 9 held out, 8 unused, the rest train). Words lowercased;
the vocabulary is ``brown.Vocab`` on the training paragraphs with ``min_count`` (words rarer than
that share the OOV id) plus BOS and EOS. A document is ``BOS w_1 .. w_n`` predicting ``w_1 .. w_n EOS``;
one longer than ``row_len`` is cut into chunks of ``row_len`` (each a document of its own, in both
layouts). ``row_len`` = 128 covers 85% of the paragraphs whole.

Both layouts train on the same chunks in the same order, ``docs_per_step`` per step: padded puts
one per row (``[docs_per_step, row_len]``); packed puts the same chunks into as few rows of
``row_len`` as first-fit decreasing allows (rounded up to a multiple of ``row_multiple``, a few
shapes to compile). The loss is the mean over the step's real targets, so the two layouts compute
the same gradients and differ in the time they take.

Variants:
    default  d = 128, 2 layers, 4 heads, MLP 512, sinusoidal positions; 200 AdamW steps of 24
             documents; seeds 0, 1, 2, packed and padded alternating (6 runs).
    smoke    4 files, a tiny model, 6 steps, one seed: seconds; used by the tests.

Every field can be overridden, e.g. `--config.train.num_steps=50 --config.seeds=0`.
"""

import ml_collections


def get_config(variant: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.seeds = "0,1,2"
    c.layouts = "packed,padded"  # alternating per seed: the tokens/s ratio comes from back-to-back runs
    c.data = ml_collections.ConfigDict(
        dict(
            max_files=None,  # all 500 files
            min_count=50,  # training-split words seen fewer times share the OOV id (vocabulary 1,810)
            row_len=128,
            max_eval_docs=None,  # held-out paragraphs evaluated (None: all 1,566)
        )
    )
    c.model = ml_collections.ConfigDict(dict(d_model=128, num_layers=2, num_heads=4, mlp_dim=512))
    c.train = ml_collections.ConfigDict(
        dict(
            docs_per_step=24,
            row_multiple=2,  # packed rows per step, rounded up to a multiple of this
            num_steps=200,
            learning_rate=3e-3,
            warmup_steps=30,
            weight_decay=0.01,
            log_every=10,
            eval_rows=64,
        )
    )
    match variant:
        case "default":
            pass
        case "smoke":
            c.seeds = "0"
            c.data.update(max_files=4, min_count=3, row_len=32, max_eval_docs=12)
            c.model.update(d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
            c.train.update(docs_per_step=8, num_steps=6, warmup_steps=2, log_every=2, eval_rows=8)
        case _:
            raise ValueError(f"unknown lm variant {variant!r}: use one of ('default', 'smoke')")
    return c
