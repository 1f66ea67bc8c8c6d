r"""Scores inside the blockwise tiles against the plain dot product, one process.

Two parts, both through ``attnlab.kernels.blockwise_attention``:

1. **Per-element scores at 4K** (8 heads, H = 64, fp32): ``scores.SoftCap(30)`` (``cap * tanh(s / cap)``,
   Gemma 2) and ``positional.Alibi().score(slopes=slopes)`` (ALiBi as a ``ScoreMod``, a user
   ``score_mod``; rows ``alibi_mod``) next to ``score="dot"``, full and causal masks, forward and
   forward + backward, best of ``--repeats`` in interleaved rounds. The target: each within 1.3x of the dot product.
2. **Additive (tanh) attention at 16K** (``--additive_seq_len``; 4 heads, H = 64, fp32, no mask),
   ``scores.Additive(w)`` fwd+bwd: the compiled temporary memory (XLA's memory analysis) of the
   tiled kernel and of the dense reference (compiled only, never run: it needs the
   ``[T, S, N, H]`` tanh tensor), the time of one call, and its throughput as GFLOP/s
   (``benchmarks.harness.useful_flops``: 5H per pair and head forward for the additive score, 3x
   that forward+backward; 4H and 3.5x for the dot product; the committed ``scores.json`` of
   2026-12 counted the dot product's backward as 2x its forward, 12H per pair where this counts
   14H) next to the dot product's on the same shape. Also the compiled memory at twice the
   length (compile only).
3. **Scores on a graph's edges** (``--graph_nodes`` nodes, ``--graph_degree`` random edges per node and
   self loops, ``masks.graph_edges``; 8 heads, H = 64, fp32, fwd+bwd): the edge-list kernel
   (``implementation="sparse"``, O(E)) against the blockwise kernel on the same graph, for the dot
   product, SoftCap, ALiBi and a Graphormer-style per-pair table (``ScoreMod``), with what dispatch
   chooses for each, and each score's time over the dot product's on the edge-list kernel. The additive
   score runs on the edge-list kernel only (on the blockwise kernel: a tanh per pair and head dimension).

Command (what ``make scores`` runs; ~10 min on the 2-core development CPU):

    python -m benchmarks.scores --out results/scores

Writes ``<out>/scores.json`` (records, host CPU model and SIMD flags, versions, command, date, wall).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import attnlab
from attnlab import kernels, masks, positional, scores
from benchmarks import cases, harness


def define_flags():
    """The command-line flags, defined only when run as a program (importing the module defines none)."""
    global _OUT, _T, _HEADS, _TA, _HEADS_A, _H, _REPEATS, _ROUNDS, _CAP, _NODES, _DEGREE
    _OUT = flags.DEFINE_string("out", "results/scores", "Output folder.")
    _T = flags.DEFINE_integer("seq_len", 4096, "Sequence length of part 1 (per-element scores).")
    _HEADS = flags.DEFINE_integer("heads", 8, "Heads of part 1.")
    _TA = flags.DEFINE_integer("additive_seq_len", 16384, "Sequence length of part 2 (additive); 0 skips it.")
    _HEADS_A = flags.DEFINE_integer("additive_heads", 4, "Heads of part 2.")
    _H = flags.DEFINE_integer("head_dim", 64, "Head dimension H.")
    _REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per cell and round (best kept).")
    _ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
    _CAP = flags.DEFINE_float("cap", 30.0, "The soft cap.")
    _NODES = flags.DEFINE_integer("graph_nodes", 4096, "Nodes of part 3 (scores on a graph's edges); 0 skips it.")
    _DEGREE = flags.DEFINE_integer("graph_degree", 10, "Random edges per node in part 3 (plus a self loop).")


def _qkv(T, N, H):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(x, (1, T, N, H), jnp.float32) for x in (kq, kk, kv))


def _fwd_bwd(attend, args):
    """(fn, args with the cotangent): the gradients for the fixed output cotangent (``harness.with_direction``)."""
    return harness.with_direction(attend, "fwd+bwd", tuple(args))


def _best(cells: dict) -> dict:
    """``{key: best seconds}`` of jitted ``(fn, args)`` cells, timed in ``--rounds`` interleaved rounds."""
    timed = harness.interleaved(
        {key: harness.blocking(fn, *args) for key, (fn, args) in cells.items()},
        rounds=_ROUNDS.value,
        repeats=_REPEATS.value,
        settle=True,
        progress=harness.progress,
    )
    return {key: t.best_s for key, t in timed.items()}


def per_element(T: int, N: int, H: int) -> list[dict]:
    q, k, v = _qkv(T, N, H)
    slopes = jnp.asarray(attnlab.positional.alibi_slopes(N), jnp.float32)
    score_list = (("dot", "dot"), ("softcap", scores.SoftCap(_CAP.value)),
                  ("alibi_mod", positional.Alibi().score(slopes=slopes)))  # fmt: skip
    cells = {}
    for mask_name, mask in (("full", None), ("causal", masks.causal())):
        for score_name, score in score_list:

            def attend(q, k, v, score=score, mask=mask):
                return kernels.blockwise_attention(q, k, v, mask=mask, score=score)

            for mode in harness.DIRECTIONS:
                fn, args = harness.with_direction(attend, mode, (q, k, v))
                cells[mask_name, score_name, mode] = (jax.jit(fn), args)
    print(f"part 1: {len(cells)} cells, {_ROUNDS.value} interleaved rounds of {_REPEATS.value} calls", flush=True)
    best = _best(cells)
    records = []
    for mask_name in ("full", "causal"):
        for mode in ("fwd", "fwd+bwd"):
            dot = best[mask_name, "dot", mode]
            for score_name, _ in score_list[1:]:
                s = best[mask_name, score_name, mode]
                records.append({"mask": mask_name, "mode": mode, "T": T, "heads": N, "H": H, "score": score_name,
                                "dot_s": dot, "score_s": s, "score_over_dot": s / dot})  # fmt: skip
                print(json.dumps(records[-1]), flush=True)
    return records


def _temp_gib(fn, args) -> float:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**30


def additive(T: int, N: int, H: int) -> dict:
    q, k, v = _qkv(T, N, H)
    w = jnp.asarray(np.random.default_rng(0).normal(0.0, H**-0.5, (N, H)), jnp.float32)
    add = scores.Additive(w)

    def tiled(q, k, v):
        return kernels.blockwise_attention(q, k, v, score=add)

    def dot(q, k, v):
        return kernels.blockwise_attention(q, k, v)

    def dense(q, k, v):
        return attnlab.attention_reference(q, k, v, score=add)

    spec = [jax.ShapeDtypeStruct((1, T, N, H), jnp.float32)] * 3
    spec2 = [jax.ShapeDtypeStruct((1, 2 * T, N, H), jnp.float32)] * 3
    print(f"part 2: compiled memory at T = {T} and {2 * T}", flush=True)
    mem = {
        "tiled_temp_gib": _temp_gib(*_fwd_bwd(tiled, spec)),
        "dense_temp_gib": _temp_gib(*_fwd_bwd(dense, spec)),
        "tiled_temp_gib_2T": _temp_gib(*_fwd_bwd(tiled, spec2)),
        "dot_temp_gib": _temp_gib(*_fwd_bwd(dot, spec)),
    }
    print(json.dumps(mem), flush=True)
    flops = {name: harness.useful_flops(T * T, N, H, "fwd+bwd", name) for name in ("additive", "dot")}
    out = {"T": T, "heads": N, "H": H, "mode": "fwd+bwd", **mem, "inputs_gib": 3 * 4 * T * N * H / 2**30}
    for name, fn in (("dot", dot), ("additive", tiled)):
        print(f"part 2: timing {name} fwd+bwd at T = {T} (one warm-up call, one timed)", flush=True)
        fwd_bwd, args = _fwd_bwd(fn, (q, k, v))
        s = harness.best_of(jax.jit(fwd_bwd), args, 1)
        out[f"{name}_s"], out[f"{name}_gflops"] = s, flops[name] / s / 1e9
        print(json.dumps({name: s}), flush=True)
    out["additive_over_dot_time"] = out["additive_s"] / out["dot_s"]
    return out


def _pair_table(s, q_idx, k_idx, table, kind):
    """Graphormer-style: a learned per-head term for the pair's relation (the kinds of its two nodes)."""
    return s + table[:, kind[q_idx] * 4 + kind[k_idx]]


def graph(T: int, degree: int, N: int, H: int) -> list[dict]:
    q, k, v = _qkv(T, N, H)
    senders, receivers = cases.random_graph(T, degree)
    mask = masks.graph_edges(jnp.asarray(senders), jnp.asarray(receivers), T)
    r = np.random.default_rng(1)
    table = scores.ScoreMod(
        _pair_table,
        jnp.asarray(r.normal(size=(N, 16)), jnp.float32),
        jnp.asarray(r.integers(0, 4, T), jnp.int32),
        head_axes=(0, None),
    )
    slopes = jnp.asarray(cases.alibi_slopes(N), jnp.float32)
    w = jnp.asarray(r.normal(size=(N, H)) / np.sqrt(H), jnp.float32)
    score_list = {"dot": "dot", "softcap": scores.SoftCap(_CAP.value),
                  "alibi_mod": positional.Alibi().score(slopes=slopes), "pair_table_mod": table,
                  "additive": scores.Additive(w)}  # fmt: skip
    cells, chosen = {}, {}
    for score_name, score in score_list.items():
        chosen[score_name] = attnlab.explain(q, k, v, mask=mask, score=score).implementation
        # the additive score on the blockwise kernel: a tanh per pair and head dim (about 8 G at 4,096 nodes)
        for impl in ("sparse",) if score_name == "additive" else ("sparse", "blockwise"):

            def attend(q, k, v, score=score, impl=impl):
                return attnlab.attention(q, k, v, mask=mask, score=score, implementation=impl)

            fn, args = _fwd_bwd(attend, (q, k, v))
            cells[score_name, impl] = (jax.jit(fn), args)
    print(f"part 3: {len(cells)} cells on {T} nodes, {len(senders)} edges, fwd+bwd", flush=True)
    best = _best(cells)
    records = []
    for score_name in score_list:
        sparse, blockwise = best[score_name, "sparse"], best.get((score_name, "blockwise"))
        records.append({"nodes": T, "edges": len(senders), "heads": N, "H": H, "mode": "fwd+bwd", "score": score_name,
                        "sparse_s": sparse, "blockwise_s": blockwise, "sparse_over_dot": sparse / best["dot", "sparse"],
                        "blockwise_over_sparse": None if blockwise is None else blockwise / sparse,
                        "dispatch": chosen[score_name]})  # fmt: skip
        print(json.dumps(records[-1]), flush=True)
    return records


def main(argv):
    del argv
    run = harness.Run()
    records = per_element(_T.value, _HEADS.value, _H.value) if _T.value else []
    add = additive(_TA.value, _HEADS_A.value, _H.value) if _TA.value else None
    on_graph = graph(_NODES.value, _DEGREE.value, _HEADS.value, _H.value) if _NODES.value else None
    out = Path(_OUT.value) / "scores.json"
    result = {"records": records, "additive": add, "graph": on_graph, "cap": _CAP.value}
    harness.write_json(out, result | run.finish())
    print(f"wrote {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
