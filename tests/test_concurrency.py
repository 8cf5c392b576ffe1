"""Concurrency and determinism: threads and repetitions give bitwise the same results.

Eight threads call polyattn at once (released together by a barrier) on
different problems; every result must equal, bit for bit, the one computed
before the threads started. Repeated calls must agree bit for bit too, and on
NumPy the blocked path's result must not depend on its number of threads.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _support import IMPLEMENTATIONS, SIMULATOR, assert_bitwise_equal, use_implementation
from helpers import Backend, to_numpy, to_xp

import polyattn
from polyattn.implementations import chunked

THREADS = 8


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, backend, monkeypatch):
    """Each implementation; blocks that split the problems below into a few each."""
    name = use_implementation(request.param, backend, monkeypatch)
    monkeypatch.setattr(chunked, "BLOCK_Q", 10)
    monkeypatch.setattr(chunked, "BLOCK_K", 16)
    return name


def calls(xp, device, implementation, *, tq=24, tk=40):
    """Eight different attention calls, as zero-argument functions returning NumPy arrays."""
    rng = np.random.default_rng(300)
    fns = []
    for i in range(THREADS):
        dtype = "float32" if i % 2 else "float64"
        h, hkv = (4, 2) if i % 4 == 3 else (2, 2)
        q = to_xp(rng.standard_normal((2, h, tq, 8)), xp, dtype=dtype, device=device)
        k = to_xp(rng.standard_normal((2, hkv, tk, 8)), xp, dtype=dtype, device=device)
        v = to_xp(rng.standard_normal((2, hkv, tk, 6)), xp, dtype=dtype, device=device)
        mask = None
        if i % 3 == 1:
            mask = to_xp(rng.random((tq, tk)) < 0.7, xp, device=device)
        elif i % 3 == 2:
            mask = to_xp(rng.standard_normal((2, 1, 1, tk)), xp, dtype=dtype, device=device)
        options = {"attn_mask": mask, "is_causal": i % 2 == 0, "enable_gqa": h != hkv,
                   "causal_alignment": "bottom_right" if i % 4 == 2 else "top_left"}

        def fn(q=q, k=k, v=v, options=options):
            out, lse = polyattn.scaled_dot_product_attention(
                q, k, v, return_lse=True, implementation=implementation, **options)
            return to_numpy(out), to_numpy(lse)

        fns.append(fn)
    return fns


def run_together(fns, repeats=2):
    """Run every function ``repeats`` times from ``THREADS`` threads released at once."""
    barrier = threading.Barrier(THREADS)

    def worker(start):
        barrier.wait(timeout=60)
        return [fns[(start + j) % len(fns)]() for j in range(repeats * len(fns) // THREADS)]

    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(worker, t) for t in range(THREADS)]
        return [(t, f.result(timeout=600)) for t, f in enumerate(futures)]


def small_shapes(backend, implementation):
    """The CUDA simulator runs one Python thread per CUDA thread: keep its problems tiny."""
    return implementation == "numba_cuda" and SIMULATOR


def test_threads_give_sequential_results(backend, xp, device, implementation):
    if implementation == "numba_cuda" and SIMULATOR:
        pytest.skip("the CUDA simulator is not thread-safe: while a kernel runs it swaps "
                    "the kernel module's `cuda` global for its fake module")
    sizes = {"tq": 5, "tk": 6} if small_shapes(backend, implementation) else {}
    fns = calls(xp, device, implementation, **sizes)
    expected = [fn() for fn in fns]
    for start, results in run_together(fns):
        for j, (out, lse) in enumerate(results):
            want_out, want_lse = expected[(start + j) % len(fns)]
            assert_bitwise_equal(out, want_out, f"thread {start}, call {j}: out")
            assert_bitwise_equal(lse, want_lse, f"thread {start}, call {j}: lse")


def test_other_functions_from_threads(backend, xp, device):
    """attention_weights, multi_head_attention, softmax and positional encodings in threads."""
    rng = np.random.default_rng(301)
    q = to_xp(rng.standard_normal((2, 3, 9, 4)), xp, device=device)
    k = to_xp(rng.standard_normal((2, 3, 11, 4)), xp, device=device)
    x = to_xp(rng.standard_normal((2, 9, 8)), xp, device=device)
    mha = polyattn.MultiHeadAttention(8, 2, num_kv_heads=1, xp=xp, dtype=xp.float64,
                                      device=device, seed=3)
    fns = [
        lambda: to_numpy(polyattn.attention_weights(q, k, is_causal=True,
                                                    causal_alignment="bottom_right")),
        lambda: to_numpy(mha(x, is_causal=True)),
        lambda: to_numpy(polyattn.multi_head_attention(x, x, x, mha.params, num_heads=2,
                                                       num_kv_heads=1, need_weights=True)[1]),
        lambda: to_numpy(polyattn.softmax(q, axis=-2)),
        lambda: to_numpy(polyattn.logsumexp(k, axis=-1)),
        lambda: to_numpy(polyattn.sinusoidal_positional_encoding(
            17, 8, xp=xp, device=device, dtype=xp.float32)),
        lambda: to_numpy(polyattn.causal_mask(5, 7, alignment="bottom_right", xp=xp,
                                              device=device)),
        lambda: to_numpy(polyattn.scaled_dot_product_attention(x, x, x, scale=0.5)),
    ]
    expected = [fn() for fn in fns]
    for start, results in run_together(fns):
        for j, got in enumerate(results):
            assert_bitwise_equal(got, expected[(start + j) % len(fns)],
                                 f"thread {start}, call {j}")


def test_repeated_calls_are_bitwise_identical(backend, xp, device, implementation):
    sizes = {"tq": 5, "tk": 6} if small_shapes(backend, implementation) else {}
    fns = calls(xp, device, implementation, **sizes)
    first = [fn() for fn in fns]
    for _ in range(2):
        for fn, (want_out, want_lse) in zip(fns, first, strict=True):
            out, lse = fn()
            assert_bitwise_equal(out, want_out)
            assert_bitwise_equal(lse, want_lse, "lse")


def test_numpy_blocked_path_ignores_its_thread_count(monkeypatch):
    """The NumPy fast path splits work over threads; no reduction crosses work items."""
    numpy_chunked = pytest.importorskip("polyattn.implementations.numpy_chunked")
    if not hasattr(numpy_chunked, "NUM_THREADS"):
        pytest.skip("the NumPy fast path has no thread-count setting")
    use_implementation("chunked", Backend.NUMPY, monkeypatch)
    fns = calls(np, None, "chunked", tq=37, tk=45)
    results = {}
    for n in (1, 2, 3, 8):
        monkeypatch.setattr(numpy_chunked, "NUM_THREADS", n)
        results[n] = [fn() for fn in fns]
    for n in (2, 3, 8):
        for (out, lse), (want_out, want_lse) in zip(results[n], results[1], strict=True):
            assert_bitwise_equal(out, want_out, f"{n} threads: out")
            assert_bitwise_equal(lse, want_lse, f"{n} threads: lse")
