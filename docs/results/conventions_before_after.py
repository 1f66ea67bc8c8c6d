# ruff: noqa: B023, E402, E501, E731  (each lambda is called at once by run(); sys.path set before the conftest import)
"""Issue #20 items 1-7, before (main at 160a7db) and after (branch core): one line per case.

Run from the repository root (or from a checkout of 160a7db for "before"):
    PYTHONPATH=$PWD .venv/bin/python docs/results/conventions_before_after.py
Output of both runs: docs/results/conventions_before_after.txt.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import attnlab
from attnlab import masks

sys.path.insert(0, "tests")
from conftest import np_attention, qkv

FMIN = float(np.finfo(np.float32).min)


def run(name, f):
    try:
        print(name, f())
    except Exception as e:
        print(name, "ERR", type(e).__name__, str(e)[:90].replace("\n", " "))


# 1
q, k, v = qkv((2, 6, 2, 8), s=7, dtype=jnp.bfloat16, seed=1)
bias = jnp.asarray(np.random.default_rng(0).uniform(295.0, 305.0, (2, 2, 6, 7)), jnp.float32)
exp, _ = np_attention(q, k, v, bias=bias)


def one():
    out = attnlab.attention(q, k, v, bias=bias, implementation="xla")
    ct = jnp.ones(out.shape)
    g = jax.grad(
        lambda q: jnp.sum(attnlab.attention(q, k, v, bias=bias, implementation="xla").astype(jnp.float32) * ct)
    )(q)
    gr = jax.grad(
        lambda q: jnp.sum(attnlab.attention_reference(q, k.astype(jnp.float32), v.astype(jnp.float32), bias=bias) * ct)
    )(q.astype(jnp.float32))
    return f"out err {np.abs(np.asarray(out, np.float64) - exp).max():.3g}, dq err {np.abs(np.asarray(g, np.float32) - np.asarray(gr)).max():.3g}"


run("1 bf16 bias~300 xla", one)
b2 = jnp.zeros((1, 2, 4, 5), jnp.float32).at[:, :, 1, :].set(FMIN)
q1, k1, v1 = qkv((1, 4, 2, 8), s=5, dtype=jnp.bfloat16)
run(
    "1 bf16 finfo.min row xla NaN?",
    lambda: bool(np.isnan(np.asarray(attnlab.attention(q1, k1, v1, bias=b2, implementation="xla"), np.float32)).any()),
)
# 2
q, k, v = qkv((2, 10, 2, 8), s=10, seed=4)
bf = lambda qi, ki: jnp.where(
    (qi % 2 == 1)[:, None], jnp.float32(FMIN), 0.5 * (ki[None, :] - qi[:, None]).astype(jnp.float32)
)
db = np.asarray(bf(jnp.arange(10), jnp.arange(10)))
for impl in ["blockwise", "xla"]:
    for mk, m in [("none", None), ("window(3,1)", masks.window(3, 1))]:
        exp, _ = np_attention(q, k, v, bias=db, mask=None if m is None else np.asarray(m.dense(10, 10)))
        run(
            f"2 huge-negative rows {impl} mask={mk} max err",
            lambda: (
                f"{np.abs(np.asarray(attnlab.attention(q, k, v, bias=bf, mask=m, implementation=impl)) - exp).max():.3g}"
            ),
        )
# 3
q, k, v = qkv((4, 2, 8))
f = jax.jit(
    lambda s: attnlab.attention(q, k, v, mask=masks.graph_edges(s, jnp.array([1, 2, 3]), 4), implementation="sparse")
)
g = jax.jit(
    lambda s: attnlab.attention(q, k, v, mask=masks.graph_edges(s, jnp.array([1, 2, 3]), 4), implementation="reference")
)
run(
    "3 sparse vs reference, edge 7->3 under jit: max diff",
    lambda: f"{np.abs(np.asarray(f(jnp.array([0, 1, 7]))) - np.asarray(g(jnp.array([0, 1, 7])))).max():.3g}",
)
# 4
for impl in ["reference", "xla", None]:
    q, k, v = qkv((2, 4, 2, 8), s=0)
    run(f"4 S=0 {impl}", lambda: attnlab.attention(q, k, v, implementation=impl).shape)
# 5
q, k, v = qkv((1, 4, 2, 8), s=5)
run("5 rank-1 mask", lambda: attnlab.attention(q, k, v, mask=np.arange(5) <= 3).shape)
# 6
q, k, v = qkv((1, 1, 1, 8), s=1, dtype=jnp.bfloat16)
run(
    "6 bf16 1x1x1 jit xla",
    lambda: jax.jit(lambda q, k, v: attnlab.attention(q, k, v, implementation="xla"))(q, k, v).shape,
)
# 7
q, k, v = qkv((1, 4, 2, 8), s=5)
run("7 scale=ones(S)", lambda: attnlab.attention(q, k, v, scale=jnp.ones(5)).shape)
run("7 masked_softmax int mask", lambda: attnlab.masked_softmax(jnp.zeros((1, 3)), jnp.array([[1, 2, 0]])).tolist())
run("7 window(2**40)", lambda: jnp.asarray(attnlab.attention(q, k, v, mask=masks.window(2**40, 0))).shape)
from attnlab import heads

p = heads.init_multi_head_params(jax.random.key(0), 16, 4)
p["wo"] = p["wo"][:, :3]
run("7 wrong wo", lambda: heads.multi_head_attention(p, jnp.ones((2, 7, 16))).shape)
