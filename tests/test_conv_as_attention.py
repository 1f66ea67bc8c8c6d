"""conv_as_attention: multi-head self-attention that equals a 'SAME' convolution, borders included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import nn


def _conv1d(x, kernel):
    return jax.lax.conv_general_dilated(
        x, kernel, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"), precision="highest"
    )


def _conv2d(x, kernel, grid):
    b, _, c = x.shape
    img = x.reshape(b, *grid, c)
    out = jax.lax.conv_general_dilated(
        img, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision="highest"
    )
    return out.reshape(b, grid[0] * grid[1], -1)


@pytest.mark.parametrize(
    "k,T,implementation",
    [
        (1, 4, "reference"),
        (3, 7, "reference"),
        (5, 9, "reference"),
        (7, 5, "reference"),
        (3, 7, "xla"),
        (5, 9, "blockwise"),
    ],
)
def test_1d_equals_conv(k, T, implementation):
    kx, kk = jax.random.split(jax.random.key(k * 31 + T))
    x = jax.random.normal(kx, (3, T, 4))
    kernel = jax.random.normal(kk, (k, 4, 6))
    layer, params = nn.conv_as_attention(kernel, implementation=implementation)
    assert params["wo"].shape == (k, 4, 6)  # one head per offset
    np.testing.assert_allclose(jax.jit(layer)(x), _conv1d(x, kernel), atol=2e-5, rtol=2e-5)


def test_1d_borders_are_zero_padding():
    # a kernel that only looks two steps right: the last two outputs see padding (zeros) only
    kernel = jnp.zeros((5, 1, 1)).at[4, 0, 0].set(1.0)
    layer, _ = nn.conv_as_attention(kernel)
    x = jnp.arange(1.0, 7.0)[None, :, None]
    np.testing.assert_array_equal(layer(x)[0, :, 0], [3, 4, 5, 6, 0, 0])


@pytest.mark.parametrize("k,grid", [(3, (4, 5)), (5, (3, 6))])
def test_2d_equals_conv_on_grid(k, grid):
    kx, kk = jax.random.split(jax.random.key(k))
    x = jax.random.normal(kx, (2, grid[0] * grid[1], 3))
    kernel = jax.random.normal(kk, (k, k, 3, 2))
    layer, params = nn.conv_as_attention(kernel, grid=grid)
    assert params["wo"].shape == (k * k, 3, 2)
    np.testing.assert_allclose(layer(x), _conv2d(x, kernel, grid), atol=2e-5, rtol=2e-5)


def test_gradients_match_conv():
    kx, kk = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (2, 6, 3))
    kernel = jax.random.normal(kk, (3, 3, 2))
    layer, _ = nn.conv_as_attention(kernel)
    g_att = jax.grad(lambda x: jnp.sum(layer(x) ** 2))(x)
    g_conv = jax.grad(lambda x: jnp.sum(_conv1d(x, kernel) ** 2))(x)
    assert np.isfinite(g_att).all()
    np.testing.assert_allclose(g_att, g_conv, atol=1e-4, rtol=1e-4)


def test_offsets_match_kernel_layout():
    np.testing.assert_array_equal(nn.conv_offsets((5,)), [-2, -1, 0, 1, 2])
    np.testing.assert_array_equal(nn.conv_offsets((3, 3), grid=(4, 4))[[0, 4, 8]], [[-1, -1], [0, 0], [1, 1]])


@pytest.mark.parametrize(
    "kernel,grid,match",
    [
        (jnp.zeros((4, 2, 2)), None, "odd"),
        (jnp.zeros((3, 2)), None, "kernel must have shape"),
        (jnp.zeros((3, 3, 2, 2)), None, "kernel must have shape"),
        (jnp.zeros((3, 2, 2), jnp.int32), None, "floating"),
        (jnp.zeros((3, 3, 2, 2)), (0, 4), "grid"),
    ],
)
def test_bad_kernel_named(kernel, grid, match):
    with pytest.raises(ValueError, match=match):
        nn.conv_as_attention(kernel, grid=grid)


def test_bad_input_named():
    layer, _ = nn.conv_as_attention(jnp.zeros((3, 3, 2, 2)), grid=(2, 3))
    with pytest.raises(ValueError, match="C_in"):
        layer(jnp.zeros((1, 6, 5)))
    with pytest.raises(ValueError, match="grid"):
        layer(jnp.zeros((1, 7, 2)))
