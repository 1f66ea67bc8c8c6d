"""The blockwise (flash-style, block-sparse) kernel as an implementation: ``attnlab.kernels.blockwise``."""

from __future__ import annotations

import numpy as np

from attnlab import masks as masks_lib
from attnlab import scores as scores_lib
from attnlab import tuning
from attnlab.impls.base import Implementation, static_scale_reason
from attnlab.kernels import blockwise as kernel

__all__ = [
    "BLOCKWISE",
    "BLOCKWISE_MIN_PAIRS",
    "BLOCKWISE_MAX_VISITED",
    "BLOCKWISE_GQA_MIN_PAIRS",
    "PAIR_FORM_DENSE_BYTES",
    "visited_share",
]

# implementation=None on CPU sends dot-product attention with at least this many (query, key) pairs
# to the blockwise kernel: on the 2-core CPU it ran the forward 1.3x faster than jax.nn at
# T = S = 256 and 512 and 2.3x at 1K, fwd+bwd 1.2x at 1K (`make bench`; it compiles ~3x longer).
BLOCKWISE_MIN_PAIRS = 512 * 512

# Below that, a mask with an EMPTY 64 x 64 tile sends the call to the blockwise kernel where its non-empty
# tiles cover at most BLOCKWISE_MAX_VISITED of the pairs, and above that share only with fewer key heads
# than query heads (K < N) from BLOCKWISE_GQA_MIN_PAIRS pairs. Elsewhere (causal, causal windows and
# ±32 windows at T = 128..384) dense XLA ran forward+backward faster in both runs of `make crossover`
# (B x N x H = 2 x 4 x 32, the same with one key head, 1 x 8 x 64; T = 128..1024; the gradients for a
# fixed output cotangent; docs/kernels.md), while the kernel ran the forward alone faster: a training
# step runs both.
BLOCKWISE_MAX_VISITED = 0.5
BLOCKWISE_GQA_MIN_PAIRS = 256 * 256

# A score with a pair form (additive: tanh(q_t + k_s) for every pair and head dim) takes the blockwise
# kernel on cpu once the reference's dense [B, T, S, N, H] fp32 intermediate would exceed this.
PAIR_FORM_DENSE_BYTES = 64 * 2**20


def visited_share(mask, T: int, S: int, backend: str = "cpu") -> float:
    """The share of the ``[T, S]`` tiles (the backend's sparse tiles) that ``mask``'s block layout leaves
    non-empty: what the blockwise kernel still visits. 1.0 for no mask, a full mask or an empty shape.

    The layout is always safe, so it counts even when the mask holds traced data (padding lengths under
    jit): its structural part (window, causal, BigBird) still has EMPTY tiles."""
    if mask is None or mask.is_full or not T or not S:
        return 1.0
    bs = kernel.default_block_sizes(backend, sparse=True)
    layout = np.asarray(mask.block_layout(T, S, min(bs.block_q, T), min(bs.block_k, S)))
    return float((layout != masks_lib.EMPTY).mean())


class Blockwise(Implementation):
    """Online softmax over the non-empty tiles of the mask's block layout; O(T + S) memory."""

    name = "blockwise"
    features = frozenset({"dropout", "lse"})

    def supports(self, call, backend):
        """None when the kernel computes the bound call's score in its tiles (``score.tile_form()``), else why
        not. Any bias: None, a callable of positions, or an array (sliced per tile)."""
        if (reason := static_scale_reason("blockwise", call)) is not None:
            return reason
        if call.score.tile_form() is None:
            return (
                f"computes scores with a tile form only (Dot, SoftCap, ScoreMod, Additive; got "
                f"{type(call.score).__name__}, dense only: write a per-element change as scores.ScoreMod)"
            )
        return None

    def pays_off(self, call, backend):
        if call.bias_kind == "array":
            # the kernel takes an array bias (sliced per tile) when asked, but its backward adds each
            # tile's bias gradient into a full [T, S] buffer: not a default choice
            return "an array bias is O(T*S) already and its blockwise backward is slow: xla (or pass a callable bias)"
        if backend != "cpu":
            return None  # the portable fallback after the fused kernels and XLA
        T, S = call.T, call.S
        if T * S >= BLOCKWISE_MIN_PAIRS:
            return None
        if (
            isinstance(call.score.tile_form(), scores_lib.PairTile)
            and 4 * call.batch * T * S * call.N * call.H > PAIR_FORM_DENSE_BYTES
        ):
            return None
        bs = kernel.default_block_sizes(backend, sparse=True)
        bq, bk = min(bs.block_q, T), min(bs.block_k, S)
        visited = visited_share(call.mask, T, S, backend)
        if visited == 1.0:
            return (
                f"pays off on cpu from {BLOCKWISE_MIN_PAIRS} (query, key) pairs or with an EMPTY {bq} x {bk} tile "
                f"(here {T} x {S}, none empty)"
            )
        if visited <= BLOCKWISE_MAX_VISITED or (call.K < call.N and T * S >= BLOCKWISE_GQA_MIN_PAIRS):
            return None
        return (
            f"below {BLOCKWISE_MIN_PAIRS} pairs on cpu its non-empty {bq} x {bk} tiles must cover at most "
            f"{BLOCKWISE_MAX_VISITED:.0%} of the pairs (here {visited:.0%}), or K < N from "
            f"{BLOCKWISE_GQA_MIN_PAIRS} pairs (here K = {call.K}, N = {call.N}, {T * S} pairs): dense xla is faster"
        )

    def run(self, call):
        return kernel.attend(call, block_sizes=tuning.lookup(self.name, call))

    tunable = None  # set below


class BlockwiseTuning:
    """The blockwise kernel's tunable parameters: its tile sizes (``kernels.BlockSizes``)."""

    def space(self, call, backend):
        """Tile rows 64..1024 by columns 64..512 (powers of two, at most the next power of two of T / S)."""
        cap_q, cap_k = 1 << max(0, call.T - 1).bit_length(), 1 << max(0, call.S - 1).bit_length()
        sizes = {(min(bq, cap_q), min(bk, cap_k)) for bq in (64, 128, 256, 512, 1024) for bk in (64, 128, 256, 512)}
        return [kernel.BlockSizes(bq, bk) for bq, bk in sorted(sizes)]

    def run(self, call, config):
        return kernel.attend(call, block_sizes=config)

    def to_json(self, config):
        return {"block_q": config.block_q, "block_k": config.block_k}

    def from_json(self, d):
        return kernel.BlockSizes(int(d["block_q"]), int(d["block_k"]))


Blockwise.tunable = BlockwiseTuning()
BLOCKWISE = Blockwise()
