"""Chinese part-of-speech tagging (People's Daily, January 1998, 44 PKU tags): the POS experiment's pku configs.

The course note's own example: in 意思 一下 ， 小 意思 ("a small token of thanks; it's nothing")
the word 意思 is a verb the first time and a noun the second; a tagger that sees each word alone
cannot tell them apart. Same entry point, trainer and models as the Brown experiment
(``experiments/pos_tagging.py``); only the data (``attnlab.data.pku``) and these configs differ.

Commands:

    make pos-zh                     # every variant of POS_ZH_VARIANTS into results/pos-zh/, then the report
    python -m experiments.pos_tagging --config experiments/configs/pos_zh.py:attention --out results/pos-zh
    python -m experiments.pos_tagging --report results/pos-zh   # table + figures from the JSON only

Data and split: ``attnlab.data.pku`` (paragraph i of the file -> dev if i % 10 == 8, test if
i % 10 == 9, else train; paragraphs cut into sentences after 。！？；, at most 128 tokens).
Train 38,055 sentences / 895,066 tokens, dev 4,863 / 114,777, test 4,736 / 111,604; 2.9% of
test tokens are words never seen in train (OOV).

Inputs per word: word id (min count 2), first- and last-character ids, a shape id, and a
character view: the word's characters (up to 6) through a char CNN (width 3, max-pooled), added
to the word embedding (``attnlab.nn.Chars``).

Each run also reports accuracy on every occurrence of ``focus_word`` (意思) in dev + test
(standalone, and words containing it such as 不好意思, 有意思) and tags ``example`` (the note's
sentence, segmented as given); ``example_gold`` is the note's reading in PKU tags as the corpus
uses them for these words (一下/m 63 of 63 times, 小/a 566 of 575).

Variants (d=64, batch 64 sentences, 2,000 AdamW steps ~ 3.4 epochs; measured numbers, one seed:
docs/pos_tagging.md, "Chinese: People's Daily 1998", generated from docs/results/pos-zh/results.jsonl):
    attention  2-layer pre-norm self-attention encoder, 4 heads, sinusoidal positions, window +-4
               (the Brown runs found a small window better than full attention for POS).
    mlp        per-word MLP: no context at all.
    cnn        2 convolutions of width 5 (+-4 words).
    gru        1-layer bidirectional GRU.
    attention_full  the same as attention with full attention (not measured).
    smoke      tiny model, 300 paragraphs, 10 steps: seconds; used by the tests.
"""

from experiments.configs import pos_tagging

POS_ZH_VARIANTS = ("attention", "mlp", "cnn", "gru")


def get_config(variant: str = "attention"):
    if variant not in POS_ZH_VARIANTS + ("smoke", "attention_full"):
        raise ValueError(
            f"unknown pos_zh variant {variant!r}: use one of {POS_ZH_VARIANTS + ('attention_full', 'smoke')}"
        )
    c = pos_tagging.get_config("attention")
    c.variant = variant
    c.data = dict(
        corpus="pku",
        tagset="pku",
        max_paragraphs=None,  # None: all 19,484; n: the first n paragraphs
        max_len=128,  # longer sentences are cut into chunks of this many tokens
        num_chars=6,  # characters per word for the char view
        min_count=2,
        max_eval_sentences=None,
        buckets=(16, 32, 64, 128),
    )
    c.model.chars = "cnn"  # the char view: "cnn" | "mean" | None
    c.model.char_kernel = 3
    c.model.window = 4
    c.train.num_steps = 2000
    c.train.eval_every = 500
    c.focus_word = "意思"
    c.example = "意思 一下 ， 小 意思"
    c.example_gold = "v m w a n"
    match variant:
        case "attention":
            pass
        case "attention_full":
            c.model.window = None
        case "mlp" | "cnn" | "gru":
            c.model.kind = variant
        case "smoke":
            c.data.max_paragraphs = 300
            c.data.max_len = 64
            c.data.buckets = (64,)  # one shape: one compile
            c.model.update(d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
            c.train.update(
                batch_size=16,
                num_steps=10,
                log_every=5,
                eval_every=10,
                checkpoint_every=10,
                warmup_steps=5,
                learning_rate=1e-2,
            )
    return c
