"""The Pallas block-sparse flash kernel and the splash adapter, run in Pallas interpret mode on CPU:
what is specific to them (EMPTY tiles never loaded, schedules built on device, a head dim the kernel
pads, reasons, default tiles, the fp32 dot's precision, splash's mask mapping). What every
implementation must do (every mask kind including BigBird, chunks | global tokens and masks per head
and per example, traced lengths with empty rows, fp16, scores with arrays of every kind, vmap, trace
counts) is the conformance base, tests/conformance.py, which runs both kernels.

Each case compares outputs and gradients (of q, k, v) with ``attention_reference`` (fp32) at small
sizes, with the tolerances of ``attnlab.testing``.
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
from attnlab.testing import assert_close, tolerance


def _inputs(B, T, S, N, K, H, dtype, seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (B, T, N, H), jnp.float32)
    return q, k, v, do


def test_pallas_empty_tiles_are_never_loaded():
    # kv_lengths = 40 with 16-wide key blocks: key block 3 (positions 48..63) is EMPTY for every
    # query block, so NaNs there cannot reach the output unless the kernel loads that tile.
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 16, jnp.float32)
    m = masks.padding(kv_lengths=np.array([40])) & masks.causal()
    assert (m.block_layout(64, 64, 16, 16)[:, 3] == masks.EMPTY).all()
    k_nan, v_nan = k.at[:, 48:].set(jnp.nan), v.at[:, 48:].set(jnp.nan)
    out = pallas_flash.pallas_attention(q, k_nan, v_nan, mask=m, block_q=16, block_k=16)
    chex.assert_trees_all_close(out, attention_reference(q, k, v, mask=m), **tolerance(jnp.float32))


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
        chex.assert_trees_all_close(out, ref, **tolerance(jnp.float32))
        chex.assert_trees_all_close(grads, ref_vjp(do), **tolerance(jnp.float32, "grad"))
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
    for g, r in zip(got, want, strict=True):
        assert g.shape == r.shape
        assert_close(g, r, dtype, "grad")
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
