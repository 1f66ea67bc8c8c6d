r"""Where a call's time goes, op by op: one attnlab call profiled (``harness.op_profile``), ops grouped by kind.

The default is the CPU window target of issue 41: ``attention(mask=masks.window(128, 128))`` at 16K,
8 heads of 64, fp32, forward+backward on the blockwise kernel.

    PYTHONPATH=. python -m benchmarks.profile_ops --out benchmarks/results/cpu-2core-shared/profile_window16k.json
    PYTHONPATH=. python -m benchmarks.profile_ops --T 1024 --direction fwd --out /tmp/profile.json

The JSON holds the run record, the call, what the untraced call costs the host per call
(``call_costs``, from ``harness.call_costs``: wall, user and system CPU time, page faults, XLA's
temporary and output buffers), the traced call's wall time, each op's total ms and calls, and the ms
per kind of op: ``matmul`` (XLA:CPU's library matmul fusions ``ynn_fusion*`` and plain ``dot``s),
``dynamic-slice`` (copies of a loop step's slice), ``dynamic-update-slice`` (in-place accumulation),
``copy`` (relayouts) and ``elementwise`` (every other fusion: exponentials, masks, sums).

``call_costs_pages_kept`` is the same untraced measurement in a child process whose C library keeps freed
memory for reuse instead of returning it to the operating system (``KEEP_PAGES_ENV``, glibc's malloc
tunables): XLA's buffers then come back already mapped, the page faults of each call mostly vanish, and
the two wall times say what those faults cost the call (``--pages_kept=false`` skips it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
from absl import app, flags

import attnlab
from attnlab import masks
from benchmarks import harness

_T = _HEADS = _HEAD_DIM = _WINDOW = _DIRECTION = _IMPL = _TOP = _OUT = _PAGES_KEPT = _COSTS_ONLY = None

# glibc's malloc: never map a large block on its own, never give freed memory back (so a buffer freed after
# one call is reused, already mapped, by the next), one arena for all threads.
KEEP_PAGES_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(2**32),
    "MALLOC_TRIM_THRESHOLD_": str(2**36),
    "MALLOC_TOP_PAD_": str(2**29),
    "MALLOC_ARENA_MAX": "1",
}


def define_flags():
    """The command line's flags (defined when run as a program, so importing this module defines none)."""
    global _T, _HEADS, _HEAD_DIM, _WINDOW, _DIRECTION, _IMPL, _TOP, _OUT, _PAGES_KEPT, _COSTS_ONLY
    _T = flags.DEFINE_integer("T", 16384, "Sequence length.")
    _HEADS = flags.DEFINE_integer("heads", 8, "Heads.")
    _HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim.")
    _WINDOW = flags.DEFINE_integer("window", 128, "Window half-width (keys t-w .. t+w).")
    _DIRECTION = flags.DEFINE_enum("direction", "fwd+bwd", ["fwd", "fwd+bwd"], "Forward, or a loss's gradient.")
    _IMPL = flags.DEFINE_string("implementation", "blockwise", "attnlab implementation.")
    _TOP = flags.DEFINE_integer("top", 40, "Ops kept in the file (the kinds sum over all of them).")
    _OUT = flags.DEFINE_string("out", "results/profile_ops.json", "Result JSON.")
    _PAGES_KEPT = flags.DEFINE_bool("pages_kept", True, "Also measure the untraced call with KEEP_PAGES_ENV.")
    _COSTS_ONLY = flags.DEFINE_bool("costs_only", False, "Internal: write only the untraced call's costs.")


def kind(op: str) -> str:
    """The kind of a compiled op, from its HLO name."""
    if op.startswith(("ynn_fusion", "dot")):
        return "matmul"
    if "dynamic-update-slice" in op:
        return "dynamic-update-slice"
    if "dynamic-slice" in op:
        return "dynamic-slice"
    if op.startswith(("copy", "transpose")):
        return "copy"
    return "elementwise"


def program(T, heads, head_dim, window, direction, implementation):
    """The jitted call and its arguments: the forward, or the gradients of q, k and v for the fixed normal
    output cotangent of every benchmark's forward+backward (``harness.with_direction``)."""
    q, k, v = (jax.random.normal(key, (1, T, heads, head_dim)) for key in jax.random.split(jax.random.key(0), 3))
    mask = masks.window(window, window)

    def fwd(q, k, v):
        return attnlab.attention(q, k, v, mask=mask, implementation=implementation)

    fn, args = harness.with_direction(fwd, direction, (q, k, v))
    return jax.jit(fn), args


def costs_pages_kept(T, heads, head_dim, window, direction, implementation) -> dict:
    """``harness.call_costs`` of the same call (``program``'s arguments), in a child process run with
    ``KEEP_PAGES_ENV`` (``env``: the settings the child saw)."""
    call = dict(T=T, heads=heads, head_dim=head_dim, window=window, direction=direction, implementation=implementation)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "costs.json"
        cmd = [sys.executable, "-m", "benchmarks.profile_ops", *(f"--{k}={v}" for k, v in call.items())]
        cmd += ["--costs_only", f"--out={out}"]
        subprocess.run(cmd, env=os.environ | KEEP_PAGES_ENV, cwd=Path(__file__).resolve().parents[1], check=True)
        return json.loads(out.read_text())


def profile(T, heads, head_dim, window, direction, implementation, top):
    fn, args = program(T, heads, head_dim, window, direction, implementation)
    costs = harness.call_costs(fn, *args)
    prof = harness.op_profile(fn, *args)
    kinds = {}
    for o in prof["ops"]:
        kinds[kind(o["op"])] = round(kinds.get(kind(o["op"]), 0.0) + o["ms"], 2)
    call = dict(T=T, heads=heads, head_dim=head_dim, window=window, direction=direction, implementation=implementation)
    return {"call": call, "call_costs": costs, "wall_ms": prof["wall_ms"], "kinds_ms": kinds, "ops": prof["ops"][:top]}


def main(argv):
    call = (_T.value, _HEADS.value, _HEAD_DIM.value, _WINDOW.value, _DIRECTION.value, _IMPL.value)
    if _COSTS_ONLY.value:
        fn, args = program(*call)
        seen = {k: os.environ.get(k) for k in KEEP_PAGES_ENV}  # the settings this process runs under
        Path(_OUT.value).write_text(json.dumps(harness.call_costs(fn, *args) | {"env": seen}))
        return
    run = harness.Run()
    harness.progress(f"profiling T={_T.value} {_DIRECTION.value} ({_IMPL.value}) ...")
    result = profile(*call, _TOP.value)
    if _PAGES_KEPT.value:
        harness.progress("the untraced call again, freed memory kept by the C library ...")
        result["call_costs_pages_kept"] = costs_pages_kept(*call)
    harness.write_json(_OUT.value, run.finish() | result)
    for name, ms in sorted(result["kinds_ms"].items(), key=lambda x: -x[1]):
        print(f"{name:22s} {ms:9.1f} ms")
    print(f"untraced call: {result['call_costs']}")
    if _PAGES_KEPT.value:
        print(f"untraced call, pages kept: {result['call_costs_pages_kept']}")
    print(f"traced call {result['wall_ms']} ms; wrote {_OUT.value}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
