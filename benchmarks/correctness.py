"""The correctness harness: implementations against the dense fp32 reference, outputs and gradients.

For each head dim, case and dtype: the reference (``attnlab.attention_reference`` in fp32, matmul
precision "highest", on the same inputs upcast) and each implementation's output and ``jax.vjp``
gradients (of q, k, v and of the score's arrays), compared with ``harness.compare`` (the one
tolerance table, ``attnlab.testing``, for the backend that runs them); rows with nothing to attend
to must be exactly zero and every gradient finite. A case's mask may have several equivalent forms
(a graph as adjacency or as an edge list): each implementation runs the first form it supports,
and an implementation that supports none gets ``explain``'s reason. The additive score's dense
reference is ``[B, N, T, S, H]``: its cells run at the largest T that fits ``dense_ref_bytes``.

Cells and their references are compiled in batches in a thread pool (``harness.compile_all``) and
run one at a time, the batch's compiles under the device lock's shared hold and its runs under its
exclusive one (``harness.DeviceLock``). ``benchmarks.gpu_check``'s correctness section calls
``check_all``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import attnlab
from attnlab import masks, positional, scores
from benchmarks import harness
from benchmarks.cases import additive_weights

__all__ = ["CorrCase", "corr_cases", "corr_score", "check_all"]


@dataclasses.dataclass(frozen=True)
class CorrCase:
    """A correctness case: its mask forms (functions of the traced padding lengths), score and length."""

    mask: str
    forms: tuple  # equivalent masks, each lengths -> mask; an implementation runs the first it supports
    lengths: tuple | None  # (q_len [B], kv_len [B]) passed traced, or None
    score: str  # "dot", "softcap", "alibi_mod", "additive"
    T: int


def corr_cases(sz) -> list[CorrCase]:
    """The cases in the order they run (each for every head dim and dtype before the next, so a budget
    cut leaves out whole cases, last first): full, causal, traced padding, the scores (causal), the
    windows, the graph; only those whose mask name is in ``sz.corr_masks`` where that is set."""
    B, T, N, _ = sz.corr_shape
    rng = np.random.default_rng(0)
    q_len = np.array([T - T // 7, T], np.int32)[:B]  # batch 1 has no keys at all: every row empty
    kv_len = np.array([T - T // 5, 0], np.int32)[:B]
    adj = rng.random((T, T)) < 0.01
    adj[3] = False  # an isolated query: an empty row
    senders, receivers = np.nonzero(adj.T)  # edge s -> t for adj[t, s]
    w, w2 = sz.window, sz.window2
    padding = lambda lens: masks.padding(q_lengths=lens[0], kv_lengths=lens[1])  # noqa: E731
    graphs = (lambda lens: masks.graph(adj), lambda lens: masks.graph_edges(senders, receivers, T))
    out = [
        CorrCase("full", (lambda lens: None,), None, "dot", T),
        CorrCase("causal", (lambda lens: masks.causal(),), None, "dot", T),
        CorrCase("traced_padding", (padding,), (q_len, kv_len), "dot", T),
    ]
    for name in sz.corr_scores:  # the additive reference is [B, N, T, S, H]: at a length where it fits
        t = T if name != "additive" else min(T, int((sz.dense_ref_bytes / (B * N * max(sz.corr_heads) * 4)) ** 0.5))
        out.append(CorrCase("causal", (lambda lens: masks.causal(),), None, name, t - t % 8))
    out += [
        CorrCase(f"window({w},0)", (lambda lens: masks.window(w, 0),), None, "dot", T),
        CorrCase(f"window({w2},{w2})", (lambda lens: masks.window(w2, w2),), None, "dot", T),
        CorrCase("graph_1pct", graphs, None, "dot", T),
    ]
    return [c for c in out if sz.corr_masks is None or c.mask in sz.corr_masks]


def corr_score(name: str, N: int, H: int):
    """The correctness score objects (each with arrays that get gradients, but SoftCap); None for dot."""
    if name == "softcap":
        return scores.SoftCap(30.0)
    if name == "alibi_mod":
        return positional.Alibi().score(N)
    if name == "additive":
        return scores.Additive(jnp.asarray(additive_weights(N, H, seed=H + 1)) / 2)
    return None


def _fwd_bwd(attend, form, *, reference: bool = False):
    """jit-able ``(q, k, v, cot, lengths, score) -> (out, grads)``; the reference in fp32, precision "highest"."""

    def f(q, k, v, cot, lengths, score):
        if reference:
            q, k, v, cot = (x.astype(jnp.float32) for x in (q, k, v, cot))
        mask = form(lengths)
        with jax.default_matmul_precision("highest") if reference else contextlib.nullcontext():
            out, vjp = jax.vjp(lambda q, k, v, sc: attend(q, k, v, mask=mask, score=sc or "dot"), q, k, v, score)
            return out, vjp(cot)

    return f


def _inputs(sz, H: int, dtype, T: int):
    B, T0, N, K = sz.corr_shape
    keys = jax.random.split(jax.random.key(H), 4)
    shapes = ((B, T0, N, H), (B, T0, K, H), (B, T0, K, H), (B, T0, N, H))
    return tuple(jax.random.normal(kk, s, jnp.float32)[:, :T].astype(dtype) for kk, s in zip(keys, shapes, strict=True))


def _empty_rows(case: CorrCase, B: int, N: int):
    """bool ``[B, T, N]``: the query rows the reference's mask leaves empty, or None."""
    mask = case.forms[0](case.lengths)
    if mask is None:
        return None
    dense = np.broadcast_to(np.asarray(mask.dense(case.T, case.T)), (B, 1, case.T, case.T))
    return np.broadcast_to(~dense.any(-1).transpose(0, 2, 1), (B, case.T, N))  # [B, 1, T] -> [B, T, N]


# Variants checked beside the registered implementations: name -> (the implementation whose ``supports``
# decides, the largest head dim the variant takes). The Mosaic forward with the Mosaic backward kernels
# (its default configuration runs the Triton ones), which take H <= 128.
VARIANTS = {"mosaic+mosaic_bwd": ("mosaic", 128)}


def _variant_attend(name: str):
    """``attention(q, k, v, **kw)`` for a variant of ``VARIANTS``."""
    from attnlab.call import bind  # noqa: PLC0415
    from attnlab.kernels import mosaic_gpu  # noqa: PLC0415 (only where the variant is asked for)

    config = {"mosaic+mosaic_bwd": mosaic_gpu.MosaicConfig(backward=mosaic_gpu.MosaicBackward())}[name]
    return lambda q, k, v, **kw: mosaic_gpu.attend(bind(q, k, v, **kw), config=config)


def _first_form(case: CorrCase, sds, score, name: str):
    """(the first form of the case's mask ``name`` supports, None) or (None, the first form's reason)."""
    reasons = []
    for form in case.forms:
        ex = attnlab.explain(*sds, mask=form(case.lengths), score=score or "dot", implementation=(name,))
        reasons.append(ex.reason(name))
        if reasons[-1] is None:
            return form, None
    return None, reasons[0]


def _jobs(sz, rec: harness.Recorder, names):
    """Yields ``(row, args, job, ref_key, ref_job, case)`` per cell to run (rows it cannot run are recorded)."""
    N = sz.corr_shape[2]
    for case in corr_cases(sz):
        for H in sz.corr_heads:
            for dtype in sz.corr_dtypes:
                q, k, v, cot = _inputs(sz, H, jnp.dtype(dtype), case.T)
                score = corr_score(case.score, N, H)
                lengths = None if case.lengths is None else tuple(jnp.asarray(x) for x in case.lengths)
                args = (q, k, v, cot, lengths, score)
                ref_key = (H, case.mask, case.score, dtype)
                ref_job = (_fwd_bwd(attnlab.attention_reference, case.forms[0], reference=True), args)
                sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
                for name in names:
                    row = dict(H=H, T=case.T, mask=case.mask, dtype=dtype, implementation=name, score=case.score)
                    base, max_h = VARIANTS.get(name, (name, None))
                    form, why = _first_form(case, sds, score, base)
                    if why is None and max_h is not None and H > max_h:
                        why = f"{name}: head dims up to {max_h}"
                    if why is not None:
                        rec.add(row | dict(status="unsupported", reason=why))
                        continue
                    if name in VARIANTS:
                        attend = _variant_attend(name)
                    else:
                        attend = lambda q, k, v, name=name, **kw: attnlab.attention(q, k, v, implementation=name, **kw)  # noqa: E731
                    yield row, args, (_fwd_bwd(attend, form), args), ref_key, ref_job, case


def check_all(sz, names, rec: harness.Recorder, lock: harness.DeviceLock, workers: int) -> None:
    """Each cell's output and gradients against the reference's, as rows of ``rec``.

    Args:
        sz: the sizes (``gpu_check.Sizes``: ``corr_shape``, ``corr_heads``, ``corr_dtypes``, the windows,
            ``corr_scores``, ``dense_ref_bytes``).
        names: the implementations to check (registered names).
        rec: where the rows go (its budget stops the section).
        lock: shared while a batch compiles, exclusive while it runs on the device.
        workers: threads compiling a batch of cells (and their references) at once.
    """
    B, _, N, _ = sz.corr_shape
    refs: dict = {}
    jobs = _jobs(sz, rec, names)
    while True:
        batch = [j for _, j in zip(range(2 * max(1, workers)), jobs, strict=False)]
        if not batch:
            break
        if not rec.left():
            for row, *_ in batch:
                rec.add(row | dict(status="skipped", reason="time budget"))
            continue
        new_refs = {key: job for _, _, _, key, job, _ in batch if key not in refs}
        with lock.compiling():
            compiled = harness.compile_all([j for _, _, j, *_ in batch] + list(new_refs.values()), workers)
        with lock.exclusive():
            for key, (exe, _) in zip(new_refs, compiled[len(batch) :], strict=True):
                refs[key] = _run_compiled(exe, new_refs[key][1])
            for (row, args, _, key, _, case), (exe, compile_s) in zip(batch, compiled, strict=False):
                if not rec.left():
                    rec.add(row | dict(status="skipped", reason="time budget"))
                elif isinstance(refs[key], Exception):
                    rec.error(row, RuntimeError(f"the reference failed: {refs[key]}"))
                elif isinstance(exe, Exception):
                    rec.error(row | dict(compile_s=round(compile_s, 2)), exe)
                else:
                    _check_cell(rec, row, exe, args, refs[key], _empty_rows(case, B, N), compile_s)


def _run_compiled(exe, args):
    """``exe(*args)`` (waited for), or the exception (``exe`` may be one: a failed compile)."""
    if isinstance(exe, Exception):
        return exe
    try:
        return jax.block_until_ready(exe(*args))
    except Exception as e:  # noqa: BLE001  (e.g. out of memory: the cell says so)
        return e


def _check_cell(rec, row, exe, args, ref, empty, compile_s) -> None:
    t0 = time.perf_counter()
    try:
        out, grads = jax.block_until_ready(exe(*args))
    except Exception as e:  # noqa: BLE001  (report and go on: one broken kernel must not hide the others)
        rec.error(row, e)
        return
    run_s = time.perf_counter() - t0
    ref_out, ref_grads = ref
    o = harness.compare(out, ref_out, row["dtype"], "out")
    pairs = zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True)
    g = [harness.compare(a, b, row["dtype"], "grad") for a, b in pairs]
    zero_rows = bool(np.all(np.asarray(out, np.float32)[empty] == 0)) if empty is not None else True
    finite = all(bool(np.isfinite(np.asarray(x, np.float32)).all()) for x in jax.tree_util.tree_leaves(grads))
    ok = o["ok"] and all(x["ok"] for x in g) and zero_rows and finite
    rec.add(
        row
        | dict(
            status="ok" if ok else "FAIL",
            out_rel_err=round(o["rel_err"], 6),
            grad_rel_err=round(max(x["rel_err"] for x in g), 6),
            out_tol_ratio=round(o["tol_ratio"], 4),  # max |err| / (atol + rtol |ref|): <= 1 passes
            grad_tol_ratio=round(max(x["tol_ratio"] for x in g), 4),
            empty_rows_zero=zero_rows,
            grads_finite=finite,
            compile_s=round(compile_s, 2),  # in a pool of --compile_workers threads
            first_call_s=round(compile_s + run_s, 2),
        )
    )
