"""benchmarks.harness: the timing protocol, the run record, result files, tolerances, FLOPs, tables, the lock."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import masks, testing
from benchmarks import harness
from experiments import common


def _sleeper(first: float, rest: float):
    calls = {"n": 0}

    def run():
        calls["n"] += 1
        time.sleep(first if calls["n"] == 1 else rest)

    return run, calls


def test_time_call_times_the_first_call_apart_and_then_repeats():
    run, calls = _sleeper(0.05, 0.002)
    t = harness.time_call(run, repeats=4, warmup=2)
    assert calls["n"] == 2 + 4 and t.runs == 4
    assert t.first_s >= 0.05 and 0.002 <= t.best_s <= t.median_s < 0.04
    rec = t.record()
    assert rec["ms"] == round(1e3 * t.best_s, 3) and rec["runs"] == 4 and rec["first_call_s"] >= 0.05


def test_time_call_spends_at_most_max_s_on_the_timed_calls():
    run, calls = _sleeper(0.2, 0.01)
    # the first call (~0.2 s, the guess) says two fit in 0.5 s: whatever the load adds to a 0.2 s sleep
    # up to 0.05 s, int(0.5 / first) stays 2
    t = harness.time_call(run, repeats=10, max_s=0.5)
    assert t.runs == 2 and calls["n"] == 3
    run, calls = _sleeper(0.5, 0.001)
    assert harness.time_call(run, repeats=10, max_s=0.1).runs == 1  # never fewer than one


def test_interleaved_settles_and_times_the_second_of_each_pair():
    calls = {"a": 0, "b": 0}
    order = []

    def make(name):
        def fn():
            calls[name] += 1
            order.append(name)
            # call 1 is the first call; then each round makes an untimed (even) and a timed (odd) call
            time.sleep(0.03 if calls[name] % 2 == 0 else 0.002)

        return fn

    lines = []
    out = harness.interleaved({"a": make("a"), "b": make("b")}, rounds=3, settle=True, progress=lines.append)
    assert calls == {"a": 7, "b": 7}  # 1 first call + 3 rounds x (untimed + timed)
    assert order[:4] == ["a", "b", "a", "a"]  # first calls, then a's settle and timed call in round 1
    assert len(lines) == 2 + 3 * 2 and lines[-1] == "round 3/3: b"
    for name in ("a", "b"):
        assert out[name].runs == 3 and 0.002 <= out[name].best_s < 0.015  # the 30 ms untimed calls are never timed
        assert out[name].first_s >= 0.002


def test_interleaved_rotate_starts_each_round_with_the_next_contender():
    order = []
    runs = {name: (lambda name=name: order.append(name)) for name in "abc"}
    out = harness.interleaved(runs, rounds=4, repeats=2, rotate=True)
    assert order[:3] == ["a", "b", "c"]  # the first calls, in order
    rounds = ["".join(order[3 + 6 * r : 9 + 6 * r : 2]) for r in range(4)]  # each contender's 2 calls in a row
    assert rounds == ["abc", "bca", "cab", "abc"]
    assert all(out[n].runs == 8 for n in "abc")


def test_blocking_and_best_of_wait_for_jax():
    f = jax.jit(lambda x: (x @ x).sum())
    x = jnp.ones((64, 64))
    assert float(harness.blocking(f, x)()) == 64.0**3
    assert harness.best_of(f, (x,), 2) > 0


def test_op_profile_names_the_compiled_programs_ops_and_counts_loop_steps():
    """A 7-step loop over a matmul and an exponential: each op of the compiled HLO, counted per step."""

    def f(x):
        return jax.lax.fori_loop(0, 7, lambda i, y: jnp.exp(y @ x * 1e-3), x)

    fn = jax.jit(f)
    x = jnp.ones((256, 256), jnp.float32)
    hlo = fn.lower(x).compile().as_text()
    prof = harness.op_profile(fn, x)
    assert prof["wall_ms"] > 0 and prof["ops"]
    names = [o["op"] for o in prof["ops"]]
    assert all(f"%{n} = " in hlo for n in names), names  # instructions of the compiled program
    assert not any(n.startswith("while") for n in names)  # the loop's time is its body's: not counted twice
    in_loop = {o["op"]: o["ms"] for o in prof["ops"] if o["calls"] == 7}  # the body's ops, once per iteration
    assert all(ms >= 0 for ms in in_loop.values())  # (the loop counter's add can take less than the 0.01 ms shown)
    work = [ms for n, ms in in_loop.items() if n.startswith(("ynn_fusion", "dot")) or "exponential" in n]
    assert work and all(ms > 0 for ms in work), in_loop  # the matmul and the exponential took time
    assert [o["ms"] for o in prof["ops"]] == sorted((o["ms"] for o in prof["ops"]), reverse=True)


def test_profile_ops_sorts_ops_by_kind():
    from benchmarks import profile_ops

    small = profile_ops.profile(256, 2, 16, 8, "fwd+bwd", "blockwise", top=1000)  # every op kept
    assert small["call"]["T"] == 256 and small["kinds_ms"]["matmul"] > 0
    assert sum(small["kinds_ms"].values()) == pytest.approx(sum(o["ms"] for o in small["ops"]), abs=0.05)

    assert [profile_ops.kind(n) for n in ("ynn_fusion.3", "dot_general.26", "wrapped_dynamic-slice.1")] == [
        "matmul", "matmul", "dynamic-slice",
    ]  # fmt: skip
    assert profile_ops.kind("add_dynamic-update-slice_fusion") == "dynamic-update-slice"
    assert profile_ops.kind("copy_bitcast_fusion.1") == "copy" and profile_ops.kind("multiply_exponential_fusion") == (
        "elementwise"
    )


def test_profile_ops_measures_the_same_call_again_with_pages_kept():
    """The child process times the call the flags name (XLA's buffer sizes equal this process's) under the
    C library settings it records."""
    from benchmarks import profile_ops

    call = (128, 2, 16, 8, "fwd+bwd", "blockwise")
    kept = profile_ops.costs_pages_kept(*call)
    fn, args = profile_ops.program(*call)
    here = harness.call_costs(fn, *args)
    assert {k: kept[k] for k in ("temp_mib", "output_mib", "argument_mib")} == {
        k: here[k] for k in ("temp_mib", "output_mib", "argument_mib")
    }
    assert kept["wall_ms"] > 0 and here["argument_mib"] == pytest.approx(
        4 * 128 * 2 * 16 * 4 / 2**20, abs=0.05
    )  # q, k, v, cotangent
    assert kept["env"] == profile_ops.KEEP_PAGES_ENV and os.environ.get("MALLOC_ARENA_MAX") != "1"


def test_call_costs_reports_the_programs_buffers_and_the_hosts_time_per_call():
    """A 4 MiB argument and a 4 MiB output, as XLA's memory analysis and the array sizes say."""
    import resource

    x = jnp.ones((1024, 1024), jnp.float32)
    costs = harness.call_costs(jax.jit(lambda x: x * 2.0 + 1.0), x, repeats=2)
    assert costs["argument_mib"] == 4.0 and costs["output_mib"] == 4.0
    assert costs["temp_mib"] >= 0 and costs["wall_ms"] > 0 and costs["user_ms"] >= 0 and costs["sys_ms"] >= 0
    assert costs["fault_mib"] == pytest.approx(costs["minor_faults"] * resource.getpagesize() / 2**20, abs=0.1)


def test_max_abs_diff_over_pytrees_in_fp32():
    a = {"x": jnp.array([1.0, 2.0], jnp.bfloat16), "y": jnp.zeros((2, 2))}
    b = {"x": jnp.array([1.0, 2.5], jnp.bfloat16), "y": jnp.full((2, 2), -0.25)}
    assert harness.max_abs_diff(a, b) == 0.5
    with pytest.raises(ValueError):  # different structures are an error, not a partial answer
        harness.max_abs_diff([jnp.zeros(2)], [jnp.zeros(2), jnp.zeros(2)])


def test_compile_all_compiles_in_threads_and_returns_errors_per_job():
    good = (lambda x: x * 2, (jnp.arange(3.0),))

    def bad(x):
        raise ValueError("no such program")

    out = harness.compile_all([good, (bad, (jnp.ones(2),)), good], workers=2)
    assert len(out) == 3 and all(s >= 0 for _, s in out)
    np.testing.assert_array_equal(out[0][0](jnp.arange(3.0)), [0.0, 2.0, 4.0])
    assert isinstance(out[1][0], ValueError) and "no such program" in str(out[1][0])
    assert out[2][0] is not out[0][0]  # each job its own compiled program
    serial = harness.compile_all([good], workers=1)
    np.testing.assert_array_equal(serial[0][0](jnp.arange(3.0)), [0.0, 2.0, 4.0])


def test_run_record_says_where_and_when_it_ran(monkeypatch):
    rec = harness.run_record(command="python -m benchmarks.x --y")
    host = rec["host"]
    assert host["cpu_model"] and host["hostname"] and len(host["load_avg"]) == 3 and host["host_cpus"] >= 1
    assert "avx2" in host["cpu_simd_flags"] or not any(f.startswith("avx") for f in host["cpu_simd_flags"])
    assert rec["jax"] == jax.__version__ and rec["command"] == "python -m benchmarks.x --y"
    assert rec["backend"] == jax.default_backend() and rec["device_kind"] == jax.devices()[0].device_kind
    assert rec["date"] == time.strftime("%Y-%m-%d") and rec["started"].startswith(rec["date"])
    assert "torch" in rec  # its version, or None where not installed
    assert "backend" not in harness.run_record(devices=False)
    run = harness.Run(command="c", devices=False)
    done = run.finish()
    assert done["wall_s"] >= 0 and done["cpu_s"] >= 0 and len(done["load_avg_end"]) == 3 and done["command"] == "c"


def test_write_json_is_atomic_and_recorder_rewrites_after_every_row(tmp_path, capsys):
    out = tmp_path / "sub" / "r.json"
    result = {"meta": {"x": 1}}
    rec = harness.Recorder("speed", 1.0, result, str(out))
    rec.add({"status": "ok", "ms": 1.5})
    assert json.loads(out.read_text())["speed"] == [{"status": "ok", "ms": 1.5}]
    rec.add({"status": "unsupported", "reason": "long story"})
    rec.error({"implementation": "x"}, RuntimeError("out of resources"))
    rows = json.loads(out.read_text())["speed"]
    assert rows[-1] == {"implementation": "x", "status": "error", "reason": "RuntimeError: out of resources"}
    printed = capsys.readouterr().out
    assert printed.count("[speed") == 3 and "long story" not in printed  # an unsupported row's reason is not echoed
    assert not list(out.parent.glob("*.tmp"))
    assert rec.left() and not harness.Recorder("x", 0.0).left()
    assert not harness.Recorder("x", 10.0, deadline=time.time() - 1).left()  # the run's own deadline


def test_compare_uses_the_one_tolerance_table():
    e = np.ones((4, 4), np.float32)
    tol = testing.tolerance("bfloat16", backend="cpu")  # atol = rtol = 3e-2: |a - e| <= 0.06 passes at e = 1
    a = e.copy()
    a[0, 0] = 1.0 + 1.5 * (tol["atol"] + tol["rtol"])
    r = harness.compare(a, e, "bfloat16", backend="cpu")
    assert not r["ok"] and r["tol_ratio"] == pytest.approx(1.5, rel=1e-5) and r["rel_err"] == pytest.approx(0.09)
    a[0, 0] = 1.0 + 0.5 * (tol["atol"] + tol["rtol"])
    assert harness.compare(a, e, "bfloat16", backend="cpu")["ok"]
    assert not harness.compare(a, e, "float32", backend="cpu")["ok"]  # fp32 is tight
    assert harness.compare(a, e, "float32", "grad", backend="gpu")["ok"] is False  # 1e-2 for fp32 gradients on a GPU
    a[1, 1] = np.nan
    assert not harness.compare(a, e, "bfloat16", backend="cpu")["ok"]  # NaN never passes


def test_useful_flops_by_hand():
    # 4 pairs, 2 heads, H = 8: forward 4 N H = 64 per pair -> 256; fwd+bwd 3.5x; additive 5 N H per pair, 3x
    assert harness.useful_flops(4, 2, 8, "fwd") == 256
    assert harness.useful_flops(4, 2, 8, "fwd+bwd") == 896
    assert harness.useful_flops(4, 2, 8, "fwd", "additive") == 320
    assert harness.useful_flops(4, 2, 8, "fwd+bwd", "additive") == 960
    assert harness.useful_flops(4, 2, 8, "fwd", "softcap") == 256
    with pytest.raises(ValueError, match="direction"):
        harness.useful_flops(4, 2, 8, "bwd")


def test_allowed_pairs_by_hand():
    # T = 4: full 16, causal 4 + 3 + 2 + 1 = 10, window(1, 0): 1 + 2 + 2 + 2 = 7, window(1, 1): 2 + 3 + 3 + 2 = 10
    assert harness.allowed_pairs(None, 4) == 16
    assert harness.allowed_pairs(masks.causal(), 4) == 10
    assert harness.allowed_pairs(masks.window(1, 0), 4) == 7
    assert harness.allowed_pairs(masks.window(1, 1), 4) == 10
    assert harness.allowed_pairs(masks.document(np.array([[0, 0, 1, 1, 1]])), 5) == 4 + 9  # documents of 2 and 3
    assert harness.allowed_pairs(None, 3, 5) == 15


def test_tables_are_the_experiments_writer():
    assert harness.markdown_table(["a", "b"], [[1, 2]]) == common.markdown_table(["a", "b"], [[1, 2]])
    rows = [{"a": 1, "b": None, "c": 0.123456}, {"a": 2, "b": None, "c": 12345.0}, {"a": 3, "c": 1234.5}]
    assert harness.rows_table("t", rows, ["a", "b", "c"]) == "## t\n" + common.markdown_table(
        ["a", "c"], [["1", "0.123"], ["2", "12,345"], ["3", "1,234"]]
    )  # a column with no value is left out


def _try(path, mode) -> bool:
    """Whether another holder could take ``path`` in ``mode`` now (flock: per open file, so also in-process)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_device_lock_shares_compiles_and_times_alone(tmp_path):
    path = str(tmp_path / "lock")
    lock = harness.DeviceLock(path)
    with lock.compiling():
        assert _try(path, fcntl.LOCK_SH) and not _try(path, fcntl.LOCK_EX)  # compiles share, a timing waits
    with lock.exclusive():
        assert not _try(path, fcntl.LOCK_SH) and not _try(path, fcntl.LOCK_EX)  # alone
    assert _try(path, fcntl.LOCK_EX)  # released
    with harness.DeviceLock(None).exclusive(), harness.DeviceLock(None).compiling():  # no path: no lock
        pass


def test_a_waiting_timing_holds_the_turnstile_so_compiles_cannot_starve_it(tmp_path):
    path = str(tmp_path / "lock")
    lock = harness.DeviceLock(path)
    got = threading.Event()

    def timer():
        with lock.exclusive():
            got.set()

    with lock.compiling():
        t = threading.Thread(target=timer)
        t.start()
        deadline = time.time() + 10
        while _try(path + ".turnstile", fcntl.LOCK_EX) and time.time() < deadline:
            time.sleep(0.01)  # until the timer waits, holding the turnstile
        assert not _try(path + ".turnstile", fcntl.LOCK_EX)  # a new compile would queue behind it
        assert not got.is_set()  # the timer waits for the compile to end
    t.join(10)
    assert got.is_set()


def test_host_devices_auto_is_the_largest_divisor_of_heads_within_the_cores():
    pick = harness.host_devices
    assert pick(-1, cpus=2, heads=8) == 2
    assert pick(-1, cpus=16, heads=8) == 8
    assert pick(-1, cpus=6, heads=8) == 4  # 5 and 6 do not divide 8
    assert pick(-1, cpus=4, heads=6) == 3
    assert pick(-1, cpus=1, heads=8) == 1
    assert pick(0, cpus=2, heads=8) == 1 and pick(1, cpus=2, heads=8) == 1
    assert pick(4, cpus=2, heads=8) == 4  # explicit: taken as given (more devices than cores is allowed)


def test_profile_ops_program_takes_the_gradients_for_the_benchmarks_cotangent():
    """fwd+bwd profiles the gradients for ``harness.cotangent`` (not ones, which XLA simplifies), as the
    other benchmarks' forward+backward rows do: checked against the reference's vjp."""
    import jax
    import jax.numpy as jnp

    import attnlab
    from attnlab import masks
    from benchmarks import profile_ops

    fn, (q, k, v, ct) = profile_ops.program(128, 2, 16, 8, "fwd+bwd", "blockwise")
    assert bool(jnp.array_equal(ct, harness.cotangent(q.shape, q.dtype))) and float(jnp.std(ct)) > 0.5
    ref = lambda q, k, v: attnlab.attention(q, k, v, mask=masks.window(8, 8), implementation="reference")  # noqa: E731
    want = jax.vjp(ref, q, k, v)[1](ct)
    for got, w in zip(fn(q, k, v, ct), want, strict=True):
        assert float(jnp.max(jnp.abs(got - w))) < 1e-4 * float(jnp.max(jnp.abs(w)))
    fwd, args = profile_ops.program(128, 2, 16, 8, "fwd", "blockwise")
    assert len(args) == 3 and float(jnp.max(jnp.abs(fwd(*args) - ref(*args)))) < 1e-5


def test_with_direction_is_the_vjp_for_the_fixed_normal_cotangent():
    """``harness.with_direction``: the forward as given, or the gradients of q, k and v for
    ``harness.cotangent`` (normal, fixed, passed last), equal to ``jax.vjp``'s; anything else is refused."""
    import attnlab

    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(kk, (1, 32, 2, 8)) for kk in keys)
    ref = lambda q, k, v, m: attnlab.attention_reference(q, k, v, mask=m)  # noqa: E731
    fwd, args = harness.with_direction(ref, "fwd", (q, k, v, masks.causal()))
    assert fwd is ref and len(args) == 4
    fn, args = harness.with_direction(ref, "fwd+bwd", (q, k, v, masks.causal()))
    ct = args[-1]
    assert len(args) == 5 and ct is harness.cotangent(q.shape, q.dtype) and float(jnp.std(ct)) > 0.5
    want = jax.vjp(lambda q, k, v: ref(q, k, v, masks.causal()), q, k, v)[1](ct)
    for got, w in zip(jax.jit(fn, static_argnums=3)(*args), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="direction must be one of"):
        harness.with_direction(ref, "bwd", (q, k, v))


@pytest.mark.parametrize("bench", ["adopt", "crossover", "scores", "traced_padding"])
def test_every_benchmarks_fwd_bwd_takes_the_fixed_cotangent(bench):
    """adopt, crossover, scores and traced_padding time forward+backward as ``harness.with_direction`` does
    (not the gradient of a sum or of a sum of squares): their programs' gradients equal the reference's vjp
    for ``harness.cotangent``."""
    import importlib

    import attnlab

    module = importlib.import_module(f"benchmarks.{bench}")
    keys = jax.random.split(jax.random.key(4), 3)
    q, k, v = (jax.random.normal(kk, (1, 64, 2, 16)) for kk in keys)
    mask = masks.causal()
    if bench == "adopt":
        fns, args = harness.directed({"j": module._fwd(jax.nn.dot_product_attention, {"is_causal": True})}, "fwd+bwd",
                                     (q, k, v, {}))  # fmt: skip
        fn = fns["j"]
    elif bench == "crossover":  # its cells build theirs with harness.directed, as adopt's
        assert "harness.directed(" in Path(module.__file__).read_text()
        fns, args = harness.directed({"b": lambda q, k, v: attnlab.attention(q, k, v, mask=mask)}, "fwd+bwd", (q, k, v))
        fn = fns["b"]
    elif bench == "scores":
        fn, args = module._fwd_bwd(lambda q, k, v: attnlab.kernels.blockwise_attention(q, k, v, mask=mask), (q, k, v))
    else:
        lengths = np.array([40], np.int32)
        mask = masks.bigbird(64, block_size=16) & masks.padding(kv_lengths=lengths)
        fn, args = module.programs(q, k, v, masks.bigbird(64, block_size=16), lengths)["fwd+bwd/traced"]
    assert args[-1] is harness.cotangent(q.shape, q.dtype)
    want = jax.vjp(lambda q, k, v: attnlab.attention_reference(q, k, v, mask=mask), q, k, v)[1](args[-1])
    for got, w in zip(fn(*args), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-5)


def test_sweep_measures_each_point_and_rewrites_the_file_after_each(tmp_path, capsys):
    """harness.sweep: one record per grid point, a progress line each, the file holding the run's record,
    the extra fields and the records so far."""
    import json

    from benchmarks import harness

    out = tmp_path / "s.json"
    seen = []

    def measure(a, b):
        if seen:  # the file already holds the earlier records
            assert [r["sum"] for r in json.loads(out.read_text())["records"]] == [sum(p) for p in seen]
        seen.append((a, b))
        return {"sum": a + b}

    records = harness.sweep([(1, 2), (3, 4)], measure, out, lambda a, b, rec: f"{a}+{b}={rec['sum']}", tag="x")
    assert records == [{"sum": 3}, {"sum": 7}]
    data = json.loads(out.read_text())
    assert data["records"] == records and data["tag"] == "x" and "wall_s" in data and "host" in data
    printed = capsys.readouterr().out
    assert "[1/2] 1+2=3" in printed and "[2/2] 3+4=7" in printed
