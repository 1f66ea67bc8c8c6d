"""Named variants of the attention sweep (`python -m experiments.sweep --config experiments/configs/sweep.py:NAME`).

Variants:
    default     `make sweep`: minutes on a 2-core CPU (docs/results/sweep/run.json). Full, causal and
                +-64 window masks, N = 512..2048,
                1 and 8 heads, forward and forward+backward, reference / xla / blockwise. Expect:
                quadratic growth for the dense implementations with every mask (they compute every
                pair, then mask); "xla" ahead of the fp32 reference; "blockwise" ahead of both at
                N >= 1K, and for the window mask nearly linear in N (it skips the empty tiles).
    smoke       seconds; used by the tests.
    long        `make sweep-long`: N up to 16K, for a GPU/TPU or a patient CPU; cells that run out of
                memory are recorded as "oom" and the sweep goes on.
    lra_table2  the shape of the Long Range Arena efficiency table (Tay et al. 2020, arXiv 2011.04006,
                Table 2): attention forward+backward steps/s and memory at N = 1K, 2K, 3K, 4K, for each
                attention variant available.

Any field can be overridden on the command line, e.g. `--config.seq_lens=512,1024` or, for the
common ones, the plain flags `--seq_lens=512,1024 --num_heads=4`.
"""

import ml_collections


def get_config(variant: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.seq_lens = [512, 1024, 2048]
    c.num_heads = [1, 8]
    c.head_dim = 64
    c.batch = 1
    c.implementations = ["reference", "xla", "blockwise"]
    c.masks = ["full", "causal", "window:64:64"]
    c.scores = ["dot"]  # attnlab.scores.from_spec: dot, softcap:CAP, alibi, additive (--scores)
    c.modes = ["fwd", "fwd_bwd"]
    c.dtypes = ["auto"]  # bfloat16 on GPU/TPU, float32 on CPU (experiments.sweep.resolve_dtypes)
    c.repeats = 3
    c.cell_timeout_s = 60.0
    c.seed = 0
    c.mesh = ""  # one device; "sp=8", "heads=4,sp=2": attnlab.parallel over that mesh (--mesh)
    if variant == "default":
        pass
    elif variant == "smoke":
        c.seq_lens = [32, 64]
        c.num_heads = [1, 2]
        c.head_dim = 8
        c.masks = ["full", "window:4:4"]
        c.implementations = ["reference", "xla"]
        c.modes = ["fwd"]
        c.repeats = 2
    elif variant == "long":
        c.seq_lens = [1024, 2048, 4096, 8192, 16384]
        c.num_heads = [8]
        c.implementations = ["xla", "blockwise", "sparse"]
        c.masks = ["full", "causal", "window:128:128", "graph:0.01"]
        c.repeats = 3
        c.cell_timeout_s = 600.0
    elif variant == "lra_table2":
        c.seq_lens = [1024, 2048, 3072, 4096]
        c.num_heads = [8]
        c.implementations = ["reference", "xla", "blockwise"]
        c.masks = ["full", "window:128:128", "causal"]
        c.modes = ["fwd_bwd"]
        c.repeats = 3
        c.cell_timeout_s = 300.0
    else:
        raise ValueError(f"unknown sweep variant {variant!r}: use default, smoke, long or lra_table2")
    return c
