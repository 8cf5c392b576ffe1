"""Backends, devices and dtypes as pytest fixtures.

Every test that takes ``xp`` runs once per backend listed in
``POLYATTN_TEST_BACKENDS`` (comma separated; set by nox), by default every
CPU backend that is installed. Inputs are drawn in float64 NumPy and
converted with :func:`helpers.to_xp`.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
from helpers import Backend, available_backends, backend_namespace, default_device


def _selected() -> list[Backend]:
    env = os.environ.get("POLYATTN_TEST_BACKENDS", "")
    if env.strip():
        names = [n.strip() for n in env.split(",") if n.strip()]
        chosen = [Backend(n) for n in names]
    else:
        chosen = [b for b in Backend if b.is_cpu]
    return chosen


def pytest_report_header(config):
    return f"polyattn backends: {', '.join(b.value for b in _selected())}"


def _params():
    params = []
    installed = available_backends()
    for backend in _selected():
        marks = []
        if backend not in installed:
            marks.append(pytest.mark.skip(reason=f"{backend.value} is not installed"))
        elif backend is Backend.CUPY and not installed[backend]:
            marks.append(pytest.mark.skip(reason="cupy is installed but no CUDA GPU is usable"))
        params.append(pytest.param(backend, id=backend.value, marks=marks))
    return params


@pytest.fixture(params=_params())
def backend(request) -> Backend:
    """The array library under test."""
    return request.param


@pytest.fixture
def xp(backend):
    """The library's standard-compatible namespace (array_api_compat where needed)."""
    return backend_namespace(backend)


@pytest.fixture
def device(backend, xp):
    """A device to create arrays on: a non-default one where the library has one."""
    return default_device(backend, xp)


@pytest.fixture(params=["float32", "float64"])
def dtype_name(request) -> str:
    """A real floating dtype, by name."""
    return request.param


@pytest.fixture(autouse=True, scope="session")
def cuda_simulator():
    """Under ``NUMBA_ENABLE_CUDASIM=1``: the simulator polls its block threads, so a
    short switch interval speeds it up, and its shared arrays are made race-free
    (see :func:`_shared_array`). Nothing otherwise."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        yield
        return
    from numba.cuda.simulator import kernelapi

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    _ORIGINAL_SHARED_ARRAY.append(kernelapi.FakeCUDAShared.array)
    kernelapi.FakeCUDAShared.array = _shared_array
    yield
    kernelapi.FakeCUDAShared.array = _ORIGINAL_SHARED_ARRAY.pop()
    sys.setswitchinterval(previous)


_SHARED_LOCK = threading.Lock()
_ORIGINAL_SHARED_ARRAY = []


def _shared_array(self, shape, dtype, alignment=None):
    """``FakeCUDAShared.array`` with its look-up and its store under one lock.

    The simulator gives every thread of a block the array allocated for the
    calling line, looked up and stored in two steps: a thread switch between
    them gives two threads two different arrays, and the kernel then reads
    tiles that its neighbours never wrote (a failure once in a few hundred
    launches, without any race in the kernel).
    """
    from numba.cuda.simulator import kernelapi

    if alignment is not None or shape == 0:  # errors and dynamic memory: no look-up
        return _ORIGINAL_SHARED_ARRAY[-1](self, shape, dtype, alignment)
    if isinstance(dtype, kernelapi.types.Type):
        dtype = kernelapi.numpy_support.as_dtype(dtype)
    frame = sys._getframe(1)
    caller = (frame.f_code.co_filename, frame.f_lineno)
    with _SHARED_LOCK:
        array = self._allocations.get(caller)
        if array is None:
            array = self._allocations[caller] = np.empty(shape, dtype)
    return array
