"""The NumPy fast path's backward pass (implementations/numpy_vjp.py) and its forward dropout.

Every gradient is compared with ``reference.backward`` in float64 on the same
problem (float64: relative error <= 1e-12; float32: <= 1e-4 against the
float64 oracle of the float32-rounded inputs). Tiles are shrunk so the small
shapes here cross several query and key blocks, and each test runs both ways
the backward pass can go: two passes (key blocks, then query blocks) on one
thread, and the fused pass (one item per batch row and key/value head) on the
thread pool.
"""

from __future__ import annotations

import contextlib
import tracemalloc

import numpy as np
import pytest
from _support import NUMPY_SESSION_ONLY
from test_numpy_forward import items_on_threads

from polyattn._problem import prepare
from polyattn.backends.array_api import reference
from polyattn.backends.numpy import backward as numpy_vjp
from polyattn.backends.numpy import forward as numpy_chunked
from polyattn.rules.visibility import Rules

pytestmark = NUMPY_SESSION_ONLY

TOL = {"float32": 1e-4, "float64": 1e-12}
ALIGNMENTS = ["top_left", "bottom_right"]
SIZES = [(13, 13), (7, 17), (17, 7)]


@pytest.fixture(params=[(1, "two_pass"), (2, "fused")], ids=["two_pass", "fused_threads"])
def tiles(request, monkeypatch):
    """Small tiles; two passes inline, or the fused pass on two threads."""
    threads, mode = request.param
    monkeypatch.setattr(numpy_chunked, "BLOCK_Q", 6)
    monkeypatch.setattr(numpy_chunked, "BLOCK_K", 4)
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", threads)
    monkeypatch.setattr(numpy_vjp, "FUSED_MIN_PAIRS", 0 if mode == "fused" else 10**9)
    with items_on_threads() if threads > 1 else contextlib.nullcontext():
        yield mode


def problem(seed, *, b=2, h=4, hkv=2, tq=13, tk=17, e=5, ev=3):
    """Random q (B, H, Tq, E), k (B, Hkv, Tk, E), v (B, Hkv, Tk, Ev) in float64."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, h, tq, e)), rng.standard_normal((b, hkv, tk, e)),
            rng.standard_normal((b, hkv, tk, ev)))


def prepared(q, k, v, dtype_name, mask=None, **kw):
    """The validated problem (implementations' layout and rules) in ``dtype_name``."""
    def cast(x):
        x = np.asarray(x)
        return x.astype(dtype_name) if x.dtype.kind == "f" else x

    options = {"is_causal": False, "causal_alignment": "top_left", "scale": None,
               "enable_gqa": q.ndim >= 3 and q.shape[-3] != k.shape[-3]}
    options.update({name: cast(a) if isinstance(a, np.ndarray) else a for name, a in kw.items()})
    return prepare(cast(q), cast(k), cast(v), attn_mask=None if mask is None else cast(mask),
                   **options)


def call(module, pb, go, gl=None):
    """``module``'s forward on a prepared problem, then its backward: (out, lse, dq, dk, dv)."""
    kw = {**pb.arguments(), "xp": np}
    out, lse = module.attention(pb.q, pb.k, pb.v, **kw)
    grads = module.backward(pb.q, pb.k, pb.v, out, lse, go.astype(pb.q.dtype), grad_lse=gl, **kw)
    return (out, lse, *grads)


def rel(got, want):
    """‖got − want‖ / ‖want‖ (0 where both are 0)."""
    scale = np.linalg.norm(want)
    err = np.linalg.norm(np.asarray(got, dtype=np.float64) - want)
    return err if scale == 0 else err / scale


def check(q, k, v, dtype_name, mask=None, grad_lse=False, seed=0, **kw):
    """The NumPy path's out, lse and gradients against the float64 reference; returns them."""
    pb = prepared(q, k, v, dtype_name, mask, **kw)
    rounded = [x if x.dtype == bool else x.astype(dtype_name)
               for x in (q, k, v, np.zeros(0) if mask is None else mask)]
    pb64 = prepared(*rounded[:3], "float64", None if mask is None else rounded[3], **kw)
    rng = np.random.default_rng(seed)
    go = rng.standard_normal((*pb.q.shape[:-1], pb.v.shape[-1]))
    gl = rng.standard_normal(pb.q.shape[:-1]) if grad_lse else None
    got = call(numpy_chunked, pb, go, None if gl is None else gl.astype(dtype_name))
    want = call(reference, pb64, go, gl)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == np.dtype(dtype_name), name
        assert a.shape == b.shape, name
        assert not np.isnan(a).any(), name
        if name == "lse":
            np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
            a, b = np.where(np.isneginf(a), 0, a), np.where(np.isneginf(b), 0, b)
        assert rel(a, b) <= TOL[dtype_name], (name, rel(a, b))
    return got


def test_window_keys_out_of_reach_get_zero(tiles):
    """A key outside every query's window gets no gradient."""
    q, k, v = problem(6, tq=6, tk=20)
    _, _, _, dk, dv = check(q, k, v, "float64", window=(2, 2))   # rows 0..5 see keys 0..7
    assert np.all(dk[..., 8:, :] == 0) and np.all(dv[..., 8:, :] == 0)
    assert np.all(dk[..., :8, :] != 0)


@pytest.mark.parametrize("p", [0.2, 0.7])
def test_dropout(dtype_name, tiles, p):
    q, k, v = problem(13, tq=11, tk=14)
    for causal in (False, True):
        check(q, k, v, dtype_name, dropout_p=p, dropout_seed=1234, is_causal=causal)
    check(q, k, v, dtype_name, dropout_p=p, dropout_seed=2**40 + 7, softcap=2.0,
          window=(3, 1), key_lengths=np.array([14, 6]), grad_lse=True)


def test_fully_masked_rows(dtype_name, tiles):
    """Rows that see no key (bool mask, -inf float mask, causal): zero gradients, never NaN."""
    q, k, v = problem(15, tq=9, tk=10)
    rng = np.random.default_rng(16)
    mask = rng.random((2, 4, 9, 10)) < 0.5
    mask[0, :, 1] = False
    mask[1, 3, 7] = False
    mask[..., :4] = False                     # the first key tile is hidden from every row
    _, lse, dq, _, _ = check(q, k, v, dtype_name, mask, grad_lse=True)
    assert np.isneginf(lse[0, :, 1]).all() and np.isneginf(lse[1, 3, 7])
    assert np.all(dq[0, :, 1] == 0) and np.all(dq[1, 3, 7] == 0)
    fmask = np.where(mask, rng.standard_normal(mask.shape), -np.inf)
    _, _, dq, _, _ = check(q, k, v, dtype_name, fmask, grad_lse=True)
    assert np.all(dq[0, :, 1] == 0)
    # bottom-right causal with Tq > Tk: the first Tq - Tk rows see nothing
    q, k, v = problem(17, tq=12, tk=5)
    _, _, dq, _, _ = check(q, k, v, dtype_name, is_causal=True, causal_alignment="bottom_right",
                           grad_lse=True)
    assert np.all(dq[..., :7, :] == 0)


def bthe(dtype_name, *, b=2, tq=13, tk=17, h=4, hkv=2, e=5, ev=6, seed=18):
    """q, k, v as the (B, H, T, E) views of (B, T, H, E) arrays."""
    rng = np.random.default_rng(seed)
    arrays = (rng.standard_normal((b, tq, h, e)), rng.standard_normal((b, tk, hkv, e)),
              rng.standard_normal((b, tk, hkv, ev)))                     # (B, T, H, E)
    return [np.swapaxes(x.astype(dtype_name), 1, 2) for x in arrays]    # (B, H, T, E) views


def test_bthe_views(dtype_name, tiles, monkeypatch):
    """Strided inputs give the bits of contiguous ones, gradients in the inputs' memory order."""
    q, k, v = bthe(dtype_name)
    go = np.swapaxes(np.random.default_rng(19).standard_normal((2, 13, 4, 6)), 1, 2)
    go = go.astype(dtype_name)
    kw = {"mask": None, "rules": Rules(13, 17, causal=True, offset=2), "scale": 0.4, "xp": np}
    out, lse = numpy_chunked.attention(q, k, v, **kw)
    want = numpy_chunked.backward(*(np.ascontiguousarray(x) for x in (q, k, v, out)), lse,
                                  np.ascontiguousarray(go), **kw)

    def no_copy(*args, **kwargs):
        raise AssertionError("np.ascontiguousarray called on an input")

    monkeypatch.setattr(np, "ascontiguousarray", no_copy)
    got = numpy_chunked.backward(q, k, v, out, lse, go, **kw)
    for a, b in zip(got, want, strict=True):
        assert a.tobytes() == b.tobytes()
        assert np.swapaxes(a, 1, 2).flags.c_contiguous       # (B, T, H, E) order kept


@pytest.mark.parametrize(("block_q", "block_k"), [(1, 1), (5, 3), (8, 16), (1024, 256)])
def test_block_sizes(monkeypatch, block_q, block_k):
    monkeypatch.setattr(numpy_chunked, "BLOCK_Q", block_q)
    monkeypatch.setattr(numpy_chunked, "BLOCK_K", block_k)
    q, k, v = problem(20, tq=19, tk=23)
    for mode in (0, 10**9):
        monkeypatch.setattr(numpy_vjp, "FUSED_MIN_PAIRS", mode)
        check(q, k, v, "float64", is_causal=True, window=(6, None),
              alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]), dropout_p=0.3, dropout_seed=5)
        check(q, k, v, "float64", softcap=1.5, causal_alignment="bottom_right", is_causal=True)


@pytest.mark.parametrize("mode", [0, 10**9], ids=["fused", "two_pass"])
def test_threads_bitwise_identical(dtype_name, monkeypatch, mode):
    monkeypatch.setattr(numpy_chunked, "BLOCK_Q", 8)
    monkeypatch.setattr(numpy_chunked, "BLOCK_K", 16)
    monkeypatch.setattr(numpy_vjp, "FUSED_MIN_PAIRS", mode)
    q, k, v = problem(21, b=3, tq=45, tk=45, e=8, ev=8)
    pb = prepared(q, k, v, dtype_name, is_causal=True, dropout_p=0.1, dropout_seed=3)
    go = np.random.default_rng(22).standard_normal((3, 4, 45, 8))
    results = []
    with items_on_threads():
        for n in (1, 2, 3):
            monkeypatch.setattr(numpy_chunked, "NUM_THREADS", n)
            results.append(call(numpy_chunked, pb, go))
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            assert a.tobytes() == b.tobytes()


def test_inputs_not_modified(tiles):
    q, k, v = problem(23)
    pb = prepared(q, k, v, "float64", is_causal=True, dropout_p=0.2, dropout_seed=1,
                  key_lengths=np.array([17, 9]))
    kw = {**pb.arguments(), "xp": np}
    out, lse = numpy_chunked.attention(pb.q, pb.k, pb.v, **kw)
    rng = np.random.default_rng(24)
    go, gl = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    arrays = [pb.q, pb.k, pb.v, out, lse, go, gl]
    copies = [a.copy() for a in arrays]
    for a in arrays:
        a.flags.writeable = False
    numpy_chunked.backward(pb.q, pb.k, pb.v, out, lse, go, grad_lse=gl, **kw)
    for a, c in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(a, c)


def test_memory_follows_the_band(monkeypatch):
    """No (Tq, Tk) matrix: a causal backward at T = 4096 needs far less than T² floats."""
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 1)
    threadpoolctl = pytest.importorskip("threadpoolctl")
    t = 4096
    q, k, v = (x.astype(np.float32) for x in problem(25, b=1, h=1, hkv=1, tq=t, tk=t, e=8,
                                                       ev=8))
    kw = {"mask": None, "rules": Rules(t, t, causal=True), "scale": 0.3, "xp": np}
    out, lse = numpy_chunked.attention(q, k, v, **kw)
    tracemalloc.start()
    try:
        with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):   # (quick on busy cores)
            numpy_chunked.backward(q, k, v, out, lse, out, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < t * t * 4 / 8, f"{peak / 2**20:.1f} MiB"


# --- forward dropout ------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_forward_dropout_matches_reference_and_drops_the_same_weights(tiles, p):
    """With identity values the output is the dropped weights: the same zeros as the oracle's."""
    rng = np.random.default_rng(26)
    b, h, hkv, tq, tk = (2, 3), 4, 2, 10, 12
    q, k = rng.standard_normal((*b, h, tq, 5)), rng.standard_normal((*b, hkv, tk, 5))
    v = np.broadcast_to(np.eye(tk), (*b, hkv, tk, tk))
    for kw in ({}, {"is_causal": True, "causal_alignment": "bottom_right"},
               {"window": (4, 2), "key_lengths": np.array([[12, 5, 9], [0, 12, 1]])},
               {"scale": 40.0}):   # scores beyond exp's range: the exact path runs
        pb = prepared(q, k, v, "float64", dropout_p=p, dropout_seed=99, **kw)
        args = {**pb.arguments(), "xp": np}
        out, lse = numpy_chunked.attention(pb.q, pb.k, pb.v, **args)
        want_out, want_lse = reference.attention(pb.q, pb.k, pb.v, **args)
        weights = reference.weights(pb.q, pb.k, **args)
        np.testing.assert_array_equal(out == 0, weights == 0)
        np.testing.assert_allclose(out, weights, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
        # lse is of the scores before dropout: the same as without it
        undropped = prepared(q, k, v, "float64", **kw)
        _, lse0 = numpy_chunked.attention(undropped.q, undropped.k, undropped.v, **{
            **args, "rules": undropped.rules})
        np.testing.assert_array_equal(lse, lse0)


def test_forward_dropout_float32(tiles):
    q, k, v = problem(27)
    pb = prepared(q, k, v, "float32", dropout_p=0.4, dropout_seed=8, is_causal=True)
    pb64 = prepared(*(x.astype(np.float32) for x in (q, k, v)), "float64", dropout_p=0.4,
                    dropout_seed=8, is_causal=True)
    args = {"mask": None, "scale": pb.scale, "xp": np}
    out, _ = numpy_chunked.attention(pb.q, pb.k, pb.v, rules=pb.rules, **args)
    want, _ = reference.attention(pb64.q, pb64.k, pb64.v, rules=pb64.rules, **args)
    assert out.dtype == np.float32 and rel(out, want) <= 1e-5
