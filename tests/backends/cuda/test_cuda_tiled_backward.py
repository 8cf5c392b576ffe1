"""Tests of the register-tiled backward kernels (``implementations/numba_cuda_tiled_backward.py``).

On Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``; run the shared arrays
race-free by ``simulator_threads``) or on a GPU with CuPy: dq, dk and dv from
the kernel's own forward against ``reference.backward`` on the float64
problem of the same (rounded) values (relative error ≤ 1e-12 in float64,
≤ 1e-4 in float32), on shapes that span several 64-row blocks and 32-row
tiles, with every rule. Their PTX and SASS are checked in ``test_cuda_ptx.py``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed", allow_module_level=True)

from test_cuda_tensor_core import SIMULATOR, _gpu_reason

from polyattn.backends.array_api import reference as reference_implementation
from polyattn.backends.cuda import facade as numba_cuda
from polyattn.backends.cuda import inputs, launch, tiled_backward
from polyattn.backends.cuda import rows_backward as numba_cuda_backward
from polyattn.rules.visibility import Rules

# Why the kernels cannot run here (None: on the simulator or a GPU with CuPy); the
# tests that need no kernel run anyway.
KERNEL_PROBLEM = None if SIMULATOR else _gpu_reason()
if KERNEL_PROBLEM is None:
    from test_cuda_rows import (  # noqa: F401  (simulator_threads: an autouse fixture)
        convert_problem,
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

TOL = {"float32": 1e-4, "float64": 1e-12}
needs_kernel = pytest.mark.skipif(KERNEL_PROBLEM is not None,
                                  reason=f"needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU with "
                                  f"CuPy ({KERNEL_PROBLEM})")


def _rounded(a, dtype):
    return None if a is None else a.astype(dtype).astype(np.float64)


def run_backward(q, k, v, grad_out, *, dtype="float64", grad_lse=None, dropout=None,
                 **options):
    """Tiled-kernel (dq, dk, dv) from the reference's (out, lse) of the problem in
    ``dtype``, and the reference gradients of the float64 problem with the same
    rounded values; both as NumPy arrays."""
    mask = options.get("mask")
    ref_options = dict(options, alibi_slopes=_rounded(options.get("alibi_slopes"), dtype))
    if mask is not None and mask.dtype != bool:
        ref_options["mask"] = _rounded(mask, dtype)
    ref = prepared(*(_rounded(a, dtype) for a in (q, k, v)), "float64", dropout=dropout,
                   **ref_options)
    ref_kw = dict(mask=ref.mask, rules=ref.rules, scale=ref.scale, xp=ref.xp)
    ref_out, ref_lse = reference_implementation.attention(ref.q, ref.k, ref.v, **ref_kw)
    ref_grads = reference_implementation.backward(
        ref.q, ref.k, ref.v, ref_out, ref_lse, _rounded(grad_out, dtype),
        grad_lse=_rounded(grad_lse, dtype), **ref_kw)

    got = prepared(q, k, v, dtype, dropout=dropout, **options)
    kw = dict(mask=None if got.mask is None else convert_problem(got.mask),
              rules=rules_on_device(got.rules), scale=got.scale, xp=namespace())
    qkv = [convert_problem(a) for a in (got.q, got.k, got.v)]
    out, lse = (to_library(np.asarray(a, dtype=dtype)) for a in (ref_out, ref_lse))
    grads = tiled_backward.backward(
        *qkv, out, lse, to_library(grad_out.astype(dtype)),
        grad_lse=None if grad_lse is None else to_library(grad_lse.astype(dtype)), **kw)
    return [to_numpy(g) for g in grads], [np.asarray(g) for g in ref_grads]


def assert_grads_match(grads, ref_grads, dtype):
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.shape == r.shape, name
        assert str(g.dtype) == dtype, name
        assert not np.isnan(g).any(), name
        assert rel_error(g, r) <= TOL[dtype], (name, rel_error(g, r))


def draw(rng, batch, h, hkv, tq, tk, e, ev):
    """q, k, v and a gradient of the output."""
    q, k, v = make_inputs(rng, batch, h, hkv, tq, tk, e, ev)
    return q, k, v, rng.standard_normal((*batch, h, tq, ev))


# (batch, H, Hkv, Tq, Tk, E, Ev): several 64-row blocks and 32-row tiles.
SHAPES = {
    "gqa_odd": ((1,), 2, 1, 70, 75, 13, 9),
    "head40": ((), 1, 1, 66, 40, 40, 33),
    "head64": ((), 1, 1, 40, 70, 64, 64),
    "head100": ((), 1, 1, 33, 66, 100, 70),
    "head200": ((), 1, 1, 20, 40, 200, 136),  # head bucket 256
}


@needs_kernel
@pytest.mark.parametrize("name, dtype", [
    (name, dtype) if dtype == "float32" or name in ("gqa_odd", "head200")
    else pytest.param(name, dtype, marks=pytest.mark.exhaustive)
    for name in SHAPES for dtype in ("float32", "float64")])
def test_shapes(name, dtype):
    rng = np.random.default_rng(len(name))
    grads, ref = run_backward(*draw(rng, *SHAPES[name]), dtype=dtype)
    assert_grads_match(grads, ref, dtype)


@needs_kernel
@pytest.mark.parametrize("alignment, kind", [
    ("top_left", "bool"), ("bottom_right", "float"),
    # the other two pairs take the same paths (noxfile.py's THOROUGH)
    pytest.param("top_left", "float", marks=pytest.mark.exhaustive),
    pytest.param("bottom_right", "bool", marks=pytest.mark.exhaustive)])
def test_causal_masks_and_fully_masked_rows(alignment, kind):
    rng = np.random.default_rng(12)
    tq, tk = (70, 45) if alignment == "top_left" else (45, 70)
    q, k, v, do = draw(rng, (2,), 2, 1, tq, tk, 8, 8)
    mask = make_mask(rng, kind, (2, 1, tq, tk))
    hidden = False if kind == "bool" else -np.inf
    mask[1, :, 5, :] = hidden
    grads, ref = run_backward(q, k, v, do, mask=mask, is_causal=True, alignment=alignment,
                              dtype="float32", grad_lse=rng.standard_normal((2, 2, tq)))
    assert_grads_match(grads, ref, "float32")
    assert np.all(grads[0][1, :, 5] == 0)


@needs_kernel
def test_every_rule_with_a_float_mask_gqa_and_grad_lse():
    rng = np.random.default_rng(21)
    tq, tk = 35, 70
    q, k, v, do = draw(rng, (2,), 4, 2, tq, tk, 5, 3)
    mask = make_mask(rng, "float", (2, 1, 1, tk))
    options = dict(window=(40, 2), softcap=2.0, alibi_slopes=rng.uniform(0.1, 1, (4,)),
                   key_lengths=np.array([70, 0]), is_causal=True, alignment="bottom_right",
                   mask=mask)
    grads, ref = run_backward(q, k, v, do, dtype="float32",
                              grad_lse=rng.standard_normal((2, 4, tq)), **options)
    assert_grads_match(grads, ref, "float32")
    assert all(np.all(g[1] == 0) for g in grads)  # the batch row without keys


@needs_kernel
@pytest.mark.parametrize("dtype",
                         ["float32", pytest.param("float64", marks=pytest.mark.exhaustive)])
def test_dropout(dtype):
    rng = np.random.default_rng(30)
    tq, tk = 66, 40
    q, k, v, do = draw(rng, (1,), 2, 1, tq, tk, 8, 8)
    options = dict(is_causal=True, mask=make_mask(rng, "bool", (1, 2, tq, tk)))
    grad_lse = rng.standard_normal((1, 2, tq))
    grads, ref = run_backward(q, k, v, do, dtype=dtype, grad_lse=grad_lse,
                              dropout=(0.35, 2**33 + 17), **options)
    assert_grads_match(grads, ref, dtype)
    undropped, _ = run_backward(q, k, v, do, dtype=dtype, grad_lse=grad_lse, **options)
    assert rel_error(grads[2], undropped[2]) > 0.1  # dv saw the dropped weights


@needs_kernel
def test_nan_rows_as_the_row_kernel():
    rng = np.random.default_rng(15)
    q, k, v, do = (a.astype(np.float32) for a in draw(rng, (1,), 2, 1, 66, 40, 8, 8))
    q[0, 1, 3, 2] = np.nan
    k[0, 0, 20, 1] = np.nan  # a key that the rows before 20 do not see
    kw = dict(mask=None, rules=Rules(66, 40, causal=True), scale=0.25, xp=namespace())
    out, lse = numba_cuda.attention(*(to_library(a) for a in (q, k, v)), **kw)
    args = [to_library(a) for a in (q, k, v)] + [out, lse, to_library(do)]
    got = [to_numpy(g) for g in tiled_backward.backward(*args, **kw)]
    want = [to_numpy(g) for g in numba_cuda_backward.backward(*args, **kw)]
    assert np.isnan(got[0][0, 1, 3]).all() and np.isnan(got[1]).any()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        ok = ~np.isnan(w)
        assert rel_error(g[ok], w[ok].astype(np.float64)) <= TOL["float32"]


@needs_kernel
def test_no_scores():
    rng = np.random.default_rng(44)
    q, k, v, do = draw(rng, (1,), 2, 2, 0, 5, 4, 3)
    out, lse = np.zeros((1, 2, 0, 3)), np.full((1, 2, 0), -np.inf)
    grads = [to_numpy(g) for g in tiled_backward.backward(
        *(to_library(a) for a in (q, k, v, out, lse, do)), mask=None, rules=Rules(0, 5),
        scale=0.5, xp=namespace())]
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(np.all(g == 0) for g in grads)


# --------------------------------------------------------------------------- #
# Without running a kernel
# --------------------------------------------------------------------------- #

def test_shared_memory_fits_every_specialisation():
    for dtype in tiled_backward.DTYPES:
        for bucket in tiled_backward.HEAD_DIM_BUCKETS:
            assert tiled_backward.shared_bytes(dtype, bucket) <= 48 * 1024


@pytest.mark.exhaustive  # builds all 144 kernels; kernel_ptx_all compiles every one
def test_specializations_cover_every_combination():
    specs = tiled_backward.specializations()
    per_kernel = (len(numba_cuda.DTYPES) * len(numba_cuda.HEAD_DIM_BUCKETS)
                  * len(numba_cuda.MASK_KINDS) * 2)
    assert len(specs) == 2 * per_kernel
    assert len({fn.__name__ for fn, _ in specs}) == 2 * per_kernel


def _aligned_copy(a, skip=0):
    """``a``'s values in new memory that starts ``skip`` elements past a 16-byte
    boundary."""
    buf = np.empty(a.size + 16 + skip, a.dtype)
    start = (-buf.ctypes.data % 16) // a.itemsize + skip
    view = buf[start:start + a.size].reshape(a.shape)
    view[...] = a
    return view


@needs_kernel
@pytest.mark.parametrize("dtype",
                         ["float32", pytest.param("float64", marks=pytest.mark.exhaustive)])
def test_vector_and_element_loads_agree(dtype, monkeypatch):
    """Inputs that allow vector loads and inputs that do not (dO one element off a
    16-byte boundary) take the two load paths of both kernels: the same bits."""
    rng = np.random.default_rng(31)
    q, k, v = (a.astype(dtype) for a in make_inputs(rng, (1,), 2, 1, 70, 75, 16, 8))
    grad_out = rng.standard_normal((1, 2, 70, 8)).astype(dtype)
    out, lse = (np.asarray(a, dtype=dtype) for a in reference_implementation.attention(
        q, k, v, mask=None, rules=Rules(70, 75, causal=True), scale=0.25, xp=namespace()))
    decisions = []
    fit = numba_cuda.vector_loads_fit
    for module in (inputs, launch):  # q, k and v's decision, then dO's
        monkeypatch.setattr(module, "vector_loads_fit",
                            lambda *arrays: decisions.append(fit(*arrays)) or decisions[-1])

    def run(grad_out):
        grads = tiled_backward.backward(
            *(to_library(_aligned_copy(a)) for a in (q, k, v)), to_library(out),
            to_library(lse), to_library(grad_out), mask=None, rules=Rules(70, 75, causal=True),
            scale=0.25, xp=namespace())
        return [to_numpy(g) for g in grads]

    aligned = run(_aligned_copy(grad_out))
    shifted = run(_aligned_copy(grad_out, skip=1))
    if SIMULATOR:  # on a GPU the arrays are copied to the device, aligned again
        # q, k, v then dO, per call
        assert decisions == [True, True, True, False]
    for got, want in zip(shifted, aligned, strict=True):
        np.testing.assert_array_equal(got, want)
    assert all(np.isfinite(g).all() for g in aligned)
