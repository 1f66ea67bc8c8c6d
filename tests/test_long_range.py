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


def _records():
    acc = [
        dict(model=m, test_accuracy=a, dev_accuracy=a, steps=10, train_time_s=1.0, params=100, data="cpu",
             max_len=128, majority_class=0.1)
        for m, a in (("full", 0.30), ("linear", 0.15), ("gru", 0.20))
    ]  # fmt: skip
    eff = [
        dict(model=m, seq_len=n, steps_per_s=sps / n, step_s=n / sps, peak_bytes=mib * n * 2**20, batch_size=2,
             status="ok")
        for m, sps, mib in (("full", 1e3, 0.2), ("full_dense", 5e2, 1.0), ("linear", 4e3, 0.05), ("bigbird", 2e3, 0.1))
        for n in (1024, 2048)
    ]  # fmt: skip
    eff.append(dict(model="full_dense", seq_len=4096, steps_per_s=0.01, step_s=100.0, peak_bytes=1, batch_size=2,
                    status="ok"))  # fmt: skip
    return acc, eff


def test_outlook_points_by_hand():
    acc, eff = _records()
    points = long_range.outlook_points(acc, eff)
    # bigbird has no accuracy, gru no step: both left out; full_dense takes full's accuracy;
    # N = 2048 is the longest length every plotted model has (only full_dense reached 4096).
    assert [p["model"] for p in points] == ["full", "full_dense", "linear"]
    assert {p["seq_len"] for p in points} == {2048}
    assert [p["accuracy"] for p in points] == [0.30, 0.30, 0.15]
    np.testing.assert_allclose([p["steps_per_s"] for p in points], [1e3 / 2048, 5e2 / 2048, 4e3 / 2048])
    np.testing.assert_allclose([p["mib"] for p in points], [0.2 * 2048, 1.0 * 2048, 0.05 * 2048])
    assert long_range.outlook_points([], eff) == [] and long_range.outlook_points(acc, []) == []


def test_report_draws_the_outlook(tmp_path):
    acc, eff = _records()
    for name, records in (("listops.jsonl", acc), ("efficiency.jsonl", eff)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    text = long_range.report(tmp_path)
    assert (tmp_path / "outlook.png").stat().st_size > 0
    outlook = text[text.index("Efficiency outlook") :]
    assert "at N = 2K" in outlook
    assert "| full attention | 30.0 ± 0.0 | 0.49 | 409.6 |" in outlook  # 1000 / 2048 steps/s, 0.2 * 2048 MiB
    assert "| linear (elu+1) | 15.0 ± 0.0 | 1.95 | 102.4 |" in outlook


def test_seeds_give_mean_and_sample_sd(tmp_path):
    """Three seeds of one model: the tables show mean ± sample sd (numpy, ddof=1) and each seed's time."""
    acc, eff = _records()
    extra = [dict(acc[0], seed=s, test_accuracy=a, dev_accuracy=a, train_time_s=t)
             for s, a, t in ((1, 0.34, 2.0), (2, 0.26, 3.0))]  # fmt: skip
    acc = [dict(acc[0], seed=0), *extra, *acc[1:]]
    (tmp_path / "listops.jsonl").write_text("".join(json.dumps(r) + "\n" for r in acc))
    (tmp_path / "efficiency.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eff))
    vals = np.array([30.0, 34.0, 26.0])
    want = f"{vals.mean():.1f} ± {vals.std(ddof=1):.1f}"  # 30.0 ± 4.0
    text = long_range.tables(tmp_path)
    assert f"| full attention | {want} | {want} | 3 | 10 | 1/2/3 | 100 |" in text
    assert "| GRU | 20.0 ± 0.0 | 20.0 ± 0.0 | 1 | 10 | 1 | 100 |" in text
    points = long_range.outlook_points(acc, eff)
    full = next(p for p in points if p["model"] == "full")
    np.testing.assert_allclose([full["accuracy"], full["accuracy_sd"]], [0.30, vals.std(ddof=1) / 100])
    assert f"| full attention | {want} | 0.49 | 409.6 |" in text
