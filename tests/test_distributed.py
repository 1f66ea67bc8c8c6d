"""attnlab.parallel across two processes: ``jax.distributed.initialize`` on loopback, CPU.

Two interpreters (``tests/distributed_worker.py``), each with 2 CPU devices, join one JAX
cluster on 127.0.0.1 (process 0 hosts the coordinator on a free port; the CPU collectives go
over gloo). The ring (contiguous and zig-zag) runs over the 4 devices, so its key/value shards
and gradient accumulators cross the process boundary at every step, and head parallelism runs
over the 4 devices too. Each process gathers outputs and gradients and compares them with
``attention_reference``; this test judges the numbers with the suite's tolerances. The processes
run with a timeout and are killed if either fails or hangs (a dead peer leaves the other
blocked in a collective).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest
from conftest import CHEAP_COMPILE_FLAGS, grad_tol, tol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "distributed_worker.py")
PROCESSES = 2
TIMEOUT_S = 600
CASES = [
    "ring-contiguous-sp4-T24-causal&padding",
    "ring-zigzag-sp4-T24-causal&padding",
    "ring-contiguous-sp4-T24-full",
    "ring-zigzag-sp4-T21-causal-replicated",
    "heads4-T19-causal",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_cluster(logdir) -> list[dict]:
    env = dict(os.environ)
    # no forced device count (the worker asks for 2 per process); fast compiles: correctness only
    env["XLA_FLAGS"] = " ".join(CHEAP_COMPILE_FLAGS)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    port = _free_port()
    logs = [(logdir / f"p{i}.out", logdir / f"p{i}.err") for i in range(PROCESSES)]
    procs = []
    for i, (out, err) in enumerate(logs):
        with open(out, "w") as fo, open(err, "w") as fe:  # files, not pipes: no pipe can fill and block
            cmd = [sys.executable, WORKER, str(i), str(PROCESSES), str(port)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fo, stderr=fe))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        # Wait for all; stop early when one fails (its peer would wait for it in a collective).
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = [f"--- process {i} (rc {procs[i].returncode}):\n{logs[i][1].read_text()[-4000:]}" for i in failed]
        report = "\n".join(tails)
        pytest.fail(f"distributed worker(s) {failed} failed, or were killed after {TIMEOUT_S} s:\n{report}")
    return [json.loads(out.read_text().strip().splitlines()[-1]) for out, _ in logs]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return _run_cluster(tmp_path_factory.mktemp("distributed"))


@pytest.mark.slow
def test_two_processes_form_one_cluster(cluster):
    assert [r["process_index"] for r in cluster] == list(range(PROCESSES))
    for r in cluster:
        assert r["process_count"] == PROCESSES
        assert r["local_devices"] == 2 and r["devices"] == 2 * PROCESSES
        assert r["mesh_processes"] == list(range(PROCESSES))  # the mesh spans both processes
        assert sorted(r["results"]) == sorted(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_output_and_grads_match_reference(cluster, case):
    t, gt = tol(jnp.float32), grad_tol(jnp.float32)
    for proc in cluster:  # each process checked the gathered global result itself
        r = proc["results"][case]
        assert r["finite"], r
        # |x - ref| <= atol + rtol * max|ref|, per array
        assert r["out_err"] <= t["atol"] + t["rtol"] * r["out_ref"], r
        for err, ref in zip(r["grad_err"], r["grad_ref"], strict=True):
            assert ref > 0  # the gradient reaches every input
            assert err <= gt["atol"] + gt["rtol"] * ref, r
