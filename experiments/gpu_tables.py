"""The GPU check's committed runs on an H200 (``benchmarks/results/h200/``, ``benchmarks/gpu_check.py``)
as the docs' tables: ``speed`` (bf16 per implementation and case against cuDNN), ``headline`` (the
README's Pallas-vs-cuDNN rows), ``blocks`` (Pallas tile shapes) and ``correctness`` (every
implementation against the reference). Each takes the results folder; ``experiments/docs.py``
calls them.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.tables import markdown_table, ms


def _md(header, rows) -> str:
    return markdown_table(header, rows) + "\n"


_CASES = {  # (mask, score) of gpu_check's speed rows -> the row label
    ("full", "dot"): "full",
    ("causal", "dot"): "causal",
    ("window(128,0)", "dot"): "causal window 128",
    ("window(128,128)", "dot"): "window ±128",
    ("document16", "dot"): "16 documents",
    ("document16_traced", "dot"): "16 documents, ids traced",
    ("full", "softcap:30"): "full, SoftCap(30)",
    ("full", "alibi_mod"): "full, ALiBi ScoreMod",
    ("full", "additive"): "full, additive (tanh)",
}


def _load(folder, name: str) -> dict:
    return json.loads((Path(folder) / name).read_text())


def _speed_rows(folder) -> list[dict]:
    """The speed rows the current code reproduces: H = 64 from run 1 ((64, 64) tiles, still the default there),
    H = 128 from run 2 (its (128, 64) tiles are the bf16 default now), but additive through pallas at H = 128
    from run 1 (the pair form keeps (64, 64) tiles)."""
    run1 = [dict(r, run=1) for r in _load(folder, "run1_gpu_check.json")["speed"]]
    run2 = [dict(r, run=2) for r in _load(folder, "run2_speed_H128.json")["speed"]]

    def keep(r):
        pallas_additive = r["implementation"] == "pallas" and r["score"] == "additive"
        if r["H"] == 64:
            return r["run"] == 1
        return r["run"] == (1 if pallas_additive else 2)

    return [r for r in run1 + run2 if keep(r) and r["status"] == "ok"]


def speed(folder) -> str:
    """bf16 speed per implementation and case on an H200: ms and the ratio to cuDNN (cuDNN ms / ms)."""
    rows = _speed_rows(folder)
    cols = sorted({(r["H"], r["T"]) for r in rows})
    cells = {(r["implementation"], r["mask"], r["score"], r["direction"], r["H"], r["T"]): r for r in rows}
    order = ("cudnn", "pallas", "xla", "blockwise")
    out = []
    for direction in ("fwd", "fwd+bwd"):
        for impl in order:
            for (mask, score), label in _CASES.items():
                rs = [cells.get((impl, mask, score, direction, H, T)) for H, T in cols]
                if not any(rs):
                    continue
                shown = []
                for r in rs:
                    if r is None:
                        shown.append("")
                    elif impl == "cudnn":
                        shown.append(ms(r["ms"]))
                    else:
                        shown.append(f"{ms(r['ms'])} ({r['vs_cudnn']:.2f}x)")
                out.append([direction, impl, label, *shown])
    header = ["direction", "implementation", "case", *(f"H={H}, T={T // 1024}K ms (vs cuDNN)" for H, T in cols)]
    mem = {r["implementation"]: r for r in _load(folder, "run1_gpu_check.json")["memory"] if r["status"] == "ok"}
    m = mem["pallas"]
    return _md(header, out) + (
        "\nH=64 columns and pallas' additive rows at H=128: run 1; the other H=128 cells: run 2 (ratios are "
        "against cuDNN in the same run).\n"
        f"Compiled fwd+bwd memory at T={m['T'] // 1024}K, H={m['H']} (arguments, outputs, temporaries): "
        + ", ".join(f"{k} {v['total_mib']:.0f} MiB" for k, v in mem.items())
        + ".\n"
    )


def headline(folder) -> str:
    """README: pallas against cuDNN at H = 128, T = 16K (bf16, one H200 run): ms, and cuDNN ms / pallas ms."""
    rows = [r for r in _speed_rows(folder) if r["H"] == 128 and r["T"] == 16384]
    cells = {(r["implementation"], r["mask"], r["score"], r["direction"]): r for r in rows}
    picks = [  # (pallas case, the cuDNN case it is compared with)
        (("full", "dot"), ("full", "dot")),
        (("causal", "dot"), ("causal", "dot")),
        (("window(128,128)", "dot"), ("window(128,0)", "dot")),
        (("document16", "dot"), ("full", "dot")),
        (("document16_traced", "dot"), ("full", "dot")),
        (("full", "softcap:30"), ("full", "dot")),
    ]
    out = []
    for mine, theirs in picks:
        row = [_CASES[mine], _CASES[theirs]]
        for direction in ("fwd", "fwd+bwd"):
            p, c = cells[("pallas", *mine, direction)], cells[("cudnn", *theirs, direction)]
            row += [ms(c["ms"]), f"{ms(p['ms'])} ({p['vs_cudnn']:.2f}x)"]
        out.append(row)
    header = ["pallas case", "cuDNN case", "cuDNN fwd ms", "pallas fwd ms (vs cuDNN)", "cuDNN fwd+bwd ms",
              "pallas fwd+bwd ms (vs cuDNN)"]  # fmt: skip
    return _md(header, out)


def blocks(folder) -> str:
    """Run 1's blocks section: pallas per (block_q, block_k) at T = 16K, each against cuDNN in the same run."""
    rows = [r for r in _load(folder, "run1_gpu_check.json")["blocks"] if r["status"] == "ok"]
    shapes = list(dict.fromkeys((r["block_q"], r["block_k"]) for r in rows if r["implementation"] == "pallas"))
    out = []
    for key in dict.fromkeys((r["mask"], r["H"], r["direction"]) for r in rows):
        mine = {(r["block_q"], r["block_k"]): r for r in rows if (r["mask"], r["H"], r["direction"]) == key}
        ref = next(r for r in rows if (r["mask"], r["H"], r["direction"]) == key and r["implementation"] == "cudnn")
        cells = [f"{ms(mine[b]['ms'])} ({mine[b]['vs_cudnn']:.2f}x)" if b in mine else "not run" for b in shapes]
        out.append([key[0], str(key[1]), key[2], ms(ref["ms"]), *cells])
    T = rows[0]["T"]
    return _md(["mask", "H", "direction", "cuDNN ms", *(f"({q}, {k})" for q, k in shapes)], out) + (
        f"\nbf16, T={T // 1024}K, 16 heads; ms (cuDNN ms / ms); cells past the section's time budget: not run.\n"
    )


def correctness(folder) -> str:
    """Run 2's correctness cells (H = 64 and 128): per implementation and dtype, what ran and its largest errors."""
    rows = []
    for H in (64, 128):
        for dtype in ("bfloat16", "float32"):
            rows += _load(folder, f"run2_correctness_H{H}_{dtype}.json")["correctness"]
    out = []
    for impl in dict.fromkeys(r["implementation"] for r in rows):
        for dtype in ("bfloat16", "float32"):
            mine = [r for r in rows if r["implementation"] == impl and r["dtype"] == dtype]
            ran = [r for r in mine if r["status"] in ("ok", "FAIL")]
            ok = [r for r in ran if r["status"] == "ok"]
            err = [r for r in mine if r["status"] == "error"]
            if not ran and not err:
                why = {r.get("reason", "") for r in mine if r["status"] == "unsupported"}
                out.append([impl, dtype, "0", "", "", "", "", "unsupported: " + "; ".join(sorted(why))[:80]])
                continue
            first = sorted(r["first_call_s"] for r in ran)
            cases = sorted({f"{r['mask']}" + ("" if r["score"] == "dot" else f" {r['score']}") for r in ran})
            note = f"H={sorted({r['H'] for r in ran})}; " if ran else ""
            if err:
                reasons = sorted({r["reason"].split(", context")[0] for r in err})
                note += f"{len(err)} errors: " + "; ".join(reasons)
            out.append([
                impl, dtype, f"{len(ok)}/{len(ran)}",
                f"{max((r['out_rel_err'] for r in ran), default=0):.1e}",
                f"{max((r['grad_rel_err'] for r in ran), default=0):.1e}",
                f"{first[len(first) // 2]:.1f}" if first else "",
                ", ".join(cases), note,
            ])  # fmt: skip
    header = ["implementation", "dtype", "ok / run", "max out err", "max grad err", "median first call s", "cases",
              "notes"]  # fmt: skip
    return _md(header, out)
