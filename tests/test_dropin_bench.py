"""`make adopt-bench` (benchmarks/adopt.py) at its smoke size: every row timed on both sides, outputs equal."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_adopt_benchmark_runs_small(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.adopt", "--smoke", "--out", str(tmp_path), "--repeats=1", "--rounds=1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "adopt.json").read_text())
    host = result["host"]
    assert host["cpu_model"] is not None and isinstance(host["cpu_simd_flags"], list)
    assert result["jax"] and result["flax"]
    rows = [(r["suite"], r["case"], r["mode"]) for r in result["records"]]
    cases = ["tiny/causal", "small/custom", "small/bias", "long/window ±16"]
    assert rows[:8] == [("jax_nn", c, m) for c in cases for m in ("fwd", "fwd+bwd")]
    assert [r[1].split(",")[0] for r in rows[8:]] == [
        "nnx.MultiHeadAttention", "nnx.MultiHeadAttention", "linen.MultiHeadDotProductAttention"
    ]  # fmt: skip
    for r in result["records"]:
        ours, theirs = r["attnlab_ms"], r["jax_nn_ms"] if r["suite"] == "jax_nn" else r["stock_ms"]
        assert (
            ours > 0 and theirs > 0 and r["ratio"] == pytest.approx(theirs / ours, rel=0.05)
        )  # ms rounded to 3 decimals
        if r["suite"] == "jax_nn":
            assert r["max_abs_diff"] < 1e-4, r
        else:
            assert r["max_grad_diff"] < 1e-5 and r["loss_diff"] < 1e-6, r
    by_case = {(r["case"], r["mode"]): r for r in result["records"] if r["suite"] == "jax_nn"}
    assert by_case["tiny/causal", "fwd"]["implementation"] == "xla"  # a small dense call: jax.nn's program written out
    assert by_case["long/window ±16", "fwd"]["implementation"] == "blockwise"
    # the implementation as the timed (jitted) call chooses it: a traced mask array shows no empty tile
    assert by_case["small/custom", "fwd"]["implementation"] == "xla"
    # jax.nn against itself on the small rows (the run's noise), not on the long one
    assert (
        by_case["tiny/causal", "fwd"]["control_ratio"] > 0
        and by_case["long/window ±16", "fwd"]["control_ratio"] is None
    )
    noise = [abs(1 - r["control_ratio"]) for r in by_case.values() if r["control_ratio"] is not None]
    assert result["summary"]["noise"] == pytest.approx(max(noise), abs=1e-3)
    assert set(result["summary"]["window_ratios"]) == {"fwd", "fwd+bwd"}
