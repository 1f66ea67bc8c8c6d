"""ListOps generator: labels agree with an independent evaluator; lengths, seeds, encoding."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from attnlab.data import listops


def independent_value(tokens: list[str]) -> int:
    """Evaluates the token string by rewriting it as a Python expression (not the generator's recursion)."""
    fns = {
        "MAX": lambda *a: max(a),
        "MIN": lambda *a: min(a),
        "MED": lambda *a: int(statistics.median(a)),
        "SM": lambda *a: sum(a) % 10,
    }
    expr = []
    for tok in tokens:
        if tok.startswith("["):
            expr.append(f"{tok[1:]}(")
        elif tok == "]":
            expr.append("),")
        else:
            expr.append(f"{int(tok)},")
    return eval("".join(expr).rstrip(","), {"__builtins__": {}}, fns)  # noqa: S307 - our own tokens only


def test_hand_checked_expressions():
    assert independent_value(["[MAX", "2", "9", "[MIN", "4", "7", "]", "0", "]"]) == 9
    assert listops.evaluate(("MAX", [2, 9, ("MIN", [4, 7]), 0])) == 9
    assert listops.evaluate(("MED", [1, 2, 3, 8])) == 2  # median 2.5 -> int 2
    assert listops.evaluate(("SM", [9, 8, ("MAX", [7, 1])])) == 4  # 24 mod 10


@pytest.mark.parametrize("variant", ["smoke", "cpu"])
def test_labels_match_independent_evaluator(variant):
    cfg = listops.VARIANTS[variant]
    examples = listops.make_split(200, seed=11, cfg=cfg)
    for toks, label in examples:
        assert cfg.min_length <= len(toks) <= cfg.max_length
        assert independent_value(toks) == label
    labels = [label for _, label in examples]
    assert len(set(labels)) >= 6  # not a degenerate task


def test_lra_variant_lengths():
    cfg = listops.VARIANTS["lra"]
    examples = listops.make_split(3, seed=0, cfg=cfg)
    for toks, label in examples:
        assert 500 <= len(toks) <= 2000 and independent_value(toks) == label


def test_splits_are_seeded_and_disjoint_seeds():
    a = listops.make_splits("smoke", seed=3)
    b = listops.make_splits("smoke", seed=3)
    assert a == b
    assert {k: len(v) for k, v in a.items()} == {"train": 64, "dev": 16, "test": 16}
    assert a["train"][:16] != a["dev"]


def test_encode():
    ids, lengths, labels = listops.encode([(["[MAX", "2", "9", "]"], 9), (["7"], 7)], max_len=6)
    assert ids.tolist() == [[1, 8, 15, 5, 0, 0], [13, 0, 0, 0, 0, 0]]  # pad 0, ops 1-4, "]" 5, digit d is 6 + d
    assert lengths.tolist() == [4, 1] and labels.tolist() == [9, 7]
    assert [listops.VOCAB[i] for i in ids[0, :4]] == ["[MAX", "2", "9", "]"]
    with pytest.raises(ValueError, match="max_len=2"):
        listops.encode([(["[MAX", "2", "9", "]"], 9)], max_len=2)
    with pytest.raises(ValueError, match="variant must be one of"):
        listops.make_splits("huge")
    assert np.unique(ids).max() < len(listops.VOCAB)
