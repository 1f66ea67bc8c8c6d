"""The implementation registry and explain(); the cuDNN flag mapping; traced padding keeps a mask's tiles."""

from __future__ import annotations

import importlib.util
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import CASES  # the suite's mask families
from conftest import grad_tol, np_attention, qkv, tol

import attnlab
from attnlab import dispatch, impls, masks, scores
from attnlab.kernels import blockwise as bw
from attnlab.kernels import cudnn
from attnlab.masks import base as masks_mod  # the layout internals live in masks/base.py


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _available(module):
    return importlib.util.find_spec(f"attnlab.kernels.{module}") is not None


# ------------------------------------------------------------------------------------------
# explain() on shapes only, for backends this process does not have


def test_explain_gpu_picks_cudnn_for_what_cudnn_covers():
    x = _sds((2, 4096, 16, 64))  # [B, T, N, H] bf16
    for mask in (None, masks.causal(), masks.window(128, 0), masks.causal() & masks.padding(kv_lengths=[4000, 10])):
        ex = attnlab.explain(x, x, x, mask=mask, backend="gpu")
        assert ex.implementation == "cudnn", str(ex)
        assert ex.reason("sparse").startswith("needs mask=masks.graph_edges")
        assert [n for n, _ in ex.candidates] == list(dispatch.ORDER["gpu"])
    # "cuda" is the platform name for the same backend
    assert attnlab.explain(x, x, x, mask=masks.causal(), backend="cuda").implementation == "cudnn"


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(dtype=jnp.float32), r"takes bf16/fp16 \(cuDNN flash attention\), got dtype float32"),
        (dict(H=12), r"multiple of 8 up to 256, got H=12"),
        (dict(H=512), r"got H=512"),
        (dict(mask=masks.window(64, 64)), r"left windows only"),
        (dict(mask=masks.causal(3)), r"flag for mask part Causal\(offset=3\)"),
        (dict(mask=masks.chunks(64)), r"has no flag for mask part Chunks"),
        (dict(score=scores.Additive(jnp.ones(64))), r"supports score='dot' only"),
        (dict(bias=_sds((4096, 4096), jnp.float32)), r"takes no bias"),
    ],
)
def test_explain_gpu_says_why_cudnn_was_skipped(kwargs, reason):
    H = kwargs.pop("H", 64)
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    x = _sds((1, 4096, 8, H), dtype)
    ex = attnlab.explain(x, x, x, backend="gpu", **kwargs)
    assert ex.implementation != "cudnn"
    assert re.search(reason, ex.reason("cudnn")), ex.reason("cudnn")


def test_explain_gpu_dense_xla_only_where_the_logits_fit():
    small = _sds((1, 2048, 8, 64), jnp.float32)  # 4 * 8 * 2048^2 = 128 MiB of logits
    big = _sds((1, 32768, 16, 64), jnp.float32)  # 64 GiB of logits
    ex_small = attnlab.explain(small, small, small, mask=masks.window(64, 64), backend="gpu")
    ex_big = attnlab.explain(big, big, big, mask=masks.window(64, 64), backend="gpu")
    assert ex_small.reason("xla") is None
    assert "64.0 GiB > XLA_MAX_LOGITS_BYTES" in ex_big.reason("xla")
    if not _available("pallas_flash"):
        assert ex_small.implementation == "xla"
        assert ex_big.implementation == "blockwise"
        assert ex_big.reason("pallas") == "attnlab.kernels.pallas_flash not available"
    else:
        assert ex_big.implementation in ("pallas", "blockwise")


def test_explain_tpu_and_cpu_orders():
    x = _sds((1, 4096, 8, 128))
    ex = attnlab.explain(x, x, x, mask=masks.causal(), backend="tpu")
    assert [n for n, _ in ex.candidates] == list(dispatch.ORDER["tpu"])
    assert ex.implementation == ("splash" if _available("splash") and ex.reason("splash") is None else "xla")
    # cpu: today's rule
    f32 = _sds((1024, 8, 64), jnp.float32)
    assert attnlab.explain(f32, f32, f32, mask=masks.window(128, 0), backend="cpu").implementation == "blockwise"
    small = _sds((64, 2, 8), jnp.float32)
    ex = attnlab.explain(small, small, small, mask=masks.causal(), backend="cpu")
    assert ex.implementation == "xla"
    assert "pays off on cpu from 262144" in ex.reason("blockwise")
    ex = attnlab.explain(small, small, small, score=lambda q, k: scores.dot_product(q, k), backend="cpu")
    assert ex.implementation == "reference" and "score='dot' only" in ex.reason("xla")
    edges = masks.graph_edges(senders=[0, 1], receivers=[1, 0], num_nodes=64)
    assert attnlab.explain(small, small, small, mask=edges, backend="gpu").implementation == "sparse"


def test_cpu_small_masked_calls_take_dense_xla_where_it_measured_faster():
    """Below BLOCKWISE_MIN_PAIRS an EMPTY tile is not enough on cpu when the kernel would still visit
    more than half the pairs, unless fewer key heads serve the query heads from BLOCKWISE_GQA_MIN_PAIRS
    (``make crossover``, forward+backward)."""

    def choice(shape, mask, K=None):
        q = _sds(shape, jnp.float32)
        kv = q if K is None else _sds(shape[:-2] + (K, shape[-1]), jnp.float32)
        return attnlab.explain(q, kv, kv, mask=mask, backend="cpu")

    # causal at T = 256: 10 of the 16 64 x 64 tiles are non-empty (62%)
    ex = choice((2, 256, 4, 32), masks.causal())
    assert ex.implementation == "xla"
    assert "(here 62%)" in ex.reason("blockwise") and "K = 4, N = 4, 65536 pairs" in ex.reason("blockwise")
    assert 10 / 16 > impls.BLOCKWISE_MAX_VISITED and 256 * 256 == impls.BLOCKWISE_GQA_MIN_PAIRS
    assert choice((1, 256, 8, 64), masks.causal()).implementation == "xla"  # whatever the head dim
    assert choice((2, 256, 4, 32), masks.causal(), K=1).implementation == "blockwise"  # one key head, 256^2 pairs
    assert choice((2, 128, 4, 32), masks.causal(), K=1).implementation == "xla"  # one key head, fewer pairs
    assert choice((2, 256, 4, 32), masks.chunks(64)).implementation == "blockwise"  # 4 of 16 tiles
    assert choice((2, 256, 4, 32), masks.window(16, 0)).implementation == "blockwise"  # 7 of 16 tiles
    # no EMPTY tile: dense; from 512 x 512 pairs: blockwise whatever the tiles
    assert choice((2, 128, 4, 64), masks.window(64, 64)).implementation == "xla"
    assert choice((2, 512, 4, 32), masks.causal()).implementation == "blockwise"
    assert choice((1, 384, 8, 64), masks.causal() & masks.window(128, 0)).implementation == "blockwise"  # 42%


def test_explain_table_reads():
    x = _sds((1, 1024, 8, 64))
    table = str(attnlab.explain(x, x, x, mask=masks.causal(), backend="gpu"))
    lines = table.splitlines()
    assert lines[0] == "backend gpu: cudnn"
    assert re.match(r"\s+cudnn\s+<- chosen", lines[2])
    assert "supported, not reached" in table  # xla also supports it, after cudnn
    assert all(name in table for name in dispatch.ORDER["gpu"])


def test_explain_rejects_bad_backend_and_names():
    x = _sds((8, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="backend must be"):
        attnlab.explain(x, x, x, backend="npu")
    with pytest.raises(ValueError, match="implementation must be one of"):
        attnlab.explain(x, x, x, implementation=("xla", "flash"))


# ------------------------------------------------------------------------------------------
# implementation= as a sequence


def test_implementation_sequence_takes_first_supporting():
    q, k, v = qkv((2, 16, 4, 8), kv_heads=2)
    mask = masks.causal()
    out = attnlab.attention(q, k, v, mask=mask, implementation=("cudnn", "sparse", "xla", "blockwise"))
    ref, _ = np_attention(q, k, v, mask=np.tril(np.ones((16, 16), bool)))
    np.testing.assert_allclose(out, ref, **tol(jnp.float32))
    assert attnlab.explain(q, k, v, mask=mask).implementation == "xla"
    with pytest.raises(ValueError, match=r"implementation='cudnn' needs a GPU backend \(this is cpu\); "):
        attnlab.attention(q, k, v, mask=mask, implementation=("cudnn", "sparse"))


# ------------------------------------------------------------------------------------------
# The cuDNN flag mapping, checked through jax.nn's own XLA path given the same flags


CUDNN_MASKS = {
    "none": lambda B: None,
    "causal": lambda B: masks.causal(),
    "left_window": lambda B: masks.window(3, 0),
    "causal_and_window": lambda B: masks.causal() & masks.window(4, 2),
    "padding": lambda B: masks.padding(q_lengths=jnp.array([9, 5])[:B], kv_lengths=jnp.array([7, 0])[:B]),
    "causal_padding": lambda B: masks.causal() & masks.padding(kv_lengths=jnp.array([6, 11])[:B]),
    "window_padding": lambda B: (
        masks.window(2, 0) & masks.padding(q_lengths=jnp.array([11, 8])[:B], kv_lengths=jnp.array([4, 13])[:B])
    ),
}


@pytest.mark.parametrize("kind", sorted(CUDNN_MASKS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cudnn_mapping_through_jax_nn_xla(kind, dtype):
    B, T, S = 2, 11, 13
    q, k, v = qkv((B, T, 4, 8), s=S, kv_heads=2, dtype=dtype)  # GQA
    mask = CUDNN_MASKS[kind](B)
    assert not isinstance(cudnn.cudnn_flags(mask), str)

    def ours(q, k, v):
        return cudnn.cudnn_attention(q, k, v, mask=mask, scale=0.4, implementation="xla")

    def ref(q, k, v):
        return attnlab.attention_reference(q, k, v, mask=mask, scale=0.4)

    out = jax.jit(ours)(q, k, v)
    dense = None if mask is None else np.asarray(mask.dense(T, S))
    expected, _ = np_attention(q, k, v, mask=dense, scale=0.4)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, **tol(dtype))
    if dtype == jnp.float32:
        cot = jax.random.normal(jax.random.key(9), out.shape)
        g = jax.vjp(ours, q, k, v)[1](cot)
        g_ref = jax.vjp(ref, q, k, v)[1](cot)
        for a, b in zip(g, g_ref, strict=True):
            assert np.isfinite(np.asarray(a)).all()
            np.testing.assert_allclose(a, b, **grad_tol(dtype))


def test_cudnn_mapping_flags_and_reasons():
    assert cudnn.cudnn_flags(masks.window(5, 0)) == cudnn.CudnnFlags(True, (5, 0), None)
    assert cudnn.cudnn_flags(masks.causal() & masks.window(5, 9)) == cudnn.CudnnFlags(True, (5, 0), None)
    assert cudnn.cudnn_flags(masks.full() & masks.causal()) == cudnn.CudnnFlags(True, None, None)
    assert "left windows only" in cudnn.cudnn_flags(masks.window(5, 1))
    assert "excludes the diagonal" in cudnn.cudnn_flags(masks.causal() & masks.Window(5, -1))
    assert "mask part Graph" in cudnn.cudnn_flags(masks.graph(np.eye(4, dtype=bool)))
    assert "mask part Or" in cudnn.cudnn_flags(masks.causal() | masks.window(1, 1))
    with pytest.raises(ValueError, match="mask: cudnn_attention covers left windows only"):
        cudnn.cudnn_attention(*qkv((4, 1, 8)), mask=masks.window(1, 1), implementation="xla")


# ------------------------------------------------------------------------------------------
# Traced padding keeps the structural part's sparsity


def test_traced_padding_keeps_the_tiles_of_concrete_padding():
    T = 1024
    bigbird = masks.bigbird(T, block_size=64)
    lengths = np.array([900, 500], np.int32)
    concrete = bw.pick_block_sizes(bigbird & masks.padding(kv_lengths=lengths), T, T, "cpu")
    seen = {}

    def f(lengths):
        m = bigbird & masks.padding(kv_lengths=lengths)
        assert not m.is_static
        seen["tiles"] = bw.pick_block_sizes(m, T, T, "cpu")
        x = jax.ShapeDtypeStruct((2, T, 2, 8), jnp.float32)
        seen["choice"] = attnlab.explain(x, x, x, mask=m, backend="cpu").implementation
        return lengths

    jax.eval_shape(f, jnp.asarray(lengths))
    assert seen["tiles"] == concrete == bw.default_block_sizes("cpu", sparse=True)
    # at a size below BLOCKWISE_MIN_PAIRS the choice follows the EMPTY tiles, traced or not
    small = {}

    def g(lengths):
        x = jax.ShapeDtypeStruct((256, 2, 8), jnp.float32)
        m = masks.window(16, 0) & masks.padding(kv_lengths=lengths)
        small["choice"] = attnlab.explain(x, x, x, mask=m, backend="cpu").implementation
        return lengths

    jax.eval_shape(g, jnp.int32(200))
    assert small["choice"] == "blockwise"


def test_traced_padding_is_correct_and_does_not_retrace():
    T = 256
    q, k, v = qkv((2, T, 2, 8))
    mask_of = lambda n: masks.window(16, 0) & masks.padding(kv_lengths=n)  # noqa: E731

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, k, v, n):
        return attnlab.attention(q, k, v, mask=mask_of(n))

    for n in ([200, 0], [256, 3]):
        n = jnp.asarray(n, jnp.int32)
        out = f(q, k, v, n)
        expected, _ = np_attention(q, k, v, mask=np.asarray(mask_of(np.asarray(n)).dense(T, T)))
        np.testing.assert_allclose(out, expected, **tol(jnp.float32))


@pytest.mark.parametrize(
    "mask",
    [
        masks.bigbird(200, block_size=16),
        masks.window(7, 3) | masks.chunks(24),
        masks.causal(2) & masks.padding(q_lengths=np.array([150, 40]), kv_lengths=np.array([3, 190])),
        masks.graph(np.random.default_rng(0).random((2, 150, 190)) < 0.02),
    ],
    ids=["bigbird", "window_or_chunks", "causal_padding_batched", "graph_batched"],
)
def test_dense_layout_evaluation_equals_row_by_row(mask):
    """The one-shot dense evaluation of a layout gives the same blocks as the row-by-row one."""
    T, S = 150, 190
    for bq, bk in ((16, 16), (32, 48), (64, 25)):
        fast = masks_mod.layout_by_evaluation(mask, T, S, bq, bk)
        slow = masks_mod.layout_by_evaluation(mask, T, S, bq, bk, dense_max=0)
        np.testing.assert_array_equal(fast, slow)
        # and both agree with the definition: EMPTY / FULL from the dense mask
        dense = np.broadcast_to(np.asarray(mask.dense(T, S)), np.asarray(mask.dense(T, S)).shape)
        block = dense.reshape(-1, T, S)[:, :bq, :bk]
        assert fast[0, 0] == (0 if not block.any() else 2 if block.all() else 1)
        # scattered blocks to decide (rows with different numbers of them, some none): the rest stay PARTIAL
        todo = np.random.default_rng(bq).random(fast.shape) < 0.3
        some = masks_mod.layout_by_evaluation(mask, T, S, bq, bk, todo, dense_max=0)
        np.testing.assert_array_equal(some, np.where(todo, fast, masks_mod.PARTIAL))


@pytest.mark.parametrize("case", sorted(c for c in CASES if c != "none"))
def test_row_by_row_evaluation_of_every_mask_family_equals_the_dense_one(case):
    """Every conformance mask family (arrays, batch dims, predicates, edge lists, combinations) through the
    row-by-row evaluation's one compiled program (the mask an argument of it), ragged tiles: the dense result."""
    (t, s), make = CASES[case]
    mask = masks.as_mask(make(), "mask").for_tiles()
    for bq, bk in ((8, 16), (16, 7)):
        dense = masks_mod.layout_by_evaluation(mask, t, s, bq, bk)
        np.testing.assert_array_equal(masks_mod.layout_by_evaluation(mask, t, s, bq, bk, dense_max=0), dense)


def test_row_by_row_evaluation_is_one_program_for_every_row():
    """Beyond the dense budget each query-block row is one call of the same compiled program (its key
    blocks gathered, padded to the row with the most), not every op of the mask dispatched per row."""
    ids = np.repeat(np.arange(7), 40)[:270]  # documents: every block row has its own set of blocks
    mask = masks.document(ids) & masks.causal()
    before = masks_mod._block_row._cache_size()
    got = masks_mod.layout_by_evaluation(mask, 270, 270, 16, 16, dense_max=0)
    assert masks_mod._block_row._cache_size() == before + 1
    np.testing.assert_array_equal(got, masks_mod.layout_by_evaluation(mask, 270, 270, 16, 16))


# ------------------------------------------------------------------------------------------
# Tiles and compute dtype for the backend the trace is for (attnlab.platform.target)


def test_blockwise_plans_for_the_target_backend_alone():
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv((256, 2, 16)))
    f = jax.jit(lambda q, k, v: bw.blockwise_attention(q, k, v, mask=masks.window(32, 0)))
    bf16_dot = re.compile(r"dot_general[^\n]*tensor<[^>]*bf16>, tensor<[^>]*bf16>")
    with attnlab.lowering_for("cuda"):
        assert attnlab.platform.target() == "gpu"
        cuda = jax.export.export(f, platforms=["cuda"])(q, k, v).mlir_module()
    assert attnlab.platform.target() == "cpu"
    cpu = jax.export.export(f, platforms=["cpu"])(q, k, v).mlir_module()
    assert bf16_dot.search(cuda)  # bf16 tiles with fp32 accumulation on a GPU
    assert not bf16_dot.search(cpu)  # fp32 tiles on XLA:CPU
    # the GPU plan uses 128-row tiles, the CPU plan 64-row ones: the window's forward moves each step's query
    # rows to a tile [B*K, G*bq, H] = [2, 128, 16] (GPU, bf16) or [2, 64, 16] (CPU, fp32); each program holds
    # one plan only (no platform_dependent branch for the others)
    assert "tensor<2x128x16xbf16>" in cuda and "tensor<2x64x16x" not in cuda
    assert "tensor<2x64x16xf32>" in cpu and "tensor<2x128x16xbf16>" not in cpu
    with pytest.raises(ValueError, match="backend must be"), attnlab.lowering_for("metal"):
        pass
    np.testing.assert_allclose(
        np.asarray(f(q, k, v), np.float32),
        np.asarray(attnlab.attention_reference(q, k, v, mask=masks.window(32, 0)), np.float32),
        **tol(jnp.bfloat16),
    )


# ------------------------------------------------------------------------------------------
# Lazily registered kernels (the Pallas modules are written to this contract)


def test_lazy_kernel_registration(monkeypatch):
    import sys
    import types

    from attnlab.impls import LazyImplementation

    fake = types.ModuleType("attnlab.kernels.fake_flash")
    calls = []

    def call_reason(call, backend):
        return None if call.mask is None or call.mask.interval() == (None, 0) else "causal or no mask only"

    def attend(call):
        calls.append((type(call.mask).__name__, call.score.scale))
        return attnlab.attention_reference(call.q, call.k, call.v, mask=call.mask, score=call.score)

    fake.call_reason, fake.attend = call_reason, attend
    monkeypatch.setitem(sys.modules, "attnlab.kernels.fake_flash", fake)
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "pallas", LazyImplementation("pallas", "attnlab.kernels.fake_flash"))

    x = _sds((1, 4096, 8, 64), jnp.float32)  # fp32: cuDNN declines, the registered kernel is next
    assert attnlab.explain(x, x, x, mask=masks.causal(), backend="gpu").implementation == "pallas"
    ex = attnlab.explain(x, x, x, mask=masks.window(8, 8), backend="gpu")
    assert ex.reason("pallas") == "causal or no mask only"
    q, k, v = qkv((8, 2, 4))
    out = attnlab.attention(q, k, v, mask=masks.causal(), scale=0.5, implementation="pallas")
    assert calls == [("Causal", 0.5)]
    np.testing.assert_allclose(out, attnlab.attention_reference(q, k, v, mask=masks.causal(), scale=0.5), rtol=1e-6)

    missing = LazyImplementation("pallas", "attnlab.kernels.no_such_kernel")
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "pallas", missing)
    assert attnlab.explain(x, x, x, backend="gpu").reason("pallas") == "attnlab.kernels.no_such_kernel not available"
    with pytest.raises(ValueError, match="no_such_kernel not available"):
        attnlab.attention(q, k, v, implementation="pallas")
