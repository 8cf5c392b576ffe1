"""Shared pieces of the reliability tests: which implementations run, and small helpers.

Every CPU implementation (``"reference"``, ``"chunked"``, ``"auto"``) runs on
every backend. ``"numba_cuda"`` joins where it can run: on the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, NumPy arrays only, tiny shapes) or on a CUDA GPU
(the CuPy backend).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
from helpers import (
    Backend,
    implementations_under_test,
    kernel_mode,
    selected_backends,
    skip_unless_native_on,
    to_numpy,
)

from polyattn.backends.array_api import blocked as chunked

IMPLEMENTATIONS = tuple(implementations_under_test())
CPU_IMPLEMENTATIONS = tuple(n for n in IMPLEMENTATIONS if n != "numba_cuda")
SIMULATOR = kernel_mode() == "simulator"

#: For modules that test NumPy code alone (no ``xp`` fixture): they run in the session
#: that selects NumPy and are skipped, saying where they run, in the other sessions.
NUMPY_SESSION_ONLY = pytest.mark.skipif(
    Backend.NUMPY not in selected_backends(),
    reason="NumPy-only tests: they run where POLYATTN_TEST_BACKENDS selects numpy")


def kernel_runs_on(backend: Backend) -> bool:
    """Whether the kernel accepts this backend's arrays in this run."""
    return "numba_cuda" in IMPLEMENTATIONS and backend is (
        Backend.NUMPY if SIMULATOR else Backend.CUPY)


def use_implementation(name: str, backend: Backend | None, monkeypatch: Any) -> str:
    """Prepare ``name`` for small test shapes and return it.

    The blocked implementations get tiny blocks so that a handful of queries
    and keys spans several blocks (and every block-boundary code path runs),
    except on JAX (see below).
    ``"numba_cuda"`` is skipped, with the reason, on backends it cannot take.
    """
    # JAX compiles every operation anew for each block shape, so there the blocks
    # hold these tests' small problems whole; block boundaries are exercised on
    # the other backends (and on JAX by test_attention.py and test_properties.py).
    bq, bk = (16, 16) if backend is Backend.JAX else (3, 4)
    monkeypatch.setattr(chunked, "BLOCK_Q", bq)
    monkeypatch.setattr(chunked, "BLOCK_K", bk)
    try:
        numpy_chunked = importlib.import_module("polyattn.backends.numpy.forward")
    except ImportError:
        numpy_chunked = None
    if numpy_chunked is not None:
        monkeypatch.setattr(numpy_chunked, "BLOCK_Q", 6, raising=False)
        monkeypatch.setattr(numpy_chunked, "BLOCK_K", 4, raising=False)
    skip_unless_native_on(backend, name, monkeypatch)
    if name == "numba_cuda":
        wanted = "numpy (CUDA simulator)" if SIMULATOR else "cupy (CUDA GPU)"
        backend = backend or Backend.NUMPY
        if not kernel_runs_on(backend):
            pytest.skip(f"numba_cuda takes {wanted} arrays in this run, not {backend.value}")
        from polyattn.backends.cuda import rows as numba_cuda

        monkeypatch.setattr(numba_cuda, "BLOCK_Q", 4)
    return name


def rounded(a: np.ndarray, dtype_name: str) -> np.ndarray:
    """``a`` rounded to ``dtype_name`` and back to float64: the values the library sees."""
    return np.asarray(a).astype(dtype_name).astype(np.float64)


def assert_bitwise_equal(a: Any, b: Any, what: str = "out") -> None:
    """Same shape and the same bits (NaN equal to NaN)."""
    x, y = to_numpy(a), to_numpy(b)
    assert x.shape == y.shape, f"{what}: shape {x.shape} != {y.shape}"
    assert x.dtype == y.dtype, f"{what}: dtype {x.dtype} != {y.dtype}"
    assert x.tobytes() == y.tobytes(), f"{what}: results differ bitwise"
