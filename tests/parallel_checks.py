"""Multi-device checks for attnlab.parallel, run by tests/test_parallel.py in a subprocess.

JAX fixes its device count when it starts, and the test session has already started it with one
CPU device; this script runs in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and prints one JSON object (last line of
stdout): for each case, the largest error against ``attention_reference`` and the largest
reference magnitude, for outputs and for the gradients; the test module judges them with the
suite's tolerances. Every case is one jitted program (output and gradients together) to keep
compile time, which dominates here, small.

Run by hand: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel_checks.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import attnlab  # noqa: E402
from attnlab import masks, parallel  # noqa: E402
from attnlab.kernels import BlockSizes  # noqa: E402


def inputs(B, T, N, K, H, dtype, seed=0):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k1, (B, T, N, H)).astype(dtype)
    k = jax.random.normal(k2, (B, T, K, H)).astype(dtype)
    v = jax.random.normal(k3, (B, T, K, H)).astype(dtype)
    ct = jax.random.normal(k4, (B, T, N, H))  # cotangent: a fixed random projection of the output
    return q, k, v, ct


def errors(fn, ref_fn, q, k, v, ct, mask_list):
    """Per mask, one jitted program: output and (dq, dk, dv) of fn and of the fp32 reference.

    One program per mask, not one for all: XLA:CPU may run independent collectives of one
    program (several rings' ``ppermute`` loops, the gathers that slice off the padding) in a
    different order on different host devices, and they then wait for each other for ever.
    """

    def both(q, k, v, m):
        res = []
        for f in (fn, ref_fn):
            g = lambda q, k, v, f=f: jnp.sum(f(q, k, v, m).astype(jnp.float32) * ct)  # noqa: E731
            out = f(q, k, v, m)
            grads = jax.grad(g, argnums=(0, 1, 2))(q, k, v)
            res.append((out, grads))
        return res

    res = [r for m in mask_list for r in jax.jit(both)(q, k, v, m)]
    out = []
    for i in range(len(mask_list)):
        (o, g), (ro, rg) = res[2 * i], res[2 * i + 1]
        f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        out.append(
            dict(
                out_err=float(jnp.abs(f32(o) - f32(ro)).max()),
                out_ref=float(jnp.abs(f32(ro)).max()),
                grad_err=[float(jnp.abs(f32(a) - f32(b)).max()) for a, b in zip(g, rg, strict=True)],
                grad_ref=[float(jnp.abs(f32(b)).max()) for b in rg],
                finite=bool(all(jnp.isfinite(f32(x)).all() for x in (o, *g))),
            )
        )
    return out


def reference(q, k, v, m):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  the fp32 reference on the same (rounded) inputs
    return attnlab.attention_reference(f32(q), f32(k), f32(v), mask=m)


def run():
    results = {}
    timings = {}
    lengths = jnp.array([37, 20])  # traced: the ring cannot skip by them statically

    # Ring over 8 devices, T = 37 (not a multiple of 8), GQA 4 -> 2, tiles of 3: shards of 6
    # (2 whole tiles; padded to 48, so the last shard is all padding and shard 6 half). fp32.
    t0 = time.perf_counter()
    mesh = parallel.make_mesh("sp=8")
    q, k, v, ct = inputs(2, 37, 4, 2, 8, jnp.float32)
    bs = BlockSizes(3, 3)
    named = {
        "full": None,
        "causal": masks.causal(),
        "window": masks.window(6, 2),
        "padding": masks.padding(lengths, lengths),
        # packed documents crossing shard boundaries (shards of 6), ids traced: documents across shards
        "document&causal": masks.document(jnp.asarray(np.repeat([[0, 1, 2, 3]], 2, 0).repeat([5, 14, 9, 9], 1)))
        & masks.causal(),
    }
    ring = lambda q, k, v, m: parallel.attention(q, k, v, mesh=mesh, seq_axis="sp", mask=m, block_sizes=bs)  # noqa: E731
    for name, r in zip(named, errors(ring, reference, q, k, v, ct, list(named.values())), strict=True):
        results[f"ring-float32-T37-{name}"] = dict(r, dtype="float32")
    timings["ring-float32"] = time.perf_counter() - t0

    # Ring, bf16, T = 32 (divides evenly), default tiles; causal & padding combined.
    t0 = time.perf_counter()
    q, k, v, ct = inputs(2, 32, 2, 2, 8, jnp.bfloat16, seed=1)
    lengths32 = jnp.array([32, 13])
    named = {"window": masks.window(3, 3), "causal&padding": masks.causal() & masks.padding(lengths32, lengths32)}
    ring = lambda q, k, v, m: parallel.attention(q, k, v, mesh=mesh, seq_axis="sp", mask=m)  # noqa: E731
    for name, r in zip(named, errors(ring, reference, q, k, v, ct, list(named.values())), strict=True):
        results[f"ring-bfloat16-T32-{name}"] = dict(r, dtype="bfloat16")
    timings["ring-bfloat16"] = time.perf_counter() - t0

    # Zig-zag ring (device d holds chunks d and 2D-1-d), causal and causal & padding (traced
    # lengths), on 8 devices (T = 37: 16 chunks of 3, padded to 48) and on 4 (T = 21: 8 chunks
    # of 3, padded to 24), fp32; bf16 on 8 (T = 32, default tiles).
    t0 = time.perf_counter()
    mesh4 = parallel.make_mesh("sp=4")
    for D, T, lens in ((8, 37, [37, 20]), (4, 21, [21, 8])):
        q, k, v, ct = inputs(2, T, 4, 2, 8, jnp.float32, seed=5)
        lens = jnp.array(lens)
        named = {"causal": masks.causal(), "causal&padding": masks.causal() & masks.padding(lens, lens)}
        ring = lambda q, k, v, m, mesh=(mesh if D == 8 else mesh4): parallel.attention(  # noqa: E731
            q, k, v, mesh=mesh, seq_axis="sp", mask=m, block_sizes=BlockSizes(3, 3), layout="zigzag"
        )
        for name, r in zip(named, errors(ring, reference, q, k, v, ct, list(named.values())), strict=True):
            results[f"ring-zigzag-sp{D}-float32-T{T}-{name}"] = dict(r, dtype="float32")
    q, k, v, ct = inputs(2, 32, 2, 2, 8, jnp.bfloat16, seed=6)
    m = masks.causal() & masks.padding(lengths32, lengths32)
    ring = lambda q, k, v, m: parallel.attention(q, k, v, mesh=mesh, seq_axis="sp", mask=m, layout="zigzag")  # noqa: E731
    (r,) = errors(ring, reference, q, k, v, ct, [m])
    results["ring-zigzag-sp8-bfloat16-T32-causal&padding"] = dict(r, dtype="bfloat16")
    timings["ring-zigzag"] = time.perf_counter() - t0

    # An irregular static mask (random EMPTY / PARTIAL / FULL 4 x 4 tiles): more distinct pair
    # layouts than the ring compiles branches for, so it coarsens them; zig-zag, 8 devices.
    t0 = time.perf_counter()
    T = 64
    kinds = np.random.default_rng(7).integers(0, 3, (T // 4, T // 4))
    diag = np.eye(4, dtype=bool)
    dense = np.kron(kinds == masks.FULL, np.ones((4, 4), bool)) | np.kron(kinds == masks.PARTIAL, diag)
    static = masks.as_mask(dense)
    q, k, v, ct = inputs(1, T, 2, 2, 8, jnp.float32, seed=8)
    ring = lambda q, k, v, m: parallel.attention(  # noqa: E731  the static mask, not the traced m
        q, k, v, mesh=mesh, seq_axis="sp", mask=static, block_sizes=BlockSizes(4, 4), layout="zigzag"
    )
    (r,) = errors(ring, reference, q, k, v, ct, [static])
    results["ring-zigzag-sp8-float32-T64-irregular"] = dict(r, dtype="float32")
    timings["ring-irregular"] = time.perf_counter() - t0

    # Head parallelism over 4 devices (N = 8, K = 4: one kv head and its 2 query heads each),
    # fp32 and bf16, each device running attnlab.attention (dispatcher's choice) on its heads.
    t0 = time.perf_counter()
    mesh_h = parallel.make_mesh("heads=4")
    heads = lambda q, k, v, m: parallel.attention(q, k, v, mesh=mesh_h, head_axis="heads", mask=m)  # noqa: E731
    lengths19 = jnp.array([19, 7])
    cases = {
        "float32": ("window&padding", masks.window(2, 2) & masks.padding(lengths19, lengths19)),
        "bfloat16": ("causal", masks.causal()),
    }
    for dtype, (name, m) in cases.items():
        q, k, v, ct = inputs(2, 19, 8, 4, 8, jnp.dtype(dtype), seed=2)
        (r,) = errors(heads, reference, q, k, v, ct, [m])
        results[f"heads-{dtype}-T19-{name}"] = dict(r, dtype=dtype)
    # The blockwise kernel itself on each device's heads, with a window that leaves most of its
    # 64 x 64 tiles EMPTY (T = 150: 3 x 3 tiles, a short last one), as `make bench` times it.
    q, k, v, ct = inputs(2, 150, 8, 4, 8, jnp.float32, seed=3)
    m = masks.window(20, 20) & masks.padding(jnp.array([150, 97]), jnp.array([150, 97]))
    heads_bw = lambda q, k, v, m: parallel.attention(  # noqa: E731
        q, k, v, mesh=mesh_h, head_axis="heads", mask=m, implementation="blockwise"
    )
    (r,) = errors(heads_bw, reference, q, k, v, ct, [m])
    results["heads-blockwise-float32-T150-window&padding"] = dict(r, dtype="float32")
    timings["heads"] = time.perf_counter() - t0

    mesh_hs = parallel.make_mesh("heads=2,sp=4")

    # multi_head_attention with both axes (heads over 2 devices, the ring over 4; T = 21 padded to
    # 24) and sharded projections, against the single-device one.
    t0 = time.perf_counter()
    params = attnlab.init_multi_head_params(jax.random.key(4), 16, 4, num_kv_heads=2)
    params = {n: p + 0.1 for n, p in params.items()}  # nonzero biases, so bo counted once is checked
    x = jax.random.normal(jax.random.key(5), (2, 21, 16))
    lens = jnp.array([21, 9])
    m = masks.causal() & masks.padding(lens, lens)

    def mha_both(params, x, layout):
        def loss(f):
            return lambda p, x: jnp.sum(jnp.sin(f(p, x)))

        sharded = lambda p, x: parallel.multi_head_attention(  # noqa: E731
            p, x, mesh=mesh_hs, seq_axis="sp", head_axis="heads", mask=m, layout=layout
        )
        single = lambda p, x: attnlab.multi_head_attention(p, x, mask=m, implementation="reference")  # noqa: E731
        return [(f(params, x), jax.grad(loss(f), argnums=(0, 1))(params, x)) for f in (sharded, single)]

    for layout, suffix in (("contiguous", ""), ("zigzag", "-zigzag")):
        (y, g), (ry, rg) = jax.jit(mha_both, static_argnums=2)(params, x, layout)
        gl, rgl = jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(rg)
        results[f"mha-heads2xsp4{suffix}-float32-T21-causal&padding"] = dict(
            out_err=float(jnp.abs(y - ry).max()),
            out_ref=float(jnp.abs(ry).max()),
            grad_err=[float(jnp.abs(a - b).max()) for a, b in zip(gl, rgl, strict=True)],
            grad_ref=[float(jnp.abs(b).max()) for b in rgl],
            finite=bool(all(jnp.isfinite(a).all() for a in [y, *gl])),
            dtype="float32",
        )
    timings["mha"] = time.perf_counter() - t0

    # Per-device memory of the compiled ring program (forward + backward) for a fixed shard
    # of 512 positions per device, on 2 and 8 devices; and whether the program gathers.
    t0 = time.perf_counter()
    memory, gathers = {}, {}
    for D in (2, 8):
        mesh_d = parallel.make_mesh(f"sp={D}")
        sh = NamedSharding(mesh_d, P(None, "sp", None, None))
        xs = jax.ShapeDtypeStruct((1, 512 * D, 2, 32), jnp.float32, sharding=sh)

        def loss(q, k, v, mesh_d=mesh_d):
            return jnp.sum(parallel.attention(q, k, v, mesh=mesh_d, seq_axis="sp", mask=masks.causal()))

        c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(xs, xs, xs).compile()
        ma = c.memory_analysis()
        memory[D] = dict(
            temp=int(ma.temp_size_in_bytes),
            argument=int(ma.argument_size_in_bytes),
            output=int(ma.output_size_in_bytes),
        )
        gathers[f"ring-sp{D}"] = "all-gather" in c.as_text()

    # The zig-zag ring on 8: its reordering is ppermutes, so no gather and about the same memory.
    def zigzag8(q, k, v):  # mesh_d, xs: the 8-device ones of the loop's last pass
        return parallel.attention(q, k, v, mesh=mesh_d, seq_axis="sp", mask=masks.causal(), layout="zigzag")

    c = jax.jit(jax.grad(lambda q, k, v: jnp.sum(zigzag8(q, k, v)), argnums=(0, 1, 2))).lower(xs, xs, xs).compile()
    ma = c.memory_analysis()
    memory["8-zigzag"] = dict(
        temp=int(ma.temp_size_in_bytes), argument=int(ma.argument_size_in_bytes), output=int(ma.output_size_in_bytes)
    )
    gathers["ring-zigzag-sp8"] = "all-gather" in c.as_text()
    sh = NamedSharding(mesh_h, P(None, None, "heads", None))
    xs = jax.ShapeDtypeStruct((1, 64, 8, 16), jnp.float32, sharding=sh)
    c = jax.jit(lambda q, k, v: parallel.attention(q, k, v, mesh=mesh_h, head_axis="heads")).lower(xs, xs, xs).compile()
    gathers["heads4"] = "all-gather" in c.as_text()
    timings["memory"] = time.perf_counter() - t0

    # Errors that need a mesh of several devices.
    errs = {}
    q, k, v, _ = inputs(1, 8, 6, 6, 4, jnp.float32)
    try:
        parallel.attention(q, k, v, mesh=mesh_h, head_axis="heads")
        errs["heads_not_divisible"] = None
    except ValueError as e:
        errs["heads_not_divisible"] = str(e)
    return dict(
        results=results, memory=memory, gathers=gathers, errors=errs, timings=timings, devices=jax.device_count()
    )


if __name__ == "__main__":
    print(json.dumps(run()))
