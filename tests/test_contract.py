"""The numerical contract (docs/semantics.rst) at a realistic size, on every implementation.

Relative error ``‖out − ref‖ / ‖ref‖`` against a float64 reference, for
random normal inputs: ≤ 1e-5 for float32, ≤ 1e-12 for float64, ≤ 2e-3 for
float16 (NumPy and torch), ≤ 4e-3 for bfloat16 (torch and JAX, the libraries that
have it). One problem of B=1, H=2, T=2048, E=64 per
backend, implementation and dtype; the reference is computed once per dtype
from the inputs as rounded to that dtype. On the CUDA simulator the kernel
gets a small problem instead (it runs one Python thread per CUDA thread).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from _support import IMPLEMENTATIONS, SIMULATOR, kernel_runs_on, rounded
from helpers import (
    TOLERANCE,
    Backend,
    assert_namespace_device,
    rel_error,
    skip_unless_native_on,
    to_numpy,
    to_xp,
)

import polyattn

SHAPE = (1, 2, 2048, 64)          # (B, H, T, E)
SIMULATOR_SHAPE = (1, 2, 48, 16)
FLOAT16_BACKENDS = (Backend.NUMPY, Backend.TORCH, Backend.CUPY)
BFLOAT16_BACKENDS = (Backend.TORCH, Backend.JAX)


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, backend, monkeypatch):
    """Each implementation with its production block sizes: the contract is for what runs."""
    if request.param == "numba_cuda" and not kernel_runs_on(backend):
        pytest.skip(f"numba_cuda does not take {backend.value} arrays in this run")
    skip_unless_native_on(backend, request.param, monkeypatch)
    return request.param


@cache
def problem(shape: tuple[int, ...], dtype: str, causal: bool):
    """Inputs rounded to ``dtype`` (as float64) and the float64 (out, lse) they give."""
    rng = np.random.default_rng(2048)
    q, k, v = (rounded(rng.standard_normal(shape), dtype) for _ in range(3))
    s = (q @ np.swapaxes(k, -1, -2)) / np.sqrt(shape[-1])              # (B, H, T, T)
    if causal:
        t = shape[-2]
        s = np.where(np.tril(np.ones((t, t), dtype=bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return q, k, v, (p / l) @ v, (m + np.log(l))[..., 0]


@pytest.mark.parametrize(("dtype", "causal"), [("float16", False), ("bfloat16", False),
                                               ("float32", False), ("float64", False),
                                               ("float32", True)],
                         ids=["float16", "bfloat16", "float32", "float64", "float32-causal"])
def test_relative_error_within_contract(backend, xp, device, implementation, dtype, causal):
    if dtype == "float16" and backend not in FLOAT16_BACKENDS:
        pytest.skip(f"the float16 contract is checked on NumPy and torch, not {backend.value}")
    if dtype == "bfloat16" and backend not in BFLOAT16_BACKENDS:
        pytest.skip(f"{backend.value} has no bfloat16")
    shape = SIMULATOR_SHAPE if implementation == "numba_cuda" and SIMULATOR else SHAPE
    q, k, v, ref, ref_lse = problem(shape, dtype, causal)
    args = [to_xp(a, xp, dtype=dtype, device=device) for a in (q, k, v)]
    out, lse = polyattn.scaled_dot_product_attention(*args, is_causal=causal, return_lse=True,
                                                     implementation=implementation)
    assert_namespace_device(out, xp, device, getattr(xp, dtype))
    if dtype == "bfloat16":             # torch's .numpy() refuses bfloat16
        out, lse = xp.astype(out, xp.float32), xp.astype(lse, xp.float32)
    got = to_numpy(out)
    assert np.isfinite(got).all()
    err = rel_error(got, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]} ({dtype})"
    lse_err = rel_error(to_numpy(lse), ref_lse)
    # float16 and bfloat16 keep the lse in float32
    lse_tol = max(TOLERANCE[dtype], TOLERANCE["float32"])
    assert lse_err <= lse_tol, f"lse relative error {lse_err:.3g} > {lse_tol}"
