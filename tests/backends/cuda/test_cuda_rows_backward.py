"""Tests of the Numba CUDA backward kernels (``implementations/numba_cuda_backward.py``).

As in ``test_cuda_rows.py``: with ``NUMBA_ENABLE_CUDASIM=1`` the kernels run
on Numba's CPU simulator on NumPy arrays, with small shapes and small tiles
(several query and key tiles per case); with CuPy and a CUDA GPU, on CuPy
arrays. The kernel's forward and backward run on the problem that
``polyattn._problem.prepare`` builds, and are compared with
``reference.attention`` and ``reference.backward`` on the float64 problem of
the same (rounded) values: relative error ≤ 1e-12 in float64, ≤ 1e-4 in
float32, for dq, dk and dv.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_rows import (  # also skips this module where the kernel cannot run
    SIMULATOR,
    SMALL_TILES,
    assert_matches,
    causal,
    convert_problem,
    make_inputs,
    make_mask,
    namespace,
    prepared,
    rel_error,
    rules_on_device,
    simulator_threads,  # noqa: F401 (an autouse fixture: short switches, safe shared arrays)
    to_library,
    to_numpy,
)

import polyattn
from polyattn.backends.array_api import reference as reference_implementation
from polyattn.backends.cuda import facade as numba_cuda
from polyattn.backends.cuda import rows
from polyattn.backends.cuda import rows_backward as numba_cuda_backward

TOL = {"float32": 1e-4, "float64": 1e-12}
# The backward kernels' tiles: 8 threads per block, 4 rows per shared tile.
BACKWARD_TILES = {"block_q": 8, "block_k": 4}


def _rounded(a, dtype):
    return None if a is None else a.astype(dtype).astype(np.float64)


def run_backward(q, k, v, grad_out, *, dtype="float64", grad_lse=None, dropout=None,
                 forward_tiles=None, backward_tiles=None, **options):
    """Kernel (dq, dk, dv) from the kernel's own (out, lse), and the reference gradients
    of the float64 problem with the same rounded values; both as NumPy arrays."""
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
    out, lse = numba_cuda.attention(*qkv, **kw,
                                    **(SMALL_TILES if forward_tiles is None else forward_tiles))
    assert_matches(out, lse, np.asarray(ref_out), np.asarray(ref_lse), dtype)
    grads = numba_cuda.backward(
        *qkv, out, lse, to_library(grad_out.astype(dtype)),
        grad_lse=None if grad_lse is None else to_library(grad_lse.astype(dtype)),
        **kw, **(BACKWARD_TILES if backward_tiles is None else backward_tiles))
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


# --------------------------------------------------------------------------- #
# Shapes, masks, causal alignments
# --------------------------------------------------------------------------- #

# (batch, H, Hkv, Tq, Tk, E, Ev)
SHAPES = {
    "plain": ((2,), 2, 2, 9, 13, 4, 4),
    "gqa_ev_ne_e": ((1,), 4, 2, 7, 10, 3, 5),
    "mqa_tq_gt_tk": ((2,), 3, 1, 11, 5, 4, 2),
    "two_batch_dims": ((2, 2), 2, 1, 5, 6, 4, 4),
    "head_40": ((), 1, 1, 3, 5, 40, 36),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes(name, dtype):
    rng = np.random.default_rng(len(name))
    grads, ref = run_backward(*draw(rng, *SHAPES[name]), dtype=dtype)
    assert_grads_match(grads, ref, dtype)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_broadcast_over_batch_dims_with_gqa(kind):
    rng = np.random.default_rng(3)
    q, k, v, do = draw(rng, (2, 2), 4, 2, 5, 6, 4, 4)
    grads, ref = run_backward(q, k, v, do, mask=make_mask(rng, kind, (1, 2, 1, 5, 6)),
                              dtype="float32")
    assert_grads_match(grads, ref, "float32")


def test_causal_rules_with_a_negative_offset():
    # Causal with j <= i - 2 and nothing else.
    rng = np.random.default_rng(5)
    q, k, v, do = draw(rng, (2,), 2, 2, 6, 8, 4, 4)
    out, lse = reference_implementation.attention(q, k, v, mask=None, rules=causal(-2, q, k),
                                                  scale=0.4, xp=np)
    ref = reference_implementation.backward(q, k, v, out, lse, do, mask=None,
                                            rules=causal(-2, q, k), scale=0.4, xp=np)
    grads = numba_cuda.backward(*(to_library(a) for a in (q, k, v, np.asarray(out),
                                                          np.asarray(lse), do)),
                                mask=None, rules=causal(-2, q, k), scale=0.4,
                                xp=namespace(), **BACKWARD_TILES)
    assert_grads_match([to_numpy(g) for g in grads], [np.asarray(g) for g in ref], "float64")


# --------------------------------------------------------------------------- #
# Rules: windows, soft-capping, ALiBi, key lengths and positions
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_rule_with_a_mask_gqa_and_grad_lse(causal, dtype):
    rng = np.random.default_rng(21)
    tq, tk = 6, 15
    q, k, v, do = draw(rng, (2, 2), 4, 2, tq, tk, 5, 3)
    mask = make_mask(rng, "float", (2, 1, 1, tq, tk))
    options = dict(window=(6, 2), softcap=2.0, alibi_slopes=rng.uniform(0.1, 1, (2, 1, 4)),
                   key_lengths=np.array([[15, 9], [0, 12]]), is_causal=causal,
                   alignment="bottom_right", mask=mask)
    grad_lse = rng.standard_normal((2, 2, 4, tq))
    grads, ref = run_backward(q, k, v, do, dtype=dtype, grad_lse=grad_lse, **options)
    assert_grads_match(grads, ref, dtype)
    # the batch row without keys: zero gradients everywhere
    assert all(np.all(g[1, 0] == 0) for g in grads)


@pytest.mark.parametrize("window", [(0, 0), (2, None), (None, 3)],
                         ids=["diagonal", "left", "right"])
def test_window_sides(window):
    rng = np.random.default_rng(22)
    grads, ref = run_backward(*draw(rng, (1,), 2, 2, 10, 10, 4, 4), window=window)
    if window == (0, 0):
        # One key per row: P = 1 and dS = dP - D = 0, so dq and dk vanish (the
        # reference's are rounding noise, which no relative error can judge).
        assert all(np.max(np.abs(g)) <= 1e-14 for g in grads[:2] + ref[:2])
        grads, ref = grads[2:], ref[2:]
    for g, r in zip(grads, ref, strict=True):
        assert rel_error(g, r) <= TOL["float64"]


def test_grad_lse_alone():
    # dO = 0 with dlse: the gradients of lse only (dS = P dlse).
    rng = np.random.default_rng(23)
    q, k, v, do = draw(rng, (2,), 2, 1, 5, 7, 4, 4)
    grad_lse = rng.standard_normal((2, 2, 5))
    grads, ref = run_backward(q, k, v, np.zeros_like(do), grad_lse=grad_lse,
                              is_causal=True)
    assert_grads_match(grads, ref, "float64")
    assert np.all(grads[2] == 0) and np.any(grads[0] != 0)


# --------------------------------------------------------------------------- #
# Dropout: the forward's keep-mask, recomputed
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rules", [False, True], ids=["plain", "every_rule"])
def test_dropout(rules, dtype):
    rng = np.random.default_rng(30)
    tq, tk = 7, 11
    q, k, v, do = draw(rng, (2,), 4, 2, tq, tk, 4, 3)
    options = {}
    if rules:
        options = dict(is_causal=True, alignment="bottom_right", window=(5, None),
                       softcap=2.5, alibi_slopes=rng.uniform(0.1, 0.5, (4,)),
                       key_lengths=np.array([11, 8]), mask=make_mask(rng, "bool", (2, 4, tq,
                                                                                  tk)))
    grad_lse = rng.standard_normal((2, 4, tq))
    grads, ref = run_backward(q, k, v, do, dtype=dtype, grad_lse=grad_lse,
                              dropout=(0.35, 2**33 + 17), **options)
    assert_grads_match(grads, ref, dtype)
    undropped, _ = run_backward(q, k, v, do, dtype=dtype, grad_lse=grad_lse, **options)
    assert rel_error(grads[2], undropped[2]) > 0.1  # dv saw the dropped weights


@pytest.mark.parametrize("launch", ["lanes", "split"])
def test_dropout_gradients_from_a_decoding_forward(launch):
    # The backward from the out and lse of the lane and split-key launches.
    rng = np.random.default_rng(31)
    q, k, v, do = draw(rng, (2,), 2, 1, 3, 21, 4, 4)
    tiles = dict(SMALL_TILES, decode=True, num_splits=1 if launch == "lanes" else 3)
    grads, ref = run_backward(q, k, v, do, dropout=(0.5, 8), forward_tiles=tiles,
                              is_causal=True, alignment="bottom_right",
                              key_lengths=np.array([21, 13]))
    assert_grads_match(grads, ref, "float64")


# --------------------------------------------------------------------------- #
# Masked rows, padding, layouts, edge cases
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_have_zero_gradients(kind):
    rng = np.random.default_rng(40)
    q, k, v, do = draw(rng, (2,), 2, 2, 6, 9, 4, 4)
    mask = make_mask(rng, kind, (2, 2, 6, 9))
    hidden = False if kind == "bool" else -np.inf
    mask[0, 1, 2, :] = hidden
    mask[1, :, 4:, :] = hidden
    grads, ref = run_backward(q, k, v, do, mask=mask, grad_lse=rng.standard_normal((2, 2, 6)))
    assert_grads_match(grads, ref, "float64")
    dq = grads[0]
    assert np.all(dq[0, 1, 2] == 0) and np.all(dq[1, :, 4:] == 0)


def test_keys_past_the_lengths_are_never_read():
    # NaN keys and values past each row's key length (and left of the window):
    # their dk and dv are 0, and nothing else turns NaN.
    rng = np.random.default_rng(41)
    q, k, v, do = draw(rng, (2,), 2, 1, 3, 16, 4, 4)
    lengths = np.array([16, 9])
    options = dict(window=(4, 0), is_causal=True, alignment="bottom_right",
                   key_lengths=lengths)
    _, ref = run_backward(q, k, v, do, **options)
    for b, n in enumerate(lengths):
        k[b, :, : n - 7] = v[b, :, : n - 7] = np.nan
        k[b, :, n:] = v[b, :, n:] = np.nan
    got = prepared(q, k, v, "float64", **options)
    kw = dict(mask=None, rules=rules_on_device(got.rules), scale=got.scale, xp=namespace())
    qkv = [convert_problem(a) for a in (got.q, got.k, got.v)]
    out, lse = numba_cuda.attention(*qkv, **kw, **SMALL_TILES)
    grads = [to_numpy(g) for g in numba_cuda.backward(*qkv, out, lse, to_library(do), **kw,
                                                      **BACKWARD_TILES)]
    assert_grads_match(grads, ref, "float64")
    for b, n in enumerate(lengths):
        assert np.all(grads[1][b, :, n:] == 0) and np.all(grads[2][b, :, n:] == 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_time_major_views(dtype):
    # layout="BTHE": q, k, v, out and dO as (B, T, H, E) arrays seen as (B, H, T, E).
    rng = np.random.default_rng(42)
    q, k, v, do = (np.swapaxes(np.ascontiguousarray(np.swapaxes(a.astype(dtype), 1, 2)), 1, 2)
                   for a in draw(rng, (2,), 3, 3, 7, 8, 4, 5))  # (B, H, T, E) views
    out, lse = reference_implementation.attention(q, k, v, mask=None, rules=causal(1, q, k),
                                                  scale=0.5, xp=np)
    ref = reference_implementation.backward(*(a.astype(np.float64) for a in (q, k, v, out,
                                                                             lse, do)),
                                            mask=None, rules=causal(1, q, k), scale=0.5,
                                            xp=np)

    def convert(a):
        if SIMULATOR:
            return a
        import cupy

        return cupy.swapaxes(cupy.asarray(np.ascontiguousarray(np.swapaxes(a, 1, 2))), 1, 2)

    grads = numba_cuda.backward(*(convert(a) for a in (q, k, v, out)), to_library(lse),
                                convert(do), mask=None, rules=causal(1, q, k), scale=0.5,
                                xp=namespace(), **BACKWARD_TILES)
    assert_grads_match([to_numpy(g) for g in grads], [np.asarray(g) for g in ref], dtype)


def test_inputs_are_not_modified():
    rng = np.random.default_rng(43)
    q, k, v, do = draw(rng, (1,), 2, 2, 5, 6, 4, 4)
    mask = make_mask(rng, "float", (1, 2, 5, 6))
    out, lse = (np.asarray(a) for a in reference_implementation.attention(
        q, k, v, mask=mask, rules=causal(None, q, k), scale=0.5, xp=np))
    grad_lse = rng.standard_normal((1, 2, 5))
    arrays = (q, k, v, out, lse, do, grad_lse, mask)
    copies = [a.copy() for a in arrays]
    if SIMULATOR:
        for a in arrays:
            a.flags.writeable = False
    numba_cuda.backward(*(to_library(a) for a in arrays[:6]), grad_lse=to_library(grad_lse),
                        mask=to_library(mask), rules=causal(None, q, k), scale=0.5,
                        xp=namespace(), **BACKWARD_TILES)
    for a, c in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("tq, tk", [(0, 5), (4, 0)], ids=["no_queries", "no_keys"])
def test_no_scores(tq, tk):
    rng = np.random.default_rng(44)
    q, k, v, do = draw(rng, (1,), 2, 2, tq, tk, 4, 3)
    out, lse = np.zeros((1, 2, tq, 3)), np.full((1, 2, tq), -np.inf)
    grads = [to_numpy(g) for g in numba_cuda.backward(
        *(to_library(a) for a in (q, k, v, out, lse, do)), mask=None,
        rules=causal(None, q, k), scale=0.5, xp=namespace())]
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(np.all(g == 0) for g in grads)


def test_dtypes_must_agree():
    rng = np.random.default_rng(45)
    q, k, v, do = draw(rng, (1,), 1, 1, 2, 3, 4, 4)
    out, lse = np.zeros((1, 1, 2, 4)), np.zeros((1, 1, 2))
    with pytest.raises(TypeError, match="`grad_out` has dtype float32"):
        numba_cuda.backward(*(to_library(a) for a in (q, k, v, out, lse,
                                                      do.astype(np.float32))),
                            mask=None, rules=causal(None, q, k), scale=1.0, xp=namespace())


def test_specializations_cover_every_combination():
    specs = list(numba_cuda_backward.specializations())
    per_kernel = (len(numba_cuda.DTYPES) * len(numba_cuda.HEAD_DIM_BUCKETS)
                  * len(numba_cuda.MASK_KINDS) * 2)
    assert len(specs) == 2 * per_kernel  # a dQ and a dK/dV kernel each
    assert len({fn.__name__ for fn, _ in specs}) == 2 * per_kernel
    assert len(list(numba_cuda_backward.specializations((64,)))) == 2 * per_kernel // len(
        numba_cuda.HEAD_DIM_BUCKETS)


# --------------------------------------------------------------------------- #
# The public API on the kernel
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("tq", [6, 20], ids=["rows", "tiled"])
@pytest.mark.parametrize("layout", ["BHTE", "BTHE"])
def test_attention_vjp_with_every_keyword(layout, tq, monkeypatch):
    """Through the public API: 6 query rows run the one-thread-per-row kernels
    (decoding shapes), 20 the register-tiled forward and backward kernels."""
    monkeypatch.setattr(rows, "BLOCK_Q", 8)
    rng = np.random.default_rng(60)
    q, k, v, do = draw(rng, (2,), 4, 2, tq, 11 + tq, 4, 3)
    grad_lse = rng.standard_normal((2, 4, tq))
    if layout == "BTHE":
        q, k, v, do = (np.swapaxes(a, 1, 2) for a in (q, k, v, do))
    options = dict(is_causal=True, causal_alignment="bottom_right", window=(4, 0),
                   softcap=2.5, alibi_slopes=rng.uniform(0.1, 0.5, (4,)), enable_gqa=True,
                   key_lengths=np.array([11 + tq, 7]), dropout_p=0.3, dropout_seed=5,
                   return_lse=True, layout=layout)
    (ref_out, ref_lse), ref_pullback = polyattn.attention_vjp(
        q, k, v, implementation="reference", **options)
    (out, lse), pullback = polyattn.attention_vjp(
        *(to_library(a) for a in (q, k, v)), implementation="numba_cuda",
        **dict(options, alibi_slopes=to_library(options["alibi_slopes"]),
               key_lengths=to_library(options["key_lengths"])))
    assert_matches(out, lse, np.asarray(ref_out), np.asarray(ref_lse), "float64")
    grads = pullback(to_library(do), to_library(grad_lse))
    ref = ref_pullback(do, grad_lse)
    assert_grads_match([to_numpy(g) for g in grads], [np.asarray(g) for g in ref], "float64")


# --------------------------------------------------------------------------- #
# A real GPU: production tiles
# --------------------------------------------------------------------------- #

gpu_only = pytest.mark.skipif(SIMULATOR, reason="larger shapes need a real GPU")


@gpu_only
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("head", [64, 128])
def test_gpu_production_tiles(head, dtype):
    rng = np.random.default_rng(50)
    q, k, v, do = draw(rng, (2,), 8, 2, 300, 420, head, head)
    options = dict(is_causal=True, alignment="bottom_right", window=(200, None), softcap=20.0,
                   alibi_slopes=rng.uniform(0.0, 0.05, (8,)), key_lengths=np.array([420, 250]))
    grads, ref = run_backward(q, k, v, do, dtype=dtype, dropout=(0.1, 3),
                              grad_lse=rng.standard_normal((2, 8, 300)), forward_tiles={},
                              backward_tiles={}, **options)
    assert_grads_match(grads, ref, dtype)


@pytest.mark.skipif(not SIMULATOR, reason="torch CPU tensors reach the kernel on the simulator "
                    "only (on a GPU the CuPy session tests CuPy arrays)")
@pytest.mark.parametrize("options", [
    {},
    {"is_causal": True, "causal_alignment": "bottom_right", "window": (2, 0), "softcap": 4.0},
    {"dropout_p": 0.25, "dropout_seed": 11, "enable_gqa": True},
], ids=["plain", "rules", "dropout_gqa"])
def test_torch_gradcheck_through_the_kernel(options, monkeypatch):
    """torch autograd reaches the kernel's backward pass (a ``torch.autograd.Function``):
    ``gradcheck`` in float64 on torch CPU tensors, which the simulator runs through NumPy
    views; the gradients also match the reference implementation's under torch autograd."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(rows, "BLOCK_Q", 8)
    rng = np.random.default_rng(5)
    hkv = 1 if options.get("enable_gqa") else 2
    q = torch.tensor(rng.standard_normal((1, 2, 5, 4)), requires_grad=True)
    k = torch.tensor(rng.standard_normal((1, hkv, 7, 4)), requires_grad=True)
    v = torch.tensor(rng.standard_normal((1, hkv, 7, 3)), requires_grad=True)
    explained = polyattn.explain(q, k, v, implementation="numba_cuda", **options)
    assert explained.implementation == "numba_cuda"

    def kernel(q, k, v):
        return polyattn.scaled_dot_product_attention(q, k, v, implementation="numba_cuda",
                                                     **options)

    out = kernel(q, k, v)
    assert out.grad_fn is not None and "FusedAttention" in type(out.grad_fn).__name__
    assert torch.autograd.gradcheck(kernel, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=True)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(0))
    mine = torch.autograd.grad(out, (q, k, v), g)
    ref = polyattn.scaled_dot_product_attention(q, k, v, implementation="reference", **options)
    theirs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(mine, theirs, strict=True):
        assert float((a - b).norm() / b.norm()) <= 1e-12


@pytest.mark.skipif(not SIMULATOR, reason="torch CPU tensors reach the kernel on the simulator "
                    "only (on a GPU the CuPy session tests CuPy arrays)")
def test_torch_autograd_through_the_tiled_kernels():
    """20 query rows: torch autograd runs the register-tiled forward and backward
    kernels (gradcheck's hundreds of launches are left to the small shapes above);
    the gradients match the reference implementation's under torch autograd."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    options = {"is_causal": True, "softcap": 4.0, "enable_gqa": True}
    q = torch.tensor(rng.standard_normal((1, 2, 20, 4)), requires_grad=True)
    k = torch.tensor(rng.standard_normal((1, 1, 23, 4)), requires_grad=True)
    v = torch.tensor(rng.standard_normal((1, 1, 23, 3)), requires_grad=True)
    assert "register-tiled" in str(polyattn.explain(q, k, v, implementation="numba_cuda",
                                                    **options))
    out = polyattn.scaled_dot_product_attention(q, k, v, implementation="numba_cuda", **options)
    assert out.grad_fn is not None and "FusedAttention" in type(out.grad_fn).__name__
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(0))
    mine = torch.autograd.grad(out, (q, k, v), g)
    ref = polyattn.scaled_dot_product_attention(q, k, v, implementation="reference", **options)
    theirs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(mine, theirs, strict=True):
        assert float((a - b).norm() / b.norm()) <= 1e-12
