"""The Hopper Mosaic GPU forward (``attnlab.kernels.mosaic_gpu``): checked on this CPU as far as a CPU can.

* its values: Pallas' GPU interpret mode runs the kernel's warpgroups, barriers, TMA copies and
  wgmma on the CPU, so the forward (and the Triton backward it hands to) is compared with the
  reference, outputs and gradients (slow: the interpreter simulates every thread);
* its lowering: exported for cuda from this CPU (``attnlab.lowering_for("gpu")``), the forward is one
  Mosaic GPU custom call and the backward the two Triton kernels;
* its protocol: what it supports from shapes alone, and that dispatch takes it on a GPU only where a
  tuning table times it faster than the Triton kernel.
Its speed is measured on a GPU (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import attnlab
from attnlab import masks, positional, scores, tuning
from attnlab.call import bind
from attnlab.impls.mosaic import MOSAIC
from attnlab.testing import assert_close


@pytest.mark.slow
@pytest.mark.parametrize(
    "mask_name, backward",
    [
        ("causal_padding", "triton"),
        ("causal_padding", "mosaic"),
        ("window_softcap", "triton"),
        ("window_softcap", "mosaic"),
        ("documents_causal", "mosaic"),  # documents take the Mosaic backward whatever the config says
    ],
)
def test_mosaic_forward_and_backward_match_the_reference(mask_name, backward):
    """The Mosaic forward with either backward (the Triton dq and dk/dv kernels, or the Mosaic ones).

    Eager calls: under ``jit`` on this 2-core host Pallas' GPU interpreter sometimes stops with one
    warpgroup's thread inside its compiled step and none at a barrier (seen with the document mask's
    id loads), which the device does not run into."""
    mg = pytest.importorskip("attnlab.kernels.mosaic_gpu")
    T, S, N, K, H = 130, 120, 2, 1, 64  # odd lengths, GQA
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(1, T, N, H)), jnp.bfloat16)
    k, v = (jnp.asarray(r.normal(size=(1, S, K, H)), jnp.bfloat16) for _ in range(2))
    do = jnp.asarray(r.normal(size=(1, T, N, H)), jnp.float32)
    m, score = {
        "causal_padding": (masks.causal() & masks.padding(kv_lengths=jnp.asarray([100])), "dot"),
        "window_softcap": (masks.window(40, 8), scores.SoftCap(5.0)),
        "documents_causal": (
            masks.document(jnp.asarray([[0] * 50 + [1] * 70 + [2] * 10]), jnp.asarray([[0] * 50 + [1] * 70]))
            & masks.causal(),
            "dot",
        ),
    }[mask_name]
    bwd = mg.pallas_flash.PallasConfig(64, 64, 4, 2) if backward == "triton" else mg.MosaicBackward(64, 64, 2)
    config = mg.MosaicConfig(64, 64, 2, bwd)  # 2 slots for 2 key tiles

    def fn(q, k, v):
        return mg.attend(bind(q, k, v, mask=m, score=score), config=config)

    out, vjp = jax.vjp(fn, q, k, v)
    grads = vjp(do.astype(out.dtype))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref, ref_vjp = jax.vjp(lambda q, k, v: attnlab.attention_reference(q, k, v, mask=m, score=score), *f32)
    assert_close(out, ref, jnp.bfloat16)
    for g, r_ in zip(grads, ref_vjp(do), strict=True):
        assert_close(g, r_, jnp.bfloat16, "grad")
    assert (np.asarray(out[0, 100:], np.float32) != 0).any()  # rows past the padding still attend (causal)


def _export(fn, *specs):
    checks = [export.DisabledSafetyCheck.custom_call(n) for n in ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")]
    with attnlab.lowering_for("gpu"):
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*specs).mlir_module()


@pytest.mark.parametrize("mask", [None, masks.causal(), masks.window(128, 0) & masks.padding(kv_lengths=[900])])
def test_mosaic_lowers_for_cuda_to_one_mosaic_kernel_and_the_triton_backward(mask):
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)

    def fwd(q, k, v):
        return attnlab.attention(q, k, v, mask=mask, implementation="mosaic")

    def grad(q, k, v):
        return jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)

    text = _export(fwd, q, kv, kv)
    assert text.count("@mosaic_gpu_v2(") == 1 and not re.findall(r'name = "attnlab_flash_', text)
    text = _export(grad, q, kv, kv)
    assert text.count("@mosaic_gpu_v2(") == 1
    assert re.findall(r'name = "(attnlab_flash_[a-z]+)"', text) == ["attnlab_flash_dq", "attnlab_flash_dkv"]


@pytest.mark.parametrize(
    "mask, score",
    [
        (None, "dot"),
        (masks.causal(), "dot"),
        (masks.window(128, 0) & masks.padding(kv_lengths=[900]), scores.SoftCap(30.0)),
    ],
)
def test_mosaic_backward_lowers_for_cuda_to_three_mosaic_kernels(mask, score):
    """With ``MosaicBackward`` the gradient is three Mosaic GPU kernels (forward, dq, dk/dv) and no Triton:
    the lowering checks each kernel's TMA copies, layouts and wgmma operands (not its speed)."""
    mg = pytest.importorskip("attnlab.kernels.mosaic_gpu")
    q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)
    config = mg.MosaicConfig(64, 128, 2, mg.MosaicBackward(64, 64, 2))

    def grad(q, k, v):
        fwd = lambda q, k, v: mg.attend(bind(q, k, v, mask=mask, score=score), config=config)  # noqa: E731
        return jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)

    text = _export(grad, q, kv, kv)
    assert text.count("@mosaic_gpu_v2(") == 3 and not re.findall(r'name = "attnlab_flash_', text)


def test_mosaic_documents_lower_for_cuda_with_traced_ids():
    """A document mask with traced ids (packed rows): three Mosaic GPU kernels for a gradient, no Triton (the
    ids ride in one [B, 2, L] array; the schedules are refined on device from them)."""
    mg = pytest.importorskip("attnlab.kernels.mosaic_gpu")
    q = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
    config = mg.MosaicConfig(64, 128, 2)  # a Triton backward configured: documents take the Mosaic one

    def grad(q, k, v, ids):
        m = masks.document(ids) & masks.causal()
        fwd = lambda q, k, v: mg.attend(bind(q, k, v, mask=m), config=config)  # noqa: E731
        return jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)

    text = _export(grad, q, kv, kv, ids)
    assert text.count("@mosaic_gpu_v2(") == 3 and not re.findall(r'name = "attnlab_flash_', text)


def test_mosaic_backward_config_is_checked_and_tuned():
    """MosaicBackward's fields are validated; the tuning space offers it at H <= 128 and round-trips it."""
    mg = pytest.importorskip("attnlab.kernels.mosaic_gpu")
    with pytest.raises(ValueError, match="block_q_dkv"):
        mg.MosaicBackward(64, 96, 2)
    with pytest.raises(ValueError, match="backward must be"):
        mg.MosaicConfig(64, 128, 2, backward=(64, 64))
    x = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    space = MOSAIC.tunable.space(bind(x, x, x), "gpu")
    mosaic_bwd = [c for c in space if isinstance(c.backward, mg.MosaicBackward)]
    assert mosaic_bwd and all(MOSAIC.tunable.from_json(MOSAIC.tunable.to_json(c)) == c for c in space)
    x256 = jax.ShapeDtypeStruct((1, 1024, 4, 256), jnp.bfloat16)
    space256 = MOSAIC.tunable.space(bind(x256, x256, x256), "gpu")
    assert not [c for c in space256 if isinstance(c.backward, mg.MosaicBackward)]
    # the tuned candidate fits a Hopper thread block's shared memory at H = 128; a larger one does not
    assert max(mg.backward_smem_bytes(mg.MosaicBackward(64, 64, 2), 64, 128)) <= mg.SMEM_BYTES
    dq_bytes = (2 * 2 * 64 * 128 + 2 * 3 * 64 * 128) * 2 + 2 * 2 * 64 * 4  # q, do; 2 slots of k^T, v^T, k; lse, delta
    dkv_bytes = (2 * 2 * 64 * 128 + 2 * 4 * 64 * 128) * 2 + 2 * 2 * 64 * 4  # k, v; 2 slots of q, do, q^T, do^T; stats
    assert mg.backward_smem_bytes(mg.MosaicBackward(64, 64, 2), 64, 128) == (dq_bytes, dkv_bytes)
    assert max(mg.backward_smem_bytes(mg.MosaicBackward(128, 128, 3), 64, 128)) > mg.SMEM_BYTES
    big = mg.MosaicConfig(64, 128, 2, mg.MosaicBackward(128, 128, 3))
    with pytest.raises(ValueError, match="shared memory at H = 128"):  # planned for a GPU (the export's trace)
        _export(lambda q, k, v: mg.attend(bind(q, k, v), config=big), x, x, x)
    with pytest.raises(ValueError, match="H <= 128"):
        mg.attend(bind(jnp.zeros((1, 64, 1, 256), jnp.bfloat16), *(jnp.zeros((1, 64, 1, 256), jnp.bfloat16),) * 2),
                  config=mg.MosaicConfig(64, 64, 2, mg.MosaicBackward()))  # fmt: skip


def test_mosaic_supports_from_shapes():
    x = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)

    def reason(q=x, k=x, v=x, backend="gpu", **kw):
        return MOSAIC.supports(bind(q, k, v, **kw), backend)

    assert reason(mask=masks.causal() & masks.padding(kv_lengths=[10])) is None
    assert reason(score=scores.SoftCap(30.0), mask=masks.window(64, 64)) is None
    ids = jnp.zeros((1, 1024), jnp.int32)
    assert reason(mask=masks.document(ids) & masks.causal() & masks.padding(kv_lengths=[10])) is None
    h256 = jax.ShapeDtypeStruct((1, 1024, 4, 256), jnp.bfloat16)
    assert "document mask at H <= 128" in reason(h256, h256, h256, mask=masks.document(ids))
    assert "interval form" in reason(mask=masks.document(ids) & masks.document(ids))
    assert "interval form" in reason(mask=masks.chunks(64))
    assert "SoftCap only" in reason(score=positional.Alibi().score(slopes=jnp.ones(4)))
    f32 = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.float32)
    assert "dtype float32" in reason(f32, f32, f32)
    h96 = jax.ShapeDtypeStruct((1, 1024, 4, 96), jnp.bfloat16)
    assert "multiple of 64" in reason(h96, h96, h96)
    assert "Hopper GPU kernel" in reason(backend="tpu")


def test_dispatch_takes_mosaic_only_where_a_table_times_it_faster(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_TUNING_CACHE", str(tmp_path / "tuning.json"))
    x = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16)
    m = masks.window(128, 128)  # no cuDNN flag form: the next in line are mosaic and pallas
    ex = attnlab.explain(x, x, x, mask=m, backend="gpu")
    assert ex.implementation == "pallas" and "not measured faster" in ex.reason("mosaic")
    call = bind(x, x, x, mask=m)
    for impl, ms in (("mosaic", 2.0), ("pallas", 3.0)):
        config = {"pallas": {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 2}}.get(impl)
        config = config or {"block_q": 64, "block_kv": 128, "max_concurrent_steps": 2, "backward": [64, 64, 4, 2]}
        tuning.store(tuning.key_of(impl, call, "gpu", "fwd"), config, tmp_path / "tuning.json", ms=ms)
    assert attnlab.explain(x, x, x, mask=m, backend="gpu").implementation == "mosaic"
    tuning.store(tuning.key_of("pallas", call, "gpu", "fwd"), {"block_q": 64, "block_k": 64, "num_warps": 4,
                 "num_stages": 3}, tmp_path / "tuning.json", ms=1.5)  # fmt: skip
    assert attnlab.explain(x, x, x, mask=m, backend="gpu").implementation == "pallas"
