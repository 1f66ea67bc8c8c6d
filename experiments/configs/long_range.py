"""Configs for experiments/long_range.py: ListOps, LRA-style efficiency table, attention vs RNN.

Commands:

    make listops      # = python -m experiments.long_range --config experiments/configs/long_range.py:default \
                      #       --out results/long_range   (wall and CPU time: docs/results/long_range/run.json)
    python -m experiments.long_range --config experiments/configs/long_range.py:smoke --out /tmp/lr   # seconds
    python -m experiments.long_range --config experiments/configs/long_range.py:lra --out results/lra_listops
                      # LRA's ListOps sizes (96K examples, length 500-2000) and model; for a GPU/TPU

Variants:
    default  ListOps ``:cpu`` (20K train, lengths 32-128), d=64, 2 layers, 4 heads, batch 32, the same
             300 AdamW steps for every model (half an epoch: what the shared 2-core CPU allows), 3 seeds;
             efficiency table at N = 512 .. 4K (batch 2); recall task at distances 16 .. 256.
    smoke    tiny everything (used by tests/test_long_range.py).
    lra      LRA's ListOps setting (Tay et al. 2020, appendix: 96K/2K/2K, max length 2000, 4 layers,
             d=512, 8 heads, MLP 1024, batch 32, 5K steps); only the ListOps part.

Every field can be overridden, e.g. ``--config.listops.num_steps=500 --config.models=full,gru``.
"""

import ml_collections

MODELS = ("full", "local", "bigbird", "linear", "performer", "gru")


def get_config(variant: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.seed = 0
    c.parts = "listops,efficiency,recall"  # any subset, comma-separated
    c.models = ",".join(MODELS)
    c.model = ml_collections.ConfigDict(
        dict(
            d_model=64,
            num_layers=2,
            num_heads=4,
            mlp_dim=128,
            dropout=0.0,
            local_chunk=32,  # masks.chunks(c): LRA's local attention
            bigbird_block=16,  # masks.bigbird(N, block_size=b, window_blocks=3, num_global=2, num_random=2)
            bigbird_random=2,
            num_features=64,  # Performer's M
        )
    )
    c.listops = ml_collections.ConfigDict(
        dict(
            data="cpu",  # attnlab.data.listops.VARIANTS
            max_len=128,
            batch_size=32,
            num_steps=300,
            learning_rate=2e-3,
            warmup_steps=30,
            weight_decay=1e-2,
            log_every=50,
            eval_every=150,
            max_eval=500,  # examples of dev used for the periodic dev evaluation
            seeds="0,1,2",  # model init, batch order and BigBird's random blocks; the data is cfg.seed's
        )
    )
    c.efficiency = ml_collections.ConfigDict(
        dict(
            models=",".join(MODELS) + ",full_dense",  # full_dense: full attention with XLA's dense kernel
            seq_lens=(512, 1024, 2048, 3072, 4096),
            batch_size=2,
            repeats=2,  # timed steps after one warm-up step
            local_chunk=128,
            bigbird_block=64,
            bigbird_random=3,
            max_step_s=20.0,  # a model whose step exceeds this skips the longer lengths
        )
    )
    c.recall = ml_collections.ConfigDict(
        dict(
            models="full,gru",
            distances=(16, 64, 128, 256),
            num_keys=8,
            num_distractors=16,
            d_model=32,
            num_layers=1,
            num_heads=2,
            batch_size=32,
            num_steps=250,
            learning_rate=3e-3,
            num_eval=512,
        )
    )
    _variant(c, variant)
    return c


def _variant(c: ml_collections.ConfigDict, variant: str) -> None:
    """The variant's changes to the default config, in place."""
    match variant:
        case "default":
            pass
        case "smoke":  # one model per code path, so the tests stay within seconds of compile time
            c.models = "performer"
            c.model.update(d_model=16, num_layers=1, num_heads=2, mlp_dim=32, local_chunk=8, bigbird_block=8)
            c.model.num_features = 16
            c.listops.update(data="smoke", max_len=32, batch_size=8, num_steps=6, log_every=2, eval_every=3)
            c.listops.update(warmup_steps=2, seeds="0")
            c.efficiency.update(models="bigbird,gru", seq_lens=(64,), batch_size=1, repeats=1, bigbird_block=16)
            c.efficiency.bigbird_random = 1
            c.recall.update(models="full", distances=(6,), d_model=16, batch_size=8, num_steps=4, num_eval=16)
        case "lra":
            c.parts = "listops"
            c.model.update(d_model=512, num_layers=4, num_heads=8, mlp_dim=1024, dropout=0.1)
            c.model.update(local_chunk=128, bigbird_block=64, bigbird_random=3, num_features=256)
            c.listops.update(data="lra", max_len=2000, batch_size=32, num_steps=5000, eval_every=1000)
            c.listops.update(learning_rate=5e-4, warmup_steps=1000, max_eval=2000, seeds="0")
        case _:
            raise ValueError(f"unknown long_range variant {variant!r}: use default, smoke or lra")
