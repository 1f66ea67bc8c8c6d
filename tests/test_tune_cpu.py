"""benchmarks.tune_cpu (``make tune-cpu``): autotune's rows and the re-timed pair on a small case, and its table."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import attnlab
from attnlab.call import bind
from attnlab.kernels import blockwise
from benchmarks import harness, tune_cpu
from experiments import dispatch_tables


@pytest.mark.slow
def test_a_small_case_times_every_candidate_and_re_times_the_fastest_against_the_default():
    row = tune_cpu.tune_case("documents", 256, 2, 16, budget_s=60, repeats=1, rounds=1)
    times = {(c["config"]["block_q"], c["config"]["block_k"]): c["ms"] for c in row["candidates"]}
    assert len(times) == 9 and all(t is not None and t > 0 for t in times.values())  # 64..256 x 64..256
    best = min(times, key=times.get)
    assert (row["best"]["block_q"], row["best"]["block_k"]) == best and row["autotune_best_ms"] == times[best]
    assert row["default"] == {"block_q": 64, "block_k": 64}  # 16 documents in 256: the sparse tiles
    assert row["default_ms"] > 0 and row["best_ms"] > 0
    assert row["best_over_default"] == pytest.approx(row["best_ms"] / row["default_ms"])
    assert row["key"]["implementation"] == "blockwise" and row["key"]["direction"] == "fwd_bwd"
    # the two timed programs compute the same gradients as the reference (any tiles: the same attention)
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 256, 2, 16)) for i in range(3))
    mask = tune_cpu.CASES["documents"][0](256)
    call = bind(q, k, v, mask=mask)
    tiles = blockwise.BlockSizes(**row["best"])
    fns = {
        "best": lambda q, k, v: blockwise.attend(dataclasses.replace(call, q=q, k=k, v=v), block_sizes=tiles),
        "reference": lambda q, k, v: attnlab.attention_reference(q, k, v, mask=mask),
    }
    jitted, args = harness.directed(fns, "fwd+bwd", (q, k, v))
    for g, g_ref in zip(jitted["best"](*args), jitted["reference"](*args), strict=True):
        np.testing.assert_allclose(g, g_ref, atol=1e-5, rtol=1e-5)


def test_table_reads_each_case_from_its_candidates_and_re_timed_pair(tmp_path):
    host = {"cpu_model": "AMD EPYC", "cpu_simd_flags": ["avx2"], "host_cpus": 2}
    cand = lambda bq, bk, ms: {"config": {"block_q": bq, "block_k": bk}, "ms": ms, "compile_s": 1.0, "error": None}  # noqa: E731
    rows = [
        dict(case="window", T=16384, default={"block_q": 64, "block_k": 64}, best={"block_q": 128, "block_k": 64},
             candidates=[cand(64, 64, 700.0), cand(128, 64, 650.0), cand(1024, 512, None)], autotune_best_ms=650.0,
             default_ms=690.0, best_ms=669.3, best_over_default=0.97),
        dict(case="documents", T=4096, default={"block_q": 64, "block_k": 64}, best={"block_q": 64, "block_k": 64},
             candidates=[cand(64, 64, 393.6)], autotune_best_ms=393.6, default_ms=407.6, best_ms=352.0,
             best_over_default=0.8636),
        dict(case="causal", T=4096, default={"block_q": 512, "block_k": 256}, best=None, candidates=[],
             autotune_best_ms=None),
    ]  # fmt: skip
    result = {"meta": {"host": host, "jax": "0.10.2", "date": "2026-12-07"}, "rows": rows}
    lines = dispatch_tables.tune_cpu_rows(result).strip().splitlines()
    assert lines[0].startswith("| case (fwd+bwd) | tiles timed | default tiles | autotune ms | fastest tiles |")
    assert lines[2] == "| window 16,384 | 2 | 64 x 64 | 700.0 | 128 x 64 | 650.0 | 690.0 | 669.3 | 0.97 |"
    assert lines[3] == "| documents 4,096 | 1 | 64 x 64 | 393.6 | 64 x 64 | 393.6 | 407.6 | 352.0 | 0.86 (same tiles) |"
    assert lines[4] == "| causal 4,096 | 0 | 512 x 256 |  |  |  |  |  |  |"
    # two committed runs: each case's rows together, labelled by run, and the runs' host
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(result))
    lines = dispatch_tables.tune_cpu(tmp_path, ("a.json", "b.json")).strip().splitlines()
    assert [line.split(" |")[0] for line in lines[2:8]] == [
        "| window 16,384 (run 1)", "| window 16,384 (run 2)", "| documents 4,096 (run 1)",
        "| documents 4,096 (run 2)", "| causal 4,096 (run 1)", "| causal 4,096 (run 2)",
    ]  # fmt: skip
    assert lines[-1] == "Host: AMD EPYC, 2 CPUs (avx2); jax 0.10.2, 2026-12-07."
