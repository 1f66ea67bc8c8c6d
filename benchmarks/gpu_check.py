r"""A GPU check in one go: correctness of every GPU implementation, bf16 speed against cuDNN, peak memory.

Needs only jax (with CUDA), flax, optax, chex and absl-py; run from the repository root:

    PYTHONPATH=. python -m benchmarks.gpu_check --out results/gpu_check.json

(``make gpu-check``). Each section has its own time budget (``--minutes``; by default 19 minutes in
all, sized from two shorter runs on an H200); cells past a section's budget are recorded as skipped.
Every row is printed as it finishes and the JSON file is rewritten after each row, so a run cut
short keeps what it measured.
``--smoke`` runs the same code at toy sizes on any backend (the test suite runs it on CPU).
``--corr_heads``, ``--corr_dtypes``, ``--speed_lengths`` and ``--speed_heads`` override the sizes below.

Sections:

a. **correctness**: each implementation in ``--implementations`` (cudnn, pallas, xla, blockwise,
   sparse) against ``attention_reference`` in fp32 with matmul precision "highest": outputs and
   ``jax.vjp`` gradients, bf16 and fp32, masks full / causal / window(128, 0) / window(64, 64) /
   traced padding with an empty row / a 1% random graph (``graph_edges`` for sparse, ``graph``
   otherwise); B=2, T=1000, N=8, K=2, H=64 and 128. An implementation that does not support a
   cell is recorded with ``attnlab.explain``'s reason, not run. Empty rows must be exactly zero.
   Then the scores computed in the tiles, ``SoftCap(30)``, ALiBi as a ``ScoreMod`` and ``Additive(w)``,
   causal, through pallas and blockwise: gradients of q, k, v and of the score's arrays.
b. **speed**: bf16, B=1, N=16, H=64 and 128, T = 4K, 8K, 16K, 32K, forward and forward+backward,
   full attention through cudnn, pallas, xla (where its dense logits fit, the dispatcher's rule)
   and blockwise (to 8K): ms (best of ``--repeats`` after a warm-up), useful TFLOP/s (4·N·H per
   allowed pair forward, 3.5x that forward+backward) and the ratio to cuDNN (cuDNN time / time:
   > 1 is faster than cuDNN). Then causal through pallas vs cuDNN, window ±128 through
   pallas vs cuDNN's causal window(128, 0) (what cuDNN covers), 16 packed documents through
   pallas / xla / blockwise, and ``SoftCap(30)``, ALiBi as a ``ScoreMod`` and additive (tanh) scores
   ``Additive(w)`` (w per head) through pallas, all against cuDNN's full attention (additive's TFLOP/s
   count 5·N·H per pair forward, 3x that forward+backward, as ``benchmarks/scores.py``).
c. **blocks**: the Pallas kernel's tile sizes (block_q, block_k) at ``--speed_lengths``' largest
   length up to 16K, full and causal, bf16, forward and forward+backward (``pallas_attention``
   called with each pair), against cuDNN in the same run.
d. **memory**: the compiled forward+backward's memory (``memory_analysis``: arguments + outputs +
   temporaries) at the largest length, per implementation.

Writes one JSON file and prints a table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import attnlab
from attnlab import impls, masks
from attnlab.call import bind

IMPLEMENTATIONS = ("cudnn", "pallas", "xla", "blockwise", "sparse")


@dataclasses.dataclass(frozen=True)
class Options:
    """The command line (flags are defined only when this file runs as a script)."""

    implementations: tuple = IMPLEMENTATIONS
    repeats: int = 5
    # per section, sized from two shorter runs on an H200 (34 correctness cells of one (H, dtype) in under 2 minutes,
    # 112 speed cells at two lengths in 3 minutes); --minutes trims them
    minutes: tuple = (("correctness", 8.0), ("speed", 8.0), ("blocks", 2.0), ("memory", 1.0))

    def budget(self, section: str) -> float:
        return dict(self.minutes).get(section, 1.0)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each section runs at (the issue's sizes, or toy ones for --smoke)."""

    corr_shape: tuple  # (B, T, N, K)
    corr_heads: tuple  # H values
    window: int  # window(window, 0)
    window2: int  # window(window2, window2)
    speed_lengths: tuple
    speed_heads: tuple
    speed_n: int
    blockwise_max: int  # blockwise timed up to this length
    speed_window: int  # window ±speed_window through pallas vs cuDNN's causal window
    corr_scores: tuple = ("softcap", "alibi_mod", "additive")  # score cells of (a), causal, pallas and blockwise
    corr_dtypes: tuple = ("bfloat16", "float32")  # the dtypes of (a)
    blocks: tuple = ((64, 64), (128, 64), (64, 128), (128, 128), (32, 64))  # (block_q, block_k) of (c)


FULL = Sizes((2, 1000, 8, 2), (64, 128), 128, 64, (4096, 8192, 16384, 32768), (64, 128), 16, 8192, 128)
# (the smoke run checks this script's code; the kernels' fp32 and bf16 correctness on CPU is the conformance suite's)
SMOKE = Sizes((2, 40, 4, 2), (8,), 6, 3, (64,), (8,), 2, 64, 8, ("additive",), ("bfloat16",), ((16, 32),))

# Tolerances against the fp32 "highest" reference, relative to the reference's largest magnitude.
TOL = {"float32": 5e-3, "bfloat16": 4e-2}


class Recorder:
    """The rows of one section: each printed as it is added (progress), and the result file rewritten."""

    def __init__(self, section: str, budget_minutes: float, result: dict | None = None, out: str | None = None):
        self.section, self.rows, self.result, self.out = section, [], result, out
        self.t0, self.budget = time.perf_counter(), budget_minutes
        self._errors_seen: set[str] = set()
        if result is not None:
            result[section] = self.rows

    def left(self) -> bool:
        return (time.perf_counter() - self.t0) / 60 < self.budget

    def add(self, row: dict) -> None:
        self.rows.append(row)
        shown = {k: v for k, v in row.items() if k not in ("reason",) or row["status"] != "unsupported"}
        print(f"[{self.section} {time.perf_counter() - self.t0:6.1f}s] " + json.dumps(shown), flush=True)
        if self.out and self.result is not None:
            _write(self.out, self.result)

    def error(self, row: dict, e: Exception) -> None:
        """An error row; the first traceback of each kind of error goes to stderr in full."""
        msg = f"{type(e).__name__}: {e}"
        key = msg.splitlines()[0][:120]
        if key not in self._errors_seen:
            self._errors_seen.add(key)
            traceback.print_exception(e, file=sys.stderr)
        self.add(row | dict(status="error", reason=msg[:2000]))


def _write(out: str, result: dict) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, out)


# ------------------------------------------------------------------------------------------
# (a) correctness


def _correctness_masks(sz: Sizes, rng):
    B, T, _, _ = sz.corr_shape
    # traced padding: batch 0 pads queries and keys, batch 1 has no keys at all (every row empty)
    q_len = np.array([T - T // 7, T], np.int32)[:B]
    kv_len = np.array([T - T // 5, 0], np.int32)[:B]
    adj = rng.random((T, T)) < 0.01
    adj[3] = False  # an isolated query: an empty row
    r, s = np.nonzero(adj)
    return {
        "full": (None, None),
        "causal": (masks.causal(), None),
        f"window({sz.window},0)": (masks.window(sz.window, 0), None),
        f"window({sz.window2},{sz.window2})": (masks.window(sz.window2, sz.window2), None),
        "traced_padding": ("padding", (q_len, kv_len)),
        "graph_1pct": ((masks.graph(adj), masks.graph_edges(s, r, T)), None),
    }


def _scores(N: int, H: int) -> dict:
    """The correctness section's scores (each with arrays that get gradients, but SoftCap)."""
    return {
        "softcap": attnlab.scores.SoftCap(30.0),
        "alibi_mod": attnlab.scores.ScoreMod(
            attnlab.scores.alibi_mod, jnp.asarray(attnlab.positional.alibi_slopes(N), jnp.float32)
        ),
        "additive": attnlab.scores.Additive(jax.random.normal(jax.random.key(H + 1), (N, H), jnp.float32) / 4),
    }


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(1e-6, float(np.max(np.abs(b)))))


def correctness(sz: Sizes, rec: Recorder, opts: Options) -> None:
    rng = np.random.default_rng(0)
    B, T, N, K = sz.corr_shape
    for H in sz.corr_heads:
        keys = jax.random.split(jax.random.key(H), 4)
        q32 = jax.random.normal(keys[0], (B, T, N, H), jnp.float32)
        k32 = jax.random.normal(keys[1], (B, T, K, H), jnp.float32)
        v32 = jax.random.normal(keys[2], (B, T, K, H), jnp.float32)
        cot32 = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
        # every mask with the dot product on every implementation; then each score, causal, on the two
        # kernels that compute scores in their tiles (gradients of q, k, v and the score's arrays)
        cells = [(name, spec, lengths, "dot", opts.implementations) for name, (spec, lengths) in
                 _correctness_masks(sz, rng).items()]  # fmt: skip
        tiled = tuple(i for i in ("pallas", "blockwise") if i in opts.implementations)
        cells += [("causal", masks.causal(), None, _scores(N, H)[name], tiled) for name in sz.corr_scores]
        for mask_name, spec, lengths, score, impls_ in cells:
            for dtype in map(jnp.dtype, sz.corr_dtypes):
                q, k, v, cot = (x.astype(dtype) for x in (q32, k32, v32, cot32))
                try:
                    ref_out, ref_grads, empty = _reference(q, k, v, cot, spec, lengths, score)
                except Exception as e:  # e.g. out of memory (the additive reference is [B, N, T, S, H])
                    for impl in impls_:
                        row = dict(H=H, mask=mask_name, dtype=jnp.dtype(dtype).name, implementation=impl)
                        rec.error(row | dict(score=_score_name(score)), RuntimeError(f"the reference failed: {e}"))
                    continue
                for impl in impls_:
                    row = dict(H=H, mask=mask_name, dtype=jnp.dtype(dtype).name, implementation=impl)
                    row |= dict(score=_score_name(score))
                    mask = _mask_for(spec, lengths, impl)
                    if not rec.left():
                        rec.add(row | dict(status="skipped", reason="time budget"))
                        continue
                    why = _why_not(q, k, v, mask, lengths, impl, score)
                    if why is not None:
                        rec.add(row | dict(status="unsupported", reason=why))
                        continue
                    try:
                        first = time.perf_counter()
                        out, grads = _run(q, k, v, cot, spec, lengths, impl, score)
                        first = time.perf_counter() - first
                    except Exception as e:  # report and go on: one broken kernel must not hide the others
                        rec.error(row, e)
                        continue
                    err = _rel_err(out, ref_out)
                    pairs = zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True)
                    gerr = max(_rel_err(g, r) for g, r in pairs)
                    zero_rows = bool(np.all(np.asarray(out, np.float32)[empty] == 0)) if empty is not None else True
                    finite = all(
                        bool(np.isfinite(np.asarray(g, np.float32)).all()) for g in jax.tree_util.tree_leaves(grads)
                    )
                    tol = TOL[jnp.dtype(dtype).name]
                    ok = err <= tol and gerr <= 2 * tol and zero_rows and finite
                    rec.add(
                        row
                        | dict(
                            status="ok" if ok else "FAIL",
                            out_rel_err=round(err, 6),
                            grad_rel_err=round(gerr, 6),
                            empty_rows_zero=zero_rows,
                            grads_finite=finite,
                            first_call_s=round(first, 2),  # trace, compile and run of fwd+bwd
                        )
                    )


def _mask_for(spec, lengths, impl, traced_lengths=None):
    if spec == "padding":
        q_len, kv_len = lengths if traced_lengths is None else traced_lengths
        return masks.padding(q_lengths=q_len, kv_lengths=kv_len)
    if isinstance(spec, tuple):  # (dense graph, edge list)
        return spec[1] if impl == "sparse" else spec[0]
    return spec


def _why_not(q, k, v, mask, lengths, impl, score="dot"):
    sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    ex = attnlab.explain(*sds, mask=mask, score=score, backend=None, implementation=(impl,))
    return ex.reason(impl)


def _call(impl, spec):
    def f(q, k, v, q_len, kv_len, score):
        mask = _mask_for(spec, None, impl, traced_lengths=(q_len, kv_len))
        return attnlab.attention(q, k, v, mask=mask, score=score, implementation=impl)

    return f


def _vjp(f, q, k, v, score, cot):
    """Output and the gradients of q, k, v (and of the score's arrays: a score object is a pytree)."""
    if score == "dot":
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, score), q, k, v)
    else:
        out, vjp = jax.vjp(f, q, k, v, score)
    return out, vjp(cot)


def _run(q, k, v, cot, spec, lengths, impl, score="dot"):
    q_len, kv_len = (None, None) if lengths is None else (jnp.asarray(x) for x in lengths)
    f = _call(impl, spec)

    def fwd_bwd(q, k, v, cot, q_len, kv_len, *score_arg):  # the score object is a pytree argument; "dot" is not
        sc = score_arg[0] if score_arg else score
        return _vjp(lambda q, k, v, sc: f(q, k, v, q_len, kv_len, sc), q, k, v, sc, cot)

    out, grads = jax.jit(fwd_bwd)(q, k, v, cot, q_len, kv_len, *(() if score == "dot" else (score,)))
    return jax.block_until_ready((out, grads))


def _reference(q, k, v, cot, spec, lengths, score="dot"):
    """fp32, precision "highest"; also the boolean [B, T, N] of empty rows (or None)."""
    q, k, v, cot = (x.astype(jnp.float32) for x in (q, k, v, cot))
    mask = _mask_for(spec, lengths, "reference")
    with jax.default_matmul_precision("highest"):
        out, grads = _vjp(
            lambda q, k, v, sc: attnlab.attention_reference(q, k, v, mask=mask, score=sc), q, k, v, score, cot
        )
    empty = None
    if mask is not None:
        B, T, N, _ = q.shape
        dense = np.broadcast_to(np.asarray(mask.dense(T, k.shape[1])), (B, 1, T, k.shape[1]))
        empty = np.broadcast_to(~dense.any(-1).transpose(0, 2, 1), (B, T, N))  # [B, 1, T] -> [B, T, N]
    return out, grads, empty


# ------------------------------------------------------------------------------------------
# (b) speed and (c) memory


def _allowed_pairs(kind, T, w):
    if kind == "full":
        return T * T
    if kind == "causal":
        return T * (T + 1) // 2
    left, right = w
    t = np.arange(T)
    return int(np.sum(np.minimum(T - 1, t + right) - np.maximum(0, t - left) + 1))


def _speed_fn(impl, mask, direction, score="dot", traced_mask=False):
    """jitted fwd or fwd+bwd of (q, k, v), or of (q, k, v, mask) when ``traced_mask`` (the mask's arrays
    are then traced arguments: the kernels' run-time layout, no recompile when they change)."""

    def fwd(q, k, v, m=mask):
        return attnlab.attention(q, k, v, mask=m, score=score, implementation=impl)

    if direction == "fwd":
        f = fwd
    else:

        def f(q, k, v, *m):
            return jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v, *m).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    if traced_mask:
        return jax.jit(f)
    return jax.jit(lambda q, k, v: f(q, k, v))


def _time(f, args, repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    compile_s = time.perf_counter() - t
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best * 1e3, compile_s


DOCS = 16  # packed documents per row in the speed section's document cells


def doc_ids(T: int, docs: int = DOCS, seed: int = 0) -> np.ndarray:
    """int32 [1, T]: ``docs`` documents of random lengths covering one row (as benchmarks.flex)."""
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, T), size=docs - 1, replace=False))
    return np.repeat(np.arange(docs, dtype=np.int32), np.diff(np.concatenate([[0], cuts, [T]])))[None]


def _score_name(score) -> str:
    if score == "dot":
        return "dot"
    if isinstance(score, attnlab.scores.SoftCap):
        return f"softcap:{score.cap:g}"
    return "additive" if isinstance(score, attnlab.scores.Additive) else "alibi_mod"


def _speed_cells(sz: Sizes):
    """(kind, mask, window, T, H, impl, direction, score) in the order they run; cuDNN first in each group.

    The document rows (16 packed documents of random lengths, ids concrete), the soft-capped rows
    (``SoftCap(30)``) and the ALiBi ``ScoreMod`` rows are compared with full attention through cuDNN
    (cuDNN takes none of them): their
    ``vs_cudnn`` says what the structure or the score costs against the dense fused kernel.
    """
    w = sz.speed_window
    for H in sz.speed_heads:
        for T in sz.speed_lengths:
            for direction in ("fwd", "fwd+bwd"):
                for impl in ("cudnn", "pallas", "xla", "blockwise"):
                    if impl == "blockwise" and T > sz.blockwise_max:
                        continue
                    yield "full", None, None, T, H, impl, direction, "dot"
                for impl in ("cudnn", "pallas"):
                    yield "causal", masks.causal(), None, T, H, impl, direction, "dot"
                # window ±w through pallas against what cuDNN covers: the causal window (w, 0)
                yield f"window({w},0)", masks.window(w, 0), (w, 0), T, H, "cudnn", direction, "dot"
                yield f"window({w},{w})", masks.window(w, w), (w, w), T, H, "pallas", direction, "dot"
                ids = doc_ids(T, min(DOCS, T // 2))
                for impl in ("pallas", "xla", "blockwise"):
                    if impl == "blockwise" and T > sz.blockwise_max:
                        continue
                    yield "document16", masks.document(ids), None, T, H, impl, direction, "dot"
                # the same documents with traced ids (the mask is a jit argument): layout refined on device
                yield "document16_traced", masks.document(jnp.asarray(ids)), None, T, H, "pallas", direction, "dot"
                yield "full", None, None, T, H, "pallas", direction, attnlab.scores.SoftCap(30.0)
                slopes = jnp.asarray(attnlab.positional.alibi_slopes(sz.speed_n), jnp.float32)
                alibi = attnlab.scores.ScoreMod(attnlab.scores.alibi_mod, slopes)  # a user score_mod with arrays
                yield "full", None, None, T, H, "pallas", direction, alibi
                w_add = jax.random.normal(jax.random.key(H), (sz.speed_n, H), jnp.float32) * H**-0.5
                for impl in ("pallas", "blockwise"):  # tanh, w per head
                    if impl == "blockwise" and T > sz.blockwise_max:
                        continue
                    yield "full", None, None, T, H, impl, direction, attnlab.scores.Additive(w_add)


def _flops(kind, T, w, N, H, direction, score) -> float:
    """Useful FLOPs of one call: 4·N·H per allowed pair forward, 3.5x that forward+backward; additive
    5·N·H per pair, 3x (as ``benchmarks/scores.py``)."""
    if kind.startswith("document"):
        pairs = int((np.bincount(doc_ids(T, min(DOCS, T // 2))[0]) ** 2).sum())
    else:
        pairs = _allowed_pairs("window" if w else kind, T, w)
    if isinstance(score, attnlab.scores.Additive):
        return 5 * N * H * pairs * (3.0 if direction == "fwd+bwd" else 1.0)
    return 4 * N * H * pairs * (3.5 if direction == "fwd+bwd" else 1.0)


def _qkv(T, H, N):
    keys = jax.random.split(jax.random.key(T + H), 3)
    return tuple(jax.random.normal(kk, (1, T, N, H), jnp.bfloat16) for kk in keys)


def speed(sz: Sizes, rec: Recorder, opts: Options) -> None:
    cudnn_ms = {}
    for kind, mask, w, T, H, impl, direction, score in _speed_cells(sz):
        if impl not in opts.implementations:
            continue
        N = sz.speed_n
        row = dict(mask=kind, T=T, H=H, N=N, B=1, dtype="bfloat16", implementation=impl, direction=direction)
        row |= dict(score=_score_name(score))
        sds = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
        why = attnlab.explain(sds, sds, sds, mask=mask, score=score, implementation=(impl,)).reason(impl)
        if why is None and impl == "xla":
            why = impls.XLA.pays_off(bind(sds, sds, sds, mask=mask), "gpu")
        if why is not None:
            rec.add(row | dict(status="unsupported", reason=why))
            continue
        if not rec.left():
            rec.add(row | dict(status="skipped", reason="time budget"))
            continue
        traced = kind.endswith("_traced")
        args = _qkv(T, H, N) + ((mask,) if traced else ())
        group = ("full" if kind.startswith("document") else kind if w is None else "window", T, H, direction)
        flops = _flops(kind, T, w, N, H, direction, score)
        f = _speed_fn(impl, mask, direction, score, traced)
        ms = _timed_row(rec, row, f, args, opts, flops, cudnn_ms.get(group))
        if ms is not None and impl == "cudnn" and score == "dot":
            cudnn_ms[group] = ms


def _timed_row(rec: Recorder, row: dict, f, args, opts: Options, flops: float, cudnn_ms: float | None):
    """Times ``f(*args)`` and records the row (ms, useful TFLOP/s, ``cudnn_ms`` / ms); the ms, or None on an error."""
    try:
        ms, compile_s = _time(f, args, opts.repeats)
    except Exception as e:
        rec.error(row, e)
        return None
    ratio = ms if cudnn_ms is None and row["implementation"] == "cudnn" else cudnn_ms  # cuDNN's own row: 1
    rec.add(
        row
        | dict(
            status="ok",
            ms=round(ms, 3),
            tflops=float(f"{flops / ms / 1e9:.3g}"),
            vs_cudnn=None if ratio is None else round(ratio / ms, 3),
            compile_s=round(compile_s, 2),
        )
    )
    return ms


def blocks(sz: Sizes, rec: Recorder, opts: Options) -> None:
    """The Pallas kernel's tile sizes, full and causal, each against cuDNN in the same run."""
    from attnlab.kernels import pallas_flash  # noqa: PLC0415

    T = max(t for t in sz.speed_lengths if t <= max(16384, min(sz.speed_lengths)))
    N = sz.speed_n
    for H in sz.speed_heads:
        q, k, v = _qkv(T, H, N)
        for kind, mask in (("full", None), ("causal", masks.causal())):
            for direction in ("fwd", "fwd+bwd"):
                ref_ms = None
                for bq, bk in ((None, None),) + tuple(sz.blocks):
                    impl = "cudnn" if bq is None else "pallas"
                    row = dict(mask=kind, T=T, H=H, N=N, dtype="bfloat16", direction=direction, implementation=impl)
                    row |= dict(block_q=bq, block_k=bk)
                    if impl not in opts.implementations:
                        continue
                    if impl == "cudnn":
                        sds = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
                        why = attnlab.explain(sds, sds, sds, mask=mask, implementation=("cudnn",)).reason("cudnn")
                        if why is not None:
                            rec.add(row | dict(status="unsupported", reason=why))
                            continue
                    if not rec.left():
                        rec.add(row | dict(status="skipped", reason="time budget"))
                        continue

                    def fwd(q, k, v, bq=bq, bk=bk, mask=mask):
                        if bq is None:
                            return attnlab.attention(q, k, v, mask=mask, implementation="cudnn")
                        return pallas_flash.pallas_attention(q, k, v, mask=mask, block_q=bq, block_k=bk)

                    if direction == "fwd":
                        f = jax.jit(fwd)
                    else:
                        f = jax.jit(
                            jax.grad(lambda q, k, v, fwd=fwd: jnp.sum(fwd(q, k, v).astype(jnp.float32)), (0, 1, 2))
                        )
                    ms = _timed_row(rec, row, f, (q, k, v), opts, _flops(kind, T, None, N, H, direction, "dot"), ref_ms)
                    if bq is None:
                        ref_ms = ms


def memory(sz: Sizes, rec: Recorder, opts: Options) -> None:
    T, H, N = sz.speed_lengths[-1], sz.speed_heads[0], sz.speed_n
    for impl in opts.implementations:
        if impl == "sparse":
            continue
        row = dict(T=T, H=H, N=N, B=1, dtype="bfloat16", implementation=impl, direction="fwd+bwd", mask="full")
        sds = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
        why = attnlab.explain(sds, sds, sds, implementation=(impl,)).reason(impl)
        if why is None and impl == "xla":
            why = impls.XLA.pays_off(bind(sds, sds, sds), "gpu")
        if why is None and impl == "blockwise" and T > sz.blockwise_max:
            why = f"blockwise is timed up to T={sz.blockwise_max}"
        if why is not None or not rec.left():
            rec.add(row | dict(status="unsupported" if why else "skipped", reason=why or "time budget"))
            continue
        try:
            compiled = _speed_fn(impl, None, "fwd+bwd").lower(sds, sds, sds).compile()
            ma = compiled.memory_analysis()
            total = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
            temp = ma.temp_size_in_bytes
            rec.add(row | dict(status="ok", temp_bytes=temp, total_bytes=total, total_mib=round(total / 2**20, 1)))
        except Exception as e:
            rec.error(row, e)


# ------------------------------------------------------------------------------------------


def _table(title, rows, cols) -> str:
    lines = [f"## {title}", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


SECTIONS = ("correctness", "speed", "blocks", "memory")


def run(smoke: bool, sections, out: str | None, opts: Options = Options(), sizes: dict | None = None) -> dict:
    """Runs ``sections`` (in SECTIONS' order); ``sizes`` overrides fields of the Sizes (e.g. speed_lengths)."""
    sz = dataclasses.replace(SMOKE if smoke else FULL, **(sizes or {}))
    t0 = time.perf_counter()
    result = {
        "meta": dict(
            jax=jax.__version__,
            backend=jax.default_backend(),
            devices=[str(d) for d in jax.devices()],
            device_kind=jax.devices()[0].device_kind,
            python=sys.version.split()[0],
            machine=platform.machine(),
            smoke=smoke,
            sizes=dataclasses.asdict(sz),
            implementations=list(opts.implementations),
            repeats=opts.repeats,
            minutes=dict(opts.minutes),
        )
    }
    fns = {"correctness": correctness, "speed": speed, "blocks": blocks, "memory": memory}
    for name in SECTIONS:
        if name in sections:
            s = time.perf_counter()
            fns[name](sz, Recorder(name, opts.budget(name), result, out), opts)
            result["meta"][f"{name}_s"] = round(time.perf_counter() - s, 1)
    result["meta"]["total_s"] = round(time.perf_counter() - t0, 1)
    if out:
        _write(out, result)
    return result


def _minutes(values) -> tuple:
    """``["speed=3", "blocks=0.5"]`` -> the default budgets with those replaced."""
    minutes = dict(Options.minutes)
    for item in values:
        name, _, value = item.partition("=")
        if name not in SECTIONS or not value:
            raise ValueError(f"--minutes: expected section=minutes with a section in {SECTIONS}, got {item!r}")
        minutes[name] = float(value)
    return tuple(minutes.items())


def main(_):
    opts = Options(tuple(_IMPLS.value), _REPEATS.value, _minutes(_MINUTES.value))
    sizes = {}
    for flag, field in ((_CORR_HEADS, "corr_heads"), (_SPEED_LENGTHS, "speed_lengths"), (_SPEED_HEADS, "speed_heads")):
        if flag.value:
            sizes[field] = tuple(int(x) for x in flag.value)
    if _CORR_DTYPES.value:
        sizes["corr_dtypes"] = tuple(_CORR_DTYPES.value)
    result = run(_SMOKE.value, _SECTIONS.value, _OUT.value, opts, sizes)
    speed_cols = ["mask", "T", "H", "direction", "implementation", "score", "status", "ms", "tflops", "vs_cudnn"]
    cols = {
        "correctness": ["H", "mask", "dtype", "implementation", "score", "status", "out_rel_err", "grad_rel_err"],
        "speed": speed_cols,
        "blocks": ["mask", "T", "H", "direction", "implementation", "block_q", "block_k", "status", "ms", "vs_cudnn"],
        "memory": ["T", "H", "implementation", "status", "temp_bytes", "total_mib"],
    }
    print(json.dumps(result["meta"], indent=1))
    for name in SECTIONS:
        if name in result:
            print(_table(name, result[name], cols[name] + ["reason"]))
    fails = [r for r in result.get("correctness", []) if r["status"] in ("FAIL", "error")]
    print(f"\n{len(fails)} correctness failures; wrote {_OUT.value}")


if __name__ == "__main__":
    _OUT = flags.DEFINE_string("out", "results/gpu_check.json", "JSON file to write.")
    _SMOKE = flags.DEFINE_bool("smoke", False, "Toy sizes (runs on CPU in seconds): the same code path.")
    _SECTIONS = flags.DEFINE_list("sections", ["correctness", "speed", "blocks", "memory"], "Sections to run.")
    _IMPLS = flags.DEFINE_list("implementations", list(IMPLEMENTATIONS), "Implementations to check.")
    _REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per speed cell (best is reported).")
    _MINUTES = flags.DEFINE_list(
        "minutes",
        [],
        "Time budget per section, e.g. speed=3,blocks=0.5 (defaults: " + str(dict(Options.minutes)) + ").",
    )
    _CORR_HEADS = flags.DEFINE_list("corr_heads", [], "Head dims of the correctness section (default 64,128).")
    _CORR_DTYPES = flags.DEFINE_list("corr_dtypes", [], "dtypes of the correctness section (default bfloat16,float32).")
    _SPEED_LENGTHS = flags.DEFINE_list("speed_lengths", [], "Lengths of the speed section (default 4K-32K).")
    _SPEED_HEADS = flags.DEFINE_list("speed_heads", [], "Head dims of the speed section (default 64,128).")
    app.run(main)
