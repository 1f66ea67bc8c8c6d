"""Images as sequences: attention (ViT over patches, pixel-level local attention) against a CNN.

Command (the whole sweep and the figures):

    make images
    # = python -m experiments.images --config experiments/configs/images.py:default --out results/images
    #   python -m experiments.images --config experiments/configs/images.py:pixel --out results/images
    #   python -m experiments.images --report results/images

Variants:
    default  Fashion-MNIST (the Debian package's 60K train / 10K test split), ViT and CNN, each at
             train-set sizes 1K, 5K, 20K, 60K x 3 seeds (seed = model init, batch order and which
             subset of the training set). Same tokens for both: 49 patches of 4 x 4 pixels, each
             a 16-vector, linearly embedded to d=48, mean-pooled into a linear classifier.
             ViT: 3 pre-norm blocks, 4 heads, MLP 96, 2-D sinusoidal positions, full attention
             (58,282 params). CNN: 3 residual 3 x 3 convolutions over the 7 x 7 patch grid
             (63,754 params). A fixed, small budget (what a shared 2-core CPU allows): 200 / 300 /
             400 / 500 steps of batch 64 for 1K / 5K / 20K / 60K images (12.8 / 3.8 / 1.3 / 0.53
             epochs), AdamW (lr 2e-3, weight decay 0.05), 30 warmup steps + cosine, dropout 0.1,
             no augmentation, no early stopping: the test set is evaluated once, at the end.
    pixel    the pixel-level model: 784 tokens (each pixel a 1-vector), 2-D local attention in a
             7 x 7 neighbourhood (``masks.window_2d(28, 3)``, run by the blockwise kernel, which
             skips the tiles outside the band), 2 blocks, d=32, 4 heads; one seed, 5K images,
             200 steps of batch 32; evaluated on the first 2,000 test images.
    epochs   the default ViT and CNN at 1K / 5K / 20K images, each trained for the same 5 epochs
             (78 / 391 / 1,562 steps of batch 64), 3 seeds: compute grows with the data, so whether
             the CNN's lead shrinks with more data is no longer confounded by fewer epochs
             (``make images-epochs``; its wall time is in ``docs/results/images/run.json``).
    smoke    scikit-learn's 8 x 8 digits, ViT and CNN (2 x 2 patches, 16 tokens), sizes 200 / 1,347,
             2 seeds, 12 steps: seconds of compute (mostly compiling); used by the tests. (The pixel
             model is the same Encoder with ``attention_mask``; the tests check it and the mask apart.)

Measured: docs/images.md (tables generated from ``docs/results/images/``, commands and times in its
``run.json``); a rerun writes ``results/images/summary.md``.

Every field can be overridden, e.g. `--config.sizes=1000,5000 --config.seeds=0`.
"""

import ml_collections

VARIANTS = ("default", "pixel", "epochs", "smoke")
EPOCHS = 5  # the `epochs` variant: the same number of passes over the data at every training-set size


def _model(kind, **kw):
    base = dict(
        kind=kind,  # vit | cnn | pixel
        patch=4,  # patch side in pixels (pixel: 1)
        d_model=48,
        num_layers=3,
        num_heads=4,
        mlp_dim=96,
        kernel_size=3,  # cnn
        radius=3,  # pixel: window_2d radius (7 x 7)
        dropout=0.1,
    )
    base.update(kw)
    return base


def get_config(variant: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.dataset = "fashion_mnist"  # or "digits" (scikit-learn, 8 x 8)
    c.sizes = (1000, 5000, 20000, 60000)
    c.seeds = (0, 1, 2)
    c.models = ml_collections.ConfigDict({"vit": _model("vit"), "cnn": _model("cnn")})
    c.train = ml_collections.ConfigDict(
        dict(
            batch_size=64,
            steps=(200, 300, 400, 500),  # one per training-set size in `sizes` (a fixed budget)
            learning_rate=2e-3,
            warmup_steps=30,
            weight_decay=0.05,
            log_every=50,
        )
    )
    c.eval_batch_size = 1000
    c.eval_count = None  # None: the whole test split
    c.distance_images = 500  # test images for the mean attention distance
    match variant:
        case "default":
            pass
        case "pixel":
            c.sizes = (5000,)
            c.seeds = (0,)
            c.models = ml_collections.ConfigDict(
                {"pixel": _model("pixel", patch=1, d_model=32, num_layers=2, num_heads=4, mlp_dim=64)}
            )
            c.train.steps = (200,)
            c.train.batch_size = 32
            c.eval_count = 2000  # the first 2,000 test images (784-token inference is slow on CPU)
            c.distance_images = 32
        case "epochs":
            # the default models at equal epochs instead of equal-ish steps: compute grows with data
            c.sizes = (1000, 5000, 20000)
            c.train.steps = tuple(round(EPOCHS * n / c.train.batch_size) for n in c.sizes)  # 78, 391, 1562
        case "smoke":
            c.dataset = "digits"
            c.sizes = (200, 1347)
            c.seeds = (0, 1)
            c.models = ml_collections.ConfigDict(
                {
                    "vit": _model("vit", patch=2, d_model=16, num_layers=1, num_heads=2, mlp_dim=32),
                    "cnn": _model("cnn", patch=2, d_model=16, num_layers=1),
                }
            )
            c.train.update(batch_size=32, steps=(12, 12), warmup_steps=2, log_every=4)
            c.eval_batch_size = 256
            c.distance_images = 16
        case _:
            raise ValueError(f"unknown images variant {variant!r}: use one of {VARIANTS}")
    return c
