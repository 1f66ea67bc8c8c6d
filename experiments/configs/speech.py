"""Speech recognition on spoken numbers (espeak-ng): an encoder-decoder, truncated self-attention.

Commands:

    make speech
    # = python -m experiments.speech --config experiments/configs/speech.py:default --out results/speech
    python -m experiments.speech --report results/speech     # tables + figures from the JSONL alone

Variants:
    default  3000 training utterances (numbers 0..999999 read by 4 accents x 10 voice variants),
             300 held-out numbers, 150 of them read by a held-out voice variant; 80 log-mel frames,
             per-utterance CMVN, 4x subsampled; encoder 3 layers, decoder 2, d = 96, 4 heads; 600
             AdamW steps of 32 utterances of similar length; loss 0.7 attention + 0.3 CTC (hybrid
             CTC/attention); encoder windows full, ±32, ±16, ±8, ±4, ±2 (after subsampling); seeds 0, 1, 2.
    budget   the same data, d = 64, 2 + 1 layers, 600 steps of 16, windows full, ±16, ±4, no CMVN,
             no CTC: what a loaded shared CPU finished in an earlier session, then with random
             batches (it did not learn; docs/speech.md, docs/results/speech-budget/).
    smoke    a few utterances, a tiny model, 1 window, a few steps: seconds (tests/test_speech.py).

Every field can be overridden, e.g. `--config.train.num_steps=3000 --config.windows=full,16`. Brown
sentences instead of numbers (not part of `make speech`; its run and command are in
docs/results/speech-sentences/): `--config.data.corpus=sentences --config.model.max_target_len=120
--config.eval.max_len=120`.
"""

import ml_collections


def get_config(variant: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.windows = "full,32,16,8,4,2"  # encoder self-attention: full, or ±w frames after subsampling
    c.seeds = "0,1,2"
    c.data = ml_collections.ConfigDict(
        dict(num_train=3000, num_test=300, num_new_voice=150, seed=0, corpus="numbers", cmvn=True)
    )
    c.model = ml_collections.ConfigDict(
        # max_target_len: the longest reading, "nine hundred and ninety nine thousand ...", is 66 characters + EOS
        dict(d_model=96, num_heads=4, encoder_layers=3, decoder_layers=2, subsample=2, dropout=0.1, max_target_len=80)
    )
    c.train = ml_collections.ConfigDict(
        dict(
            batch_size=32,
            num_steps=600,
            learning_rate=2e-3,
            warmup_steps=100,
            weight_decay=1e-4,
            label_smoothing=0.1,
            ctc_weight=0.3,  # hybrid CTC/attention training (an auxiliary CTC loss on the encoder); 0 = off
            pad_to=192,  # batches of similar lengths, frames padded to a multiple of 192: 3 shapes, 3 compiles
            target_pad=80,  # characters padded to a multiple of 80 (= every batch to the longest, 71): 1 shape
            log_every=50,
        )
    )
    c.eval = ml_collections.ConfigDict(dict(batch_size=50, beam=4, alpha=1.0, max_len=80))
    # encoder cost vs utterance length (random frames; untrained model): windows to compare
    c.scaling = ml_collections.ConfigDict(dict(frames="500,1000,2000,3000", windows="full,16", repeats=3))
    c.decoding = ml_collections.ConfigDict(dict(tokens=200, batch=8, repeats=3))
    match variant:
        case "default":
            pass
        case "budget":  # what a loaded 2-core CPU finished in about an hour (it did not learn)
            c.windows = "full,16,4"
            c.seeds = "0"
            c.data.cmvn = False
            c.train.ctc_weight = 0.0
            c.model.update(d_model=64, encoder_layers=2, decoder_layers=1)
            c.train.update(batch_size=16, num_steps=600, warmup_steps=50)
            c.scaling.update(repeats=2)
        case "smoke":
            c.windows = "2"
            c.seeds = "0"
            c.data.update(num_train=12, num_test=4, num_new_voice=2)
            c.model.update(d_model=16, num_heads=2, encoder_layers=1, decoder_layers=1)
            # target_pad stays 80 (every batch padded to the longest target): the 2 steps share one compile
            c.train.update(batch_size=4, num_steps=2, warmup_steps=1, log_every=1, pad_to=640)
            c.eval.update(batch_size=4, beam=2, max_len=8)
            c.scaling.update(frames="64", windows="full,2", repeats=1)
            c.decoding.update(tokens=12, batch=2, repeats=1)
        case _:
            raise ValueError(f"unknown speech variant {variant!r}: use one of ('default', 'budget', 'smoke')")
    return c
