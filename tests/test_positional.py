"""sinusoidal() against the closed form of Vaswani et al. 2017, sec. 3.5."""

import math

import numpy as np
import pytest

from attnlab import positional


def test_sinusoidal_hand_checked_entries():
    pe = np.asarray(positional.sinusoidal(50, 8))
    assert pe.shape == (50, 8)
    # p = 0: sin 0 = 0 at even dims, cos 0 = 1 at odd dims.
    np.testing.assert_allclose(pe[0], [0, 1, 0, 1, 0, 1, 0, 1], atol=1e-7)
    # p = 1, i = 0: angle 1 / 10000^0 = 1 -> sin 1 = 0.841471, cos 1 = 0.540302.
    np.testing.assert_allclose(pe[1, :2], [0.841471, 0.540302], atol=1e-6)
    # p = 7, i = 1 (dims 2, 3): angle 7 / 10000^(2/8) = 7 / 10 = 0.7 -> sin 0.644218, cos 0.764842.
    np.testing.assert_allclose(pe[7, 2:4], [0.644218, 0.764842], atol=1e-6)
    # p = 42, i = 3 (dims 6, 7): angle 42 / 10000^(6/8) = 42 / 1000 = 0.042.
    np.testing.assert_allclose(pe[42, 6:8], [math.sin(0.042), math.cos(0.042)], atol=1e-6)


def test_sinusoidal_base_and_errors():
    pe = np.asarray(positional.sinusoidal(3, 4, base=100))
    # p = 2, i = 1: angle 2 / 100^(2/4) = 0.2.
    np.testing.assert_allclose(pe[2, 2:], [math.sin(0.2), math.cos(0.2)], atol=1e-6)
    with pytest.raises(ValueError, match="d_model"):
        positional.sinusoidal(3, 5)
    with pytest.raises(ValueError, match="num_positions"):
        positional.sinusoidal(0, 4)
