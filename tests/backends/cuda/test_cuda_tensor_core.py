"""Tests of the tensor-core kernel (``implementations/numba_cuda_tc.py``) and of the
``mma.sync`` fragment emulator (``implementations/_mma.py``).

The emulator's layouts are checked to cover each matrix exactly once and to
multiply like ``A @ B``; its number formats (float16, bfloat16, TF32 rounding)
against NumPy and hand-made cases. With ``NUMBA_ENABLE_CUDASIM=1`` the kernel
runs on Numba's simulator, every warp-wide instruction emulated through those
layouts (a wrong register index in the kernel gives a wrong product), and is
compared with polyattn's float64 reference on the values the kernel sees: f16
and bf16 operands exactly representable, the only rounding being P's (and
float32 sums). Where CuPy and a GPU are present, the same cases run on the
GPU, with the real ``mma.sync``, and the emulator is checked against it.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed", allow_module_level=True)

from polyattn.backends.cuda import mma as _mma

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"

# --------------------------------------------------------------------------- #
# The emulator
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("shape", list(_mma.SHAPES))
def test_fragment_layouts_cover_each_matrix_once(shape):
    m, n, k = _mma.SHAPES[shape]
    n_a, n_b = _mma.values_per_lane(shape)
    a = {_mma.a_position(shape, lane, i) for lane in range(32) for i in range(n_a)}
    b = {_mma.b_position(shape, lane, i) for lane in range(32) for i in range(n_b)}
    c = {_mma.c_position(lane, i) for lane in range(32) for i in range(4)}
    assert a == {(r, col) for r in range(m) for col in range(k)}
    assert b == {(r, col) for r in range(k) for col in range(n)}
    assert c == {(r, col) for r in range(m) for col in range(n)}


def test_fragment_layouts_match_the_ptx_tables():
    # Spot checks against the PTX ISA figures: lane 5 is group 1, thread 1.
    assert [_mma.a_position("m16n8k16", 5, i) for i in range(8)] == [
        (1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]
    assert [_mma.b_position("m16n8k16", 5, i) for i in range(4)] == [
        (2, 1), (3, 1), (10, 1), (11, 1)]
    assert [_mma.a_position("m16n8k8", 5, i) for i in range(4)] == [(1, 1), (9, 1), (1, 5),
                                                                    (9, 5)]
    assert [_mma.b_position("m16n8k8", 5, i) for i in range(2)] == [(1, 1), (5, 1)]
    assert [_mma.c_position(31, i) for i in range(4)] == [(7, 6), (7, 7), (15, 6), (15, 7)]


@pytest.mark.parametrize("shape", list(_mma.SHAPES))
def test_emulated_mma_is_a_product(shape):
    m, n, k = _mma.SHAPES[shape]
    rng = np.random.default_rng(1)
    a, b, c = rng.standard_normal((m, k)), rng.standard_normal((k, n)), rng.standard_normal(
        (m, n))
    d = _mma.mma(shape, _mma.fragments_a(shape, a), _mma.fragments_b(shape, b),
                 _mma.fragments_c(c))
    assert d.dtype == np.float32
    np.testing.assert_allclose(_mma.matrix_c(d), a @ b + c, rtol=1e-6, atol=1e-6)
    # A fragment put in the wrong lane changes the product.
    frags = _mma.fragments_a(shape, a)
    frags[[0, 1]] = frags[[1, 0]]
    wrong = _mma.mma(shape, frags, _mma.fragments_b(shape, b), _mma.fragments_c(c))
    assert not np.allclose(_mma.matrix_c(wrong), a @ b + c, atol=1e-3)


def test_ldmatrix_of_the_quadrants_is_the_a_fragment():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 16)).astype(np.float16).astype(np.float32)
    quadrants = [a[:8, :8], a[8:, :8], a[:8, 8:], a[8:, 8:]]
    registers = _mma.ldmatrix(quadrants)  # (32, 4, 2): lane, register, half
    np.testing.assert_array_equal(registers.reshape(32, 8), _mma.fragments_a("m16n8k16", a))
    # and a K tile's rows (keys) give the B fragments of two 8-key tiles
    k = rng.standard_normal((16, 16)).astype(np.float32)  # (keys, features)
    registers = _mma.ldmatrix([k[:8, :8], k[:8, 8:], k[8:, :8], k[8:, 8:]])
    for tile in range(2):
        b = k[8 * tile:8 * tile + 8].T  # B = Kᵀ: (features, keys)
        got = registers[:, 2 * tile:2 * tile + 2].reshape(32, 4)
        np.testing.assert_array_equal(got, _mma.fragments_b("m16n8k16", b))


def test_number_formats():
    x = np.array([1.0, -2.5, 65504.0, 1e-8, np.inf, -np.inf, np.nan, 1 + 2**-11, 3.14159],
                 dtype=np.float32)
    np.testing.assert_array_equal(_mma.from_f16_bits(_mma.f16_bits(x)),
                                  x.astype(np.float16).astype(np.float32))
    # bfloat16: the upper 16 bits, rounded to nearest even; NaN stays NaN.
    bf = _mma.from_bf16_bits(_mma.bf16_bits(x))
    assert bf[0] == 1.0 and bf[1] == -2.5 and np.isinf(bf[4]) and np.isnan(bf[6])
    assert _mma.from_bf16_bits(_mma.bf16_bits(np.float32(1 + 2**-8)))[()] == 1.0  # tie: even
    assert _mma.from_bf16_bits(_mma.bf16_bits(np.float32(1 + 3 * 2**-8)))[()] == 1 + 2**-6
    np.testing.assert_allclose(bf[np.isfinite(x)], x[np.isfinite(x)], rtol=2**-8)
    # TF32: 10 stored mantissa bits, ties away from zero.
    assert _mma.tf32_round(np.float32(1 + 2**-11))[()] == 1 + 2**-10
    assert _mma.tf32_round(np.float32(-(1 + 2**-11)))[()] == -(1 + 2**-10)
    assert _mma.tf32_round(np.float32(1 + 2**-12))[()] == 1.0
    t = _mma.tf32_round(x)
    assert np.isnan(t[6]) and np.isinf(t[4]) and t[5] == -np.inf
    big = _mma.tf32_round(np.float32(np.pi))
    small = _mma.tf32_round(np.float32(np.pi) - big)
    assert abs(float(big) + float(small) - float(np.float32(np.pi))) < 2**-20
    assert _mma.unpack(_mma.pack(0x1234, 0xABCD)) == (0x1234, 0xABCD)


# --------------------------------------------------------------------------- #
# The kernel
# --------------------------------------------------------------------------- #

def _gpu_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    try:
        import cupy

        if not cupy.cuda.is_available():
            return "no CUDA GPU"
    except Exception as exc:  # CUDA driver errors come in many types
        return f"CUDA is not usable ({exc})"
    return None


needs_kernel = pytest.mark.skipif(
    not SIMULATOR and _gpu_reason() is not None,
    reason=f"needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU with CuPy ({_gpu_reason()})")

if SIMULATOR or _gpu_reason() is None:
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

    from polyattn.backends.array_api import reference as reference_implementation
    from polyattn.backends.cuda import facade as numba_cuda
    from polyattn.backends.cuda import tensor_core as numba_cuda_tc

# Relative error against the float64 reference on the same operands: float16's
# contract (docs/semantics.rst, "dtypes"), bfloat16's rounding of P (8 bits), and float32's.
TOL = {"f16": 2e-3, "bf16": 1e-2, "3xtf32": 1e-5}


def operands(x, arithmetic):
    """float32 values exactly representable in the arithmetic's operand type."""
    x = np.asarray(x, dtype=np.float32)
    if arithmetic == "f16":
        return x.astype(np.float16).astype(np.float32)
    if arithmetic == "bf16":
        return _mma.from_bf16_bits(_mma.bf16_bits(x))
    return x


def run_tc(arithmetic, q, k, v, *, dropout=None, **options):
    """Tensor-core (out, lse) on the prepared float32 problem, and polyattn's reference
    on the same values in float64."""
    q, k, v = (operands(a, arithmetic) for a in (q, k, v))
    ref = prepared(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                   "float64", dropout=dropout, **options)
    ref_out, ref_lse = reference_implementation.attention(
        ref.q, ref.k, ref.v, mask=ref.mask, rules=ref.rules, scale=ref.scale, xp=ref.xp)
    got = prepared(q, k, v, "float32", dropout=dropout, **options)
    out, lse = numba_cuda_tc.attention(
        *(to_library(np.asarray(a)) for a in (got.q, got.k, got.v)),
        mask=None if got.mask is None else to_library(np.asarray(got.mask)),
        rules=rules_on_device(got.rules), scale=got.scale, xp=namespace(),
        arithmetic=arithmetic)
    return (to_numpy(out), to_numpy(lse)), (np.asarray(ref_out), np.asarray(ref_lse))


def assert_close(got, ref, arithmetic):
    (out, lse), (ref_out, ref_lse) = got, ref
    assert out.shape == ref_out.shape and out.dtype == np.float32
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_error(out, ref_out) <= TOL[arithmetic], rel_error(out, ref_out)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


# (batch, H, Hkv, Tq, Tk, E, Ev): two key tiles (64 keys) each, two query blocks
# (64 rows) where Tq > 64; E and Ev padded to the head bucket, GQA, odd sizes.
TC_SHAPES = {
    "head16": ((1,), 2, 1, 70, 100, 16, 16),
    "odd_sizes": ((1,), 1, 1, 67, 71, 13, 9),
    "head64": ((), 1, 1, 65, 80, 64, 64),
    "head128": ((), 1, 1, 20, 70, 100, 128),
}


@needs_kernel
@pytest.mark.parametrize("name, arithmetic", [
    (name, arithmetic) if (arithmetic == "f16" and name != "head16")
    or (arithmetic == "bf16" and name in ("head16", "odd_sizes"))
    else pytest.param(name, arithmetic, marks=pytest.mark.exhaustive)
    for name in TC_SHAPES for arithmetic in ("f16", "bf16")])
def test_shapes(name, arithmetic):
    batch, h, hkv, tq, tk, e, ev = TC_SHAPES[name]
    q, k, v = make_inputs(np.random.default_rng(1), batch, h, hkv, tq, tk, e, ev)
    assert_close(*run_tc(arithmetic, q, k, v), arithmetic)


@needs_kernel
def test_3xtf32_is_float32_accurate():
    q, k, v = make_inputs(np.random.default_rng(2), (1,), 2, 1, 40, 70, 24, 16)
    assert_close(*run_tc("3xtf32", q, k, v, is_causal=True), "3xtf32")


@needs_kernel
@pytest.mark.parametrize("alignment, kind", [
    ("top_left", "bool"), ("bottom_right", "float"),
    # the other two pairs take the same paths (noxfile.py's THOROUGH)
    pytest.param("top_left", "float", marks=pytest.mark.exhaustive),
    pytest.param("bottom_right", "bool", marks=pytest.mark.exhaustive)])
def test_causal_masks_and_fully_masked_rows(alignment, kind):
    rng = np.random.default_rng(3)
    q, k, v = make_inputs(rng, (2,), 2, 1, 66, 90, 16, 16)
    mask = make_mask(rng, kind, (2, 1, 66, 90))  # broadcast over heads
    mask[1, :, 5, :] = False if kind == "bool" else -np.inf
    (out, lse), ref = run_tc("f16", q, k, v, mask=mask, is_causal=True, alignment=alignment)
    assert_close((out, lse), ref, "f16")
    assert np.all(out[1, :, 5] == 0) and np.all(np.isneginf(lse[1, :, 5]))


@needs_kernel
def test_nan_rows_and_inputs_never_modified():
    rng = np.random.default_rng(6)
    q, k, v = (operands(a, "f16") for a in make_inputs(rng, (1,), 1, 1, 20, 70, 16, 16))
    q[0, 0, 3, 2] = np.nan
    copies = [a.copy() for a in (q, k, v)]
    out, lse = numba_cuda_tc.attention(*(to_library(a) for a in (q, k, v)), mask=None,
                                       rules=causal(None, q, k), scale=0.25, xp=namespace(),
                                       arithmetic="f16")
    out, lse = to_numpy(out), to_numpy(lse)
    assert np.isnan(out[0, 0, 3]).all() and np.isnan(lse[0, 0, 3])
    assert not np.isnan(np.delete(out, 3, axis=2)).any()
    for a, c in zip((q, k, v), copies, strict=True):
        np.testing.assert_array_equal(a, c)


@needs_kernel
def test_refuses_what_it_cannot_take():
    q = np.zeros((1, 1, 8, 16), np.float32)
    with pytest.raises(ValueError, match="8 query rows"):
        numba_cuda_tc.attention(q, q, q, mask=None, rules=causal(None, q, q), scale=1.0,
                                xp=namespace(), arithmetic="f16")
    big = to_library(np.zeros((1, 1, 32, 160), np.float32))
    with pytest.raises(ValueError, match="160 exceeds"):
        numba_cuda_tc.attention(big, big, big, mask=None, rules=causal(None, big, big),
                                scale=1.0, xp=namespace(), arithmetic="f16")
    # numba_cuda hands such calls to its exact kernel instead.
    out, _ = numba_cuda.attention(big, big, big, mask=None, rules=causal(None, big, big),
                                  scale=1.0, xp=namespace(), arithmetic="f16")
    assert to_numpy(out).shape == (1, 1, 32, 160)


@needs_kernel
def test_public_api_sends_float16_to_tensor_cores():
    import polyattn

    rng = np.random.default_rng(8)
    q, k, v = (to_library(a.astype(np.float16)) for a in
               make_inputs(rng, (1,), 2, 2, 33, 40, 16, 16))
    why = polyattn.explain(q, k, v, is_causal=True, implementation="numba_cuda")
    assert "tensor cores: float16 operands" in str(why)
    assert why.compute_dtype == "float32" and "computed in float32" in str(why)
    out = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                implementation="numba_cuda")
    assert str(out.dtype) == "float16"
    ref = polyattn.scaled_dot_product_attention(
        *(to_numpy(a).astype(np.float64) for a in (q, k, v)), is_causal=True,
        implementation="reference")
    assert rel_error(to_numpy(out), ref) <= 2e-3


def test_float32_choice(monkeypatch):
    from polyattn.backends.cuda import tensor_core as tc

    monkeypatch.delenv(tc.FLOAT32_VARIABLE, raising=False)
    assert tc.choose("float32", 128, 64, 64)[0] is None
    monkeypatch.setenv(tc.FLOAT32_VARIABLE, "3xTF32")
    assert tc.choose("float32", 128, 64, 64) == ("3xtf32", tc._DESCRIPTIONS["3xtf32"])
    assert tc.choose("float32", 128, 128, 128)[0] is None  # 3xTF32 stops at head size 64
    assert tc.choose("float64", 128, 64, 64)[0] is None
    monkeypatch.setenv(tc.FLOAT32_VARIABLE, "tf32")
    for dtype in ("float16", "float32", "float64"):  # checked whatever the call's dtype
        with pytest.raises(ValueError, match="POLYATTN_CUDA_FLOAT32='tf32'"):
            tc.choose(dtype, 128, 64, 64)
    monkeypatch.delenv(tc.FLOAT32_VARIABLE)
    monkeypatch.setenv("POLYATTN_CUDA_KERNEL", "fast")
    with pytest.raises(ValueError, match="POLYATTN_CUDA_KERNEL='fast'"):
        tc.choose("float16", 128, 64, 64)


def test_hmma_counts_per_step():
    from polyattn.backends.cuda import tensor_core as tc

    # Q Kᵀ: two 8-key tiles × (E / 16) k-steps; P V: one 16-key step × (Ev / 8) tiles.
    assert tc.hmma_per_step("f16", 64) == 2 * 4 + 8
    assert tc.hmma_per_step("bf16", 128) == 2 * 8 + 16
    assert tc.hmma_per_step("3xtf32", 64) == 3 * (2 * 8 + 2 * 8)
    assert tc.ldmatrix_per_step("f16", 64) == 4 + 4
    assert tc.ldmatrix_per_step("3xtf32", 64) == 0
    assert len(tc.specializations()) == (4 + 4 + 3) * 3 * 2


@pytest.mark.skipif(SIMULATOR or _gpu_reason() is not None,
                    reason="the real mma.sync needs a CUDA GPU with CuPy")
@pytest.mark.parametrize("arithmetic", ["f16", "bf16", "3xtf32"])
def test_emulator_matches_the_hardware(arithmetic):
    """One warp-wide mma.sync on the GPU, fragments placed by the emulator's layouts."""
    import cupy
    from numba import cuda, types

    ops = _mma.gpu_ops()
    shape = "m16n8k8" if arithmetic == "3xtf32" else "m16n8k16"
    mma_op = {"f16": ops.mma_f16, "bf16": ops.mma_bf16, "3xtf32": ops.mma_tf32}[arithmetic]
    m, n, k = _mma.SHAPES[shape]
    rng = np.random.default_rng(9)
    a = operands(rng.standard_normal((m, k)), arithmetic)
    b = operands(rng.standard_normal((k, n)), arithmetic)
    if arithmetic == "3xtf32":
        a, b = _mma.tf32_round(a), _mma.tf32_round(b)
        words_a = _mma.fragments_a(shape, a).astype(np.float32).view(np.uint32)
        words_b = _mma.fragments_b(shape, b).astype(np.float32).view(np.uint32)
    else:
        bits = _mma.f16_bits if arithmetic == "f16" else _mma.bf16_bits
        fa, fb = bits(_mma.fragments_a(shape, a)), bits(_mma.fragments_b(shape, b))
        words_a = (fa[:, 0::2].astype(np.uint32) | (fa[:, 1::2].astype(np.uint32) << 16))
        words_b = (fb[:, 0::2].astype(np.uint32) | (fb[:, 1::2].astype(np.uint32) << 16))

    @cuda.jit(types.void(types.uint32[:, ::1], types.uint32[:, ::1], types.float32[:, ::1]))
    def one_mma(wa, wb, d):
        lane = cuda.threadIdx.x
        zero = np.float32(0.0)
        r = mma_op(wa[lane, 0], wa[lane, 1], wa[lane, 2], wa[lane, 3], wb[lane, 0],
                   wb[lane, 1], zero, zero, zero, zero)
        for i in range(4):
            d[lane, i] = r[i]

    d = cupy.full((32, 4), np.nan, dtype=np.float32)
    one_mma[1, 32](cupy.asarray(np.ascontiguousarray(words_a)),
                   cupy.asarray(np.ascontiguousarray(words_b)), d)
    np.testing.assert_allclose(_mma.matrix_c(cupy.asnumpy(d)), a.astype(np.float64) @ b,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(SIMULATOR or _gpu_reason() is not None,
                    reason="the real ldmatrix needs a CUDA GPU with CuPy")
def test_ldmatrix_matches_the_hardware():
    """ldmatrix x4 from a shared tile on the GPU, against the emulator's layout."""
    import cupy
    from numba import cuda, types

    ldmatrix_x4 = _mma.gpu_ops().ldmatrix_x4
    words = np.arange(16 * 8, dtype=np.uint32).reshape(16, 8) * np.uint32(2654435761)

    @cuda.jit(types.void(types.uint32[:, ::1], types.uint32[:, ::1]))
    def load(source, out):
        tile = cuda.shared.array((16, 8), types.uint32, alignment=16)
        lane = cuda.threadIdx.x
        for i in range(4):
            tile[(lane * 4 + i) // 8, (lane * 4 + i) % 8] = source[(lane * 4 + i) // 8,
                                                                  (lane * 4 + i) % 8]
        cuda.syncthreads()
        # lane L: row L % 8 of matrix L // 8 = (row block L // 16, word block (L // 8) % 2)
        r = ldmatrix_x4(tile, (lane // 16) * 8 + lane % 8, 4 * ((lane // 8) % 2))
        for i in range(4):
            out[lane, i] = r[i]

    out = cupy.zeros((32, 4), dtype=np.uint32)
    load[1, 32](cupy.asarray(words), out)
    halves = words.view(np.uint16).reshape(16, 16)  # little-endian: low half first
    expected = _mma.ldmatrix([halves[:8, :8], halves[:8, 8:], halves[8:, :8], halves[8:, 8:]])
    np.testing.assert_array_equal(cupy.asnumpy(out),
                                  expected.reshape(32, 8).view(np.uint32).reshape(32, 4))
