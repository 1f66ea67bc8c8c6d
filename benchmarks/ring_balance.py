"""Causal ring attention: per-device work and step time, contiguous vs zig-zag layout.

Command (8 CPU host devices are forced when the script starts):

    python -m benchmarks.ring_balance --out benchmarks/results/cpu-2core-shared/ring_balance.json

For each layout (``attnlab.parallel.attention(..., seq_axis="sp", layout=...)`` on a mesh
``sp=8``) and mask it reports two things:

* The work, from the ring's static tile layouts (``attnlab.kernels.ring.pair_layouts``, the same
  tables the compiled program switches on): the tiles each device visits over the whole ring
  (non-EMPTY; PARTIAL ones also evaluate the mask), their max / mean (1.0 = balanced), and the
  lockstep critical path: the ring moves in steps that each end with a ``ppermute``, so a step
  lasts as long as its busiest device; the sum over steps of the largest per-device tile count,
  against the ideal total / D. These counts do not depend on the machine.
* For ``--time_masks``: the step time of the gradients for a fixed output cotangent (``harness.fwd_bwd``;
  forward + backward), jitted, after a warm-up call, median and best of ``--repeats`` calls (the layouts
  take turns), compile time apart. On a CPU whose 8 "host devices" share a few cores these times
  measure total work, not the critical path: they are not a speedup measurement; on 8 real devices
  the critical path is what a step waits for.

Writes one JSON object to ``--out`` and prints a table.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts: 8 CPU host devices
    flags_env = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags_env:
        os.environ["XLA_FLAGS"] = (flags_env + " --xla_force_host_platform_device_count=8").strip()

import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from attnlab import masks, parallel  # noqa: E402
from attnlab.kernels import BlockSizes  # noqa: E402
from attnlab.kernels import ring as ring_lib  # noqa: E402
from benchmarks import harness  # noqa: E402

FLAGS = flags.FLAGS
LAYOUTS = ring_lib.LAYOUTS


def define_flags():
    flags.DEFINE_string("out", "benchmarks/results/cpu-2core-shared/ring_balance.json", "Output JSON file.")
    flags.DEFINE_integer("devices", 8, "Ring size (mesh sp=devices).")
    flags.DEFINE_integer("seq_len", 2048, "T = S.")
    flags.DEFINE_integer("num_heads", 4, "Heads N.")
    flags.DEFINE_integer("head_dim", 64, "Head dim H.")
    flags.DEFINE_integer("block", 64, "Tile size (block_q = block_k), an upper bound.")
    flags.DEFINE_list("masks", ["causal", "full", "window"], "Masks: causal, full, window (±seq_len/16).")
    flags.DEFINE_integer("repeats", 10, "Timed calls per layout (layouts take turns).")
    flags.DEFINE_list("time_masks", ["causal"], "Masks whose forward + backward is also timed (others: counts only).")


def make_mask(name: str, T: int):
    return {"causal": masks.causal(), "full": None, "window": masks.window(T // 16, T // 16)}[name]


def work(mask, T: int, D: int, block: int, layout: str) -> dict:
    """Tile counts per device and the lockstep critical path, from the ring's static layouts."""
    lay, (Cq, bq), (Ck, bk) = ring_lib.pair_layouts(mask, T, T, D, BlockSizes(block, block), layout)
    visited = (lay != masks.EMPTY).sum((2, 3))  # [D, D]: tiles of pair (device, key shard)
    partial = (lay == masks.PARTIAL).sum((2, 3))
    per_device = visited.sum(1)
    # step r: device d holds key shard (d - r) mod D; the step lasts as long as its busiest device
    steps = [int(max(visited[d, (d - r) % D] for d in range(D))) for r in range(D)]
    classes = len({lay[d, s].tobytes() for d in range(D) for s in range(D) if lay[d, s].any()})
    return dict(
        tile=[bq, bk],
        chunk=[Cq, Ck],
        tiles_per_device=per_device.tolist(),
        partial_tiles_per_device=partial.sum(1).tolist(),
        max_tiles=int(per_device.max()),
        mean_tiles=float(per_device.mean()),
        max_over_mean=float(per_device.max() / per_device.mean()),
        step_max_tiles=steps,
        critical_path_tiles=int(sum(steps)),
        ideal_tiles=float(visited.sum() / D),
        critical_over_ideal=float(sum(steps) / (visited.sum() / D)),
        compiled_pair_classes=classes,
    )


def compile_step(mask, T: int, D: int, block: int, layout: str):
    """(compiled fwd+bwd, its inputs, compile seconds) for one layout."""
    mesh = parallel.make_mesh(f"sp={D}")
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    shape = (1, T, FLAGS.num_heads, FLAGS.head_dim)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in (k1, k2, k3))
    # sharded as q (the output's sharding); the cotangent every benchmark takes (harness.with_direction)
    args = tuple(parallel.shard(x, mesh, seq_axis="sp") for x in (q, k, v, harness.cotangent(shape, jnp.float32)))
    bs = BlockSizes(block, block)

    def fwd(q, k, v):
        return parallel.attention(q, k, v, mesh=mesh, seq_axis="sp", mask=mask, block_sizes=bs, layout=layout)

    t0 = time.perf_counter()
    compiled = jax.jit(harness.fwd_bwd(fwd)).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))  # warm-up
    return compiled, args, compile_s


def time_alternating(programs: dict, repeats: int) -> dict:
    """Times each compiled program ``repeats`` times, taking turns, so drifting load hits all alike."""
    runs = {key: harness.blocking(compiled, *args) for key, (compiled, args, _) in programs.items()}
    timed = harness.interleaved(runs, rounds=repeats)
    return {
        key: dict(compile_s=programs[key][2], step_s_median=t.median_s, step_s_best=t.best_s, step_s=list(t.times))
        for key, t in timed.items()
    }


def main(argv):
    del argv
    D, T, block = FLAGS.devices, FLAGS.seq_len, FLAGS.block
    if jax.device_count() < D:
        raise SystemExit(f"need {D} devices, have {jax.device_count()} (XLA_FLAGS was set after JAX started?)")
    rows, programs = [], {}
    for name in FLAGS.masks:
        mask = make_mask(name, T)
        for layout in LAYOUTS:
            rows.append(dict(mask=name, layout=layout, **work(mask, T, D, block, layout)))
            if name in FLAGS.time_masks:
                programs[name, layout] = compile_step(mask, T, D, block, layout)
    timings = time_alternating(programs, FLAGS.repeats)
    for row in rows:
        row.update(timings.get((row["mask"], row["layout"]), {}))
    result = dict(
        config=dict(
            devices=D,
            seq_len=T,
            batch=1,
            num_heads=FLAGS.num_heads,
            head_dim=FLAGS.head_dim,
            block=block,
            dtype="float32",
            repeats=FLAGS.repeats,
            timing="compiled programs called in turn, warm-up excluded",
            what="the gradients of q, k, v for a fixed normal output cotangent (harness.fwd_bwd): forward + backward",
        ),
        environment=harness.run_record()
        | dict(
            device_count=jax.device_count(),
            cpu_count=os.cpu_count(),
            machine=platform.machine(),
            load_average_1m_at_end=os.getloadavg()[0],
            note="host devices share the CPU's cores: step times measure total work, not the critical path",
        ),
        rows=rows,
    )
    harness.write_json(FLAGS.out, result)
    print(table(result))


def table(result: dict) -> str:
    head = (
        "| mask | layout | tiles per device | max/mean | lockstep critical path (ideal) "
        "| step fwd+bwd median (best) | compile |"
    )
    lines = [head, "|" + "---|" * 7]
    for r in result["rows"]:
        timing = f"{r['step_s_median'] * 1e3:.0f} ms ({r['step_s_best'] * 1e3:.0f})" if "step_s_median" in r else "-"
        compile_s = f"{r['compile_s']:.1f} s" if "compile_s" in r else "-"
        lines.append(
            f"| {r['mask']} | {r['layout']} | {' '.join(map(str, r['tiles_per_device']))} | "
            f"{r['max_over_mean']:.2f} | {r['critical_path_tiles']} ({r['ideal_tiles']:.0f}) | {timing} | {compile_s} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    define_flags()
    app.run(main)
