"""The benchmark harness's timing protocol (benchmarks/bench_attention.py)."""

import time

from benchmarks import bench_attention


def test_side_by_side_times_the_second_of_each_pair():
    calls = {"a": 0, "b": 0}

    def make(name):
        def fn():
            calls[name] += 1
            # call 1 is the warm-up; then each round makes an untimed (even) and a timed (odd) call
            time.sleep(0.03 if calls[name] % 2 == 0 else 0.002)

        return fn

    out = bench_attention._time_side_by_side({"a": make("a"), "b": make("b")}, repeats=3)
    assert calls == {"a": 7, "b": 7}  # 1 warm-up + 3 rounds x (untimed + timed)
    for name in ("a", "b"):
        best_ms, first_ms = out[name]
        assert 2.0 <= best_ms < 15.0, out  # the 30 ms untimed calls are never the ones timed
        assert first_ms >= 2.0
