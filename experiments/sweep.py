"""Time attention over sequence length x head count x implementation.

Command (what `make sweep` runs, a couple of minutes on a 2-core CPU):

    python -m experiments.sweep --out results/sweep

Other shapes, e.g. a longer sweep on a GPU:

    python -m experiments.sweep --seq_lens=1024,4096,16384 --num_heads=8,16 --mask=causal --out results/gpu

Writes ``results.jsonl`` (one line per cell: config, median/min time over repeats after a warm-up
call, compile time, useful GFLOP/s, backend, device, versions) and ``sweep.png`` (time vs sequence
length, log-log, one line per implementation and head count) into ``--out``, and prints a table.

The figure to expect on a 2-core CPU: every curve bends to slope 2 on the log-log plot (attention
is quadratic in N); "xla" (``jax.nn.dot_product_attention``) is about 2x faster than the fp32
reference at N >= 1K; time grows linearly with the number of heads.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

import attnlab
from attnlab import masks

FLAGS = flags.FLAGS
flags.DEFINE_list("seq_lens", ["128", "256", "512", "1024", "2048"], "Sequence lengths N (T = S = N).")
flags.DEFINE_list("num_heads", ["1", "4", "8"], "Head counts.")
flags.DEFINE_list("implementations", ["reference", "xla"], "attnlab.attention implementations.")
flags.DEFINE_integer("head_dim", 64, "Head dimension H.")
flags.DEFINE_integer("batch", 1, "Batch size B.")
flags.DEFINE_enum("mask", "full", ["full", "causal"], "Mask for every cell.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Input dtype.")
flags.DEFINE_integer("repeats", 5, "Timed calls per cell (after one warm-up call).")
flags.DEFINE_string("out", "results/sweep", "Output folder for results.jsonl and sweep.png.")


def useful_flops(batch, n, heads, head_dim, mask):
    """Forward FLOPs of the two matmuls, counting only the (t, s) pairs the mask allows."""
    pairs = n * n if mask == "full" else n * (n + 1) // 2
    return 4 * batch * heads * head_dim * pairs  # 2 (mul+add) x 2 matmuls (QK^T and AV)


def time_cell(impl, n, heads, *, head_dim, batch, mask, dtype, repeats):
    """Compiles and times one cell; returns the result record (without the environment)."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    shape = (batch, n, heads, head_dim)  # [B, T, N, H]
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in (k1, k2, k3))
    m = masks.causal() if mask == "causal" else None
    fn = jax.jit(lambda q, k, v: attnlab.attention(q, k, v, mask=m, implementation=impl))

    t0 = time.perf_counter()
    compiled = fn.lower(q, k, v).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(q, k, v))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - t0)
    flops = useful_flops(batch, n, heads, head_dim, mask)
    return dict(
        implementation=impl,
        seq_len=n,
        num_heads=heads,
        head_dim=head_dim,
        batch=batch,
        mask=mask,
        dtype=jnp.dtype(dtype).name,
        repeats=repeats,
        compile_s=compile_s,
        median_ms=1e3 * statistics.median(times),
        min_ms=1e3 * min(times),
        useful_gflops=flops / min(times) / 1e9,
    )


def environment():
    dev = jax.devices()[0]
    return dict(
        backend=jax.default_backend(),
        device_kind=dev.device_kind,
        jax=jax.__version__,
        jaxlib=jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        host_cpus=os.cpu_count(),
        python=platform.python_version(),
    )


def run_sweep(
    seq_lens,
    num_heads,
    implementations,
    *,
    head_dim=64,
    batch=1,
    mask="full",
    dtype="float32",
    repeats=5,
    out="results/sweep",
    plot=True,
):
    """Runs every cell, prints progress and a table, writes results.jsonl (+ sweep.png)."""
    os.makedirs(out, exist_ok=True)
    env = environment()
    cells = [(impl, n, h) for h in num_heads for impl in implementations for n in seq_lens]
    records = []
    start = time.perf_counter()
    for i, (impl, n, h) in enumerate(cells, 1):
        rec = time_cell(impl, n, h, head_dim=head_dim, batch=batch, mask=mask, dtype=dtype, repeats=repeats)
        rec.update(env)
        records.append(rec)
        elapsed = time.perf_counter() - start
        print(
            f"[{i}/{len(cells)}] {impl:>9s} N={n:<6d} heads={h:<3d} {rec['min_ms']:9.2f} ms "
            f"{rec['useful_gflops']:7.1f} GF/s  (elapsed {elapsed:.0f}s)",
            flush=True,
        )
    path = os.path.join(out, "results.jsonl")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    print_table(records)
    if plot:
        plot_records(records, os.path.join(out, "sweep.png"))
    print(f"wrote {path}" + (f" and {os.path.join(out, 'sweep.png')}" if plot else ""))
    return records


def print_table(records):
    head = ("impl", "heads", "N", "min ms", "med ms", "GF/s", "compile s")
    print("\n" + " ".join(f"{h:>{w}s}" for h, w in zip(head, (10, 5, 6, 9, 9, 7, 9), strict=True)))
    for r in records:
        print(
            f"{r['implementation']:>10s} {r['num_heads']:>5d} {r['seq_len']:>6d} {r['min_ms']:>9.2f} "
            f"{r['median_ms']:>9.2f} {r['useful_gflops']:>7.1f} {r['compile_s']:>9.2f}"
        )


def plot_records(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    impls = sorted({r["implementation"] for r in records})
    heads = sorted({r["num_heads"] for r in records})
    styles = ["-", "--", ":", "-."]  # line style = implementation, colour = head count
    for i, impl in enumerate(impls):
        for j, h in enumerate(heads):
            rs = sorted(
                (r for r in records if (r["implementation"], r["num_heads"]) == (impl, h)),
                key=lambda r: r["seq_len"],
            )
            ax.plot(
                [r["seq_len"] for r in rs],
                [r["min_ms"] for r in rs],
                marker="o",
                color=f"C{j}",
                linestyle=styles[i % len(styles)],
                label=f"{impl}, {h} heads",
            )
    r0 = records[0]
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length N (T = S)",
        ylabel="time per call (ms, best)",
        title=f"attention fwd, {r0['mask']} mask, H={r0['head_dim']}, B={r0['batch']}, {r0['dtype']}\n"
        f"{r0['backend']} ({r0['device_kind']}, {r0['host_cpus']} host CPUs), jax {r0['jax']}",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    run_sweep(
        [int(n) for n in FLAGS.seq_lens],
        [int(h) for h in FLAGS.num_heads],
        FLAGS.implementations,
        head_dim=FLAGS.head_dim,
        batch=FLAGS.batch,
        mask=FLAGS.mask,
        dtype=FLAGS.dtype,
        repeats=FLAGS.repeats,
        out=FLAGS.out,
    )


if __name__ == "__main__":
    sys.exit(app.run(main))
