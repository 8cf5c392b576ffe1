"""softmax and logsumexp on every backend."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from helpers import TOLERANCE, assert_namespace_device, rel_error, to_numpy, to_xp

import polyattn


def np_softmax(x, axis):
    with np.errstate(invalid="ignore"):
        m = np.max(x, axis=axis, keepdims=True)
        m = np.where(np.isneginf(m), 0, m)
        e = np.exp(x - m)
        s = e.sum(axis=axis, keepdims=True)
        return np.where(s > 0, e / np.where(s > 0, s, 1), 0)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_matches_numpy(xp, device, dtype_name, axis):
    x = np.random.default_rng(0).standard_normal((3, 4, 5)) * 5
    out = polyattn.softmax(to_xp(x, xp, dtype=dtype_name, device=device), axis=axis)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert rel_error(to_numpy(out), np_softmax(x, axis)) <= TOLERANCE[dtype_name]
    np.testing.assert_allclose(to_numpy(out).sum(axis=axis), 1.0, rtol=1e-6)


def test_softmax_all_neg_inf_row_is_zero(xp, device, dtype_name):
    x = np.array([[1.0, 2.0, -np.inf], [-np.inf, -np.inf, -np.inf]])
    out = to_numpy(polyattn.softmax(to_xp(x, xp, dtype=dtype_name, device=device)))
    assert np.all(out[1] == 0)
    np.testing.assert_allclose(out[0].sum(), 1.0, rtol=1e-6)
    assert out[0, 2] == 0


def test_softmax_huge_logits(xp, device, dtype_name):
    x = np.array([1e4, 1e4 - 1.0, -1e4])
    out = to_numpy(polyattn.softmax(to_xp(x, xp, dtype=dtype_name, device=device)))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, np_softmax(x, -1), rtol=1e-6)


@pytest.mark.parametrize("keepdims", [False, True])
def test_logsumexp(xp, device, dtype_name, keepdims):
    x = np.random.default_rng(1).standard_normal((4, 6)) * 3
    x[2] = -np.inf
    out = polyattn.logsumexp(to_xp(x, xp, dtype=dtype_name, device=device), axis=-1,
                             keepdims=keepdims)
    got = to_numpy(out)
    with np.errstate(divide="ignore"):
        ref = np.log(np.exp(x).sum(-1, keepdims=keepdims))
    assert got.shape == ref.shape
    assert np.array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-6)


def test_logsumexp_of_non_finite_rows(xp, device, dtype_name):
    inf, nan = np.inf, np.nan
    x = np.array([[inf, 1.0, -inf], [-inf, -inf, -inf], [inf, nan, 1.0], [inf, inf, -2.0]])
    out = polyattn.logsumexp(to_xp(x, xp, dtype=dtype_name, device=device))
    with warnings.catch_warnings():
        # Dask runs the graph when it is computed, after the call: NumPy's warnings for
        # inf - inf come from its tasks, where no call of polyattn is there to quiet them
        if type(out).__module__.startswith("dask"):
            warnings.simplefilter("ignore", RuntimeWarning)
        got = to_numpy(out)
    assert got[0] == inf and got[3] == inf        # a +inf term makes the sum +inf
    assert got[1] == -inf                         # nothing to sum
    assert np.isnan(got[2])                       # NaN never disappears


def test_logsumexp_no_overflow():
    assert float(polyattn.logsumexp(np.array([1000.0, 1000.0]))) == pytest.approx(
        1000.0 + np.log(2.0), rel=1e-15)


def test_softmax_float16_computed_in_float32():
    x = np.array([10.0, 11.0, 12.0], dtype=np.float16)
    out = polyattn.softmax(x)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), np_softmax(x.astype(np.float64), -1),
                               rtol=2e-3)


def test_softmax_rejects_integers():
    with pytest.raises(TypeError, match="`x` must have a real floating dtype"):
        polyattn.softmax(np.arange(3))
