"""experiments/common.py: resume by key, torn JSONL lines, summaries, the config loader, no recompiles."""

import json
import os
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attnlab import train
from experiments import common


def test_run_grid_resumes_by_key(tmp_path):
    path = tmp_path / "grid.jsonl"
    calls = []

    def run_cell(cell):
        calls.append(cell)
        return {"value": 10 * cell["model"] + cell["seed"]}

    cells = [{"model": m, "seed": s} for m in (1, 2) for s in (0, 1)]
    first = common.run_grid(path, cells, run_cell, verbose=False)
    assert [r["value"] for r in first] == [10, 11, 20, 21] and len(calls) == 4
    assert common.run_grid(path, cells, run_cell, verbose=False) == first and len(calls) == 4  # nothing rerun
    more = cells + [{"model": 3, "seed": 0}]
    assert [r["value"] for r in common.run_grid(path, more[::-1], run_cell, verbose=False)] == [30, 21, 20, 11, 10]
    assert calls[4:] == [{"model": 3, "seed": 0}]  # only the new cell ran
    assert common.pending(path, more + [{"model": 1, "seed": 2}]) == [{"model": 1, "seed": 2}]


def test_torn_line_is_skipped_and_its_cell_runs_again(tmp_path):
    path = tmp_path / "grid.jsonl"
    common.run_grid(path, [{"k": "a"}], lambda c: {"v": 1}, verbose=False)
    with path.open("a") as f:  # a crash in the middle of writing cell b's record
        f.write('{"k": "b", "v": 2, "ext')
    with pytest.warns(RuntimeWarning, match=r"torn last line, .*grid.jsonl:2:"):
        assert common.read_jsonl(path) == [{"k": "a", "v": 1}]
    with pytest.warns(RuntimeWarning, match=r"torn last line, .*grid.jsonl:2:"):
        assert train.read_jsonl(path) == [{"k": "a", "v": 1}]  # the trainer's reader drops a torn last line too
    with pytest.warns(RuntimeWarning):
        out = common.run_grid(path, [{"k": "a"}, {"k": "b"}], lambda c: {"v": 3}, verbose=False)
    assert out == [{"k": "a", "v": 1}, {"k": "b", "v": 3}]
    lines = path.read_text().splitlines()  # the new record is on a line of its own
    assert lines == ['{"k": "a", "v": 1}', '{"k": "b", "v": 2, "ext', '{"k": "b", "v": 3}']
    with pytest.raises(ValueError, match=r"grid.jsonl:2: not valid JSON"):
        train.read_jsonl(path)  # now mid-file: the strict reader names it; the grid's reader skips it
    with pytest.warns(RuntimeWarning, match=r"a bad line, .*grid.jsonl:2:"):
        assert len(common.read_jsonl(path)) == 2


def test_summaries_against_numpy():
    rng = np.random.default_rng(0)
    vals = {("vit", 200): rng.random(3), ("cnn", 200): rng.random(2), ("vit", 1000): rng.random(1)}
    records = [
        {"model": m, "size": n, "seed": s, "acc": float(v)} for (m, n), vs in vals.items() for s, v in enumerate(vs)
    ]
    records.append(dict(records[0]))  # the same (group, seed) recorded twice counts once
    records.append({"model": "vit", "size": 200, "seed": 9})  # no value: left out
    for ddof in (0, 1):
        got = common.summarize(records, ("model", "size"), "acc", ddof=ddof)
        assert list(got) == list(vals)  # groups in the order first seen
        for key, v in vals.items():
            std = np.std(v, ddof=ddof) if len(v) > ddof else 0.0
            np.testing.assert_allclose(got[key][:2], (np.mean(v), std), rtol=1e-12)
            assert got[key][2] == len(v)
    assert common.mean_std((0.97123, 0.00444, 3), scale=100) == "97.1 ± 0.4"
    assert common.mean_std((0.5, 0.25, 2), digits=3, sep=" +- ") == "0.500 +- 0.250"
    table = common.markdown_table(["model", "acc"], [["vit", 1.5], ["cnn", "-"]])
    assert table == "| model | acc |\n|---|---|\n| vit | 1.5 |\n| cnn | - |"


def test_config_loader_errors_name_the_argument(tmp_path):
    cfg = common.load_config("experiments/configs/posenc.py:smoke")
    assert cfg.variant == "smoke" and cfg.train.num_steps == 20
    assert common.load_config("experiments/configs/posenc.py").variant == "default"
    with pytest.raises(ValueError, match="config file .*nope.py.* does not exist"):
        common.load_config("experiments/configs/nope.py:smoke")
    with pytest.raises(ValueError, match="config must name a .py file"):
        common.load_config("experiments/configs/posenc:smoke")
    with pytest.raises(ValueError, match="config must be"):
        common.load_config("")
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match="has no get_config"):
        common.load_config(f"{tmp_path / 'empty.py'}:a")
    with pytest.raises(ValueError, match="unknown posenc variant 'huge'"):
        common.load_config("experiments/configs/posenc.py:huge")


def test_predict_in_batches_matches_one_call():
    x = np.arange(23 * 3, dtype=np.float32).reshape(23, 3)
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    shapes = []

    def apply(a, b):
        shapes.append(a.shape)
        assert b is None
        return a @ w

    for pad in (True, False):
        shapes.clear()
        np.testing.assert_allclose(common.predict(apply, [x, None], 5, pad=pad), x @ w)
        assert shapes == ([(5, 3)] * 5 if pad else [(5, 3)] * 4 + [(3, 3)])  # pad: one shape


def test_classification_loss_by_hand():
    logits = jnp.array([[2.0, 0.0], [0.0, 1.0]], jnp.bfloat16)
    loss, aux = common.classification_loss(logits, jnp.array([0, 0]))
    want = (np.log1p(np.exp(-2.0)) + np.log1p(np.exp(1.0))) / 2  # -log softmax of the label, averaged
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    assert loss.dtype == jnp.float32 and float(aux["accuracy"]) == 0.5


def test_compiled_memory_by_hand():
    x = jnp.ones(1000, jnp.float32)  # 4,000 bytes in and 4,000 out
    plain = common.compiled_memory(jax.jit(lambda a: a * 2).lower(x).compile())
    assert plain["peak_bytes"] == 8000 + plain["temp_bytes"]
    donated = common.compiled_memory(jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile())
    assert donated["peak_bytes"] == 4000 + donated["temp_bytes"]  # the output reuses the donated input


def _model_and_batch():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 2))}
    return model, batch


def _make_loss(scale):
    @chex.assert_max_traces(n=1)  # the counter is shared by every loss made here (same footprint)
    def loss_fn(m, b, key):
        return ((m(b["x"]) - b["y"]) ** 2).mean() * scale, {}

    return loss_fn


def test_equal_new_tx_and_loss_do_not_recompile():
    chex.clear_trace_counter()
    losses = []
    for _ in range(3):  # a fresh model, optimizer and loss closure each time: equal, not identical
        model, batch = _model_and_batch()
        tx = train.adamw_cosine(1e-2, 2, 5, 1e-4)
        _, log = train.train(model, tx, _make_loss(2.0), lambda s, b=batch: b, num_steps=5, verbose=False)
        losses.append([r["loss"] for r in log])
    assert losses[0] == losses[1] == losses[2]
    # A different value in the closure (scale) or in the optimizer is a different step: it traces again.
    model, batch = _model_and_batch()
    with pytest.raises(AssertionError, match="traced > 1 times"):
        train.train(model, optax.adam(1e-2), _make_loss(3.0), lambda s: batch, num_steps=1, verbose=False)
    a, b = train.ByValue(train.adamw_cosine(1e-2, 2, 5, 1e-4)), train.ByValue(train.adamw_cosine(1e-2, 2, 5, 1e-4))
    assert a == b and hash(a) == hash(b)
    assert a != train.ByValue(train.adamw_cosine(2e-2, 2, 5, 1e-4))
    arr = np.ones(3)  # unhashable closure values compare by identity: never a false match
    assert train.ByValue(lambda: arr) != train.ByValue(lambda: np.ones(3))


def test_measure_train_step_uses_the_trainers_step():
    model, batch = _model_and_batch()
    tx = optax.adamw(1e-4)
    res = common.measure_train_step(model, tx, _plain_loss, batch, repeats=2)
    assert res["timed_steps"] == 2 and res["finite"] and res["steps_per_s"] == pytest.approx(1 / res["step_s"])
    # arguments: params 8 floats (32 B), AdamW count + 2 moments (68 B), batch 80 B. Not donated, the
    # new params + state (100 B) would come on top: >= 280 B. Donated, they reuse the arguments' buffers.
    assert res["peak_bytes"] - res["temp_bytes"] < 32 + 68 + 80 + 100
    # the model keeps its own parameters (the step donates copies)
    np.testing.assert_allclose(model(batch["x"]), nnx.Linear(3, 2, rngs=nnx.Rngs(0))(batch["x"]))


def _plain_loss(m, b, key):
    return ((m(b["x"]) - b["y"]) ** 2).mean(), {}


def test_launch_report_only_from_the_command_line(tmp_path):
    records = [
        {"scheme": "rope", "seed": s, "acc@8": a, "acc@16": a / 2, "acc_beyond_L@16": a / 4, "train_time_s": 1.0}
        for s, a in ((0, 0.5), (1, 0.75))
    ]
    for r in records:
        common.append_jsonl(tmp_path / "results.jsonl", r)
    root = Path(__file__).resolve().parents[1]
    kw = dict(capture_output=True, text=True, timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    cmd = [sys.executable, "-m", "experiments.posenc", "--report", str(tmp_path)]
    done = subprocess.run(cmd, check=True, **kw)
    # mean and population std of 0.5 and 0.75, by hand: 0.625 ± 0.125
    assert "| rope | 62.5 ± 12.5 | 31.2 ± 6.2 | 15.6 ± 3.1 | 2 | 1 |" in done.stdout
    assert (tmp_path / "summary.md").exists() and (tmp_path / "length.png").exists()
    bad = subprocess.run([*cmd, "stray"], **kw)
    assert bad.returncode != 0 and "unexpected arguments ['stray']" in bad.stderr


def test_head_mean_train_time_and_save_config_by_hand(tmp_path):
    w = np.arange(2 * 2 * 2 * 3, dtype=np.float32).reshape(2, 2, 2, 3)  # [B=2, N=2, T=2, S=3]
    got = common.head_mean([w, 2 * w], row=1)
    np.testing.assert_allclose(got[0], (w[1, 0] + w[1, 1]) / 2)  # the mean of the two heads of example 1
    np.testing.assert_allclose(got[1], w[1, 0] + w[1, 1])
    records = [{"split": "train", "time_s": 1.5}, {"split": "dev", "time_s": 9.0}, {"split": "train", "time_s": 3.0}]
    assert common.train_time(records) == 3.0 and common.train_time([], default=7.0) == 7.0
    common.save_config(common.load_config("experiments/configs/posenc.py:smoke"), tmp_path / "a" / "config.json")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["train"]["num_steps"] == 20
