r"""Speed and memory of attnlab's kernels against peers, as ratios measured side by side.

Peers (optional ``bench`` extra): torch 2.13 CPU ``scaled_dot_product_attention`` and compiled
``flex_attention`` with a block mask, ``jax.nn.dot_product_attention`` (XLA), and PyTorch
Geometric's ``TransformerConv`` for graphs. Missing peers are skipped, not faked.

Each suite times every implementation once per round (after one untimed call, so the previous
implementation's spinning thread pool is idle), rounds alternate (so machine load hits all
alike), and the best of ``--repeats`` rounds is reported after a warm-up call (whose extra time
is reported as compile time). GFLOP/s counts useful work only: 4·N·H per allowed (query, key)
pair forward, 3.5x that for forward+backward (the backward does 5 matmuls to the forward's 2).

On CPU, attnlab is also timed with its heads split over one host device per core
(``attnlab.blockwise/<D>dev``: ``attnlab.parallel`` head parallelism, the same kernel on N / D
heads per device; ``--host_devices``), because XLA:CPU runs small tile matmuls on one core and
one device's ops one after another: the one-device window kernel keeps ~1 of 2 cores busy.
Its inputs are placed on the devices before timing, as a head-parallel model's activations are
(torch's inputs are likewise made once, in its own layout, outside the timed region).

Command (what ``make bench`` runs; about 20 minutes on 2 cores, PyG included):

    python -m benchmarks.bench_attention --out results/bench

Short smoke run:

    python -m benchmarks.bench_attention --suites=full --full_lengths=512 --repeats=2

Writes ``<out>/bench.json`` (one record per implementation and size, plus the flags) and prints
a table.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import attnlab
from attnlab import masks, parallel
from benchmarks import harness
from benchmarks.cases import Case
from benchmarks.harness import host_devices
from benchmarks.torch_peers import mask_mod
from experiments import common


def define_flags():
    """The command-line flags, defined only when run as a program (importing the module defines none)."""
    global \
        _SUITES, \
        _FULL, \
        _BWD, \
        _WIN, \
        _WIN_BWD, \
        _WIN_FLEX, \
        _WIN_JNN, \
        _WINDOW, \
        _NODES, \
        _EDGES, \
        _MEM, \
        _HEADS, \
        _HEAD_DIM, \
        _REPEATS, \
        _PEERS, \
        _DTYPE, \
        _OUT, \
        _DEVICES
    _SUITES = flags.DEFINE_list(
        "suites", ["full", "full_bwd", "window", "window_bwd", "graph", "memory"], "Suites to run."
    )
    _FULL = flags.DEFINE_list("full_lengths", ["1024", "2048", "4096", "8192"], "N for full attention forward.")
    _BWD = flags.DEFINE_list("bwd_lengths", ["1024", "2048", "4096", "8192"], "N for full attention forward+backward.")
    _WIN = flags.DEFINE_list("window_lengths", ["1024", "4096", "16384", "65536"], "N for window attention.")
    _WIN_BWD = flags.DEFINE_list(
        "window_bwd_lengths", ["1024", "4096", "16384", "65536"], "N for window attention forward+backward."
    )
    _WIN_FLEX = flags.DEFINE_list(
        "window_flex_lengths",
        ["1024", "4096", "16384"],
        "N at which torch flex_attention is also timed (each N compiles anew).",
    )
    _WIN_JNN = flags.DEFINE_list(
        "window_jax_nn_lengths",
        ["4096", "8192"],
        "N at which jax.nn's local window is also timed (it forms [N, T, S]: 16K needs > 20 GB).",
    )
    _WINDOW = flags.DEFINE_integer("window", 128, "Window half-width: keys t-w .. t+w.")
    _NODES = flags.DEFINE_integer("graph_nodes", 100_000, "Graph suite: nodes.")
    _EDGES = flags.DEFINE_integer("graph_edges", 1_000_000, "Graph suite: edges (random, unique).")
    _MEM = flags.DEFINE_list("memory_lengths", ["8192", "32768"], "N for the compiled fwd+bwd memory.")
    _HEADS = flags.DEFINE_integer("heads", 8, "N heads.")
    _HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "H head dim.")
    _REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds (best is reported).")
    _PEERS = flags.DEFINE_list("peers", ["torch", "jax_nn", "pyg"], "Peers to include if installed.")
    _DTYPE = flags.DEFINE_enum(
        "dtype",
        "auto",
        ["auto", "float32", "bfloat16", "float16"],
        "Input dtype of every implementation and peer; auto: bfloat16 on GPU/TPU, float32 on CPU.",
    )
    _OUT = flags.DEFINE_string("out", "results/bench", "Output folder for bench.json.")
    _DEVICES = flags.DEFINE_integer(
        "host_devices",
        -1,
        "CPU only: also time attnlab with the heads split over this many host devices (one per core, "
        "attnlab.parallel head parallelism), beside the one-device kernel. -1: the largest divisor of "
        "--heads not above the core count; 0 or 1: off.",
    )


def bench_dtype(flag: str, backend: str) -> str:
    """The dtype measured: the flag, or for "auto" bfloat16 on GPU/TPU and float32 on CPU."""
    if flag != "auto":
        return flag
    return "bfloat16" if backend in ("gpu", "cuda", "rocm", "tpu") else "float32"


def torch_device(backend: str, cuda_available: bool) -> tuple[str | None, str]:
    """(torch device for the peers or None, why): torch runs where JAX runs, or not at all.

    JAX on CPU -> torch on CPU; JAX on a GPU -> torch on CUDA when torch sees one (SDPA and
    flex_attention on the same device); JAX on TPU, or on a GPU torch cannot see -> no torch peer
    (a CPU peer against an accelerator is no comparison).
    """
    if backend == "cpu":
        return "cpu", "JAX and torch on CPU"
    if backend in ("gpu", "cuda", "rocm"):
        if cuda_available:
            return "cuda", "JAX and torch on the GPU"
        return None, "JAX is on a GPU but torch sees none (a CPU-only torch?): torch peers skipped"
    return None, f"no torch peer on {backend}: torch does not run there"


def _torch():
    """(torch module or None, its device or None): see ``torch_device``."""
    if "torch" not in _PEERS.value:
        return None, None
    try:
        import torch
    except ImportError:
        print("torch not installed (pip install -e '.[bench]'): torch peers skipped", file=sys.stderr)
        return None, None
    device, why = torch_device(jax.default_backend(), torch.cuda.is_available())
    print(f"torch {torch.__version__}: {why}", file=sys.stderr)
    return (torch, device) if device else (None, None)


def time_side_by_side(fns: dict, repeats: int) -> dict:
    """{name: fn()} -> {name: Timing}; fns must block until done (``harness.interleaved`` with a settling call).

    Each round runs every implementation twice in a row and times the second call. Both torch's
    OpenMP pool and XLA:CPU's Eigen pool spin-wait for a while after their work, so the first call
    after the other framework finds its cores still busy (measured at N = 1K: +25% for attnlab
    after torch, +20% for torch after jax.nn); the untimed call absorbs that. Best of ``repeats``.
    """
    return harness.interleaved(fns, rounds=repeats, repeats=1, settle=True)


def _records(suite, n, timed, flops, peers_of):
    """One record per implementation, with ratios (peer ms / ours ms: > 1 means ours is faster)."""
    out = []
    for name, t in timed.items():
        ms, first_ms = 1e3 * t.best_s, 1e3 * t.first_s
        rec = dict(
            suite=suite,
            impl=name,
            N=n,
            ms=round(ms, 3),
            compile_ms=round(max(first_ms - ms, 0), 1),
            gflops=round(flops / ms / 1e6, 2),
        )
        if name in peers_of:
            for peer in peers_of[name]:
                if peer in timed:
                    rec[f"x_vs_{peer}"] = round(1e3 * timed[peer].best_s / ms, 3)
        out.append(rec)
    return out


def _dtype():
    return jnp.dtype(bench_dtype(_DTYPE.value, jax.default_backend()))


def _qkv(n, seed=0):
    h, d = _HEADS.value, _HEAD_DIM.value
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(kk, (1, n, h, d), jnp.float32).astype(_dtype()) for kk in keys]  # [B, T, N, H]


TORCH_DEVICE = "cpu"  # set by main() from torch_device()


def to_torch(torch, xs, grad=False, device=None):
    """[B, T, N, H] jax arrays -> [B, N, T, H] torch tensors (torch's layout) of the same dtype, on
    the torch peers' device; once, outside the timed region."""
    out = []
    for x in xs:
        t = torch.from_numpy(np.array(x.astype(jnp.float32)))  # numpy has no bfloat16: through fp32 (a writable copy)
        t = t.to(device=device or TORCH_DEVICE, dtype=getattr(torch, jnp.dtype(x.dtype).name))
        out.append(t.transpose(1, 2).contiguous().requires_grad_(grad))
    return out


def _synced(torch, fn):
    """fn, made to block until its (possibly asynchronous, on CUDA) work is done, as JAX's are."""
    if TORCH_DEVICE != "cuda":
        return fn

    def run():
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


def _sharded():
    """(name, mesh) of the head-parallel attnlab row, or None (one device, or not on CPU)."""
    d = host_devices(_DEVICES.value, os.cpu_count() or 1, _HEADS.value)
    if d < 2 or jax.default_backend() != "cpu" or len(jax.devices()) < d:
        return None
    return f"attnlab.blockwise/{d}dev", parallel.make_mesh(f"heads={d}")


def _ours(sh) -> list[str]:
    return ["attnlab.blockwise"] + ([sh[0]] if sh else [])


def _heads_split(mesh, xs):
    return [parallel.shard(x, mesh, head_axis="heads") for x in xs]


# ------------------------------------------------------------------------------------------


def suite_full(torch):
    recs = []
    ours = jax.jit(functools.partial(attnlab.attention, implementation="blockwise"))
    jnn = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="xla"))
    sh = _sharded()
    if sh:
        ours_sh = jax.jit(
            functools.partial(parallel.attention, mesh=sh[1], head_axis="heads", implementation="blockwise")
        )
    for n in map(int, _FULL.value):
        q, k, v = _qkv(n)
        fns = {"attnlab.blockwise": lambda q=q, k=k, v=v: ours(q, k, v).block_until_ready()}
        if sh:
            qkv = _heads_split(sh[1], (q, k, v))
            fns[sh[0]] = lambda qkv=qkv: ours_sh(*qkv).block_until_ready()
        if "jax_nn" in _PEERS.value:
            fns["jax.nn"] = lambda q=q, k=k, v=v: jnn(q, k, v).block_until_ready()
        if torch is not None:
            tq, tk, tv = to_torch(torch, (q, k, v))
            fns["torch.sdpa"] = _synced(
                torch, lambda tq=tq, tk=tk, tv=tv: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
            )
        flops = 4 * n * n * _HEADS.value * _HEAD_DIM.value
        recs += _records(
            "full fwd",
            n,
            time_side_by_side(fns, _REPEATS.value),
            flops,
            {name: ["torch.sdpa", "jax.nn"] for name in _ours(sh)},
        )
    return recs


def suite_full_bwd(torch):
    recs = []

    def fwd_bwd(impl, attention=attnlab.attention, **kw):
        def f(q, k, v, ct):
            out, vjp = jax.vjp(functools.partial(attention, implementation=impl, **kw), q, k, v)
            return vjp(ct)

        return jax.jit(f)

    ours, xla = fwd_bwd("blockwise"), fwd_bwd("xla")
    sh = _sharded()
    if sh:
        ours_sh = fwd_bwd("blockwise", parallel.attention, mesh=sh[1], head_axis="heads")
    for n in map(int, _BWD.value):
        q, k, v = _qkv(n)
        ct = _qkv(n, seed=1)[0]
        fns = {"attnlab.blockwise": lambda q=q, k=k, v=v, ct=ct: jax.block_until_ready(ours(q, k, v, ct))}
        if sh:
            args = _heads_split(sh[1], (q, k, v, ct))
            fns[sh[0]] = lambda args=args: jax.block_until_ready(ours_sh(*args))
        if "jax_nn" in _PEERS.value:
            fns["jax.nn"] = lambda q=q, k=k, v=v, ct=ct: jax.block_until_ready(xla(q, k, v, ct))
        if torch is not None:
            tq, tk, tv = to_torch(torch, (q, k, v), grad=True)
            tct = to_torch(torch, (ct,))[0]

            def run_torch(tq=tq, tk=tk, tv=tv, tct=tct):
                out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
                return torch.autograd.grad(out, (tq, tk, tv), tct)

            fns["torch.sdpa"] = _synced(torch, run_torch)
        flops = 3.5 * 4 * n * n * _HEADS.value * _HEAD_DIM.value
        recs += _records(
            "full fwd+bwd",
            n,
            time_side_by_side(fns, _REPEATS.value),
            flops,
            {name: ["torch.sdpa", "jax.nn"] for name in _ours(sh)},
        )
    return recs


def suite_window(torch):
    return _window_suite(torch, backward=False)


def suite_window_bwd(torch):
    return _window_suite(torch, backward=True)


def _window_suite(torch, backward: bool):
    """Window ±w attention, forward or forward+backward, against torch and jax.nn.

    The torch peer is flex_attention forward; it has no CPU backward (torch 2.13), so
    forward+backward is compared with torch's dense SDPA given the window as a boolean mask.
    """
    recs = []
    w = _WINDOW.value
    mask = masks.window(w, w)

    def timed_fn(attention, **kw):  # q, k, v[, ct] -> output, or the three input gradients
        if not backward:
            return jax.jit(functools.partial(attention, **kw))

        def f(q, k, v, ct):
            return jax.vjp(functools.partial(attention, **kw), q, k, v)[1](ct)

        return jax.jit(f)

    ours = timed_fn(attnlab.attention, mask=mask, implementation="blockwise")
    jnn = timed_fn(jax.nn.dot_product_attention, implementation="xla", local_window_size=(w, w))
    sh = _sharded()
    if sh:
        ours_sh = timed_fn(parallel.attention, mesh=sh[1], head_axis="heads", mask=mask, implementation="blockwise")
    flex = None
    if torch is not None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention)
        except Exception as e:  # noqa: BLE001  (report, don't fail the other peers)
            print(f"flex_attention unavailable: {e}", file=sys.stderr)
    for n in map(int, (_WIN_BWD if backward else _WIN).value):
        q, k, v = _qkv(n)
        args = (q, k, v, _qkv(n, seed=1)[0]) if backward else (q, k, v)
        fns = {"attnlab.blockwise": lambda args=args: jax.block_until_ready(ours(*args))}
        if sh:
            split = _heads_split(sh[1], args)
            fns[sh[0]] = lambda split=split: jax.block_until_ready(ours_sh(*split))
        if "jax_nn" in _PEERS.value and str(n) in _WIN_JNN.value:
            fns["jax.nn"] = lambda args=args: jax.block_until_ready(jnn(*args))
        if flex is not None and str(n) in _WIN_FLEX.value and not backward:  # flex has no CPU backward
            tq, tk, tv = to_torch(torch, (q, k, v))

            window_mod = mask_mod(torch, Case("window", "window", (w, w)), None)
            bm = create_block_mask(window_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=TORCH_DEVICE)
            fns["torch.flex"] = _synced(torch, lambda tq=tq, tk=tk, tv=tv, bm=bm: flex(tq, tk, tv, block_mask=bm))
        if torch is not None and backward and str(n) in _WIN_JNN.value:  # dense SDPA with the window as a mask
            tq, tk, tv = to_torch(torch, (q, k, v), grad=True)
            tct = to_torch(torch, args[3:])[0]
            tmask = torch.tensor(np.asarray(mask.dense(n, n)), device=TORCH_DEVICE)

            def run_sdpa(tq=tq, tk=tk, tv=tv, tct=tct, tmask=tmask):
                out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask)
                return torch.autograd.grad(out, (tq, tk, tv), tct)

            fns["torch.sdpa+mask"] = _synced(torch, run_sdpa)
        pairs = int(np.asarray(mask.dense(n, n)).sum()) if n <= 16384 else (2 * w + 1) * n - w * (w + 1)
        flops = (3.5 if backward else 1.0) * 4 * pairs * _HEADS.value * _HEAD_DIM.value
        timed = time_side_by_side(fns, _REPEATS.value if n <= 16384 else max(2, _REPEATS.value // 2))
        peers = {name: ["torch.flex", "torch.sdpa+mask", "jax.nn"] for name in _ours(sh)}
        recs += _records(f"window ±{w} {'fwd+bwd' if backward else 'fwd'}", n, timed, flops, peers)
        recs[-len(timed) :] = [dict(r, us_per_token=round(r["ms"] * 1e3 / n, 3)) for r in recs[-len(timed) :]]
    return recs


def _random_graph(nodes, edges, seed=0):
    rng = np.random.default_rng(seed)
    pairs = np.unique(rng.integers(0, nodes, size=(int(edges * 1.01) + 16, 2)), axis=0)
    pairs = pairs[rng.permutation(len(pairs))[:edges]]
    return pairs[:, 0].astype(np.int32), pairs[:, 1].astype(np.int32)  # senders, receivers


def suite_graph(torch):
    nodes, e = _NODES.value, _EDGES.value
    h, d = _HEADS.value, _HEAD_DIM.value
    senders, receivers = _random_graph(nodes, e)
    mask = masks.graph_edges(senders, receivers, nodes)
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (nodes, h * d), jnp.float32)
    w = [jax.random.normal(kk, (h * d, h * d), jnp.float32) / np.sqrt(h * d) for kk in keys[1:4]]
    ct = jax.random.normal(keys[4], (nodes, h, d), jnp.float32)

    # everything is an argument (closed-over arrays become constants XLA tries to fold)
    def attn_only(q, k, v, mask):
        return attnlab.attention(q, k, v, mask=mask, implementation="sparse")

    def layer(x, wq, wk, wv, mask):  # as TransformerConv(root_weight=False): projections + attention
        q, k, v = ((x @ wi).reshape(nodes, h, d) for wi in (wq, wk, wv))
        return attn_only(q, k, v, mask)

    @jax.jit
    def attn_fwd_bwd(q, k, v, mask, ct):
        return jax.vjp(functools.partial(attn_only, mask=mask), q, k, v)[1](ct)

    @jax.jit
    def layer_fwd_bwd(x, wq, wk, wv, mask, ct):
        return jax.vjp(functools.partial(layer, mask=mask), x, wq, wk, wv)[1](ct)

    mask = jax.tree_util.tree_map(jnp.asarray, mask)
    q, k, v = ((x @ wi).reshape(nodes, h, d) for wi in w)
    fns = {
        "attnlab.sparse (attention)": lambda: jax.block_until_ready(attn_fwd_bwd(q, k, v, mask, ct)),
        "attnlab.sparse (layer)": lambda: jax.block_until_ready(layer_fwd_bwd(x, *w, mask, ct)),
    }
    if torch is not None and "pyg" in _PEERS.value:
        try:
            from torch_geometric.nn import TransformerConv

            conv = TransformerConv(h * d, d, heads=h, root_weight=False).to(TORCH_DEVICE)
            tx = torch.tensor(np.asarray(x), requires_grad=True, device=TORCH_DEVICE)
            edge_index = torch.tensor(np.stack([senders, receivers]).astype(np.int64), device=TORCH_DEVICE)
            tct = torch.tensor(np.asarray(ct).reshape(nodes, h * d), device=TORCH_DEVICE)

            def run_pyg():
                out = conv(tx, edge_index)
                return torch.autograd.grad(out, [tx, *conv.parameters()], tct, allow_unused=True)

            fns["pyg.TransformerConv (layer)"] = _synced(torch, run_pyg)
        except ImportError:
            print("torch_geometric not installed: PyG peer skipped", file=sys.stderr)
    attn_flops = 3.5 * e * h * (2 * d + 2 * d)
    timed = time_side_by_side(fns, max(2, _REPEATS.value // 2))
    recs = _records(
        f"graph {nodes // 1000}K nodes / {e // 1000}K edges fwd+bwd",
        e,
        timed,
        attn_flops,
        {"attnlab.sparse (layer)": ["pyg.TransformerConv (layer)"]},
    )
    # memory of the compiled attention fwd+bwd, at E and 4E
    for r in recs:
        if r["impl"] == "attnlab.sparse (attention)":
            compiled = attn_fwd_bwd.lower(q, k, v, mask, ct).compile()
            r["temp_mb"] = round(common.compiled_memory(compiled)["temp_bytes"] / 2**20, 1)
    return recs


def suite_memory(torch):
    """Compiled fwd+bwd memory of the blockwise kernel (XLA's buffer assignment), and where the
    device keeps statistics (GPU, TPU; not XLA:CPU) the device's peak while running it once, above
    what was in use before (``experiments.common.memory_record``: only when it is this run's)."""
    recs = []
    h, d = _HEADS.value, _HEAD_DIM.value
    for n in map(int, _MEM.value):
        x = jax.ShapeDtypeStruct((1, n, h, d), _dtype())

        def fwd(q, k, v):
            return attnlab.attention(q, k, v, implementation="blockwise")

        t0 = time.perf_counter()  # the gradients for an output cotangent passed in, as every fwd+bwd benchmark
        compiled = jax.jit(harness.fwd_bwd(fwd)).lower(x, x, x, x).compile()
        ma = compiled.memory_analysis()
        rec = dict(
            suite="memory fwd+bwd (compiled)",
            impl="attnlab.blockwise",
            N=n,
            temp_mb=round(common.compiled_memory(compiled)["temp_bytes"] / 2**20, 1),
            args_out_mb=round((ma.argument_size_in_bytes + ma.output_size_in_bytes) / 2**20, 1),
            dense_logits_mb=round(n * n * h * 4 / 2**20, 1),
            compile_ms=round((time.perf_counter() - t0) * 1e3, 1),
            memory_source="xla_memory_analysis",
        )
        if common.memory_stats() is not None:  # run it once and read the device's own peak
            args = (*_qkv(n), harness.cotangent(x.shape, x.dtype))
            before = common.memory_stats()
            jax.block_until_ready(compiled(*args))
            mem = common.memory_record(compiled, before, common.memory_stats())
            rec["memory_source"] = mem["memory_source"]
            if "device_peak_bytes" in mem:
                rec["device_peak_mb"] = round(mem["device_peak_bytes"] / 2**20, 1)
        recs.append(rec)
    return recs


def _print_table(recs):
    cols = ["suite", "impl", "N", "ms", "compile_ms", "gflops", "us_per_token", "temp_mb", "args_out_mb"]
    cols += ["dense_logits_mb", "device_peak_mb", *sorted({k for r in recs for k in r if k.startswith("x_vs_")})]
    print(harness.rows_table(recs[0]["suite"] if recs else "bench", recs, cols))


def main(argv):
    del argv
    d = host_devices(_DEVICES.value, os.cpu_count() or 1, _HEADS.value)
    if d > 1:  # before the first computation; affects only the CPU client
        parallel.use_host_devices(d)
    global TORCH_DEVICE
    torch, TORCH_DEVICE = _torch()
    if torch is not None and TORCH_DEVICE == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    suites = dict(
        full=suite_full,
        full_bwd=suite_full_bwd,
        window=suite_window,
        window_bwd=suite_window_bwd,
        graph=suite_graph,
        memory=suite_memory,
    )
    for name in _SUITES.value:
        if name not in suites:
            raise app.UsageError(f"--suites: unknown suite {name!r}; choose from {sorted(suites)}")
    os.makedirs(_OUT.value, exist_ok=True)
    run = harness.Run()
    meta = dict(
        flags={f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(sys.modules[__name__])},
        cpus=os.cpu_count(),
        machine=platform.machine(),
        dtype=bench_dtype(_DTYPE.value, jax.default_backend()),
        torch_device=TORCH_DEVICE if torch is not None else None,
        host_devices=int(sh[1].devices.size) if (sh := _sharded()) else 1,
    )
    recs = []
    path = os.path.join(_OUT.value, "bench.json")
    for name in _SUITES.value:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        new = suites[name](torch)
        _print_table(new)
        recs += new
        # after every suite (a crash keeps the rest), with the wall and CPU seconds so far
        harness.write_json(path, dict(meta=run.finish() | meta, records=recs))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    define_flags()
    app.run(main)
