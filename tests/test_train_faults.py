"""Faults injected into the trainer's workdir: corrupted checkpoints and torn metrics lines."""

from __future__ import annotations

import shutil
import warnings

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from attnlab import train

BATCH = {"x": jnp.arange(8.0).reshape(4, 2), "y": jnp.ones((4, 1))}


def loss_fn(m, b, key):
    del key
    return ((m(b["x"]) - b["y"]) ** 2).mean(), {}


def run(workdir, **kw):
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    kw = dict(num_steps=8, checkpoint_every=4, verbose=False) | kw
    return train.train(model, optax.adam(0.05), loss_fn, lambda s: BATCH, workdir=workdir, **kw)[1]


def curve(records):
    return [(r["step"], r["loss"]) for r in records]


def corrupt(step_dir, how):
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    assert files
    if how == "truncated":
        for p in files:
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    elif how == "zeroed":
        for p in files:
            p.write_bytes(b"\0" * p.stat().st_size)
    elif how == "missing metadata":
        for p in files:
            if "METADATA" in p.name:
                p.unlink()
    elif how == "empty step dir":
        shutil.rmtree(step_dir)
        step_dir.mkdir()


@pytest.fixture(scope="module")
def full_curve(tmp_path_factory):
    return curve(run(tmp_path_factory.mktemp("full")))


@pytest.mark.parametrize("how", ["truncated", "zeroed", "missing metadata", "empty step dir"])
def test_resume_falls_back_to_the_newest_readable_checkpoint(tmp_path, full_curve, how):
    run(tmp_path)  # checkpoints at 4 and 8
    corrupt(tmp_path / "checkpoints" / "8", how)
    with pytest.warns(RuntimeWarning, match=r"checkpoint step 8 .* cannot be restored .* Resuming from step 4"):
        resumed = run(tmp_path)  # steps 5..8 replayed from step 4: the same curve as the run never broken
    assert curve(resumed) == full_curve
    assert curve(train.read_jsonl(tmp_path / "metrics.jsonl")) == full_curve
    (aside,) = (tmp_path / "corrupt_checkpoints").iterdir()  # the broken one is kept, out of the way
    assert aside.name.startswith("8-")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "8"]  # 8 saved anew
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert curve(run(tmp_path, num_steps=10)) == curve(run(tmp_path / "straight", num_steps=10))


def test_no_readable_checkpoint_raises_and_moves_nothing(tmp_path):
    run(tmp_path)
    for step in ("4", "8"):
        corrupt(tmp_path / "checkpoints" / step, "zeroed")
    with pytest.raises(RuntimeError, match=r"no checkpoint .* can be restored:\n  step 8: .*\n  step 4: "):
        run(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "8"]
    assert not (tmp_path / "corrupt_checkpoints").exists()


def test_a_torn_last_metrics_line_does_not_stop_a_resume(tmp_path, full_curve):
    run(tmp_path, stop_after=6)  # interrupted after step 6; last checkpoint at 4
    path = tmp_path / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 10])  # the last append was cut short
    with pytest.warns(RuntimeWarning, match=r"torn last line, .*metrics.jsonl:6:"):
        resumed = run(tmp_path)
    assert curve(resumed) == full_curve


def test_a_bad_line_inside_metrics_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo\n{"step": 3, "loss": 0.25}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        train.read_jsonl(path)
