"""The Pallas block-sparse flash kernel and the splash adapter, run in Pallas interpret mode on CPU:
what is specific to them (fp16, tile bitmaps per head, traced lengths, block sizes, schedules); every
mask kind in fp32 and bf16 against the reference is in tests/conformance.py.

Every case compares outputs and gradients (of q, k, v) with ``attention_reference`` (fp32) at small
sizes: interpret mode compiles the kernel's logic as XLA loops, which is slow, so each case is one
jit of the forward and one of the gradient.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlab
from attnlab import kernels, masks, positional, scores
from attnlab.attention import attention_reference
from attnlab.impls.pallas import PALLAS
from attnlab.kernels import pallas_flash, pallas_mask_info, splash

TOL = {
    jnp.float32: dict(atol=2e-5, rtol=2e-5),
    jnp.bfloat16: dict(atol=3e-2, rtol=3e-2),
    jnp.float16: dict(atol=5e-3, rtol=5e-3),
}


def _inputs(B, T, S, N, K, H, dtype, seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (B, T, N, H), jnp.float32)
    return q, k, v, do


def _check_against_reference(fn, q, k, v, do, make_mask, args, dtype):
    """fn(q, k, v, mask) vs attention_reference on the same (upcast) inputs: output and grads."""

    def loss(attn, q, k, v, *args):
        return jnp.sum(attn(q, k, v, make_mask(*args)).astype(jnp.float32) * do)

    out = jax.jit(lambda q, k, v, *a: fn(q, k, v, make_mask(*a)))(q, k, v, *args)
    grads = jax.jit(jax.grad(lambda *x: loss(fn, *x), argnums=(0, 1, 2)))(q, k, v, *args)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    ref = attention_reference(q32, k32, v32, mask=make_mask(*args))
    ref_grads = jax.grad(
        lambda *x: loss(lambda q, k, v, m: attention_reference(q, k, v, mask=m), *x), argnums=(0, 1, 2)
    )(q32, k32, v32, *args)
    assert out.dtype == q.dtype and out.shape == ref.shape
    chex.assert_trees_all_close(out.astype(jnp.float32), ref, **TOL[dtype])
    for g, r, name in zip(grads, ref_grads, "qkv", strict=True):
        assert g.dtype == q.dtype, name
        chex.assert_trees_all_close(g.astype(jnp.float32), r, **TOL[dtype], custom_message=f"d{name}")
    return out, grads


_RNG = np.random.default_rng(0)
_GRAPH = _RNG.random((2, 40, 40)) < 0.1
_GRAPH[:, 5, :] = False  # node 5 has no neighbour: an empty row
_PER_HEAD = _RNG.random((4, 40, 40)) < 0.7  # a bool mask [N, T, S] that differs per head


# name -> (B, T, S, N, K, H, dtype, mask maker, mask args)
CASES = {
    # (full, causal and window with GQA, odd lengths, fp32 and bf16: tests/conformance.py)
    "traced_padding_empty_rows_fp32": (
        2,
        40,
        40,
        2,
        2,
        16,
        jnp.float32,
        lambda ql, kl: masks.padding(ql, kl) & masks.causal(),
        (jnp.array([40, 25]), jnp.array([0, 30])),  # example 0: no key at all -> every row empty
    ),
    "chunks_or_global_fp16": (
        *(1, 64, 64, 2, 2, 16, jnp.float16),
        lambda: masks.chunks(12) | masks.global_tokens([0]),
        (),
    ),
    "bigbird_bf16": (1, 64, 64, 2, 1, 16, jnp.bfloat16, lambda: masks.bigbird(64, block_size=16, num_random=1), ()),
    "graph_batched_and_per_head_gqa_fp32": (
        *(2, 40, 40, 4, 2, 16, jnp.float32),
        lambda: masks.graph(_GRAPH) & masks.as_mask(_PER_HEAD),  # bitmaps [B, N, ...]
        (),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pallas_matches_reference(case):
    B, T, S, N, K, H, dtype, make_mask, args = CASES[case]
    q, k, v, do = _inputs(B, T, S, N, K, H, dtype)

    def fn(q, k, v, m):
        return pallas_flash.pallas_attention(q, k, v, mask=m, block_q=16, block_k=16)

    out, grads = _check_against_reference(fn, q, k, v, do, make_mask, args, dtype)
    if case.startswith("traced_padding"):  # empty rows: zeros and zero gradients, never NaN
        assert not np.asarray(out[0]).any() and not np.asarray(grads[0][0]).any()
        assert not np.asarray(out[1, 25:]).any() and not np.asarray(grads[0][1, 25:]).any()
    if case.startswith("graph"):
        assert not np.asarray(out[:, 5]).any() and not np.asarray(grads[0][:, 5]).any()


def test_pallas_traced_lengths_do_not_retrace():
    q, k, v, _ = _inputs(2, 40, 40, 2, 1, 16, jnp.float32)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, k, v, ql, kl):
        return pallas_flash.pallas_attention(
            q, k, v, mask=masks.padding(ql, kl) & masks.window(8, 0), block_q=16, block_k=16
        )

    for ql, kl in (([40, 17], [40, 3]), ([9, 40], [33, 40])):
        ql, kl = jnp.array(ql), jnp.array(kl)
        ref = attention_reference(q, k, v, mask=masks.padding(ql, kl) & masks.window(8, 0))
        chex.assert_trees_all_close(f(q, k, v, ql, kl), ref, **TOL[jnp.float32])


def test_pallas_vmap_of_unbatched_call():
    q, k, v, _ = _inputs(2, 20, 20, 2, 1, 16, jnp.float32)
    m = masks.window(4, 4)
    out = jax.vmap(lambda q, k, v: pallas_flash.pallas_attention(q, k, v, mask=m, block_q=16, block_k=16))(q, k, v)
    chex.assert_trees_all_close(out, attention_reference(q, k, v, mask=m), **TOL[jnp.float32])


def test_pallas_empty_tiles_are_never_loaded():
    # kv_lengths = 40 with 16-wide key blocks: key block 3 (positions 48..63) is EMPTY for every
    # query block, so NaNs there cannot reach the output unless the kernel loads that tile.
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 16, jnp.float32)
    m = masks.padding(kv_lengths=np.array([40])) & masks.causal()
    assert (m.block_layout(64, 64, 16, 16)[:, 3] == masks.EMPTY).all()
    k_nan, v_nan = k.at[:, 48:].set(jnp.nan), v.at[:, 48:].set(jnp.nan)
    out = pallas_flash.pallas_attention(q, k_nan, v_nan, mask=m, block_q=16, block_k=16)
    chex.assert_trees_all_close(out, attention_reference(q, k, v, mask=m), **TOL[jnp.float32])


def test_pallas_schedule_lists_only_non_empty_tiles():
    layout = masks.window(16, 0).block_layout(64, 64, 16, 16)
    sc = kernels.Schedule(
        pallas_mask_info.mask_info(masks.window(16, 0), (1,), 64, 64, 16, 16).layout, 64, 16, pow2=True
    )
    assert sc.index.shape[1] == 2  # the widest row visits 2 tiles (a power of two: Triton)
    for i in range(layout.shape[0]):
        n_full, n_partial = sc.counts[i]
        assert sc.index[i, :n_full].tolist() == np.nonzero(layout[i] == masks.FULL)[0].tolist()
        assert sc.index[i, n_full : n_full + n_partial].tolist() == np.nonzero(layout[i] == masks.PARTIAL)[0].tolist()


def test_pallas_supports_and_errors():
    q = jax.ShapeDtypeStruct((2, 100, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 100, 2, 64), jnp.bfloat16)
    assert (
        attnlab.explain(q, kv, kv, mask=masks.causal(), backend="gpu", implementation="pallas").reason("pallas") is None
    )
    assert attnlab.explain(q, kv, kv, backend="cpu", implementation="pallas").reason("pallas") is None
    assert "TPU" in attnlab.explain(q, kv, kv, backend="tpu", implementation="pallas").reason("pallas")
    assert "bias" in attnlab.explain(q, kv, kv, bias=jnp.zeros(()), backend="gpu", implementation="pallas").reason(
        "pallas"
    )
    assert "score" in attnlab.explain(q, kv, kv, score=lambda q, k: q, backend="gpu", implementation="pallas").reason(
        "pallas"
    )
    big = jax.ShapeDtypeStruct((2, 100, 8, 512), jnp.bfloat16)
    assert "head dims" in attnlab.explain(big, big, big, backend="gpu", implementation="pallas").reason("pallas")
    x = jnp.zeros((20, 2, 16))
    with pytest.raises(ValueError, match="bias"):
        pallas_flash.pallas_attention(x, x, x, bias=jnp.zeros((2, 20, 20)))
    with pytest.raises(ValueError, match="block_q"):
        pallas_flash.pallas_attention(x, x, x, block_q=24)
    with pytest.raises(ValueError, match="multiple of key heads"):
        pallas_flash.pallas_attention(jnp.zeros((20, 3, 16)), x, x)
    with pytest.raises(ValueError, match="does not broadcast"):  # a [T, S] mask of the wrong size
        pallas_flash.pallas_attention(x, x, x, mask=np.ones((20, 19), bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        splash.splash_attention(x, x, x, mask=np.ones((20, 19), bool))


# ------------------------------------------------------------------------------------------
# splash (TPU kernel, interpret mode here)

SPLASH_CASES = {
    # (causal and windows with GQA and odd lengths: tests/conformance.py)
    "traced_padding_empty_rows_fp32": CASES["traced_padding_empty_rows_fp32"],
    "bigbird_fp32": (1, 64, 64, 2, 2, 16, jnp.float32, lambda: masks.bigbird(64, block_size=16, num_random=1), ()),
    "graph_and_per_head_gqa_fp32": (
        *(1, 40, 40, 4, 2, 16, jnp.float32),
        lambda: masks.graph(_GRAPH[0]) & masks.as_mask(_PER_HEAD),  # a splash mask per head
        (),
    ),
}


@pytest.mark.parametrize("case", sorted(SPLASH_CASES))
def test_splash_matches_reference(case):
    B, T, S, N, K, H, dtype, make_mask, args = SPLASH_CASES[case]
    q, k, v, do = _inputs(B, T, S, N, K, H, dtype)
    out, grads = _check_against_reference(
        lambda q, k, v, m: splash.splash_attention(q, k, v, mask=m), q, k, v, do, make_mask, args, dtype
    )
    if case.startswith("traced_padding"):
        assert not np.asarray(out[0]).any() and not np.asarray(grads[0][0]).any()
        assert not np.asarray(out[1, 25:]).any() and not np.asarray(grads[0][1, 25:]).any()
    if case.startswith("graph"):
        assert not np.asarray(out[:, 5]).any() and not np.asarray(grads[0][:, 5]).any()


def test_splash_mask_mapping_and_supports():
    sa = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    assert isinstance(splash.splash_mask(masks.causal(), 100, 100, 128, 128, 0), sa.CausalMask)
    assert isinstance(splash.splash_mask(masks.window(4, 2), 100, 100, 128, 128, 0), sa.LocalMask)
    adapted = splash.splash_mask(masks.chunks(10), 100, 90, 128, 128, 0)
    np.testing.assert_array_equal(adapted[0:128, 0:128][:100, :90], np.asarray(masks.chunks(10).dense(100, 90)))
    assert not adapted[0:128, 0:128][100:].any() and not adapted[0:128, 0:128][:, 90:].any()
    q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    assert (
        attnlab.explain(q, kv, kv, mask=masks.causal(), backend="tpu", implementation="splash").reason("splash") is None
    )
    assert "TPU" in attnlab.explain(q, kv, kv, backend="gpu", implementation="splash").reason("splash")
    batched = masks.graph(np.ones((2, 256, 256), bool))
    assert "batch" in attnlab.explain(q, kv, kv, mask=batched, backend="tpu", implementation="splash").reason("splash")
    with pytest.raises(ValueError, match="block"):
        x = jnp.zeros((20, 2, 16))
        splash.splash_attention(x, x, x, block=64)


def test_pallas_graph_edges_forward():
    # an edge list is scattered to an adjacency once and fed to the kernel as tile bitmaps
    q = jax.random.normal(jax.random.PRNGKey(1), (30, 2, 16))
    m = masks.graph_edges([0, 1, 2, 5, 7], [1, 2, 3, 5, 29], 30)  # most nodes receive nothing: empty rows
    out = pallas_flash.pallas_attention(q, q, q, mask=m, block_q=16, block_k=16)
    chex.assert_trees_all_close(out, attention_reference(q, q, q, mask=m), **TOL[jnp.float32])
    assert not np.asarray(out[0]).any()


def test_pallas_traced_document_ids_schedule_on_device():
    """Document ids traced under jit: the schedules are built on device from the ids (kernel inputs),
    the values and gradients are the reference's, and new ids reuse the program."""
    T, traces = 80, []
    q, k, v, do = _inputs(2, T, T, 2, 1, 16, jnp.float32, seed=4)

    def mask(ids, lengths):
        return masks.document(ids, padding_id=9) & masks.causal() & masks.padding(kv_lengths=lengths)

    @jax.jit
    def run(q, k, v, ids, lengths):
        traces.append(1)
        f = lambda q, k, v: pallas_flash.pallas_attention(q, k, v, mask=mask(ids, lengths), block_q=16, block_k=16)  # noqa: E731
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do)

    for seed in range(2):
        rng = np.random.default_rng(seed)
        row = np.searchsorted(np.sort(rng.choice(np.arange(1, T), 3, replace=False)), np.arange(T), side="right")
        ids = np.stack([row, np.where(np.arange(T) < 60, row, 9)]).astype(np.int32)
        lengths = np.array([T, 70], np.int32)
        out, grads = run(q, k, v, ids, lengths)
        ref, ref_vjp = jax.vjp(functools.partial(attention_reference, mask=mask(ids, lengths)), q, k, v)
        chex.assert_trees_all_close(out, ref, **TOL[jnp.float32])
        chex.assert_trees_all_close(grads, ref_vjp(do), atol=1e-4, rtol=1e-4)
    assert len(traces) == 1

    def schedule(ids):  # traced ids: the static layout is all PARTIAL, the runtime one exact
        m = masks.document(ids)
        info = pallas_mask_info.mask_info(m, (2,), T, T, 16, 16)
        sc = kernels.Schedule(info.layout, T, 16, runtime=m.runtime_layout(T, T, 16, 16), pow2=True)
        return sc.index, sc.counts

    index, counts = jax.jit(schedule)(ids)
    exact = masks.document(ids).block_layout(T, T, 16, 16)
    for i in range(exact.shape[0]):  # each row lists exactly the tiles the ids make non-empty, FULL ones first
        n_full, n_partial = np.asarray(counts[i])
        assert sorted(np.asarray(index[i, : n_full + n_partial]).tolist()) == np.nonzero(exact[i])[0].tolist()
        assert (exact[i][np.asarray(index[i, :n_full])] == masks.FULL).all()


def _mixed_mod(s, q_idx, k_idx, temp, bias, slopes):
    """A scalar temperature, a bias table all heads share (indexed arithmetically) and per-head slopes."""
    near = (jnp.abs(q_idx - k_idx) <= 2).astype(jnp.float32)  # [t, s]
    return s * temp + bias[0] * near + bias[1] * (1.0 - near) - slopes[:, None, None] * jnp.abs(q_idx - k_idx)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_score_mod_arrays_of_every_kind_get_their_gradients(dtype):
    """A ScoreMod with a 0-d array, an array shared by all heads (head axis None) and a per-head one (GQA:
    4 query heads on 2 kv heads): output and gradients of q, k, v and all three arrays = the reference."""
    q, k, v, do = _inputs(2, 40, 40, 4, 2, 16, dtype, seed=3)
    arrays = (jnp.float32(0.7), jnp.array([0.5, -0.25]), jnp.array([0.3, 0.2, 0.1, 0.05]))
    mask = masks.causal() & masks.padding(kv_lengths=jnp.array([40, 23]))

    def loss(fn, q, k, v, arrays):
        score = scores.ScoreMod(_mixed_mod, *arrays, head_axes=(None, None, 0))
        return jnp.sum(fn(q, k, v, mask=mask, score=score).astype(jnp.float32) * do)

    def grads(fn, *x):
        return jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2, 3))(*x)

    got = jax.jit(functools.partial(grads, pallas_flash.pallas_attention))(q, k, v, arrays)
    want = grads(attention_reference, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), arrays)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == jnp.float32 else dict(atol=0.15, rtol=6e-2)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)
    assert float(jnp.abs(got[3][1]).min()) > 0  # each array's gradient is really there


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_additive_shared_weights_under_gqa(dtype):
    """Additive scores with one w [H] for all heads (head axis None: w's gradient sums every program's
    share), 4 query heads on 2 kv heads, a head dim the kernel pads (12 -> 16), causal with padding."""
    q, k, v, do = _inputs(2, 40, 36, 4, 2, 12, dtype, seed=5)
    w = jnp.linspace(-1.0, 1.5, 12)
    mask = masks.causal(offset=-4) & masks.padding(kv_lengths=jnp.array([36, 19]))

    def loss(fn, q, k, v, w):
        return jnp.sum(fn(q, k, v, mask=mask, score=scores.Additive(w)).astype(jnp.float32) * do)

    def grads(fn, *x):
        return jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2, 3))(*x)

    got = jax.jit(functools.partial(grads, pallas_flash.pallas_attention))(q, k, v, w)
    want = grads(attention_reference, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), w)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == jnp.float32 else dict(atol=0.15, rtol=6e-2)
    for g, r in zip(got, want, strict=True):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), **tol)
    assert float(jnp.abs(got[3]).min()) > 0


def test_pallas_additive_reasons():
    """Additive runs in the kernel wherever its w can be a Triton block; the reason says when it cannot."""
    q = jax.ShapeDtypeStruct((2, 64, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.float32)

    def reason(w, backend, head_dim=16):
        qq = jax.ShapeDtypeStruct(q.shape[:-1] + (head_dim,), q.dtype)
        kk = jax.ShapeDtypeStruct(kv.shape[:-1] + (head_dim,), kv.dtype)
        return PALLAS.supports(attnlab.call.bind(qq, kk, kk, score=scores.Additive(w)), backend)

    for w in (jnp.ones((4, 16)), jnp.ones(16), jax.ShapeDtypeStruct((4, 16), jnp.float32)):
        assert reason(w, "gpu") is None and reason(w, "cpu") is None
    assert "powers of two" in reason(jnp.ones(12), "gpu", head_dim=12)  # w's block [12]
    assert reason(jnp.ones(12), "cpu", head_dim=12) is None  # interpret mode takes any width
    # supported, but on a GPU dispatch moves on to blockwise (faster there on an H200: pays_off); asked for, it runs
    x = attnlab.explain(q, kv, kv, score=scores.Additive(jnp.ones(16)), backend="gpu")
    assert x.implementation == "blockwise" and "ran faster in blockwise" in x.reason("pallas")
    x = attnlab.explain(q, kv, kv, score=scores.Additive(jnp.ones(16)), backend="gpu", implementation=("pallas",))
    assert x.implementation == "pallas"
    assert attnlab.explain(q, kv, kv, score=scores.SoftCap(30.0), backend="gpu").implementation == "pallas"


def test_pallas_default_tiles_per_backend_dtype_and_score():
    """(128, 64) tiles on a GPU for 16-bit inputs with head dims 65-128 and a dot-product tile; 64 otherwise."""
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    assert pallas_flash.default_block_q(128, 128, bf16, backend="gpu") == 128
    assert pallas_flash.default_block_q(128, 128, f16, backend="cuda") == 128
    assert pallas_flash.default_block_q(64, 128, bf16, backend="gpu") == 128  # the wider of H and Hv counts
    assert pallas_flash.default_block_q(128, 128, f32, backend="gpu") == 64  # fp32 tiles: shared memory
    assert pallas_flash.default_block_q(128, 128, bf16, pair_form=True, backend="gpu") == 64  # additive
    assert pallas_flash.default_block_q(64, 64, bf16, backend="gpu") == 64
    assert pallas_flash.default_block_q(256, 256, bf16, backend="gpu") == 64
    assert pallas_flash.default_block_q(128, 128, bf16, backend="cpu") == 64
    assert pallas_flash.default_block_q(128, 128, bf16) == (128 if jax.default_backend() == "gpu" else 64)


def test_pallas_fp32_tile_products_are_tf32x3_on_gpu_and_exact_in_interpret_mode():
    """fp32 tiles: three TF32 passes in the Triton lowering (fast to compile, about fp32's accuracy), the exact
    product in interpret mode, and on a GPU too under jax.default_matmul_precision("highest")."""
    assert pallas_flash._fp32_dot(False) == jax.lax.Precision.HIGHEST
    assert pallas_flash._fp32_dot(True) == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    with jax.default_matmul_precision("highest"):
        assert pallas_flash._fp32_dot(True) == jax.lax.Precision.HIGHEST
    with jax.default_matmul_precision("float32"):
        assert pallas_flash._fp32_dot(True) == jax.lax.Precision.HIGHEST
    with jax.default_matmul_precision("tensorfloat32"):
        assert pallas_flash._fp32_dot(True) == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def test_pallas_score_mod_reasons():
    """What the kernel says when it cannot take a ScoreMod, per backend, from shapes alone."""
    q = jax.ShapeDtypeStruct((2, 64, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.float32)

    def reason(score, backend="cpu"):
        return PALLAS.supports(attnlab.call.bind(q, kv, kv, score=score), backend)

    def table(s, q_idx, k_idx, t):
        return s + t[jnp.clip(q_idx - k_idx, -4, 4) + 4]  # a gather, and a scatter-add in its gradient

    assert "needs head_axes" in reason(scores.ScoreMod(lambda s, qi, ki, w: s + w[:, None, None], jnp.ones(4)))
    gather = scores.ScoreMod(table, jnp.ones(16), head_axes=(None,))
    assert reason(gather, "cpu") is None  # interpret mode gathers
    assert "uses gather" in reason(gather, "gpu") and "Triton" in reason(gather, "gpu")
    assert "powers of two" in reason(scores.ScoreMod(table, jnp.ones(9), head_axes=(None,)), "gpu")
    all_heads = scores.ScoreMod(lambda s, qi, ki, w: s + w.reshape(4, 1, 1), jnp.ones(4), head_axes=(0,))
    assert "fails on one head's tile" in reason(all_heads)
    assert "not N=4" in reason(positional.Alibi().score(slopes=jnp.ones(3)))
    assert reason(positional.Alibi().score(slopes=jnp.ones(4)), "gpu") is None
    shapes_only = positional.Alibi().score(slopes=jax.ShapeDtypeStruct((4,), jnp.float32))  # as explain gets it
    assert reason(shapes_only, "gpu") is None and reason(shapes_only, "cpu") is None
    assert "uses gather" in reason(
        scores.ScoreMod(table, jax.ShapeDtypeStruct((16,), jnp.float32), head_axes=(None,)), "gpu"
    )
    x = jnp.ones((64, 2, 16))
    with pytest.raises(ValueError, match="head_axes"):
        pallas_flash.pallas_attention(x, x, x, score=scores.ScoreMod(lambda s, qi, ki, w: s + w[:, None], jnp.ones(2)))
