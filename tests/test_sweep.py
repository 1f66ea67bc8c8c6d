"""The sweep harness: FLOP counts by hand, schema, resume, fault isolation, no recompilation, plots."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlab
from attnlab import masks
from attnlab.testing import tolerance
from experiments import plot, sweep
from experiments.configs import sweep as sweep_configs

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "sweep_fixture.jsonl")


def tiny_config(**overrides):
    c = sweep_configs.get_config("smoke")
    c.seq_lens = [16, 24]
    c.num_heads = [1]
    c.masks = ["full", "window:2:1"]
    c.update(overrides)
    return c


@pytest.mark.parametrize(
    "spec", ["full", "causal", "window:3:1", "window:0:0", "graph:0.2", "padding:0.25", "document:3", "prefix_lm:4"]
)
def test_allowed_pairs_match_dense_mask(spec):
    n, batch = 13, 2
    mask, pairs, _ = sweep.parse_mask(spec, n, batch)
    dense = np.ones((n, n), bool) if mask is None else np.asarray(mask.dense(n, n))
    assert pairs == np.broadcast_to(dense, (batch, 1, n, n)).sum()


def test_flops_by_hand():
    # window:1:1 on N=4 allows 2 + 3 + 3 + 2 = 10 pairs.
    assert sweep.window_pairs(4, 1, 1) == 10
    cell = sweep.Cell("xla", "window:1:1", 4, 2, 8, 1, "fwd", "float32")
    assert sweep.useful_flops(cell, 10) == 4 * 2 * 8 * 10  # 2 matmuls x (mul + add)
    cell_bwd = sweep.Cell("xla", "window:1:1", 4, 2, 8, 1, "fwd_bwd", "float32")
    assert sweep.useful_flops(cell_bwd, 10) == 3 * 4 * 2 * 8 * 10  # + 4 backward matmuls


def test_every_variant_expands():
    for variant in ("default", "smoke", "long", "lra_table2"):
        cells = sweep.expand(sweep_configs.get_config(variant))
        assert cells and len(set(c.key() for c in cells)) == len(cells)
    with pytest.raises(ValueError, match="unknown sweep variant"):
        sweep_configs.get_config("huge")
    with pytest.raises(ValueError, match="masks.from_spec: bad spec 'window:3'"):
        sweep.expand(tiny_config(masks=["window:3"]))
    with pytest.raises(ValueError, match="implementations: unknown 'flash'"):
        sweep.expand(tiny_config(implementations=["flash"]))


def test_schema_resume_and_fault_isolation(tmp_path, monkeypatch, capsys):
    config = tiny_config(implementations=["reference", "xla", "jax.nn"], modes=["fwd", "fwd_bwd"])
    real_time_cell = sweep.time_cell
    broken = sweep.Cell("xla", "window:2:1", 24, 1, 8, 1, "fwd_bwd", "float32")

    def flaky(cell, **kw):
        if cell == broken:
            raise RuntimeError("forced failure")
        return real_time_cell(cell, **kw)

    monkeypatch.setattr(sweep, "time_cell", flaky)
    records = sweep.run_sweep(config, str(tmp_path), plot=False)
    assert len(records) == 3 * 2 * 2 * 2
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == len(records)
    failed = [r for r in rows if r["status"] != "ok"]
    assert len(failed) == 1 and failed[0]["status"] == "error" and "forced failure" in failed[0]["error"]
    for r in rows:
        for key in (
            "implementation",
            "mask",
            "seq_len",
            "num_heads",
            "head_dim",
            "batch",
            "mode",
            "dtype",
            "backend",
            "device_kind",
            "jax",
            "jaxlib",
            "host_cpus",
            "variant",
        ):
            assert key in r, key
        if r["status"] == "ok":
            assert 0 < r["min_ms"] <= r["median_ms"] and r["compile_s"] > 0 and r["repeats"] == config.repeats
            assert r["useful_gflops"] > 0 and r["memory_bytes"] > 0
            assert r["memory_source"] == "xla_memory_analysis"
    assert "ETA" in capsys.readouterr().out
    run = json.loads((tmp_path / "run.json").read_text())  # what made the folder (experiments.provenance)
    assert run["command"] == "experiments.sweep.run_sweep" and run["cells"] == run["cells_run"] == len(records)
    assert run["wall_s"] > 0 and run["cpu_s"] > 0 and "at the start" in run["load"]

    # Rerun: only the failed cell runs again.
    ran = []
    monkeypatch.setattr(sweep, "time_cell", lambda cell, **kw: ran.append(cell) or real_time_cell(cell, **kw))
    sweep.run_sweep(config, str(tmp_path), plot=False)
    assert ran == [broken]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == len(records) and all(r["status"] == "ok" for r in rows)

    # --force redoes everything.
    ran.clear()
    sweep.run_sweep(tiny_config(seq_lens=[16], masks=["full"]), str(tmp_path), force=True, plot=False)
    assert len(ran) == 2


def test_sparse_cells_take_the_graph_as_edges():
    cells = sweep.expand(tiny_config(implementations=["sparse", "xla"], masks=["full", "graph:0.3"]))
    assert {(c.implementation, c.mask) for c in cells} == {
        ("sparse", "graph:0.3"),
        ("xla", "full"),
        ("xla", "graph:0.3"),
    }
    cell = sweep.Cell("sparse", "graph:0.3", 12, 2, 4, 1, "fwd", "float32")
    fn, (q, k, v, mask), pairs = sweep.build(cell)
    assert isinstance(mask, masks.GraphEdges) and mask.senders.shape[0] == pairs
    dense_fn, (_, _, _, dense_mask), _ = sweep.build(
        sweep.Cell("reference", "graph:0.3", 12, 2, 4, 1, "fwd", "float32")
    )
    np.testing.assert_allclose(fn(q, k, v, mask), dense_fn(q, k, v, dense_mask), atol=2e-5)


def test_forward_backward_cells_compute_gradients():
    # the cell's program is the gradient of <attention(q, k, v), cotangent> in q, k and v: against jax.vjp of
    # the reference with the same cotangent (the cell's own key split: q, k, v, then the cotangent)
    fn, (q, k, v, mask), _ = sweep.build(sweep.Cell("xla", "causal", 8, 2, 4, 1, "fwd_bwd", "float32"))
    grads = fn(q, k, v, mask)
    cotangent = jax.random.normal(jax.random.split(jax.random.key(0), 4)[3], q.shape, jnp.float32)
    out, vjp = jax.vjp(lambda q, k, v: attnlab.attention_reference(q, k, v, mask=mask), q, k, v)
    assert out.shape == (1, 8, 2, 4) and len(grads) == 3
    for got, want in zip(grads, vjp(cotangent), strict=True):
        np.testing.assert_allclose(got, want, **tolerance("float32", "grad"))


def test_no_recompilation_across_repeats(monkeypatch):
    traces = []
    real = attnlab.attention

    def counting(*a, **kw):
        traces.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(attnlab, "attention", counting)
    rec = sweep.time_cell(sweep.Cell("xla", "causal", 16, 1, 8, 1, "fwd", "float32"), repeats=4)
    assert rec["status"] == "ok" and rec["repeats"] == 4
    assert len(traces) == 1  # traced and compiled once, then the compiled program is reused


def test_soft_timeout_is_recorded():
    rec = sweep.time_cell(sweep.Cell("reference", "full", 16, 1, 8, 1, "fwd", "float32"), repeats=3, timeout_s=0.0)
    assert rec["status"] == "timeout" and rec["repeats"] == 1


def test_plots_from_fixture(tmp_path):
    files = plot.make_plots(FIXTURE, str(tmp_path))
    names = sorted(os.path.basename(f) for f in files)
    assert names == ["gflops_vs_n.png", "memory_vs_n.png", "summary.md", "time_vs_heads.png", "time_vs_n.png"]
    for f in files:
        assert os.path.getsize(f) > 1000
    summary = (tmp_path / "summary.md").read_text()
    n_records = len(plot.load_results(FIXTURE))
    assert summary.count("\n| ") == n_records + 1  # header + one row per cell
    assert "oom" in summary and "Failed cells" in summary


def test_experiments_import_together():
    # Flags are defined only when a module runs as a program, so several experiments (and the
    # benchmarks) can be imported into one process, as the test suite and notebooks do.
    import importlib

    for name in ("experiments.sweep", "experiments.plot", "experiments.pos_tagging", "benchmarks.bench_attention"):
        importlib.import_module(name)


def test_mesh_flag_selects_cells_and_runs_on_a_mesh():
    # With a sequence axis only blockwise cells run (the ring uses its block step); peers never.
    cells = sweep.expand(tiny_config(implementations=["reference", "blockwise", "jax.nn"], mesh="heads=1,sp=1"))
    assert {c.implementation for c in cells} == {"blockwise"} and all(c.mesh == "heads=1,sp=1" for c in cells)
    cells = sweep.expand(tiny_config(implementations=["reference", "jax.nn"], mesh="heads=1"))
    assert {c.implementation for c in cells} == {"reference"}
    with pytest.raises(ValueError, match="mesh"):
        sweep.expand(tiny_config(mesh="data=2"))
    # One cell on a 1-device mesh (same code as 8 devices), against attention_reference.
    cell = sweep.Cell("blockwise", "window:2:1", 24, 2, 8, 1, "fwd", "float32", "heads=1,sp=1")
    fn, (q, k, v, m), _ = sweep.build(cell)
    out = jax.jit(fn)(q, k, v, m)
    np.testing.assert_allclose(out, attnlab.attention_reference(q, k, v, mask=m), atol=2e-5, rtol=2e-5)


def test_dtypes_auto_is_bf16_on_accelerators_and_fp32_on_cpu():
    assert sweep.resolve_dtypes(["auto"], "cpu") == ["float32"]
    assert sweep.resolve_dtypes(["auto"], "gpu") == ["bfloat16"]
    assert sweep.resolve_dtypes(["auto"], "tpu") == ["bfloat16"]
    assert sweep.resolve_dtypes(["auto", "bfloat16", "float16"], "gpu") == ["bfloat16", "float16"]
    for backend, want in (("cpu", "float32"), ("gpu", "bfloat16"), ("tpu", "bfloat16")):
        cells = sweep.expand(tiny_config(dtypes=["auto"]), backend=backend)
        assert {c.dtype for c in cells} == {want}
    assert {c.dtype for c in sweep.expand(tiny_config(dtypes=["float32"]), backend="gpu")} == {"float32"}
    with pytest.raises(ValueError, match="dtypes: unknown 'fp8'"):
        sweep.expand(tiny_config(dtypes=["fp8"]), backend="cpu")


class _Analysis:  # what compiled.memory_analysis() gives: 100 + 20 + 10 - 0 bytes
    temp_size_in_bytes, argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 100, 20, 10, 0


class _Compiled:
    def memory_analysis(self):
        return _Analysis()


def test_memory_is_the_cells_own_device_peak_or_the_compiled_analysis():
    rec = sweep.memory_record(_Compiled(), None, None)  # CPU: no device stats
    assert rec["memory_bytes"] == 130 and rec["memory_source"] == "xla_memory_analysis"
    # the process-wide peak rose during this cell: its own peak is that peak minus what was in use before
    before = {"bytes_in_use": 1000, "peak_bytes_in_use": 5000}
    rec = sweep.memory_record(_Compiled(), before, {"bytes_in_use": 1000, "peak_bytes_in_use": 7000})
    assert rec["memory_bytes"] == rec["device_peak_bytes"] == 6000 and rec["compiled_memory_bytes"] == 130
    assert rec["memory_source"].startswith("device_peak")
    # an earlier cell peaked higher: the process-wide peak says nothing about this one, so it is not used
    rec = sweep.memory_record(_Compiled(), before, {"bytes_in_use": 1000, "peak_bytes_in_use": 5000})
    assert rec["memory_bytes"] == 130 and "device_peak_bytes" not in rec and "not attributable" in rec["memory_source"]
    # a cell in its own process: the device peak is the cell's
    rec = sweep.memory_record(_Compiled(), before, {"bytes_in_use": 1000, "peak_bytes_in_use": 5000}, isolated=True)
    assert rec["memory_bytes"] == 5000 and "own process" in rec["memory_source"]


def test_mesh_advice_per_backend():
    assert "host devices" in sweep.mesh_advice("sp=8", "cpu", 1, cpus=2)
    assert "no speed-up" in sweep.mesh_advice("sp=8", "cpu", 1, cpus=2)
    assert "no speed-up" not in sweep.mesh_advice("heads=2", "cpu", 1, cpus=2)
    assert "one GPU per mesh device" in sweep.mesh_advice("heads=4,sp=2", "gpu", 8)
    assert "TPU core" in sweep.mesh_advice("sp=4", "tpu", 4)
    with pytest.raises(ValueError, match=r"mesh: 'sp=8' needs 8 devices, the gpu backend has 1 .*--mesh=heads=1"):
        sweep.mesh_advice("sp=8", "gpu", 1)
