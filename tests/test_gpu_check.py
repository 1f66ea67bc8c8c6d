"""benchmarks/gpu_check.py --smoke: the GPU check's own code at toy sizes on a CPU, and its pieces."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlab
from benchmarks import contenders, correctness, gpu_check, harness, torch_peers
from benchmarks.cases import Case, UnsupportedError, speed_cases

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the smoke run checks the script's code, not the kernels (the conformance suite does): cheap contenders
QUICK = ("sparse", "xla", "blockwise", "cudnn", "tokamax")


def test_smoke_runs_every_default_section_and_writes_json(tmp_path, monkeypatch):
    # the autotune section points it at its table; setenv first, so the test restores it afterwards
    monkeypatch.setenv("ATTNLAB_TUNING_CACHE", str(tmp_path / "before.json"))
    out = tmp_path / "gpu_check.json"
    opts = gpu_check.Options(contenders=QUICK, cases=("full", "window", "documents", "additive"), repeats=1,
                             minutes=tuple((s, 10.0) for s in gpu_check.SECTIONS), compile_workers=2)  # fmt: skip
    sizes = {"speed_lengths": (64,)}  # one length (the slow rule has its own test)
    result = gpu_check.run(smoke=True, sections=gpu_check.DEFAULT_SECTIONS, out=str(out), opts=opts, sizes=sizes)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    meta = result["meta"]
    assert meta["smoke"] and meta["backend"] == "cpu" and meta["host"]["cpu_model"] and meta["command"]
    assert {"correctness_s", "speed_s", "wall_s", "load_avg_end"} <= set(meta)

    corr = result["correctness"]
    sz = gpu_check.SMOKE
    cells = len(correctness.corr_cases(sz)) * len(sz.corr_heads) * len(sz.corr_dtypes)
    assert len(corr) == cells * 4  # xla, blockwise, sparse and cudnn (registered); tokamax is a peer, timed only
    assert all(r["status"] == "unsupported" for r in corr if r["implementation"] == "cudnn")  # no GPU here
    assert not [r for r in corr if r["status"] in ("FAIL", "error", "skipped")], corr
    ran = {(r["implementation"], r["mask"], r["score"]) for r in corr if r["status"] == "ok"}
    assert ("sparse", "graph_1pct", "dot") in ran  # its edge-list form of the graph
    assert {("xla", "traced_padding", "dot"), ("blockwise", "traced_padding", "dot")} <= ran
    assert ("blockwise", "causal", "additive") in ran and ("xla", "causal", "additive") not in ran
    assert all(
        r["empty_rows_zero"] and r["grads_finite"] and r["out_tol_ratio"] <= 1 for r in corr if r["status"] == "ok"
    )
    assert all(
        r["grad_tol_ratio"] <= 1 and r["first_call_s"] >= r["compile_s"] > 0 for r in corr if r["status"] == "ok"
    )

    speed = result["speed"]
    ok = [r for r in speed if r["status"] == "ok"]
    assert {r["implementation"] for r in ok} == {"xla", "blockwise"}
    assert all(r["ms"] > 0 and r["median_ms"] >= r["ms"] and r["tflops"] > 0 and r["runs"] == 1 for r in ok)
    assert {r["case"] for r in ok} == {"full", "window", "documents", "additive"}
    assert {r["mask"] for r in ok if r["case"] == "documents"} == {"document4_traced"}  # ours: ids are jit arguments
    assert all(r["vs_cudnn"] is None and r["vs_flex"] is None for r in ok)  # no cuDNN, no flex on this run
    cudnn = [r for r in speed if r["implementation"] == "cudnn"]
    assert cudnn and all(r["status"] == "unsupported" and "GPU" in r["reason"] for r in cudnn)
    tok = [r for r in speed if r["implementation"] == "tokamax"]
    assert tok and all(r["status"] in ("ok", "unsupported") for r in tok)
    additive = [r for r in speed if r["case"] == "additive"]
    assert {(r["H"], r["T"]) for r in additive} == set(sz.additive_at)  # one target size only
    assert {r["T"] for r in speed} == {64}
    assert result["autotune"] == []  # no contender here has a GPU tile search (see the next test)
    mem = [r for r in result["memory"] if r["status"] == "ok"]
    assert {r["implementation"] for r in mem} == {"xla", "blockwise"}
    assert {r["implementation"] for r in result["memory"]} == {"xla", "blockwise", "sparse", "cudnn"}
    assert all(r["total_bytes"] >= r["temp_bytes"] > 0 for r in mem)


def test_autotune_section_tunes_pallas_writes_its_table_and_the_speed_section_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_TUNING_CACHE", str(tmp_path / "before.json"))  # restored after the test
    out = tmp_path / "gpu_check.json"
    opts = gpu_check.Options(contenders=("pallas", "mosaic"), cases=("full",), repeats=1,
                             minutes=tuple((s, 10.0) for s in gpu_check.SECTIONS), compile_workers=2)  # fmt: skip
    result = gpu_check.run(smoke=True, sections=("autotune",), out=str(out), opts=opts, sizes={"speed_lengths": (64,)})
    rows = {(r["implementation"], r["case"]): r for r in result["autotune"]}
    assert set(rows) == {(i, c) for i in ("mosaic", "pallas") for c in gpu_check.AUTOTUNE_CASES}
    mosaic = [r for (i, _), r in rows.items() if i == "mosaic"]  # not on a CPU (nor at H = 8): its reason
    assert all(r["status"] == "unsupported" and "implementation='mosaic'" in r["reason"] for r in mosaic)
    side = json.loads((tmp_path / "autotune.json").read_text())["results"]
    for r in side:  # every candidate timed; the best is the fastest of them
        ms = [c["ms"] for c in r["rows"] if c["ms"] is not None]
        assert rows["pallas", r["case"]]["ms"] == pytest.approx(min(ms), abs=1e-3)
    assert {r["case"] for r in side} == set(gpu_check.AUTOTUNE_CASES)
    table = tmp_path / "tuning.json"
    assert os.environ["ATTNLAB_TUNING_CACHE"] == str(table)  # what the speed section then reads
    entries = attnlab.tuning.load_timed(table)
    assert len(entries) == len({k for k, _, _ in entries}) > 0  # one entry per key
    assert all((k.implementation, k.direction, k.dtype) == ("pallas", "fwd_bwd", "bfloat16") for k, _, _ in entries)


def test_contenders_come_from_the_registry():
    ours = contenders.ours()
    assert contenders.JUDGE not in ours and "cudnn" not in ours  # the judge, and the peer called at jax.nn's API
    assert set(ours) | {contenders.JUDGE, "cudnn"} == set(attnlab.IMPLEMENTATIONS)
    assert set(contenders.registered()) == set(attnlab.IMPLEMENTATIONS) - {contenders.JUDGE}  # correctness, memory
    names = gpu_check.Options().contender_names()
    assert names == ours + contenders.PEERS
    with pytest.raises(ValueError, match="contenders must be among"):
        gpu_check.run(True, ["memory"], None, gpu_check.Options(contenders=("nope",)))


def test_speed_cells_run_shorter_lengths_first_and_additive_at_its_size():
    sz = dataclasses.replace(gpu_check.FULL, speed_heads=(64, 128), speed_lengths=(16384, 4096))
    cells = gpu_check.speed_cells(sz, gpu_check.Options(contenders=("pallas", "flex")))
    assert [(c.H, c.T) for c in cells[:1]] == [(128, 4096)] and cells[-1].H == 64 and cells[-1].T == 16384
    assert {(c.H, c.T) for c in cells if c.case.name == "additive"} == {(64, 4096)}
    per_group = {(c.H, c.T, c.direction) for c in cells}
    assert len(per_group) == 8 and len(cells) == 2 * (8 * 7 + 2)  # 7 cases everywhere, additive in 2 groups
    window = next(c.case for c in cells if c.case.name == "window")
    assert window.window == (128, 128) and window.baseline == "causal_window"


def test_too_slow_skips_at_the_longer_length_only_what_was_slow_at_the_shorter():
    case = speed_cases()[0]
    seen = {(64, 4096, "fwd", "full", "cudnn"): 1.0, (64, 4096, "fwd", "full", "blockwise"): 30.0}
    seen[64, 4096, "fwd", "full", "pallas"] = 2.0
    cell = gpu_check.SpeedCell(64, 16384, "fwd", case, "blockwise")
    assert "30x the fastest at T=4096" in gpu_check._too_slow(cell, seen, 10.0)
    assert gpu_check._too_slow(dataclasses.replace(cell, contender="pallas"), seen, 10.0) is None
    assert gpu_check._too_slow(dataclasses.replace(cell, direction="fwd+bwd"), seen, 10.0) is None
    assert gpu_check._too_slow(cell, seen, 40.0) is None


def test_ratios_against_cudnn_baseline_and_flex_in_the_same_run():
    def row(case, impl, ms, T=4096, direction="fwd"):
        return dict(case=case, implementation=impl, ms=ms, H=64, T=T, N=16, direction=direction, status="ok",
                    tflops=1.0)  # fmt: skip

    rows = [
        row("causal_window", "cudnn", 0.5),
        row("window", "pallas", 1.0),
        row("window", "flex", 1.5),
        row("full", "cudnn", 2.0),
        row("documents", "pallas", 0.5),
        row("documents", "flex", 0.4, T=16384),  # another length: not pallas' 4K reference
        dict(case="full", implementation="sdpa", status="unsupported", reason="x"),
    ]
    gpu_check.add_ratios(rows, speed_cases())
    assert rows[1]["vs_cudnn"] == 0.5 and rows[1]["vs_flex"] == 1.5  # window against cuDNN's causal window
    assert rows[0]["vs_cudnn"] == 1.0 and rows[2]["vs_flex"] == 1.0
    assert rows[4]["vs_cudnn"] == 4.0 and rows[4]["vs_flex"] is None  # documents against cuDNN's full attention
    assert "vs_cudnn" not in rows[6]
    worker_row = row("full", "flex", 2.0) | {"N": 16}
    del worker_row["tflops"]
    gpu_check.add_ratios([worker_row], speed_cases())
    # 16 heads, H = 64, 4096^2 pairs: 4 N H pairs FLOPs in 2 ms
    assert worker_row["tflops"] == pytest.approx(float(f"{4 * 16 * 64 * 4096**2 / 2 / 1e9:.3g}"))


def test_corr_cases_shrink_the_additive_cells_to_a_dense_reference_that_fits():
    sz = gpu_check.FULL
    cases = correctness.corr_cases(sz)
    B, T, N, _ = sz.corr_shape
    add = next(c for c in cases if c.score == "additive")
    assert add.T < T and add.T % 8 == 0
    assert B * N * add.T**2 * max(sz.corr_heads) * 4 <= sz.dense_ref_bytes < B * N * (add.T + 8) ** 2 * 128 * 4
    assert all(c.T == T for c in cases if c.score != "additive")
    graph = next(c for c in cases if c.mask == "graph_1pct")
    dense, edges = (f(None) for f in graph.forms)
    np.testing.assert_array_equal(dense.dense(T, T), edges.dense(T, T))  # two forms of one mask
    pad = next(c for c in cases if c.mask == "traced_padding")
    assert pad.lengths[1][1] == 0  # batch 1 has no keys: every row of it empty


def test_a_wrong_or_failing_implementation_is_a_fail_or_error_row_and_the_others_go_on(monkeypatch):
    """One broken kernel must not hide the others: its cells are FAIL / error rows, the rest still pass."""
    real = attnlab.attention

    def broken(q, k, v, *, implementation=None, mask=None, **kw):
        if implementation == "xla" and mask is None:
            raise RuntimeError("out of resources")
        out = real(q, k, v, implementation=implementation, mask=mask, **kw)
        return out + 0.1 if implementation == "xla" else out  # a wrong kernel

    monkeypatch.setattr(attnlab, "attention", broken)
    sz = dataclasses.replace(gpu_check.SMOKE, corr_scores=())
    rec = harness.Recorder("correctness", 10.0)
    correctness.check_all(sz, ["xla", "blockwise"], rec, harness.DeviceLock(None), workers=1)
    by = {(r["implementation"], r["mask"]): r for r in rec.rows}
    assert by["xla", "full"]["status"] == "error" and "out of resources" in by["xla", "full"]["reason"]
    wrong = [r for (i, m), r in by.items() if i == "xla" and m != "full"]
    assert wrong and all(r["status"] == "FAIL" and r["out_tol_ratio"] > 1 for r in wrong)
    assert all(r["status"] == "ok" for (i, _), r in by.items() if i == "blockwise")


def test_side_files_sit_beside_the_result():
    ctx = gpu_check.Context(gpu_check.SMOKE, gpu_check.Options(), {}, None, harness.DeviceLock(None), 1e18)
    assert ctx.side_file("autotune.json") is None
    ctx.out = "/tmp/x/gpu_check.json"
    assert ctx.side_file("autotune.json") == "/tmp/x/autotune.json"


def test_minutes_flag():
    assert dict(gpu_check._minutes(["speed=3"]))["speed"] == 3.0
    assert dict(gpu_check._minutes([]))["correctness"] == dict(gpu_check.Options.minutes)["correctness"]
    with pytest.raises(ValueError, match="section=minutes"):
        gpu_check._minutes(["warp=1"])


def test_default_run_fits_the_device_lease():
    """The default sections' budgets (plus start-up) fit the ~6 minutes a device command is sized for."""
    opts = gpu_check.Options()
    assert sum(opts.budget(s) for s in gpu_check.DEFAULT_SECTIONS) <= 5.5


def test_fwd_bwd_cells_take_the_gradient_for_a_fixed_normal_cotangent():
    """A forward+backward cell's gradients are the reference's vjp of ``harness.cotangent`` (passed as its
    last argument), not of ones; the torch rows use a cotangent of their own, fixed too."""
    case = {c.name: c for c in speed_cases(window=3, docs=3)}["documents"]
    fn, args = contenders.build("xla", case, 32, 2, 8, "fwd+bwd")
    q, k, v, ids, ct = args
    assert ct is harness.cotangent(q.shape, q.dtype) and float(jnp.std(ct.astype(jnp.float32))) > 0.5
    mask = contenders.attnlab_mask(case, ids)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, pull = jax.vjp(lambda q, k, v: attnlab.attention_reference(q, k, v, mask=mask), *f32)
    for got, want in zip(jax.jit(fn)(*args), pull(ct.astype(jnp.float32)), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=5e-2)
    torch = pytest.importorskip("torch")
    like = torch.zeros((1, 2, 32, 8), dtype=torch.bfloat16)
    a, b = torch_peers._cotangent(torch, like), torch_peers._cotangent(torch, like)
    assert torch.equal(a, b) and a.dtype == torch.bfloat16 and float(a.float().std()) > 0.5


def test_cudnn_and_tokamax_say_why_not_or_compute_the_case():
    cases = {c.name: c for c in speed_cases(window=3, docs=3)}
    with pytest.raises(UnsupportedError, match="GPU"):
        contenders.build("cudnn", cases["full"], 32, 2, 8, "fwd")
    with pytest.raises(UnsupportedError, match="no additive|tokamax not importable"):
        contenders.build("tokamax", cases["additive"], 32, 2, 8, "fwd")
    for name in ("window", "causal_window", "documents", "softcap"):
        case = cases[name]
        try:
            fn, args = contenders.build("tokamax", case, 32, 2, 8, "fwd")
        except UnsupportedError as e:
            assert "tokamax not importable" in str(e)
            continue
        # tokamax installed: its form of the case computes attnlab's reference
        ids = jnp.asarray(case.ids(32)) if case.mask == "documents" else None
        mask, score = contenders.attnlab_mask(case, ids), contenders.attnlab_score(case, 2, 8)
        ref = attnlab.attention_reference(*(x.astype(jnp.float32) for x in args[:3]), mask=mask, score=score)
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(*args), np.float32), np.asarray(ref), atol=3e-2, err_msg=name)


@pytest.mark.parametrize(
    "case",
    [
        Case("causal", "causal"),
        Case("w", "window", (3, 1)),
        Case("d", "documents", docs=3),
        Case("s", score="softcap", cap=2.0),
        Case("a", score="alibi"),
    ],  # fmt: skip
    ids=lambda c: c.name,
)
def test_torch_dense_reference_is_attnlabs_case(case):
    """The peers are checked against ``dense_reference``: it computes what attnlab computes for the same case."""
    torch = pytest.importorskip("torch")
    T, N, H = 16, 4, 8
    q, k, v = (np.random.default_rng(i).normal(size=(1, T, N, H)).astype(np.float32) for i in range(3))
    tq, tk, tv = (torch.from_numpy(x.transpose(0, 2, 1, 3).copy()) for x in (q, k, v))  # [B, N, T, H]
    got = torch_peers.dense_reference(torch, case, tq, tk, tv).numpy().transpose(0, 2, 1, 3)
    ids = jnp.asarray(case.ids(T)) if case.mask == "documents" else None
    mask, score = contenders.attnlab_mask(case, ids), contenders.attnlab_score(case, N, H)
    want = attnlab.attention_reference(q, k, v, mask=mask, score=score)
    np.testing.assert_allclose(got, np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_command_line_times_torch_peers_in_workers(tmp_path):
    """The script entry point with torch's CPU build: flex and SDPA in a worker, ratios, table, JSON and JSONL."""
    pytest.importorskip("torch")
    out = tmp_path / "g.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--sections=speed", f"--out={out}",
           "--contenders=flex,sdpa,blockwise", "--cases=documents,softcap", "--speed_lengths=64", "--repeats=2",
           "--torch_jobs=1", "--compile_workers=1"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "## speed" in proc.stdout and "| documents | 64 |" in proc.stdout
    result = json.loads(out.read_text())
    rows = {(r["case"], r["direction"], r["implementation"]): r for r in result["speed"]}
    assert len(rows) == len(result["speed"]) == 2 * 2 * 3
    for case in ("documents", "softcap"):
        flex = rows[case, "fwd", "flex"]
        assert flex["status"] == "ok", flex.get("reason")  # what went wrong
        assert flex["matches_dense"] and flex["max_abs_err"] < 3e-2 and flex["tflops"] > 0
        assert rows[case, "fwd+bwd", "flex"]["status"] == "unsupported"  # torch has no flex backward on a CPU
        mine = rows[case, "fwd", "blockwise"]
        assert mine["vs_flex"] == pytest.approx(flex["ms"] / mine["ms"], rel=1e-2)
    assert rows["documents", "fwd", "flex"]["block_mask_s"] >= 0 and rows["documents", "fwd", "sdpa"]["status"] == "ok"
    assert "no score_mod" in rows["softcap", "fwd", "sdpa"]["reason"]
    jsonl = [json.loads(line) for line in (tmp_path / "g.torch.jsonl").read_text().splitlines()]
    assert {(r["case"], r["direction"], r["implementation"]) for r in jsonl} == {k for k in rows if k[2] != "blockwise"}


def test_torch_worker_skips_what_it_cannot_time_before_its_deadline(tmp_path):
    pytest.importorskip("torch")
    case = speed_cases()[0]
    cells = [torch_peers.Cell(peer, case, 32, 2, 8, "fwd") for peer in ("flex", "sdpa")]
    out = tmp_path / "rows.jsonl"
    lock = harness.DeviceLock(tmp_path / "lock")
    torch_peers.run_cells(cells, out=out, lock=lock, deadline=0.0, repeats=1, max_cell_s=1.0, check_len=0, device="cpu")
    rows = torch_peers.collect(out)
    assert [(r["implementation"], r["status"], r["reason"]) for r in rows] == [
        ("flex", "skipped", "time budget"),
        ("sdpa", "skipped", "time budget"),
    ]
    out.write_text(out.read_text() + '{"cut short')  # a worker killed mid-line: the line is skipped
    assert len(torch_peers.collect(out)) == 2


@pytest.mark.slow
def test_correctness_checks_the_mosaic_forward_with_its_own_backward_too():
    """With "mosaic" among the contenders the correctness section also runs "mosaic+mosaic_bwd" (the Mosaic
    backward kernels, which the default configuration leaves to Triton): at H = 64 in the GPU interpreter here,
    equal to the reference; at the smoke's H = 8 both say why not."""
    opts = gpu_check.Options(contenders=("mosaic",), repeats=1, minutes=tuple((s, 10.0) for s in gpu_check.SECTIONS))
    sizes = {"corr_heads": (8, 64), "corr_shape": (1, 40, 2, 1), "corr_dtypes": ("bfloat16",), "corr_scores": ()}
    sizes["corr_masks"] = ("causal",)  # the other masks' Mosaic cells: test_mosaic
    result = gpu_check.run(smoke=True, sections=("correctness",), out=None, opts=opts, sizes=sizes)
    rows = result["correctness"]
    assert {r["mask"] for r in rows} == {"causal"}  # corr_masks keeps only the cases it names
    by = {(r["implementation"], r["H"]): r for r in rows}
    assert {i for i, _ in by} == {"mosaic", "mosaic+mosaic_bwd"}
    assert all(by[i, 8]["status"] == "unsupported" for i in ("mosaic", "mosaic+mosaic_bwd"))
    assert by["mosaic+mosaic_bwd", 64]["status"] == "ok", by["mosaic+mosaic_bwd", 64]
