"""Every implementation keeps its own dtypes whatever ``jax_enable_x64`` says (issue 41's fuzzing crash).

Under x64, a ``jnp.zeros(shape)`` without a dtype is float64: inside a kernel it meets float32 values
(a ``lax.cond`` whose branches disagree, as the Pallas dq kernel's additive-score backward did) or
silently promotes them. Each case runs every registered implementation that supports it, with float32
inputs under ``jax.enable_x64(True)``, and compares the output and the gradients with the dense
reference computed in the same mode; outputs and gradients must stay float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import attention, attention_reference, dispatch, masks, positional, scores
from attnlab.call import bind
from attnlab.testing import assert_close

T, N, H = 40, 2, 8


def _inputs():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, T, N, H)), jnp.float32) for _ in range(3))
    ids = jnp.asarray(np.repeat(np.arange(4), 10)[None])
    adj = jnp.asarray(rng.random((T, T)) < 0.2)
    w = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    return q, k, v, ids, adj, w


CASES = {
    # issue 41: pallas failed under grad ("cond branches must have equal output types": float64 vs float32)
    "documents & window, additive": lambda ids, adj, w: (masks.document(ids) & masks.window(5, 2), scores.Additive(w)),
    "causal, softcap": lambda ids, adj, w: (masks.causal(), scores.SoftCap(5.0)),
    "graph & padding, alibi": lambda ids, adj, w: (
        masks.graph(adj, self_loops=True) & masks.padding(kv_lengths=jnp.asarray([T - 3])),
        positional.Alibi().score(slopes=jnp.asarray([0.5, 0.25], jnp.float32)),
    ),
    "documents, dot": lambda ids, adj, w: (masks.document(ids), "dot"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_keep_float32_under_x64(case):
    with jax.enable_x64(True):
        q, k, v, ids, adj, w = _inputs()
        mask, score = CASES[case](ids, adj, w)
        ran = []
        for name, impl in dispatch.IMPLEMENTATIONS.items():
            if impl.supports(bind(q, k, v, mask=mask, score=score), "cpu") is not None:
                continue

            def f(q, k, v, impl=name):
                return attention(q, k, v, mask=mask, score=score, implementation=impl)

            def ref(q, k, v):
                return attention_reference(q, k, v, mask=mask, score=score)

            out, grads = jax.jit(lambda *a, f=f: (f(*a), jax.grad(lambda *b: (f(*b) ** 2).sum(), (0, 1, 2))(*a)))(
                q, k, v
            )
            r_grads = jax.grad(lambda *b: (ref(*b) ** 2).sum(), (0, 1, 2))(q, k, v)
            assert {out.dtype, *(g.dtype for g in grads)} == {jnp.dtype(jnp.float32)}, name
            assert_close(out, ref(q, k, v), jnp.float32, err_msg=name)
            for g, r in zip(grads, r_grads, strict=True):
                assert_close(g, r, jnp.float32, "grad", err_msg=name)
            ran.append(name)
    assert {"reference", "blockwise", "pallas"} <= set(ran), ran
