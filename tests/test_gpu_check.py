"""benchmarks/gpu_check.py --smoke: the GPU check's own code at toy sizes on CPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp

from benchmarks import gpu_check

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_smoke_runs_every_section_and_writes_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    opts = gpu_check.Options(repeats=1)
    result = gpu_check.run(smoke=True, sections=list(gpu_check.SECTIONS), out=str(out), opts=opts)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    corr = result["correctness"]
    # 6 masks x the dtypes x the implementations, then each score x the dtypes x (pallas, blockwise)
    sz = gpu_check.SMOKE
    cells = len(sz.corr_heads) * len(sz.corr_dtypes)
    assert len(corr) == 6 * cells * len(opts.implementations) + len(sz.corr_scores) * cells * 2
    assert {r["dtype"] for r in corr} == set(sz.corr_dtypes)
    scored = [r for r in corr if r["score"] != "dot"]
    assert {(r["implementation"], r["score"], r["status"]) for r in scored} == {
        ("pallas", "additive", "ok"),
        ("blockwise", "additive", "ok"),
    }
    assert not [r for r in corr if r["status"] in ("FAIL", "error")], [r for r in corr if r["status"] != "ok"]
    ran = {(r["implementation"], r["mask"]) for r in corr if r["status"] == "ok"}
    # on a CPU: xla and blockwise run every mask, sparse the graph, cuDNN none (with its reason)
    assert {("xla", "traced_padding"), ("blockwise", "traced_padding"), ("sparse", "graph_1pct")} <= ran
    cudnn = [r for r in corr if r["implementation"] == "cudnn"]
    assert all(r["status"] == "unsupported" and "needs a GPU backend" in r["reason"] for r in cudnn)
    assert all(r["empty_rows_zero"] and r["grads_finite"] for r in corr if r["status"] == "ok")
    speed = [r for r in result["speed"] if r["status"] == "ok"]
    assert {r["implementation"] for r in speed} >= {"xla", "blockwise"}
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in speed)
    assert {(r["mask"], r["implementation"]) for r in speed} >= {("document16", "xla"), ("document16", "blockwise")}
    scored = [r for r in result["speed"] if r["score"] != "dot"]
    assert {r["score"] for r in scored} == {"softcap:30", "alibi_mod", "additive"}
    assert {(r["score"], r["implementation"]) for r in scored} == {
        ("softcap:30", "pallas"),
        ("alibi_mod", "pallas"),
        ("additive", "pallas"),
        ("additive", "blockwise"),
    }
    traced = [r for r in result["speed"] if r["mask"] == "document16_traced"]
    assert traced and all(r["implementation"] == "pallas" and r["status"] == "ok" for r in traced)
    assert all(r["first_call_s"] > 0 for r in corr if r["status"] == "ok")
    blocks = result["blocks"]
    assert {(r["block_q"], r["block_k"]) for r in blocks if r["status"] == "ok"} == set(sz.blocks)
    mem = [r for r in result["memory"] if r["status"] == "ok"]
    assert mem and all(r["total_bytes"] >= r["temp_bytes"] > 0 for r in mem)


def test_command_line_smoke_prints_a_table(tmp_path):
    """The script entry point (flags, table, JSON), memory section only to stay quick."""
    out = tmp_path / "g.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--sections=memory", f"--out={out}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "## memory" in proc.stdout and "| xla | ok |" in proc.stdout
    assert json.loads(out.read_text())["meta"]["smoke"] is True


def test_allowed_pairs_by_hand():
    # T = 4: full 16, causal 4 + 3 + 2 + 1 = 10, window(1, 0): 1 + 2 + 2 + 2 = 7, window(1, 1): 2 + 3 + 3 + 2 = 10
    assert gpu_check._allowed_pairs("full", 4, None) == 16
    assert gpu_check._allowed_pairs("causal", 4, None) == 10
    assert gpu_check._allowed_pairs("window", 4, (1, 0)) == 7
    assert gpu_check._allowed_pairs("window", 4, (1, 1)) == 10


def test_timed_row_ratio_to_cudnn_and_errors(capsys):
    """cuDNN's own row is 1.0, another row is cuDNN ms / its ms; a failing call is an error row (None)."""
    rec = gpu_check.Recorder("speed", 1.0)
    opts = gpu_check.Options(repeats=1)
    slow = jax.jit(lambda x: jnp.tanh(x @ x) @ x)  # a few ms: the row's ms rounded to µs is exact to < 1%
    x = jnp.ones((384, 384))
    ms = gpu_check._timed_row(rec, dict(implementation="cudnn"), slow, (x,), opts, 1e9, None)
    assert ms > 0 and rec.rows[-1]["vs_cudnn"] == 1.0 and rec.rows[-1]["status"] == "ok"
    gpu_check._timed_row(rec, dict(implementation="pallas"), slow, (x,), opts, 1e9, 2 * ms)
    mine = rec.rows[-1]
    assert abs(mine["vs_cudnn"] - 2 * ms / mine["ms"]) <= 0.01 * mine["vs_cudnn"]
    assert abs(mine["tflops"] * mine["ms"] - 1) < 0.01  # 1e9 FLOPs: TFLOP/s x ms = 1

    def boom(x):
        raise RuntimeError("out of resources")

    assert gpu_check._timed_row(rec, dict(implementation="xla"), boom, (x,), opts, 1, None) is None
    assert rec.rows[-1]["status"] == "error" and rec.rows[-1]["reason"] == "RuntimeError: out of resources"
    assert capsys.readouterr().out.count("[speed") == 3  # every row printed as it is added
