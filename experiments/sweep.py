"""The sweep harness: sequence length x head count x implementation x mask x mode x dtype.

Command (what `make sweep` runs; about 3 minutes on a 2-core CPU):

    python -m experiments.sweep --config experiments/configs/sweep.py:default --out results/sweep

Variants live in ``experiments/configs/sweep.py`` (``default``, ``smoke``, ``long``, ``lra_table2``);
plain flags override them, e.g.

    python -m experiments.sweep --seq_lens=1024,4096 --num_heads=8 --masks=full,window:128:128 \
        --implementations=xla,jax.nn --modes=fwd_bwd --out results/mine

Each cell is compiled once, called once to warm up, then timed ``repeats`` times. One JSON line per
cell goes to ``<out>/results.jsonl`` (rewritten atomically after every cell) with: the cell's
config, status (ok / timeout / oom / error + message), median and min time, compile time, useful
FLOPs (only the (t, s) pairs the mask allows) and GFLOP/s, steps/s, memory (``memory_source`` says
whether it is XLA's memory analysis of the compiled program or the device's own peak), backend,
device kind, jax/jaxlib versions and host CPU count. Running the same command again skips cells
already done (resume); ``--force`` redoes them. A cell that fails is recorded and the sweep goes on.

Faults (docs/harness.md): a line of results.jsonl that is not a JSON record stops the rerun with
its file and line named; ``--skip_bad_lines`` sets such lines aside into ``results.jsonl.bad`` and
reruns their cells. One sweep at a time writes into an ``--out`` (a second one is refused, naming
the first's pid and command). ``--cell_hard_timeout_s=S`` runs the cells in a subprocess and kills
it when a cell passes S seconds (status ``timeout``; the next cell gets a new subprocess), so a hung
call cannot stall the sweep; the soft ``cell_timeout_s`` of the config only skips the repeats of a
slow cell. ``--fresh_process_per_cell`` starts a new subprocess for every cell.

Backends: ``--dtypes=auto`` is bfloat16 on GPU/TPU and float32 on CPU. ``memory_bytes`` is the
device's own peak where it belongs to the cell (always with ``--fresh_process_per_cell``), XLA's
analysis of the compiled program otherwise (CPU keeps no device statistics).
``experiments/plot.py`` then draws the figures and a markdown summary from the JSONL alone (the
sweep calls it at the end).

Figure to expect from ``default`` on a 2-core CPU (``results/sweep/time_vs_n.png``): every dense
implementation grows as N^2 (slope 2 on the log-log plot) for every mask, including the window;
"xla" (``jax.nn.dot_product_attention`` inside attnlab) is faster than the fp32 reference;
forward+backward costs about 2-3x forward.

Implementations: every name in ``attnlab.IMPLEMENTATIONS`` (through ``attnlab.attention``), and the
peer ``jax.nn`` (``jax.nn.dot_product_attention`` called directly with its own mask flags).
``sparse`` (the edge-list kernel) runs only on ``graph:`` masks, which it receives as an edge list;
other combinations are left out of the sweep.
Masks: ``full``, ``causal``, ``window:L:R``, ``graph:DENSITY`` (random graph, fixed seed,
self-loops), ``padding:FRACTION`` (the last FRACTION of every sequence is padding).

Several devices: ``--mesh=sp=8`` (ring attention over the sequence), ``--mesh=heads=4`` (head
parallelism) or ``--mesh=heads=4,sp=2`` (both) runs every cell through ``attnlab.parallel.attention``
with q/k/v sharded over that mesh; with an ``sp`` axis only ``blockwise`` cells run (the ring uses
its block step), and the peer ``jax.nn`` and head counts the ``heads`` axis does not divide are
left out. Memory is then per device. On CPU the sweep presents as many host devices as the mesh
needs (``attnlab.parallel.use_host_devices``; ``XLA_FLAGS=--xla_force_host_platform_device_count``
takes precedence when set):

    python -m experiments.sweep --config experiments/configs/sweep.py:smoke --implementations=blockwise \
        --mesh=sp=8 --out results/sweep-sp8
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import math
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

import attnlab
from attnlab import masks, parallel
from experiments import common
from experiments.plot import BadResultsLineError, describe_bad_lines, make_plots, read_results

_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "sweep.py")
FLAGS = flags.FLAGS


def define_flags():
    """Defines the command-line flags; only when run as a program, so experiments can be imported together."""
    config_flags.DEFINE_config_file("config", f"{_CONFIGS}:default", "Sweep config file and variant.")
    flags.DEFINE_list("seq_lens", None, "Sequence lengths N (T = S = N); overrides the config.")
    flags.DEFINE_list("num_heads", None, "Head counts; overrides the config.")
    flags.DEFINE_list("implementations", None, "Implementations; overrides the config.")
    flags.DEFINE_list("masks", None, "Masks: full, causal, window:L:R, graph:DENSITY, padding:FRACTION.")
    flags.DEFINE_list("modes", None, "fwd and/or fwd_bwd; overrides the config.")
    flags.DEFINE_list(
        "dtypes", None, "float32, bfloat16, float16 or auto (bfloat16 on GPU/TPU, float32 on CPU); overrides the config"
    )
    flags.DEFINE_integer("head_dim", None, "Head dimension H; overrides the config.")
    flags.DEFINE_integer("batch", None, "Batch size B; overrides the config.")
    flags.DEFINE_integer("repeats", None, "Timed calls per cell after one warm-up; overrides the config.")
    flags.DEFINE_string("out", "results/sweep", "Results folder (results.jsonl, config.json, plots).")
    flags.DEFINE_bool("force", False, "Redo cells already in results.jsonl (bad lines in it are set aside).")
    flags.DEFINE_bool(
        "skip_bad_lines",
        False,
        "Set aside lines of results.jsonl that are not JSON records (into results.jsonl.bad, with a "
        "warning) and rerun the cells they held, instead of stopping.",
    )
    flags.DEFINE_bool("plot", True, "Draw the plots and summary.md at the end.")
    flags.DEFINE_float(
        "cell_hard_timeout_s",
        None,
        "Run each cell in its own subprocess and kill it after this many seconds (a hung cell is "
        "recorded as timeout and the sweep goes on); 0 = in this process (default: the config's).",
    )
    flags.DEFINE_bool(
        "fresh_process_per_cell",
        False,
        "With --cell_hard_timeout_s: a new subprocess for every cell (JAX starts each time) instead of "
        "one reused until a cell is killed; the device's peak memory is then each cell's own.",
    )
    flags.DEFINE_string("mesh", None, "Device mesh, e.g. sp=8, heads=4 or heads=4,sp=2; overrides the config.")


PEERS = ("jax.nn",)
MODES = ("fwd", "fwd_bwd")


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

    def key(self) -> tuple:
        return dataclasses.astuple(self)


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


def mesh_advice(spec: str, backend: str, num_devices: int, cpus: int | None = None) -> str:
    """What a `--mesh` means on this backend; raises ValueError when the backend cannot hold it.

    On CPU a mesh is made of host devices (as many as asked: they share the cores, so it tests the
    sharded code, and beyond the core count it does not add speed). On GPU and TPU each mesh
    device is a real chip, so the mesh must fit in the devices there are.
    """
    need = math.prod(parallel.parse_mesh(spec).values())
    if backend == "cpu":
        cpus = cpus or os.cpu_count() or 1
        advice = (
            f"mesh {spec} on CPU: {need} host devices sharing {cpus} cores; this checks the sharded code "
            f"path, and speed grows only up to one device per core (heads={cpus} is what the bench uses)"
        )
        return advice + ("" if need <= cpus else f"; {need} > {cpus} cores: expect no speed-up over {cpus}")
    chip = "TPU core" if backend == "tpu" else "GPU"
    if need > num_devices:
        raise ValueError(
            f"mesh: {spec!r} needs {need} devices, the {backend} backend has {num_devices} ({chip}s); "
            f"use a mesh of at most {num_devices}, e.g. --mesh=heads={num_devices} or --mesh=sp={num_devices}"
        )
    return (
        f"mesh {spec} on {backend}: one {chip} per mesh device ({need} of {num_devices}); heads= needs no "
        "communication inside attention, sp= (ring) passes K/V blocks between neighbours: use it when one "
        f"{chip}'s memory cannot hold the sequence"
    )


def expand(config, backend: str | None = None) -> list[Cell]:
    """All cells of a config, in the order they run (small N first within each group).

    ``backend`` (default: JAX's) resolves the dtype "auto"."""
    for mode in config.modes:
        if mode not in MODES:
            raise ValueError(f"modes: unknown mode {mode!r}, expected one of {MODES}")
    for impl in config.implementations:
        if impl not in attnlab.IMPLEMENTATIONS + PEERS:
            raise ValueError(f"implementations: unknown {impl!r}, expected one of {attnlab.IMPLEMENTATIONS + PEERS}")
    for spec in config.masks:  # validate each spec before any cell runs
        if spec.startswith("padding"):
            parse_mask(spec, 8, 1)
        else:
            masks.from_spec(spec, seq_len=min(config.seq_lens))
    mesh = config.get("mesh", "") or ""
    axes = parallel.parse_mesh(mesh) if mesh else {}
    if set(axes) - {"sp", "heads"}:
        raise ValueError(f"mesh: axes must be named 'sp' (sequence) and/or 'heads', got {mesh!r}")
    dtypes = resolve_dtypes(config.dtypes, backend or jax.default_backend())
    prod = itertools.product(
        config.modes, dtypes, config.masks, config.num_heads, config.implementations, config.seq_lens
    )
    return [
        Cell(impl, m, int(n), int(h), int(config.head_dim), int(config.batch), mode, dt, mesh)
        for mode, dt, m, h, impl, n in prod
        if impl != "sparse" or m.startswith("graph:")  # the edge-list kernel only takes graphs
        if not mesh
        or (impl not in PEERS and ("sp" not in axes or impl == "blockwise") and h % axes.get("heads", 1) == 0)
    ]


# ------------------------------------------------------------------------------------------
# Masks and the work they allow


def window_pairs(n: int, left: int, right: int) -> int:
    """Number of (t, s) pairs in [0, n)^2 with t - left <= s <= t + right."""
    t = np.arange(n)
    return int((np.minimum(n - 1, t + right) - np.maximum(0, t - left) + 1).clip(min=0).sum())


def _allowed_pairs(mask, n: int, rows: int = 1024) -> int:
    """Allowed (t, s) pairs of a structural mask on n x n, counted a block of rows at a time."""
    total = 0
    for start in range(0, n, rows):
        q_idx = jnp.arange(start, min(start + rows, n))
        total += int(jnp.sum(jnp.broadcast_to(mask(q_idx, jnp.arange(n)), (len(q_idx), n))))
    return total


def parse_mask(spec: str, n: int, batch: int, seed: int = 0):
    """Mask spec -> (attnlab mask or None, allowed (t, s) pairs summed over the batch, jax.nn kwargs).

    Every structural spec of ``attnlab.masks.from_spec`` (``full``, ``causal``, ``window:L:R``,
    ``graph:DENSITY``, ``chunks:C``, ``bigbird``, combinations with ``&`` / ``|`` ...), plus the
    sweep's own ``padding:FRACTION`` (every sequence padded by that fraction: data, not structure).
    jax.nn gets its native arguments for full, causal, windows, graphs and padding, and a dense
    mask for the rest (``None`` here: ``build`` makes it only for a jax.nn cell).
    """
    name, *args = spec.split(":")
    if name == "padding":
        try:
            if len(args) != 1:
                raise ValueError("expected padding:FRACTION")
            length = max(1, round(n * (1 - float(args[0]))))
        except ValueError as e:
            raise ValueError(f"masks: bad spec {spec!r}: {e}") from e
        lengths = jnp.full((batch,), length, jnp.int32)
        return (
            masks.padding(lengths, lengths),
            batch * length * length,
            {"query_seq_lengths": lengths, "key_value_seq_lengths": lengths},
        )
    mask = masks.from_spec(spec, seq_len=n, seed=seed)  # ValueError naming the spec
    if isinstance(mask, masks.Full):
        return None, batch * n * n, {}
    if isinstance(mask, masks.Causal) and mask.offset == 0:
        return mask, batch * n * (n + 1) // 2, {"is_causal": True}
    if isinstance(mask, masks.Window) and mask.offset == 0:
        return mask, batch * window_pairs(n, mask.left, mask.right), {"local_window_size": (mask.left, mask.right)}
    if isinstance(mask, masks.Graph):
        adj = jnp.asarray(mask.adjacency)
        return mask, batch * int(adj.sum()), {"mask": adj}
    return mask, batch * _allowed_pairs(mask, n), None  # None: jax.nn takes the dense mask (build makes it)


def useful_flops(cell: Cell, pairs: int) -> int:
    """FLOPs of the matmuls over allowed pairs: 2 matmuls forward, 4 more backward (no recomputation)."""
    fwd = 4 * cell.num_heads * cell.head_dim * pairs  # 2 (mul + add) x (QK^T and AV)
    return fwd if cell.mode == "fwd" else 3 * fwd


# ------------------------------------------------------------------------------------------
# One cell


def build(cell: Cell, seed: int = 0):
    """-> (function of (q, k, v, mask), its arguments, allowed pairs)."""
    mask, pairs, jnn_kwargs = parse_mask(cell.mask, cell.seq_len, cell.batch, seed)
    dtype = jnp.dtype(cell.dtype)
    shape = (cell.batch, cell.seq_len, cell.num_heads, cell.head_dim)  # [B, T, N, H]
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in (kq, kk, kv))

    if cell.implementation == "sparse":  # the O(E) kernel takes the same graph as an edge list
        receivers, senders = np.nonzero(np.asarray(mask.adjacency))
        mask = masks.graph_edges(senders, receivers, cell.seq_len)

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

        def attend(q, k, v, m):
            return attnlab.attention(q, k, v, mask=m, implementation=cell.implementation)

    if cell.mode == "fwd":
        fn = attend
    else:
        cotangent = jax.random.normal(kc, shape, jnp.float32)

        def fn(q, k, v, m):
            loss = lambda q, k, v: jnp.sum(attend(q, k, v, m).astype(jnp.float32) * cotangent)  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return fn, (q, k, v, mask), pairs


def memory_record(compiled, before: dict | None = None, after: dict | None = None, *, isolated: bool = False) -> dict:
    """The cell's memory: the device's own peak where it is the cell's, XLA's analysis otherwise.

    Args:
        compiled: the compiled cell (its ``memory_analysis()``: arguments + outputs + temporaries).
        before, after: ``device.memory_stats()`` before building the cell and after timing it
            (None where the backend keeps none, as XLA:CPU).
        isolated: the process ran only this cell (a subprocess per cell), so its peak is the cell's.

    ``memory_bytes`` is the device peak when it can be attributed to this cell (isolated, or the
    process-wide peak rose during the cell: then the peak minus what was in use before it), else
    the compiled analysis; ``memory_source`` says which.
    """
    rec = {}
    try:
        cm = common.compiled_memory(compiled)
        rec.update(
            memory_bytes=cm["peak_bytes"],
            compiled_memory_bytes=cm["peak_bytes"],
            temp_bytes=cm["temp_bytes"],
            memory_source=cm["memory_source"],
        )
    except Exception:  # noqa: BLE001  (some backends give no analysis)
        rec.update(memory_bytes=None, memory_source="unavailable")
    after = after or {}
    if "peak_bytes_in_use" not in after:
        return rec
    peak, prev_peak = int(after["peak_bytes_in_use"]), int((before or {}).get("peak_bytes_in_use", 0))
    if isolated:
        rec.update(device_peak_bytes=peak, memory_bytes=peak, memory_source="device_peak (cell in its own process)")
    elif peak > prev_peak:
        cell_peak = peak - int((before or {}).get("bytes_in_use", 0))
        rec.update(
            device_peak_bytes=cell_peak,
            memory_bytes=cell_peak,
            memory_source="device_peak (reached during this cell, above the bytes in use before it)",
        )
    else:  # an earlier cell peaked higher: this cell's own peak is not visible in process-wide stats
        rec["memory_source"] += " (device peak not attributable: --fresh_process_per_cell gives every cell its own)"
    return rec


def _memory_stats() -> dict | None:
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (backends without stats)
        return None


def time_cell(
    cell: Cell, *, repeats: int, timeout_s: float = float("inf"), seed: int = 0, isolated: bool = False
) -> dict:
    """Compiles once, warms up once, times `repeats` calls of the compiled program.

    `isolated`: this process runs this cell alone (a subprocess per cell), so the device's peak
    memory is the cell's own.
    """
    before = _memory_stats()
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
        **memory_record(compiled, before, _memory_stats(), isolated=isolated),
    )


def environment() -> dict:
    import jaxlib

    dev = jax.devices()[0]
    return dict(
        backend=jax.default_backend(),
        device_kind=dev.device_kind,
        num_devices=jax.device_count(),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        host_cpus=os.cpu_count(),
        python=platform.python_version(),
        platform=platform.platform(),
    )


# ------------------------------------------------------------------------------------------
# The sweep


def write_results(path: str, records: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half of one


def record_key(r: dict) -> tuple:
    return tuple(r.get(f.name, f.default) for f in dataclasses.fields(Cell))


def _load_previous(path: str, *, set_aside: bool) -> list[dict]:
    """The records of an earlier run; bad lines stop the sweep, or with `set_aside` move to `<path>.bad`."""
    previous, bad = read_results(path)
    if not bad:
        return previous
    where = describe_bad_lines(path, bad)
    if not set_aside:
        raise BadResultsLineError(
            f"sweep: {len(bad)} line(s) of {path} are not JSON records (torn or overwritten):\n{where}\n"
            f"Rerun with --skip_bad_lines to set them aside in {path}.bad and rerun the cells they held, "
            "or with --force to redo every cell."
        )
    with open(path + ".bad", "a") as f:
        for lineno, text, why in bad:
            f.write(json.dumps({"line": lineno, "why": why, "text": text, "set_aside_at": time.time()}) + "\n")
    print(f"warning: set aside {len(bad)} bad line(s) into {path}.bad:\n{where}", file=sys.stderr, flush=True)
    write_results(path, previous)  # the file holds only good records from here on
    return previous


class OutLockedError(RuntimeError):
    """Another sweep holds the lock on this results folder."""


@contextlib.contextmanager
def lock_out(out: str):
    """Holds an exclusive lock on `<out>/.sweep.lock` (flock) for the duration; one writer per folder.

    The kernel drops the lock when its holder exits, however it exits (SIGKILL included), so a
    crashed sweep leaves no stale lock. Raises OutLockedError, naming the holder, when another
    process (or another sweep in this one) holds it.
    """
    path = os.path.join(out, ".sweep.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
        os.close(fd)
        raise OutLockedError(
            f"sweep: another sweep is writing into {out} ({holder}); two sweeps in one folder would "
            "lose each other's cells. Wait for it to finish (then rerun: its cells are kept and "
            "yours are added), or use another --out."
        ) from None
    try:
        me = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}, "
        me += "command: " + " ".join(sys.argv)[:500]
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def failure_record(e: BaseException) -> dict:
    """The record of a cell that raised: status oom (out of memory) or error, with the message."""
    msg = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else str(e)
    oom = isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    return dict(status="oom" if oom else "error", error=msg[:2000])


def _worker_main(conn, runner, host_devices, isolated):
    """Body of a cell subprocess: says it is ready (imports done), then runs cells until told to stop."""
    if host_devices > 1:
        parallel.use_host_devices(host_devices)
    conn.send(("ready", None))
    while (msg := conn.recv()) is not None:
        cell, kwargs = msg
        try:
            rec = runner(cell, isolated=isolated, **kwargs)
        except Exception as e:  # noqa: BLE001  (sent to the parent, which records it)
            rec = failure_record(e)
        conn.send(("done", rec))
    conn.close()


class CellWorker:
    """Runs cells in a subprocess and kills it when a cell passes its deadline.

    The subprocess (spawned: a fresh interpreter) is reused from cell to cell, so JAX starts once,
    and replaced after a cell that was killed or crashed. With ``fresh=True`` every cell gets a
    new process: slower (JAX starts each time) but the device's peak memory is then the cell's own.
    ``runner(cell, isolated=..., **kwargs) -> record`` must be importable (a module-level
    function); it defaults to ``time_cell``.
    """

    def __init__(self, runner=None, *, host_devices: int = 1, fresh: bool = False, startup_timeout_s: float = 300.0):
        self.runner = runner or time_cell
        self.host_devices, self.fresh, self.startup_timeout_s = host_devices, fresh, startup_timeout_s
        self.proc = self.conn = None

    def _start(self) -> str | None:
        """Starts the subprocess; -> None when ready, else why not."""
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked JAX runtime
        self.conn, child = ctx.Pipe()
        args = (child, self.runner, self.host_devices, self.fresh)
        self.proc = ctx.Process(target=_worker_main, args=args, daemon=True)
        self.proc.start()
        child.close()  # the child holds the other end; EOF here when it dies
        try:
            if self.conn.poll(self.startup_timeout_s) and self.conn.recv()[0] == "ready":
                return None
        except EOFError:
            pass
        why = f"did not start within {self.startup_timeout_s:g} s" if self.proc.is_alive() else self._death()
        self.close(kill=True)
        return f"cell process {why}"

    def _death(self) -> str:
        self.proc.join(5)
        code = self.proc.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        hint = " (the kernel's out-of-memory killer sends SIGKILL)" if code == -signal.SIGKILL else ""
        return f"died: {how}{hint}"

    def run(self, cell: Cell, *, hard_timeout_s: float, **kwargs) -> dict:
        """The cell's record; status "timeout" if it ran past ``hard_timeout_s`` (counted from when
        the process is ready: building, compiling and timing the cell), "error" if its process died."""
        if self.proc is not None and not self.proc.is_alive():  # died while idle: start anew
            self.close(kill=True)
        if self.proc is None and (why := self._start()):
            return dict(status="error", error=why)
        self.conn.send((cell, kwargs))
        t0 = time.perf_counter()
        rec = None
        try:
            if self.conn.poll(hard_timeout_s):
                rec = self.conn.recv()[1]
            else:
                rec = dict(
                    status="timeout",
                    error=f"hard timeout: cell process killed after {time.perf_counter() - t0:.1f} s "
                    f"(cell_hard_timeout_s={hard_timeout_s:g})",
                )
                self.close(kill=True)
        except EOFError:  # the process died before sending its record
            rec = dict(status="error", error=f"cell process {self._death()}")
            self.close(kill=True)
        if self.fresh:
            self.close()
        return rec

    def close(self, *, kill: bool = False) -> None:
        """Stops the subprocess: asks it to finish (or kills it at once with ``kill``)."""
        if self.proc is None:
            return
        if self.proc.is_alive() and not kill:
            with contextlib.suppress(OSError):
                self.conn.send(None)  # ask it to stop; killed below if it does not
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()
        self.proc = self.conn = None


def _host_devices(cell: Cell) -> int:
    """CPU host devices a cell's subprocess needs (its mesh size on CPU; 1 otherwise)."""
    if cell.mesh and jax.default_backend() == "cpu":
        return math.prod(parallel.parse_mesh(cell.mesh).values())
    return 1


def run_sweep(config, out: str, *, force: bool = False, plot: bool = True, skip_bad_lines: bool = False) -> list[dict]:
    """Runs every cell of `config` not already done in `<out>/results.jsonl`; returns this sweep's records.

    The sweep holds a lock on `<out>` while it runs; cells run in this process, or each in a
    subprocess killed after ``config.cell_hard_timeout_s`` seconds when that is > 0.

    Raises:
        OutLockedError: another sweep is writing into `<out>` (the message names its process).
        BadResultsLineError: `<out>/results.jsonl` has a line that is not a JSON record (the message
            names the file and line) and neither `skip_bad_lines` nor `force` is set.
    """
    os.makedirs(out, exist_ok=True)
    cells = expand(config)
    with lock_out(out):
        return _run_locked(config, cells, out, force=force, plot=plot, skip_bad_lines=skip_bad_lines)


def _run_locked(config, cells, out, *, force, plot, skip_bad_lines):
    path = os.path.join(out, "results.jsonl")
    fields = [f.name for f in dataclasses.fields(Cell) if f.default is dataclasses.MISSING]
    previous = _load_previous(path, set_aside=force or skip_bad_lines)
    by_key = {record_key(r): r for r in previous if all(name in r for name in fields)}
    if len(by_key) < len(previous):
        print(f"sweep: dropping {len(previous) - len(by_key)} records of an older format from {path}")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config.to_dict() if hasattr(config, "to_dict") else dict(config), f, indent=2)
    env = environment()
    hard_timeout_s = float(config.get("cell_hard_timeout_s", 0) or 0)
    fresh, worker = bool(config.get("fresh_process_per_cell", False)), None
    todo = [c for c in cells if force or by_key.get(c.key(), {}).get("status") in (None, "error")]
    print(
        f"sweep: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run "
        f"on {env['backend']} ({env['device_kind']})",
        flush=True,
    )
    start = time.perf_counter()
    try:
        for i, cell in enumerate(todo, 1):
            kwargs = dict(repeats=config.repeats, timeout_s=config.cell_timeout_s, seed=config.seed)
            if hard_timeout_s > 0:
                if worker is None:
                    worker = CellWorker(time_cell, host_devices=_host_devices(cell), fresh=fresh)
                rec = worker.run(cell, hard_timeout_s=hard_timeout_s, **kwargs)
            else:
                try:
                    rec = time_cell(cell, **kwargs)
                except Exception as e:  # record and go on: one bad cell must not end the sweep
                    rec = failure_record(e)
            rec = {**dataclasses.asdict(cell), **rec, **env, "variant": config.get("variant", "custom")}
            process = ("fresh subprocess" if fresh else "subprocess") if hard_timeout_s > 0 else "in-process"
            rec["cell_process"] = process
            by_key[cell.key()] = rec
            write_results(path, list(by_key.values()))
            elapsed = time.perf_counter() - start
            eta = elapsed / i * (len(todo) - i)
            what = (
                f"{rec['min_ms']:9.2f} ms {rec['useful_gflops']:7.1f} GF/s"
                if rec.get("min_ms") is not None
                else rec["status"].upper() + (f" ({rec['error'][:80]})" if rec.get("error") else "")
            )
            print(
                f"[{i}/{len(todo)}] {cell.implementation:>9s} {cell.mask:>14s} {cell.mode:>7s} N={cell.seq_len:<6d} "
                f"heads={cell.num_heads:<3d} {what}  (elapsed {elapsed:.0f}s, ETA {eta:.0f}s)",
                flush=True,
            )
    finally:
        if worker is not None:
            worker.close()
    records = [by_key[c.key()] for c in cells]
    print_table(records)
    if plot:
        files = make_plots(path, out)
        print("wrote " + ", ".join([path] + files))
    return records


def print_table(records: list[dict]) -> None:
    cols = [
        ("implementation", 10, "s"),
        ("mask", 14, "s"),
        ("mode", 7, "s"),
        ("seq_len", 6, "d"),
        ("num_heads", 5, "d"),
        ("min_ms", 9, ".2f"),
        ("median_ms", 9, ".2f"),
        ("useful_gflops", 7, ".1f"),
        ("compile_s", 7, ".2f"),
    ]
    names = {
        "implementation": "impl",
        "seq_len": "N",
        "num_heads": "heads",
        "min_ms": "min ms",
        "median_ms": "med ms",
        "useful_gflops": "GF/s",
        "compile_s": "compile",
    }
    print("\n" + " ".join(f"{names.get(c, c):>{w}s}" for c, w, _ in cols) + "  status")
    for r in records:
        cells = []
        for c, w, fmt in cols:
            val = r.get(c)
            cells.append(f"{val:>{w}{fmt}}" if val is not None else f"{'-':>{w}s}")
        print(" ".join(cells) + f"  {r['status']}")


def config_from_flags():
    c = FLAGS.config
    for name in ("seq_lens", "num_heads"):
        if FLAGS[name].value is not None:
            c[name] = [int(x) for x in FLAGS[name].value]
    for name in ("implementations", "masks", "modes", "dtypes"):
        if FLAGS[name].value is not None:
            c[name] = list(FLAGS[name].value)
    for name in ("head_dim", "batch", "repeats", "mesh"):
        if FLAGS[name].value is not None:
            c[name] = FLAGS[name].value
    with c.unlocked():
        if FLAGS.cell_hard_timeout_s is not None:
            c.cell_hard_timeout_s = FLAGS.cell_hard_timeout_s
        if FLAGS.fresh_process_per_cell:
            c.fresh_process_per_cell = True
    return c


def main(argv):
    del argv
    config = config_from_flags()
    if config.get("mesh"):  # on CPU, one host device per mesh device (before JAX's first computation)
        parallel.use_host_devices(math.prod(parallel.parse_mesh(config.mesh).values()))
        print(mesh_advice(config.mesh, jax.default_backend(), jax.device_count()), flush=True)
    run_sweep(config, FLAGS.out, force=FLAGS.force, plot=FLAGS.plot, skip_bad_lines=FLAGS.skip_bad_lines)


if __name__ == "__main__":
    define_flags()
    sys.exit(app.run(main))
