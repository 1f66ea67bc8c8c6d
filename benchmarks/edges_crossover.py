r"""Where the edge-list kernel pays off on the CPU: sparse and blockwise on the same graph.

A graph given as ``masks.graph_edges`` runs on the edge-list kernel (``implementation="sparse"``:
gathers and segment sums, O(E)) or on the blockwise kernel (dense tiles over the graph's non-empty 64 x
64 blocks, O(visited pairs)). Which is faster depends on how many pairs the blockwise kernel visits per
edge: ``pairs_per_edge`` = the pairs of the non-empty tiles (``blockwise.visited_share`` x T x S) over
E. This times both on random graphs (no block is empty: the pairs are T x S) of growing density and on
block-diagonal "molecule" batches (components of 30 nodes), for the dot product and SoftCap (both
through the kernel's chunked custom backward; SoftCap's change of the dot product differentiated by jax,
per chunk), forward+backward (the gradients for a fixed normal output cotangent), 8 heads, H = 64 (other
head shapes with ``--heads`` / ``--head_dim``), fp32, in alternating rounds (``harness.alternate_best``),
outputs checked equal first. Each record has ``ratio`` = blockwise ms / sparse ms (above 1: sparse is
faster) and what ``implementation=None`` chooses; ``attnlab.impls.sparse.MIN_PAIRS_PER_EDGE`` (per H) comes from it.

    make edges-crossover                                    # -> results/edges_crossover/edges_crossover.json
    make edges-crossover EDGES_CROSSOVER_FLAGS="--heads=4 --head_dim=16" EDGES_CROSSOVER_OUT=results/ec_4x16
    PYTHONPATH=. python -m benchmarks.edges_crossover --smoke --out /tmp/ec   # seconds

Figure: the table ``edges_crossover`` in docs/kernels.md (``python -m experiments.docs --write``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import attnlab
from attnlab import masks, scores
from attnlab.impls.blockwise import visited_share
from benchmarks import cases, harness

_OUT = _SMOKE = _REPEATS = _ROUNDS = _HEADS = _HEAD_DIM = None


def _components(count: int, size: int, degree: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``count`` components of ``size`` nodes side by side, ``degree`` random edges per node inside its
    component, and every self loop (a batch of small graphs, as molecules are packed)."""
    r = np.random.default_rng(seed)
    base = np.repeat(np.arange(count) * size, size * degree)
    inner = r.integers(0, size, (2, count * size * degree)) + base
    loops = np.arange(count * size)
    return (np.concatenate([inner[0], loops]).astype(np.int32), np.concatenate([inner[1], loops]).astype(np.int32))


# name ("random T xdegree", "molecules count x size xdegree": _nodes reads T) -> () -> (senders, receivers)
GRAPHS = {
    **{f"random {T} x{d}": functools.partial(cases.random_graph, T, d) for T, d in
       ((1024, 4), (1024, 16), (1024, 64), (1024, 256), (2048, 8), (2048, 32), (2048, 128), (4096, 10))},
    **{f"molecules 64 x 30 x{d}": functools.partial(lambda d: _components(64, 30, d), d) for d in (1, 3, 8)},
    # --smoke's
    "random 256 x4": functools.partial(cases.random_graph, 256, 4),
    "molecules 8 x 30 x3": functools.partial(_components, 8, 30, 3),
}  # fmt: skip
SMOKE = ("random 256 x4", "molecules 8 x 30 x3")
SCORES = {"dot": lambda: "dot", "softcap": lambda: scores.SoftCap(30.0)}
N, H = 8, 64


def _nodes(graph: str) -> int:
    words = graph.split()
    return int(words[1]) if words[0] == "random" else int(words[1]) * int(words[3])


def define_flags():
    """The command line's flags (defined when run as a program, so importing this module defines none)."""
    global _OUT, _SMOKE, _REPEATS, _ROUNDS, _HEADS, _HEAD_DIM
    _OUT = flags.DEFINE_string("out", "results/edges_crossover", "Folder for edges_crossover.json.")
    _SMOKE = flags.DEFINE_bool("smoke", False, "One small graph per kind, tiny heads unless named (for the test).")
    _REPEATS = flags.DEFINE_integer("repeats", 2, "Timed calls per round.")
    _ROUNDS = flags.DEFINE_integer("rounds", 2, "Alternating rounds.")
    _HEADS = flags.DEFINE_integer("heads", N, "Query (= key) heads.")
    _HEAD_DIM = flags.DEFINE_integer("head_dim", H, "H, the head dimension.")


def cell(graph, score_name, *, rounds, repeats, heads=N, head_dim=H):
    senders, receivers = GRAPHS[graph]()
    T = _nodes(graph)
    mask = masks.graph_edges(jnp.asarray(senders), jnp.asarray(receivers), T)
    q, k, v = (jax.random.normal(key, (1, T, heads, head_dim)) for key in jax.random.split(jax.random.key(T), 3))
    score = SCORES[score_name]()
    fns, args = harness.directed(
        {
            i: functools.partial(attnlab.attention, mask=mask, score=score, implementation=i)
            for i in ("sparse", "blockwise")
        },
        "fwd+bwd",
        (q, k, v),
    )
    outs = {impl: jax.block_until_ready(f(*args)) for impl, f in fns.items()}
    diff = harness.max_abs_diff(outs["sparse"], outs["blockwise"])
    best = harness.alternate_best(fns, args, rounds=rounds, repeats=repeats)
    visited = visited_share(mask, T, T, "cpu") * T * T
    return {
        "graph": graph, "nodes": T, "edges": len(senders), "score": score_name, "heads": heads, "H": head_dim,
        "mode": "fwd+bwd", "visited_pairs": int(round(visited)), "pairs_per_edge": round(visited / len(senders), 1),
        "sparse_ms": round(best["sparse"] * 1e3, 3), "blockwise_ms": round(best["blockwise"] * 1e3, 3),
        "ratio": round(best["blockwise"] / best["sparse"], 3),
        "chosen": attnlab.explain(q, k, v, mask=mask, score=score).implementation, "max_abs_diff": diff,
    }  # fmt: skip


def main(_):
    graphs = list(SMOKE) if _SMOKE.value else [g for g in GRAPHS if g not in SMOKE]
    grid = [(g, s) for g in graphs for s in SCORES]

    def line(g, s, rec):
        return (
            f"{g:22s} {s:8s} E={rec['edges']:7d} pairs/edge {rec['pairs_per_edge']:7.1f}  "
            f"sparse {rec['sparse_ms']:9.1f} ms  blockwise {rec['blockwise_ms']:9.1f} ms  "
            f"ratio {rec['ratio']:5.2f}  chosen {rec['chosen']}"
        )

    def named_or(flag, smoke_value):  # --smoke: tiny heads unless the command line names them
        return flag.value if flag.present or not _SMOKE.value else smoke_value

    size = dict(heads=named_or(flags.FLAGS["heads"], 2), head_dim=named_or(flags.FLAGS["head_dim"], 16))
    measure = functools.partial(cell, rounds=_ROUNDS.value, repeats=_REPEATS.value, **size)
    harness.sweep(grid, measure, f"{_OUT.value}/edges_crossover.json", line)


if __name__ == "__main__":
    define_flags()
    app.run(main)
