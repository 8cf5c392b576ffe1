"""sinusoidal_positional_encoding against the formula."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import to_numpy

import polyattn


def formula(n, d, base=10000.0, offset=0):
    pe = np.zeros((n, d))
    for pos in range(n):
        for col in range(d):
            i2 = col - col % 2
            angle = (pos + offset) / base ** (i2 / d)
            pe[pos, col] = np.sin(angle) if col % 2 == 0 else np.cos(angle)
    return pe


@pytest.mark.parametrize(("n", "d"), [(5, 8), (7, 5), (1, 1), (0, 4), (50, 16)])
def test_matches_formula(xp, device, dtype_name, n, d):
    pe = polyattn.sinusoidal_positional_encoding(n, d, xp=xp, dtype=getattr(xp, dtype_name),
                                                 device=device)
    assert pe.dtype == getattr(xp, dtype_name) and tuple(pe.shape) == (n, d)
    tol = 1e-6 if dtype_name == "float32" else 1e-12
    np.testing.assert_allclose(to_numpy(pe), formula(n, d), atol=tol)


def test_offset_and_base():
    pe = polyattn.sinusoidal_positional_encoding(4, 6, base=100.0, offset=10)
    np.testing.assert_allclose(pe, formula(4, 6, base=100.0, offset=10), atol=1e-12)
    full = polyattn.sinusoidal_positional_encoding(14, 6, base=100.0)
    np.testing.assert_allclose(pe, full[10:], atol=1e-12)


def test_default_dtype_follows_library():
    assert polyattn.sinusoidal_positional_encoding(2, 4).dtype == np.float64
    torch = pytest.importorskip("torch")
    pe = polyattn.sinusoidal_positional_encoding(2, 4, xp=torch)
    assert pe.dtype == torch.get_default_dtype()


def test_relative_position_is_linear():
    # PE[pos + k] is a fixed rotation of PE[pos] for each frequency pair.
    pe = polyattn.sinusoidal_positional_encoding(40, 8)
    k = 3
    for i in range(4):
        w = 1.0 / 10000 ** (2 * i / 8)
        rot = np.array([[np.cos(k * w), -np.sin(k * w)], [np.sin(k * w), np.cos(k * w)]])
        np.testing.assert_allclose(pe[:-k, 2 * i:2 * i + 2] @ rot, pe[k:, 2 * i:2 * i + 2],
                                   atol=1e-12)
