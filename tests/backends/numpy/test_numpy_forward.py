"""The NumPy fast path (implementations/numpy_chunked.py) against the oracle and the Array-API path.

Tile sizes are shrunk so that the small shapes here span several query and
key tiles; every test runs with the thread pool on and off. Inputs may be the
(B…, H, T, E) views of (B…, T, H, E) arrays: no copy, the same bits, and an
output in the query's memory order.
"""

from __future__ import annotations

import contextlib
import tracemalloc

import numpy as np
import pytest
from _support import NUMPY_SESSION_ONLY
from helpers import assert_close, assert_lse_close, ref_attention

import polyattn
from polyattn import _preferences
from polyattn.backends.array_api import blocked as chunked
from polyattn.backends.numpy import forward as numpy_chunked
from polyattn.rules.visibility import Rules


def causal_rules(tq, tk, offset):
    """The rules of a causal mask ``j <= i + offset`` (``offset=None``: none)."""
    return Rules(tq, tk, causal=offset is not None, offset=offset or 0)

pytestmark = NUMPY_SESSION_ONLY


@contextlib.contextmanager
def items_on_threads():
    """The thread pool in use.

    As it is where the workers can hold their own BLAS to one thread; otherwise under a
    process-wide one-thread BLAS limit set here (the caller's choice, which the path
    then finds and uses).
    """
    if numpy_chunked.threading_mode() == "pool":
        yield
        return
    threadpoolctl = pytest.importorskip("threadpoolctl")
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        if numpy_chunked.threading_mode() != "pool":
            pytest.skip("no BLAS library found that runs on one thread: the NumPy path "
                        "runs its items inline")
        yield


@pytest.fixture(params=[1, 2], ids=["serial", "threads"])
def tiles(request, monkeypatch):
    """Small tiles (several per test shape), with the thread pool off or on."""
    monkeypatch.setattr(numpy_chunked, "BLOCK_Q", 6)
    monkeypatch.setattr(numpy_chunked, "BLOCK_K", 4)
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", request.param)
    with items_on_threads() if request.param > 1 else contextlib.nullcontext():
        yield request.param


def run(q, k, v, dtype_name, mask=None, **kw):
    """polyattn's "chunked" on NumPy arrays (the NumPy fast path), with out and lse."""
    args = [np.asarray(a, dtype=dtype_name) for a in (q, k, v)]
    if mask is not None and mask.dtype != bool:
        mask = mask.astype(dtype_name)
    return polyattn.scaled_dot_product_attention(*args, attn_mask=mask, return_lse=True,
                                                 implementation="chunked", **kw)


def check(got, ref, dtype_name):
    out, lse = got
    ref_out, ref_lse, _ = ref
    assert out.dtype == np.dtype(dtype_name)
    assert_close(out, ref_out, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


def test_dispatch_uses_numpy_path(monkeypatch):
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "0")   # where Numba is installed, it comes first
    q = np.zeros((1, 2, 256, 16), dtype=np.float32)
    e = polyattn.explain(q, q, q)
    assert e.implementation == "chunked"
    assert e.module == "polyattn.backends.numpy.forward"
    assert "numpy_chunked" in e.reason and "numpy_chunked" in str(e)
    # the rule that chose it (the budget and where it comes from), no machine's speed figures
    assert "32.0 KiB budget" in e.reason and "NUMPY_SCORE_BUDGET_BYTES" in e.reason
    for text in (e.reason, *e.candidates.values()):
        assert "measured" not in text and "torch" not in text, text
    small = polyattn.explain(q[:, :, :8], q[:, :, :8], q[:, :, :8])
    assert small.implementation == "reference"
    assert small.score_budget == _preferences.NUMPY_SCORE_BUDGET_BYTES


def test_dispatch_budget_override(monkeypatch):
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "0")
    q = np.zeros((1, 2, 256, 16), dtype=np.float32)
    monkeypatch.setenv("POLYATTN_SCORE_BUDGET", str(2**30))
    assert polyattn.explain(q, q, q).implementation == "reference"
    assert "POLYATTN_SCORE_BUDGET" in polyattn.explain(q, q, q).reason
    monkeypatch.setenv("POLYATTN_SCORE_BUDGET", "0")
    assert polyattn.explain(q[..., :1, :], q, q).implementation == "chunked"
    for bad in ("lots", "-5", "inf", "nan"):
        monkeypatch.setenv("POLYATTN_SCORE_BUDGET", bad)
        with pytest.raises(ValueError, match=f"POLYATTN_SCORE_BUDGET must be .*; got '{bad}'"):
            polyattn.explain(q, q, q)


def test_growing_and_shrinking_scores(dtype_name, tiles):
    """Row maxima that rise by far more than RESCALE_LIMIT, and scores that underflow."""
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((2, 10, 4)), rng.standard_normal((2, 21, 4)), \
        rng.standard_normal((2, 21, 3))
    k[0, :, 0] = np.linspace(-40, 120, 21)   # each key tile outweighs the previous one
    k[1, :, 0] = np.linspace(90, -200, 21)   # later tiles underflow against the first
    q[..., 0] = np.abs(q[..., 0]) + 0.5
    check(run(q, k, v, dtype_name, scale=1.0), ref_attention(q, k, v, scale=1.0), dtype_name)
    big = q * 300.0                         # every row far above exp's range unless shifted
    check(run(big, k, v, dtype_name), ref_attention(big, k, v), dtype_name)


def test_nan_confined_to_its_row(tiles):
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 11, 4)) for _ in range(3))
    q[1, 4, 2] = np.nan
    out, lse = run(q, k, v, "float64")
    ref, ref_lse, _ = ref_attention(np.where(np.isnan(q), 0.0, q), k, v)
    rows = np.ones((2, 11), dtype=bool)
    rows[1, 4] = False
    np.testing.assert_allclose(out[rows], ref[rows], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse[rows], ref_lse[rows], rtol=1e-12)
    expected, expected_lse = polyattn.scaled_dot_product_attention(
        q, k, v, return_lse=True, implementation="reference")
    np.testing.assert_array_equal(np.isnan(out[1, 4]), np.isnan(expected[1, 4]))
    assert np.isnan(lse[1, 4]) == np.isnan(expected_lse[1, 4])


def test_empty_queries_and_keys(tiles):
    q, k = np.ones((2, 0, 4)), np.ones((2, 5, 4))
    out, lse = polyattn.scaled_dot_product_attention(q, k, k, return_lse=True,
                                                     implementation="chunked")
    assert out.shape == (2, 0, 4) and lse.shape == (2, 0)
    out, lse = numpy_chunked.attention(np.ones((1, 2, 0, 4)), np.ones((1, 2, 5, 4)),
                                       np.ones((1, 2, 5, 3)), mask=None, rules=Rules(0, 5),
                                       scale=0.5, xp=np)
    assert out.shape == (1, 2, 0, 3) and lse.shape == (1, 2, 0)


def test_against_array_api_path(dtype_name, tiles, monkeypatch):
    monkeypatch.setattr(chunked, "BLOCK_Q", 5)
    monkeypatch.setattr(chunked, "BLOCK_K", 3)
    import array_api_compat.numpy as xp

    rng = np.random.default_rng(10)
    q = rng.standard_normal((2, 4, 12, 6)).astype(dtype_name)
    k = rng.standard_normal((2, 2, 17, 6)).astype(dtype_name)
    v = rng.standard_normal((2, 2, 17, 5)).astype(dtype_name)
    mask = rng.random((1, 4, 12, 17)) < 0.8
    kw = {"mask": mask, "rules": causal_rules(12, 17, 3), "scale": 0.4}
    out, lse = numpy_chunked.attention(q, k, v, xp=xp, **kw)
    ref_out, ref_lse = chunked.attention(q, k, v, xp=xp, **kw)
    assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype
    tol = 1e-5 if dtype_name == "float32" else 1e-12
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)


def test_threads_bitwise_identical(dtype_name, monkeypatch):
    monkeypatch.setattr(numpy_chunked, "BLOCK_Q", 8)
    monkeypatch.setattr(numpy_chunked, "BLOCK_K", 16)
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 4, 67, 8)).astype(dtype_name) for _ in range(3))
    results = []
    with items_on_threads():
        for n in (1, 2, 3):
            monkeypatch.setattr(numpy_chunked, "NUM_THREADS", n)
            results.append(run(q, k, v, dtype_name, is_causal=True))
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


def test_default_tiles_and_strided_read_only_inputs(dtype_name):
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 2, 600, 16))
    kt = rng.standard_normal((1, 2, 16, 700))
    k = np.swapaxes(kt, -1, -2)                     # a transposed view, not BLAS-ready
    v = rng.standard_normal((700, 1, 2, 8)).transpose(1, 2, 0, 3)
    for a in (q, kt, v):
        a.flags.writeable = False
    got = run(q, k, v, dtype_name, is_causal=True, causal_alignment="bottom_right")
    check(got, ref_attention(q, k, v, is_causal=True, alignment="bottom_right"), dtype_name)


def bthe_problem(dtype_name, *, b=2, tq=13, tk=17, h=4, hkv=2, e=5, ev=6, seed=13):
    """q, k, v as the (B, H, T, E) views of (B, T, H, E) arrays, and a mask."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, tq, h, e)).astype(dtype_name)      # (B, Tq, H, E)
    k = rng.standard_normal((b, tk, hkv, e)).astype(dtype_name)    # (B, Tk, Hkv, E)
    v = rng.standard_normal((b, tk, hkv, ev)).astype(dtype_name)   # (B, Tk, Hkv, Ev)
    mask = rng.random((1, h, tq, tk)) < 0.8
    return (*(np.swapaxes(x, 1, 2) for x in (q, k, v)), mask)      # (B, H, T, E) views


def test_bthe_views_give_the_bits_of_contiguous_inputs(dtype_name, tiles):
    q, k, v, mask = bthe_problem(dtype_name)
    assert not q.flags.c_contiguous and q.strides[-2] == 4 * 5 * q.itemsize
    for m, offset in [(None, None), (mask, 3), (None, 0)]:
        kw = {"mask": m, "rules": causal_rules(q.shape[-2], k.shape[-2], offset),
              "scale": 0.4, "xp": np}
        out, lse = numpy_chunked.attention(q, k, v, **kw)
        want_out, want_lse = numpy_chunked.attention(
            *(np.ascontiguousarray(x) for x in (q, k, v)), **kw)
        assert out.tobytes() == want_out.tobytes() and out.shape == want_out.shape
        assert lse.tobytes() == want_lse.tobytes()
        # out follows q's memory order: its (B, Tq, H, Ev) view is contiguous
        assert np.swapaxes(out, 1, 2).flags.c_contiguous
        assert want_out.flags.c_contiguous


def test_bthe_views_are_not_copied(dtype_name, monkeypatch):
    """No copy of q, k or v: peak memory as for contiguous inputs, and no ascontiguousarray."""
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 1)
    q, k, v, _ = bthe_problem(dtype_name, b=1, tq=512, tk=512, h=8, hkv=8, e=32, ev=32)
    contiguous = [np.ascontiguousarray(x) for x in (q, k, v)]

    def peak(arrays):
        tracemalloc.start()
        try:
            numpy_chunked.attention(*arrays, mask=None, rules=causal_rules(512, 512, 0),
                                    scale=0.3, xp=np)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def no_copy(*args, **kwargs):
        raise AssertionError("np.ascontiguousarray called on an input")

    base = peak(contiguous)
    monkeypatch.setattr(np, "ascontiguousarray", no_copy)
    assert peak((q, k, v)) < base + q.nbytes // 4, "a whole input was copied"


def test_bthe_view_of_values_goes_to_blas_as_it_is():
    """A (T, Ev) value matrix with row stride Hkv·Ev is BLAS-ready; other layouts are copied."""
    v = np.zeros((2, 7, 3, 5))                          # (B, Tk, Hkv, Ev)
    view = np.swapaxes(v, 1, 2)                         # (B, Hkv, Tk, Ev)
    assert numpy_chunked._blas_ready(view) is view
    transposed = np.swapaxes(view, -1, -2)              # unit stride across rows
    ready = numpy_chunked._blas_ready(transposed)
    assert ready is not transposed and ready.flags.c_contiguous
    np.testing.assert_array_equal(ready, transposed)
    overlapping = np.lib.stride_tricks.as_strided(v, (4, 6), (8, 8))   # row stride < a row
    assert numpy_chunked._blas_ready(overlapping) is not overlapping


@pytest.mark.parametrize("offset", [None, 0, 3, -2, 17, -40])
@pytest.mark.parametrize(("bq", "bk"), [(6, 4), (8, 3), (5, 16), (1, 1), (64, 64)])
def test_tiles_cover_each_visible_score_once(offset, bq, bk):
    """Every (query, key) pair a causal mask lets through is in exactly one rectangle."""
    tq, tk = 23, 29
    z = np.zeros((1, tq, 4))
    p = numpy_chunked._Problem(z, np.zeros((1, tk, 4)), np.zeros((1, tk, 4)), None, 1.0,
                               causal_rules(tq, tk, offset))
    seen = np.zeros((tq, tk), dtype=int)
    for q0 in range(0, tq, bq):
        q1 = min(q0 + bq, tq)
        for r0, r1, k0, k1 in numpy_chunked._tiles(p, q0, q1, bk):
            assert 0 <= r0 < r1 <= q1 - q0 and 0 <= k0 < k1 <= tk
            seen[q0 + r0:q0 + r1, k0:k1] += 1
    visible = np.ones((tq, tk), dtype=bool) if offset is None else \
        np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset
    assert (seen <= 1).all()
    np.testing.assert_array_equal(seen[visible], 1)
    # rows that see no key are in no rectangle
    assert (seen[~visible.any(axis=1)] == 0).all()


def test_hidden_keys_never_leak(tiles, dtype_name):
    """Keys the masks hide may be NaN or overflow the exponential: the result does not see them.

    The cheap path exponentiates before it zeroes hidden entries, so a hidden score
    that overflows, or is NaN, must still count for nothing. (A NaN or infinite
    *value* under a zero weight is another matter: 0 · NaN is NaN in every
    implementation's product with the values.)
    """
    rng = np.random.default_rng(21)
    tq, tk, e = 13, 19, 8
    q = np.abs(rng.standard_normal((2, 3, tq, e)))
    k = rng.standard_normal((2, 3, tk, e))
    v = rng.standard_normal((2, 3, tk, e))
    # key tq - 1 is seen by the last query row only (top-left causal); its score is huge
    # for every row, so the cheap path overflows on the rows it is hidden from
    k[..., tq - 1, :] = 1e3
    clean = k.copy()
    k[..., tq:, :] = np.nan                        # hidden from every row
    got = run(q, k, v, dtype_name, is_causal=True)
    check(got, ref_attention(q, clean[..., :tq, :], v[..., :tq, :], is_causal=True),
          dtype_name)
    # a boolean mask that hides a NaN key from every row, and the huge key from half
    mask = np.ones((tq, tk), dtype=bool)
    mask[:, 5] = False
    mask[::2, tq - 1] = False
    k2 = clean.copy()
    k2[..., 5, :] = np.nan
    clean[..., 5, :] = 0.0
    got = run(q, k2, v, dtype_name, mask=mask)
    check(got, ref_attention(q, clean, v, mask=mask), dtype_name)


# --- windows, soft-capping, ALiBi and key lengths (docs/semantics.rst) --------------------------

def oracle(q, k, v, mask=None, **kw):
    """polyattn's reference implementation in float64 on the same problem: (out, lse)."""
    def f64(x):
        x = np.asarray(x)
        return x.astype(np.float64) if x.dtype.kind == "f" else x

    kw = {name: f64(a) if isinstance(a, np.ndarray) else a for name, a in kw.items()}
    return polyattn.scaled_dot_product_attention(
        f64(q), f64(k), f64(v), attn_mask=None if mask is None else f64(mask),
        return_lse=True, implementation="reference", **kw)


def check_rules(q, k, v, dtype_name, mask=None, **kw):
    """The NumPy path in ``dtype_name`` against the float64 reference; returns (out, lse)."""
    got = run(q, k, v, dtype_name, mask, **kw)
    want_out, want_lse = oracle(q, k, v, mask, **kw)
    check(got, (want_out, want_lse, None), dtype_name)
    return got


def problem(seed, *, b=2, h=4, hkv=2, tq=13, tk=17, e=5, ev=3):
    """Random q (B, H, Tq, E), k (B, Hkv, Tk, E), v (B, Hkv, Tk, Ev) in float64."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, h, tq, e)), rng.standard_normal((b, hkv, tk, e)),
            rng.standard_normal((b, hkv, tk, ev)))


SIZES = [(13, 13), (7, 19), (19, 7)]
ALIGNMENTS = ["top_left", "bottom_right"]


def test_alibi_far_keys_underflow(dtype_name, tiles):
    """Steep slopes: far keys' scores underflow, near ones decide every row."""
    q, k, v = problem(34, h=2, hkv=2, tq=23, tk=29)
    slopes = np.array([4.0, 40.0], dtype=dtype_name)
    check_rules(q, k, v, dtype_name, alibi_slopes=slopes)
    check_rules(q, k, v, dtype_name, alibi_slopes=slopes, is_causal=True,
                causal_alignment="bottom_right")


def test_rows_outside_every_window(dtype_name, tiles):
    """Rows whose window holds no key (before the first, after the key length): 0, -inf."""
    q, k, v = problem(39, tq=19, tk=7)
    out, lse = check_rules(q, k, v, dtype_name, window=(1, 0), is_causal=True,
                           causal_alignment="bottom_right", enable_gqa=True)
    assert np.all(out[..., :12, :] == 0) and np.all(np.isneginf(lse[..., :12]))
    out, lse = check_rules(q, k, v, dtype_name, window=(2, 2), key_lengths=np.array([7, 3]),
                           enable_gqa=True)
    assert np.all(out[1, :, 5:] == 0) and np.all(np.isneginf(lse[1, :, 5:]))
    assert not np.isnan(out).any()


def test_rules_with_strided_read_only_inputs(dtype_name, tiles):
    """(B, H, T, E) views of (B, T, H, E) arrays: bits of contiguous inputs; inputs untouched."""
    q, k, v, mask = bthe_problem(dtype_name)
    slopes = np.linspace(0.1, 0.8, 4).astype(dtype_name)
    lengths = np.array([17, 9])
    before = [x.copy() for x in (q, k, v, slopes, lengths)]
    for x in (q, k, v, slopes, lengths):
        x.flags.writeable = False
    for alignment in ALIGNMENTS:
        kw = {"window": (4, 1), "softcap": 2.0, "alibi_slopes": slopes, "key_lengths": lengths,
              "is_causal": True, "causal_alignment": alignment, "enable_gqa": True,
              "attn_mask": mask, "return_lse": True, "implementation": "chunked"}
        out, lse = polyattn.scaled_dot_product_attention(q, k, v, **kw)
        want_out, want_lse = polyattn.scaled_dot_product_attention(
            *(np.ascontiguousarray(x) for x in (q, k, v)), **kw)
        assert out.tobytes() == want_out.tobytes() and lse.tobytes() == want_lse.tobytes()
        assert np.swapaxes(out, 1, 2).flags.c_contiguous
        ref_out, ref_lse = oracle(q, k, v, mask, **{n: kw[n] for n in (
            "window", "softcap", "alibi_slopes", "key_lengths", "is_causal",
            "causal_alignment", "enable_gqa")})
        check((out, lse), (ref_out, ref_lse, None), dtype_name)
        # layout="BTHE": the (B, T, H, E) arrays themselves
        bthe = polyattn.scaled_dot_product_attention(
            *(np.swapaxes(x, 1, 2) for x in (q, k, v)), layout="BTHE", **kw)
        np.testing.assert_array_equal(bthe[0], np.swapaxes(out, 1, 2))
    for x, x0 in zip((q, k, v, slopes, lengths), before, strict=True):
        np.testing.assert_array_equal(x, x0)


def test_rules_with_bthe_views_are_not_copied(dtype_name, monkeypatch):
    """No copy of q, k or v with a window, ALiBi and key lengths either."""
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 1)
    q, k, v, _ = bthe_problem(dtype_name, b=1, tq=512, tk=512, h=8, hkv=8, e=32, ev=32)
    rules = Rules(tq=512, tk=512, causal=True, window=(100, 0), key_lengths=np.array([400]),
                  alibi=np.full((1, 8), 0.1, dtype=dtype_name), softcap=5.0)

    def peak(arrays):
        tracemalloc.start()
        try:
            numpy_chunked.attention(*arrays, mask=None, rules=rules, scale=0.3, xp=np)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def no_copy(*args, **kwargs):
        raise AssertionError("np.ascontiguousarray called on an input")

    base = peak([np.ascontiguousarray(x) for x in (q, k, v)])
    monkeypatch.setattr(np, "ascontiguousarray", no_copy)
    assert peak((q, k, v)) < base + q.nbytes // 4, "a whole input was copied"


def test_rules_threads_bitwise_identical(dtype_name, monkeypatch):
    """Every rule at once: the same bits on 1, 2 or 3 threads (and inline)."""
    monkeypatch.setattr(numpy_chunked, "BLOCK_Q", 8)
    monkeypatch.setattr(numpy_chunked, "BLOCK_K", 16)
    q, k, v = (x.astype(dtype_name) for x in problem(40, b=3, h=4, hkv=2, tq=67, tk=80, e=8))
    rng = np.random.default_rng(41)
    kw = {"window": (20, 3), "softcap": 3.0, "enable_gqa": True, "is_causal": True,
          "alibi_slopes": rng.uniform(0.01, 0.3, size=(4,)).astype(dtype_name),
          "key_lengths": np.array([80, 0, 41]), "causal_alignment": "bottom_right"}
    mask = rng.random((67, 80)) < 0.9
    results = []
    with items_on_threads():
        for n in (1, 2, 3):
            monkeypatch.setattr(numpy_chunked, "NUM_THREADS", n)
            results.append(run(q, k, v, dtype_name, mask, **kw))
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])
    check(results[0], (*oracle(q, k, v, mask, **kw), None), dtype_name)


def _visible(rules, tq, tk, lengths=None):
    """Bool (B…, Tq, Tk) of §4.1's visibility (no attn_mask), written out element by element."""
    rows = []
    for n in ([tk] if lengths is None else lengths):
        off = n - tq if rules.lengths_shift else rules.offset
        left, right = rules.window or (None, None)
        ok = np.zeros((tq, tk), dtype=bool)
        for i in range(tq):
            p = i + off
            for j in range(n):
                ok[i, j] = ((not rules.causal or j <= p)
                            and (left is None or j >= p - left)
                            and (right is None or j <= p + right))
        rows.append(ok)
    return rows


@pytest.mark.parametrize("window", [None, (0, 0), (3, 0), (2, 6), (None, 2), (5, None)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize(("bq", "bk"), [(6, 4), (5, 16), (1, 1), (64, 64)])
def test_band_tiles_cover_each_visible_score_once(window, causal, shift, bq, bk):
    """Each score visible by window, causal mask and key length lies in exactly one rectangle."""
    tq, tk = 23, 29
    lengths = np.array([0, 29, 11, 1])
    rules = Rules(tq=tq, tk=tk, causal=causal, offset=tk - tq if shift else 0,
                  key_lengths=lengths, lengths_shift=shift, window=window)
    z = np.zeros((4, 1, tq, 4))
    p = numpy_chunked._Problem(z, np.zeros((4, 1, tk, 4)), np.zeros((4, 1, tk, 4)), None,
                               1.0, rules)
    for b, visible in enumerate(_visible(rules, tq, tk, lengths)):
        seen = np.zeros((tq, tk), dtype=int)
        for q0 in range(0, tq, bq):
            q1 = min(q0 + bq, tq)
            for r0, r1, k0, k1 in numpy_chunked._tiles(p, q0, q1, bk, (b,)):
                assert 0 <= r0 < r1 <= q1 - q0 and 0 <= k0 < k1 <= lengths[b]
                seen[q0 + r0:q0 + r1, k0:k1] += 1
        assert (seen <= 1).all()
        np.testing.assert_array_equal(seen[visible], 1)
        assert (seen[~visible.any(axis=1)] == 0).all()


def test_window_work_follows_the_band():
    """At T = 32768 with window (1024, 0), the scores computed grow with T·window, not T².

    The rectangles of the default tiles hold the band's T·1025 visible scores and
    a margin of at most the key block width per row.
    """
    areas = {}
    for t in (8192, 32768):
        rules = Rules(tq=t, tk=t, causal=True, window=(1024, 0))
        z = np.zeros((1, 1, t, 64), dtype=np.float32)
        p = numpy_chunked._Problem(z, z, z, None, 1.0, rules)
        area = 0
        for q0 in range(0, t, p.bq):
            for r0, r1, k0, k1 in numpy_chunked._tiles(p, q0, min(q0 + p.bq, t),
                                                       p.key_block(p.bq)):
                area += (r1 - r0) * (k1 - k0)
        assert area <= t * (1025 + p.block_k)
        areas[t] = area
    # each row past the first 8192 adds the same band, not more: no T² term
    assert (areas[32768] - areas[8192]) / (32768 - 8192) <= 1025 + p.block_k


def test_window_memory_follows_the_band(monkeypatch):
    """Peak extra memory of a windowed call at T = 8192: far below one T×T score matrix.

    Everything allocated during the call (tracemalloc), output and scratch included,
    against T²·itemsize = 256 MiB for the scores alone.
    """
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 2)
    t, h, e = 8192, 2, 16
    rng = np.random.default_rng(42)
    q, k, v = (rng.standard_normal((1, h, t, e)).astype(np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True, window=(1024, 0),
                                                    implementation="chunked")
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < t * t * 4 / 32, f"{peak / 2**20:.1f} MiB"
    # the last row sees exactly keys t - 1025 .. t - 1
    want, _ = oracle(q[..., -1:, :], k[..., -1025:, :], v[..., -1025:, :])
    assert_close(out[..., -1:, :], want, "float32")


def test_public_api_runs_the_numpy_path_with_rules():
    q = np.zeros((1, 2, 256, 16), dtype=np.float32)
    e = polyattn.explain(q, q, q, window=(16, 0), is_causal=True, softcap=3.0,
                         alibi_slopes=np.ones(2, dtype=np.float32), key_lengths=np.array([200]),
                         implementation="chunked")
    assert e.module == "polyattn.backends.numpy.forward"


# --- non-finite inputs (docs/semantics.rst, "Non-finite inputs") ---------------------------

def _sees(tq, tk, causal):
    """Bool (Tq, Tk): key j visible to query i (bottom-right alignment under causal)."""
    i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
    return j <= i + (tk - tq) if causal else np.ones((tq, tk), dtype=bool)


def _clean_or_nan(got, clean, dtype_name):
    """Entries that no NaN reached: the clean result; NaN allowed, a finite wrong number not."""
    finite = ~np.isnan(got)
    assert_close(got[finite], clean[finite], dtype_name)


@pytest.mark.parametrize("causal", [False, True])
def test_nan_never_disappears(dtype_name, tiles, causal):
    """A query row holding NaN gives a NaN output row and lse; a NaN in a key makes every
    row that sees that key NaN, a NaN in a value that feature of every such row; the other
    entries are the result of the clean inputs (or NaN, where a causal mask hides the key
    inside a tile), never a finite wrong number."""
    q, k, v = problem(44, tq=13, tk=17)          # (2, 4, 13, 5), key/value heads (2, 2, 17, ·)
    kw = {"is_causal": causal, "causal_alignment": "bottom_right", "enable_gqa": True}
    clean, clean_lse = run(q, k, v, dtype_name, **kw)
    sees = _sees(13, 17, causal)[:, 6]        # which query rows see key 6
    assert sees.any() and (causal == (not sees.all()))

    bad_q = q.copy()
    bad_q[1, 3, 5, 2] = np.nan
    out, lse = run(bad_q, k, v, dtype_name, **kw)
    assert np.isnan(out[1, 3, 5]).all() and np.isnan(lse[1, 3, 5])
    others = np.ones(out.shape[:-1], dtype=bool)
    others[1, 3, 5] = False
    assert not np.isnan(out[others]).any() and not np.isnan(lse[others]).any()
    assert_close(out[others], clean[others], dtype_name)

    bad_k = k.copy()
    bad_k[1, 0, 6, 1] = np.nan                   # key head 0 serves query heads 0 and 1
    out, lse = run(q, bad_k, v, dtype_name, **kw)
    assert np.isnan(out[1, :2][:, sees]).all() and np.isnan(lse[1, :2][:, sees]).all()
    _clean_or_nan(out[1, :2][:, ~sees], clean[1, :2][:, ~sees], dtype_name)
    np.testing.assert_array_equal(np.isnan(out[0]).any(), False)
    assert not np.isnan(out[1, 2:]).any()
    assert_close(out[0], clean[0], dtype_name)

    bad_v = v.copy()
    bad_v[1, 0, 6, 2] = np.nan
    out, lse = run(q, k, bad_v, dtype_name, **kw)
    assert np.isnan(out[1, :2][:, sees, 2]).all()
    _clean_or_nan(out[1, :2][:, ~sees, 2], clean[1, :2][:, ~sees, 2], dtype_name)
    assert not np.isnan(out[..., [0, 1]]).any() and not np.isnan(lse).any()
    assert_close(out[..., [0, 1]], clean[..., [0, 1]], dtype_name)
    assert_lse_close(lse, clean_lse, dtype_name)


def test_nan_never_disappears_through_auto(monkeypatch, dtype_name):
    """What "auto" runs on NumPy arrays above the score budget (the NumPy fast path where
    numba_cpu is left out) keeps a NaN query row NaN, and padding past key_lengths out."""
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "0")
    rng = np.random.default_rng(46)
    q, k, v = (rng.standard_normal((2, 4, 96, 16)).astype(dtype_name) for _ in range(3))
    assert polyattn.explain(q, k, v).module == "polyattn.backends.numpy.forward"
    lengths = np.array([96, 80])
    want = oracle(q, k, v, key_lengths=lengths)[0]
    q[0, 2, 40, 3] = np.nan
    k[1, :, 80:] = np.nan
    v[1, :, 80:] = np.inf
    out = polyattn.scaled_dot_product_attention(q, k, v, key_lengths=lengths)
    assert np.isnan(out[0, 2, 40]).all()
    rows = np.ones(out.shape[:-1], dtype=bool)
    rows[0, 2, 40] = False
    assert np.isfinite(out[rows]).all()
    assert_close(out[rows], want[rows], dtype_name)


def test_no_floating_point_warning_escapes(dtype_name, tiles):
    """inf and -inf in the query, scores so far apart that exponentials underflow, NaN in a
    key: the NumPy path itself (not only the public functions around it) gives no warning
    and no FloatingPointError, whatever the caller's np.errstate (the pool's workers have
    their own), and the values say what happened."""
    import warnings

    q, k, v = (x.astype(dtype_name) for x in problem(45, tq=13, tk=17, hkv=4))
    q *= 400                                     # exp underflows in float32 and float64
    q[0, 1, 4, 2] = np.inf
    q[1, 2, 7] = -np.inf
    q[0, 3, 9, 1] = np.nan
    k[1, 1, 3, 0] = np.nan
    slopes = np.array([[0.5, 0.25, 0.1, 0.0]], dtype=dtype_name)       # (B|1, H)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        for offset in (None, 0):
            out, lse = numpy_chunked.attention(q, k, v, mask=None,
                                               rules=causal_rules(13, 17, offset), scale=0.45,
                                               xp=np)
            assert np.isnan(out[0, 1, 4]).all() and np.isnan(out[1, 2, 7]).all()
            assert np.isnan(out[0, 3, 9]).all() and np.isnan(lse[0, 3, 9])
            assert np.isnan(out[1, 1]).any()                 # the head that reads key 3
            assert np.isfinite(out[0, [0, 2]]).all()
        rules = Rules(tq=13, tk=17, causal=True, window=(3, 1), softcap=2.0, alibi=slopes)
        out, lse = numpy_chunked.attention(q, k, v, mask=None, rules=rules, scale=0.45, xp=np)
        assert np.isnan(out[0, 3, 9]).all() and np.isfinite(out[0, 0]).all()
        out, _ = run(q, k, v, dtype_name, is_causal=True)    # and through the public function
        assert np.isnan(out[0, 3, 9]).all()


@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_query_whose_scores_are_all_minus_inf_is_nan(dtype_name, tiles, bad):
    """inf in a query whose keys all have the opposite sign there makes every score of the
    row -inf: not a fully masked row, so NaN (out and lse), not 0; a fully masked row with a
    finite query is still 0 and -inf, and the other rows are right."""
    q, k, v = problem(47, tq=13, tk=17)
    k[..., 0] = -np.sign(bad) * (np.abs(k[..., 0]) + 0.5)       # all opposite to ``bad``
    mask = np.ones((13, 17), dtype=bool)
    mask[8] = False                                              # a fully masked row
    clean = run(q, k, v, dtype_name, mask, enable_gqa=True)
    q[1, 2, 5, 0] = bad
    for causal in (False, True):
        out, lse = run(q, k, v, dtype_name, mask, enable_gqa=True, is_causal=causal)
        assert np.isnan(out[1, 2, 5]).all() and np.isnan(lse[1, 2, 5])
        assert np.all(out[:, :, 8] == 0) and np.all(lse[:, :, 8] == -np.inf)
        if not causal:
            rows = np.ones(out.shape[:-1], dtype=bool)
            rows[1, 2, 5] = False
            assert_close(out[rows], clean[0][rows], dtype_name)
            assert_lse_close(lse[rows], clean[1][rows], dtype_name)
