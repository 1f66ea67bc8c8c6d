"""The first sweep: runs end to end on tiny sizes, writes a well-formed JSONL and a plot."""

from __future__ import annotations

import json

from experiments import sweep


def test_useful_flops_by_hand():
    # full: 4 * B * heads * H * N^2 ; causal counts N(N+1)/2 pairs
    assert sweep.useful_flops(1, 4, 2, 8, "full") == 4 * 2 * 8 * 16
    assert sweep.useful_flops(2, 4, 1, 8, "causal") == 4 * 2 * 8 * 10


def test_sweep_writes_results_and_plot(tmp_path, capsys):
    records = sweep.run_sweep(
        [16, 32], [1, 2], ["reference", "xla"], head_dim=8, mask="causal", repeats=2, out=str(tmp_path)
    )
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(records) == 8
    rows = [json.loads(line) for line in lines]
    assert {(r["implementation"], r["seq_len"], r["num_heads"]) for r in rows} == {
        (i, n, h) for i in ("reference", "xla") for n in (16, 32) for h in (1, 2)
    }
    for r in rows:
        assert r["min_ms"] > 0 and r["median_ms"] >= r["min_ms"] and r["compile_s"] > 0
        assert r["backend"] == "cpu" and r["mask"] == "causal"
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "[8/8]" in out and "GF/s" in out
