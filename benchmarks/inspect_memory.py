"""Memory of ``attnlab.inspect.capture`` of one query row vs the plain forward of one long encoder layer.

Command (compiles only, about a minute on a 2-core CPU; ``--run`` also executes both, minutes):

    python -m benchmarks.inspect_memory --out benchmarks/results/cpu-2core-shared/inspect_memory.json

Model: ``nn.Encoder`` with one layer, d_model 64, 4 heads (H = 16), no positions, full softmax
attention (the dispatcher's choice: blockwise at this length), B = 1, T = 32768 (``--seq_len``).
Three programs are compiled with ``jax.jit`` over ``nnx.split`` and their buffers read from XLA's
``compiled.memory_analysis()`` (temporaries + arguments + outputs - aliased: what the host must hold
at the program's peak):

* ``forward``: ``encoder(x)``;
* ``capture_row``: ``inspect.capture(encoder, x, rows=[T // 2], record=("weights",))``: the output,
  the weights of that one query row ``[1, N, 1, S]`` and every row's lse ``[1, T, N]``;
* ``capture_row_all``: the same with q, k, v and the per-head outputs recorded too.

"extra" is a program's total minus the forward's. The dense weights of this layer would be
``N T S`` fp32 = 16 GiB; capture refuses them beyond 4096 x 4096 pairs (pass ``rows=``).
With ``--run`` each program is also executed once in a fresh subprocess and its peak RSS
(``ru_maxrss``) recorded.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from attnlab import inspect, nn
from benchmarks import harness

FLAGS = flags.FLAGS
PROGRAMS = ("forward", "capture_row", "capture_row_all")


def define_flags():
    flags.DEFINE_string("out", "benchmarks/results/cpu-2core-shared/inspect_memory.json", "Output JSON.")
    flags.DEFINE_integer("seq_len", 32768, "T (= S).")
    flags.DEFINE_bool("run", False, "Also execute each program once in a subprocess and record its peak RSS.")
    flags.DEFINE_string("only", "", "Internal: run this one program and print its peak RSS (used by --run).")


def build(seq_len: int):
    enc = nn.Encoder(input_dim=8, d_model=64, num_layers=1, num_heads=4, posenc="none", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(enc)
    row = seq_len // 2

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    def capture_row(state, x):
        return inspect.capture(nnx.merge(graphdef, state), x, rows=[row], record=("weights",))

    def capture_row_all(state, x):
        return inspect.capture(nnx.merge(graphdef, state), x, rows=[row])

    x = jax.ShapeDtypeStruct((1, seq_len, 8), jnp.float32)
    return state, x, {"forward": forward, "capture_row": capture_row, "capture_row_all": capture_row_all}


def analyse(seq_len: int) -> dict:
    state, x, fns = build(seq_len)
    out = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(state, x).compile()
        m = compiled.memory_analysis()
        total = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        out[name] = {
            "temp_bytes": int(m.temp_size_in_bytes),
            "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "total_bytes": int(total),
            "compile_s": round(time.perf_counter() - t0, 2),
        }
    base = out["forward"]["total_bytes"]
    for name in out:
        out[name]["extra_bytes"] = out[name]["total_bytes"] - base
        out[name]["extra_mib"] = round(out[name]["extra_bytes"] / 2**20, 2)
    return out


def run_one(name: str, seq_len: int) -> None:
    state, x_struct, fns = build(seq_len)
    x = jax.random.normal(jax.random.key(0), x_struct.shape, x_struct.dtype)
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(fns[name])(state, x))
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps({"peak_rss_bytes": rss, "wall_s": round(wall, 2)}))


def main(argv):
    del argv
    if FLAGS.only:
        run_one(FLAGS.only, FLAGS.seq_len)
        return
    result = harness.run_record() | {
        "model": "nn.Encoder(input_dim=8, d_model=64, num_layers=1, num_heads=4, posenc='none'), full softmax",
        "seq_len": FLAGS.seq_len,
        "row": FLAGS.seq_len // 2,
        **harness.cpu_info(),  # also at the top level, where earlier results had them
        "compiled": analyse(FLAGS.seq_len),
        "dense_weights_bytes": 4 * FLAGS.seq_len * FLAGS.seq_len * 4,
    }
    if FLAGS.run:
        runs = {}
        for name in PROGRAMS:
            cmd = [sys.executable, "-m", "benchmarks.inspect_memory", f"--only={name}", f"--seq_len={FLAGS.seq_len}"]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs[name] = json.loads(line)
        base = runs["forward"]["peak_rss_bytes"]
        for r in runs.values():
            r["extra_rss_mib"] = round((r["peak_rss_bytes"] - base) / 2**20, 1)
        result["run"] = runs
    harness.write_json(FLAGS.out, result)
    print(json.dumps(result["compiled"], indent=1))
    if "run" in result:
        print(json.dumps(result["run"], indent=1))


if __name__ == "__main__":
    define_flags()
    app.run(main)
