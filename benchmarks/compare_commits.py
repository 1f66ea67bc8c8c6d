r"""CPU before/after: the same attention calls timed on two commits of attnlab in one run.

A change to the dispatcher or a kernel must not slow the CPU paths down. This script checks out
``--base`` (default: the commit before the GPU/TPU work, 160a7db) into a temporary git worktree and
times a fixed set of ``attnlab.attention`` calls (the public API both commits have) from each tree
in its own subprocess, alternating base and head for ``--rounds`` rounds so that machine load hits
both alike; each cell reports the best time per tree and the ratio head / base (< 1: faster now).
A forward+backward cell takes the gradients of q, k and v for a fixed random output cotangent
(``--cotangent random``; ``ones``, the gradient of ``out.sum()``, lets XLA simplify the backward).

Command (what ``make compare-main`` runs; ~10 min on the shared 2-core CPU):

    python -m benchmarks.compare_commits --base 160a7db --out results/compare

Writes ``<out>/compare.json`` and prints a table.

With ``--same_process`` both trees' programs are timed in this one process, alternating per cell: each
tree's ``attnlab`` is copied as a package of its own name (``attnlab_base``, ``attnlab_head``; the word
``attnlab`` in its sources rewritten), so what differs between two processes (memory layout, thread
pools, the load in between) does not enter the ratio. It also reports each round's head / base ratio,
whose spread says how far the bests can be read:

    python -m benchmarks.compare_commits --base 04a795f --same_process --rounds 20 --cells "full 4096 fwd"

With ``--bench`` (a key of ``BENCHES``, e.g. ``flex``) it runs that benchmark program instead, each
tree's own copy of it on that tree's attnlab, alternating base and head the same way: the peer's
time is measured beside attnlab's in each run, so "the ratio against torch is no lower than before"
is a statement from one session on one host:

    python -m benchmarks.compare_commits --base 04a795f --bench flex --rounds 2 --out results/compare-flex

Writes ``<out>/compare_<bench>.json`` (each run's records, and per record the best of each field over
the rounds, per tree) and prints a table.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]

# name -> (mask spec, T, batch, heads, head dim, fwd+bwd?); implementation=None: each commit's own choice
CELLS = {
    "full 1024 fwd": ("full", 1024, 1, 8, 64, False),
    "full 1024 fwd+bwd": ("full", 1024, 1, 8, 64, True),
    "full 4096 fwd": ("full", 4096, 1, 8, 64, False),
    "full 2048 fwd+bwd": ("full", 2048, 1, 8, 64, True),
    "causal 2048 fwd": ("causal", 2048, 1, 8, 64, False),
    "causal 2048 fwd+bwd": ("causal", 2048, 1, 8, 64, True),
    "window±128 4096 fwd": ("window", 4096, 1, 8, 64, False),
    "window±128 4096 fwd+bwd": ("window", 4096, 1, 8, 64, True),
    "window±128 16384 fwd": ("window", 16384, 1, 8, 64, False),
    "window±128 16384 fwd+bwd": ("window", 16384, 1, 8, 64, True),
    "documents16 4096 fwd": ("documents", 4096, 1, 8, 64, False),
    "documents16 4096 fwd+bwd": ("documents", 4096, 1, 8, 64, True),
    "padding 128 x8 fwd": ("padding", 128, 8, 4, 32, False),
    "padding 128 x8 fwd+bwd": ("padding", 128, 8, 4, 32, True),
    "full 256 fwd": ("full", 256, 4, 8, 64, False),
    "graph 20000 nodes x10 edges fwd+bwd": ("graph", 20_000, 1, 8, 64, True),
    # a decoding step: one query row per sequence over T cached keys, the cache's lengths as a padding mask
    "decode 2048 x8 fwd": ("decode", 2048, 8, 8, 64, False),
    "decode 2048 x8 fwd+bwd": ("decode", 2048, 8, 8, 64, True),
    # masks known at trace time (closed over, not jit arguments): their tiles are classified while tracing
    "bigbird 16384 fwd": ("bigbird", 16384, 1, 8, 64, False),
    "documents16 known 16384 fwd": ("documents known", 16384, 1, 8, 64, False),
    "documents16 known & causal 16384 fwd": ("documents known & causal", 16384, 1, 8, 64, False),
    "documents16 known in any order 16384 fwd": ("documents known shuffled", 16384, 1, 8, 64, False),
    "documents16 known cross 16384 fwd": ("documents known cross", 16384, 1, 8, 64, False),
    "window_2d ±3 16384 (128x128) fwd": ("window_2d", 16384, 1, 8, 64, False),
}

# --bench: a benchmark program each tree runs with its own copy, its output file, the fields that
# name a record and the timed fields (seconds; best over rounds kept) and the peer / attnlab ratios
# formed from them.
BENCHES = {
    "flex": {
        "module": "benchmarks.flex",
        "file": "flex.json",
        "key": ("mask", "T"),
        "times": ("attnlab_s", "attnlab_devices_s", "flex_s"),
        "ratios": {
            "flex / attnlab": ("flex_s", "attnlab_s"),
            "flex / attnlab (host devices)": ("flex_s", "attnlab_devices_s"),
        },
    },
    # make scores' part 3 alone (scores on a graph's edges): the edge-list kernel against the blockwise one
    "scores-graph": {
        "module": "benchmarks.scores",
        "args": ("--seq_len=0", "--additive_seq_len=0"),
        "file": "scores.json",
        "records": "graph",
        "key": ("score", "mode"),
        "times": ("sparse_s", "blockwise_s"),
        "ratios": {"blockwise / sparse": ("blockwise_s", "sparse_s")},
    },
}


def define_flags():
    """Defines the command-line flags; only when run as a program (tests import this module beside others)."""
    global _BASE, _HEAD, _ROUNDS, _REPEATS, _CELLS, _OUT, _WORKER, _BENCH, _PROGRAM, _COTANGENT, _SAME_PROCESS, _MEASURE
    _BASE = flags.DEFINE_string("base", "160a7db", "The commit to compare against.")
    _HEAD = flags.DEFINE_string("head", ".", "The tree to compare ('.' = this working tree) or a commit.")
    _ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating rounds (each tree times every cell once per round).")
    _REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per cell per round (best kept).")
    _CELLS = flags.DEFINE_list("cells", list(CELLS), "Cells to time.")
    _OUT = flags.DEFINE_string("out", "results/compare", "Output folder for compare.json.")
    _WORKER = flags.DEFINE_string("worker", None, "Internal: time the cells with the attnlab on PYTHONPATH.")
    _BENCH = flags.DEFINE_enum("bench", None, list(BENCHES), "Run this benchmark program in each tree instead.")
    _PROGRAM = flags.DEFINE_enum(
        "program", "own", ["own", "head"],
        "--bench: each tree runs its own copy of the program (own), or both run the head tree's copy, each on its "
        "own attnlab (head: times what the base's copy lacks, e.g. a new cell, with the base's kernels).",
    )  # fmt: skip
    _COTANGENT = flags.DEFINE_enum(
        "cotangent", "random", ["random", "ones"],
        "fwd+bwd cells: the output's cotangent, a fixed normal array, or ones (the gradient of out.sum(), which "
        "lets XLA simplify the backward; the runs committed before 2026-12-06's fifth session used it).",
    )  # fmt: skip
    _MEASURE = flags.DEFINE_enum(
        "measure", "run", ["run", "trace"],
        "run: each cell's best time per call; trace: the seconds of its first trace (the dispatch and the planning: "
        "a known mask's tiles classified), nothing compiled or run. Not with --same_process (a trace is timed cold, "
        "in each tree's own fresh process).",
    )  # fmt: skip
    _SAME_PROCESS = flags.DEFINE_bool(
        "same_process", False,
        "Time both trees' programs in this process, alternating per cell (each tree's attnlab imported as a package "
        "of its own name), and report each round's ratio beside the bests.",
    )  # fmt: skip


def _cell(name: str, cotangent: str = "random", lib=None) -> tuple:
    """Cell ``name``'s jitted program and its arguments ``(f, (q, k, v, mask, ct))``: the forward, or the
    gradients of q, k and v for the output cotangent ``ct`` (``cotangent="random"``: a fixed normal array;
    ``"ones"``: None, the gradient of ``out.sum()``). ``lib``: the attnlab package to call (default: the one on
    the path; ``as_package`` gives another commit's under its own name).

    Self-contained on purpose (as ``_worker``): only attnlab's public API of either tree."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    attnlab = lib or importlib.import_module("attnlab")
    masks = importlib.import_module(f"{attnlab.__name__}.masks")

    kind, T, B, N, H, bwd = CELLS[name]
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32) for kk in ks)
    if kind == "decode":
        q = q[:, :1]
    lengths = jnp.asarray([T - 7 * i for i in range(B)], jnp.int32)
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, T), size=15, replace=False))
    if kind == "graph":  # T nodes, 10 * T random edges (unique), self loops: the sparse kernel
        flat = np.random.default_rng(0).choice(T * T, size=10 * T, replace=False)
        src, dst = np.concatenate([flat // T, np.arange(T)]), np.concatenate([flat % T, np.arange(T)])
    ids_np = np.repeat(np.arange(16), np.diff(np.concatenate([[0], cuts, [T]])))[None].astype(np.int32)
    ids = jnp.asarray(ids_np)
    enc_ids = np.sort(np.random.default_rng(2).integers(0, 16, T))[None].astype(np.int32)
    known = {
        "bigbird": lambda: masks.bigbird(T, block_size=64),
        "documents known": lambda: masks.document(ids_np),
        "documents known & causal": lambda: masks.document(ids_np) & masks.causal(),
        # the same documents numbered in no order (a packer that keeps each example's index as its id)
        "documents known shuffled": lambda: masks.document(np.random.default_rng(1).permutation(16)[ids_np]),
        # cross-attention: the keys pack the 16 documents at other lengths (an encoder's, say)
        "documents known cross": lambda: masks.document(ids_np, enc_ids),
        "window_2d": lambda: masks.window_2d(128, 3, 3),
    }
    ct = jax.random.normal(jax.random.key(1), q.shape, jnp.float32) if cotangent == "random" else None
    if kind in known:  # closed over: its tiles are classified while tracing
        fixed = known[kind]()
        assert not bwd, "the known-mask cells are forward cells"
        return jax.jit(lambda q, k, v, m, ct: attnlab.attention(q, k, v, mask=fixed)), (q, k, v, None, ct)
    mask = {
        "full": None,
        "causal": masks.causal(),
        "window": masks.window(128, 128),
        "padding": masks.padding(lengths, lengths),
        "decode": masks.padding(kv_lengths=lengths),
        "documents": masks.document(ids),  # 16 documents of random lengths, ids traced (a jit argument)
        "graph": masks.graph_edges(jnp.asarray(src), jnp.asarray(dst), T) if kind == "graph" else None,
    }[kind]
    if not bwd:
        return jax.jit(lambda q, k, v, m, ct: attnlab.attention(q, k, v, mask=m)), (q, k, v, mask, ct)

    def loss(q, k, v, m, ct):
        out = attnlab.attention(q, k, v, mask=m)
        return out.sum() if ct is None else jnp.vdot(out, ct)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v, mask, ct)


def _worker(cells: list[str], repeats: int, cotangent: str = "random", measure: str = "run") -> dict:
    """Best ms and compile seconds per cell (``_cell``), with the attnlab on PYTHONPATH (the other commit's tree);
    ``measure="trace"``: the seconds of each cell's first trace instead (``trace_s``), nothing compiled.

    Self-contained on purpose: it runs against the other tree, whose ``benchmarks/`` may predate
    ``benchmarks.harness``, so its timing (one warm-up call, one untimed call, then the best of
    ``repeats``) is written out here; the parent process records with the harness.
    """
    import jax

    out = {}
    for name in cells:
        f, args = _cell(name, cotangent)
        if measure == "trace":
            t0 = time.perf_counter()
            f.trace(*args)
            out[name] = {"trace_s": time.perf_counter() - t0}
            continue
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(f(*args))  # an untimed call: thread pools awake
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        out[name] = {"best_ms": 1e3 * min(times), "compile_s": compile_s}
    return out


def as_package(tree: Path, name: str, dest: Path) -> str:
    """``tree``'s ``attnlab`` copied into ``dest`` as the package ``name``, with every word ``attnlab`` in its
    sources rewritten, so that two commits' attnlab import side by side in one process -> ``name``.

    (A jax config state that attnlab defines keeps its name, so a second copy cannot define it again;
    ``attnlab.platform`` then falls back to its context variable, which plans for the same backend.)"""
    pkg = dest / name
    shutil.copytree(tree / "attnlab", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    word = re.compile(r"\battnlab\b")
    for path in pkg.rglob("*.py"):
        path.write_text(word.sub(name, path.read_text()))
    return name


def same_process(libs: dict, cells: list[str], rounds: int, repeats: int, cotangent: str = "random") -> dict:
    """Per cell, ``{side: best ms, ...}`` for the attnlab packages ``libs`` (``{"base": module, "head": module}``)
    timed in this process in ``rounds`` alternating rounds of ``repeats`` calls (``harness.interleaved``,
    each round starting with the other side), with each round's best per side (``rounds_ms``), the
    largest difference between the two sides' outputs, and the compile seconds."""
    import jax  # noqa: PLC0415

    from benchmarks import harness  # noqa: PLC0415

    out = {}
    for name in cells:
        progs = {side: _cell(name, cotangent, lib) for side, lib in libs.items()}
        runs = {side: harness.blocking(f, *args) for side, (f, args) in progs.items()}
        results = {side: jax.block_until_ready(f(*args)) for side, (f, args) in progs.items()}
        report = lambda line, name=name: print(f"{name}: {line}", file=sys.stderr)  # noqa: E731
        timings = harness.interleaved(runs, rounds=rounds, repeats=repeats, rotate=True, progress=report)
        cell = {"max_abs_diff": harness.max_abs_diff(results["base"], results["head"])}
        for side, t in timings.items():
            per_round = [1e3 * min(t.times[r * repeats : (r + 1) * repeats]) for r in range(rounds)]
            cell[side] = {"best_ms": 1e3 * t.best_s, "rounds_ms": per_round, "first_call_s": t.first_s}
        out[name] = cell
    return out


def _main_same_process():
    """``--same_process``: both trees' attnlab copied as packages and timed in this process (``same_process``)."""
    from benchmarks import harness  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "packages"
        dest.mkdir()
        with _trees(Path(tmp)) as (paths, names):
            for side, tree in paths.items():
                as_package(tree, f"attnlab_{side}", dest)
        sys.path.insert(0, str(dest))
        try:
            libs = {side: importlib.import_module(f"attnlab_{side}") for side in ("base", "head")}
            cells = same_process(libs, _CELLS.value, _ROUNDS.value, _REPEATS.value, _COTANGENT.value)
        finally:
            sys.path.remove(str(dest))
    rows = []
    for name, c in cells.items():
        per_round = [h / b for h, b in zip(c["head"]["rounds_ms"], c["base"]["rounds_ms"], strict=True)]
        rows.append({
            "cell": name, "base_ms": c["base"]["best_ms"], "head_ms": c["head"]["best_ms"],
            "ratio": c["head"]["best_ms"] / c["base"]["best_ms"],
            "round_ratios": {"min": min(per_round), "median": statistics.median(per_round), "max": max(per_round)},
            "max_abs_diff": c["max_abs_diff"],
        })  # fmt: skip
    meta = harness.run_record() | {"base": names["base"], "head": names["head"], "rounds": _ROUNDS.value}
    meta |= {"repeats": _REPEATS.value, "cotangent": _COTANGENT.value, "same_process": True}
    harness.write_json(Path(_OUT.value) / "compare.json", {"meta": meta, "rows": rows, "cells": cells})
    header = ["cell", f"base {names['base']} ms", f"head {names['head']} ms", "head / base"]
    header.append("per round: median (range)")
    print(harness.markdown_table(header, [
        [r["cell"], f"{r['base_ms']:.1f}", f"{r['head_ms']:.1f}", f"{r['ratio']:.3f}",
         "{median:.3f} ({min:.3f}-{max:.3f})".format(**r["round_ratios"])] for r in rows]))  # fmt: skip


def _in_tree(tree: Path, args: list[str], what: str, path: tuple = ()) -> str:
    """``python <args>`` with ``tree`` as the working directory and on PYTHONPATH (then ``path``) -> its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (tree, *path))))
    res = subprocess.run([sys.executable, *args], env=env, cwd=tree, capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"compare_commits: {what} in {tree} failed:\n{res.stderr[-3000:]}")
    return res.stdout


def _run(tree: Path, cells, repeats) -> dict:
    args = [str(Path(__file__).resolve()), f"--worker={','.join(cells)}", f"--repeats={repeats}"]
    args += [f"--cotangent={_COTANGENT.value}", f"--measure={_MEASURE.value}"]
    return json.loads(_in_tree(tree, args, "the worker").strip().splitlines()[-1])


@contextlib.contextmanager
def _trees(tmp: Path):
    """``({"base": path, "head": path}, {"base": name, "head": name})`` for ``--base`` and ``--head``: git worktrees
    under ``tmp`` (this tree itself for "."), removed on exit."""
    paths, names = {}, {}
    try:
        for side, spec in (("base", _BASE.value), ("head", _HEAD.value)):
            paths[side], names[side] = _tree(spec, tmp, side)
        yield paths, names
    finally:
        for path in paths.values():
            if path != ROOT:
                subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)


def _alternate(run) -> tuple[dict, str, str]:
    """``run(tree, out folder, head tree)`` on the base and head trees in ``--rounds`` alternating rounds (base first in
    even rounds) -> ``({"base": [...], "head": [...]}, base name, head name)``; worktrees removed after."""
    runs = {"base": [], "head": []}
    with tempfile.TemporaryDirectory() as tmp, _trees(Path(tmp)) as (paths, names):
        for r in range(_ROUNDS.value):
            for side in ("base", "head") if r % 2 == 0 else ("head", "base"):
                t0 = time.perf_counter()
                runs[side].append(run(paths[side], Path(tmp) / f"out-{side}-{r}", paths["head"]))
                print(f"round {r + 1}/{_ROUNDS.value} {side}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return runs, names["base"], names["head"]


def _tree(spec: str, tmp: Path, name: str) -> tuple[Path, str]:
    if spec == ".":
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return ROOT, f"working tree (HEAD {rev.stdout.strip()})"
    path = tmp / name
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(path), spec], cwd=ROOT, check=True)
    return path, spec


def main(argv):
    del argv
    if _WORKER.value:  # before anything from this tree is imported (see _worker)
        print(json.dumps(_worker(_WORKER.value.split(","), _REPEATS.value, _COTANGENT.value, _MEASURE.value)))
        return
    if _BENCH.value:
        _main_bench(BENCHES[_BENCH.value])
        return
    unknown = sorted(set(_CELLS.value) - set(CELLS))
    if unknown:
        raise ValueError(f"--cells: unknown {unknown}; choose from {list(CELLS)}")
    if _SAME_PROCESS.value:
        if _MEASURE.value != "run":
            raise app.UsageError("--measure=trace times each tree in its own fresh process: drop --same_process")
        _main_same_process()
        return
    runs, base_name, head_name = _alternate(lambda tree, out, head: _run(tree, _CELLS.value, _REPEATS.value))
    rows = compare_rows(runs, _CELLS.value, _MEASURE.value)
    from benchmarks import harness  # noqa: PLC0415  (this tree's; the worker never imports it)

    meta = harness.run_record() | {"base": base_name, "head": head_name, "rounds": _ROUNDS.value}
    meta["repeats"], meta["cotangent"], meta["measure"] = _REPEATS.value, _COTANGENT.value, _MEASURE.value
    name = "compare.json" if _MEASURE.value == "run" else "compare_trace.json"
    harness.write_json(Path(_OUT.value) / name, {"meta": meta, "rows": rows, "runs": runs})
    unit = "ms" if _MEASURE.value == "run" else "trace_s"
    header = ["cell", f"base {base_name} {unit}", f"head {head_name} {unit}", "head / base"]
    print(harness.markdown_table(header, [[r["cell"], f"{r[f'base_{unit}']:.3g}", f"{r[f'head_{unit}']:.3g}",
                                           f"{r['ratio']:.2f}"] for r in rows]))  # fmt: skip


def compare_rows(runs: dict, cells: list[str], measure: str = "run") -> list[dict]:
    """Per cell, the best over each tree's rounds (``base_ms`` / ``head_ms``; ``base_trace_s`` / ``head_trace_s``
    for ``measure="trace"``) and their ratio head / base."""
    field, unit = ("best_ms", "ms") if measure == "run" else ("trace_s", "trace_s")
    rows = []
    for name in cells:
        b, h = (min(run[name][field] for run in runs[side]) for side in ("base", "head"))
        rows.append({"cell": name, f"base_{unit}": b, f"head_{unit}": h, "ratio": h / b})
    return rows


def _run_bench(tree: Path, spec: dict, out: Path, program: Path | None = None) -> list[dict]:
    """The benchmark program of ``tree`` (or of ``program``, with ``tree``'s attnlab first on the path) -> its
    records."""
    args, path = ["-m", spec["module"], *spec.get("args", ()), f"--out={out}"], ()
    if program and program != tree:
        # run in a folder that holds only a link to this tree's attnlab, with the program's tree on the path after
        # it (`python -m` puts the working directory first, so the program's tree must not be it)
        link = out.parent / f"attnlab-of-{out.name}"
        link.mkdir(parents=True, exist_ok=True)
        (link / "attnlab").symlink_to(tree / "attnlab", target_is_directory=True)
        path, tree = (program,), link
    _in_tree(tree, args, spec["module"], path)
    return json.loads((out / spec["file"]).read_text())[spec.get("records", "records")]


def bench_rows(spec: dict, runs: dict) -> list[dict]:
    """Per record key: the best of each timed field over a tree's runs, and the ratios from those bests."""
    rows = []
    for rec in runs["head"][0]:
        key = {k: rec[k] for k in spec["key"]}
        row = dict(key)
        for side in ("base", "head"):
            recs = [r for run in runs[side] for r in run if all(r[k] == v for k, v in key.items())]
            best = {
                f: min(r[f] for r in recs if r.get(f) is not None) for f in spec["times"] if any(r.get(f) for r in recs)
            }
            row[side] = best
            for name, (num, den) in spec["ratios"].items():
                if num in best and den in best:
                    row.setdefault("ratios", {}).setdefault(name, {})[side] = best[num] / best[den]
        rows.append(row)
    return rows


def _main_bench(spec: dict):
    from benchmarks import harness  # noqa: PLC0415

    def run(tree, out, head):  # --program head: both trees run the head tree's program
        return _run_bench(tree, spec, out, head if _PROGRAM.value == "head" else None)

    runs, base_name, head_name = _alternate(run)
    rows = bench_rows(spec, runs)
    meta = harness.run_record() | {"base": base_name, "head": head_name, "rounds": _ROUNDS.value}
    meta["bench"], meta["program"] = spec["module"], _PROGRAM.value
    harness.write_json(Path(_OUT.value) / f"compare_{_BENCH.value}.json", {"meta": meta, "rows": rows, "runs": runs})
    header = [*spec["key"], "ratio", f"base {base_name}", f"head {head_name}"]
    table = [[*(str(r[k]) for k in spec["key"]), name, f"{v['base']:.2f}", f"{v['head']:.2f}"]
             for r in rows for name, v in r.get("ratios", {}).items()]  # fmt: skip
    print(harness.markdown_table(header, table))


if __name__ == "__main__":
    define_flags()
    app.run(main)
