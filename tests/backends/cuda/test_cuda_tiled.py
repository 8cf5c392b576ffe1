"""Tests of the register-tiled exact kernel (``implementations/numba_cuda_tiled.py``).

On Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``; warp shuffles emulated)
or on a GPU with CuPy: every rule against polyattn's float64 reference on the
problem the public API builds, in float32 and float64, on shapes that span
several query blocks and key tiles.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed", allow_module_level=True)

from test_cuda_tensor_core import SIMULATOR, _gpu_reason

if not SIMULATOR and _gpu_reason() is not None:
    pytest.skip(f"needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU with CuPy ({_gpu_reason()})",
                allow_module_level=True)

from test_cuda_rows import (  # noqa: F401  (simulator_threads: an autouse fixture)
    causal,
    make_inputs,
    make_mask,
    namespace,
    prepared,
    rel_error,
    rules_on_device,
    simulator_threads,
    to_library,
    to_numpy,
)

import polyattn
from polyattn.backends.array_api import reference as reference_implementation
from polyattn.backends.cuda import facade as numba_cuda
from polyattn.backends.cuda import inputs
from polyattn.backends.cuda import tiled as numba_cuda_tiled

TOL = {"float32": 1e-5, "float64": 1e-12}


def run_tiled(dtype, q, k, v, *, dropout=None, **options):
    q, k, v = (np.asarray(a, dtype=dtype) for a in (q, k, v))
    ref = prepared(*(a.astype(np.float64) for a in (q, k, v)), "float64", dropout=dropout,
                   **options)
    ref_out, ref_lse = reference_implementation.attention(
        ref.q, ref.k, ref.v, mask=ref.mask, rules=ref.rules, scale=ref.scale, xp=ref.xp)
    got = prepared(q, k, v, dtype, dropout=dropout, **options)
    out, lse = numba_cuda_tiled.attention(
        *(to_library(np.asarray(a)) for a in (got.q, got.k, got.v)),
        mask=None if got.mask is None else to_library(np.asarray(got.mask)),
        rules=rules_on_device(got.rules), scale=got.scale, xp=namespace())
    return (to_numpy(out), to_numpy(lse)), (np.asarray(ref_out), np.asarray(ref_lse))


def assert_close(got, ref, dtype):
    (out, lse), (ref_out, ref_lse) = got, ref
    assert out.shape == ref_out.shape and str(out.dtype) == dtype
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_error(out, ref_out) <= TOL[dtype], rel_error(out, ref_out)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~finite)
    assert rel_error(lse[finite], ref_lse[finite]) <= TOL[dtype]


SHAPES = {  # (batch, H, Hkv, Tq, Tk, E, Ev)
    "gqa": ((1,), 2, 1, 70, 100, 16, 16),
    "odd_sizes": ((1,), 1, 1, 67, 45, 13, 9),
    "head40": ((), 1, 1, 20, 70, 40, 33),  # float32: Qᵀ resident; float64: in chunks
    "head100": ((), 1, 1, 20, 40, 100, 72),  # 2-row patches, 256 threads, Qᵀ in chunks
    "head200": ((), 1, 1, 20, 40, 200, 136),  # head bucket 256 (float64: 8-key V chunks)
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes(name, dtype):
    batch, h, hkv, tq, tk, e, ev = SHAPES[name]
    q, k, v = make_inputs(np.random.default_rng(11), batch, h, hkv, tq, tk, e, ev)
    assert_close(*run_tiled(dtype, q, k, v), dtype)


@pytest.mark.parametrize("alignment, kind", [
    ("top_left", "bool"), ("bottom_right", "float"),
    # the other two pairs take the same paths (noxfile.py's THOROUGH)
    pytest.param("top_left", "float", marks=pytest.mark.exhaustive),
    pytest.param("bottom_right", "bool", marks=pytest.mark.exhaustive)])
def test_causal_masks_and_fully_masked_rows(alignment, kind):
    rng = np.random.default_rng(12)
    q, k, v = make_inputs(rng, (2,), 2, 1, 66, 90, 8, 8)
    mask = make_mask(rng, kind, (2, 1, 66, 90))
    mask[1, :, 5, :] = False if kind == "bool" else -np.inf
    (out, lse), ref = run_tiled("float32", q, k, v, mask=mask, is_causal=True,
                                alignment=alignment)
    assert_close((out, lse), ref, "float32")
    assert np.all(out[1, :, 5] == 0) and np.all(np.isneginf(lse[1, :, 5]))


def test_nan_rows():
    rng = np.random.default_rng(15)
    q, k, v = (a.astype(np.float32) for a in make_inputs(rng, (1,), 1, 1, 20, 40, 8, 8))
    q[0, 0, 3, 2] = np.nan
    out, lse = numba_cuda_tiled.attention(*(to_library(a) for a in (q, k, v)), mask=None,
                                          rules=causal(None, q, k), scale=0.25,
                                          xp=namespace())
    out, lse = to_numpy(out), to_numpy(lse)
    assert np.isnan(out[0, 0, 3]).all() and np.isnan(lse[0, 0, 3])
    assert not np.isnan(np.delete(out, 3, axis=2)).any()


def _aligned_copy(a, skip=0):
    """``a``'s values in new memory that starts ``skip`` elements past a 16-byte
    boundary."""
    buf = np.empty(a.size + 16 + skip, a.dtype)
    start = (-buf.ctypes.data % 16) // a.itemsize + skip
    view = buf[start:start + a.size].reshape(a.shape)
    view[...] = a
    return view


@pytest.mark.parametrize("dtype",
                         ["float32", pytest.param("float64", marks=pytest.mark.exhaustive)])
def test_vector_and_element_loads_agree(dtype, monkeypatch):
    """Inputs that allow vector loads (aligned rows of whole 16-byte groups, in
    (B, H, T, E) or a (B, T, H, E) view) and inputs that do not (one element off
    a 16-byte boundary) take the two load paths of the kernel: the same bits."""
    rng = np.random.default_rng(16)
    q, k, v = (a.astype(dtype) for a in make_inputs(rng, (1,), 2, 1, 70, 90, 16, 8))
    decisions = []
    fit = numba_cuda.vector_loads_fit
    monkeypatch.setattr(inputs, "vector_loads_fit",
                        lambda *arrays: decisions.append(fit(*arrays)) or decisions[-1])

    def run(q, k, v):
        out, lse = numba_cuda_tiled.attention(*(to_library(a) for a in (q, k, v)), mask=None,
                                              rules=causal(0, q, k), scale=0.25,
                                              xp=namespace())
        return to_numpy(out), to_numpy(lse)

    aligned = run(*(_aligned_copy(a) for a in (q, k, v)))
    shifted = run(_aligned_copy(q), _aligned_copy(k, skip=1), _aligned_copy(v))
    time_major = run(*(np.swapaxes(_aligned_copy(np.swapaxes(a, 1, 2)), 1, 2)
                       for a in (q, k, v)))
    if SIMULATOR:  # on a GPU the arrays are copied to the device, aligned again
        assert decisions == [True, False, True]
    for got in (shifted, time_major):
        np.testing.assert_array_equal(got[0], aligned[0])
        np.testing.assert_array_equal(got[1], aligned[1])


def test_vector_loads_fit():
    x = _aligned_copy(np.zeros((2, 3, 5, 8), np.float32))
    fit = numba_cuda.vector_loads_fit
    memory = inputs.memory_of
    assert fit(memory(x), memory(np.swapaxes(_aligned_copy(np.zeros((2, 5, 3, 8))), 1, 2)))
    assert fit(memory(x[:, :1]), memory(x[..., 4:]))  # strides of whole 16-byte groups
    assert not fit(memory(x[..., :6]))  # rows of 24 bytes
    assert not fit(memory(x[..., 1:5]))  # a row start 4 bytes past a boundary
    assert not fit(memory(x[:, :, ::-1]))  # a negative stride
    assert not fit(memory(x[..., ::2]))  # elements not consecutive
    assert not fit(memory(x), memory(x[..., :6]))  # one array that does not fit
    huge = (16, (2, 1, 2**20, 256), (2**31, 2**30, 1024, 4), 4)
    assert not fit(huge)  # byte offsets beyond 2**31 - 1
    problem = numba_cuda.vector_loads_problem
    assert "2 GiB" in problem(huge)
    assert "4 bytes past a 16-byte boundary" in problem(memory(x[..., 1:5]))
    assert "not consecutive" in problem(memory(x[..., ::2]))
    assert "axis 2 steps -32 bytes" in problem(memory(x[:, :, ::-1]))
    assert "axis 0 steps 300 bytes" in problem(memory(_aligned_copy(np.zeros((2, 3, 5, 5),
                                                                             np.float32))[..., :4]))
    assert problem(memory(x)) is None
    assert fit((16, (1, 1, 2**20, 256), (2**30, 2**30, 1024, 4), 4))


def test_chosen_by_name_and_explained(monkeypatch):
    rng = np.random.default_rng(16)
    q, k, v = (to_library(a.astype(np.float32)) for a in
               make_inputs(rng, (1,), 2, 2, 33, 40, 8, 8))
    monkeypatch.delenv(numba_cuda.KERNEL_VARIABLE, raising=False)  # the default
    why = polyattn.explain(q, k, v, is_causal=True, implementation="numba_cuda")
    assert "register-tiled kernel, rows read 16 bytes per load" in why.arithmetic
    odd = polyattn.explain(q, k, v[..., :6], implementation="numba_cuda")
    assert "element by element" in odd.arithmetic and "`value`: its rows are 24 bytes" in (
        odd.arithmetic)
    monkeypatch.setenv(numba_cuda.KERNEL_VARIABLE, "tiled")
    assert "register-tiled" in str(polyattn.explain(q, k, v, implementation="numba_cuda"))
    out = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                implementation="numba_cuda")
    monkeypatch.setenv(numba_cuda.KERNEL_VARIABLE, "rows")
    assert "POLYATTN_CUDA_KERNEL=rows" in str(polyattn.explain(q, k, v,
                                                               implementation="numba_cuda"))
    rows = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 implementation="numba_cuda")
    assert rel_error(to_numpy(out), to_numpy(rows).astype(np.float64)) <= 1e-6
    monkeypatch.setenv(numba_cuda.KERNEL_VARIABLE, "fast")
    with pytest.raises(ValueError, match="POLYATTN_CUDA_KERNEL"):
        polyattn.scaled_dot_product_attention(q, k, v, implementation="numba_cuda")


def test_shared_memory_fits_every_specialisation():
    for dtype in numba_cuda_tiled.DTYPES:
        for bucket in numba_cuda_tiled.HEAD_DIM_BUCKETS:
            assert numba_cuda_tiled.shared_bytes(dtype, bucket) <= 48 * 1024
