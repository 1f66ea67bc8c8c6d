r"""What ``attnlab.autotune`` finds for the blockwise kernel on this CPU, and whether it beats the default tiles.

Per case (B = 1, 8 heads of 64, fp32, forward+backward: the gradients of q, k, v for a fixed normal output
cotangent), two steps:

1. ``attnlab.autotune(..., implementation="blockwise", direction="fwd_bwd", save=False)`` times the kernel's
   tile search space (``BlockwiseTuning.space``: rows 64-1024 by columns 64-512), smallest tiles first,
   within ``--budget_s`` per case; each candidate's best of ``--repeats`` is recorded.
2. The fastest candidate and the tiles the kernel picks with no tuned entry (``kernels.blockwise``'s
   ``pick_block_sizes``) are timed again in alternating rounds (``harness.alternate_best``), so the ratio
   best / default is read from one run where both met the same load.

    PYTHONPATH=. python -m benchmarks.tune_cpu --out results/tune_cpu.json
    PYTHONPATH=. python -m benchmarks.tune_cpu --cases causal --T 512 --budget_s 20 --out /tmp/tune.json

Writes the JSON (the run record, per case every candidate and the re-timed pair) and prints a table;
docs/kernels.md tables the committed runs (``experiments.dispatch_tables.tune_cpu``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from absl import app, flags

import attnlab
from attnlab import masks, tuning
from attnlab.call import bind
from attnlab.kernels import blockwise as kernel
from benchmarks import cases as cases_lib
from benchmarks import harness

# name -> (mask for T, default T)
CASES = {
    "full": (lambda T: None, 2048),
    "causal": (lambda T: masks.causal(), 4096),
    "window": (lambda T: masks.window(128, 128), 16384),
    "documents": (lambda T: masks.document(jnp.asarray(cases_lib.doc_ids(T, 16))), 4096),
}


def define_flags():
    """The command-line flags, defined only when run as a program (importing the module defines none)."""
    flags.DEFINE_list("cases", list(CASES), f"Cases, of {list(CASES)}.")
    flags.DEFINE_integer("T", 0, "Sequence length for every case (0: each case's own).")
    flags.DEFINE_integer("heads", 8, "Heads.")
    flags.DEFINE_integer("head_dim", 64, "Head dim.")
    flags.DEFINE_float("budget_s", 150.0, "autotune's time per case (candidates not started by then are dropped).")
    flags.DEFINE_integer("repeats", 2, "Timed calls per candidate in autotune (after its first).")
    flags.DEFINE_integer("rounds", 5, "Alternating rounds of the best against the default.")
    flags.DEFINE_string("out", "results/tune_cpu.json", "Result JSON.")


def _tiles(bs) -> dict:
    return {"block_q": bs.block_q, "block_k": bs.block_k}


def tune_case(name: str, T: int, N: int, H: int, *, budget_s: float, repeats: int, rounds: int) -> dict:
    """One case's autotune rows and the re-timed best against the default tiles."""
    mask = CASES[name][0](T)
    q, k, v = (jax.random.normal(jax.random.key(i), (1, T, N, H), jnp.float32) for i in range(3))
    call = bind(q, k, v, mask=mask)
    picked = kernel.pick_block_sizes(call.tile_mask, T, T)
    default = kernel.BlockSizes(min(picked.block_q, T), min(picked.block_k, T))  # as the kernel runs them
    result = attnlab.autotune(
        q, k, v, mask=mask, implementation="blockwise", direction="fwd_bwd", repeats=repeats, budget_s=budget_s,
        save=False, verbose=True,
    )  # fmt: skip
    best = None if result.best is None else _tiles(result.best)
    row = dict(case=name, T=T, N=N, H=H, dtype="float32", direction="fwd+bwd", key=result.key.as_json(),
               default=_tiles(default), candidates=result.rows, best=best, autotune_best_ms=result.best_ms)  # fmt: skip
    if result.best is None:
        return row
    fns = {
        "default": lambda q, k, v: kernel.attend(dataclasses.replace(call, q=q, k=k, v=v)),
        "best": lambda q, k, v: kernel.attend(dataclasses.replace(call, q=q, k=k, v=v), block_sizes=result.best),
    }
    jitted, args = harness.directed(fns, "fwd+bwd", (q, k, v))
    best_s = harness.alternate_best(jitted, args, rounds=rounds, repeats=2)
    row |= dict(default_ms=1e3 * best_s["default"], best_ms=1e3 * best_s["best"],
                best_over_default=best_s["best"] / best_s["default"], rounds=rounds)  # fmt: skip
    harness.progress(f"{name} T={T}: default {default} {row['default_ms']:.1f} ms, best {result.best} "
                     f"{row['best_ms']:.1f} ms ({row['best_over_default']:.2f}x)")  # fmt: skip
    return row


def main(_):
    F = flags.FLAGS
    result = {"meta": harness.run_record() | {"tuning_device": tuning.device_kind("cpu")}, "rows": []}
    for name in F.cases:
        if name not in CASES:
            raise app.UsageError(f"--cases: unknown case {name!r}, expected some of {list(CASES)}")
        T = F.T or CASES[name][1]
        result["rows"].append(
            tune_case(name, T, F.heads, F.head_dim, budget_s=F.budget_s, repeats=F.repeats, rounds=F.rounds)
        )
        harness.write_json(F.out, result)  # after each case: a run cut short keeps what it measured
    from experiments import dispatch_tables  # noqa: PLC0415 (the docs' table of this file)

    print(dispatch_tables.tune_cpu_rows(result))


if __name__ == "__main__":
    define_flags()
    app.run(main)
