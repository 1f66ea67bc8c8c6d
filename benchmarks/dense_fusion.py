r"""Dense XLA on the CPU: which of the dense program's three forms is faster, by size.

``attnlab.impls.xla.dense_attention(..., form=...)`` has three forms of jax.nn's dense program:
``"mapped"``, jax.nn's own (mapped over the query heads of a key head); ``"fused"``, with one query head
per key head and no map, which XLA:CPU compiles to one kernel for both products and the softmax; and
``"key_major"``, for few query rows, k and v read in their own layout (the queries a block-diagonal
matrix). None is faster everywhere. This sweep times the three, and ``jax.nn.dot_product_attention``
itself, on the same calls (B x N x T, T = S or, with ``--kv_lengths``, S keys, N = K, fp32, no mask),
forward and forward+backward (the gradients of q, k and v for a fixed normal cotangent,
``harness.with_direction``), in alternating rounds (``harness.alternate_best``), outputs checked equal
first. Each record has ``ratio`` = fused ms / mapped ms (below 1: fused is faster), ``key_major_ratio`` =
key-major ms / the better of the other two, the query rows ``B * N * T`` and the form the rule
``xla.dense_form`` picks (``FUSED_MAX_ROWS``, ``KEY_MAJOR_SIZES``).

    make dense-fusion                                     # -> results/dense_fusion/dense_fusion.json
    PYTHONPATH=. python -m benchmarks.dense_fusion --smoke --out /tmp/dense_fusion   # seconds

Cross-attention (few query rows, many keys; ~5 min each), ``dense_fusion_cross*.json``:

    python -m benchmarks.dense_fusion --batch 2,8 --heads 8 --lengths 1,16,128 --kv_lengths 512,2048 \
        --dims 64 --out results/dense_fusion_cross

Decoding and pooling (one to eight query rows), ``dense_key_major*.json``:

    python -m benchmarks.dense_fusion --batch 1,8 --heads 8 --lengths 1,2,4,8 --kv_lengths 128,512,2048,8192 \
        --dims 64 --out results/dense_key_major

The default grid on an AVX2 host is ``dense_fusion_avx2.json``. Figures: the tables ``dense-fusion``,
``dense-fusion-avx2``, ``dense-fusion-cross`` and ``dense-key-major`` in docs/kernels.md (``python -m
experiments.docs --write``).
"""

from __future__ import annotations

import functools
import itertools
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from attnlab.impls import xla
from benchmarks import harness

_OUT = _SMOKE = _REPEATS = _ROUNDS = _BATCH = _HEADS = _LENGTHS = _KV_LENGTHS = _DIMS = None


def define_flags():
    """The command line's flags (defined when run as a program, so importing this module defines none)."""
    global _OUT, _SMOKE, _REPEATS, _ROUNDS, _BATCH, _HEADS, _LENGTHS, _KV_LENGTHS, _DIMS
    _OUT = flags.DEFINE_string("out", "results/dense_fusion", "Folder for dense_fusion.json.")
    _SMOKE = flags.DEFINE_bool("smoke", False, "Two tiny calls (for the test).")
    _REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per round (more for sub-0.1 s calls).")
    _ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating rounds (more for sub-0.1 s calls).")
    _BATCH = flags.DEFINE_list("batch", ["1", "2", "4", "8"], "B.")
    _HEADS = flags.DEFINE_list("heads", ["4", "8"], "N = K.")
    _LENGTHS = flags.DEFINE_list("lengths", ["64", "128", "256", "384"], "T (and S unless --kv_lengths).")
    _KV_LENGTHS = flags.DEFINE_list("kv_lengths", [], "S, each with every T (cross-attention); empty: S = T.")
    _DIMS = flags.DEFINE_list("dims", ["32", "64"], "H.")


def _jax_nn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


FORMS = {form: functools.partial(xla.dense_attention, form=form) for form in xla.FORMS} | {"jax.nn": _jax_nn}


# The key-major form is timed up to this many query rows only: its products grow with T * K, and at T = 8 it
# was already up to 3x the other forms' time over a small k (dense_key_major*.json); the default grid starts
# at T = 64.
KEY_MAJOR_MAX_TIMED_T = 16


def cell(B, N, T, S, H, direction, *, rounds, repeats):
    """One call's record: the forms' best ms, fused / mapped, key-major / the better of those two (where timed:
    ``KEY_MAJOR_MAX_TIMED_T``), the rule's choice."""
    keys = jax.random.split(jax.random.key(T), 3)
    args = tuple(jax.random.normal(kk, (B, L, N, H), jnp.float32) for kk, L in zip(keys, (T, S, S), strict=True))
    fns = {}
    forms = {n: f for n, f in FORMS.items() if n != "key_major" or T <= KEY_MAJOR_MAX_TIMED_T}
    for name, fwd in forms.items():
        fn, fargs = harness.with_direction(fwd, direction, args)
        fns[name] = jax.jit(fn)
    t0 = time.perf_counter()
    outs = {name: jax.block_until_ready(f(*fargs)) for name, f in fns.items()}
    compile_s = time.perf_counter() - t0
    best = harness.alternate_best(fns, fargs, rounds=rounds, repeats=repeats)
    return {
        "B": B,
        "N": N,
        "T": T,
        "S": S,
        "H": H,
        "direction": direction,
        "rows": B * N * T,
        **{f"{name}_ms": round(best[name] * 1e3, 4) for name in forms},
        "ratio": round(best["fused"] / best["mapped"], 3),
        **(
            {"key_major_ratio": round(best["key_major"] / min(best["fused"], best["mapped"]), 3)}
            if "key_major" in best
            else {}
        ),
        "mapped_over_jax_nn": round(best["mapped"] / best["jax.nn"], 3),
        "rule_form": xla.dense_form(B, N, N, T, S, H, "cpu"),
        "max_abs_diff": max(harness.max_abs_diff(outs["fused"], o) for o in outs.values()),
        "compile_and_first_s": round(compile_s, 2),
    }


def main(_):
    if _SMOKE.value:
        grid = [(1, 2, 16, 16, 8), (2, 2, 16, 16, 8)]
    else:
        B, N, T, H = ([int(x) for x in f.value] for f in (_BATCH, _HEADS, _LENGTHS, _DIMS))
        kv = [int(x) for x in _KV_LENGTHS.value]
        grid = [(b, n, t, s, h) for b, n, t, h in itertools.product(B, N, T, H) for s in (kv or [t])]
    grid = [(*g, d) for g in grid for d in ("fwd", "fwd+bwd")]

    def line(B, N, T, S, H, d, rec):
        km = ""
        if "key_major_ms" in rec:
            km = f"key-major {rec['key_major_ms']:8.3f} ms ({rec['key_major_ratio']:5.2f})  "
        return (
            f"B={B} N={N} T={T:4d} S={S:4d} H={H} {d:8s} fused {rec['fused_ms']:8.3f} ms  "
            f"mapped {rec['mapped_ms']:8.3f} ms  jax.nn {rec['jax.nn_ms']:8.3f} ms  ratio {rec['ratio']:5.2f}  "
            f"{km}rows {rec['rows']:6d}  rule {rec['rule_form']}"
        )

    measure = functools.partial(cell, rounds=_ROUNDS.value, repeats=_REPEATS.value)
    harness.sweep(grid, measure, f"{_OUT.value}/dense_fusion.json", line, fused_max_rows=xla.FUSED_MAX_ROWS)


if __name__ == "__main__":
    define_flags()
    app.run(main)
