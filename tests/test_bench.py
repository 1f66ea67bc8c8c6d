"""The benchmark harness's timing protocol (benchmarks/bench_attention.py)."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
from absl import app

from benchmarks import bench_attention, harness
from experiments import common

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_side_by_side_times_the_second_of_each_pair():
    calls = {"a": 0, "b": 0}

    def make(name):
        def fn():
            calls[name] += 1
            # call 1 is the warm-up; then each round makes an untimed (even) and a timed (odd) call
            time.sleep(0.03 if calls[name] % 2 == 0 else 0.002)

        return fn

    out = bench_attention.time_side_by_side({"a": make("a"), "b": make("b")}, repeats=3)
    assert calls == {"a": 7, "b": 7}  # 1 warm-up + 3 rounds x (untimed + timed)
    for name in ("a", "b"):
        assert 0.002 <= out[name].best_s < 0.015, out  # the 30 ms untimed calls are never the ones timed
        assert out[name].first_s >= 0.002


def test_records_give_ratios_peer_over_ours():
    """``x_vs_<peer>`` is the peer's best ms over ours (> 1: ours faster); compile time is first call minus best."""
    timed = {
        "attnlab.blockwise": harness.Timing(0.5, (0.010, 0.012)),
        "torch.sdpa": harness.Timing(0.02, (0.030, 0.025)),
    }
    ours, peer = bench_attention._records("full fwd", 1024, timed, 1e9, {"attnlab.blockwise": ["torch.sdpa", "jax.nn"]})
    assert ours["ms"] == 10.0 and ours["x_vs_torch.sdpa"] == 2.5 and "x_vs_jax.nn" not in ours
    assert ours["compile_ms"] == 490.0 and ours["gflops"] == 100.0  # 1e9 FLOPs in 10 ms
    assert peer["ms"] == 25.0 and not any(k.startswith("x_vs_") for k in peer)


def test_host_devices_must_divide_heads():
    with pytest.raises(app.UsageError, match="--host_devices=3 must divide --heads=8"):
        bench_attention.host_devices(3, cpus=4, heads=8)


def test_bench_times_the_head_parallel_kernel_on_two_host_devices(tmp_path):
    # a fresh process: the host device count must be set before JAX's first computation
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "benchmarks.bench_attention", "--suites=full,window,window_bwd", "--full_lengths=256"]
    cmd += ["--window_lengths=512", "--window_bwd_lengths=512", "--window_jax_nn_lengths=512", "--window=32"]
    cmd += ["--heads=4", "--head_dim=16"]
    cmd += ["--repeats=1", "--peers=jax_nn"]
    cmd += ["--host_devices=2", f"--out={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["meta"]["host_devices"] == 2
    assert out["meta"]["dtype"] == "float32"  # --dtype=auto on CPU
    assert out["meta"]["wall_s"] > 0 and out["meta"]["cpu_s"] > 0 and "load_avg_end" in out["meta"]
    rows = {(r["suite"], r["impl"]): r for r in out["records"]}
    for suite in ("full fwd", "window ±32 fwd", "window ±32 fwd+bwd"):
        two = rows[(suite, "attnlab.blockwise/2dev")]
        assert two["ms"] > 0 and "x_vs_jax.nn" in two
        assert rows[(suite, "attnlab.blockwise")]["ms"] > 0


def test_dtype_auto_is_bf16_on_accelerators_and_fp32_on_cpu():
    assert bench_attention.bench_dtype("auto", "cpu") == "float32"
    assert bench_attention.bench_dtype("auto", "gpu") == "bfloat16"
    assert bench_attention.bench_dtype("auto", "tpu") == "bfloat16"
    assert bench_attention.bench_dtype("float16", "gpu") == "float16"
    assert bench_attention.bench_dtype("float32", "tpu") == "float32"


def test_torch_peers_run_on_the_device_jax_runs_on():
    pick = bench_attention.torch_device
    assert pick("cpu", cuda_available=False)[0] == "cpu"
    assert pick("cpu", cuda_available=True)[0] == "cpu"  # JAX on CPU: so is its peer, even with a GPU around
    assert pick("gpu", cuda_available=True)[0] == "cuda"
    device, why = pick("gpu", cuda_available=False)
    assert device is None and "skipped" in why  # never a CPU torch against a GPU JAX
    assert pick("tpu", cuda_available=True)[0] is None


def test_torch_inputs_keep_the_dtype_and_layout():
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp
    import numpy as np

    x = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5).astype(jnp.bfloat16)  # [B, T, N, H]
    (t,) = bench_attention.to_torch(torch, [x], device="cpu")
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (2, 4, 3, 5)  # [B, N, T, H]
    np.testing.assert_array_equal(t.float().numpy(), np.asarray(x, np.float32).transpose(0, 2, 1, 3))


def test_memory_suite_reads_the_device_peak_where_the_backend_keeps_one(monkeypatch):
    from absl import flags
    from absl.testing import flagsaver

    if "memory_lengths" not in flags.FLAGS:  # defined when run as a program; importing defines none
        bench_attention.define_flags()
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    # GPU-like statistics: nothing in use before, a 3 MiB peak while the fwd+bwd runs
    idle, busy = {"bytes_in_use": 0, "peak_bytes_in_use": 0}, {"bytes_in_use": 0, "peak_bytes_in_use": 3 << 20}
    stats = iter([idle, idle, busy])  # read: is there any, before the run, after it
    monkeypatch.setattr(common, "memory_stats", lambda: next(stats))
    with flagsaver.flagsaver(memory_lengths=["64"], heads=2, head_dim=8, dtype="float32"):
        (rec,) = bench_attention.suite_memory(None)
    assert rec["device_peak_mb"] == 3.0 and rec["memory_source"].startswith("device_peak")
    assert rec["temp_mb"] >= 0 and rec["N"] == 64
    monkeypatch.setattr(common, "memory_stats", lambda: None)  # XLA:CPU: the analysis only
    with flagsaver.flagsaver(memory_lengths=["64"], heads=2, head_dim=8, dtype="float32"):
        (rec,) = bench_attention.suite_memory(None)
    assert "device_peak_mb" not in rec and rec["memory_source"] == "xla_memory_analysis"


def test_packed_documents_benchmark_runs_small_and_traces_once(tmp_path):
    """`make packed-docs` at a tiny size: every suite's records, one trace across batches of new ids."""
    cmd = [
        sys.executable, "-m", "benchmarks.packed_documents", "--out", str(tmp_path), "--seq_len=256", "--docs=4",
        "--scaling_docs=2,8", "--repeats=1", "--batches=3", "--heads=2",
    ]  # fmt: skip
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=pathlib.Path(__file__).resolve().parents[1]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "packed.json").read_text())
    suites = [r["suite"] for r in result["records"]]
    assert suites.count("compare") == 2 and suites.count("scaling") == 2
    assert [r["traces"] for r in result["records"] if r["suite"] == "retrace"] == [1]
    assert "cpu_simd_flags" in result["host"] and (tmp_path / "packed.png").stat().st_size > 0
    for r in result["records"]:
        if r["suite"] == "compare":
            assert r["traced_s"] > 0 and r["concrete_s"] > 0 and r["xla_s"] > 0


def test_scores_benchmark_runs_small(tmp_path):
    """`make scores` at a tiny size: softcap and alibi_mod rows per (mask, mode), the additive part's memory."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.scores",
        "--out",
        str(tmp_path),
        "--seq_len=64",
        "--heads=2",
        "--additive_seq_len=128",
        "--additive_heads=2",
        "--head_dim=16",
        "--repeats=1",
        "--rounds=1",
        "--graph_nodes=256",
        "--graph_degree=1",
    ]
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=pathlib.Path(__file__).resolve().parents[1]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "scores.json").read_text())
    # part 3: every score on the graph's edges; 256^2 pairs over 2 * 256 edges = 128 pairs per edge, from
    # min_pairs_per_edge(H) (at most 64) up, so dispatch runs the sparse kernel for each (it takes them all)
    graph = result["graph"]
    assert [r["score"] for r in graph] == ["dot", "softcap", "alibi_mod", "pair_table_mod", "additive"]
    assert all(r["edges"] == 256 * 2 and r["sparse_s"] > 0 for r in graph)
    assert all(r["blockwise_s"] > 0 for r in graph[:4]) and graph[4]["blockwise_s"] is None
    assert {r["dispatch"] for r in graph} == {"sparse"}
    assert [(r["mask"], r["mode"], r["score"]) for r in result["records"]] == [
        (m, mode, s) for m in ("full", "causal") for mode in ("fwd", "fwd+bwd") for s in ("softcap", "alibi_mod")
    ]
    assert all(r["dot_s"] > 0 and r["score_s"] > 0 for r in result["records"])
    add = result["additive"]
    # the dense reference's [T, S, N, H] fp32 tanh tensor alone is 4 * 128^2 * 2 * 16 bytes = 2 MiB
    assert add["dense_temp_gib"] * 2**30 >= 4 * 128 * 128 * 2 * 16 > add["tiled_temp_gib"] * 2**30
    assert add["additive_s"] > 0 and add["dot_s"] > 0 and add["additive_gflops"] > 0


def test_flex_benchmark_runs_small(tmp_path):
    """`make flex` at a tiny size: both masks, both sides timed, outputs equal (needs torch: the bench extra)."""
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "benchmarks.flex", "--out", str(tmp_path), "--seq_len=256", "--heads=2",
           "--head_dim=16", "--docs=4", "--window=16", "--repeats=1", "--rounds=1"]  # fmt: skip
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=pathlib.Path(__file__).resolve().parents[1]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "flex.json").read_text())
    assert [r["mask"] for r in result["records"]] == ["document", "window"]
    for r in result["records"]:
        assert r["attnlab_s"] > 0 and r["flex_s"] > 0 and r["max_abs_diff"] < 1e-4
        # the head-parallel row (2 host devices on this 2-core machine); its output is in max_abs_diff too
        assert r["host_devices"] == min(2, os.cpu_count() or 1) and r.get("attnlab_devices_s", 1.0) > 0


def test_flex_cap_isa_caps_both_sides_with_a_fresh_inductor_cache(monkeypatch):
    """``--cap_isa avx2``: XLA's and torch's code capped, and an empty inductor cache of its own each run (inductor's
    cache does not key on the capability: a stale AVX-512 kernel gave wrong outputs under avx2)."""
    import shutil

    from benchmarks import flex

    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    for name in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR"):
        # setenv first: delenv of an unset variable records nothing, and cap_isa's values (avx2, a cache
        # folder removed below) would outlive the test and reach later tests' torch subprocesses
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert flex.cap_isa(None) == {} and os.environ["XLA_FLAGS"] == "--xla_foo=1"
    first = flex.cap_isa("avx2")
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1 --xla_cpu_max_isa=AVX2" == first["XLA_FLAGS"]
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    cache = pathlib.Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    second = flex.cap_isa("avx2")
    try:
        assert cache == pathlib.Path(first["TORCHINDUCTOR_CACHE_DIR"]) and cache.is_dir() and not any(cache.iterdir())
        assert second["TORCHINDUCTOR_CACHE_DIR"] != first["TORCHINDUCTOR_CACHE_DIR"]
    finally:
        for env in (first, second):
            shutil.rmtree(env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def test_ring_balance_benchmark_runs_small(tmp_path):
    """`make ring-balance` at a tiny size on 8 host devices: the zig-zag ring's even tile counts (17 per device
    at T = 256, tiles of 16: 136 causal tiles over 8), the contiguous ring's 4d + 3 (two query blocks per device),
    and both layouts' forward+backward step timed."""
    out = tmp_path / "ring_balance.json"
    cmd = [sys.executable, "-m", "benchmarks.ring_balance", "--seq_len=256", "--block=16", "--num_heads=2",
           "--head_dim=8", "--repeats=1", "--masks=causal", f"--out={out}"]  # fmt: skip
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["zigzag"]["tiles_per_device"] == [17] * 8
    assert rows["contiguous"]["tiles_per_device"] == [4 * d + 3 for d in range(8)]
    assert all(r["step_s_best"] > 0 for r in rows.values())
