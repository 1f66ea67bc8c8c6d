r"""A sparse mask ANDed with padding: traced lengths (every training step) against concrete ones.

``attention(..., mask=masks.bigbird(T) & masks.padding(kv_lengths=lengths))`` under ``jax.jit``,
with ``lengths`` a jit argument (traced) or closed over as numbers (concrete). Before the fix,
traced lengths hid the mask's block layout from tile selection (512 x 256 tiles, ~94% visited,
against 64 x 64 and ~22% with concrete lengths). Timed side by side, alternating, best of
``--repeats`` after a warm-up; prints the tiles each variant picks.

    PYTHONPATH=. python -m benchmarks.traced_padding --out benchmarks/results/cpu-2core-shared/traced_padding.json

``--label`` names the code measured (e.g. ``before`` with PYTHONPATH pointing at an older tree);
``--append`` adds to an existing JSON file instead of overwriting it.
"""

from __future__ import annotations

import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import attnlab
from attnlab import masks
from benchmarks import harness


def define_flags():
    """The command-line flags, defined only when run as a program (importing the module defines none)."""
    global _T, _B, _N, _H, _REPEATS, _OUT, _LABEL, _APPEND
    _T = flags.DEFINE_integer("T", 2048, "Sequence length (T = S).")
    _B = flags.DEFINE_integer("B", 2, "Batch.")
    _N = flags.DEFINE_integer("N", 4, "Heads.")
    _H = flags.DEFINE_integer("H", 64, "Head dim.")
    _REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds (best is reported).")
    _OUT = flags.DEFINE_string("out", None, "JSON file to write.")
    _LABEL = flags.DEFINE_string("label", "after", "Name of the code measured.")
    _APPEND = flags.DEFINE_bool("append", False, "Append to --out's records.")


def _tiles(mask, T):
    """(block sizes, fraction of tiles visited) that blockwise picks for this mask, where it can tell."""
    try:
        from attnlab.kernels import blockwise as bw

        bs = bw.pick_block_sizes(mask, T, T)
    except Exception:  # an older tree with another signature
        return None
    layout = mask.block_layout(T, T, bs.block_q, bs.block_k)
    return {"block_q": bs.block_q, "block_k": bs.block_k, "visited": round(float((layout != 0).mean()), 3)}


def _traced_tiles(bigbird, lengths, T):
    seen = {}

    def f(lengths):
        seen["tiles"] = _tiles(bigbird & masks.padding(kv_lengths=lengths), T)
        return lengths

    jax.eval_shape(f, jnp.asarray(lengths))
    return seen["tiles"]


def programs(q, k, v, bigbird, lengths) -> dict:
    """``{"fwd/concrete": (jitted fn, args), "fwd/traced", "fwd+bwd/concrete", "fwd+bwd/traced"}``: attention
    with ``bigbird & padding(kv_lengths=lengths)``, lengths closed over or a jit argument; forward+backward is
    the gradients for the fixed output cotangent (``harness.with_direction``)."""

    def concrete(q, k, v):
        return attnlab.attention(q, k, v, mask=bigbird & masks.padding(kv_lengths=lengths))

    def traced(q, k, v, lengths):
        return attnlab.attention(q, k, v, mask=bigbird & masks.padding(kv_lengths=lengths))

    fns = {}
    for mode in harness.DIRECTIONS:
        for name, f, args in (("concrete", concrete, (q, k, v)), ("traced", traced, (q, k, v, jnp.asarray(lengths)))):
            fn, args = harness.with_direction(f, mode, args)
            fns[f"{mode}/{name}"] = (jax.jit(fn), args)
    return fns


def main(_):
    T, B, N, H = _T.value, _B.value, _N.value, _H.value
    key = jax.random.key(0)
    q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32) for kk in jax.random.split(key, 3))
    lengths = np.array([T - T // 8, T // 2], np.int32)[:B]
    bigbird = masks.bigbird(T, block_size=64)
    fns = programs(q, k, v, bigbird, lengths)
    np.testing.assert_allclose(
        fns["fwd/traced"][0](*fns["fwd/traced"][1]), fns["fwd/concrete"][0](q, k, v), atol=1e-5, rtol=1e-5
    )
    runs = {name: harness.blocking(f, *args) for name, (f, args) in fns.items()}
    timed = harness.interleaved(runs, rounds=_REPEATS.value, settle=True)  # settle: the previous one's threads
    best = {n: 1e3 * t.best_s for n, t in timed.items()}
    compile_ms = {n: 1e3 * t.first_s for n, t in timed.items()}
    record = {
        "label": _LABEL.value,
        "shape": {"B": B, "T": T, "N": N, "H": H, "dtype": "float32"},
        "mask": "bigbird(T, block_size=64) & padding(kv_lengths=[7T/8, T/2])",
        "implementation": "attention(implementation=None)",
        "best_ms": {n: round(t, 2) for n, t in best.items()},
        "compile_ms": {n: round(t, 1) for n, t in compile_ms.items()},
        "traced_over_concrete": {d: round(best[f"{d}/traced"] / best[f"{d}/concrete"], 3) for d in ("fwd", "fwd+bwd")},
        "tiles": {
            "concrete": _tiles(bigbird & masks.padding(kv_lengths=lengths), T),
            "traced": _traced_tiles(bigbird, lengths, T),
        },
        **harness.run_record(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "repeats": _REPEATS.value,
    }
    print(json.dumps(record, indent=1))
    if _OUT.value:
        records = []
        if _APPEND.value and os.path.exists(_OUT.value):
            with open(_OUT.value) as f:
                records = json.load(f)
        harness.write_json(_OUT.value, records + [record])


if __name__ == "__main__":
    define_flags()
    app.run(main)
