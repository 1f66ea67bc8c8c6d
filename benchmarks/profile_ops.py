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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

import attnlab
from attnlab import masks
from benchmarks import harness

_T = _HEADS = _HEAD_DIM = _WINDOW = _DIRECTION = _IMPL = _TOP = _OUT = None


def define_flags():
    """The command line's flags (defined when run as a program, so importing this module defines none)."""
    global _T, _HEADS, _HEAD_DIM, _WINDOW, _DIRECTION, _IMPL, _TOP, _OUT
    _T = flags.DEFINE_integer("T", 16384, "Sequence length.")
    _HEADS = flags.DEFINE_integer("heads", 8, "Heads.")
    _HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim.")
    _WINDOW = flags.DEFINE_integer("window", 128, "Window half-width (keys t-w .. t+w).")
    _DIRECTION = flags.DEFINE_enum("direction", "fwd+bwd", ["fwd", "fwd+bwd"], "Forward, or a loss's gradient.")
    _IMPL = flags.DEFINE_string("implementation", "blockwise", "attnlab implementation.")
    _TOP = flags.DEFINE_integer("top", 40, "Ops kept in the file (the kinds sum over all of them).")
    _OUT = flags.DEFINE_string("out", "results/profile_ops.json", "Result JSON.")


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


def profile(T, heads, head_dim, window, direction, implementation, top):
    q, k, v = (jax.random.normal(key, (1, T, heads, head_dim)) for key in jax.random.split(jax.random.key(0), 3))
    mask = masks.window(window, window)

    def fwd(q, k, v):
        return attnlab.attention(q, k, v, mask=mask, implementation=implementation)

    fn = jax.jit(fwd if direction == "fwd" else jax.grad(lambda *a: jnp.sum(fwd(*a) ** 2), argnums=(0, 1, 2)))
    costs = harness.call_costs(fn, q, k, v)
    prof = harness.op_profile(fn, q, k, v)
    kinds = {}
    for o in prof["ops"]:
        kinds[kind(o["op"])] = round(kinds.get(kind(o["op"]), 0.0) + o["ms"], 2)
    call = dict(T=T, heads=heads, head_dim=head_dim, window=window, direction=direction, implementation=implementation)
    return {"call": call, "call_costs": costs, "wall_ms": prof["wall_ms"], "kinds_ms": kinds, "ops": prof["ops"][:top]}


def main(_):
    run = harness.Run()
    harness.progress(f"profiling T={_T.value} {_DIRECTION.value} ({_IMPL.value}) ...")
    result = profile(_T.value, _HEADS.value, _HEAD_DIM.value, _WINDOW.value, _DIRECTION.value, _IMPL.value, _TOP.value)
    harness.write_json(_OUT.value, run.finish() | result)
    for name, ms in sorted(result["kinds_ms"].items(), key=lambda x: -x[1]):
        print(f"{name:22s} {ms:9.1f} ms")
    print(f"untraced call: {result['call_costs']}")
    print(f"traced call {result['wall_ms']} ms; wrote {_OUT.value}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
