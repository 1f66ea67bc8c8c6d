r"""Dense XLA on the CPU: the program fused into one kernel, or mapped over the group as jax.nn's, by size.

With one query head per key head, jax.nn's dense program written without jax.nn's map over the group
(``attnlab.impls.xla.dense_attention(..., fuse=True)``) compiles on XLA:CPU to one kernel for both
products and the softmax; with the map (``fuse=False``) to jax.nn's kernels. Neither is faster
everywhere. This sweep times both, and ``jax.nn.dot_product_attention`` itself, on the same calls
(B x N x T, T = S, H = 32 and 64, fp32, no mask), forward and forward+backward (the gradients of q, k
and v for a fixed normal cotangent, ``contenders.with_direction``), in alternating rounds
(``harness.alternate_best``), outputs checked equal first. Each record has ``ratio`` = fused ms / mapped
ms (below 1: fused is faster), the query rows ``B * N * T`` and what the rule ``xla.fuses`` picks
(``FUSED_MAX_ROWS``).

    make dense-fusion                                     # -> results/dense_fusion/dense_fusion.json
    PYTHONPATH=. python -m benchmarks.dense_fusion --smoke --out /tmp/dense_fusion   # seconds

Figure: the table ``dense-fusion`` in docs/kernels.md (``python -m experiments.docs --write``).
"""

from __future__ import annotations

import functools
import itertools
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from attnlab.impls import xla
from benchmarks import contenders, harness

_OUT = _SMOKE = _REPEATS = _ROUNDS = _BATCH = _HEADS = _LENGTHS = _DIMS = None


def define_flags():
    """The command line's flags (defined when run as a program, so importing this module defines none)."""
    global _OUT, _SMOKE, _REPEATS, _ROUNDS, _BATCH, _HEADS, _LENGTHS, _DIMS
    _OUT = flags.DEFINE_string("out", "results/dense_fusion", "Folder for dense_fusion.json.")
    _SMOKE = flags.DEFINE_bool("smoke", False, "Two tiny calls (for the test).")
    _REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per round (more for sub-0.1 s calls).")
    _ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating rounds (more for sub-0.1 s calls).")
    _BATCH = flags.DEFINE_list("batch", ["1", "2", "4", "8"], "B.")
    _HEADS = flags.DEFINE_list("heads", ["4", "8"], "N = K.")
    _LENGTHS = flags.DEFINE_list("lengths", ["64", "128", "256", "384"], "T = S.")
    _DIMS = flags.DEFINE_list("dims", ["32", "64"], "H.")


def _jax_nn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


FORMS = {
    "fused": functools.partial(xla.dense_attention, fuse=True),
    "mapped": functools.partial(xla.dense_attention, fuse=False),
    "jax.nn": _jax_nn,
}


def cell(B, N, T, H, direction, *, rounds, repeats):
    """One call's record: the three forms' best ms, fused / mapped, the rule's choice."""
    keys = jax.random.split(jax.random.key(T), 3)
    args = tuple(jax.random.normal(kk, (B, T, N, H), jnp.float32) for kk in keys)
    fns = {}
    for name, fwd in FORMS.items():
        fn, fargs = contenders.with_direction(fwd, direction, args)
        fns[name] = jax.jit(fn)
    t0 = time.perf_counter()
    outs = {name: jax.block_until_ready(f(*fargs)) for name, f in fns.items()}
    compile_s = time.perf_counter() - t0
    best = harness.alternate_best(fns, fargs, rounds=rounds, repeats=repeats)
    return {
        "B": B,
        "N": N,
        "T": T,
        "H": H,
        "direction": direction,
        "rows": B * N * T,
        **{f"{name}_ms": round(best[name] * 1e3, 4) for name in FORMS},
        "ratio": round(best["fused"] / best["mapped"], 3),
        "mapped_over_jax_nn": round(best["mapped"] / best["jax.nn"], 3),
        "rule_fuses": xla.fuses(B, N, N, T, "cpu"),
        "max_abs_diff": max(harness.max_abs_diff(outs["fused"], o) for o in outs.values()),
        "compile_and_first_s": round(compile_s, 2),
    }


def main(_):
    if _SMOKE.value:
        grid = [(1, 2, 16, 8), (2, 2, 16, 8)]
    else:
        ints = [[int(x) for x in f.value] for f in (_BATCH, _HEADS, _LENGTHS, _DIMS)]
        grid = list(itertools.product(*ints))
    grid = [(*g, d) for g in grid for d in ("fwd", "fwd+bwd")]

    def line(B, N, T, H, d, rec):
        return (
            f"B={B} N={N} T={T:4d} H={H} {d:8s} fused {rec['fused_ms']:8.3f} ms  mapped {rec['mapped_ms']:8.3f} ms  "
            f"jax.nn {rec['jax.nn_ms']:8.3f} ms  ratio {rec['ratio']:5.2f}  rows {rec['rows']:6d}  "
            f"rule {'fused' if rec['rule_fuses'] else 'mapped'}"
        )

    measure = functools.partial(cell, rounds=_ROUNDS.value, repeats=_REPEATS.value)
    harness.sweep(grid, measure, f"{_OUT.value}/dense_fusion.json", line, fused_max_rows=xla.FUSED_MAX_ROWS)


if __name__ == "__main__":
    define_flags()
    app.run(main)
