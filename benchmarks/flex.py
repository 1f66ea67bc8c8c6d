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

import functools
import json
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import attnlab
from attnlab import parallel
from benchmarks import harness
from benchmarks.cases import Case, doc_ids
from benchmarks.contenders import attnlab_mask
from benchmarks.harness import host_devices
from benchmarks.torch_peers import mask_mod


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


def _attnlab_fns(case: Case, mesh):
    """(one-device fn, fn over the host devices or None), each ``(q, k, v[, ids])`` -> output, blockwise."""

    def attend(q, k, v, *ids, attention=attnlab.attention, **kw):
        return attention(q, k, v, mask=attnlab_mask(case, *(i[None] for i in ids)), implementation="blockwise", **kw)

    on_devices = None
    if mesh is not None:  # the same kernel, the heads split over the host devices (nothing gathered)
        on_devices = jax.jit(functools.partial(attend, attention=parallel.attention, mesh=mesh, head_axis="heads"))
    return jax.jit(attend), on_devices


def _prepare(torch, case: Case, q, k, v, mesh) -> dict:
    """One mask's contenders (blocking calls) with its block mask's build time and the largest output difference."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: PLC0415

    T = q.shape[1]
    ids = doc_ids(T, case.docs) if case.mask == "documents" else None
    tq, tk, tv = (torch.from_numpy(np.asarray(x).transpose(0, 2, 1, 3).copy()) for x in (q, k, v))  # [B, N, T, H]
    print(f"building {case.name}: flex block mask, compiling both", flush=True)
    t0 = time.perf_counter()
    mod = mask_mod(torch, case, None if ids is None else torch.from_numpy(ids))
    bm = create_block_mask(mod, B=None, H=None, Q_LEN=T, KV_LEN=T, device="cpu")
    build_s = time.perf_counter() - t0
    flex = torch.compile(flex_attention)

    def flex_run():
        with torch.no_grad():
            return flex(tq, tk, tv, block_mask=bm)

    extra = () if ids is None else (jnp.asarray(ids),)
    one, on_devices = _attnlab_fns(case, mesh)
    runs = {"attnlab": harness.blocking(one, q, k, v, *extra), "flex": flex_run}
    ref = flex_run().numpy()
    diff = float(np.abs(np.asarray(one(q, k, v, *extra)).transpose(0, 2, 1, 3) - ref).max())
    if on_devices is not None:
        split = [parallel.shard(x, mesh, head_axis="heads") for x in (q, k, v)]
        runs["devices"] = harness.blocking(on_devices, *split, *extra)
        diff = max(diff, float(np.abs(np.asarray(on_devices(*split, *extra)).transpose(0, 2, 1, 3) - ref).max()))
    print(f"  {case.name}: block mask {build_s:.2f} s, max |attnlab - flex| = {diff:.2e}")
    return {"runs": runs, "flex_block_mask_s": build_s, "max_abs_diff": diff}


def _record(case: Case, prepared: dict, timed: dict, T: int, N: int, H: int, d: int) -> dict:
    ours, flex = timed[case.name, "attnlab"].best_s, timed[case.name, "flex"].best_s
    rec = {"mask": "document" if case.mask == "documents" else case.mask, "T": T, "heads": N, "H": H, "mode": "fwd",
           "attnlab_s": ours, "flex_s": flex, "flex_over_attnlab": flex / ours,
           "flex_block_mask_s": prepared["flex_block_mask_s"], "max_abs_diff": prepared["max_abs_diff"],
           "docs": case.docs if case.mask == "documents" else None,
           "window": case.window[0] if case.mask == "window" else None, "host_devices": d}  # fmt: skip
    if (case.name, "devices") in timed:
        dev = timed[case.name, "devices"].best_s
        rec |= {"attnlab_devices_s": dev, "flex_over_attnlab_devices": flex / dev}
    return rec


def main(argv):
    del argv
    capped = cap_isa(_ISA.value)
    d = host_devices(_DEVICES.value, os.cpu_count() or 1, _HEADS.value)
    if d > 1:  # before JAX's first computation
        parallel.use_host_devices(d)
    import torch

    run = harness.Run()
    T, N, H, w = _T.value, _HEADS.value, _H.value, _WINDOW.value
    q, k, v = (jax.random.normal(x, (1, T, N, H), jnp.float32) for x in jax.random.split(jax.random.key(0), 3))
    mesh = parallel.make_mesh(f"heads={d}") if d > 1 and len(jax.devices()) >= d else None
    cases = (Case("document", "documents", docs=_DOCS.value), Case("window", "window", (w, w)))
    prepared = {c.name: _prepare(torch, c, q, k, v, mesh) for c in cases}
    runs = {(c, side): fn for c, p in prepared.items() for side, fn in p["runs"].items()}
    print(f"timing: {_ROUNDS.value} interleaved rounds of {_REPEATS.value} calls each", flush=True)
    timed = harness.interleaved(
        runs, rounds=_ROUNDS.value, repeats=_REPEATS.value, settle=True, progress=harness.progress
    )
    records = [_record(c, prepared[c.name], timed, T, N, H, d if mesh else 1) for c in cases]
    for r in records:
        print(json.dumps(r), flush=True)
    result = {"records": records, **run.finish(), "torch_threads": torch.get_num_threads(), "cap_isa": _ISA.value,
              "capped_env": capped, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip
    harness.write_json(Path(_OUT.value) / "flex.json", result)
    print(f"wrote {Path(_OUT.value) / 'flex.json'}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
