"""The fused Numba CPU kernel (implementation "numba_cpu"): its mechanics (exponential,
tiles, cache, compile notice, threads); the rules themselves are tests/test_rules.py's.

Runs where Numba is installed (``nox -s numba_cpu``); skipped elsewhere with the reason.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_close, assert_lse_close

import polyattn
from polyattn import scaled_dot_product_attention as sdpa

pytest.importorskip("numba", reason="the numba_cpu kernel needs Numba (pip install numba)")
from polyattn.backends.numba_cpu import compiler, launch
from polyattn.backends.numba_cpu.plan import Call
from polyattn.rules.visibility import Rules

# --- the exponential ---------------------------------------------------------------------

@pytest.mark.parametrize(("dtype", "tol"), [(np.float32, 2.5e-7), (np.float64, 1e-15)])
def test_exp_accuracy(dtype, tol):
    lo = compiler.EXP_MIN[np.dtype(dtype)]
    x = np.concatenate([np.linspace(lo, 0.0, 200001), -np.logspace(-30, 0, 301)]).astype(dtype)
    got = compiler.exp(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) <= tol


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_edges(dtype):
    lo = compiler.EXP_MIN[np.dtype(dtype)]
    x = np.array([-np.inf, np.nan, 0.0, -0.0, lo, np.nextafter(dtype(lo), dtype(-np.inf)),
                  -745.2, -1e30, 1e-30], dtype=dtype)
    got = compiler.exp(x)
    assert got[0] == 0.0                           # -inf
    assert np.isnan(got[1])                        # NaN stays NaN
    assert got[2] == 1.0 and got[3] == 1.0
    assert got[4] >= np.finfo(dtype).tiny          # the smallest argument: a normal result
    assert got[5] == 0.0 and got[6] == 0.0 and got[7] == 0.0   # subnormal results: 0
    assert abs(got[8] - 1.0) <= np.finfo(dtype).eps


# --- layouts, broadcasts and blocks (every rule against the oracle: test_rules.py) ----------

def _inputs(rng, b=2, h=4, hkv=2, tq=37, tk=300, e=8, ev=6):
    return (rng.standard_normal((b, h, tq, e)), rng.standard_normal((b, hkv, tk, e)),
            rng.standard_normal((b, hkv, tk, ev)))


def test_layouts_broadcasts_and_long_queries():
    """(B, T, H, E) views, a key/value batch axis broadcast, more queries than keys."""
    rng = np.random.default_rng(30)
    q = rng.standard_normal((3, 700, 4, 16))                 # (B, T, H, E)
    k = rng.standard_normal((1, 260, 2, 16))
    v = rng.standard_normal((1, 260, 2, 16))
    kw = {"is_causal": True, "causal_alignment": "bottom_right", "enable_gqa": True}
    got = sdpa(q, k, v, layout="BTHE", implementation="numba_cpu", **kw)
    want = sdpa(q, k, v, layout="BTHE", implementation="reference", **kw)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # every layout runs the two compiled signatures (no compilation per memory layout)
    assert len(compiler.kernels()["forward"].signatures) == 2


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_keys_a_boolean_mask_hides_cannot_poison_the_result(dtype):
    """NaN or inf in keys that a boolean mask hides stays out, forward and backward, as in
    the other paths (a float -inf mask adds to the score, so NaN propagates there)."""
    rng = np.random.default_rng(39)
    q, k, v = (x.astype(dtype) for x in _inputs(rng, b=1, tq=30, tk=200))
    k[..., 190:, :] = np.nan
    k[..., 180, 0] = np.inf
    mask = np.ones(200, dtype=bool)
    mask[180:] = False
    kw = {"attn_mask": mask, "enable_gqa": True}
    got = sdpa(q, k, v, implementation="numba_cpu", **kw)
    want = sdpa(q, k, v, implementation="chunked", **kw)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    g = np.ones_like(got)
    _, grads = _grads("numba_cpu", q, k, v, g, **kw)
    _, want_grads = _grads("chunked", q, k, v, g, **kw)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))


def test_concurrent_callers_get_the_sequential_results():
    rng = np.random.default_rng(33)
    problems = [_inputs(rng, tq=300, tk=300, e=32, ev=32) for _ in range(8)]
    problems = [tuple(x.astype(np.float32) for x in p) for p in problems]
    kw = {"enable_gqa": True, "is_causal": True, "implementation": "numba_cpu"}
    sequential = [sdpa(*p, **kw) for p in problems]
    results: list[np.ndarray | None] = [None] * 8
    start = threading.Barrier(8)

    def run(i):
        start.wait()
        results[i] = sdpa(*problems[i], **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, sequential, strict=True):
        np.testing.assert_array_equal(got, want)
    assert launch.threading_layer() in ("tbb", "omp", "workqueue")


# --- dropout and the backward pass ---------------------------------------------------------

def _grads(implementation, q, k, v, g, g_lse=None, **options):
    out, pullback = polyattn.attention_vjp(q, k, v, implementation=implementation,
                                           return_lse=g_lse is not None, **options)
    return out, pullback(g, g_lse) if g_lse is not None else pullback(g)


def test_gradients_with_lse_dropout_broadcasts_and_many_blocks():
    """grad_lse, dropout, a key/value batch broadcast, BTHE, more queries than a work item
    and keys than a block, a fully masked row and padding past key lengths."""
    rng = np.random.default_rng(37)
    q = rng.standard_normal((2, 700, 4, 16))                 # (B, T, H, E)
    k = rng.standard_normal((1, 600, 2, 16))
    v = rng.standard_normal((1, 600, 2, 8))
    mask = np.ones((700, 600), dtype=bool)
    mask[3] = False
    kw = {"layout": "BTHE", "enable_gqa": True, "attn_mask": mask, "softcap": 4.0,
          "key_lengths": np.array([600, 333]), "dropout_p": 0.2, "dropout_seed": 11}
    g = rng.standard_normal((2, 700, 4, 8))
    g_lse = rng.standard_normal((2, 4, 700))
    (out, lse), got = _grads("numba_cpu", q, k, v, g, g_lse, **kw)
    (want_out, want_lse), want = _grads("chunked", q, k, v, g, g_lse, **kw)
    np.testing.assert_allclose(out, want_out, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-11, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    assert np.all(got[0][:, 3] == 0)                         # the fully masked row
    assert np.all(got[1][1:, 600:] == 0)


def test_other_arrays_are_refused_with_the_reason():
    strict = pytest.importorskip("array_api_strict")
    qs = strict.asarray(np.zeros((1, 2, 8, 4)))
    with pytest.raises(ValueError, match=r"numba_cpu.*NumPy arrays"):
        sdpa(qs, qs, qs, implementation="numba_cpu")


# --- what "auto" does with it -----------------------------------------------------------------

def test_auto_takes_it_above_the_score_budget(monkeypatch):
    """Above NumPy's score budget "auto" runs the kernel, whatever BLAS's threads (the
    kernel calls no BLAS)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    monkeypatch.delenv("POLYATTN_NUMBA_CPU", raising=False)
    big = np.zeros((1, 4, 128, 16), dtype=np.float32)        # 256 KiB of scores
    small = np.zeros((1, 1, 16, 16), dtype=np.float32)       # 1 KiB
    for limit in (None, 1):
        with threadpoolctl.threadpool_limits(limit, user_api="blas"):
            chosen = polyattn.explain(big, big, big)
            assert chosen.implementation == "numba_cpu"
    # the reason is the rule that chose it, not speed figures of some machine
    assert "NUMPY_BLOCKED_PREFERENCE" in chosen.reason
    assert "NUMPY_SCORE_BUDGET_BYTES" in chosen.reason
    for text in (chosen.reason, *chosen.candidates.values()):
        assert not re.search(r"\d\.\d+\s*[x×]|torch", text), text
    assert chosen.candidates["numba_cpu"] == ""
    assert chosen.candidates["chunked"] == "numba_cpu comes first"
    assert "numba_cpu kernel:" in str(chosen)
    assert f"numba_cpu tiles: {compiler.tiles()}" in str(chosen)
    below = polyattn.explain(small, small, small)
    assert below.implementation == "reference"
    assert "fits" in below.candidates["numba_cpu"]
    assert polyattn.explain(big, big, big, dropout_p=0.1,
                            dropout_seed=3).implementation == "numba_cpu"
    got = sdpa(big + 1, big, big)                              # runs, and right
    np.testing.assert_allclose(got, sdpa(big + 1, big, big, implementation="reference"))
    for value in ("0", "off", "False"):
        monkeypatch.setenv("POLYATTN_NUMBA_CPU", value)
        off = polyattn.explain(big, big, big)
        assert off.implementation == "chunked"
        assert f"POLYATTN_NUMBA_CPU={value}" in off.candidates["numba_cpu"]
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "maybe")
    with pytest.raises(ValueError, match="POLYATTN_NUMBA_CPU"):
        polyattn.explain(big, big, big)
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "0")
    # by name it still runs
    assert polyattn.explain(big, big, big,
                            implementation="numba_cpu").implementation == "numba_cpu"


def test_auto_gradients_take_it_too(monkeypatch):
    """attention_vjp's "auto" runs the kernel's backward pass above the budget as well."""
    from polyattn import _dispatch
    from polyattn._problem import prepare

    monkeypatch.delenv("POLYATTN_NUMBA_CPU", raising=False)
    big = np.zeros((1, 4, 128, 16), dtype=np.float32)
    kw = {"attn_mask": None, "is_causal": False, "causal_alignment": "top_left",
          "scale": None, "enable_gqa": False}
    chosen = _dispatch.choose(prepare(big, big, big, **kw), "auto", return_lse=True,
                              for_vjp=True)
    assert chosen.implementation == "numba_cpu"
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "0")
    off = _dispatch.choose(prepare(big, big, big, **kw), "auto", return_lse=True,
                           for_vjp=True)
    assert off.implementation == "chunked"
    out, pullback = polyattn.attention_vjp(big + 1, big, big)
    monkeypatch.delenv("POLYATTN_NUMBA_CPU")
    got = polyattn.attention_vjp(big + 1, big, big)[1](np.ones_like(out))
    for a, b in zip(got, pullback(np.ones_like(out)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_falls_back_when_the_kernel_cannot_compile(monkeypatch):
    rng = np.random.default_rng(34)
    q, k, v = (x.astype(np.float32) for x in _inputs(rng, b=1, hkv=4, tq=64, tk=64))

    def broken(dtype=None, **_):
        raise compiler.KernelUnavailable("the numba_cpu kernel failed to compile: test")

    monkeypatch.setattr(compiler, "kernels", broken)
    got = sdpa(q, k, v)
    want = sdpa(q, k, v, implementation="chunked")
    np.testing.assert_array_equal(got, want)
    assert polyattn.explain(q, k, v).implementation == "numba_cpu"
    monkeypatch.setattr(compiler, "_failed", ["failed to compile: test"])
    chosen = polyattn.explain(q, k, v)
    assert chosen.implementation == "chunked"
    assert "failed to compile" in chosen.candidates["numba_cpu"]


def test_strided_features_and_views_forward_and_backward():
    """Keys/values whose features are not contiguous are copied per block (the kernel
    reads the others in place, negative and zero row strides included), forward and
    backward."""
    rng = np.random.default_rng(35)
    q, k, v = _inputs(rng, b=1, tq=600, tk=300, e=16, ev=16)
    cases = {
        "feature stride 2": (q[..., :8], k[..., ::2], v[..., ::2]),
        "reversed keys": (q, k[..., ::-1, :], v[..., ::-1, :]),
        "one key repeated": (q, np.broadcast_to(k[..., :1, :], k.shape),
                             np.broadcast_to(v[..., :1, :], v.shape)),
    }
    for name, (qq, kk, vv) in cases.items():
        want = sdpa(qq, kk, vv, enable_gqa=True, implementation="reference")
        got = sdpa(qq, kk, vv, enable_gqa=True, implementation="numba_cpu")
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)
        g = rng.standard_normal(got.shape)
        _, grads = _grads("numba_cpu", qq, kk, vv, g, enable_gqa=True)
        _, want_grads = _grads("reference", qq, kk, vv, g, enable_gqa=True)
        for a, b in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11, err_msg=name)


def test_backward_parts_of_dq_and_their_work_items(monkeypatch):
    """The backward pass's work items cover every block of keys once (part p of a head
    takes every ``parts``-th block from its p-th); dQ summed from several parts equals
    dQ from one (and the reference), and the same parts give the same bits whatever the
    number of threads (the parts do not depend on it); the parts stay within their memory
    budget."""
    from polyattn.backends.numba_cpu import gradients

    items = gradients.key_items(np.array([700, 300]), 2, 256, 3)
    covered = {(b, hk, k0) for b, hk, start, step, _, _ in items
               for k0 in range(start, (700, 300)[b], step)}
    assert covered == {(b, hk, k0) for b, n in enumerate((700, 300)) for hk in range(2)
                       for k0 in range(0, n, 256)}
    assert len(covered) == sum(len(range(s, (700, 300)[b], st))
                               for b, _, s, st, _, _ in items)        # none twice
    assert items[0][0] == 0 and set(items[:, 4]) == {0, 1, 2}
    assert gradients.part_count(64, 8, 1 << 20) == 1            # heads enough already
    assert gradients.part_count(2, 64, 1 << 20) == gradients.ITEMS // 2  # split the blocks
    assert gradients.part_count(1, 3, 1 << 20) == 3             # no more than the blocks
    assert gradients.part_count(1, 64, gradients.PART_BYTES) == 2        # memory bound

    rng = np.random.default_rng(36)
    q, k, v = _inputs(rng, b=1, tq=700, tk=700, e=16, ev=8)
    g = rng.standard_normal((1, 4, 700, 8))
    _, want = _grads("reference", q, k, v, g, enable_gqa=True, is_causal=True)
    got = {}
    for parts in (1, 3):
        monkeypatch.setattr(gradients, "part_count", lambda *a, _p=parts: _p)
        _, got[parts] = _grads("numba_cpu", q, k, v, g, enable_gqa=True, is_causal=True)
        for a, b in zip(got[parts], want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    import numba

    monkeypatch.undo()                       # the parts of the call itself, as chosen
    _, both = _grads("numba_cpu", q, k, v, g, enable_gqa=True, is_causal=True)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        _, alone = _grads("numba_cpu", q, k, v, g, enable_gqa=True, is_causal=True)
    finally:
        numba.set_num_threads(before)
    for a, b in zip(alone, both, strict=True):
        np.testing.assert_array_equal(a, b)


_LAYER = """
import hashlib, sys
import numba
import numpy as np
from polyattn import attention_vjp
rng = np.random.default_rng(37)
q = rng.standard_normal((2, 4, 333, 16))
k, v = (rng.standard_normal((2, 2, 333, 16)) for _ in range(2))
out, pull = attention_vjp(q, k, v, is_causal=True, enable_gqa=True, window=(200, 0),
                          implementation="numba_cpu")
grads = pull(rng.standard_normal(out.shape))
print(numba.threading_layer(), numba.get_num_threads(),
      hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes()
                              for a in (out, *grads))).hexdigest())
"""


def test_items_are_shared_out_by_the_kernel_whatever_the_threading_layer():
    """Each loop of a kernel takes the next work item from an atomic counter: every item
    runs once (the counter ends one past the last item per loop), and the results are
    bitwise the same under TBB, OpenMP and the work queue (those that load here)."""
    import subprocess

    from polyattn.backends.numba_cpu import threads

    rng = np.random.default_rng(38)
    q = rng.standard_normal((1, 3, 200, 8))
    call = Call(q, q, q, None, Rules(200, 200, causal=True), 0.5)
    items = call.query_items()
    out, lse = np.empty((1, 3, 200, 8)), np.empty((1, 3, 200))
    forward = compiler.kernels(np.float64)["forward"]
    counter = threads.counter(compiler.item_address("forward", np.float64))
    loops = min(int(counter[1]), len(items))
    threads.run(forward, *call.common(), items, call.fparams, call.iparams, out, lse, counter)
    assert counter[0] == len(items) + loops
    np.testing.assert_allclose(out, sdpa(q, q, q, is_causal=True, scale=0.5,
                                         implementation="reference"), rtol=1e-12, atol=1e-13)

    seen = {}
    for layer in ("tbb", "omp", "workqueue"):
        run = subprocess.run([sys.executable, "-c", _LAYER, layer], capture_output=True,
                             text=True, timeout=900, check=False,
                             env=dict(os.environ, NUMBA_NUM_THREADS="2",
                                      NUMBA_THREADING_LAYER=layer))
        if run.returncode == 0:
            name, count, digest = run.stdout.split()
            assert (name, count) == (layer, "2")
            seen[layer] = digest
    import platform

    # the numba extra installs TBB on x86-64; asked for by name, it loads
    assert "workqueue" in seen and ("tbb" in seen or platform.machine() not in (
        "x86_64", "AMD64")), seen
    assert len(set(seen.values())) == 1, seen


_WORDS = """
import numpy as np
from polyattn import scaled_dot_product_attention as sdpa
from polyattn.backends.numba_cpu import threads
print(threads.layer_in_words())
x = np.zeros((1, 1, 8, 4))
sdpa(x, x, x, implementation="numba_cpu")
print(threads.layer_in_words())
"""


def test_info_says_which_threading_layer_the_kernel_takes():
    """``polyattn info``'s threading layer: the one the first call will take (the one
    asked for by NUMBA_THREADING_LAYER), then the one in use."""
    import subprocess

    for layer in ("omp", "workqueue"):
        run = subprocess.run([sys.executable, "-c", _WORDS], capture_output=True, text=True,
                             timeout=900, check=False,
                             env=dict(os.environ, NUMBA_THREADING_LAYER=layer))
        if run.returncode != 0 and layer == "omp":
            continue                          # no OpenMP runtime here
        assert run.returncode == 0, run.stderr[-3000:]
        before, after = run.stdout.strip().splitlines()
        assert before == f"{layer} at the first call (NUMBA_THREADING_LAYER)"
        assert after == f"{layer} (in use in this process)"
    # a priority the user sets is kept, and said
    run = subprocess.run([sys.executable, "-c", _WORDS], capture_output=True, text=True,
                         timeout=900, check=False,
                         env=dict(os.environ, NUMBA_THREADING_LAYER_PRIORITY="workqueue tbb omp"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines() == [
        "workqueue at the first call (NUMBA_THREADING_LAYER_PRIORITY)",
        "workqueue (in use in this process)"]


def test_threading_layer_selectors_and_unknown_layers_in_words(monkeypatch):
    """NUMBA_THREADING_LAYER's selectors (threadsafe, …) are said to be selectors, and a
    value Numba does not know is said to stop the kernel."""
    from polyattn.backends.numba_cpu import threads

    monkeypatch.setattr(threads, "_layer_and_how", lambda: ("threadsafe", "selector"))
    assert "'threadsafe' layers" in threads.layer_in_words()
    monkeypatch.setattr(threads, "_layer_and_how", lambda: ("bogus", "selector"))
    assert "unknown to Numba" in threads.layer_in_words()
    monkeypatch.undo()
    monkeypatch.setenv("NUMBA_THREADING_LAYER", "Bogus")
    if threads.threading_layer() == "":
        assert threads._layer_and_how() == ("bogus", "selector")


# --- the register tiles ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_tiles_multiply_like_numpy(dtype):
    """Every tile shape the kernel uses (each row count up to 29: full tiles and every
    remainder), A read by rows, by columns (transposed), strided and backwards; storing
    and accumulating."""
    from numba import njit

    from polyattn.backends.numba_cpu import kernels as compiled
    from polyattn.backends.numba_cpu import tiles

    @njit
    def product(a, a_row, a_col, b, c, alpha, accumulate):
        compiled.tile_product(a.ctypes.data, a_row, a_col, c.shape[0], b.ctypes.data,
                              b.shape[1], c.ctypes.data, c.shape[1], b.shape[0], alpha,
                              accumulate, c.itemsize)

    rng = np.random.default_rng(5)
    dt = np.dtype(dtype)
    width = tiles.VECTOR_BYTES // dt.itemsize * tiles.TILE_VECTORS
    tol = 1e-5 if dt == np.float32 else 1e-13
    for rows in range(1, 30):
        for depth in (1, 7, 64):
            base = rng.standard_normal((2 * rows, 2 * depth)).astype(dt)
            b = rng.standard_normal((depth, width)).astype(dt)
            c = rng.standard_normal((rows, width)).astype(dt)
            views = {"rows": np.ascontiguousarray(base[:rows, :depth]),
                     "columns": np.asfortranarray(base[:rows, :depth]),
                     "strided": base[::2, ::2], "backwards": base[::-2, ::-2]}
            for name, a in views.items():
                a_row, a_col = (x // dt.itemsize for x in a.strides)
                want = 0.5 * (a.astype(np.float64) @ b)
                for accumulate in (False, True):
                    got = c.copy()
                    product(a, a_row, a_col, b, got, dt.type(0.5), accumulate)
                    expected = want + c if accumulate else want
                    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * depth,
                                               err_msg=f"{rows} x {depth}, {name}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_transpose_moves_every_element_and_no_other(dtype):
    """The block transpose (whole SIMD blocks in registers, the edges one by one) for
    sizes below, at and past a block, from strided rows into a larger destination whose
    other elements it must leave alone."""
    from numba import njit

    from polyattn.backends.numba_cpu import tiles

    @njit
    def transpose(src, dst, rows, cols):
        tiles.transpose(src.ctypes.data, src.strides[0] // src.itemsize, dst.ctypes.data,
                        dst.shape[1], rows, cols, dst.dtype.type(0))

    dt = np.dtype(dtype)
    lanes = tiles.VECTOR_BYTES // dt.itemsize
    rng = np.random.default_rng(11)
    sizes = sorted({1, lanes - 1, lanes, lanes + 1, 2 * lanes, 3 * lanes + 5})
    for rows in sizes:
        for cols in sizes:
            src = rng.standard_normal((rows, cols + 3)).astype(dt)    # rows 3 apart
            dst = np.full((cols + 2, rows + 4), -7.0, dtype=dt)
            transpose(src, dst, rows, cols)
            np.testing.assert_array_equal(dst[:cols, :rows], src[:, :cols].T,
                                          err_msg=f"{rows} x {cols}")
            untouched = np.ones(dst.shape, bool)
            untouched[:cols, :rows] = False
            assert (dst[untouched] == -7.0).all(), f"{rows} x {cols}: wrote outside"


def test_work_items_compiled_once_on_their_own():
    """The kernels call their work-item functions by address (kernels.call_at), so each is
    compiled once, on its own, not again into the kernel and each module of its parallel
    loop: the kernels' machine code in Numba's cache is a fraction of their items'."""
    found = compiler.kernels(np.float32)
    compiler.backward_kernel(np.float32)
    for kind, item in compiler.ITEMS.items():
        folder = Path(found[kind].stats.cache_path)
        sizes = {name: sum(p.stat().st_size for p in folder.glob(f"kernels.{name}-*.nbc"))
                 for name in (kind, item)}
        assert sizes[item] > 0, (folder, sizes)
        assert sizes[kind] < sizes[item] / 2, sizes
        assert compiler.item_address(kind, np.float32) > 0


def test_work_item_calls_check_their_arguments():
    """call_at takes only a work item's compiled argument types (a call by address with
    others would read its arguments wrongly), and a counter needs the item's address."""
    import numba

    from polyattn.backends.numba_cpu import kernels, threads

    @numba.njit
    def wrong(address, x):
        kernels.call_at(address, (x, x))

    with pytest.raises(numba.core.errors.TypingError, match="no work item"):
        wrong(1, np.zeros(3))
    with pytest.raises(ValueError, match="address"):
        threads.counter(0)
    sig = kernels.item_signature("forward", np.float32)
    assert sig == kernels.item_signature("forward", numba.float32)
    assert sig[-1] == numba.int64 and sig[:-1] == kernels.signature(np.float32).args[:-1]


def test_calls_skip_numba_dispatch_but_not_its_checks():
    """The kernels are called through their compiled entry points (no typing of every
    argument on every call); arguments the signature does not describe go to the
    dispatcher instead, which refuses them rather than reading memory wrongly."""
    from polyattn.backends.numba_cpu import threads

    q = np.random.default_rng(0).standard_normal((1, 2, 40, 8)).astype(np.float32)
    want = sdpa(q, q, q, is_causal=True, implementation="reference")
    assert_close(sdpa(q, q, q, is_causal=True, implementation="numba_cpu"), want, "float32")
    forward = compiler.kernels()["forward"]
    call = Call(q, q, q, None, Rules(40, 40, causal=True), 0.5)
    out = np.empty((1, 2, 40, 8), np.float32)
    lse = np.empty((1, 2, 40), np.float32)
    args = (*call.common(), call.query_items(), call.fparams, call.iparams, out, lse,
            threads.counter(compiler.item_address("forward", np.float32)))
    assert threads._entry(forward, args) is not forward            # the entry point
    wrong = list(args)
    wrong[-1] = lse.astype(np.float64)                              # lse in another dtype
    assert threads._entry(forward, tuple(wrong)) is forward
    with pytest.raises(TypeError):
        threads.run(forward, *wrong)
    wrong[-1] = lse[..., None]                                      # lse with one more axis
    assert threads._entry(forward, tuple(wrong)) is forward


def _guarded(shape, dtype, rng, at_end=True):
    """A C-contiguous array of ``shape`` whose last byte (or, with ``at_end=False``, first
    byte) touches a page that cannot be read: reading past it ends the process."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    pages = -(-nbytes // page)
    buf = mmap.mmap(-1, (pages + 2) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for start in (base, base + (pages + 1) * page):
        assert libc.mprotect(start, page, 0) == 0                # PROT_NONE
    offset = (pages + 1) * page - nbytes if at_end else page
    x = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset).view(dt)
    x = x.reshape(shape)
    x[...] = rng.standard_normal(shape)
    return x


_GUARDED = """
import sys
import numpy as np
sys.path[:0] = [{here!r}, {tests!r}]
from test_numba_cpu import _guarded
from polyattn import scaled_dot_product_attention as sdpa
from polyattn import attention_vjp
rng = np.random.default_rng(8)
worst = 0.0
for dtype in ("float32", "float64"):
    for e, ev, tq, tk, causal in [(1, 3, 5, 7, False), (3, 17, 33, 257, True),
                                  (16, 16, 40, 300, False), (20, 12, 65, 31, True),
                                  (64, 64, 1, 600, False)]:
        for at_end in (True, False):
            q = _guarded((1, 2, tq, e), dtype, rng, at_end)
            k = _guarded((1, 1, tk, e), dtype, rng, at_end)
            v = _guarded((1, 1, tk, ev), dtype, rng, at_end)
            kw = dict(enable_gqa=True, is_causal=causal, causal_alignment="bottom_right")
            got = sdpa(q, k, v, implementation="numba_cpu", **kw)
            want = sdpa(q, k, v, implementation="reference", **kw)
            worst = max(worst, float(np.abs(got - want).max()))
            out, pull = attention_vjp(q, k, v, implementation="numba_cpu", **kw)
            g = _guarded(out.shape, dtype, rng, at_end)
            grads = pull(g)
            _, ref_pull = attention_vjp(q, k, v, implementation="reference", **kw)
            for a, b in zip(grads, ref_pull(g)):
                worst = max(worst, float(np.abs(a - b).max() / max(1.0, np.abs(b).max())))
print("worst", worst)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect guard pages")
def test_no_read_outside_the_arrays():
    """Inputs that end (or begin) at an unreadable page, in shapes that leave every kind of
    remainder (features, keys, query rows, one query): the kernel reads only their
    elements (a read past one ends the child process), forward and backward."""
    import subprocess

    script = _GUARDED.format(here=str(Path(__file__).parent),
                             tests=str(Path(__file__).parents[2]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    worst = float(done.stdout.split("worst")[-1])
    assert worst < 1e-5


def test_calls_leave_the_cache_on_disk_to_explain(monkeypatch):
    """A call runs the choice without the kernel's own lines for ``explain()``: reading
    Numba's cache index on disk took half a millisecond per call. ``explain()`` still
    reports where the kernel stands."""
    asked = []
    real = compiler.cache_state
    monkeypatch.setattr(compiler, "cache_state", lambda *a: asked.append(a) or real(*a))
    q, k, v = _inputs(np.random.default_rng(7))
    sdpa(q, k, v, enable_gqa=True, implementation="numba_cpu")
    sdpa(q, k, v, enable_gqa=True, implementation="auto")
    _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True, implementation="numba_cpu")
    pullback(np.ones((2, 4, 37, 6)))
    assert asked == []
    report = polyattn.explain(q, k, v, enable_gqa=True, implementation="numba_cpu")
    assert asked and report.compiled == real("float64")


def test_info_says_which_tiles_the_kernel_runs(capsys):
    from polyattn import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"numba_cpu tiles: {compiler.tiles()}" in out
    assert "register tiles" in out


def test_warmup_caches_the_kernel_where_the_package_is_read_only(tmp_path):
    """``python -m polyattn warmup`` compiles into Numba's user-wide cache when no cache
    can be written next to the package; a second process loads it from there."""
    import os
    import shutil
    import stat
    import subprocess
    import sys

    src = Path(polyattn.__file__).resolve().parent
    copy = tmp_path / "site" / "polyattn"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    # a file where Numba would make its cache folder: unwritable even for root, which
    # permission bits do not stop
    (copy / "backends" / "numba_cpu" / "__pycache__").write_text("")
    for path in [copy, *copy.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    # compiled as users compile it, without the bounds checks the test sessions ask for
    # (a third longer to compile): where the cache goes is what is tested here
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR",
                                                               "NUMBA_BOUNDSCHECK")}
    env.update(PYTHONPATH=str(copy.parent), HOME=str(tmp_path / "home"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    try:
        runs = [subprocess.run([sys.executable, "-m", "polyattn", "warmup", "--dtype",
                                "float32"], env=env,
                               capture_output=True, text=True, timeout=600, check=False)
                for _ in range(2)]
    finally:
        for path in [copy, *copy.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert "compiling the numba_cpu" not in run.stderr    # warmup is the compile asked for
    assert "compiled in" in runs[0].stdout
    assert "(forward and backward, float32)" in runs[0].stdout
    assert "loaded from Numba's cache" in runs[1].stdout
    assert str(tmp_path) in runs[1].stdout                    # the user-wide cache
    assert not list(copy.rglob("*.nbi"))                      # nothing written to the package


@pytest.mark.parametrize("dtype", [None, "float32", "float64"])
def test_warmup_compiles_the_kernels_of_the_dtype_asked_for(monkeypatch, capsys, dtype):
    """``warmup --dtype`` compiles (or loads) that dtype's forward and backward kernels
    only; without it, both dtypes'."""
    from polyattn import cli

    asked = []
    monkeypatch.setattr(compiler, "kernels", lambda dt=None, announce=True: asked.append(
        ("forward", dt, announce)))
    monkeypatch.setattr(compiler, "backward_kernel", lambda dt=None, announce=True:
                        asked.append(("backward", dt, announce)))
    monkeypatch.setattr(compiler, "exp", lambda x: asked.append(("exp", x.dtype.name, False)))
    monkeypatch.setattr(compiler, "_states", {})
    assert cli.main(["warmup", *(["--dtype", dtype] if dtype else [])]) == 0
    exps = ["float32", "float64"] if dtype is None else [dtype]
    assert asked == [("forward", dtype, False), ("backward", dtype, False),
                     *(("exp", dt, False) for dt in exps)]
    said = capsys.readouterr().out.splitlines()[0]
    assert said.endswith(f"(forward and backward, {dtype or 'float32 and float64'})"), said


def test_warmup_says_what_happened_to_each_kernel(monkeypatch):
    """The forward kernel loaded from the cache and the backward one compiled (a forward
    call before warmup) is said so, not as one "loaded"."""
    compiler.backward_kernel(announce=False)
    for state, said in (("compiled", "forward loaded from Numba's cache, backward compiled"),
                        ("loaded", "loaded")):
        states = {(kind, dt): "loaded" if kind == "forward" else state
                  for kind in ("forward", "backward") for dt in ("float32", "float64")}
        monkeypatch.setattr(compiler, "_states", states)
        assert compiler.warmup()[0] == said


def test_a_call_compiles_the_kernels_of_its_own_dtype_only(tmp_path):
    """A float32 call compiles (or loads) the float32 kernels alone, forward then
    backward; float64 is compiled at its own first call; explain() says which."""
    import subprocess

    code = """
import numpy as np
from polyattn import attention_vjp
from polyattn.backends.numba_cpu import compiler
x = np.zeros((1, 1, 8, 4), dtype=np.float32)
out, pull = attention_vjp(x, x, x, implementation="numba_cpu")
print(sorted(compiler._states))
pull(out)
print(sorted(compiler._states))
print(compiler.cache_state(np.float32))
print(compiler.cache_state(np.float64))
y = x.astype(np.float64)
attention_vjp(y, y, y, implementation="numba_cpu")[1](y)
print(sorted(compiler._states))
print(len(compiler.kernels()["forward"].overloads), len(compiler.backward_kernel().overloads))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=900, check=False)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0] == "[('forward', 'float32')]"
    assert lines[1] == "[('backward', 'float32'), ('forward', 'float32')]"
    assert lines[2].startswith("forward and backward, float32: ")
    assert "in this process" in lines[2] and "float64" not in lines[2]
    # float64 is said to be cached or still to compile, not ready in this process
    assert lines[3].startswith("forward and backward, float64: ")
    assert "in this process" not in lines[3]
    assert lines[4] == ("[('backward', 'float32'), ('backward', 'float64'), "
                        "('forward', 'float32'), ('forward', 'float64')]")
    assert lines[5] == "2 2"


_NARROW = """
import numpy as np
from polyattn import attention_vjp
from polyattn.backends.numba_cpu import compiler, tiles
assert tiles.VECTOR_BYTES == 32 and tiles.TILE_ROWS == 6, compiler.tiles()
dtype = DTYPE  # defined above this: the dtype whose kernels to compile and check
rng = np.random.default_rng(4)
x = np.linspace(compiler.EXP_MIN[np.dtype(dtype)], 0.0, 10001).astype(dtype)
worst = float(np.abs(compiler.exp(x) / np.exp(x.astype(np.float64)) - 1.0).max())
for e, tq, tk, kw in [(5, 37, 300, {"is_causal": True}), (16, 20, 9, {"softcap": 3.0}),
                      (40, 70, 130, {"window": (30, 5)})]:
    q = rng.standard_normal((1, 4, tq, e)).astype(dtype)
    k, v = (rng.standard_normal((1, 2, tk, e)).astype(dtype) for _ in range(2))
    out, pull = attention_vjp(q, k, v, enable_gqa=True, implementation="numba_cpu", **kw)
    ref, ref_pull = attention_vjp(q, k, v, enable_gqa=True, implementation="reference", **kw)
    g = rng.standard_normal(out.shape).astype(dtype)
    for a, b in zip((out, *pull(g)), (ref, *ref_pull(g))):
        worst = max(worst, float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())))
print("worst", worst)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or
                    not Path("/proc/cpuinfo").read_text().count(" avx2"),
                    reason="compiles for an AVX2 x86-64 CPU")
@pytest.mark.parametrize(("dtype", "tol"), [("float32", 2e-5), ("float64", 1e-12)])
def test_the_32_byte_vector_kernel(tmp_path, dtype, tol):
    """The kernel as compiled for a CPU without AVX-512 (NUMBA_CPU_NAME=haswell: 32-byte
    vectors, 6 × 2 tiles, 2ⁿ built in the exponent bits), forward and backward, against
    the reference, in a child process with its own Numba cache (one per dtype: each
    compiles that dtype's kernels only)."""
    import os
    import subprocess

    features = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,"
                "+movbe,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=features,
               NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", f"DTYPE = {dtype!r}\n{_NARROW}"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    worst = float(done.stdout.split("worst")[-1])
    assert worst < tol, worst


# --- non-finite inputs (docs/semantics.rst, "Non-finite inputs") ---------------------------

@pytest.mark.parametrize(("name", "features", "expected"), [
    ("haswell", "", 32),              # the name's own features: AVX2
    ("generic", "", 32),
    ("znver4", "", 64),               # AMD Zen 4: AVX-512
    ("skylake-avx512", "", 64),
    ("znver4", "-avx512f", 32),       # features spelled out decide
    ("haswell", "+avx2,+fma,+avx512f", 64),
])
def test_vector_width_follows_numba_target(name, features, expected):
    """The tiles' vector width is the one LLVM compiles for under ``NUMBA_CPU_NAME`` and
    ``NUMBA_CPU_FEATURES``: an empty feature list means the CPU name's own (a host's
    AVX-512 would otherwise give AVX-512 instructions to an AVX2 target, which LLVM
    cannot select)."""
    from polyattn.backends.numba_cpu import tiles

    assert tiles.vector_bytes(name, features) == expected


def _finite_or_nan(got, want, dtype):
    """Entries no NaN reached are the clean result; NaN is allowed, a finite wrong number not."""
    ok = ~np.isnan(got)
    assert_close(got[ok], want[ok], dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_never_disappears(dtype, causal):
    """A query row holding NaN gives a NaN output row and lse; a NaN in a key makes every
    row that sees the key NaN, in a value that feature of every such row; entries the NaN
    did not reach are the clean result, or NaN where a causal mask hides the key in a
    panel, never a finite wrong number."""
    rng = np.random.default_rng(40)
    q, k, v = (x.astype(dtype) for x in _inputs(rng, tq=70, tk=300))
    kw = {"enable_gqa": True, "is_causal": causal, "causal_alignment": "top_left",
          "return_lse": True, "implementation": "numba_cpu"}
    clean, clean_lse = sdpa(q, k, v, **kw)
    j = 40                                        # seen by rows >= 40 under the causal mask
    sees = np.arange(70) >= j if causal else np.ones(70, dtype=bool)

    bad = q.copy()
    bad[1, 3, 33, 5] = np.nan
    out, lse = sdpa(bad, k, v, **kw)
    assert np.isnan(out[1, 3, 33]).all() and np.isnan(lse[1, 3, 33])
    rows = np.ones(out.shape[:-1], dtype=bool)
    rows[1, 3, 33] = False
    assert not np.isnan(out[rows]).any()
    assert_close(out[rows], clean[rows], dtype)

    bad = k.copy()
    bad[1, 0, j, 2] = np.nan                      # key head 0: query heads 0 and 1
    out, lse = sdpa(q, bad, v, **kw)
    assert np.isnan(out[1, :2][:, sees]).all() and np.isnan(lse[1, :2][:, sees]).all()
    _finite_or_nan(out[1, :2][:, ~sees], clean[1, :2][:, ~sees], dtype)
    assert not np.isnan(out[0]).any() and not np.isnan(out[1, 2:]).any()
    assert_close(out[0], clean[0], dtype)

    bad = v.copy()
    bad[1, 0, j, 4] = np.nan
    out, lse = sdpa(q, k, bad, **kw)
    assert np.isnan(out[1, :2][:, sees, 4]).all()
    _finite_or_nan(out[1, :2][:, ~sees, 4], clean[1, :2][:, ~sees, 4], dtype)
    keep = [0, 1, 2, 3, 5]
    assert not np.isnan(out[..., keep]).any() and not np.isnan(lse).any()
    assert_close(out[..., keep], clean[..., keep], dtype)
    assert_lse_close(lse, clean_lse, dtype)


def test_nan_never_disappears_through_auto(monkeypatch):
    """"auto" on NumPy arrays above the score budget runs this kernel: a NaN query row stays
    NaN, NaN and inf past key_lengths have no effect."""
    monkeypatch.delenv("POLYATTN_NUMBA_CPU", raising=False)
    rng = np.random.default_rng(41)
    q, k, v = (x.astype(np.float32) for x in _inputs(rng, tq=64, tk=200))
    lengths = np.array([200, 150])
    assert polyattn.explain(q, k, v, enable_gqa=True).implementation == "numba_cpu"
    want = sdpa(q, k, v, enable_gqa=True, key_lengths=lengths, implementation="reference")
    q[0, 1, 10, 0] = np.nan
    k[1, :, 150:] = np.nan
    v[1, :, 150:] = np.inf
    got = sdpa(q, k, v, enable_gqa=True, key_lengths=lengths)
    assert np.isnan(got[0, 1, 10]).all()
    rows = np.ones(got.shape[:-1], dtype=bool)
    rows[0, 1, 10] = False
    assert np.isfinite(got[rows]).all()
    assert_close(got[rows], want[rows], "float32")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_no_floating_point_warning_escapes(dtype):
    """The NumPy code around the kernel, forward and backward, raises and warns about
    nothing under the caller's np.errstate(all="raise"): inf and NaN in the query, an inf
    output row (from inf in a value) whose grad_lse is inf too (D = rowsum(dO∘O) - grad_lse
    is inf - inf there), a float mask beyond the dtype's range."""
    rng = np.random.default_rng(42)
    q, k, v = (x.astype(dtype) for x in _inputs(rng, b=1, tq=40, tk=60))
    q[0, 0, 3, 1] = np.inf
    q[0, 1, 4, 2] = np.nan
    v[0, 1, :, 0] = np.inf
    mask = rng.standard_normal((1, 1, 40, 60)) * 1e300          # float64, beyond float32
    kw = {"mask": None, "rules": Rules(40, 60, causal=True), "scale": 0.35, "xp": np}
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        out, lse = launch.attention(q, k, v, **kw)
        assert np.isnan(out[0, 1, 4]).all() and np.isnan(lse[0, 1, 4])
        assert not np.isfinite(out[0, 2:, :, 0]).any()          # the heads that read v head 1
        grad_lse = np.full(lse.shape, np.inf, dtype=dtype)
        grads = launch.backward(q, k, v, out, lse, np.ones_like(out), grad_lse=grad_lse,
                                   **kw)
        assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v), strict=True))
        masked, _ = launch.attention(q, k, v, **{**kw, "mask": mask})
        assert masked.shape == out.shape


# --- a compile that nothing cached: one line, on the "polyattn" logger ------------------------

_FIRST_CALL = """
import numpy as np
from polyattn import scaled_dot_product_attention as sdpa
q = np.ones((1, 2, 8, 4))
for dtype in ("float32", "float64"):
    sdpa(q.astype(dtype), q, q, implementation="numba_cpu")
print("ran")
"""


def test_a_compile_nothing_cached_is_announced_once(tmp_path):
    """With an empty Numba cache the first call says, in one line on stderr, that it
    compiles and that `python -m polyattn warmup` does it ahead; a process that finds the
    kernel in the cache says nothing."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_BOUNDSCHECK"}  # as users run
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")
    runs = [subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True,
                           text=True, timeout=900) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        assert "ran" in run.stdout
    lines = [line for line in runs[0].stderr.splitlines() if "polyattn warmup" in line]
    assert len(lines) == 1, runs[0].stderr
    assert lines[0].startswith("polyattn: compiling the numba_cpu forward kernel")
    assert str(tmp_path) in lines[0]
    assert "polyattn warmup" not in runs[1].stderr, runs[1].stderr


def test_the_compile_notice_is_a_log_record_the_user_can_silence(monkeypatch, caplog):
    """The notice is a WARNING record of logger "polyattn.numba_cpu" (no warnings module:
    nothing for -W error to turn into an exception); a "polyattn" logger above WARNING
    drops it; nothing is said where the cache holds the kernel or cannot be read."""
    seen = {"hit": False}
    monkeypatch.setattr(compiler, "_cached",
                        lambda function, sig: (seen["hit"], "/some/cache/folder"))
    with caplog.at_level(logging.WARNING, logger="polyattn"):
        compiler._announce_compile("forward", (np.float32, np.float64),
                                   [(None, None), (None, None)])
    assert [r.name for r in caplog.records] == ["polyattn.numba_cpu"]
    assert "(float32 and float64)" in caplog.records[0].getMessage()
    assert f"about {2 * compiler.SECONDS['forward']} s of CPU time" in caplog.records[
        0].getMessage()                                # the measured seconds, per dtype
    assert "/some/cache/folder" in caplog.records[0].getMessage()
    assert "`python -m polyattn warmup`" in caplog.records[0].getMessage()
    caplog.clear()
    for hit in (True, None):
        seen["hit"] = hit
        with caplog.at_level(logging.WARNING, logger="polyattn"):
            compiler._announce_compile("forward", (np.float32,), [(None, None)])
    assert not caplog.records
    seen["hit"] = False
    parent = logging.getLogger("polyattn")
    monkeypatch.setattr(parent, "level", logging.ERROR)
    caplog.set_level(logging.ERROR, logger="polyattn")
    compiler._announce_compile("backward", (np.float64,), [(None, None)])
    assert not [r for r in caplog.records if r.name.startswith("polyattn")]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_query_whose_scores_are_all_minus_inf_is_nan(dtype, bad):
    """inf in a query whose keys all have the opposite sign there makes every score of the
    row -inf: the kernel sees a fully masked row, the call gives NaN (out and lse); a fully
    masked row with a finite query is still 0 and -inf, the other rows are right."""
    rng = np.random.default_rng(43)
    q, k, v = (x.astype(dtype) for x in _inputs(rng, tq=30, tk=50))
    k[..., 0] = -np.sign(bad) * (np.abs(k[..., 0]) + 0.5)
    mask = np.ones((30, 50), dtype=bool)
    mask[8] = False
    kw = {"attn_mask": mask, "enable_gqa": True, "return_lse": True,
          "implementation": "numba_cpu"}
    clean, clean_lse = sdpa(q, k, v, **kw)
    q[1, 2, 5, 0] = bad
    out, lse = sdpa(q, k, v, **kw)
    assert np.isnan(out[1, 2, 5]).all() and np.isnan(lse[1, 2, 5])
    assert np.all(out[:, :, 8] == 0) and np.all(lse[:, :, 8] == -np.inf)
    rows = np.ones(out.shape[:-1], dtype=bool)
    rows[1, 2, 5] = False
    np.testing.assert_array_equal(out[rows], clean[rows])
    np.testing.assert_array_equal(lse[rows], clean_lse[rows])
    # keys and values broadcast over the batch; a strided view of the queries
    out1, lse1 = sdpa(q[:, :, 5:6], k[:1], v[:1], implementation="numba_cpu",
                      enable_gqa=True, return_lse=True)
    assert np.isnan(out1[1, 2, 0]).all() and np.isnan(lse1[1, 2, 0])
    assert np.isfinite(out1[0]).all() and np.isfinite(out1[1, [0, 1, 3]]).all()


# --- block masks -----------------------------------------------------------------------

def test_the_rows_of_a_block_mask_decide_where_the_mask_mod_runs():
    """The kernel leaves the mask_mod out of a row that its block mask calls solid (every
    key of the row's range visible) and skips the keys outside the range: a block mask
    whose rows say "causal, solid" gives the causal result for a mask_mod with holes;
    with its own rows, the holes are hidden."""
    import dataclasses

    from polyattn import ops

    def holes(b, h, q_idx, kv_idx):
        return ops.logical_and(q_idx >= kv_idx, (q_idx - kv_idx) % 3 != 1)

    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 80, 16)) for _ in range(3))
    bm = polyattn.block_mask(holes, None, None, 80, 80, block=(16, 16))
    assert not bm.rows[0, 2:, 2].any()                   # every row from the third has holes
    causal_rows = np.stack([np.zeros(80, np.int64), np.arange(1, 81), np.ones(80, np.int64)],
                           axis=-1)[None]
    solid = dataclasses.replace(bm, rows=causal_rows)
    out = sdpa(q, k, v, block_mask=solid, implementation="numba_cpu")
    assert_close(out, sdpa(q, k, v, is_causal=True, implementation="reference"), "float64")
    out = sdpa(q, k, v, block_mask=bm, implementation="numba_cpu")
    assert_close(out, sdpa(q, k, v, mask_mod=holes, implementation="reference"), "float64")
    narrow = np.stack([np.maximum(np.arange(80) - 4, 0), np.arange(1, 81),
                       np.ones(80, np.int64)], axis=-1)[None]   # a window of 5 keys
    out = sdpa(q, k, v, block_mask=dataclasses.replace(bm, rows=narrow),
               implementation="numba_cpu")
    assert_close(out, sdpa(q, k, v, is_causal=True, window=(4, 0), implementation="reference"),
                 "float64")
