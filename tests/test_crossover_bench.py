"""`make crossover` (benchmarks/crossover.py): its smoke run, the pair shares it records, and its docs table."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from attnlab import masks
from attnlab.impls.blockwise import visited_share
from experiments import dispatch_tables

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_visited_share_counts_the_non_empty_64_tiles():
    # causal at T = 256 in 64 x 64 tiles: the 4 diagonal tiles and the 6 below them, of 16
    assert visited_share(masks.causal(), 256, 256) == pytest.approx(10 / 16)
    # chunks of 64: the 4 diagonal tiles; a window of ±32 at T = 128: both tiles of each row
    assert visited_share(masks.chunks(64), 256, 256) == pytest.approx(4 / 16)
    assert visited_share(masks.window(32, 32), 128, 128) == 1.0
    assert visited_share(None, 256, 256) == 1.0 and visited_share(masks.causal(), 0, 256) == 1.0


@pytest.mark.slow
def test_crossover_benchmark_runs_small(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.crossover", "--smoke", "--out", str(tmp_path), "--repeats=1", "--rounds=1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "crossover.json").read_text())
    assert result["host"]["cpu_model"] is not None and isinstance(result["host"]["cpu_simd_flags"], list)
    recs = result["records"]
    assert [(r["T"], r["mask"], r["dtype"], r["mode"]) for r in recs] == [
        (64, "causal", "float32", "fwd"),
        (64, "causal", "float32", "fwd+bwd"),
    ]
    for r in recs:
        assert r["ratio"] == pytest.approx(r["xla_ms"] / r["blockwise_ms"], rel=0.01)
        assert r["max_abs_diff"] < 1e-4, r
        # one 64 x 64 tile, not empty: visited all; causal allows T (T + 1) / 2 of the T^2 pairs
        assert r["visited"] == 1.0 and r["allowed"] == pytest.approx(64 * 65 / 2 / 64**2, abs=1e-4)
        assert r["chosen"] == "xla"
    # the docs' table reads the file: one row per (shape, mask), the ratio in its T column
    (tmp_path / "run2.json").write_text(json.dumps(result))
    md = dispatch_tables.crossover(tmp_path, ("crossover.json", "run2.json"))
    fwd_bwd = md.split("fwd, xla ms")[0]
    row = [line for line in fwd_bwd.splitlines() if line.startswith("| 2x4x32 | causal")]
    assert row == [f"| 2x4x32 | causal | {recs[1]['ratio']:.2f} xla |"], md
    assert np.isfinite(recs[0]["xla_ms"])


@pytest.mark.slow
def test_dense_fusion_benchmark_runs_small(tmp_path):
    """`make dense-fusion` (benchmarks/dense_fusion.py): the three forms agree, the ratio is fused over mapped,
    the rule's choice is recorded, and the docs' table reads the file."""
    from attnlab.impls import xla

    cmd = [sys.executable, "-m", "benchmarks.dense_fusion", "--smoke", "--out", str(tmp_path), "--repeats=1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "dense_fusion.json").read_text())
    assert result["fused_max_rows"] == xla.FUSED_MAX_ROWS and result["host"]["cpu_model"] is not None
    recs = result["records"]
    assert [(r["B"], r["N"], r["T"], r["S"], r["H"], r["direction"]) for r in recs] == [
        (b, 2, 16, 16, 8, d) for b in (1, 2) for d in ("fwd", "fwd+bwd")
    ]
    for r in recs:
        assert r["ratio"] == pytest.approx(r["fused_ms"] / r["mapped_ms"], rel=0.01)
        assert r["mapped_over_jax_nn"] == pytest.approx(r["mapped_ms"] / r["jax.nn_ms"], rel=0.01)
        assert r["max_abs_diff"] < 1e-5 and r["rows"] == r["B"] * 2 * 16
        assert r["key_major_ratio"] == pytest.approx(r["key_major_ms"] / min(r["fused_ms"], r["mapped_ms"]), rel=0.01)
        assert r["rule_form"] == ("fused" if r["B"] >= 2 else "mapped")  # one batch row: mapped
    (tmp_path / "run2.json").write_text(json.dumps(result))
    md = dispatch_tables.dense_fusion(tmp_path, ("dense_fusion.json", "run2.json"))
    row = [line for line in md.splitlines() if line.startswith("| 2 x 2 x 16 |")]
    assert row == [f"| 2 x 2 x 16 | 64 | {recs[2]['ratio']:.2f} | {recs[3]['ratio']:.2f} | fused |"], md


@pytest.mark.slow
def test_edges_crossover_benchmark_runs_small(tmp_path):
    """`make edges-crossover` --smoke: both kernels on a random and a block-diagonal graph at the head shape the
    command names, and its docs table (a column per score, and per head shape where the runs have several)."""
    from attnlab.impls.sparse import min_pairs_per_edge
    from benchmarks import edges_crossover

    cmd = [
        sys.executable,
        "-m",
        "benchmarks.edges_crossover",
        "--smoke",
        "--out",
        str(tmp_path),
        "--repeats=1",
        "--rounds=1",
        "--heads=3",
        "--head_dim=8",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "edges_crossover.json").read_text())
    recs = result["records"]
    assert {(r["heads"], r["H"]) for r in recs} == {(3, 8)}
    assert [(r["graph"], r["score"]) for r in recs] == [
        (g, s) for g in ("random 256 x4", "molecules 8 x 30 x3") for s in ("dot", "softcap")
    ]
    for r in recs:
        assert r["ratio"] == pytest.approx(r["blockwise_ms"] / r["sparse_ms"], rel=0.01)
        assert r["max_abs_diff"] < 1e-4, r
    # a random graph visits every pair: T^2 over 4 T random edges and T self loops
    assert recs[0]["edges"] == 5 * 256 and recs[0]["pairs_per_edge"] == pytest.approx(256 / 5, abs=0.1)
    s, r = edges_crossover.GRAPHS["molecules 64 x 30 x3"]()
    assert (s // 30 == r // 30).all() and len(s) == 64 * 30 * 4  # edges stay inside their component
    table = dispatch_tables.edges_crossover(tmp_path, ("edges_crossover.json",))
    assert "| random 256 x4 | 1,280 | 51.2 |" in table and table.count("|\n") == 4
    assert "| dot: blockwise / sparse | softcap: blockwise / sparse |" in table
    # a second run at another head shape, with only the random graph's dot cell: its own column, "-" elsewhere
    other = dict(result, records=[dict(recs[0], heads=4, H=16, ratio=0.5)])
    (tmp_path / "other.json").write_text(json.dumps(other))
    table = dispatch_tables.edges_crossover(tmp_path, ("edges_crossover.json", "other.json"))
    head = "| dot, 3 x 8: blockwise / sparse | softcap, 3 x 8: blockwise / sparse | dot, 4 x 16: blockwise / sparse |"
    assert head in table
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:-1]]
    rows = {c[0]: c[1:] for c in cells}
    runs = {r["graph"]: "sparse" if r["pairs_per_edge"] >= min_pairs_per_edge(8) else "blockwise" for r in recs}
    dot = {r["graph"]: f"{r['ratio']:.2f}" for r in recs if r["score"] == "dot"}
    # cells: edges, pairs per edge, dot / softcap at 3 x 8, dot at 4 x 16, what dispatch runs at 3 x 8 and 4 x 16
    assert rows["random 256 x4"][2] == dot["random 256 x4"] and rows["random 256 x4"][4:] == [
        "0.50",
        "sparse",
        "sparse",
    ]
    assert rows["molecules 8 x 30 x3"][4:] == ["-", runs["molecules 8 x 30 x3"], runs["molecules 8 x 30 x3"]]
