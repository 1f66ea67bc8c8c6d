"""attnlab.dot_product_attention against jax.nn.dot_product_attention itself, on the CPU.

jax's own test cases for dot_product_attention (tests/nn_test.py upstream: GQA with and without vmap,
the mask modes, the bias gradient) are ported here with jax's shapes and tolerances (bf16 / fp16,
atol = rtol = 0.01 for outputs, 0.02 for dq/dk/dbias); the fp32 variants use attnlab's table
(attnlab.testing). The bf16 cases run through attnlab's automatic choice and through the blockwise
kernel, so both the adapter and a tiled kernel are held to jax.nn. Then: every argument jax.nn rejects,
the empty-row conventions, attnlab's extras (mask objects, scores), jit and the residual.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import brute_layout, compare, fwd_and_grads, np_attention

import attnlab
from attnlab import masks, scores, testing
from attnlab.dropin import ArrayMask

JAX_OUT = dict(atol=0.01, rtol=0.01)  # jax's tolerances in nn_test.py (16-bit inputs)
JAX_GRAD = dict(atol=0.02, rtol=0.02)


def _tols(dtype):
    if jnp.dtype(dtype) == jnp.float32:
        return testing.tolerance(dtype), testing.tolerance(dtype, "grad")
    return JAX_OUT, JAX_GRAD


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _jax_nn_inputs(*xs):
    """jax.nn's inputs: as they are, but fp16 upcast to fp32 (jax.nn asks XLA:CPU for an F16_F16_F32 dot,
    which it does not have; attnlab computes fp16 in fp32 there too)."""
    cpu = jax.default_backend() == "cpu"
    return tuple(x.astype(jnp.float32) if cpu and x is not None and x.dtype == jnp.float16 else x for x in xs)


# ------------------------------------------------------------------------------------------
# jax's cases


@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(
    "dtype, implementation",
    [(jnp.bfloat16, None), (jnp.bfloat16, "blockwise"), (jnp.float16, None), (jnp.float32, None)],
)
def test_gqa_against_jax_nn_with_repeated_heads(dtype, implementation, group, use_vmap):
    """GQA/MQA (K = N / G key heads) equals jax.nn on the keys repeated to N heads; dk, dv summed per group."""
    B, T, S, N, H = 2, 128, 128, 4, 32
    ks = jax.random.split(jax.random.key(0), 4)
    q = _normal(ks[0], (B, T, N, H), dtype)
    k = _normal(ks[1], (B, S, N // group, H), dtype)
    v = _normal(ks[2], (B, S, N // group, H), dtype)
    ours = functools.partial(attnlab.dot_product_attention, implementation=implementation)
    if use_vmap:  # the batch mapped away: [T, N, H] per call
        ours = jax.vmap(ours)
    out, (dq, dk, dv) = fwd_and_grads(ours, q, k, v)
    k_rep, v_rep = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    ref, (dq_r, dk_r, dv_r) = fwd_and_grads(jax.nn.dot_product_attention, *_jax_nn_inputs(q, k_rep, v_rep))
    dk_r = dk_r.astype(jnp.float32).reshape(B, S, N // group, group, H).sum(3)
    dv_r = dv_r.astype(jnp.float32).reshape(B, S, N // group, group, H).sum(3)
    out_tol, grad_tol = _tols(dtype)
    assert out.dtype == dtype and out.shape == q.shape
    compare(out, ref, out_tol)
    compare(dq, dq_r, grad_tol)
    compare(dk, dk_r, grad_tol)
    compare(dv, dv_r, grad_tol)


MASK_MODES = [
    ("bias",),
    ("causal",),
    ("padding",),
    ("custom",),
    ("causal", "padding"),
    ("custom", "padding"),
    ("bias", "causal"),
    ("causal", "sliding_window"),
    ("sliding_window",),
    ("causal", "checkerboard"),
]


def _mask_case(mode, dtype, B=2, T=128, S=128, N=4, H=32):
    ks = jax.random.split(jax.random.key(0), 5)
    q, k, v = (_normal(ks[i], (B, n, N, H), dtype) for i, n in enumerate((T, S, S)))
    bias = _normal(ks[4], (1, N, T, S), dtype) if "bias" in mode else None
    mask = None
    if "custom" in mode:  # a causal mask given as an array
        mask = jnp.tril(jnp.ones((T, S), bool))[None, None]
    if "checkerboard" in mode:  # differs from causal, so causal and the mask must both apply
        mask = ((jnp.arange(T)[:, None] + jnp.arange(S)[None, :]) % 2 == 0)[None, None]
    kw = dict(is_causal="causal" in mode)
    if "padding" in mode:
        kw.update(
            query_seq_lengths=jnp.array([T // 2, T // 4], jnp.int32),
            key_value_seq_lengths=jnp.array([S // 4, S // 2], jnp.int32),
        )
    if "sliding_window" in mode:
        kw["local_window_size"] = (3, 2) if "causal" in mode else (3, 0)
    return (q, k, v, bias, mask), kw


@pytest.mark.parametrize(
    "dtype, implementation", [(jnp.bfloat16, None), (jnp.bfloat16, "blockwise"), (jnp.float32, None)]
)
@pytest.mark.parametrize("mode", MASK_MODES, ids=["+".join(m) for m in MASK_MODES])
def test_mask_modes_against_jax_nn(mode, dtype, implementation):
    """Bias, causal, lengths, a mask array, windows and their combinations: outputs and dq, dk, dv, dbias."""
    args, kw = _mask_case(mode, dtype)
    ours = functools.partial(attnlab.dot_product_attention, implementation=implementation, **kw)
    theirs = functools.partial(jax.nn.dot_product_attention, **kw)
    diff = (0, 1, 2, 3) if args[3] is not None else (0, 1, 2)

    def split(fn):  # differentiate q, k, v (and the bias); the mask is not differentiable
        def f(*xs):
            full = list(args)
            for i, x in zip(diff, xs, strict=True):
                full[i] = x
            return fn(*full)

        return f

    out, grads = fwd_and_grads(split(ours), *(args[i] for i in diff))
    ref, grads_ref = fwd_and_grads(split(theirs), *(args[i] for i in diff))
    out_tol, grad_tol = _tols(dtype)
    compare(out, ref, out_tol)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        compare(g, g_ref, grad_tol)


@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("batch", [1, 16])
def test_bias_gradient_against_jax_nn(batch, use_vmap):
    """Self-attention x = q = k = v with a [B, N, S, S] bias and a rank-3 all-True mask: y and dbias."""
    B, S, N, H = batch, 128, 4, 32
    ks = jax.random.split(jax.random.key(0), 2)
    x = _normal(ks[0], (B, S, N, H), jnp.bfloat16)
    bias = _normal(ks[1], (B, N, S, S), jnp.bfloat16)
    mask = jnp.ones((1, 1, S), bool)

    def attention(fn, x, bias, mask):
        return fn(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

    ours = functools.partial(attention, attnlab.dot_product_attention)
    theirs = functools.partial(attention, jax.nn.dot_product_attention)
    if use_vmap:
        ours, theirs = jax.vmap(ours, in_axes=(0, 0, None)), jax.vmap(theirs, in_axes=(0, 0, None))
    compare(jax.jit(ours)(x, bias, mask), jax.jit(theirs)(x, bias, mask), JAX_OUT)

    def dbias(fn):
        return jax.jit(lambda x, b: jax.vjp(lambda b: fn(x, b, mask), b)[1](x)[0])

    compare(dbias(ours)(x, bias), dbias(theirs)(x, bias), dict(atol=0.1, rtol=0.1))  # jax's tolerance here


# ------------------------------------------------------------------------------------------
# shapes jax.nn takes that the cases above do not cover


def _np_allowed(T, S, B, kw):
    """The [B, T, S] pairs jax.nn's is_causal / local_window_size / lengths allow, written out in numpy."""
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    ok = np.ones((B, T, S), bool)
    if kw.get("is_causal"):
        ok &= s <= t
    w = kw.get("local_window_size")
    if w is not None:
        left, right = (w, w) if isinstance(w, int) else w
        ok &= (s >= t - left) & (s <= t + right)
    if "key_value_seq_lengths" in kw:
        ok &= s[None] < np.asarray(kw["key_value_seq_lengths"])[:, None, None]
    return ok


@pytest.mark.parametrize(
    "shape_q, shape_kv, kw",
    [
        ((6, 4, 8), (9, 2, 8), dict()),  # [T, N, H], cross-attention T != S, GQA
        ((6, 4, 8), (9, 2, 8), dict(is_causal=True)),  # top-left aligned: key s <= query t
        ((2, 9, 2, 8), (2, 6, 1, 8), dict(is_causal=True, local_window_size=1)),  # one int: (1, 1); rows 7, 8 empty
        ((1, 64, 2, 16), (1, 64, 2, 16), dict(local_window_size=(-3, 7))),  # a window that excludes t itself
        ((1, 64, 2, 16), (1, 64, 2, 16), dict(local_window_size=(5, -2))),
        ((1, 16, 2, 8), (1, 16, 2, 8), dict(local_window_size=(-3, 1))),  # left + right < 0: every row empty
        ((2, 5, 1, 4), (2, 7, 1, 4), dict(scale=0.3, key_value_seq_lengths=jnp.array([7, -2], jnp.int32))),
        ((2, 5, 1, 4), (2, 7, 1, 4), dict(is_causal=True, key_value_seq_lengths=jnp.array([0, 3], jnp.int32))),
    ],
)
@pytest.mark.parametrize("implementation", [None, "xla", "blockwise"])
def test_shapes_windows_and_lengths_against_jax_nn(shape_q, shape_kv, kw, implementation):
    """3-D inputs, T != S, one-int and negative windows, zero and negative lengths: out and grads.

    The rows with no key (from the structure, written out in numpy) are jax.nn's mean with
    empty_rows="mean", zeros with zero gradients by default; the other rows are jax.nn's either way."""
    ks = jax.random.split(jax.random.key(3), 3)
    q = _normal(ks[0], shape_q, jnp.float32)
    k, v = _normal(ks[1], shape_kv, jnp.float32), _normal(ks[2], shape_kv, jnp.float32)
    B = shape_q[0] if len(shape_q) == 4 else 1
    empty = ~_np_allowed(shape_q[-3], shape_kv[-3], B, kw).any(-1).reshape(shape_q[:-2])  # [B, T] or [T]
    keep = jnp.asarray(~empty)[..., None, None]
    ref, grads_ref = fwd_and_grads(functools.partial(jax.nn.dot_product_attention, **kw), q, k, v)
    _, grads_ref_kept = fwd_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw) * keep, q, k, v)
    for convention, expected_grads in (("mean", grads_ref), ("zeros", grads_ref_kept)):
        ours = functools.partial(
            attnlab.dot_product_attention, implementation=implementation, empty_rows=convention, **kw
        )
        out, grads = fwd_and_grads(ours, q, k, v)
        assert out.shape == q.shape
        expected = ref if convention == "mean" else jnp.where(keep, ref, 0.0)
        compare(out, expected, testing.tolerance(jnp.float32))
        if convention == "zeros":
            assert np.all(np.asarray(out)[empty] == 0)
        for g, g_ref in zip(grads, expected_grads, strict=True):
            compare(g, g_ref, testing.tolerance(jnp.float32, "grad"))


def test_small_dense_calls_run_attnlabs_dense_program():
    """At dense XLA's size attnlab runs jax.nn's program written out (impls.xla): outputs and gradients equal to
    jax.nn's, whatever the structure (is_causal, windows, a mask array)."""
    from attnlab import dropin

    q, k, v = _x(2, 16, 2, 8), _x(2, 16, 2, 8), _x(2, 16, 2, 8)
    for kw in (
        {},
        dict(is_causal=True),
        dict(is_causal=True, local_window_size=(3, 2)),
        dict(mask=jnp.asarray(np.random.default_rng(0).random((2, 1, 16, 16)) > 0.2)),
    ):
        assert dropin.explain(q, k, v, **kw).implementation == "xla"
        ours = fwd_and_grads(lambda q, k, v, kw=kw: attnlab.dot_product_attention(q, k, v, **kw), q, k, v)
        theirs = fwd_and_grads(lambda q, k, v, kw=kw: jax.nn.dot_product_attention(q, k, v, **kw), q, k, v)
        compare(ours[0], theirs[0], testing.tolerance(jnp.float32))
        for a, b in zip(ours[1], theirs[1], strict=True):
            compare(a, b, testing.tolerance(jnp.float32, "grad"))


def _products(f, *args):
    """The dot_general lines of ``f``'s lowering, operand shapes and dimension numbers (names dropped)."""
    import re

    text = jax.jit(f).lower(*args).as_text()
    return [re.sub(r"%[\w#.]+", "", line).strip() for line in text.splitlines() if "dot_general" in line]


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_dense_program_has_jax_nns_products_beyond_the_fused_size(kv_heads):
    """Beyond ``FUSED_MAX_ROWS`` query rows, and with several query heads per key head at any size, the dense
    program's two products are jax.nn's: it maps over the group as jax.nn does. (Skipping the map made
    XLA:CPU fuse both products and the softmax into one kernel, 3.29x slower at B = 4, T = 256, 8 heads.)"""
    from attnlab.impls import xla

    T = xla.FUSED_MAX_ROWS // 32 + 8  # 4 x 8 x T query rows: past the fused size
    q, k = _x(4, T, 8, 16), _x(4, T, kv_heads, 16)
    assert xla.dense_form(4, 8, kv_heads, T, T, 16, "cpu") == "mapped"
    ours = _products(lambda q, k, v: attnlab.attention(q, k, v, implementation="xla"), q, k, k)
    theirs = _products(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"), q, k, k)
    assert len(ours) == 2 and ours == theirs


def test_dense_form_rule():
    """``xla.dense_form``: key-major for few query rows over many keys, fused for one query head per key head,
    two or more batch rows and at most FUSED_MAX_ROWS query rows, else jax.nn's mapped program; on the CPU
    only."""
    from attnlab.impls import xla

    rows = xla.FUSED_MAX_ROWS
    assert xla.dense_form(2, 4, 4, rows // 8, 16, 64, "cpu") == "fused"
    assert xla.dense_form(2, 4, 4, rows // 8 + 1, 16, 64, "cpu") == "mapped"
    assert xla.dense_form(2, 4, 1, 16, 16, 64, "cpu") == "mapped"
    assert xla.dense_form(1, 4, 4, 16, 16, 64, "cpu") == "mapped"
    (t1, size1), (t2, size2) = xla.KEY_MAJOR_SIZES
    assert xla.dense_form(1, 8, 2, t1, size1 // 128, 64, "cpu") == "key_major"  # k: 1 x S x 2 x 64, GQA too
    assert xla.dense_form(1, 8, 2, t1, size1 // 128 - 1, 64, "cpu") == "mapped"  # one key short
    assert xla.dense_form(2, 8, 8, t1, size1 // 1024 - 1, 64, "cpu") == "fused"  # few keys: the arrays stay in cache
    assert xla.dense_form(1, 8, 8, t2, size2 // 512, 64, "cpu") == "key_major"
    assert xla.dense_form(1, 8, 8, t2, size1 // 512, 64, "cpu") == "mapped"  # T = 4 needs the larger k
    assert xla.dense_form(1, 8, 8, t2 + 1, 2**20, 64, "cpu") == "mapped"
    for backend in ("gpu", "tpu"):
        assert xla.dense_form(2, 4, 4, 16, 16, 64, backend) == "mapped"
        assert xla.dense_form(8, 8, 8, 1, 8192, 64, backend) == "mapped"


@pytest.mark.parametrize("form", ["fused", "mapped", "key_major"])
def test_dense_forms_give_jax_nns_results(form):
    """Each form has jax.nn's outputs and gradients (the fused and key-major forms lower to other products
    than the mapped one); the key-major form with several query heads per key head, a bias and a mask with
    a row it empties (zeros, zero dq) too; ``form="fused"`` with several query heads per key head and an
    unknown form are ValueErrors."""
    from attnlab.impls import xla

    f = functools.partial(xla.dense_attention, form=form)
    q, k, v = (jax.random.normal(jax.random.key(i), (2, t, 4, 8)) for i, t in enumerate((3, 16, 16)))
    if form != "mapped":
        assert _products(f, q, k, v) != _products(functools.partial(xla.dense_attention, form="mapped"), q, k, v)
    theirs = fwd_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), q, k, v)
    ours = fwd_and_grads(f, q, k, v)
    compare(ours[0], theirs[0], testing.tolerance(jnp.float32))
    for a, b in zip(ours[1], theirs[1], strict=True):
        compare(a, b, testing.tolerance(jnp.float32, "grad"))
    if form == "fused":
        with pytest.raises(ValueError, match="form='fused' needs one query head per key head"):
            f(q, k[:, :, :1], v[:, :, :1])
        with pytest.raises(ValueError, match="form must be one of"):
            xla.dense_attention(q, k, v, form="dense")
        return
    kg, vg = k[:, :, :2], v[:, :, :2]  # 2 query heads per key head
    bias = jax.random.normal(jax.random.key(7), (1, 4, 3, 16))
    allowed = (jax.random.uniform(jax.random.key(8), (2, 4, 3, 16)) < 0.5).at[1, 2, 0].set(False)
    empty = ~jnp.any(allowed, axis=-1, keepdims=True)
    ours = fwd_and_grads(lambda q, k, v: f(q, k, v, bias, allowed, empty), q, kg, vg)
    theirs = fwd_and_grads(lambda q, k, v: attnlab.attention_reference(q, k, v, bias=bias, mask=allowed), q, kg, vg)
    compare(ours[0], theirs[0], testing.tolerance(jnp.float32))
    for a, b in zip(ours[1], theirs[1], strict=True):
        compare(a, b, testing.tolerance(jnp.float32, "grad"))
    assert not np.asarray(ours[0])[1, 0, 2].any() and not np.asarray(ours[1][0])[1, 0, 2].any()


def test_a_nan_in_one_key_head_on_the_dense_forms():
    """docs/conventions.md, "Non-finite keys and values": jax.nn's mapped form keeps a NaN in key head 1 to
    query heads 2 and 3; the key-major form's one product takes it to every head's rows that see the key
    (k) or to every row (v); a key the mask excludes stays hidden on both."""
    from attnlab.impls import xla

    q, k, v = (
        jax.random.normal(jax.random.key(i), (1, t, n, 8)) for i, (t, n) in enumerate(((1, 4), (16, 2), (16, 2)))
    )
    allowed = jnp.ones((1, 1, 1, 16), bool).at[..., 5].set(False)
    cases = {
        "k, a key seen": (k.at[0, 3, 1].set(jnp.nan), v, [False, False, True, True], [True] * 4),
        "k, a key excluded": (k.at[0, 5, 1].set(jnp.nan), v, [False] * 4, [False] * 4),
        "v, a key seen": (k, v.at[0, 3, 1].set(jnp.nan), [False, False, True, True], [True] * 4),
    }
    for name, (kn, vn, mapped, key_major) in cases.items():
        for form, want in (("mapped", mapped), ("key_major", key_major)):
            out = xla.dense_attention(q, kn, vn, None, allowed, None, form=form)
            assert np.isnan(np.asarray(out))[0, 0].any(-1).tolist() == want, (name, form)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_decoding_step_runs_key_major_and_matches_the_reference(dtype):
    """A decoding step's shape (one query row, k of KEY_MAJOR_SIZES' first size, two query heads per key head)
    takes the key-major form through ``attnlab.attention(implementation="xla")``, with a traced padding mask
    that empties one batch row: the reference's outputs and gradients, zeros on the empty row."""
    from attnlab.impls import xla

    B, N, K, H = 2, 8, 4, 64
    S = xla.KEY_MAJOR_SIZES[0][1] // (B * K * H)
    assert xla.dense_form(B, N, K, 1, S, H, "cpu") == "key_major"
    q, k, v = (
        jax.random.normal(jax.random.key(i), (B, t, n, H)).astype(dtype)
        for i, (t, n) in enumerate(((1, N), (S, K), (S, K)))
    )
    lengths = jnp.array([S // 3, 0])

    def ours(q, k, v, lengths):
        return attnlab.attention(q, k, v, mask=masks.padding(kv_lengths=lengths), implementation="xla")

    def ref(q, k, v):
        return attnlab.attention_reference(q, k, v, mask=masks.padding(kv_lengths=lengths))

    out, grads = fwd_and_grads(jax.jit(ours), q, k, v, lengths)
    out_r, grads_r = fwd_and_grads(ref, q, k, v)
    compare(out, out_r, testing.tolerance(dtype))
    for a, b in zip(grads[:3], grads_r, strict=True):
        compare(a, b, testing.tolerance(dtype, "grad"))
    assert not np.asarray(out, np.float32)[1].any() and not np.asarray(grads[0], np.float32)[1].any()


def test_empty_rows_mean_with_a_mask_array_matches_jax_nn():
    """empty_rows="mean" with a mask array (at dense XLA's size): jax.nn's outputs and gradients, rows the mask
    empties included (the mean of the values, as jax.nn)."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32) for _ in range(3))
    mask = np.asarray(rng.random((2, 1, 16, 16)) > 0.3)
    mask[1, 0, 5] = False  # an empty row
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([16, 9], jnp.int32))

    def loss(fn, **extra):
        return jax.jit(jax.value_and_grad(
            lambda q, k, v, m: jnp.sum(fn(q, k, v, mask=m, **kw, **extra) ** 2), argnums=(0, 1, 2)
        ))  # fmt: skip

    ours, peer = loss(attnlab.dot_product_attention, empty_rows="mean"), loss(jax.nn.dot_product_attention)
    args = (q, k, v, jnp.asarray(mask))
    (l_ours, g_ours), (l_peer, g_peer) = ours(*args), peer(*args)
    compare(l_ours, l_peer, testing.tolerance(jnp.float32))
    for a, b in zip(g_ours, g_peer, strict=True):
        compare(a, b, testing.tolerance(jnp.float32, "grad"))
    out = attnlab.dot_product_attention(q, k, v, mask=jnp.asarray(mask), empty_rows="mean")
    compare(out[1, 5], v[1].mean(0), testing.tolerance(jnp.float32))


NO_STRUCTURE = dict(is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None)


def test_jit_with_traced_lengths_and_mask_compiles_once():
    """Lengths and a mask array are traced under jit: new values reuse the program and equal jax.nn."""
    args, kw = _mask_case(("custom", "padding"), jnp.float32, T=32, S=32)
    q, k, v, _, mask = args
    traces = []

    @jax.jit
    def f(q, k, v, mask, ql, kl):
        traces.append(1)
        return attnlab.dot_product_attention(q, k, v, mask=mask, query_seq_lengths=ql, key_value_seq_lengths=kl)

    for ql, kl in (([16, 8], [8, 16]), ([32, 3], [1, 32])):
        ql, kl = jnp.array(ql, jnp.int32), jnp.array(kl, jnp.int32)
        ref = jax.nn.dot_product_attention(q, k, v, mask=mask, query_seq_lengths=ql, key_value_seq_lengths=kl)
        compare(f(q, k, v, mask, ql, kl), ref, testing.tolerance(jnp.float32))
    assert len(traces) == 1


def test_return_residual_matches_jax_nn():
    """The log-sum-exp [B, T, N] in the key's dtype, without gradient; empty rows by convention."""
    args, kw = _mask_case(("causal", "padding"), jnp.float32, T=16, S=16)
    q, k, v, _, _ = args
    kw["key_value_seq_lengths"] = jnp.array([0, 5], jnp.int32)  # example 0: every row empty
    out, lse = attnlab.dot_product_attention(q, k, v, return_residual=True, empty_rows="mean", **kw)
    ref, lse_ref = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
    compare(out, ref, testing.tolerance(jnp.float32))
    assert lse.shape == lse_ref.shape == (2, 16, 4) and lse.dtype == lse_ref.dtype
    compare(lse, lse_ref, testing.tolerance(jnp.float32))  # the empty rows too: jax.nn's fill value
    _, lse0 = attnlab.dot_product_attention(q, k, v, return_residual=True, implementation="xla", **kw)
    valid = np.asarray(jnp.arange(16)[None, :] < kw["query_seq_lengths"][:, None]) & np.array([[False], [True]])
    np.testing.assert_allclose(np.asarray(lse0)[valid], np.asarray(lse_ref)[valid], rtol=2e-5)
    assert np.all(np.asarray(lse0)[~valid] == -np.inf)  # attnlab's convention: -inf on an empty row
    g = jax.grad(lambda q: attnlab.dot_product_attention(q, k, v, return_residual=True, **kw)[1].sum())(q)
    assert not np.any(np.asarray(g))  # no gradient through the residual, as jax.nn


# ------------------------------------------------------------------------------------------
# empty rows: attnlab's zeros, or jax.nn's mean


@pytest.mark.parametrize("implementation", [None, "blockwise", "xla", "reference"])
def test_empty_rows_zeros_and_mean(implementation):
    """A mask row of all False: zeros and zero gradients by default; jax.nn's mean of the values (and
    its gradient) with empty_rows="mean". Rows with a key are jax.nn's either way."""
    B, T, S, N, K, H = 2, 8, 6, 4, 2, 8
    ks = jax.random.split(jax.random.key(5), 3)
    q = _normal(ks[0], (B, T, N, H), jnp.float32)
    k, v = _normal(ks[1], (B, S, K, H), jnp.float32), _normal(ks[2], (B, S, K, H), jnp.float32)
    mask = np.ones((B, 1, T, S), bool)
    mask[0, :, 2] = False  # example 0, query 2: no key
    mask[1, :, 5:] = False  # example 1, queries 5..7: no key
    empty = ~mask.any(-1)[:, 0]  # [B, T]
    mask = jnp.asarray(mask)
    ref, grads_ref = fwd_and_grads(functools.partial(jax.nn.dot_product_attention, mask=mask), q, k, v)
    for convention in ("zeros", "mean"):
        fn = functools.partial(
            attnlab.dot_product_attention, mask=mask, implementation=implementation, empty_rows=convention
        )
        out, grads = fwd_and_grads(fn, q, k, v)
        tol = testing.tolerance(jnp.float32)
        compare(np.asarray(out)[~empty], np.asarray(ref)[~empty], tol)
        if convention == "zeros":
            assert np.all(np.asarray(out)[empty] == 0)
            keep = jnp.asarray(~empty)[..., None, None]
            _, grads_alone = fwd_and_grads(lambda q, k, v, fn=fn, keep=keep: fn(q, k, v) * keep, q, k, v)
            for g, g_alone in zip(grads, grads_alone, strict=True):  # the empty rows pass no gradient
                compare(g, g_alone, testing.tolerance(jnp.float32, "grad"))
        else:  # jax.nn: uniform over all S keys = each query head's key-head mean of the values
            mean = np.repeat(np.asarray(v).mean(1), N // K, axis=1)  # [B, N, H]
            compare(np.asarray(out)[empty], np.broadcast_to(mean[:, None], out.shape)[empty], tol)
            compare(out, ref, tol)
            for g, g_ref in zip(grads, grads_ref, strict=True):
                compare(g, g_ref, testing.tolerance(jnp.float32, "grad"))


def test_neg_inf_bias_row_is_zeros_where_jax_nn_is_nan():
    """A row emptied by -inf biases: jax.nn gives NaN; attnlab zeros (or the mean with empty_rows="mean")."""
    q = k = v = _normal(jax.random.key(0), (1, 4, 2, 8), jnp.float32)
    bias = jnp.zeros((1, 1, 4, 4)).at[0, 0, 1].set(-jnp.inf)
    assert np.isnan(np.asarray(jax.nn.dot_product_attention(q, k, v, bias=bias))[0, 1]).all()
    out = attnlab.dot_product_attention(q, k, v, bias=bias)
    assert np.all(np.asarray(out)[0, 1] == 0) and np.isfinite(np.asarray(out)).all()
    mean = attnlab.dot_product_attention(q, k, v, bias=bias, empty_rows="mean")
    compare(mean[0, 1], v[0].mean(0), testing.tolerance(jnp.float32))


# ------------------------------------------------------------------------------------------
# attnlab's extras


def test_attnlab_mask_object_equals_its_dense_array():
    """mask= takes an attnlab mask (documents & causal, a predicate): the same as jax.nn given its dense form."""
    B, T, N, H = 2, 64, 2, 16
    q, k, v = (_normal(kk, (B, T, N, H), jnp.float32) for kk in jax.random.split(jax.random.key(1), 3))
    ids = jnp.array([[0] * 20 + [1] * 30 + [2] * 14, [0] * 64])
    m = masks.document(ids) & masks.causal()
    dense = jnp.broadcast_to(m.dense(T, T), (B, 1, T, T))
    ref, grads_ref = fwd_and_grads(functools.partial(jax.nn.dot_product_attention, mask=dense), q, k, v)
    for implementation in (None, "blockwise"):
        out, grads = fwd_and_grads(
            functools.partial(attnlab.dot_product_attention, mask=m, implementation=implementation), q, k, v
        )
        compare(out, ref, testing.tolerance(jnp.float32))
        for g, g_ref in zip(grads, grads_ref, strict=True):
            compare(g, g_ref, testing.tolerance(jnp.float32, "grad"))


def test_score_keyword_softcap_against_numpy():
    """score=scores.SoftCap(cap): logits cap * tanh(s / cap) of the scaled dot product, with is_causal."""
    q, k, v = (_normal(kk, (1, 12, 2, 8), jnp.float32) * 4 for kk in jax.random.split(jax.random.key(2), 3))
    cap = 2.0
    out = attnlab.dot_product_attention(q, k, v, is_causal=True, score=scores.SoftCap(cap))
    qf, kf = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = np.einsum("btnh,bsnh->bnts", qf, kf) / np.sqrt(8)
    expected, _ = np_attention(q, k, v, mask=np.tril(np.ones((12, 12), bool)), logits=cap * np.tanh(s / cap))
    np.testing.assert_allclose(np.asarray(out), expected, **testing.tolerance(jnp.float32))
    with pytest.raises(ValueError, match="scale"):
        attnlab.dot_product_attention(q, k, v, scale=0.5, score=scores.SoftCap(cap))


def test_implementation_names():
    """jax.nn's 'xla' is jax.nn's computation (equal to it); attnlab's names and sequences are accepted;
    'cudnn' on a CPU says why not."""
    args, kw = _mask_case(("causal",), jnp.float32, T=16, S=16)
    q, k, v = args[:3]
    ref = jax.nn.dot_product_attention(q, k, v, **kw)
    np.testing.assert_array_equal(attnlab.dot_product_attention(q, k, v, implementation="xla", **kw), ref)
    for impl in ("reference", "blockwise", ("sparse", "blockwise")):
        compare(attnlab.dot_product_attention(q, k, v, implementation=impl, **kw), ref, testing.tolerance(jnp.float32))
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="implementation='cudnn'"):
            attnlab.dot_product_attention(q, k, v, implementation="cudnn", **kw)


def test_array_mask_runtime_layout_is_the_brute_layout():
    """ArrayMask's on-device layout of a traced array equals the layout by definition (EMPTY/FULL only when certain)."""
    rng = np.random.default_rng(0)
    a = np.zeros((2, 1, 20, 13), bool)
    a[0, :, :8, :5] = True  # full tiles in example 0 only
    a[1, :, :8, :5] = True
    a[:, :, 12:, 7:] = rng.random((2, 1, 8, 6)) < 0.5
    got = jax.jit(lambda x: ArrayMask(x).runtime_layout(20, 13, 4, 5))(jnp.asarray(a))
    np.testing.assert_array_equal(np.asarray(got), brute_layout(a, 20, 13, 4, 5))
    assert ArrayMask(a).runtime_layout(20, 13, 4, 5) is None  # concrete: the static layout is exact
    np.testing.assert_array_equal(ArrayMask(a).block_layout(20, 13, 4, 5), brute_layout(a, 20, 13, 4, 5))


@pytest.mark.slow
def test_window_at_4k_is_not_dense():
    """local_window_size at T = 4096 runs tiled: XLA's temporary buffers stay far below the dense [T, S]
    logits (64 MiB for one head), forward and backward, where jax.nn's hold them (and more)."""
    T = 4096
    x = jax.ShapeDtypeStruct((1, T, 1, 16), jnp.float32)

    def temp_bytes(fn):
        loss = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))
        return loss.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    ours = temp_bytes(functools.partial(attnlab.dot_product_attention, local_window_size=(128, 128)))
    theirs = temp_bytes(functools.partial(jax.nn.dot_product_attention, local_window_size=(128, 128)))
    assert ours < T * T * 4 / 8 < theirs, (ours, theirs)


# ------------------------------------------------------------------------------------------
# what jax.nn rejects is rejected, naming the argument


def _x(*shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


REJECTED = {
    "query rank 5": (dict(query=_x(1, 2, 4, 2, 8), key=_x(1, 2, 4, 2, 8), value=_x(1, 2, 4, 2, 8)), "query"),
    "value shape": (dict(value=_x(2, 4, 2, 16)), "value"),
    "value dtype": (dict(value=_x(2, 4, 2, 8, dtype=jnp.bfloat16)), "value"),
    "query batch": (dict(query=_x(3, 4, 2, 8)), "query"),
    "query head dim": (dict(query=_x(2, 4, 2, 4)), "query"),
    "query dtype": (dict(query=_x(2, 4, 2, 8, dtype=jnp.float16)), "query"),
    "heads not a multiple": (dict(query=_x(2, 4, 3, 8)), "query heads"),
    "int mask": (dict(mask=jnp.ones((1, 1, 4, 4), jnp.int32)), "mask"),
    "float mask": (dict(mask=jnp.ones((1, 1, 4, 4))), "mask"),
    "mask rank 5": (dict(mask=jnp.ones((1, 1, 1, 4, 4), bool)), "mask"),
    "mask heads 3": (dict(mask=jnp.ones((1, 3, 4, 4), bool), query=_x(2, 4, 6, 8)), "mask"),
    "bias rank 5": (dict(bias=_x(1, 1, 1, 4, 4)), "bias"),
    "bias heads 3": (dict(bias=_x(1, 3, 4, 4), query=_x(2, 4, 6, 8)), "bias"),
    "float lengths": (dict(query_seq_lengths=jnp.array([1.0, 2.0])), "query_seq_lengths"),
    "lengths shape": (dict(key_value_seq_lengths=jnp.array([1, 2, 3], jnp.int32)), "key_value_seq_lengths"),
    "implementation": (dict(implementation="triton"), "implementation"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_what_jax_nn_rejects_is_a_value_error_naming_it(case):
    kwargs, name = REJECTED[case]
    base = dict(query=_x(2, 4, 2, 8), key=_x(2, 4, 2, 8), value=_x(2, 4, 2, 8))
    base.update(kwargs)
    with pytest.raises(Exception):  # noqa: B017,PT011 (jax.nn raises ValueError, AssertionError, TypeError, ...)
        jax.nn.dot_product_attention(**base)
    with pytest.raises(ValueError, match=name):
        attnlab.dot_product_attention(**base)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(local_window_size=(1, 2, 3)), "local_window_size"),
        (dict(local_window_size=1.5), "local_window_size"),
        (dict(scale=jnp.ones(4)), "scale"),
        (dict(empty_rows="nan"), "empty_rows"),
        (dict(bias=lambda q_idx, k_idx: 0.0), "bias"),
        (dict(implementation=("blockwise", 3)), "implementation"),
    ],
)
def test_attnlab_checks_name_the_argument(kwargs, name):
    q = _x(2, 4, 2, 8)
    with pytest.raises(ValueError, match=name):
        attnlab.dot_product_attention(q, q, q, **kwargs)


def test_traced_is_causal_is_rejected():
    q = _x(1, 4, 1, 8)
    with pytest.raises(ValueError, match="is_causal"):
        jax.jit(lambda c: attnlab.dot_product_attention(q, q, q, is_causal=c))(True)
