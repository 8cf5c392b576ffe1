"""Backends, devices and dtypes as pytest fixtures.

Every test that takes ``xp`` runs once per backend listed in
``POLYATTN_TEST_BACKENDS`` (comma separated; set by nox), by default every
CPU backend that is installed. Inputs are drawn in float64 NumPy and
converted with :func:`helpers.to_xp`.
"""

from __future__ import annotations

import os

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
