"""One process of the two-process check of attnlab.parallel, run by tests/test_distributed.py.

Usage: ``python tests/distributed_worker.py PROCESS_ID NUM_PROCESSES PORT``. Each process presents
its CPU as 2 host devices, joins the others with ``jax.distributed.initialize`` on
``127.0.0.1:PORT`` (process 0 runs the coordinator; XLA:CPU's collectives go over gloo, jax's
default ``jax_cpu_collectives_implementation``), and builds meshes over all 2 x NUM_PROCESSES
devices, so the ring's ``ppermute`` and the head-parallel programs cross the process boundary.

Every process draws the same full inputs from one seed, places its own slices with
``jax.make_array_from_callback``, runs one jitted program per case (output and the gradients of
``sum(out * ct)`` w.r.t. q, k, v), gathers the results with ``process_allgather`` and compares them
with ``attention_reference`` computed locally in fp32 on the full arrays. It prints one JSON object
(last line of stdout): the largest errors and reference magnitudes per case; the test judges them
with the suite's tolerances.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

LOCAL_DEVICES = 2


def place(x, mesh, spec):
    """The full numpy array x (same on every process) as a global array; each process fills its shards."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def gather(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def inputs(B, T, N, K, H, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, T, n, H)).astype(np.float32) for n in (N, K, K))
    ct = rng.standard_normal((B, T, N, H)).astype(np.float32)  # cotangent of the output
    return q, k, v, ct


def check(fn, mesh, spec, q, k, v, ct, mask):
    """Output and (dq, dk, dv) of fn on global arrays vs the fp32 reference on local full arrays."""
    import attnlab

    def out_and_grads(f, q, k, v):
        loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * ct)  # noqa: E731
        return f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    o, g = jax.jit(lambda q, k, v: out_and_grads(fn, q, k, v))(*(place(x, mesh, spec) for x in (q, k, v)))
    o, g = gather(o), [gather(x) for x in g]
    ref = lambda q, k, v: attnlab.attention_reference(q, k, v, mask=mask)  # noqa: E731
    ro, rg = jax.jit(lambda q, k, v: out_and_grads(ref, q, k, v))(q, k, v)
    ro, rg = np.asarray(ro), [np.asarray(x) for x in rg]
    return dict(
        out_err=float(np.abs(o - ro).max()),
        out_ref=float(np.abs(ro).max()),
        grad_err=[float(np.abs(a - b).max()) for a, b in zip(g, rg, strict=True)],
        grad_ref=[float(np.abs(b).max()) for b in rg],
        finite=bool(all(np.isfinite(x).all() for x in (o, *g))),
        dtype="float32",
    )


def run(process_id: int, num_processes: int, port: int) -> dict:
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=120,
    )
    from attnlab import masks, parallel
    from attnlab.kernels import BlockSizes

    D = jax.device_count()
    results = {}
    # Ring over every device of every process, inputs sharded on the sequence (T = 24: 6 per device).
    mesh = parallel.make_mesh(f"sp={D}")
    spec = P(None, "sp", None, None)

    def ring(m, layout):
        return lambda q, k, v: parallel.attention(
            q, k, v, mesh=mesh, seq_axis="sp", mask=m, block_sizes=BlockSizes(4, 4), layout=layout
        )

    q, k, v, ct = inputs(2, 24, 4, 2, 8, seed=0)
    lengths = np.array([24, 9])
    m = masks.causal() & masks.padding(lengths, lengths)
    for layout in ("contiguous", "zigzag"):
        results[f"ring-{layout}-sp{D}-T24-causal&padding"] = check(ring(m, layout), mesh, spec, q, k, v, ct, m)
    results[f"ring-contiguous-sp{D}-T24-full"] = check(ring(None, "contiguous"), mesh, spec, q, k, v, ct, None)
    # T = 21 does not divide the ring: inputs replicated, attention pads and shards them itself.
    q, k, v, ct = inputs(2, 21, 4, 2, 8, seed=2)
    m = masks.causal()
    results[f"ring-zigzag-sp{D}-T21-causal-replicated"] = check(ring(m, "zigzag"), mesh, P(), q, k, v, ct, m)

    # Head parallelism over every device: N = 8 query heads, K = 4 kv heads, one kv head per device.
    mesh_h = parallel.make_mesh(f"heads={D}")
    spec_h = P(None, None, "heads", None)
    q, k, v, ct = inputs(2, 19, 2 * D, D, 8, seed=1)
    m = masks.causal()
    heads = lambda q, k, v: parallel.attention(q, k, v, mesh=mesh_h, head_axis="heads", mask=m)  # noqa: E731
    results[f"heads{D}-T19-causal"] = check(heads, mesh_h, spec_h, q, k, v, ct, m)

    summary = dict(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        devices=D,
        local_devices=jax.local_device_count(),
        mesh_processes=sorted({d.process_index for d in mesh.devices.flat}),
        results=results,
    )
    jax.distributed.shutdown()
    return summary


if __name__ == "__main__":
    pid, nproc, port = (int(a) for a in sys.argv[1:4])
    print(json.dumps(run(pid, nproc, port)), flush=True)
