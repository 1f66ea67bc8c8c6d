"""Faults injected into the sweep harness: torn results lines, two writers, hanging and dying cells."""

from __future__ import annotations

import json
import os

import pytest

from experiments import plot, sweep
from experiments.configs import sweep as sweep_configs


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
