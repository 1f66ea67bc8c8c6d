"""experiments/sweep_report.py: several runs of the sweep, their ranges and the reading, on runs made by hand."""

import json

import pytest

from experiments import provenance, sweep_report

RUN = {"command": "make sweep", "wall_s": 149.2, "cpu_s": 231.8, "machine": "a CPU", "date": "2026-12-02", "load": "1"}
ENV = {"variant": "default", "jax": "0.10.2", "backend": "cpu", "host_cpus": 2, "dtype": "float32"}


def _write_run(folder, times, run=RUN):
    """times: {(mask, mode, impl): ms}; one ok record per cell at N = 2048, 8 heads."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [
        {"implementation": impl, "mask": mask, "mode": mode, "seq_len": 2048, "num_heads": 8, "status": "ok",
         "min_ms": ms, **ENV}
        for (mask, mode, impl), ms in times.items()
    ]  # fmt: skip
    records.append({**records[0], "num_heads": 1, "min_ms": 1.0})  # another head count: not in the table
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "run.json").write_text(json.dumps(run))


def _times(dense_full, dense_causal, fast_full, fast_causal):
    return {
        ("full", "fwd", "dense"): dense_full,
        ("causal", "fwd", "dense"): dense_causal,
        ("full", "fwd", "fast"): fast_full,
        ("causal", "fwd", "fast"): fast_causal,
    }


def test_runs_in_order(tmp_path):
    _write_run(tmp_path, _times(1000, 600, 100, 30))
    for k in (10, 2):
        _write_run(tmp_path / f"run{k}", _times(900, 800, 100, 30))
    (tmp_path / "run3").mkdir()  # no results.jsonl: not a run
    (tmp_path / "runs").mkdir()
    assert [p.name for p in sweep_report.run_folders(tmp_path)] == [tmp_path.name, "run2", "run10"]
    assert len(sweep_report.load_runs(tmp_path)) == 3


def test_one_run_reads_only_beyond_the_margin(tmp_path):
    _write_run(tmp_path, _times(1000, 600, 100, 30))
    table = sweep_report.pivot(tmp_path)
    rows = ["| mask | mode | dense | fast |", "|---|---|---|---|"]
    rows += ["| full | fwd | 1000 | 100 |", "| causal | fwd | 600 | 30.0 |"]
    assert table == "\n".join(rows) + "\n"
    text = sweep_report.reading(tmp_path)
    assert "Read from the one committed run (2026-12-02; N = 2048, 8 heads): in every row," in text
    assert "in every row, fast is the fastest, 10-20x ahead of the next." in text  # 1000/100, 600/30
    assert "fast's time falls with the mask: causal 0.3x (fwd) of its full-attention time." in text
    # dense: 600 / 1000 = 0.6, not beyond a factor of 2: not read as an effect
    assert "dense's time" not in text and "within 2x of their implementation's full-attention row (0.6x)" in text
    assert "One run gives no spread" in text
    line = sweep_report.run_lines(tmp_path)
    assert line.startswith("`make sweep` (default variant, 5 cells, 5 ok) took 2 min 29 s of wall time (232 s of CPU)")


def test_several_runs_show_ranges_and_keep_what_holds_in_all(tmp_path):
    _write_run(tmp_path, _times(1000, 400, 100, 30))  # dense causal 0.4x of full in this run ...
    _write_run(tmp_path / "run2", _times(838, 755, 110, 40), dict(RUN, date="2026-12-07", cells_run=2))  # ... 0.9x here
    table = sweep_report.pivot(tmp_path)
    assert "| full | fwd | 838-1000 | 100-110 |" in table and "| causal | fwd | 400-755 | 30.0-40.0 |" in table
    text = sweep_report.reading(tmp_path)
    assert "Read from the 2 committed runs (2026-12-02, 2026-12-07;" in text
    assert "in every row of every run, fast is the fastest, 7.6-19x ahead of the next." in text  # 838/110 .. 755/40
    assert "fast's time falls with the mask: causal 0.3-0.36x (fwd)" in text  # 30/100, 40/110
    assert "dense's time" not in text  # below half in one run only: not read
    assert "(0.4-0.9x over the runs): too close to read" in text
    assert "One run gives no spread" not in text
    lines = sweep_report.run_lines(tmp_path)
    assert lines.startswith("2 runs of the same cells:\n\n- run 1: `make sweep`")
    assert "- run 2: " in lines and "It ran 2 of the cells (the others were in the folder already)." in lines


def test_no_common_leader_is_said(tmp_path):
    _write_run(tmp_path, _times(1000, 600, 100, 30))
    _write_run(tmp_path / "run2", _times(90, 600, 100, 30))  # dense fastest on full in run 2
    assert "no implementation is the fastest in every row of every run." in sweep_report.reading(tmp_path)


def test_a_cell_no_run_timed_shows_its_status(tmp_path):
    _write_run(tmp_path, _times(1000, 600, 100, 30))
    path = tmp_path / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1] = {**rows[1], "status": "timeout", "min_ms": None}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "| causal | fwd | timeout | 30.0 |" in sweep_report.pivot(tmp_path)


def test_provenance_record(tmp_path, monkeypatch):
    started = provenance.start()
    monkeypatch.setattr(provenance.sys, "argv", ["sweep.py", "--out", "a b", "--machine=quiet CPU"])
    cmd = provenance.command("experiments.sweep")
    assert cmd == "python -m experiments.sweep --out 'a b' '--machine=quiet CPU'"
    rec = provenance.finish(started, command=cmd, machine="quiet CPU", cells=3)
    assert rec["command"] == cmd and rec["machine"] == "quiet CPU" and rec["cells"] == 3
    assert rec["wall_s"] >= 0 and rec["cpu_s"] >= 0 and rec["date"] == started["date"]
    assert "at the start" in rec["load"] and rec["host"].endswith("CPUs")
    assert provenance.finish(started, command=cmd)["machine"] == rec["host"]  # default: the CPU
    path = provenance.write(tmp_path / "out", rec)
    assert json.loads(path.read_text()) == rec


@pytest.mark.parametrize("name", ["pivot", "reading", "run_lines"])
def test_the_committed_run_reads(name):
    from pathlib import Path

    text = getattr(sweep_report, name)(Path(__file__).resolve().parent.parent / "docs/results/sweep")
    assert text.endswith("\n") and text.strip()
