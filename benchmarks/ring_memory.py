"""Per-device memory of ring attention on 8 devices vs blockwise attention on one, and the largest N each fits.

Command (8 CPU host devices are forced when the script starts; a few minutes on a 2-core CPU):

    python -m benchmarks.ring_memory --out results/ring_memory

For each sequence length N it compiles attention forward + backward (the gradients for an output
cotangent passed in, ``harness.fwd_bwd``) for B = 1, 8 heads, H = 64, fp32, causal mask, two ways:
``attnlab.parallel.attention`` with the sequence sharded over a mesh ``sp=8`` (ring attention), and
``attnlab.attention(..., implementation="blockwise")`` on one device. Nothing is run: the memory is
XLA's buffer assignment for the compiled program, per device (``compiled.memory_analysis()``:
temporaries + arguments + outputs - aliased), which is what a device must hold at its peak; CPU
devices report no runtime peak. Then it searches (doubling, then bisection on multiples of 8 x 256) the largest N
whose per-device memory fits ``--budget_gib`` for each.

Writes ``<out>/ring_memory.jsonl`` (one line per compiled program), ``<out>/summary.json``
(largest N in budget) and ``<out>/ring_memory.png`` (memory vs N, log-log, with the budget line).
Expected: both grow linearly in N (flash-style kernels keep no [T, S] array); the ring's
per-device memory is ~1/8 of blockwise's at the same N, so it fits ~8x longer sequences in the
same budget. ``--plot_only`` redraws the figure from the JSONL.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX starts: 8 CPU host devices
    flags_env = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags_env:
        os.environ["XLA_FLAGS"] = (flags_env + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import attnlab  # noqa: E402
from attnlab import masks, parallel  # noqa: E402
from benchmarks import harness  # noqa: E402
from experiments import common

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("out", "results/ring_memory", "Output folder.")
    flags.DEFINE_list("seq_lens", ["2048", "4096", "8192", "16384", "32768", "65536"], "N to tabulate.")
    flags.DEFINE_integer("devices", 8, "Ring size (mesh sp=devices).")
    flags.DEFINE_integer("num_heads", 8, "Heads N.")
    flags.DEFINE_integer("head_dim", 64, "Head dim H.")
    flags.DEFINE_string("mask", "causal", "causal or full.")
    flags.DEFINE_float("budget_gib", 1.0, "Per-device memory budget for the largest-N search (GiB).")
    flags.DEFINE_bool("search", True, "Search the largest N in budget.")
    flags.DEFINE_bool("plot_only", False, "Only redraw the plot from <out>/ring_memory.jsonl.")


def per_device_bytes(method: str, n: int, *, devices: int, heads: int, head_dim: int, mask_name: str) -> dict:
    """Compiles fwd+bwd for one (method, N) and returns XLA's per-device memory analysis."""
    mask = masks.causal() if mask_name == "causal" else None
    shape = (1, n, heads, head_dim)  # [B, T, N, H]
    if method == "ring":
        mesh = parallel.make_mesh({"sp": devices})
        x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "sp", None, None)))

        def attend(q, k, v):
            return parallel.attention(q, k, v, mesh=mesh, seq_axis="sp", mask=mask)
    else:
        x = jax.ShapeDtypeStruct(shape, jnp.float32)

        def attend(q, k, v):
            return attnlab.attention(q, k, v, mask=mask, implementation="blockwise")

    t0 = time.perf_counter()  # the gradients for an output cotangent passed in (sharded as q), as every benchmark
    compiled = jax.jit(harness.fwd_bwd(attend)).lower(x, x, x, x).compile()
    ma = compiled.memory_analysis()
    cm = common.compiled_memory(compiled)  # the one formula: temp + arguments + outputs - aliased
    return dict(
        method=method,
        seq_len=n,
        devices=devices if method == "ring" else 1,
        num_heads=heads,
        head_dim=head_dim,
        mask=mask_name,
        dtype="float32",
        mode="fwd_bwd",
        per_device_bytes=cm["peak_bytes"],
        temp_bytes=cm["temp_bytes"],
        argument_bytes=int(ma.argument_size_in_bytes),
        output_bytes=int(ma.output_size_in_bytes),
        compile_s=time.perf_counter() - t0,
        source=cm["memory_source"],
        jax=jax.__version__,
        backend=jax.default_backend(),
    )


def largest_fitting(measure, budget: int, start: int, step: int) -> tuple[int, list[dict]]:
    """Largest multiple of ``step`` whose ``measure(n)["per_device_bytes"] <= budget`` (memory grows with n)."""
    records = []

    def fits(n):
        r = measure(n)
        records.append(r)
        logging.info("%s N=%d: %.1f MiB", r["method"], n, r["per_device_bytes"] / 2**20)
        return r["per_device_bytes"] <= budget

    lo, hi = 0, start
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > step:  # invariant: lo fits (or is 0), hi does not
        mid = (lo + hi) // 2 // step * step
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, records


def plot(records: list[dict], out: str, budget_gib: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, label in (("ring", "ring, per device (sp=8)"), ("blockwise", "blockwise, 1 device")):
        pts = sorted({r["seq_len"]: r["per_device_bytes"] for r in records if r["method"] == method}.items())
        if pts:
            ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], "o-", label=label)
    ax.axhline(budget_gib * 1024, color="gray", ls="--", label=f"{budget_gib:g} GiB budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("memory per device, MiB (fwd+bwd, compiled)")
    ax.set_title("Causal attention, 8 heads x 64, fp32")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "ring_memory.png")
    fig.savefig(path, dpi=120)
    return path


def main(argv):
    del argv
    os.makedirs(FLAGS.out, exist_ok=True)
    path = os.path.join(FLAGS.out, "ring_memory.jsonl")
    if FLAGS.plot_only:
        with open(path) as f:
            records = [json.loads(line) for line in f]
        print("wrote", plot(records, FLAGS.out, FLAGS.budget_gib))
        return
    if jax.device_count() < FLAGS.devices:
        raise ValueError(f"--devices={FLAGS.devices} but JAX sees {jax.device_count()}")
    kw = dict(devices=FLAGS.devices, heads=FLAGS.num_heads, head_dim=FLAGS.head_dim, mask_name=FLAGS.mask)
    records = []

    def save():
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    for n in map(int, FLAGS.seq_lens):
        for method in ("ring", "blockwise"):
            r = per_device_bytes(method, n, **kw)
            records.append(r)
            save()
            logging.info(
                "%9s N=%6d: %8.1f MiB per device (compile %.1f s)",
                method,
                n,
                r["per_device_bytes"] / 2**20,
                r["compile_s"],
            )
    summary = dict(budget_gib=FLAGS.budget_gib, **kw)
    if FLAGS.search:
        budget = int(FLAGS.budget_gib * 2**30)
        step = 256 * FLAGS.devices
        for method in ("blockwise", "ring"):
            n, recs = largest_fitting(lambda n, m=method: per_device_bytes(m, n, **kw), budget, 65536, step)
            records.extend(recs)
            save()
            summary[f"largest_n_{method}"] = n
            logging.info("largest N in %.2f GiB: %s %d", FLAGS.budget_gib, method, n)
    with open(os.path.join(FLAGS.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    print("N       ring MiB/device   blockwise MiB   ratio")
    for n in map(int, FLAGS.seq_lens):
        rr = next(r for r in records if r["method"] == "ring" and r["seq_len"] == n)
        rb = next(r for r in records if r["method"] == "blockwise" and r["seq_len"] == n)
        print(
            f"{n:<7d} {rr['per_device_bytes'] / 2**20:14.1f} {rb['per_device_bytes'] / 2**20:15.1f} "
            f"{rb['per_device_bytes'] / rr['per_device_bytes']:7.2f}"
        )
    print("wrote", path, plot(records, FLAGS.out, FLAGS.budget_gib))


if __name__ == "__main__":
    define_flags()
    sys.exit(app.run(main))
