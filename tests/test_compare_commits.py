"""benchmarks.compare_commits: the worker times the public attention API; the cell table is complete."""

import pytest

from benchmarks import compare_commits


def test_trace_measure_times_the_first_trace_of_a_known_mask_and_the_rows_take_the_best_round():
    """--measure=trace: a known mask's cell is traced (its tiles classified), not run; the best over rounds."""
    out = compare_commits._worker(["window_2d ±3 16384 (128x128) fwd"], repeats=1, measure="trace")
    assert (
        set(out["window_2d ±3 16384 (128x128) fwd"]) == {"trace_s"}
        and out["window_2d ±3 16384 (128x128) fwd"]["trace_s"] > 0
    )
    f, args = compare_commits._cell("window_2d ±3 16384 (128x128) fwd")
    assert args[3] is None and "while" in str(f.trace(*args).jaxpr)  # the mask is not an argument; a tiled kernel
    runs = {
        "base": [{"c": {"trace_s": 2.0}}, {"c": {"trace_s": 1.5}}],
        "head": [{"c": {"trace_s": 0.3}}, {"c": {"trace_s": 0.6}}],
    }
    (row,) = compare_commits.compare_rows(runs, ["c"], "trace")
    assert row == {"cell": "c", "base_trace_s": 1.5, "head_trace_s": 0.3, "ratio": pytest.approx(0.2)}
    (row,) = compare_commits.compare_rows({"base": [{"c": {"best_ms": 4.0}}], "head": [{"c": {"best_ms": 2.0}}]}, ["c"])
    assert row == {"cell": "c", "base_ms": 4.0, "head_ms": 2.0, "ratio": 0.5}


def test_worker_times_a_cell():
    out = compare_commits._worker(["padding 128 x8 fwd"], repeats=1)
    assert set(out) == {"padding 128 x8 fwd"}
    assert out["padding 128 x8 fwd"]["best_ms"] > 0 and out["padding 128 x8 fwd"]["compile_s"] > 0


@pytest.mark.parametrize("cotangent", ["random", "ones"])
def test_fwd_bwd_cells_take_the_gradient_for_their_cotangent(cotangent):
    """A random cotangent (the default) or ones: the cell's gradients equal jax.vjp's for that cotangent."""
    import jax
    import jax.numpy as jnp

    import attnlab

    f, (q, k, v, m, ct) = compare_commits._cell("padding 128 x8 fwd+bwd", cotangent)
    assert (ct is None) == (cotangent == "ones")
    out, pull = jax.vjp(lambda q, k, v: attnlab.attention(q, k, v, mask=m), q, k, v)
    want = pull(jnp.ones_like(out) if ct is None else ct)
    for got, w in zip(f(q, k, v, m, ct), want, strict=True):
        assert float(jnp.max(jnp.abs(got - w))) < 1e-5 * float(jnp.max(jnp.abs(w)))


@pytest.mark.parametrize("name", sorted(compare_commits.CELLS))
def test_cells_are_well_formed(name):
    kind, T, B, N, H, bwd = compare_commits.CELLS[name]
    # closed over, so planned in the trace
    known = ("bigbird", "window_2d", *(f"documents known{s}" for s in ("", " & causal", " shuffled", " cross")))
    assert kind in ("full", "causal", "window", "padding", "documents", "graph", "decode", *known)
    assert T > 0 and B > 0 and N > 0 and H > 0
    assert isinstance(bwd, bool) and (("bwd" in name) == bwd) and str(T) in name


def test_decode_cell_is_one_query_row_over_the_cache():
    """The decode cell: one query row per sequence over T keys, the cache's lengths as the mask, dense XLA's
    key-major form (attnlab.impls.xla.dense_form)."""
    import attnlab
    from attnlab.impls import xla

    _, (q, k, v, m, ct) = compare_commits._cell("decode 2048 x8 fwd+bwd", "random")
    assert q.shape == (8, 1, 8, 64) and k.shape == v.shape == (8, 2048, 8, 64) and ct.shape == q.shape
    assert attnlab.explain(q, k, v, mask=m).implementation == "xla"
    assert xla.dense_form(8, 8, 8, 1, 2048, 64, "cpu") == "key_major"


def test_graph_cell_runs_the_edge_list_kernel():
    """The graph cell's mask is an edge list, which dispatch sends to the sparse kernel."""
    import jax.numpy as jnp
    import numpy as np

    import attnlab
    from attnlab import masks

    T = 64
    src, dst = np.arange(T), (np.arange(T) + 1) % T
    x = jnp.zeros((1, T, 2, 8))
    m = masks.graph_edges(jnp.asarray(src), jnp.asarray(dst), T)
    assert attnlab.explain(x, x, x, mask=m).implementation == "sparse"


def test_bench_rows_take_each_trees_best_and_form_ratios():
    """--bench: per record key, the best (least) time over a tree's runs, and the ratios from the bests."""
    spec = compare_commits.BENCHES["flex"]

    def rec(mask, a, d, f):
        return {"mask": mask, "T": 16, "attnlab_s": a, "attnlab_devices_s": d, "flex_s": f, "other": 1}

    runs = {
        "base": [[rec("window", 2.0, 1.0, 4.0)], [rec("window", 1.0, 2.0, 5.0)]],
        "head": [[rec("window", 0.5, 0.8, 6.0)], [rec("window", 0.4, 1.0, 3.0)]],
    }
    (row,) = compare_commits.bench_rows(spec, runs)
    assert row["base"] == {"attnlab_s": 1.0, "attnlab_devices_s": 1.0, "flex_s": 4.0}
    assert row["head"] == {"attnlab_s": 0.4, "attnlab_devices_s": 0.8, "flex_s": 3.0}
    assert row["ratios"]["flex / attnlab"] == {"base": 4.0, "head": 7.5}
    assert row["ratios"]["flex / attnlab (host devices)"] == {"base": 4.0, "head": 3.75}


def test_a_record_only_the_head_writes_gets_the_heads_times_alone(tmp_path):
    """--bench scores-graph: the head's program may time a record (a new score) that the base's does not, and a
    record may leave a time out (the additive score's blockwise_s): no ratio there, and the table says "-"."""
    import json

    from experiments import bench_tables

    spec = compare_commits.BENCHES["scores-graph"]

    def rec(score, sparse, blockwise):
        return {"score": score, "mode": "fwd+bwd", "sparse_s": sparse, "blockwise_s": blockwise}

    runs = {"base": [[rec("dot", 0.3, 1.5)]], "head": [[rec("dot", 0.2, 1.6), rec("additive", 0.5, None)]]}
    dot, additive = compare_commits.bench_rows(spec, runs)
    assert dot["ratios"]["blockwise / sparse"] == {"base": 5.0, "head": 8.0}
    assert additive["base"] == {} and additive["head"] == {"sparse_s": 0.5} and "ratios" not in additive
    (tmp_path / "c.json").write_text(json.dumps({"meta": {"base": "abc"}, "rows": [dot, additive]}))
    table = bench_tables.compare_bench(tmp_path, ("c.json",), times=("sparse_s",))
    assert "| dot fwd+bwd | sparse_s | 0.300 / 0.200 (0.67) |" in table
    assert "| dot fwd+bwd | blockwise / sparse | 5.00 / 8.00 |" in table
    assert "| additive fwd+bwd | sparse_s | - / 0.500 |" in table and "| score, mode | seconds or ratio |" in table


def test_the_head_program_runs_on_the_base_attnlab(tmp_path):
    """--program head: the base's run is the head tree's program importing the base tree's attnlab (in real
    subprocesses: ``python -m`` puts the working directory first on the path), the head's run its own."""
    spec = {"module": "benchmarks.probe", "file": "probe.json", "records": "graph"}
    base, head = tmp_path / "base", tmp_path / "head"
    for tree in (base, head):
        (tree / "attnlab").mkdir(parents=True)
        (tree / "attnlab" / "__init__.py").write_text(f"TREE = {tree.name!r}\n")
        (tree / "benchmarks").mkdir()
        (tree / "benchmarks" / "__init__.py").write_text("")
        record = f"{{'program': {tree.name!r}, 'attnlab': attnlab.TREE}}"
        (tree / "benchmarks" / "probe.py").write_text(
            "import json, pathlib, sys\nimport attnlab\n"
            "out = pathlib.Path(sys.argv[-1].removeprefix('--out='))\nout.mkdir(parents=True)\n"
            f"(out / 'probe.json').write_text(json.dumps({{'graph': [{record}]}}))\n"
        )

    def ran(tree, program=None):
        (rec,) = compare_commits._run_bench(tree, spec, tmp_path / f"out-{tree.name}-{len(list(tmp_path.iterdir()))}",
                                            program)  # fmt: skip
        return rec["program"], rec["attnlab"]

    assert ran(base, head) == ("head", "base")  # --program head: the head's program on the base's attnlab
    assert ran(head, head) == ("head", "head")
    assert ran(base) == ("base", "base")  # --program own


def test_compare_table_names_the_cotangent_of_its_runs(tmp_path):
    """Runs from before ``--cotangent`` (no such field) took the gradient of out.sum(): the table says ones."""
    import json

    from experiments import bench_tables

    rows = [{"cell": "full 1024 fwd+bwd", "base_ms": 2.0, "head_ms": 1.0, "ratio": 0.5}]
    for meta, want in (({"base": "abc"}, "ones"), ({"base": "abc", "cotangent": "random"}, "random")):
        (tmp_path / "c.json").write_text(json.dumps({"meta": meta, "rows": rows}))
        header, _, row = bench_tables.compare(tmp_path, "c.json").splitlines()[:3]
        assert f"cell (fwd+bwd cotangent: {want})" in header and "| 0.50 |" in row


def test_same_process_times_two_packages_of_one_tree_alike(tmp_path):
    """--same_process: a tree's attnlab copied under another name imports beside attnlab and computes the same
    outputs; ``same_process`` times both sides per round and finds no difference between their outputs."""
    import importlib
    import sys

    import jax
    import jax.numpy as jnp

    import attnlab

    names = [compare_commits.as_package(compare_commits.ROOT, f"attnlab_{s}", tmp_path) for s in ("base", "head")]
    assert not any("attnlab." in p.read_text() for p in (tmp_path / names[0]).rglob("*.py"))
    sys.path.insert(0, str(tmp_path))
    try:
        libs = dict(zip(("base", "head"), (importlib.import_module(n) for n in names), strict=True))
        q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
        want = attnlab.attention(q, q, q, mask=attnlab.masks.causal())
        got = libs["head"].attention(q, q, q, mask=libs["head"].masks.causal())
        assert float(jnp.max(jnp.abs(got - want))) == 0.0
        out = compare_commits.same_process(libs, ["padding 128 x8 fwd"], rounds=2, repeats=2)
    finally:
        sys.path.remove(str(tmp_path))
        for n in names:
            for m in [m for m in sys.modules if m == n or m.startswith(n + ".")]:
                del sys.modules[m]
    cell = out["padding 128 x8 fwd"]
    assert cell["max_abs_diff"] == 0.0
    for side in ("base", "head"):
        assert len(cell[side]["rounds_ms"]) == 2 and cell[side]["best_ms"] == min(cell[side]["rounds_ms"]) > 0
