"""The positional-encoding ablation: the shift task by hand, and the smoke config end to end."""

import json

import numpy as np
import pytest

from experiments import posenc
from experiments.configs import posenc as posenc_config


def test_shift_task_by_hand():
    rng = np.random.default_rng(0)
    b = posenc.shift_task(rng, 2, 6, vocab=5, shift=2, lengths=[6, 4])
    x, y = b["inputs"], b["targets"]
    assert x.shape == y.shape == (2, 6) and b["lengths"].tolist() == [6, 4]
    assert x.min() >= 0 and x.max() < 5
    for row in range(2):  # y_t = x_{t-2}; the first two positions have nothing 2 to the left: blank = V = 5
        assert y[row].tolist() == [5, 5, *x[row, :4].tolist()]
    with pytest.raises(ValueError, match="shift must be in"):
        posenc.shift_task(rng, 1, 3, vocab=5, shift=3)


def test_config_variants():
    # the config runs every sequence scheme of positional.SCHEMES (written out: the measured table's rows)
    assert posenc_config.SCHEMES == ("none", "sinusoidal", "learned", "rope", "alibi", "t5")
    assert posenc_config.get_config("default").schemes.split(",") == list(posenc_config.SCHEMES)
    assert len(posenc_config.get_config("default").seeds.split(",")) >= 3
    with pytest.raises(ValueError, match="unknown"):
        posenc_config.get_config("nope")
    with pytest.raises(ValueError, match="posenc must be one of"):
        posenc._names("rope,xpos")
    with pytest.raises(ValueError, match="is for 2-D grids"):
        posenc._names("rope,sinusoidal_2d")


def test_smoke_end_to_end(tmp_path):
    cfg = posenc_config.get_config("smoke")
    cfg.schemes = "t5"  # one scheme: one compile
    results = posenc.run(cfg, tmp_path, verbose=False)
    assert [(r["scheme"], r["seed"]) for r in results] == [("t5", 0)]
    r = results[0]
    L = cfg.task.train_length
    for n in (L, 2 * L, 4 * L):
        assert 0.0 <= r[f"acc@{n}"] <= 1.0
    assert (tmp_path / "runs" / "t5" / "seed0" / "metrics.jsonl").exists()
    # a second call finds the run in the JSONL and does not train again
    assert posenc.run(cfg, tmp_path, verbose=False) == results
    # the report's mean +- std come from the JSONL: add a second seed by hand and check the arithmetic
    fake = dict(r, seed=1, **{f"acc@{L}": r[f"acc@{L}"] + 0.5})
    with (tmp_path / "results.jsonl").open("a") as f:
        f.write(json.dumps(fake) + "\n")
    table = posenc.report(tmp_path)
    mean, std = r[f"acc@{L}"] + 0.25, 0.25  # two values a and a + 0.5
    assert f"| t5 | {100 * mean:.1f} ± {100 * std:.1f} |" in table
    assert (tmp_path / "accuracy.png").exists() and (tmp_path / "length.png").exists()
    assert (tmp_path / "summary.md").read_text().startswith(table)
