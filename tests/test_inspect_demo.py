"""experiments/inspect_demo.py: the committed checkpoint loads, and its committed analysis is reproduced."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from experiments import inspect_demo

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "docs/results/inspect"


def test_committed_checkpoint_reproduces_its_analysis(tmp_path, capsys):
    # the program itself (python -m experiments.inspect_demo --out DIR) on a copy of the committed checkpoint:
    # it reuses the checkpoint, writes heads.json, weights.npz, the figures and run.json
    for name in ("shift_rope.npz", "shift_rope.json"):
        shutil.copy(FOLDER / name, tmp_path)
    _, meta = inspect_demo.load_checkpoint(FOLDER)
    committed = json.loads((FOLDER / "heads.json").read_text())
    inspect_demo.main(["--out", str(tmp_path), "--machine", "a test"])
    assert "Accuracy 100.0%" in capsys.readouterr().out
    record, weights = json.loads((tmp_path / "heads.json").read_text()), np.load(tmp_path / "weights.npz")["weights"]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["command"] == f"python -m experiments.inspect_demo --out {tmp_path} --machine 'a test'"
    assert run["machine"] == "a test" and run["analysis_s"] == record["analysis_s"] and run["wall_s"] > 0
    assert run["checkpoint"] == {"command": meta["command"], "train_time_s": meta["train_time_s"]}
    assert record["accuracy"] == committed["accuracy"] == round(meta["accuracy"]["acc@32"], 4)
    # the tests run XLA at optimisation level 0 (conftest.py): the last float digits may differ
    for got, want in zip(record["heads"], committed["heads"], strict=True):
        assert got.keys() == want.keys() and got["name"] == want["name"]
        for k in ("entropy", "distance", "first", "zero_ablated_accuracy", "mean_ablated_accuracy"):
            assert abs(got[k] - want[k]) <= 1e-4, (k, got, want)
        np.testing.assert_allclose(list(got["offset_mass"].values()), list(want["offset_mass"].values()), atol=1e-4)
    np.testing.assert_allclose(weights, np.load(FOLDER / "weights.npz")["weights"], atol=1e-5)
    for got, want in zip(record["patching"], committed["patching"], strict=True):
        assert got["heads"] == want["heads"]
        assert abs(got["source_answers"] - want["source_answers"]) <= 1e-4
        assert abs(got["target_answers"] - want["target_answers"]) <= 1e-4
    both = next(p for p in record["patching"] if p["heads"] == [[1, 0], [1, 1]])
    assert both["source_answers"] > 0.9  # the two offset -3 heads carry the answer


def test_load_checkpoint_refuses_other_parameters(tmp_path):
    shutil.copy(FOLDER / "shift_rope.json", tmp_path)
    saved = dict(np.load(FOLDER / "shift_rope.npz"))
    saved.pop(next(iter(saved)))
    np.savez(tmp_path / "shift_rope.npz", **saved)
    with pytest.raises(ValueError, match="parameters"):
        inspect_demo.load_checkpoint(tmp_path)


def test_report_draws_the_figures_from_the_files(tmp_path):
    for name in ("heads.json", "weights.npz"):
        shutil.copy(FOLDER / name, tmp_path)
    text = inspect_demo.report(tmp_path)
    assert "Accuracy 100.0%" in text and text.count("\n| 1 |") == 4
    assert (tmp_path / "attention_grid.png").stat().st_size > 0 and (tmp_path / "head_importance.png").exists()
