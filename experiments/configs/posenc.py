"""Positional-encoding ablation: one small encoder, every scheme, several seeds, length generalisation.

Command (the whole ablation; its wall and CPU time: docs/results/posenc/run.json):

    make posenc
    # = python -m experiments.posenc --config experiments/configs/posenc.py:default --out results/posenc
    python -m experiments.posenc --report results/posenc     # table + figures from the JSONL alone

Task ("shift"): a sequence of random symbols x_0 .. x_{T-1} from a vocabulary of V; at every
position t the model outputs x_{t-k} (the token k places to the left), or a blank class for t < k.
What decides the answer is the relative position (t - k), never the absolute one, so a scheme
that encodes offsets can carry what it learned at length L to longer sequences. Training lengths
are uniform in [k + 1, L] (padded to L, masked); evaluation on full sequences of length L, 2L, 4L.

Variants:
    default  V = 16, k = 3, L = 32 (eval at 32, 64, 128); d = 32, 2 layers, 4 heads (head dim 8);
             600 AdamW steps of 32 sequences; schemes none, sinusoidal, learned, rope, alibi, t5;
             seeds 0, 1, 2 (18 runs).
    smoke    tiny model, 2 schemes, 1 seed, 20 steps: seconds; used by the tests.

Measured with `default` (token accuracy %, mean ± std over seeds 0-2): docs/positional.md, generated
from docs/results/posenc/results.jsonl.

Every field can be overridden, e.g. `--config.train.num_steps=3000 --config.schemes=rope,t5`.
"""

import ml_collections

from attnlab import positional

# every sequence scheme of the registry (not the 2-D grid ones): none, sinusoidal, learned, rope, alibi, t5
SCHEMES = tuple(name for name, s in positional.SCHEMES.items() if not s.grid)


def get_config(variant: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.schemes = ",".join(SCHEMES)
    c.seeds = "0,1,2"
    c.task = ml_collections.ConfigDict(
        dict(
            vocab=16,  # V symbols; class V is the blank (t < shift)
            shift=3,  # k: the target at t is x[t - k]
            train_length=32,  # L: training lengths are uniform in [shift + 1, L]
            eval_multiples="1,2,4",  # evaluate at L, 2L, 4L
            eval_sequences=256,  # per eval length (a fixed, seeded set)
        )
    )
    c.model = ml_collections.ConfigDict(
        # t5_max_distance = L: every distance >= L shares T5's last bucket, which training reaches (as in T5,
        # max_distance 128 < its 512 training length); with 128 > L the far buckets stay untrained
        dict(d_model=32, num_layers=2, num_heads=4, mlp_dim=64, dropout=0.0, t5_buckets=32, t5_max_distance=32)
    )
    c.train = ml_collections.ConfigDict(
        dict(
            batch_size=32,
            num_steps=600,
            learning_rate=3e-3,
            warmup_steps=100,
            weight_decay=1e-4,
            log_every=50,
        )
    )
    match variant:
        case "default":
            pass
        case "smoke":
            c.schemes = "rope,alibi"
            c.seeds = "0"
            c.task.update(train_length=8, eval_sequences=16)
            c.model.update(d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
            c.train.update(batch_size=8, num_steps=20, warmup_steps=2, log_every=10)
        case _:
            raise ValueError(f"unknown posenc variant {variant!r}: use one of ('default', 'smoke')")
    return c
