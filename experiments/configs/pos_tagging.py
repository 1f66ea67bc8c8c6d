"""Part-of-speech tagging on the Brown corpus: one variant per model.

Command (one model):

    python -m experiments.pos_tagging --config experiments/configs/pos_tagging.py:attention \
        --out results/pos

`make pos` runs the variants of POS_VARIANTS one after the other (each into results/pos/<variant>/)
and then draws the figures and table from the JSONL (`--report`).

Variants (12 universal tags, Petrov et al. 2012; inputs: word id + 3-letter suffix + word shape;
d=64, 2 layers, batch 64 sentences, 2,500 AdamW steps = 3.5 epochs). Measured test accuracies (one
seed): docs/pos_tagging.md, generated from docs/results/pos/results.jsonl.
    attention    pre-norm self-attention encoder, 4 heads, sinusoidal positions, full attention.
    window2/4/8  the same with each word seeing only +-2/4/8 neighbours (a locality prior that
                 full attention must learn from data).
    nopos        full attention without positional encoding (a bag of context words).
    learned      full attention with a learned position table (init std 0.02).
    mlp          per-token MLP (no context).
    cnn          2 convolutions of width 5 (+-4 words of context).
    lstm         1-layer bidirectional LSTM.
    smoke        tiny model, 8 files, 30 steps, one padded length: seconds; used by the tests.

Every field can be overridden, e.g. `--config.train.num_steps=500 --config.model.d_model=64`.
"""

import ml_collections

POS_VARIANTS = ("attention", "mlp", "cnn", "lstm", "window2", "window4", "window8", "nopos", "learned")


def get_config(variant: str = "attention") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.seed = 0
    c.data = ml_collections.ConfigDict(
        dict(
            tagset="universal",  # or "base" (Brown tags without -tl/-hl/-nc/fw-)
            max_files=None,  # None: all 500 files; n: the first n (ca01 ...)
            min_count=2,  # words seen fewer times in train share the OOV id
            max_eval_sentences=None,  # None: the whole dev/test split
            buckets=(16, 32, 64, 128, 256),  # batches are padded to one of these lengths (one compile each)
        )
    )
    c.model = ml_collections.ConfigDict(
        dict(
            kind="attention",  # attention | mlp | cnn | lstm | gru
            d_model=64,
            num_layers=2,
            num_heads=4,
            mlp_dim=256,
            dropout=0.1,
            posenc="sinusoidal",
            window=None,  # window w: each word sees w neighbours on each side
            kernel_size=5,
        )
    )
    c.train = ml_collections.ConfigDict(
        dict(
            batch_size=64,
            num_steps=2500,
            learning_rate=3e-3,
            warmup_steps=200,
            weight_decay=1e-4,
            log_every=50,
            eval_every=500,
            checkpoint_every=500,
        )
    )
    match variant:
        case "attention":
            pass
        case "window2" | "window4" | "window8":
            c.model.window = int(variant.removeprefix("window"))
        case "nopos":
            c.model.posenc = "none"
        case "learned":
            c.model.posenc = "learned"
        case "mlp" | "cnn" | "lstm" | "gru":
            c.model.kind = variant
        case "smoke":
            c.data.max_files = 8
            c.data.max_eval_sentences = 200
            c.data.buckets = (256,)  # one shape: one compile
            c.model.update(d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
            c.train.update(
                batch_size=16,
                num_steps=30,
                log_every=10,
                eval_every=30,
                checkpoint_every=15,
                warmup_steps=5,
                learning_rate=1e-2,
            )
        case _:
            raise ValueError(
                f"unknown pos_tagging variant {variant!r}: use one of {POS_VARIANTS + ('learned', 'gru', 'smoke')}"
            )
    return c
