"""From this CPU host, ``jax.export`` lowers the kernels for the accelerator they are written for.

The kernels plan for the backend the trace is for (``attnlab.platform.target()``), which
``attnlab.lowering_for`` sets around an export to a platform this process lacks: exported for
``cuda`` the Pallas kernel is the Triton custom call (forward, dq and dk/dv kernels) with no
interpreter loop left in the module; exported for ``tpu`` splash is Mosaic's ``tpu_custom_call``;
exported for ``cpu`` the same code is the interpreter (loops, no custom call). Nothing here runs a
kernel, so it is fast.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import attnlab
from attnlab import masks, positional, scores
from attnlab.kernels import pallas_flash, splash

TRITON = "__gpu$xla.gpu.triton"
_ADJ = np.random.default_rng(0).random((200, 190)) < 0.05

PALLAS_MASKS = {
    "causal_traced_padding": lambda lens: masks.causal() & masks.padding(lens, lens),
    "graph_traced_kv_padding": lambda lens: masks.graph(_ADJ) & masks.padding(kv_lengths=lens),
    "chunks_or_window": lambda lens: masks.chunks(32) | masks.window(8, 8),
}


def _export(fn, platform, *specs, checks=()):
    """The StableHLO text of ``jit(fn)`` exported for ``platform``, planned for it (``attnlab.lowering_for``)."""
    with attnlab.lowering_for(platform):
        return export.export(jax.jit(fn), platforms=[platform], disabled_checks=list(checks))(*specs).mlir_module()


def _fwd_and_grad(attn, make_mask):
    def fwd(q, k, v, lens):
        return attn(q, k, v, mask=make_mask(lens))

    def grad(q, k, v, lens):
        return jax.grad(lambda *x: fwd(*x, lens).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    return fwd, grad


def _specs(B, T, S, N, K, H, dtype):
    return (
        jax.ShapeDtypeStruct((B, T, N, H), dtype),
        jax.ShapeDtypeStruct((B, S, K, H), dtype),
        jax.ShapeDtypeStruct((B, S, K, H), dtype),
        jax.ShapeDtypeStruct((B,), jnp.int32),
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("mask_name", sorted(PALLAS_MASKS))
def test_pallas_exports_the_triton_kernel_for_cuda(mask_name, dtype):
    fwd, grad = _fwd_and_grad(pallas_flash.pallas_attention, PALLAS_MASKS[mask_name])
    specs = _specs(2, 200, 190, 4, 2, 64, dtype)
    no_check = [export.DisabledSafetyCheck.custom_call(TRITON)]
    for fn, kernels in (
        (fwd, ["attnlab_flash_fwd"]),
        (grad, ["attnlab_flash_fwd", "attnlab_flash_dq", "attnlab_flash_dkv"]),
    ):
        text = _export(fn, "cuda", *specs, checks=no_check)
        assert text.count(f"@{TRITON}(") == len(kernels)
        assert re.findall(r'name = "(attnlab_flash_[a-z]+)"', text) == kernels
        assert "stablehlo.while" not in text  # no interpreter loop: the grid runs on the GPU


def _assert_three_triton_kernels(grad, specs):
    """The gradient exported for cuda is the forward, dq and dk/dv Triton kernels, with no interpreter loop."""
    no_check = [export.DisabledSafetyCheck.custom_call(TRITON)]
    text = _export(grad, "cuda", *specs, checks=no_check)
    assert re.findall(r'name = "(attnlab_flash_[a-z]+)"', text) == [
        "attnlab_flash_fwd",
        "attnlab_flash_dq",
        "attnlab_flash_dkv",
    ]
    assert "stablehlo.while" not in text


def test_pallas_exports_gqa_with_per_head_bitmaps_for_cuda():
    # G = 3 query heads per kv head and a mask that differs per head: the dk/dv kernel loops over G
    per_head = np.random.default_rng(1).random((6, 100, 90)) < 0.5
    fwd, grad = _fwd_and_grad(pallas_flash.pallas_attention, lambda lens: masks.as_mask(per_head))
    no_check = [export.DisabledSafetyCheck.custom_call(TRITON)]
    text = _export(grad, "cuda", *_specs(2, 100, 90, 6, 2, 32, jnp.bfloat16), checks=no_check)
    assert text.count(f"@{TRITON}(") == 3 and "stablehlo.while" not in text


def test_pallas_exports_soft_capped_scores_for_cuda():
    """SoftCap inside the Triton kernels (forward and both backward kernels), lowered for cuda from this CPU."""
    capped = functools.partial(pallas_flash.pallas_attention, score=scores.SoftCap(30.0))
    _, grad = _fwd_and_grad(capped, PALLAS_MASKS["causal_traced_padding"])
    _assert_three_triton_kernels(grad, _specs(2, 200, 190, 4, 2, 64, jnp.bfloat16))


def test_pallas_exports_score_mods_with_array_gradients_for_cuda():
    """ALiBi as a ScoreMod (per-head slopes, traced) in all three Triton kernels; the slopes' gradient
    comes from the dq kernel's per-program shares, so the grad of (q, k, v, slopes) is still 3 kernels."""

    def grad(q, k, v, lens, slopes):
        def loss(q, k, v, slopes):
            score = positional.Alibi().score(slopes=slopes)
            out = pallas_flash.pallas_attention(q, k, v, mask=PALLAS_MASKS["causal_traced_padding"](lens), score=score)
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, slopes)

    specs = (*_specs(2, 200, 190, 4, 2, 64, jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.float32))
    _assert_three_triton_kernels(grad, specs)


@pytest.mark.parametrize("w_shape", [(4, 64), (64,)], ids=["per_head_w", "shared_w"])
def test_pallas_exports_additive_scores_for_cuda(w_shape):
    """Additive (tanh) scores in the Triton kernels: the one-head pair form (a loop over the head dim of
    [bq, bk] tiles) lowers for cuda, forward and both backward kernels, with w's gradient from dq's shares."""

    def grad(q, k, v, lens, w):
        def loss(q, k, v, w):
            mask = PALLAS_MASKS["causal_traced_padding"](lens)
            out = pallas_flash.pallas_attention(q, k, v, mask=mask, score=scores.Additive(w))
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, w)

    specs = (*_specs(2, 200, 190, 4, 2, 64, jnp.bfloat16), jax.ShapeDtypeStruct(w_shape, jnp.float32))
    _assert_three_triton_kernels(grad, specs)


def test_pallas_exports_the_interpreter_for_cpu():
    fwd, _ = _fwd_and_grad(pallas_flash.pallas_attention, PALLAS_MASKS["causal_traced_padding"])
    text = _export(fwd, "cpu", *_specs(1, 40, 40, 2, 1, 16, jnp.float32))
    assert TRITON not in text and "stablehlo.while" in text


def test_attention_dispatch_exports_the_pallas_kernel_for_cuda():
    from attnlab.attention import attention  # noqa: PLC0415

    q = jnp.zeros((1, 64, 2, 16), jnp.bfloat16)
    no_check = [export.DisabledSafetyCheck.custom_call(TRITON)]
    text = _export(
        lambda q: attention(q, q, q, mask=masks.causal(), implementation="pallas"), "cuda", q, checks=no_check
    )
    assert f"@{TRITON}(" in text


SPLASH_MASKS = {
    "causal_traced_padding": lambda lens: masks.causal() & masks.padding(lens, lens),
    "window": lambda lens: masks.window(64, 0),
    "bigbird_adapter": lambda lens: masks.bigbird(256, block_size=64, num_random=1),
}


@pytest.mark.parametrize("mask_name", sorted(SPLASH_MASKS))
def test_splash_exports_mosaic_for_tpu(mask_name):
    fwd, grad = _fwd_and_grad(splash.splash_attention, SPLASH_MASKS[mask_name])
    specs = _specs(2, 256, 256, 4, 2, 128, jnp.bfloat16)
    text = _export(fwd, "tpu", *specs)
    assert text.count("@tpu_custom_call(") == 1 and "stablehlo.while" not in text
    text = _export(grad, "tpu", *specs)
    assert text.count("@tpu_custom_call(") == 3  # forward, dq and dk/dv kernels
    assert "stablehlo.while" not in text
