"""The CPU dispatch rules' evidence as the docs' tables, from the committed results
(``benchmarks/results/cpu-2core-shared/``): ``crossover`` (``make crossover``: where blockwise pays off),
``dense_fusion`` and ``dense_key_major`` (``make dense-fusion``: dense XLA's three forms). Each cell is the
range over the committed runs (``_span``); each table ends with its runs' host (``bench_tables.host_line``).
``experiments/docs.py`` calls them."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.bench_tables import host_line
from experiments.tables import markdown_table


def _md(header, rows) -> str:
    return markdown_table(header, rows) + "\n"


def crossover(folder, names: tuple) -> str:
    """``make crossover`` (``benchmarks.crossover``): dense XLA's time over the blockwise kernel's on the same
    calls (above 1: blockwise faster), per shape, mask and T, as the range over fp32 / bf16 and the committed
    runs ``names``; one table per direction, forward+backward first. A cell marked "xla" is a call that
    ``implementation=None`` sends to dense XLA, as the code has it now (``attnlab.explain``; the runs record
    what it chose then)."""
    files = [json.loads((Path(folder) / n).read_text()) for n in names]
    records = [r for d in files for r in d["records"]]
    lengths = sorted({r["T"] for r in records})
    rows_of = list(dict.fromkeys((r["shape"], r["mask"]) for r in records))
    out = []
    for mode in ("fwd+bwd", "fwd"):
        rows = []
        for shape, mask in rows_of:
            cells = []
            for T in lengths:
                rs = [r for r in records if (r["shape"], r["mask"], r["T"], r["mode"]) == (shape, mask, T, mode)]
                if not rs:
                    cells.append("")
                    continue
                cells.append(_span([r["ratio"] for r in rs]) + (" xla" if _chosen(shape, mask, T) == "xla" else ""))
            rows.append([shape, mask, *cells])
        header = ["B x N x H", "mask", *(f"T = {T}" for T in lengths)]
        out.append(f"{mode}, xla ms / blockwise ms:\n\n" + _md(header, rows))
    return "\n".join(out) + f"\n{host_line(files)}\n"


def _chosen(shape: str, mask: str, T: int) -> str:
    """What ``implementation=None`` runs on a crossover call (``T = S``), from its shape alone."""
    import jax.numpy as jnp  # noqa: PLC0415 (jax, only for this table)

    import attnlab  # noqa: PLC0415
    from benchmarks import crossover as bench  # noqa: PLC0415

    B, N, K, H = bench.SHAPES[shape]
    q, kv = jnp.zeros((B, T, N, H)), jnp.zeros((B, T, K, H))
    return attnlab.explain(q, kv, kv, mask=bench.MASKS[mask]()).implementation


def _span(values) -> str:
    """The range of ratios over runs, to two decimals: "0.91-1.04", or one number where both ends print alike."""
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return lo if lo == hi else f"{lo}-{hi}"


def dense_fusion(folder, names: tuple) -> str:
    """``make dense-fusion`` (``benchmarks.dense_fusion``): the fused dense program's time over the mapped one's
    (below 1: fused faster), per B x N x T (and S where S != T: cross-attention) and per H and direction, as
    the range over the committed runs ``names``; the query rows B * N * T, and the form the rule
    (``xla.dense_form``, as the code has it now) runs (per H where it differs, "a/b")."""
    from attnlab.impls import xla  # noqa: PLC0415 (jax, only for this table)

    files = [json.loads((Path(folder) / n).read_text()) for n in names]
    records = [{"S": r["T"]} | r for d in files for r in d["records"]]  # S: runs before --kv_lengths
    keys = list(dict.fromkeys((r["B"], r["N"], r["T"], r["S"]) for r in records))
    cols = list(dict.fromkeys((r["H"], r["direction"]) for r in records))
    rows = []
    for B, N, T, S in sorted(keys, key=lambda k: (k[0] * k[1] * k[2], k)):
        cells = []
        for H, d in cols:
            rs = [r for r in records if (r["B"], r["N"], r["T"], r["S"], r["H"], r["direction"]) == (B, N, T, S, H, d)]
            cells.append(_span([r["ratio"] for r in rs]))
        rule = "/".join(dict.fromkeys(xla.dense_form(B, N, N, T, S, H, "cpu") for H, _ in cols))
        rows.append([f"{B} x {N} x {T}" + ("" if S == T else f", S = {S}"), f"{B * N * T:,}", *cells, rule])
    header = ["B x N x T", "query rows", *(f"H = {H}, {d}" for H, d in cols), "rule"]
    spread = [r["mapped_over_jax_nn"] for r in records]
    spread_line = f"The mapped form over jax.nn's own time, every call: {min(spread):.2f}-{max(spread):.2f}."
    return _md(header, rows) + f"\n{spread_line} {host_line(files)}\n"


def dense_key_major(folder, names: tuple) -> str:
    """``make dense-fusion``'s few-queries grid: the key-major form's time over the better of the fused and
    mapped forms (below 1: key-major faster), per B x N x T and S, forward and forward+backward, as the range
    over the committed runs ``names``; k's elements B * S * K * H, and the form the rule (``xla.dense_form``,
    as the code has it now) runs."""
    from attnlab.impls import xla  # noqa: PLC0415 (jax, only for this table)

    files = [json.loads((Path(folder) / n).read_text()) for n in names]
    records = [r for d in files for r in d["records"] if "key_major_ratio" in r]

    def at(r):
        return r["B"], r["N"], r["T"], r["S"], r["H"]

    dirs = list(dict.fromkeys(r["direction"] for r in records))
    rows = []
    for key in sorted(dict.fromkeys(map(at, records)), key=lambda k: (k[2], k[0] * k[3])):
        B, N, T, S, H = key
        cells = [_span([r["key_major_ratio"] for r in records if at(r) == key and r["direction"] == d]) for d in dirs]
        rows.append(
            [f"{B} x {N} x {T}", f"{S:,}", f"{B * S * N * H:,}", *cells, xla.dense_form(B, N, N, T, S, H, "cpu")]
        )
    return _md(["B x N x T", "S", "k's elements B x S x K x H", *dirs, "rule"], rows) + f"\n{host_line(files)}\n"


_TUNE_HEADER = ["case (fwd+bwd)", "tiles timed", "default tiles", "autotune ms", "fastest tiles", "autotune ms",
                "re-timed default ms", "re-timed fastest ms", "fastest / default"]  # fmt: skip


def _tiles(t: dict) -> str:
    return f"{t['block_q']} x {t['block_k']}"


def _tune_rows(result: dict, run: str = "") -> list:
    """One run's rows (``benchmarks.tune_cpu``): per case the candidates autotune timed, the default tiles and
    the fastest with their autotune times, then both re-timed in alternating rounds; ``run`` labels the case."""
    rows = []
    for r in result["rows"]:
        ms = {_tiles(c["config"]): c["ms"] for c in r["candidates"]}
        default = ms.get(_tiles(r["default"]))
        cells = [f"{r['case']} {r['T']:,}{run}", str(sum(m is not None for m in ms.values())), _tiles(r["default"]),
                 "" if default is None else f"{default:.1f}"]  # fmt: skip
        if r.get("best") is None:
            rows.append([*cells, "", "", "", "", ""])
            continue
        cells += [_tiles(r["best"]), f"{r['autotune_best_ms']:.1f}", f"{r['default_ms']:.1f}", f"{r['best_ms']:.1f}"]
        same = r["best"] == r["default"]  # one program timed twice: the ratio is the run's noise
        rows.append([*cells, f"{r['best_over_default']:.2f}" + (" (same tiles)" if same else "")])
    return rows


def tune_cpu_rows(result: dict) -> str:
    """``make tune-cpu``'s table of one run, as the program prints it."""
    return _md(_TUNE_HEADER, _tune_rows(result))


def tune_cpu(folder, names: tuple) -> str:
    """``make tune-cpu``: the committed runs ``names``, each case's rows side by side (run k), with their host."""
    runs = [json.loads((Path(folder) / n).read_text()) for n in names]
    label = (lambda k: f" (run {k + 1})") if len(runs) > 1 else (lambda k: "")
    by_case: dict = {}
    for k, result in enumerate(runs):
        for r, row in zip(result["rows"], _tune_rows(result, label(k)), strict=True):
            by_case.setdefault(r["case"], []).append(row)
    return _md(_TUNE_HEADER, [row for rows in by_case.values() for row in rows]) + f"\n{host_line(runs)}\n"


def edges_crossover(folder, names: tuple) -> str:
    """``make edges-crossover`` (``benchmarks.edges_crossover``): the blockwise kernel's time over the edge-list
    kernel's on the same graph (above 1: sparse faster), per graph and score, as the range over the committed
    runs ``names`` (paths under ``folder``), with the pairs of the non-empty tiles per edge and what CPU dispatch
    runs (``impls.sparse.min_pairs_per_edge``, as the code has it now). Runs at several head shapes (heads x H)
    get a column per score and shape, and one per shape for what dispatch runs."""
    from attnlab.impls.sparse import min_pairs_per_edge  # noqa: PLC0415

    files = [json.loads((Path(folder) / n).read_text()) for n in names]
    records = [r for d in files for r in d["records"]]
    graphs = list(dict.fromkeys(r["graph"] for r in records))
    shapes = list(dict.fromkeys((r["heads"], r["H"]) for r in records))
    columns = list(dict.fromkeys((r["score"], r["heads"], r["H"]) for r in records))
    rows = []
    for g in graphs:
        first = next(r for r in records if r["graph"] == g)
        cells = [
            [r["ratio"] for r in records if (r["graph"], r["score"], r["heads"], r["H"]) == (g, *c)] for c in columns
        ]
        ratios = [_span(c) if c else "-" for c in cells]
        runs = ["sparse" if first["pairs_per_edge"] >= min_pairs_per_edge(h) else "blockwise" for _, h in shapes]
        rows.append([g, f"{first['edges']:,}", f"{first['pairs_per_edge']:.1f}", *ratios, *runs])
    header = ["graph (nodes x edges per node)", "edges", "pairs per edge"]
    shape = lambda n, h: f", {n} x {h}" if len(shapes) > 1 else ""  # noqa: E731
    header += [f"{s}{shape(n, h)}: blockwise / sparse" for s, n, h in columns]
    header += [f"dispatch runs{shape(n, h)}" for n, h in shapes]
    return _md(header, rows) + f"{host_line(files)}\n"
