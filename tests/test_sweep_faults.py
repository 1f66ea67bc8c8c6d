"""Faults injected into the sweep harness: torn results lines, two writers, hanging and dying cells."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from experiments import plot, sweep
from experiments.configs import sweep as sweep_configs

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIME_CELL = sweep.time_cell
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def tiny_config(**overrides):
    c = sweep_configs.get_config("smoke")
    c.seq_lens = [8, 16]
    c.num_heads = [1]
    c.masks = ["full"]
    c.implementations = ["reference"]
    c.repeats = 1
    c.update(overrides)
    return c


def counting(monkeypatch):
    ran = []
    real = sweep.time_cell
    monkeypatch.setattr(sweep, "time_cell", lambda cell, **kw: ran.append(cell) or real(cell, **kw))
    return ran


def test_torn_and_garbage_lines_are_named_then_set_aside(tmp_path, monkeypatch, capsys):
    config = tiny_config()
    sweep.run_sweep(config, str(tmp_path), plot=False)
    path = tmp_path / "results.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    # line 2 is torn mid-record (as by a crash of something writing it), then garbage is appended
    path.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2] + "\n" + "\x00\x00garbage\n")

    ran = counting(monkeypatch)
    with pytest.raises(plot.BadResultsLineError) as err:
        sweep.run_sweep(config, str(tmp_path), plot=False)
    msg = str(err.value)
    assert f"{path}:2:" in msg and f"{path}:3:" in msg and f"{path}:1:" not in msg
    assert "--skip_bad_lines" in msg and "--force" in msg
    assert ran == [] and path.read_text().count("\n") == 3  # nothing ran, nothing rewritten

    # the way out: the bad lines go aside (kept, with their line numbers), the torn cell runs again
    records = sweep.run_sweep(config, str(tmp_path), plot=False, skip_bad_lines=True)
    assert [c.seq_len for c in ran] == [16]
    assert [r["status"] for r in records] == ["ok", "ok"]
    aside = [json.loads(x) for x in (tmp_path / "results.jsonl.bad").read_text().splitlines()]
    assert [a["line"] for a in aside] == [2, 3] and aside[0]["text"] == lines[1][: len(lines[1]) // 2]
    assert "set aside 2 bad line(s)" in capsys.readouterr().err
    assert len(plot.load_results(str(path))) == 2  # the file is clean again

    # --force also gets past a bad line (and redoes every cell)
    with open(path, "a") as f:
        f.write('{"implementation": "reference", "mask"\n')
    ran.clear()
    sweep.run_sweep(config, str(tmp_path), plot=False, force=True)
    assert len(ran) == 2
    assert len((tmp_path / "results.jsonl.bad").read_text().splitlines()) == 3


def test_plot_skips_a_bad_line_with_a_warning(tmp_path, capsys):
    with open(os.path.join(os.path.dirname(__file__), "data", "sweep_fixture.jsonl")) as f:
        src = f.read()
    path = tmp_path / "results.jsonl"
    path.write_text(src + '{"torn": ')
    n = len(plot.load_results(str(path), skip_bad=True))
    assert n == src.count("\n")
    assert f"{path}:{n + 1}:" in capsys.readouterr().err
    with pytest.raises(plot.BadResultsLineError, match="results.jsonl:"):
        plot.load_results(str(path))
    path.write_text(src + "[1, 2]\n")  # valid JSON but not a record
    with pytest.raises(plot.BadResultsLineError, match="expected an object"):
        plot.load_results(str(path))


def test_a_second_sweep_into_the_same_out_is_refused_by_name(tmp_path, monkeypatch):
    first, second = tiny_config(), tiny_config(seq_lens=[24])
    real = sweep.time_cell
    refused = []

    def meanwhile(cell, **kw):  # while the first sweep runs, a second one starts on the same --out
        if not refused:
            with pytest.raises(sweep.OutLockedError) as err:
                sweep.run_sweep(second, str(tmp_path), plot=False)
            refused.append(str(err.value))
        return real(cell, **kw)

    monkeypatch.setattr(sweep, "time_cell", meanwhile)
    sweep.run_sweep(first, str(tmp_path), plot=False)
    assert f"pid {os.getpid()}" in refused[0] and str(tmp_path) in refused[0] and "another --out" in refused[0]
    monkeypatch.setattr(sweep, "time_cell", real)
    sweep.run_sweep(second, str(tmp_path), plot=False)  # afterwards: its cells are added to the first's
    rows = plot.load_results(str(tmp_path / "results.jsonl"))
    assert sorted(r["seq_len"] for r in rows) == [8, 16, 24] and all(r["status"] == "ok" for r in rows)


def test_the_lock_of_a_killed_sweep_is_not_stale(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=ENV
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(sweep.OutLockedError, match=f"pid {holder.pid} "):
            sweep.run_sweep(tiny_config(seq_lens=[8]), str(tmp_path), plot=False)
        assert not (tmp_path / "results.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # dies without unlocking: the kernel drops the lock
        holder.wait()
    records = sweep.run_sweep(tiny_config(seq_lens=[8]), str(tmp_path), plot=False)
    assert [r["status"] for r in records] == ["ok"]


HOLD_LOCK = """
import sys, time
from experiments import sweep
with sweep.lock_out(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def hang_or_die(cell, **kw):
    """A cell runner for the subprocess (module level: it is spawned): N=16 hangs, N=24 dies."""
    if cell.seq_len == 16:
        time.sleep(3600)  # a call that never returns (the soft timeout cannot stop it)
    if cell.seq_len == 24:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
    return dict(sweep.time_cell(cell, **kw), runner_pid=os.getpid(), isolated=kw["isolated"])


def test_hard_timeout_kills_a_hung_cell_and_the_sweep_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "time_cell", hang_or_die)
    config = tiny_config(seq_lens=[8, 12, 16, 24, 32])
    with config.unlocked():
        config.cell_hard_timeout_s = 6.0
    t0 = time.perf_counter()
    records = sweep.run_sweep(config, str(tmp_path), plot=False)
    took = time.perf_counter() - t0
    by_n = {r["seq_len"]: r for r in records}
    for n in (8, 12, 32):
        assert by_n[n]["status"] == "ok" and by_n[n]["min_ms"] > 0 and by_n[n]["cell_process"] == "subprocess"
        assert by_n[n]["runner_pid"] != os.getpid() and not by_n[n]["isolated"]
    assert by_n[8]["runner_pid"] == by_n[12]["runner_pid"] != by_n[32]["runner_pid"]  # reused until a kill
    assert by_n[16]["status"] == "timeout" and "hard timeout" in by_n[16]["error"]
    assert "min_ms" not in by_n[16]
    assert by_n[24]["status"] == "error" and "SIGKILL" in by_n[24]["error"]
    assert took < 200, took  # the hung cell cost its 6 s, not an hour
    # on resume the timed-out cell is done (as a soft timeout is); the crashed one runs again
    monkeypatch.setattr(sweep, "time_cell", TIME_CELL)
    ran = counting(monkeypatch)
    with config.unlocked():
        config.cell_hard_timeout_s = 0.0
    sweep.run_sweep(config, str(tmp_path), plot=False)
    assert [c.seq_len for c in ran] == [24]


def test_hard_timeout_flags_run_cells_in_fresh_subprocesses(tmp_path):
    cmd = [sys.executable, "-m", "experiments.sweep", "--config=experiments/configs/sweep.py:smoke"]
    cmd += ["--seq_lens=8", "--num_heads=1", "--masks=full", "--implementations=reference", "--repeats=1"]
    cmd += ["--cell_hard_timeout_s=120", "--fresh_process_per_cell", "--noplot", f"--out={tmp_path}"]
    cmd += ["--mesh=heads=1"]  # and the mesh advice for this backend is printed first
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = plot.load_results(str(tmp_path / "results.jsonl"))
    assert row["status"] == "ok" and row["cell_process"] == "fresh subprocess" and row["mesh"] == "heads=1"
    assert "mesh heads=1 on CPU: 1 host devices" in proc.stdout
    assert json.loads((tmp_path / "config.json").read_text())["cell_hard_timeout_s"] == 120


def test_a_worker_killed_between_cells_is_replaced():
    worker = sweep.CellWorker(hang_or_die)
    cell = sweep.Cell("reference", "full", 8, 1, 8, 1, "fwd", "float32")
    try:
        first = worker.run(cell, hard_timeout_s=120, repeats=1)
        os.kill(worker.proc.pid, signal.SIGKILL)  # e.g. the out-of-memory killer, while it waits
        worker.proc.join()
        second = worker.run(cell, hard_timeout_s=120, repeats=1)
    finally:
        worker.close()
    assert first["status"] == second["status"] == "ok" and first["runner_pid"] != second["runner_pid"]
    assert worker.proc is None
