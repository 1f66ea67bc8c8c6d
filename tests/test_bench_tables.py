"""experiments.bench_tables on hand-written files: make bench's ratios by host, a bisection's steps."""

import json

from experiments import bench_tables


def _run(tmp_path, name, model, flags, records):
    host = {"cpu_model": model, "cpu_simd_flags": flags, "host_cpus": 2}
    meta = {"host": host, "jax": "0.10.2", "date": "2026-12-07"}
    (tmp_path / name).write_text(json.dumps({"meta": meta, "records": records}))


def test_ratios_by_host_puts_each_runs_ratio_under_its_host_and_keeps_only_shared_cells(tmp_path):
    full = {"suite": "full fwd", "impl": "attnlab.blockwise", "N": 1024, "ms": 1.0}
    graph = {"suite": "graph", "impl": "attnlab.sparse (layer)", "N": 1_000_000, "ms": 1.0}
    _run(tmp_path, "a.json", "Intel(R) Xeon(R) Processor", ["avx2", "avx512f"], [full | {"x_vs_torch.sdpa": 0.556}])
    for name, ratio in (("b.json", 1.454), ("c.json", 0.85)):
        only_here = graph | {"x_vs_pyg": 2.0}  # not in a.json: no row
        _run(tmp_path, name, "AMD EPYC", ["avx2"], [full | {"x_vs_torch.sdpa": ratio}, only_here])
    lines = bench_tables.ratios_by_host(tmp_path, ("a.json", "b.json", "c.json")).strip().splitlines()
    hosts = "Intel(R) Xeon(R) (AVX-512) | AMD EPYC (AVX2) | AMD EPYC (AVX2) run 2"
    assert lines[0] == f"| suite | N | attnlab | vs | {hosts} |"
    assert lines[2] == "| full fwd | 1K | attnlab (1 device) | torch.sdpa | 0.56x | 1.45x | 0.85x |"
    assert len([line for line in lines if line.startswith("|")]) == 3  # header, rule, the one shared cell
    assert "Host: Intel(R) Xeon(R) Processor, 2 CPUs (avx2, avx512f)" in lines[-1]
    assert "Host: AMD EPYC, 2 CPUs (avx2); jax 0.10.2, 2026-12-07." in lines[-1]


def test_compare_steps_puts_each_step_on_its_own_row_with_its_rounds(tmp_path):
    host = {"cpu_model": "AMD EPYC", "cpu_simd_flags": ["avx2"], "host_cpus": 2}
    for name, base, head, (b, h), rounds in (
        ("s1.json", "aaa", "bbb", (700.0, 791.0), [0.9, 1.13, 1.05]),
        ("s2.json", "bbb", "ccc", (800.0, 736.0), [0.82, 0.92, 1.09]),
    ):
        ratios = {"median": sorted(rounds)[1], "min": min(rounds), "max": max(rounds)}
        row = {"cell": "window 16384 fwd+bwd", "base_ms": b, "head_ms": h, "ratio": h / b, "round_ratios": ratios}
        meta = {"host": host, "jax": "0.10.2", "date": "2026-12-07", "base": base, "head": head, "same_process": True}
        (tmp_path / name).write_text(json.dumps({"meta": meta, "rows": [row]}))
    lines = bench_tables.compare_steps(tmp_path, ("s1.json", "s2.json")).strip().splitlines()
    assert lines[0].startswith("| step (before -> after) | cell | before ms | after ms | after / before |")
    assert lines[2] == "| aaa -> bbb | window 16384 fwd+bwd | 700.0 | 791.0 | 1.13 | 1.05 (0.90-1.13) |"
    assert lines[3] == "| bbb -> ccc | window 16384 fwd+bwd | 800.0 | 736.0 | 0.92 | 0.92 (0.82-1.09) |"
    assert lines[-1] == "Host: AMD EPYC, 2 CPUs (avx2); jax 0.10.2, 2026-12-07."


def test_compare_trace_gives_each_trees_best_and_slowest_round_and_the_ratio_of_the_bests(tmp_path):
    host = {"cpu_model": "AMD EPYC", "cpu_simd_flags": ["avx2"], "host_cpus": 2}
    runs = {
        "base": [{"c": {"trace_s": 4.8}}, {"c": {"trace_s": 6.99}}],
        "head": [{"c": {"trace_s": 0.49}}, {"c": {"trace_s": 0.26}}],
    }
    runs["base"][0]["d"], runs["base"][1]["d"] = {"trace_s": 0.0064}, {"trace_s": 0.12}  # under 0.1 s: 3 decimals
    runs["head"][0]["d"], runs["head"][1]["d"] = {"trace_s": 0.0081}, {"trace_s": 0.0095}
    row = {"cell": "c", "base_trace_s": 4.8, "head_trace_s": 0.26, "ratio": 0.26 / 4.8}
    small = {"cell": "d", "base_trace_s": 0.0064, "head_trace_s": 0.0081, "ratio": 0.0081 / 0.0064}
    meta = {"host": host, "jax": "0.10.2", "date": "2026-12-07", "base": "aaa", "rounds": 2, "measure": "trace"}
    (tmp_path / "t.json").write_text(json.dumps({"meta": meta, "rows": [row, small], "runs": runs}))
    lines = bench_tables.compare_trace(tmp_path, "t.json").strip().splitlines()
    assert lines[0] == "| cell | aaa: s (slowest round) | after: s (slowest round) | after / before |"
    assert lines[2] == "| c | 4.80 (6.99) | 0.26 (0.49) | 0.054 |"
    assert lines[3] == "| d | 0.006 (0.12) | 0.008 (0.009) | 1.266 |"
    assert lines[-1] == "2 rounds. Host: AMD EPYC, 2 CPUs (avx2); jax 0.10.2, 2026-12-07."
