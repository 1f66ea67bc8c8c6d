"""benchmarks/fuzz.py: cases follow from their seed, every family is drawn, and a wrong kernel is caught."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlab
from benchmarks import fuzz


def test_a_case_follows_from_its_seed():
    assert fuzz.draw(123) == fuzz.draw(123)
    a, b = fuzz.build(fuzz.draw(123)), fuzz.build(fuzz.draw(123))
    for x, y in zip(a[3:], b[3:], strict=True):
        np.testing.assert_array_equal(x, y)


def test_every_family_is_drawn_and_built():
    cases = [fuzz.draw(s) for s in range(400)]
    for field, values in [
        ("mask", set(fuzz.MASK_KINDS)),
        ("score", set(fuzz.SCORE_KINDS)),
        ("implementation", set(fuzz.IMPLEMENTATIONS)),
        ("mode", set(fuzz.MODES)),
        ("dtype", {"float32", "bfloat16"}),
        ("bias", {True, False}),
    ]:
        assert {getattr(c, field) for c in cases} == values, field
    assert any(c.T != c.S for c in cases) and any(c.K < c.N for c in cases)
    for kind in fuzz.MASK_KINDS:  # each family builds a mask (its values are checked by every case's run)
        c = next(c for c in cases if c.mask == kind)
        mask = fuzz.build(c)[0]
        assert mask is None if kind == "none" else isinstance(mask, attnlab.masks.Mask), kind


def test_scaled_error():
    assert fuzz.scaled_error([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert fuzz.scaled_error([1.0, 2.5], [1.0, 2.0]) == pytest.approx(0.5 / (2.0 + fuzz.SCALE_FLOOR))
    assert fuzz.scaled_error([np.nan, 2.0], [1.0, 2.0]) == float("inf")


def _eager(implementation, score="dot", dtype="float32"):
    """The first case drawn with this implementation, score and dtype, run eagerly with a causal mask."""
    c = next(
        c
        for c in map(fuzz.draw, range(1000))
        if c.implementation == implementation and c.score == score and c.dtype == dtype and not c.bias
    )
    return dataclasses.replace(c, mode="eager", mask="causal")


def test_a_correct_kernel_passes():
    row = fuzz.check(_eager("blockwise"))
    assert row["status"] == "ok", row
    assert max(row["errors"]) < 1e-5


def test_a_wrong_kernel_is_caught():
    c = _eager("blockwise")

    def off_by_a_key(q, k, v, *, mask, **kw):  # attends one key too many: causal offset 1
        return attnlab.attention(q, k, v, mask=attnlab.masks.causal(offset=1), **kw)

    row = fuzz.check(c, attention=off_by_a_key)
    assert row["status"] == "mismatch" and max(row["errors"]) > fuzz.LIMITS["float32"], row


def test_a_crash_a_skip_and_a_changed_dtype_are_told_apart():
    c = _eager("blockwise")

    def crashes(q, k, v, **kw):
        raise IndexError("boom")

    def refuses(q, k, v, *, implementation, **kw):
        raise ValueError(f"attention: implementation={implementation!r} does not take this")

    def widens(q, k, v, **kw):
        return attnlab.attention(q, k, v, **kw).astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float16)

    assert fuzz.check(c, attention=crashes)["status"] == "crash"
    assert fuzz.check(c, attention=refuses)["status"] == "skip"
    assert fuzz.check(c, attention=widens)["status"] == "dtype"
    wrong_value_error = fuzz.check(c, attention=lambda q, k, v, **kw: (_ for _ in ()).throw(ValueError("shape")))
    assert wrong_value_error["status"] == "crash"  # a ValueError that does not name the implementation


def _dropin(implementation, dtype="float32"):
    return next(
        c
        for c in map(fuzz.draw_dropin, range(1000))
        if c.implementation == implementation and c.dtype == dtype and c.mode == "eager" and c.bias and c.mask
    )


def test_the_dropin_draws_every_broadcast_and_keyword():
    cases = [fuzz.draw_dropin(s) for s in range(300)]
    assert {c.bias for c in cases} == {c.mask for c in cases} == set(fuzz.BROADCASTS)
    for field in ("batched", "is_causal", "q_lengths", "kv_lengths"):
        assert {getattr(c, field) for c in cases} == {True, False}, field
    assert {type(c.window) for c in cases} == {type(None), int, tuple}
    c = next(c for c in cases if not c.batched and c.bias == "BNTS" and c.q_lengths)
    q, k, v, ct, kw = fuzz.build_dropin(c)
    assert q.ndim == 3 and kw["bias"].shape == (c.N, c.T, c.S) and kw["query_seq_lengths"].shape == (1,)


def test_the_dropin_equals_jax_nn_and_a_wrong_one_is_caught():
    c = _dropin("blockwise")
    row = fuzz.check_dropin(c)
    assert row["status"] == "ok" and len(row["errors"]) == 5, row  # out, dq, dk, dv, dbias

    def no_bias(q, k, v, bias, **kw):
        return attnlab.dot_product_attention(q, k, v, None, **kw)

    row = fuzz.check_dropin(c, attention=no_bias)
    assert row["status"] == "mismatch", row


def test_what_jax_nn_rejects_attnlab_must_reject():
    c = dataclasses.replace(_dropin("blockwise"), N=3, K=2)  # N % K != 0: jax.nn raises
    assert fuzz.check_dropin(c)["status"] == "skip"
    lenient = fuzz.check_dropin(c, attention=lambda q, k, v, bias, **kw: q)
    assert lenient["status"] == "lenient", lenient
