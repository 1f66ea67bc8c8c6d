"""One cell of the sweep: its key (``Cell``), its mask from a spec, the work the mask allows, the program it
times (``build``) and the timing itself (``time_cell``).

``experiments/sweep.py`` expands a config into cells and runs them (in this process or each in a
subprocess: ``time_cell`` is what ``common.CellWorker`` calls); ``experiments.sweep`` re-exports every
name here.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import attnlab
from attnlab import masks, parallel
from experiments import common
from experiments.common import memory_record


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of the sweep; its fields are the resume key."""

    implementation: str
    mask: str
    seq_len: int
    num_heads: int
    head_dim: int
    batch: int
    mode: str
    dtype: str
    mesh: str = ""  # "" = one device; else an attnlab.parallel.make_mesh spec ("sp=8", "heads=4,sp=2")
    score: str = "dot"  # an attnlab.scores.from_spec spec: dot, softcap:CAP, alibi, additive

    def key(self) -> tuple:
        return dataclasses.astuple(self)


def window_pairs(n: int, left: int | None, right: int | None) -> int:
    """Number of (t, s) pairs in [0, n)^2 with t - left <= s <= t + right (None: unbounded)."""
    t = np.arange(n)
    lo = np.zeros(n, int) if left is None else np.maximum(0, t - left)
    hi = np.full(n, n - 1) if right is None else np.minimum(n - 1, t + right)
    return int((hi - lo + 1).clip(min=0).sum())


def _allowed_pairs(mask, n: int, rows: int = 1024) -> int:
    """Allowed (t, s) pairs of a mask on n x n (per example: a mask with leading dims, e.g. a
    document mask's [1, 1, T, S], is averaged over them), counted a block of rows at a time."""
    total = 0
    for start in range(0, n, rows):
        q_idx = jnp.arange(start, min(start + rows, n))
        values = mask(q_idx, jnp.arange(n))
        values = jnp.broadcast_to(values, values.shape[:-2] + (len(q_idx), n))
        total += int(jnp.sum(values)) // max(1, int(np.prod(values.shape[:-2])))
    return total


@functools.lru_cache(maxsize=8)  # expand and then build each cell of a (spec, n) use one mask
def make_mask(spec: str, n: int, batch: int, seed: int = 0):
    """Mask spec -> attnlab mask: every spec of ``attnlab.masks.from_spec`` (``full``, ``causal``,
    ``window:L:R``, ``graph:DENSITY``, ``chunks:C``, ``&`` / ``|`` ...), plus the sweep's own
    ``padding:FRACTION`` (every sequence of the batch padded by that fraction: data, not structure).
    Masks are immutable, so the last few are kept (a random graph of 16K nodes takes seconds)."""
    name, *args = spec.split(":")
    if name != "padding":
        return masks.from_spec(spec, seq_len=n, seed=seed)  # ValueError naming the spec
    try:
        if len(args) != 1:
            raise ValueError("expected padding:FRACTION")
        length = max(1, round(n * (1 - float(args[0]))))
    except ValueError as e:
        raise ValueError(f"masks: bad spec {spec!r}: {e}") from e
    lengths = jnp.full((batch,), length, jnp.int32)
    return masks.padding(lengths, lengths)


@functools.lru_cache(maxsize=8)  # the cells of one (spec, n) in a row count its pairs once
def parse_mask(spec: str, n: int, batch: int, seed: int = 0):
    """Mask spec (``make_mask``) -> (attnlab mask or None, allowed (t, s) pairs summed over the
    batch, jax.nn kwargs).

    jax.nn gets its native arguments where the mask says it has that form: per-example lengths for
    padding, ``is_causal`` for the interval ``(None, 0)``, ``local_window_size`` for a finite one,
    and a dense mask for the rest (``None`` here: ``build`` makes it only for a jax.nn cell; a
    graph's dense mask is its adjacency).
    """
    mask = make_mask(spec, n, batch, seed)
    if mask.is_full:
        return None, batch * n * n, {}
    pads, rest = mask.split_padding()
    if pads:  # only padding:FRACTION has padding, and nothing beside it
        (pad,) = pads
        pairs = int(np.sum(np.asarray(pad.q_lengths) * np.asarray(pad.kv_lengths)))
        return mask, pairs, {"query_seq_lengths": pad.q_lengths, "key_value_seq_lengths": pad.kv_lengths}
    if mask.interval() is None:
        return mask, batch * _allowed_pairs(mask, n), None
    lo, hi = mask.interval()  # t + lo <= s <= t + hi
    pairs = batch * window_pairs(n, None if lo is None else -lo, hi)
    if (lo, hi) == (None, 0):
        return mask, pairs, {"is_causal": True}
    if lo is not None and hi is not None:
        return mask, pairs, {"local_window_size": (-lo, hi)}
    return mask, pairs, None


def for_implementation(implementation: str, mask, n: int):
    """The mask as ``implementation`` takes it: the edge-list kernel gets a graph as its edge list."""
    if implementation == "sparse" and isinstance(mask, masks.Graph):
        receivers, senders = np.nonzero(np.asarray(mask.dense(n, n)))
        return masks.graph_edges(senders, receivers, n)
    return mask


def useful_flops(cell: Cell, pairs: int) -> int:
    """FLOPs over allowed pairs: the score and the weighted sum forward, twice that more backward.

    The dot product's score is 2H per pair and head (mul + add), the additive score's 3H (add, tanh
    counted as one, mul + add); the weighted sum is 2H; the backward counts as twice the forward (no
    recomputation); the per-element scores (softcap, alibi) count as the dot product.
    """
    score = 3 if cell.score == "additive" else 2
    fwd = (score + 2) * cell.num_heads * cell.head_dim * pairs
    return fwd if cell.mode == "fwd" else 3 * fwd


def build(cell: Cell, seed: int = 0):
    """-> (function of (q, k, v, mask), its arguments, allowed pairs)."""
    mask, pairs, jnn_kwargs = parse_mask(cell.mask, cell.seq_len, cell.batch, seed)
    mask = for_implementation(cell.implementation, mask, cell.seq_len)
    dtype = jnp.dtype(cell.dtype)
    shape = (cell.batch, cell.seq_len, cell.num_heads, cell.head_dim)  # [B, T, N, H]
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in (kq, kk, kv))

    if cell.implementation == "jax.nn":
        if jnn_kwargs is None:  # no native jax.nn form: the dense mask
            jnn_kwargs = {"mask": mask.dense(cell.seq_len, cell.seq_len)}

        def attend(q, k, v, m):
            del m  # jax.nn takes the mask as its own flags
            return jax.nn.dot_product_attention(q, k, v, **jnn_kwargs)
    elif cell.mesh:
        mesh = parallel.make_mesh(cell.mesh)
        axes = {
            "seq_axis": "sp" if "sp" in mesh.shape else None,
            "head_axis": "heads" if "heads" in mesh.shape else None,
        }
        q, k, v = (parallel.shard(x, mesh, **axes) for x in (q, k, v))

        def attend(q, k, v, m):
            return parallel.attention(q, k, v, mesh=mesh, mask=m, implementation=cell.implementation, **axes)
    else:
        score = attnlab.scores.from_spec(cell.score, num_heads=cell.num_heads, head_dim=cell.head_dim, seed=seed)

        def attend(q, k, v, m):
            return attnlab.attention(q, k, v, mask=m, score=score, implementation=cell.implementation)

    if cell.mode == "fwd":
        fn = attend
    else:
        cotangent = jax.random.normal(kc, shape, jnp.float32)

        def fn(q, k, v, m):
            loss = lambda q, k, v: jnp.sum(attend(q, k, v, m).astype(jnp.float32) * cotangent)  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return fn, (q, k, v, mask), pairs


def time_cell(
    cell: Cell, *, repeats: int, timeout_s: float = float("inf"), seed: int = 0, isolated: bool = False
) -> dict:
    """Compiles once, warms up once, times `repeats` calls of the compiled program.

    `isolated`: this process runs this cell alone (a subprocess per cell), so the device's peak
    memory is the cell's own (``common.memory_record``).
    """
    before = common.memory_stats()
    fn, args, pairs = build(cell, seed)
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))  # warm-up
    times = [time.perf_counter() - t0]
    status = "ok"
    if times[0] * (repeats + 1) > timeout_s:
        status = "timeout"  # soft timeout: keep the warm-up time, skip the repeats
    else:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
    flops = useful_flops(cell, pairs)
    best = min(times)
    return dict(
        status=status,
        error=None,
        compile_s=compile_s,
        repeats=len(times),
        median_ms=1e3 * statistics.median(times),
        min_ms=1e3 * best,
        steps_per_s=1.0 / best,
        allowed_pairs=pairs,
        useful_flops=flops,
        useful_gflops=flops / best / 1e9,
        **memory_record(compiled, before, common.memory_stats(), isolated=isolated),
    )


ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


DTYPES = ("float32", "bfloat16", "float16")


def default_dtype(backend: str) -> str:
    """The dtype a sweep or bench measures unless told: bfloat16 on GPU/TPU (what models train in
    there, and what cuDNN and the TPU MXU run at speed), float32 on CPU (no fast bf16 matmul)."""
    return "bfloat16" if backend in ACCELERATORS else "float32"


def resolve_dtypes(dtypes, backend: str) -> list[str]:
    """`dtypes` with "auto" replaced by `default_dtype(backend)`, duplicates dropped, each checked."""
    out = []
    for dt in dtypes:
        dt = default_dtype(backend) if dt == "auto" else dt
        if dt not in DTYPES:
            raise ValueError(f"dtypes: unknown {dt!r}, expected 'auto' or one of {DTYPES}")
        if dt not in out:
            out.append(dt)
    return out
