"""experiments/long_range.py: the recall task by hand, configs, and the `smoke` config end to end."""

import json

import numpy as np
import pytest

from experiments import long_range
from experiments.configs import long_range as lr_config


def test_config_variants():
    for v in ("default", "smoke", "lra"):
        assert lr_config.get_config(v).variant == v
    assert lr_config.get_config("lra").listops.data == "lra"
    with pytest.raises(ValueError, match="unknown long_range variant"):
        lr_config.get_config("huge")


def test_recall_data_by_hand():
    ids, labels = long_range.recall_data(np.random.default_rng(0), 50, 7, num_keys=3, num_distractors=4)
    assert ids.shape == (50, 8) and labels.shape == (50,)
    # vocabulary: 1 query, 2..4 keys, 5..8 distractors
    assert (ids[:, 0] == 2 + labels).all() and (ids[:, -1] == 1).all()
    assert ((ids[:, 1:-1] >= 5) & (ids[:, 1:-1] <= 8)).all()
    assert set(labels.tolist()) == {0, 1, 2}
    with pytest.raises(ValueError, match="distance must be >= 1"):
        long_range.recall_data(np.random.default_rng(0), 2, 0, 3, 4)


@pytest.mark.slow
def test_smoke_end_to_end(tmp_path):
    cfg = lr_config.get_config("smoke")
    text = long_range.run(cfg, tmp_path, verbose=False)
    acc = [json.loads(line) for line in (tmp_path / "listops.jsonl").read_text().splitlines()]
    assert [r["model"] for r in acc] == ["performer"]
    assert all(0.0 <= r["test_accuracy"] <= 1.0 for r in acc)
    metrics = (tmp_path / "listops" / "performer" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in metrics] == [2, 3, 4, 6, 6]  # train every 2 steps, dev at 3 and the end
    eff = [json.loads(line) for line in (tmp_path / "efficiency.jsonl").read_text().splitlines()]
    assert {(r["model"], r["seq_len"], r["status"]) for r in eff} == {("bigbird", 64, "ok"), ("gru", 64, "ok")}
    assert all(r["peak_bytes"] > 0 and r["steps_per_s"] > 0 and r["finite"] for r in eff)
    rec = [json.loads(line) for line in (tmp_path / "recall.jsonl").read_text().splitlines()]
    assert [(r["model"], r["distance"]) for r in rec] == [("full", 6)]
    for name in ("summary.md", "listops_accuracy.png", "efficiency.png", "time_vs_n.png", "recall.png"):
        assert (tmp_path / name).exists(), name
    assert "| Performer |" in text and "| BigBird |" in text and "| GRU |" in text
    # Resume: a second run finds every record done and trains nothing.
    before = (tmp_path / "efficiency.jsonl").read_text()
    long_range.run(cfg, tmp_path, verbose=False)
    assert (tmp_path / "efficiency.jsonl").read_text() == before
