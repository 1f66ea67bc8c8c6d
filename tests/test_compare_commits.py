"""benchmarks.compare_commits: the worker times the public attention API; the cell table is complete."""

import pytest

from benchmarks import compare_commits


def test_worker_times_a_cell():
    out = compare_commits._worker(["padding 128 x8 fwd"], repeats=1)
    assert set(out) == {"padding 128 x8 fwd"}
    assert out["padding 128 x8 fwd"]["best_ms"] > 0 and out["padding 128 x8 fwd"]["compile_s"] > 0


@pytest.mark.parametrize("name", sorted(compare_commits.CELLS))
def test_cells_are_well_formed(name):
    kind, T, B, N, H, bwd = compare_commits.CELLS[name]
    assert kind in ("full", "causal", "window", "padding", "documents") and T > 0 and B > 0 and N > 0 and H > 0
    assert isinstance(bwd, bool) and (("bwd" in name) == bwd) and str(T) in name
