r"""attnlab's blockwise kernel against PyTorch FlexAttention on the CPU, same masks, forward.

Two masks at ``--seq_len`` (16K), 1 x 8 heads x H = 64, fp32:

* ``document``: ``--docs`` (16) packed documents of random lengths in one row (numpy seed 0), as
  ``masks.document(ids)`` with the ids *traced* under ``jax.jit`` (the blockwise kernel finds the
  empty tiles on device) and, for flex, a ``mask_mod`` reading the same ids;
* ``window``: ``masks.window(128, 128)`` (±128), for flex ``|q - k| <= 128``.

The peer is ``torch.compile(flex_attention)`` with ``create_block_mask`` of the same ``mask_mod`` (its
CPU path is forward-only in torch 2.13, so only the forward is compared). Both sides are timed in one
process in interleaved rounds, best of ``--repeats``. attnlab is timed on one device and, with
``--host_devices`` (default: one per core, dividing the heads), with the heads split over that many CPU
host devices (``attnlab.parallel``: how a JAX program uses both cores, since XLA:CPU runs the
kernel's small tile matmuls on one). The block mask is built once, outside the
timed call (its build time is recorded too); the outputs are compared. The host's CPU model and
SIMD flags are recorded: the ratio moves with them (AVX2 against AVX-512).

Command (what ``make flex`` runs; needs the bench extra: torch; under a minute on the 2-core CPU, 33-35 s in
the committed runs, after torch is imported):

    python -m benchmarks.flex --out results/flex

and with both sides' generated code capped at AVX2 on an AVX-512 host (``--cap_isa``; see the flag):

    python -m benchmarks.flex --cap_isa avx2 --out results/flex-avx2

Writes ``<out>/flex.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import attnlab
from attnlab import masks, parallel
from benchmarks.host import best_of, cpu_info, host_devices


def define_flags():
    """The command-line flags, defined only when run as a program (importing the module defines none)."""
    global _OUT, _T, _HEADS, _H, _DOCS, _WINDOW, _REPEATS, _ROUNDS, _DEVICES, _ISA
    _OUT = flags.DEFINE_string("out", "results/flex", "Output folder.")
    _T = flags.DEFINE_integer("seq_len", 16384, "Sequence length T = S.")
    _HEADS = flags.DEFINE_integer("heads", 8, "Heads N.")
    _H = flags.DEFINE_integer("head_dim", 64, "Head dimension H.")
    _DOCS = flags.DEFINE_integer("docs", 16, "Documents in the row (document mask).")
    _WINDOW = flags.DEFINE_integer("window", 128, "Window half-width (window mask).")
    _REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per round (best kept).")
    _ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved rounds.")
    _DEVICES = flags.DEFINE_integer(
        "host_devices", -1, "Also time attnlab with the heads split over this many CPU host devices (-1: the "
        "largest divisor of --heads not above the core count; 1: no such row).",
    )  # fmt: skip
    _ISA = flags.DEFINE_enum(
        "cap_isa", None, ["avx2"], "Cap both sides' generated CPU code at this instruction set: XLA's "
        "--xla_cpu_max_isa and torch's ATEN_CPU_CAPABILITY, with a fresh inductor cache (its cache does not key "
        "on the capability: a kernel compiled for AVX-512 came back under avx2 and gave wrong outputs). An AVX2 "
        "machine's code paths on this host, not its memory system or clocks; libraries that pick their own "
        "kernels at run time (YNNPACK inside XLA, oneDNN) are not capped.",
    )  # fmt: skip


def cap_isa(isa: str | None) -> dict:
    """Sets the environment for ``--cap_isa`` (before JAX's first computation and torch's import): what was set."""
    if isa is None:
        return {}
    env = {
        "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), f"--xla_cpu_max_isa={isa.upper()}"]).strip(),
        "ATEN_CPU_CAPABILITY": isa,
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix=f"inductor-{isa}-"),
    }
    os.environ.update(env)
    return env


def doc_ids(T: int, docs: int, seed: int = 0) -> np.ndarray:
    """int32 [T]: ``docs`` documents of random lengths (at least 1 token each) covering the row."""
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, T), size=docs - 1, replace=False))
    return np.repeat(np.arange(docs, dtype=np.int32), np.diff(np.concatenate([[0], cuts, [T]])))


def _torch_timer(torch, fn):
    def run():
        with torch.no_grad():
            return fn()

    return run


def main(argv):
    del argv
    capped = cap_isa(_ISA.value)
    d = host_devices(_DEVICES.value, os.cpu_count() or 1, _HEADS.value)
    if d > 1:  # before JAX's first computation
        parallel.use_host_devices(d)
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    start, cpu0 = time.perf_counter(), time.process_time()
    T, N, H, w = _T.value, _HEADS.value, _H.value, _WINDOW.value
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, T, N, H), jnp.float32) for x in (kq, kk, kv))
    tq, tk, tv = (torch.from_numpy(np.asarray(x).transpose(0, 2, 1, 3).copy()) for x in (q, k, v))  # [B, N, T, H]
    ids = doc_ids(T, _DOCS.value)
    tids = torch.from_numpy(ids)
    flex = torch.compile(flex_attention)

    def doc_mod(b, h, qi, ki):
        return tids[qi] == tids[ki]

    def window_mod(b, h, qi, ki):
        return (qi - ki <= w) & (ki - qi <= w)

    @jax.jit
    def ours_doc(q, k, v, ids):
        return attnlab.attention(q, k, v, mask=masks.document(ids[None]), implementation="blockwise")

    @jax.jit
    def ours_window(q, k, v):
        return attnlab.attention(q, k, v, mask=masks.window(w, w), implementation="blockwise")

    mesh = parallel.make_mesh(f"heads={d}") if d > 1 and len(jax.devices()) >= d else None

    def on_devices(mask_fn):  # the same kernel, the heads split over the host devices (nothing gathered)
        return jax.jit(lambda q, k, v, *a: parallel.attention(
            q, k, v, mesh=mesh, head_axis="heads", mask=mask_fn(*a), implementation="blockwise"))  # fmt: skip

    split = (lambda *xs: [parallel.shard(x, mesh, head_axis="heads") for x in xs]) if mesh else None

    cases = {}
    for name, mod, ours, args, mask_fn in (
        ("document", doc_mod, ours_doc, (q, k, v, jnp.asarray(ids)), lambda ids: masks.document(ids[None])),
        ("window", window_mod, ours_window, (q, k, v), lambda: masks.window(w, w)),
    ):
        print(f"building {name}: flex block mask, compiling both", flush=True)
        t0 = time.perf_counter()
        bm = create_block_mask(mod, B=None, H=None, Q_LEN=T, KV_LEN=T, device="cpu")
        build_s = time.perf_counter() - t0
        flex_fn = _torch_timer(torch, lambda bm=bm: flex(tq, tk, tv, block_mask=bm))
        a = np.asarray(ours(*args)).transpose(0, 2, 1, 3)
        b = flex_fn().numpy()
        allowed = int(np.asarray(masks.document(ids[None]).dense(T, T)).sum()) if name == "document" else None
        cases[name] = {"ours": (ours, args), "flex": flex_fn, "flex_block_mask_s": build_s,
                       "max_abs_diff": float(np.abs(a - b).max()), "allowed_pairs": allowed}  # fmt: skip
        if mesh is not None:
            dev_fn, dev_args = on_devices(mask_fn), (*split(q, k, v), *args[3:])
            c = np.asarray(dev_fn(*dev_args)).transpose(0, 2, 1, 3)  # compiles it once, for the check and the timing
            cases[name]["devices"] = (dev_fn, dev_args)
            cases[name]["max_abs_diff"] = max(cases[name]["max_abs_diff"], float(np.abs(c - b).max()))
        print(f"  {name}: block mask {build_s:.2f} s, max |attnlab - flex| = {cases[name]['max_abs_diff']:.2e}")
    best = {(c, side): float("inf") for c in cases for side in ("attnlab", "flex")}
    for r in range(_ROUNDS.value):
        for name, c in cases.items():
            print(f"round {r + 1}/{_ROUNDS.value}: {name}", flush=True)
            fn, args = c["ours"]
            best[name, "attnlab"] = min(best[name, "attnlab"], best_of(fn, args, _REPEATS.value))
            if "devices" in c:
                fn, args = c["devices"]
                best[name, "devices"] = min(
                    best.get((name, "devices"), float("inf")), best_of(fn, args, _REPEATS.value)
                )
            t = []
            for _ in range(_REPEATS.value + 1):
                t0 = time.perf_counter()
                c["flex"]()
                t.append(time.perf_counter() - t0)
            best[name, "flex"] = min(best[name, "flex"], min(t[1:]))
    records = []
    for name, c in cases.items():
        ours_s, flex_s = best[name, "attnlab"], best[name, "flex"]
        records.append({"mask": name, "T": T, "heads": N, "H": H, "mode": "fwd", "attnlab_s": ours_s, "flex_s": flex_s,
                        "flex_over_attnlab": flex_s / ours_s, "flex_block_mask_s": c["flex_block_mask_s"],
                        "max_abs_diff": c["max_abs_diff"],
                        "docs": _DOCS.value if name == "document" else None,
                        "window": w if name == "window" else None, "host_devices": d if mesh else 1})  # fmt: skip
        if (name, "devices") in best:
            records[-1] |= {
                "attnlab_devices_s": best[name, "devices"],
                "flex_over_attnlab_devices": flex_s / best[name, "devices"],
            }
        print(json.dumps(records[-1]), flush=True)
    out = Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "records": records, "host": cpu_info(), "jax": jax.__version__, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cap_isa": _ISA.value, "capped_env": capped,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "command": "python -m benchmarks.flex " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
        "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(time.process_time() - cpu0, 1),
    }  # fmt: skip
    (out / "flex.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'flex.json'}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
