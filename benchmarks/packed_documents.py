r"""Packed documents: the blockwise kernel with traced segment ids against concrete ids and dense XLA.

Several documents of random lengths packed into one row of T tokens (``masks.document(ids) &
masks.causal()``, the packed causal LM, and ``masks.document(ids)`` alone), 8 heads, H = 64, fp32,
forward + backward (the gradients of q, k and v for a fixed normal output cotangent, as every benchmark:
``harness.fwd_bwd``). Timed in one process, interleaved, best of
``--repeats``:

* ``traced``: ``jax.jit(f)(q, k, v, ids)``: the ids are an argument, the block layout is found on
  device (``Mask.runtime_layout``) and one compiled program serves every batch of ids;
* ``concrete``: the ids closed over as constants: the layout is evaluated exactly at trace time
  (a new program for new ids);
* ``xla``: ``jax.nn.dot_product_attention`` (XLA) with the same mask as a dense ``[T, T]`` array.

It also times the traced kernel at 4 to 64 documents (time should follow sum(len_i^2), not T^2)
and counts traces over ``--batches`` batches of different ids (the target is one).

Command (what ``make packed-docs`` runs; ~6 min on the 2-core development CPU):

    python -m benchmarks.packed_documents --out results/packed

Writes ``<out>/packed.json`` (records, the host's CPU model and flags, versions) and
``<out>/packed.png`` (time against sum(len_i^2) per document count).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import attnlab
from attnlab import kernels, masks
from benchmarks import harness
from benchmarks.cases import doc_ids
from benchmarks.harness import best_of


def define_flags():
    """The command-line flags, defined only when run as a program (importing the module defines none)."""
    global _OUT, _T, _DOCS, _SCALING, _REPEATS, _BATCHES, _HEADS, _XLA
    _OUT = flags.DEFINE_string("out", "results/packed", "Output folder.")
    _T = flags.DEFINE_integer("seq_len", 8192, "Tokens per packed row.")
    _DOCS = flags.DEFINE_integer("docs", 16, "Documents per row for the main comparison.")
    _SCALING = flags.DEFINE_list("scaling_docs", ["4", "8", "16", "32", "64"], "Document counts for the scaling rows.")
    _REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per cell (best is kept).")
    _BATCHES = flags.DEFINE_integer("batches", 10, "Batches of new ids for the trace count.")
    _HEADS = flags.DEFINE_integer("heads", 8, "Heads N.")
    _XLA = flags.DEFINE_bool("xla", True, "Also time dense XLA with the same mask (needs ~8 GiB at 8K).")


def packed_ids(T: int, docs: int, seed: int) -> np.ndarray:
    """int32 [1, T]: `docs` documents of random lengths (at least 1 token each), ids 0..docs-1 in order."""
    return doc_ids(T, docs, seed)[None]


def sum_sq(ids: np.ndarray) -> int:
    return int((np.bincount(ids.reshape(-1)) ** 2).sum())


def _grad_fn(attend):
    """jit of ``(q, k, v, *args, ct)`` -> the gradients of q, k and v for the output cotangent ``ct``
    (``harness.with_direction``, the convention of every benchmark; ``ct`` is ``harness.cotangent``)."""
    return jax.jit(harness.fwd_bwd(attend))


def main(argv):
    del argv
    run = harness.Run()
    out = Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    T, N, H = _T.value, _HEADS.value, 64
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, T, N, H), jnp.float32) for x in (kq, kk, kv))
    ct = harness.cotangent(q.shape, q.dtype)
    records = []
    traces = {"n": 0}

    def doc_mask(ids, causal):
        m = masks.document(ids)
        return m & masks.causal() if causal else m

    def traced_attend(q, k, v, ids, causal):
        traces["n"] += 1
        return kernels.blockwise_attention(q, k, v, mask=doc_mask(ids, causal))

    for causal in (True, False):
        name = "document & causal" if causal else "document"
        traced = _grad_fn(lambda q, k, v, ids, c=causal: traced_attend(q, k, v, ids, c))
        ids = packed_ids(T, _DOCS.value, seed=0)
        concrete = _grad_fn(lambda q, k, v, i=ids, c=causal: kernels.blockwise_attention(q, k, v, mask=doc_mask(i, c)))
        row = {"mask": name, "T": T, "docs": _DOCS.value, "sum_len_sq": sum_sq(ids), "heads": N, "H": H}
        t_traced = best_of(traced, (q, k, v, jnp.asarray(ids), ct), _REPEATS.value)
        t_concrete = best_of(concrete, (q, k, v, ct), _REPEATS.value)
        row |= {"traced_s": t_traced, "concrete_s": t_concrete, "traced_over_concrete": t_traced / t_concrete}
        if _XLA.value:
            dense = jnp.asarray(np.asarray(doc_mask(ids, causal).dense(T, T)).reshape(1, 1, T, T))
            xla = _grad_fn(lambda q, k, v, m=dense: attnlab.attention(q, k, v, mask=m, implementation="xla"))
            t_xla = best_of(xla, (q, k, v, ct), max(1, _REPEATS.value - 1))
            row |= {"xla_s": t_xla, "xla_over_traced": t_xla / t_traced}
        print(json.dumps(row), flush=True)
        records.append({"suite": "compare", **row})

    # one trace across batches of new ids (the causal program is reused)
    traces["n"] = 0
    traced = _grad_fn(lambda q, k, v, ids: traced_attend(q, k, v, ids, True))
    for b in range(_BATCHES.value):
        jax.block_until_ready(traced(q, k, v, jnp.asarray(packed_ids(T, _DOCS.value, seed=100 + b)), ct))
    records.append({"suite": "retrace", "batches": _BATCHES.value, "traces": traces["n"]})
    print(json.dumps(records[-1]), flush=True)

    # time against sum(len_i^2): more documents, less work
    for docs in map(int, _SCALING.value):
        ids = packed_ids(T, docs, seed=docs)
        t = best_of(traced, (q, k, v, jnp.asarray(ids), ct), _REPEATS.value)
        rec = {"suite": "scaling", "mask": "document & causal", "T": T, "docs": docs, "sum_len_sq": sum_sq(ids)}
        records.append(rec | {"traced_s": t})
        print(json.dumps(records[-1]), flush=True)

    result = {"records": records, **run.finish()}
    harness.write_json(out / "packed.json", result)
    plot(result, out / "packed.png")
    print(f"wrote {out / 'packed.json'} and {out / 'packed.png'}")


def plot(result: dict, path) -> None:
    """Traced fwd+bwd time against sum(len_i^2) (one point per document count)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in result["records"] if r["suite"] == "scaling"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = [r["sum_len_sq"] / 1e6 for r in rows]
    ax.plot(x, [r["traced_s"] for r in rows], "o-")
    for r, xi in zip(rows, x, strict=True):
        ax.annotate(f"{r['docs']} docs", (xi, r["traced_s"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("sum of squared document lengths (millions)")
    ax.set_ylabel("fwd+bwd seconds (traced ids)")
    ax.set_title(f"packed causal LM, T = {rows[0]['T'] if rows else '?'}, blockwise")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    define_flags()
    app.run(main)
