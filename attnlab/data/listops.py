"""ListOps (Nangia & Bowman 2018, arXiv 1804.06028) as used by Long Range Arena (Tay et al. 2020).

A sequence is a nested expression over the digits 0-9 with four list operators::

    [MAX 2 9 [MIN 4 7 ] 0 ]   ->   9

``MAX`` and ``MIN``; ``MED``, the median truncated to an int (``int(median)``, as LRA); ``SM``, the
sum modulo 10. The label is the value (10 classes). The model must parse the hierarchy over
long distances: with LRA's sizes the sequences are 500-2000 tokens.

The generator is seeded and deterministic. A tree's root is always an operator with 2..max_args
arguments; each argument is a digit with probability ``leaf_p`` (LRA: 0.75) and otherwise a
nested operator, until ``max_depth`` forces digits. Samples are drawn until their length falls in
[min_length, max_length] (LRA's rejection rule). Tokens are space-separated; we do not emit the
binary-tree parentheses of the original SPINN files (LRA's own pipeline drops them as well).

Variants (``VARIANTS``): ``cpu`` (lengths 32-128, 20K/1K/1K, depth 5, trains on a 2-core CPU) and
``lra`` (LRA's 96K/2K/2K, lengths 500-2000, depth 10, 10 arguments).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = [
    "OPERATORS",
    "VOCAB",
    "VARIANTS",
    "ListOpsConfig",
    "evaluate",
    "sample",
    "make_split",
    "make_splits",
    "encode",
]

OPERATORS = ("MAX", "MIN", "MED", "SM")
PAD = "<pad>"
VOCAB = (PAD, *(f"[{op}" for op in OPERATORS), "]", *(str(d) for d in range(10)))
TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB)}


@dataclasses.dataclass(frozen=True)
class ListOpsConfig:
    max_depth: int = 10
    max_args: int = 10
    leaf_p: float = 0.75
    min_length: int = 500
    max_length: int = 2000
    num_train: int = 96_000
    num_dev: int = 2_000
    num_test: int = 2_000


VARIANTS = {
    "lra": ListOpsConfig(),
    "cpu": ListOpsConfig(
        max_depth=5,
        max_args=6,
        leaf_p=0.6,
        min_length=32,
        max_length=128,
        num_train=20_000,
        num_dev=1_000,
        num_test=1_000,
    ),
    "smoke": ListOpsConfig(
        max_depth=3, max_args=4, leaf_p=0.6, min_length=8, max_length=32, num_train=64, num_dev=16, num_test=16
    ),
}


def _apply(op, args):
    match op:
        case "MAX":
            return max(args)
        case "MIN":
            return min(args)
        case "MED":
            return int(np.median(args))
        case "SM":
            return sum(args) % 10
    raise ValueError(f"unknown operator {op!r}")


def evaluate(tree) -> int:
    """Value of a tree: an int digit, or (operator, [subtrees])."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    return _apply(op, [evaluate(a) for a in args])


def _tree(rng, depth, cfg):
    op = OPERATORS[rng.integers(len(OPERATORS))]
    args = []
    for _ in range(rng.integers(2, cfg.max_args + 1)):
        if depth + 1 >= cfg.max_depth or rng.random() < cfg.leaf_p:
            args.append(int(rng.integers(10)))
        else:
            args.append(_tree(rng, depth + 1, cfg))
    return op, args


def _tokens(tree) -> list[str]:
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    out = [f"[{op}"]
    for a in args:
        out += _tokens(a)
    return out + ["]"]


def sample(rng: np.random.Generator, cfg: ListOpsConfig, *, max_tries: int = 100_000) -> tuple[list[str], int]:
    """One (tokens, label) with min_length <= len(tokens) <= max_length."""
    for _ in range(max_tries):
        tree = _tree(rng, 1, cfg)
        toks = _tokens(tree)
        if cfg.min_length <= len(toks) <= cfg.max_length:
            return toks, evaluate(tree)
    raise ValueError(
        f"no ListOps tree of length {cfg.min_length}..{cfg.max_length} in {max_tries} tries; "
        f"raise max_depth/max_args or widen the length range"
    )


def make_split(n: int, seed: int, cfg: ListOpsConfig) -> list[tuple[list[str], int]]:
    """``n`` examples from ``np.random.default_rng(seed)``: the same seed gives the same split anywhere."""
    rng = np.random.default_rng(seed)
    return [sample(rng, cfg) for _ in range(n)]


def make_splits(variant: str = "cpu", *, seed: int = 0) -> dict[str, list[tuple[list[str], int]]]:
    """Train/dev/test from disjoint seeds (seed, seed+1, seed+2) with the variant's sizes."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    cfg = VARIANTS[variant]
    return {
        "train": make_split(cfg.num_train, seed, cfg),
        "dev": make_split(cfg.num_dev, seed + 1, cfg),
        "test": make_split(cfg.num_test, seed + 2, cfg),
    }


def encode(examples, max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids ``[B, max_len]`` (padded with 0), lengths ``[B]``, labels ``[B]`` (int32).

    Raises ValueError if an example is longer than ``max_len`` (nothing is cut silently).
    """
    ids = np.zeros((len(examples), max_len), np.int32)
    lengths = np.zeros(len(examples), np.int32)
    labels = np.zeros(len(examples), np.int32)
    for i, (toks, label) in enumerate(examples):
        if len(toks) > max_len:
            raise ValueError(f"example {i} has {len(toks)} tokens > max_len={max_len}")
        ids[i, : len(toks)] = [TOKEN_ID[t] for t in toks]
        lengths[i], labels[i] = len(toks), label
    return ids, lengths, labels
