"""Positional encodings against closed forms, hand-checked values and their defining properties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import np_attention, qkv

import attnlab
from attnlab import masks, positional


def test_sinusoidal_closed_form_entries():
    pe = positional.sinusoidal(50, 8)
    # PE[p, 2i] = sin(p / 10000^(2i/8)), PE[p, 2i+1] = cos(same angle)
    np.testing.assert_allclose(pe[3, 2], np.sin(3 / 10000**0.25), rtol=1e-6)  # sin(0.3) = 0.29552
    np.testing.assert_allclose(pe[3, 2], 0.295520, atol=1e-6)
    np.testing.assert_allclose(pe[3, 3], 0.955336, atol=1e-6)  # cos(0.3)
    np.testing.assert_allclose(pe[7, 6], np.sin(7 / 1000), rtol=1e-6)  # 10000^(6/8) = 1000
    np.testing.assert_allclose(pe[0], [0, 1, 0, 1, 0, 1, 0, 1])
    p, i = np.meshgrid(np.arange(50), np.arange(4), indexing="ij")
    np.testing.assert_allclose(pe[:, 0::2], np.sin(p / 10000 ** (2 * i / 8)), atol=1e-6)
    np.testing.assert_allclose(pe[:, 1::2], np.cos(p / 10000 ** (2 * i / 8)), atol=1e-6)
    odd = positional.sinusoidal(5, 7)
    assert odd.shape == (5, 7)
    np.testing.assert_allclose(odd[:, 6], np.sin(np.arange(5) / 10000 ** (6 / 7)), atol=1e-6)


def test_sinusoidal_2d_definition():
    pe = positional.sinusoidal_2d(2, 3, 8)
    assert pe.shape == (6, 8)
    rows, cols = positional.sinusoidal(2, 4), positional.sinusoidal(3, 4)
    for r in range(2):
        for c in range(3):
            np.testing.assert_allclose(pe[r * 3 + c], np.concatenate([rows[r], cols[c]]))
    with pytest.raises(ValueError, match="d_model must be even"):
        positional.sinusoidal_2d(2, 2, 7)


def test_learned_table_shape_and_scale():
    t = positional.init_learned(jax.random.key(0), 1000, 16)
    assert t.shape == (1000, 16)
    assert 0.015 < float(t.std()) < 0.025


def _complex_rope(x, pos, base=10000.0):
    """RoPE as in the paper's complex form: pair (x_2i, x_2i+1) is z_i, multiplied by exp(i pos theta_i)."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1]
    z = x[..., 0::2] + 1j * x[..., 1::2]
    theta = base ** (-np.arange(0, h, 2) / h)
    z = z * np.exp(1j * np.asarray(pos)[:, None, None] * theta)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def test_rope_matches_complex_form_and_preserves_norms():
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))  # [B, T, N, H]
    out = positional.rope(x)
    for b in range(2):
        np.testing.assert_allclose(out[b], _complex_rope(x[b], np.arange(5)), atol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    offset = positional.rope(x, jnp.arange(5) + 7)
    np.testing.assert_allclose(offset[0], _complex_rope(x[0], np.arange(5) + 7), atol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_rope_dot_product_depends_only_on_offset(seed):
    kq, kk, kp = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (1, 1, 16))
    k = jax.random.normal(kk, (1, 1, 16))
    i, j, shift = (int(v) for v in jax.random.randint(kp, (3,), 0, 500))

    def score(a, b):
        return float(jnp.sum(positional.rope(q, jnp.array([a])) * positional.rope(k, jnp.array([b]))))

    np.testing.assert_allclose(score(i, j), score(i + shift, j + shift), rtol=1e-3, atol=1e-3)


def test_rope_2d_rotates_halves_by_row_and_column():
    x = jax.random.normal(jax.random.key(1), (6, 2, 8))  # 2 x 3 patches
    rows, cols = jnp.arange(6) // 3, jnp.arange(6) % 3
    out = positional.rope_2d(x, rows, cols)
    np.testing.assert_allclose(out[..., :4], positional.rope(x[..., :4], rows), atol=1e-6)
    np.testing.assert_allclose(out[..., 4:], positional.rope(x[..., 4:], cols), atol=1e-6)


def test_alibi_slopes_follow_the_paper():
    # 8 heads: 1/2, 1/4, ..., 1/256 (the paper's example)
    np.testing.assert_allclose(positional.alibi_slopes(8), [2.0**-k for k in range(1, 9)])
    # 6 heads: the 4-head sequence, then every other slope of the 8-head sequence
    np.testing.assert_allclose(positional.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    assert len(positional.alibi_slopes(12)) == 12


def test_alibi_bias_values_and_attention():
    a = positional.Alibi().bias(4)
    dense = a.dense(5, 7)
    assert dense.shape == (4, 5, 7)
    slopes = positional.alibi_slopes(4)
    for n, i, j in [(0, 0, 6), (3, 4, 1), (2, 2, 2)]:
        assert float(dense[n, i, j]) == pytest.approx(-slopes[n] * abs(i - j))
    np.testing.assert_array_equal(a(jnp.arange(2, 4), jnp.arange(3, 7)), dense[:, 2:4, 3:7])
    q, k, v = qkv((2, 5, 4, 8), s=7)
    mask = masks.causal(offset=2)
    out = attnlab.attention(q, k, v, mask=mask, bias=dense)
    expected, _ = np_attention(q, k, v, mask=np.asarray(mask.dense(5, 7)), bias=np.asarray(dense))
    np.testing.assert_allclose(out, expected, atol=2e-5)


def test_t5_buckets_by_hand():
    # bidirectional, 32 buckets, max distance 128: 16 per direction, 8 exact.
    # rel = -20 (key 20 before): 8 + floor(log(20/8) / log(128/8) * 8) = 8 + floor(2.64) = 10
    # rel = -200: 8 + floor(log(25) / log(16) * 8) = 8 + 9 = 17 -> capped at 15
    rel = jnp.array([0, -1, -7, -8, -20, -200, 1, 3, 20])
    assert positional.t5_bucket(rel).tolist() == [0, 1, 7, 8, 10, 15, 17, 19, 26]
    # causal: keys after the query share bucket 0; 16 exact buckets
    # rel = -20: 16 + floor(log(20/16) / log(128/16) * 16) = 16 + floor(1.72) = 17
    assert positional.t5_bucket(rel, bidirectional=False).tolist() == [0, 1, 7, 8, 17, 31, 0, 0, 0]


def test_t5_bias_table_lookup_and_grads():
    t5 = positional.T5(num_buckets=8, max_distance=16)
    bias = t5.bias(3, t5.init(jax.random.key(0), num_heads=3))
    dense = bias.dense(6, 6)
    table = np.asarray(bias.table)
    for n, i, j in [(0, 0, 5), (2, 5, 0), (1, 3, 3)]:
        b = int(positional.t5_bucket(jnp.array(j - i), num_buckets=8, max_distance=16))
        assert float(dense[n, i, j]) == pytest.approx(table[b, n])
    q, k, v = qkv((6, 3, 4))

    def loss(b):
        return jnp.sum(attnlab.attention(q, k, v, bias=b.dense(6, 6)) ** 2)

    g = jax.grad(loss)(bias)
    assert type(g) is type(bias) and g.table.shape == (8, 3)
    assert float(jnp.abs(g.table).sum()) > 0


def test_schemes_name_them_all():
    assert sorted(positional.SCHEMES) == ["alibi", "learned", "none", "rope", "sinusoidal", "sinusoidal_2d", "t5"]
    assert all(cls.name == n and issubclass(cls, positional.Encoding) for n, cls in positional.SCHEMES.items())
    assert positional.scheme("rope") is positional.Rope and "2104.09864" in positional.Rope.reference
    assert [n for n, s in positional.SCHEMES.items() if s.grid] == ["sinusoidal_2d"]
    with pytest.raises(ValueError, match="posenc must be one of"):
        positional.scheme("xpos")


ENCODINGS = {  # each flag name -> the object it must build (options a scheme does not have are ignored)
    "none": ({}, positional.NoPosition()),
    "sinusoidal": (dict(max_len=64, num_buckets=8), positional.Sinusoidal(64)),
    "learned": ({}, positional.Learned(512)),
    "rope": (dict(max_len=64, base=500.0), positional.Rope(500.0)),
    "alibi": (dict(max_len=64), positional.Alibi()),
    "t5": (dict(num_buckets=8, max_distance=16, max_len=64), positional.T5(8, 16)),
    "sinusoidal_2d": (dict(height=3, width=4, max_len=64), positional.Sinusoidal2D(3, 4)),
}


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_encoding_builds_each_scheme(name):
    options, want = ENCODINGS[name]
    got = positional.encoding(name, **options)
    assert type(got) is type(want) and got == want
    assert isinstance(got, positional.scheme(name))


# what each scheme does, by hand: its methods say it (there is no kind string to branch on)
DOES = {
    "none": set(),
    "sinusoidal": {"inputs"},
    "learned": {"init", "inputs"},
    "rope": {"rotary"},
    "alibi": {"bias"},
    "t5": {"init", "bias"},
    "sinusoidal_2d": {"inputs"},
}


@pytest.mark.parametrize("name", list(DOES))
def test_what_a_scheme_does_is_its_methods(name):
    enc = positional.encoding(name, height=2, width=3)
    param = enc.init(jax.random.key(0), d_model=8, num_heads=2)
    answers = {
        "init": param,
        "inputs": enc.inputs(6, 8, param),
        "rotary": enc.rotary(),
        "bias": enc.bias(2, param),
    }
    assert {k for k, v in answers.items() if v is not None} == DOES[name]
    assert (enc.param_name is not None) == (param is not None)


def test_every_scheme_has_an_encoding_case():
    assert sorted(ENCODINGS) == sorted(positional.SCHEMES)


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("xpos", {}, "posenc must be one of"),
        ("t5", dict(t5_buckets=8), r"unknown options \['t5_buckets'\]"),
        ("sinusoidal_2d", {}, r"posenc='sinusoidal_2d' needs \['height', 'width'\]"),
        ("sinusoidal_2d", dict(height=0, width=2), "height must be a positive int"),
    ],
)
def test_bad_encoding(name, options, match):
    with pytest.raises(ValueError, match=match):
        positional.encoding(name, **options)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: positional.sinusoidal(0, 4), "num_positions must be a positive int"),
        (lambda: positional.rope(jnp.ones((4, 2, 3))), "head dim must be even"),
        (lambda: positional.rope(jnp.ones((4, 2, 4)), jnp.arange(5)), r"positions must have shape \[\.\.\., T\]"),
        (lambda: positional.rope(jnp.ones((4, 4))), r"x must have shape \[\.\.\., T, N, H\]"),
        (lambda: positional.rope_2d(jnp.ones((4, 2, 6)), jnp.arange(4), jnp.arange(4)), "divisible by 4"),
        (lambda: positional.Alibi().bias(0), "num_heads must be a positive int"),
        (lambda: positional.T5(num_buckets=2), "num_buckets must be >= 4"),
        (lambda: positional.T5(num_buckets=1, bidirectional=False), "num_buckets must be >= 2"),
        (lambda: positional.Alibi().score(), "give num_heads"),
        (lambda: positional.Alibi().score(slopes=jnp.ones((2, 2))), r"slopes must have shape \[N\]"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_blockwise_with_alibi_and_t5_equals_reference_with_dense_bias():
    # the kernel evaluates attnlab.positional's callables per tile; the reference gets [N, T, S] arrays.
    # ALiBi and T5 together in one program (one compile): bias = alibi + t5.
    from attnlab import kernels

    T, S = 20, 27
    q, k, v = qkv((2, T, 4, 8), s=S, kv_heads=2, seed=3)
    mask = masks.causal(offset=S - T)
    alibi = positional.Alibi().bias(4)
    scheme = positional.T5(num_buckets=8, max_distance=16, stddev=1.0)
    table = scheme.init(jax.random.key(4), num_heads=4)

    def loss(q, k, v, table, fast):
        t5 = scheme.bias(4, table)
        if fast:
            both = lambda qi, ki: alibi(qi, ki) + t5(qi, ki)  # noqa: E731
            out = kernels.blockwise_attention(q, k, v, mask=mask, bias=both, block_sizes=kernels.BlockSizes(8, 8))
        else:
            out = attnlab.attention_reference(q, k, v, mask=mask, bias=alibi.dense(T, S) + t5.dense(T, S))
        return jnp.sum(out * jnp.cos(out)), out

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True), static_argnums=4)
    (grads, out), (grads_r, out_r) = g(q, k, v, table, True), g(q, k, v, table, False)
    np.testing.assert_allclose(out, out_r, atol=2e-5, rtol=2e-5)
    dense = np.asarray(alibi.dense(T, S)) + np.asarray(scheme.bias(4, table).dense(T, S))
    expected, _ = np_attention(q, k, v, mask=np.asarray(mask.dense(T, S)), bias=dense)
    np.testing.assert_allclose(out, expected, atol=2e-5)
    for a, b in zip(grads, grads_r, strict=True):  # dq, dk, dv and d table
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    assert float(jnp.abs(grads[3]).sum()) > 0


def _t5_by_hand(key, n, buckets, max_distance, stddev):
    table = stddev * jax.random.normal(key, (buckets, n), jnp.float32)
    return lambda T, S: jnp.moveaxis(
        table[
            positional.t5_bucket(
                jnp.arange(S)[None, :] - jnp.arange(T)[:, None], num_buckets=buckets, max_distance=max_distance
            )
        ],
        -1,
        0,
    )


# each deprecated name -> (how it was used, the same thing through the one name); both must give the same numbers
DEPRECATED = {
    "alibi": (lambda old: old(4).dense(5, 7), lambda: positional.Alibi().bias(4).dense(5, 7)),
    "AlibiBias": (
        lambda old: old().bias(3, None).dense(4, 4),
        lambda: positional.Alibi().bias(3, None).dense(4, 4),
    ),
    "init_t5_bias": (
        lambda old: old(jax.random.key(2), 3, num_buckets=8, max_distance=16, stddev=1.0).dense(5, 6),
        lambda: _t5_by_hand(jax.random.key(2), 3, 8, 16, 1.0)(5, 6),
    ),
    "T5Bias": (
        lambda old: old(jnp.arange(24.0).reshape(8, 3), max_distance=16).dense(5, 6),
        lambda: positional.T5(8, 16).bias(3, jnp.arange(24.0).reshape(8, 3)).dense(5, 6),
    ),
    "Scheme": (lambda old: old, lambda: positional.Encoding),
}


@pytest.mark.parametrize("name", list(DEPRECATED))
def test_deprecated_names_warn_and_give_the_same(name):
    use_old, use_new = DEPRECATED[name]
    with pytest.warns(DeprecationWarning, match=rf"positional\.{name} is deprecated: use positional\."):
        old = getattr(positional, name)
    got, want = use_old(old), use_new()
    if isinstance(want, type):
        assert got is want
    else:
        np.testing.assert_array_equal(got, want)
    assert name not in positional.__all__


def test_deprecated_alibi_mod_warns_and_gives_the_same():
    from attnlab import scores

    q, k = qkv((5, 4, 8), s=7)[:2]
    with pytest.warns(DeprecationWarning, match=r"scores\.alibi_mod is deprecated: use positional\.Alibi\(\)\.score"):
        old = scores.ScoreMod(scores.alibi_mod, jnp.asarray(positional.alibi_slopes(4)))
    new = positional.Alibi().score(4)
    np.testing.assert_array_equal(old(q, k), new(q, k))
    assert old.head_axes == new.head_axes == (0,)
    # and the same attention as the bias form, against numpy
    expected = np.asarray(scores.dot_product(q, k)) + np.asarray(positional.Alibi().bias(4).dense(5, 7))
    np.testing.assert_allclose(new(q, k), expected, atol=1e-6)
    assert "alibi_mod" not in scores.__all__
