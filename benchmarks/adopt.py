r"""One line to adopt attnlab, timed: the same calls with and without it, side by side in one run.

Two suites, each row a pair timed in alternating rounds (best of ``--repeats`` per round, best round;
``benchmarks.harness.alternate_best``), outputs checked equal first:

* ``jax_nn``: ``jax.nn.dot_product_attention(...)`` against ``attnlab.dot_product_attention(...)`` with
  the very same arguments (jax's test shapes with each mask mode, GQA, bf16, a batch of four 256-token
  rows, 1K, and a ±128 window at 8K, which jax.nn computes densely), forward and forward+backward (the
  gradients of q, k and v for a fixed normal output cotangent, as every benchmark: ``harness.with_direction``).
  Targets: ratio (jax.nn ms / attnlab ms) >= 1 everywhere, >= 5 for the window at 8K.
* ``flax``: a 2-layer model of stock Flax attention (pre-LayerNorm, residual; D = 512, 8 heads of 64,
  T = 2048, fp32) with Flax's attention_fn and with ``attnlab.flax.attention_fn``, fwd+bwd (the loss's
  gradient w.r.t. every parameter): ``nnx.MultiHeadAttention`` with ``is_causal=True`` and with
  ``mask=make_causal_mask``, linen's ``MultiHeadDotProductAttention`` with ``make_causal_mask``.
  Target: ratio >= 2.

    make adopt-bench                                      # -> results/adopt/adopt.json
    PYTHONPATH=. python -m benchmarks.adopt --smoke --out /tmp/adopt   # tiny sizes, seconds

The JSON holds the host (CPU model, SIMD flags, cores), jax/flax versions, the flags and one record
per row: the shape and arguments, both times, the ratio, attnlab's chosen implementation (as the jitted
call chooses it), the largest output difference and, on the small rows, ``control_ratio``: jax.nn timed
against a second jit of itself in the same rounds, the noise the row's ratio carries.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import attnlab
import attnlab.flax
from attnlab import dropin
from benchmarks.harness import DIRECTIONS, alternate_best, directed, max_abs_diff, run_record, write_json


def define_flags():
    """The command-line flags, defined only when run as a program (importing the module defines none)."""
    global _OUT, _SMOKE, _REPEATS, _ROUNDS, _SUITES, _WINDOW_HEADS
    _OUT = flags.DEFINE_string("out", "results/adopt", "Folder for adopt.json.")
    _SMOKE = flags.DEFINE_bool("smoke", False, "Tiny sizes (for the test): seconds, not minutes.")
    _REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per round (best is kept).")
    _ROUNDS = flags.DEFINE_integer("rounds", 2, "Alternating rounds over each pair (best round is kept).")
    _SUITES = flags.DEFINE_list("suites", ["jax_nn", "flax"], "Which suites to run.")
    _WINDOW_HEADS = flags.DEFINE_integer("window_heads", 4, "Heads of the 8K window case (jax.nn holds N x 8K^2 fp32).")


# ------------------------------------------------------------------------------------------
# jax.nn.dot_product_attention vs attnlab.dot_product_attention


def _jax_nn_cases(smoke: bool, window_heads: int):
    """(name, dict(B, T, S, N, K, H, dtype), kwargs maker) for each row of the jax_nn suite."""
    small = dict(B=2, T=32 if smoke else 128, N=4, K=4, H=32, dtype="float32")  # jax's nn_test shapes
    tiny = dict(B=1, T=16, N=2, K=2, H=8, dtype="float32")
    medium = dict(B=1, T=64 if smoke else 1024, N=8, K=8, H=64, dtype="float32")
    batch = dict(B=4, T=64 if smoke else 256, N=8, K=8, H=64, dtype="float32")  # a batch of short rows: dense XLA
    # smoke: 512 x 512 pairs, where the window takes the blockwise kernel (below, dispatch weighs its tiles)
    long = dict(B=1, T=512 if smoke else 8192, N=window_heads, K=window_heads, H=64, dtype="float32")
    w = 16 if smoke else 128

    def lengths(sh):
        return dict(
            query_seq_lengths=np.array([sh["T"] // 2, sh["T"] // 4][: sh["B"]], np.int32),
            key_value_seq_lengths=np.array([sh["T"] // 4, sh["T"] // 2][: sh["B"]], np.int32),
        )

    def custom(sh):
        return dict(mask=np.tril(np.ones((sh["T"], sh["T"]), bool))[None, None])

    def bias(sh):
        return dict(bias=np.random.default_rng(0).normal(size=(1, sh["N"], sh["T"], sh["T"])).astype(np.float32))

    cases = [
        ("tiny/none", tiny, lambda sh: {}),
        ("tiny/causal", tiny, lambda sh: dict(is_causal=True)),
        ("small/none", small, lambda sh: {}),
        ("small/causal", small, lambda sh: dict(is_causal=True)),
        ("small/padding", small, lengths),
        ("small/custom", small, custom),
        ("small/bias", small, bias),
        ("small/causal+window(3,2)", small, lambda sh: dict(is_causal=True, local_window_size=(3, 2))),
        ("small/gqa K=1 causal", dict(small, K=1), lambda sh: dict(is_causal=True)),
        ("small/bf16 causal", dict(small, dtype="bfloat16"), lambda sh: dict(is_causal=True)),
        ("batch/none", batch, lambda sh: {}),
        ("batch/custom", batch, custom),
        ("medium/none", medium, lambda sh: {}),
        ("medium/causal", medium, lambda sh: dict(is_causal=True)),
        ("medium/causal+padding", medium, lambda sh: dict(is_causal=True, **lengths(dict(sh, B=1)))),
        (f"long/window ±{w}", long, lambda sh: dict(local_window_size=w)),
    ]
    if smoke:  # one case of each kind of route: a structural mask, a mask array, a bias (dense XLA), the tiled window
        cases = [c for c in cases if c[0] in ("tiny/causal", "small/custom", "small/bias") or c[0].startswith("long")]
    return cases


def _split_kwargs(kw):
    """Array arguments become jit arguments (traced, as in a training step); the rest stay static."""
    arrays = {k: jnp.asarray(v) for k, v in kw.items() if isinstance(v, np.ndarray)}
    static = {k: v for k, v in kw.items() if k not in arrays}
    return arrays, static


def _fwd(attention, static):
    def fwd(q, k, v, arrays):
        return attention(q, k, v, **arrays, **static)

    return fwd


# Rows of at most this T also time jax.nn against a second jit of itself (the same program): the ratio
# of two identical sub-millisecond calls is the run's noise, the yardstick for "never slower".
CONTROL_UP_TO = 128


def _chosen(q, k, v, arrays, static) -> str:
    """attnlab's implementation for the call as the benchmark runs it: traced under jit (a mask array
    is then a tracer, so no tile of it is known to be empty), not eagerly."""
    seen = []

    def trace(q, k, v, arrays):
        seen.append(dropin.explain(q, k, v, **arrays, **static).implementation)
        return q

    jax.eval_shape(trace, q, k, v, arrays)
    return seen[0]


def suite_jax_nn(smoke, repeats, rounds, window_heads):
    records = []
    for name, sh, make_kw in _jax_nn_cases(smoke, window_heads):
        key = jax.random.split(jax.random.key(0), 3)
        dtype = jnp.dtype(sh["dtype"])
        q = jax.random.normal(key[0], (sh["B"], sh["T"], sh["N"], sh["H"])).astype(dtype)
        k, v = (jax.random.normal(kk, (sh["B"], sh["T"], sh["K"], sh["H"])).astype(dtype) for kk in key[1:])
        kw = make_kw(sh)
        arrays, static = _split_kwargs(kw)
        chosen = _chosen(q, k, v, arrays, static)
        for mode in DIRECTIONS:
            fns = {"jax.nn": jax.nn.dot_product_attention, "attnlab": attnlab.dot_product_attention}
            if sh["T"] <= CONTROL_UP_TO:  # jax.nn against itself: the noise a ratio of these calls carries
                fns["jax.nn again"] = jax.nn.dot_product_attention
            # forward+backward as every benchmark takes it: the gradients for the fixed output cotangent
            pairs, args = directed({n: _fwd(f, static) for n, f in fns.items()}, mode, (q, k, v, arrays))
            t0 = time.perf_counter()
            outs = {n: jax.block_until_ready(f(*args)) for n, f in pairs.items()}
            diff = max_abs_diff(outs["jax.nn"], outs["attnlab"])
            compile_s = time.perf_counter() - t0
            best = alternate_best(pairs, args, rounds=rounds, repeats=repeats)
            control = round(best["jax.nn"] / best["jax.nn again"], 3) if "jax.nn again" in best else None
            rec = {
                "suite": "jax_nn",
                "case": name,
                "mode": mode,
                "shape": sh,
                "arguments": {
                    k: (v if not isinstance(v, np.ndarray) else f"array{list(v.shape)}") for k, v in kw.items()
                },
                "jax_nn_ms": round(best["jax.nn"] * 1e3, 3),
                "attnlab_ms": round(best["attnlab"] * 1e3, 3),
                "ratio": round(best["jax.nn"] / best["attnlab"], 3),
                "control_ratio": control,
                "implementation": chosen,
                "max_abs_diff": diff,
                "compile_and_first_s": round(compile_s, 2),
            }
            records.append(rec)
            print(f"jax_nn {name:28s} {mode:8s} jax.nn {rec['jax_nn_ms']:10.3f} ms  attnlab ({chosen}) "
                  f"{rec['attnlab_ms']:10.3f} ms  ratio {rec['ratio']:6.2f}  A/A {control}  diff {diff:.1e}",
                  flush=True)  # fmt: skip
    return records


# ------------------------------------------------------------------------------------------
# stock Flax attention with Flax's attention_fn vs attnlab's


def _nnx_model(D, N, layers, attention_fn):
    from flax import nnx  # noqa: PLC0415 (the benchmark's flax half)

    kw = {} if attention_fn is None else dict(attention_fn=attention_fn)
    rngs = nnx.Rngs(0)

    class Block(nnx.Module):
        def __init__(self):
            self.norm = nnx.LayerNorm(D, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(N, D, decode=False, rngs=rngs, **kw)

        def __call__(self, x, **call_kw):
            return x + self.attn(self.norm(x), **call_kw)

    class Model(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([Block() for _ in range(layers)])

        def __call__(self, x, **call_kw):
            for b in self.blocks:
                x = b(x, **call_kw)
            return x

    return Model()


def _nnx_step(model, call):
    """jit(grad of the loss w.r.t. every parameter) of an NNX model; ``call(model, x)`` runs it."""
    from flax import nnx  # noqa: PLC0415

    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, x):
        def loss(params):
            return jnp.mean(call(nnx.merge(graphdef, params), x) ** 2)

        return jax.value_and_grad(loss)(params)

    return lambda x: step(params, x)


def _linen_step(D, N, layers, attention_fn, x):
    import flax.linen as nn  # noqa: PLC0415

    kw = {} if attention_fn is None else dict(attention_fn=attention_fn)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(x[..., 0])
            for _ in range(layers):
                x = x + nn.MultiHeadDotProductAttention(N, qkv_features=D, **kw)(nn.LayerNorm()(x), mask=mask)
            return x

    model = Model()
    params = model.init(jax.random.key(0), x)

    @jax.jit
    def step(params, x):
        return jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)

    return lambda x: step(params, x)


def suite_flax(smoke, repeats, rounds):
    from flax import nnx  # noqa: PLC0415

    B, T, D, N, layers = (1, 64, 32, 2, 2) if smoke else (1, 2048, 512, 8, 2)
    x = jax.random.normal(jax.random.key(1), (B, T, D))

    def nnx_pair(call):
        return {
            name: _nnx_step(_nnx_model(D, N, layers, fn), call)
            for name, fn in (("stock", None), ("attnlab", attnlab.flax.attention_fn))
        }

    rows = {
        "nnx.MultiHeadAttention, is_causal=True": nnx_pair(lambda m, x: m(x, is_causal=True)),
        "nnx.MultiHeadAttention, mask=make_causal_mask": nnx_pair(
            lambda m, x: m(x, mask=nnx.make_causal_mask(x[..., 0]))
        ),
        "linen.MultiHeadDotProductAttention, mask=make_causal_mask": {
            name: _linen_step(D, N, layers, fn, x)
            for name, fn in (("stock", None), ("attnlab", attnlab.flax.attention_fn))
        },
    }
    records = []
    for name, pair in rows.items():
        t0 = time.perf_counter()
        (loss_s, g_s), (loss_o, g_o) = (jax.block_until_ready(f(x)) for f in pair.values())
        compile_s = time.perf_counter() - t0
        grad_diff = max_abs_diff(g_s, g_o)
        best = alternate_best(pair, (x,), rounds=rounds, repeats=repeats)
        rec = {
            "suite": "flax",
            "case": name,
            "mode": "fwd+bwd",
            "shape": dict(B=B, T=T, D=D, N=N, H=D // N, layers=layers, dtype="float32"),
            "stock_ms": round(best["stock"] * 1e3, 2),
            "attnlab_ms": round(best["attnlab"] * 1e3, 2),
            "ratio": round(best["stock"] / best["attnlab"], 3),
            "loss_diff": abs(float(loss_s) - float(loss_o)),
            "max_grad_diff": grad_diff,
            "compile_and_first_s": round(compile_s, 2),
        }
        records.append(rec)
        print(f"flax {name:58s} stock {rec['stock_ms']:9.1f} ms  attnlab {rec['attnlab_ms']:9.1f} ms  "
              f"ratio {rec['ratio']:5.2f}  grad diff {grad_diff:.1e}", flush=True)  # fmt: skip
    return records


def main(_):
    import flax  # noqa: PLC0415

    t0 = time.time()
    records = []
    if "jax_nn" in _SUITES.value:
        records += suite_jax_nn(_SMOKE.value, _REPEATS.value, _ROUNDS.value, _WINDOW_HEADS.value)
    if "flax" in _SUITES.value:
        records += suite_flax(_SMOKE.value, _REPEATS.value, _ROUNDS.value)
    jax_nn = [r for r in records if r["suite"] == "jax_nn"]
    noise = [abs(1 - r["control_ratio"]) for r in jax_nn if r["control_ratio"] is not None] or [0.0]
    summary = {
        "jax_nn_min_ratio": min((r["ratio"] for r in jax_nn), default=None),
        "jax_nn_slower_cases": [f"{r['case']} {r['mode']}" for r in jax_nn if r["ratio"] < 1],
        # the A/A band: how far from 1 jax.nn against itself came (rows without a control: against 1)
        "noise": round(max(noise), 3),
        "jax_nn_slower_beyond_noise": [
            f"{r['case']} {r['mode']}"
            for r in jax_nn
            if r["ratio"] < (1 - max(noise) if r["control_ratio"] is not None else 1)
        ],
        "window_ratios": {r["mode"]: r["ratio"] for r in jax_nn if r["case"].startswith("long/window")},
        "flax_ratios": {r["case"]: r["ratio"] for r in records if r["suite"] == "flax"},
    }
    result = {
        **run_record("make adopt-bench" + (" (--smoke)" if _SMOKE.value else "")),
        "flax": flax.__version__,
        "flags": {
            "smoke": _SMOKE.value,
            "repeats": _REPEATS.value,
            "rounds": _ROUNDS.value,
            "suites": _SUITES.value,
            "window_heads": _WINDOW_HEADS.value,
        },  # fmt: skip
        "wall_s": round(time.time() - t0, 1),
        "summary": summary,
        "records": records,
    }
    print(json.dumps(summary, indent=1))
    path = os.path.join(_OUT.value, "adopt.json")
    write_json(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
