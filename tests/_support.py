"""Shared pieces of the behaviour tests: which implementations run, and small helpers.

Tests are parametrised by implementation case ids (:func:`helpers.implementations_under_test`):
``"reference"``, ``"chunked"`` and ``"auto"`` on every backend, ``"native"`` on torch and
JAX, ``"numba_cpu"`` on NumPy where Numba is installed, ``"distributed"`` on Dask, and
the CUDA kernel families ``"numba_cuda-rows"``, ``"numba_cuda-tiled"`` and
``"numba_cuda-tc"`` where the kernel can run: on the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, NumPy arrays only, tiny shapes) or on a CUDA GPU (the
CuPy backend). :func:`use_implementation` turns an id into the ``implementation=``
name, selecting the kernel family and skipping backends the implementation does not
take.

:data:`EVERY_IMPLEMENTATION` has every CUDA family; :data:`CASES` (the broad
behaviour files, whose shapes are mostly decoding-sized) has the one-thread-per-row
family only: the tiled and tensor-core families take more than 16 query rows, and
``test_rules.py`` runs every rule on each of them. :data:`IMPLEMENTATIONS` are plain
``implementation=`` names, for modules that pass them on as they are.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import numpy as np
import pytest
from helpers import (
    CUDA_FAMILIES,
    ONLY_ON,
    Backend,
    implementations_under_test,
    kernel_mode,
    public_name,
    selected_backends,
    skip_unless_native_on,
    to_numpy,
    to_xp,
)

import polyattn
from polyattn.backends.array_api import blocked as chunked

#: Every implementation case, each CUDA kernel family included (``test_rules.py``).
EVERY_IMPLEMENTATION = tuple(implementations_under_test())
#: The cases of the broad behaviour files: every implementation, and of the CUDA kernel
#: the one-thread-per-row family only (most of their shapes are decoding-sized, which
#: the other families leave to it; ``test_rules.py`` runs every rule on each family).
CASES = tuple(implementations_under_test(cuda_families=("numba_cuda-rows",)))
#: The implementation names of the modules that call ``implementation=name`` directly:
#: those that take every backend's arrays, and ``"numba_cuda"`` (its default kernels).
IMPLEMENTATIONS = tuple(n for n in implementations_under_test(cuda_families=("numba_cuda",))
                        if n not in ONLY_ON)
CPU_IMPLEMENTATIONS = tuple(n for n in IMPLEMENTATIONS if n != "numba_cuda")
SIMULATOR = kernel_mode() == "simulator"

#: Implementations ``attention_vjp`` refuses by name, and what the refusal says: native
#: ones are differentiated by their library (torch autograd, ``jax.grad``), the Dask plan
#: has no backward pass.
NO_VJP = {"native": "log-sum-exp for a backward pass", "distributed": "no backward pass"}
#: Implementations that refuse ``dropout_p > 0`` by name, and what the refusal says.
NO_DROPOUT = {"distributed": "dropout's keep-mask is counted over the whole problem"}

#: The cases that take NumPy arrays in this run, for tests that call with NumPy arrays
#: whatever the backend: ``numba_cpu`` where Numba is installed (and NumPy selected),
#: ``numba_cuda-rows`` on the simulator.
NUMPY_CASES = tuple(n for n in CASES if public_name(n) not in ("native", "distributed")
                    and (public_name(n) != "numba_cuda" or SIMULATOR))

#: For modules that test NumPy code alone (no ``xp`` fixture): they run in the session
#: that selects NumPy and are skipped, saying where they run, in the other sessions.
NUMPY_SESSION_ONLY = pytest.mark.skipif(
    Backend.NUMPY not in selected_backends(),
    reason="NumPy-only tests: they run where POLYATTN_TEST_BACKENDS selects numpy")


def kernel_runs_on(backend: Backend) -> bool:
    """Whether the kernel accepts this backend's arrays in this run."""
    return any(public_name(n) == "numba_cuda" for n in EVERY_IMPLEMENTATION) and backend is (
        Backend.NUMPY if SIMULATOR else Backend.CUPY)


def use_implementation(name: str, backend: Backend | None, monkeypatch: Any) -> str:
    """Prepare the implementation case ``name`` for small test shapes and return the
    ``implementation=`` name to call with.

    The blocked implementations get tiny blocks so that a handful of queries
    and keys spans several blocks (and every block-boundary code path runs),
    except on JAX (see below). A CUDA family id (``"numba_cuda-tiled"``...) sets the
    variables that select its kernel. An implementation that takes one library
    only (``"numba_cpu"``: NumPy, ``"distributed"``: Dask, ``"numba_cuda"``: NumPy on the
    simulator, CuPy on a GPU) is skipped, with the reason, on the other backends.
    """
    implementation = public_name(name)
    only = ONLY_ON.get(implementation)
    if only is not None and (backend or Backend.NUMPY) is not only:
        pytest.skip(f"{implementation} takes {only.value} arrays, not "
                    f"{(backend or Backend.NUMPY).value}")
    # JAX compiles every operation anew for each block shape, so there the blocks
    # hold these tests' small problems whole; block boundaries are exercised on
    # the other backends (and on JAX by test_attention.py and test_properties.py).
    bq, bk = (16, 16) if backend is Backend.JAX else (3, 4)
    monkeypatch.setattr(chunked, "BLOCK_Q", bq)
    monkeypatch.setattr(chunked, "BLOCK_K", bk)
    for where in ("polyattn.backends.numpy.plan", "polyattn.backends.numpy.forward"):
        try:  # the NumPy fast path's block sizes, in the module that defines them
            numpy_blocks = importlib.import_module(where)
        except ImportError:
            continue
        if "BLOCK_Q" in vars(numpy_blocks):
            monkeypatch.setattr(numpy_blocks, "BLOCK_Q", 6)
            monkeypatch.setattr(numpy_blocks, "BLOCK_K", 4)
            break
    skip_unless_native_on(backend, implementation, monkeypatch)
    if implementation == "numba_cpu" and importlib.util.find_spec("numba") is None:
        pytest.skip("numba_cpu needs Numba, which this session lacks (the numba_cpu "
                    "session runs it)")
    if implementation == "numba_cuda":
        wanted = "numpy (CUDA simulator)" if SIMULATOR else "cupy (CUDA GPU)"
        backend = backend or Backend.NUMPY
        if not kernel_runs_on(backend):
            pytest.skip(f"numba_cuda takes {wanted} arrays in this run, not {backend.value}")
        for variable, value in CUDA_FAMILIES.get(name, {}).items():
            monkeypatch.setenv(variable, value)
        if name in ("numba_cuda", "numba_cuda-rows"):
            from polyattn.backends.cuda import rows as numba_cuda

            monkeypatch.setattr(numba_cuda, "BLOCK_Q", 4)
    return implementation


def check_vjp_refused(implementation: str, xp: Any, device: Any) -> None:
    """For an implementation of :data:`NO_VJP`: check that ``attention_vjp`` refuses it,
    saying why, and skip the rest of the test. Nothing for the others."""
    why = NO_VJP.get(implementation)
    if why is None:
        return
    q = to_xp(np.zeros((1, 1, 2, 2)), xp, device=device)
    with pytest.raises(ValueError, match=why):
        polyattn.attention_vjp(q, q, q, implementation=implementation)
    pytest.skip(f"attention_vjp refuses {implementation!r} ({why}; checked)")


def check_dropout_refused(implementation: str, xp: Any, device: Any) -> None:
    """For an implementation of :data:`NO_DROPOUT`: check that it refuses ``dropout_p > 0``
    by name, saying why, and skip the rest of the test. Nothing for the others."""
    why = NO_DROPOUT.get(implementation)
    if why is None:
        return
    q = to_xp(np.zeros((1, 1, 2, 2)), xp, device=device)
    with pytest.raises(ValueError, match=why):
        polyattn.scaled_dot_product_attention(q, q, q, implementation=implementation,
                                              dropout_p=0.25, dropout_seed=1)
    pytest.skip(f"{implementation!r} refuses dropout ({why}; checked)")


def cuda_family_ran(name: str, explanation: Any) -> None:
    """Check that ``explain()`` names the CUDA kernel family of case ``name`` (or skip
    the case where the family does not take the call, which another family then runs)."""
    if public_name(name) != "numba_cuda" or name not in CUDA_FAMILIES:
        return
    how = explanation.arithmetic
    wanted = {"numba_cuda-rows": "one-thread-per-row", "numba_cuda-tiled": "register-tiled",
              "numba_cuda-tc": "tensor cores"}[name]
    if wanted not in how:
        if name == "numba_cuda-rows":
            raise AssertionError(f"{name}: explain() says {how!r}")
        pytest.skip(f"{name} does not take this call ({how}); another family runs it")


def rounded(a: np.ndarray, dtype_name: str) -> np.ndarray:
    """``a`` rounded to ``dtype_name`` and back to float64: the values the library sees.

    NumPy has no bfloat16: its values are float32 rounded to the nearest 8-bit
    significand (ties to even), so that a library converting them changes nothing."""
    if dtype_name == "bfloat16":
        bits = np.asarray(a, dtype=np.float32).view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) \
            & np.uint32(0xFFFF0000)
        return bits.view(np.float32).astype(np.float64)
    return np.asarray(a).astype(dtype_name).astype(np.float64)


def assert_bitwise_equal(a: Any, b: Any, what: str = "out") -> None:
    """Same shape and the same bits (NaN equal to NaN)."""
    x, y = to_numpy(a), to_numpy(b)
    assert x.shape == y.shape, f"{what}: shape {x.shape} != {y.shape}"
    assert x.dtype == y.dtype, f"{what}: dtype {x.dtype} != {y.dtype}"
    assert x.tobytes() == y.tobytes(), f"{what}: results differ bitwise"
