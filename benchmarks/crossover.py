r"""Where the blockwise kernel starts to pay off on the CPU: dense XLA and blockwise on the same call.

Dispatch on CPU sends a dot-product call to the blockwise kernel from ``BLOCKWISE_MIN_PAIRS`` (query,
key) pairs, and below that when its mask has an EMPTY tile and the kernel pays off by the rule this sweep
measured (``attnlab.impls.blockwise``). It times both implementations on the same calls, for masks with
EMPTY tiles (causal, windows, chunks), T = S from 128 to 1024, fp32 and bf16, forward and
forward+backward (the gradients for a fixed normal output cotangent, ``harness.with_direction``), in
alternating rounds (``harness.alternate_best``), outputs checked equal first. Each record has ``ratio`` =
xla ms / blockwise ms (above 1: blockwise is faster), the share of the ``[T, S]`` pairs that the kernel's
non-empty 64 x 64 tiles cover (``visited``: ``blockwise.visited_share``, what dispatch weighs), the share
the mask allows (``allowed``) and what ``implementation=None`` chooses.

    make crossover                                        # -> results/crossover/crossover.json
    PYTHONPATH=. python -m benchmarks.crossover --smoke --out /tmp/crossover   # seconds

Figure: the table ``crossover`` in docs/kernels.md (``python -m experiments.docs --write``).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from absl import app, flags

import attnlab
from attnlab import masks
from attnlab.impls.blockwise import visited_share
from benchmarks import harness

_OUT = _SMOKE = _REPEATS = _ROUNDS = _LENGTHS = _SHAPES = None

MASKS = {
    "causal": lambda: masks.causal(),
    "window ±32": lambda: masks.window(32, 32),
    "causal window 128": lambda: masks.causal() & masks.window(128, 0),
    "chunks 64": lambda: masks.chunks(64),
}

# name -> (B, N, K, H): jax's test shape (as the adopt benchmark's small rows), the same with one key
# head for every query head (GQA), and a shape with more work per pair
SHAPES = {"2x4x32": (2, 4, 4, 32), "2x4x32 K=1": (2, 4, 1, 32), "1x8x64": (1, 8, 8, 64)}


def define_flags():
    """The command line's flags (defined when run as a program, so importing this module defines none)."""
    global _OUT, _SMOKE, _REPEATS, _ROUNDS, _LENGTHS, _SHAPES
    _OUT = flags.DEFINE_string("out", "results/crossover", "Folder for crossover.json.")
    _SMOKE = flags.DEFINE_bool("smoke", False, "One tiny length, one mask, fp32 (for the test).")
    _REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per round (more for sub-0.1 s calls).")
    _ROUNDS = flags.DEFINE_integer("rounds", 2, "Alternating rounds (at least 4 for sub-0.1 s calls).")
    _LENGTHS = flags.DEFINE_list("lengths", ["128", "256", "384", "512", "768", "1024"], "T = S.")
    _SHAPES = flags.DEFINE_list("shapes", list(SHAPES), f"B x N x H (K=: key heads): any of {list(SHAPES)}.")


def cell(shape, T, mask_name, dtype, mode, *, rounds, repeats):
    B, N, K, H = SHAPES[shape]
    keys = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(keys[0], (B, T, N, H)).astype(dtype)
    k, v = (jax.random.normal(kk, (B, T, K, H)).astype(dtype) for kk in keys[1:])
    mask = MASKS[mask_name]()
    fns, args = harness.directed(
        {impl: functools.partial(attnlab.attention, mask=mask, implementation=impl) for impl in ("xla", "blockwise")},
        mode,
        (q, k, v),
    )  # forward+backward: the gradients for the fixed output cotangent
    t0 = time.perf_counter()
    outs = {impl: jax.block_until_ready(f(*args)) for impl, f in fns.items()}
    compile_s = time.perf_counter() - t0
    diff = harness.max_abs_diff(outs["xla"], outs["blockwise"])
    best = harness.alternate_best(fns, args, rounds=rounds, repeats=repeats)
    return {
        "shape": shape,
        "B": B,
        "N": N,
        "K": K,
        "H": H,
        "T": T,
        "mask": mask_name,
        "dtype": jnp.dtype(dtype).name,
        "mode": mode,
        "xla_ms": round(best["xla"] * 1e3, 4),
        "blockwise_ms": round(best["blockwise"] * 1e3, 4),
        "ratio": round(best["xla"] / best["blockwise"], 3),
        "visited": round(visited_share(mask, T, T, "cpu"), 4),
        "allowed": round(harness.allowed_pairs(mask, T) / (T * T), 4),
        "chosen": attnlab.explain(q, k, v, mask=mask).implementation,
        "max_abs_diff": diff,
        "compile_and_first_s": round(compile_s, 2),
    }


def main(_):
    smoke = _SMOKE.value
    lengths = [64] if smoke else [int(t) for t in _LENGTHS.value]
    shapes = _SHAPES.value[:1] if smoke else _SHAPES.value
    mask_names = ["causal"] if smoke else list(MASKS)
    dtypes = [jnp.float32] if smoke else [jnp.float32, jnp.bfloat16]
    grid = [(s, t, m, d, mode) for s in shapes for t in lengths for m in mask_names for d in dtypes
            for mode in harness.DIRECTIONS]  # fmt: skip

    def line(s, t, m, d, mode, rec):
        return (
            f"{s} T={t:5d} {m:18s} {rec['dtype']:8s} {mode:8s} xla {rec['xla_ms']:9.3f} ms  "
            f"blockwise {rec['blockwise_ms']:9.3f} ms  ratio {rec['ratio']:5.2f}  visited {rec['visited']:.2f}  "
            f"chosen {rec['chosen']}"
        )

    measure = functools.partial(cell, rounds=_ROUNDS.value, repeats=_REPEATS.value)
    harness.sweep(grid, measure, f"{_OUT.value}/crossover.json", line)


if __name__ == "__main__":
    define_flags()
    app.run(main)
