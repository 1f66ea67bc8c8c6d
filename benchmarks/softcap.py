r"""Soft-capped scores inside the blockwise tiles against the plain dot product, one process.

``scores.SoftCap(cap)`` (``cap * tanh(s / cap)``, Gemma 2) through ``attnlab.kernels.blockwise_attention``
next to ``score="dot"``, same shapes and mask, forward and forward + backward, best of ``--repeats``
(interleaved rounds). The target: soft-capped within 1.3x of plain dot-product attention.

Command (what ``make softcap`` runs; ~2 min on the 2-core development CPU):

    python -m benchmarks.softcap --out results/softcap

Writes ``<out>/softcap.json`` (records, host CPU model and SIMD flags, versions, command, date).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import app, flags

from attnlab import kernels, masks, scores
from benchmarks.host import best_of, cpu_info

_OUT = flags.DEFINE_string("out", "results/softcap", "Output folder.")
_T = flags.DEFINE_integer("seq_len", 4096, "Sequence length.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per cell and round (best kept).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved rounds.")
_CAP = flags.DEFINE_float("cap", 30.0, "The soft cap.")


def main(argv):
    del argv
    start = time.perf_counter()
    T, N, H = _T.value, 8, 64
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, T, N, H), jnp.float32) for x in (kq, kk, kv))
    cells = {}
    for mask_name, mask in (("full", None), ("causal", masks.causal())):
        for score_name, score in (("dot", "dot"), ("softcap", scores.SoftCap(_CAP.value))):

            def attend(q, k, v, score=score, mask=mask):
                return kernels.blockwise_attention(q, k, v, mask=mask, score=score)

            cells[mask_name, score_name, "fwd"] = jax.jit(attend)
            cells[mask_name, score_name, "fwd+bwd"] = jax.jit(
                jax.grad(lambda q, k, v, f=attend: f(q, k, v).sum(), argnums=(0, 1, 2))
            )
    best = {key: float("inf") for key in cells}
    for _ in range(_ROUNDS.value):
        for key, fn in cells.items():
            best[key] = min(best[key], best_of(fn, (q, k, v), _REPEATS.value))
    records = []
    for mask_name in ("full", "causal"):
        for mode in ("fwd", "fwd+bwd"):
            dot, cap = best[mask_name, "dot", mode], best[mask_name, "softcap", mode]
            records.append({"mask": mask_name, "mode": mode, "T": T, "heads": N, "H": H, "dot_s": dot,
                            "softcap_s": cap, "softcap_over_dot": cap / dot})  # fmt: skip
            print(json.dumps(records[-1]), flush=True)
    out = Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "records": records, "host": cpu_info(), "jax": jax.__version__, "cap": _CAP.value,
        "command": "python -m benchmarks.softcap " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
        "wall_s": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    (out / "softcap.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'softcap.json'}")


if __name__ == "__main__":
    app.run(main)
