"""Concurrency and determinism: threads and repetitions give bitwise the same results.

Eight threads call polyattn at once (released together by a barrier) on
different problems; every result must equal, bit for bit, the one computed
before the threads started. Repeated calls must agree bit for bit too, and on
NumPy the blocked path's result must not depend on its number of threads, even
when that number changes while other threads' calls run. Where NumPy's BLAS has
no thread-local setter, the NumPy path holds it to one thread while its pool
runs and gives the count back after the last overlapping call (or, with
``SHARED_BLAS = "leave"``, never changes it). A child started by ``fork`` after
the parent used the pool gets a pool of its own.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _support import IMPLEMENTATIONS, SIMULATOR, assert_bitwise_equal, use_implementation
from helpers import Backend, to_numpy, to_xp

import polyattn
from polyattn.backends.array_api import blocked as chunked
from polyattn.rules.visibility import Rules

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


def rules_of(q, k, *, causal):
    """The rules of a call of the NumPy path on ``q`` and ``k``: top-left causal, or none."""
    return Rules(q.shape[-2], k.shape[-2], causal=causal)


@contextlib.contextmanager
def items_on_threads(numpy_chunked):
    """The NumPy path's thread pool in use.

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


def blas_threads(threadpoolctl):
    """The thread count of every BLAS library, as the calling thread sees it."""
    return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]


def test_numpy_blocked_path_ignores_its_thread_count(monkeypatch):
    """The NumPy fast path splits work over threads; no reduction crosses work items."""
    numpy_chunked = pytest.importorskip("polyattn.backends.numpy.forward")
    if not hasattr(numpy_chunked, "NUM_THREADS"):
        pytest.skip("the NumPy fast path has no thread-count setting")
    use_implementation("chunked", Backend.NUMPY, monkeypatch)
    fns = calls(np, None, "chunked", tq=37, tk=45)
    results = {}
    with items_on_threads(numpy_chunked):
        for n in (1, 2, 3, 8):
            monkeypatch.setattr(numpy_chunked, "NUM_THREADS", n)
            results[n] = [fn() for fn in fns]
    for n in (2, 3, 8):
        for (out, lse), (want_out, want_lse) in zip(results[n], results[1], strict=True):
            assert_bitwise_equal(out, want_out, f"{n} threads: out")
            assert_bitwise_equal(lse, want_lse, f"{n} threads: lse")


def test_numpy_path_leaves_other_threads_blas_alone(monkeypatch):
    """With SHARED_BLAS = "leave", another thread sees BLAS's thread count unchanged while a
    NumPy-path call runs."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from polyattn.backends.numpy import forward as numpy_chunked

    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", None)   # every core
    monkeypatch.setattr(numpy_chunked, "SHARED_BLAS", "leave")
    before = blas_threads(threadpoolctl)
    rng = np.random.default_rng(302)
    q, k, v = (rng.standard_normal((1, 8, 1024, 64)) for _ in range(3))   # 0.3 to 3 s
    done = threading.Event()

    def call():
        try:
            return numpy_chunked.attention(q, k, v, mask=None,
                                           rules=rules_of(q, k, causal=False), scale=0.125,
                                           xp=np)
        finally:
            done.set()

    seen = []
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(call)
        while not done.wait(0.005):
            seen.append(blas_threads(threadpoolctl))
        future.result()
    assert len(seen) >= 3, f"only {len(seen)} reads while the call ran: make it longer"
    assert all(s == before for s in seen), f"BLAS threads {before} before, then {seen}"
    assert blas_threads(threadpoolctl) == before


def test_numpy_path_thread_count_changed_during_calls(monkeypatch):
    """Threads call with different NUM_THREADS, changed as they go: same bits, no error.

    The pool starts empty and grows while calls use it (a larger pool replaces a
    smaller one that calls still hold).
    """
    from polyattn.backends.numpy import forward as numpy_chunked

    monkeypatch.setattr(numpy_chunked, "BLOCK_Q", 8)
    monkeypatch.setattr(numpy_chunked, "BLOCK_K", 16)
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 1)
    monkeypatch.setattr(numpy_chunked, "_pool", None)
    monkeypatch.setattr(numpy_chunked, "_pool_size", 0)
    rng = np.random.default_rng(303)
    q, k, v = (rng.standard_normal((2, 4, 67, 8)) for _ in range(3))

    def call():
        return numpy_chunked.attention(q, k, v, mask=None, rules=rules_of(q, k, causal=True),
                                       scale=0.3, xp=np)

    want_out, want_lse = call()
    barrier = threading.Barrier(THREADS)

    def worker(t):
        barrier.wait(timeout=60)
        results = []
        for j in range(6):
            numpy_chunked.NUM_THREADS = (t + 3 * j) % 7 + 1   # 1..7, changed by every thread
            results.append(call())
        return results

    with items_on_threads(numpy_chunked), ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(worker, t) for t in range(THREADS)]
        results = [(t, f.result(timeout=600)) for t, f in enumerate(futures)]
    assert 1 < numpy_chunked._pool_size <= 7               # grown while in use
    for t, calls_of_t in results:
        for j, (out, lse) in enumerate(calls_of_t):
            assert_bitwise_equal(out, want_out, f"thread {t}, call {j}: out")
            assert_bitwise_equal(lse, want_lse, f"thread {t}, call {j}: lse")


def test_numpy_path_workers_hold_their_own_blas_to_one_thread(monkeypatch):
    """Where BLAS has a thread-local setter, each worker runs BLAS on one thread."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from polyattn.backends.numpy import forward as numpy_chunked

    libs = numpy_chunked._blas_libraries()
    lacking = [f"{lib.internal_api} {lib.version} ({getattr(lib, 'threading_layer', '?')})"
               for lib, setter in libs if setter is None]
    if not libs or lacking:
        pytest.skip("no thread-local BLAS thread count in " + (", ".join(lacking) or
                    "the BLAS libraries found (none)") + ": the NumPy path holds such a "
                    "BLAS to one thread process-wide instead (SHARED_BLAS)")
    before = blas_threads(threadpoolctl)
    seen = []
    lock = threading.Lock()

    def record():
        with lock:
            seen.append((threading.get_ident(), blas_threads(threadpoolctl)))

    numpy_chunked._run_jobs([record] * 8, 2)
    assert {ident for ident, _ in seen} - {threading.get_ident()}
    assert all(threads == [1] * len(threads) for _, threads in seen), seen
    assert blas_threads(threadpoolctl) == before


def test_numpy_path_without_thread_local_blas_runs_inline(monkeypatch):
    """With SHARED_BLAS = "leave", where BLAS has several threads and no thread-local setter,
    no worker runs an item."""
    pytest.importorskip("threadpoolctl")
    from polyattn.backends.numpy import forward as numpy_chunked

    monkeypatch.setattr(numpy_chunked, "SHARED_BLAS", "leave")
    libs = numpy_chunked._blas_libraries()
    if libs and all(setter is not None or lib.num_threads == 1 for lib, setter in libs):
        pytest.skip("every BLAS library found has a thread-local setter or runs on one thread: "
                    "the NumPy path uses its thread pool")
    assert numpy_chunked.threading_mode() == "inline"
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 4)
    ran_in = set()
    attend = numpy_chunked._attend_item

    def spy(*args):
        ran_in.add(threading.get_ident())
        attend(*args)

    monkeypatch.setattr(numpy_chunked, "_attend_item", spy)
    rng = np.random.default_rng(304)
    q, k, v = (rng.standard_normal((2, 2, 300, 8)) for _ in range(3))
    numpy_chunked.attention(q, k, v, mask=None, rules=rules_of(q, k, causal=False), scale=0.3,
                            xp=np)
    assert ran_in == {threading.get_ident()}


class _FakeBLAS:
    """A BLAS library as threadpoolctl describes it, with several threads."""

    internal_api = "fake"
    user_api = "blas"
    version = "0"
    num_threads = 4


def test_numpy_path_pool_sets_each_workers_blas_once(monkeypatch):
    """The pool's initializer calls the thread-local setter once in each worker, never here."""
    from polyattn.backends.numpy import forward as numpy_chunked

    calls_to_setter = []
    lock = threading.Lock()

    def set_local(n):
        with lock:
            calls_to_setter.append((threading.get_ident(), n))
        return 4

    ran_in = set()
    attend = numpy_chunked._attend_item

    def spy(*args):
        ran_in.add(threading.get_ident())
        attend(*args)

    monkeypatch.setattr(numpy_chunked, "_blas_libs", ((_FakeBLAS(), set_local),))
    monkeypatch.setattr(numpy_chunked, "_pool", None)
    monkeypatch.setattr(numpy_chunked, "_pool_size", 0)
    monkeypatch.setattr(numpy_chunked, "_attend_item", spy)
    monkeypatch.setattr(numpy_chunked, "BLOCK_Q", 8)
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 3)
    assert numpy_chunked.threading_mode() == "pool"
    rng = np.random.default_rng(305)
    q, k, v = (rng.standard_normal((2, 2, 61, 8)) for _ in range(3))
    for _ in range(2):
        out, lse = numpy_chunked.attention(q, k, v, mask=None,
                                           rules=rules_of(q, k, causal=True), scale=0.3, xp=np)
    here = threading.get_ident()
    workers = [ident for ident, _ in calls_to_setter]
    assert here not in ran_in and here not in workers
    assert all(n == 1 for _, n in calls_to_setter)
    assert len(workers) == len(set(workers)) <= 3          # once per worker thread
    assert ran_in <= set(workers)                          # every item ran in one of them
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 1)   # inline: the same bits
    want_out, want_lse = numpy_chunked.attention(q, k, v, mask=None,
                                                 rules=rules_of(q, k, causal=True), scale=0.3,
                                                 xp=np)
    assert_bitwise_equal(out, want_out)
    assert_bitwise_equal(lse, want_lse, "lse")


@pytest.mark.parametrize("failing", ["build_keys", "_online_softmax"])
def test_numpy_path_pool_raises_the_error_of_a_job(monkeypatch, failing):
    """A job that raises on the pool: the call raises that error, and the pool still works."""
    from polyattn.backends.numpy import forward as numpy_chunked

    monkeypatch.setattr(numpy_chunked, "BLOCK_Q", 8)
    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 3)
    rng = np.random.default_rng(306)
    q, k, v = (rng.standard_normal((2, 2, 61, 8)) for _ in range(3))

    def call():
        return numpy_chunked.attention(q, k, v, mask=None, rules=rules_of(q, k, causal=True),
                                       scale=0.3, xp=np)

    with items_on_threads(numpy_chunked):
        want_out, _ = call()
        target = numpy_chunked._Problem if failing == "build_keys" else numpy_chunked
        original = getattr(target, failing)
        count = 0

        def fail_once_in_a_while(*args):
            nonlocal count
            count += 1
            if count % 3 == 2:
                raise ValueError(f"{failing} failed")
            return original(*args)

        monkeypatch.setattr(target, failing, fail_once_in_a_while)
        with pytest.raises(ValueError, match=f"^{failing} failed$"):
            call()
        monkeypatch.setattr(target, failing, original)
        out, _ = call()
    assert_bitwise_equal(out, want_out)


# --- BLAS without a thread-local setter: held to one thread while the pool runs ------------

def _without_local_setter(numpy_chunked):
    """NumPy's BLAS libraries that have several threads and no thread-local setter."""
    return [lib for lib, setter in numpy_chunked._blas_libraries()
            if setter is None and lib.num_threads != 1]


def test_numpy_path_holds_shared_blas_to_one_thread_while_its_pool_runs(monkeypatch):
    """By default (SHARED_BLAS = "limit"), NumPy's BLAS without a thread-local setter runs on
    one thread while a call's items run on the pool, from whichever thread the call comes,
    and has its threads back afterwards."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from polyattn.backends.numpy import forward as numpy_chunked

    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", None)
    held = _without_local_setter(numpy_chunked)
    if not held:
        pytest.skip("NumPy's BLAS has a thread-local setter or one thread: nothing is held")
    assert numpy_chunked.SHARED_BLAS == "limit"
    assert numpy_chunked.threading_mode() == "pool"
    before = [lib.num_threads for lib in held]
    rng = np.random.default_rng(307)
    q, k, v = (rng.standard_normal((1, 8, 1024, 64)) for _ in range(3))

    def call():
        return numpy_chunked.attention(q, k, v, mask=None, rules=rules_of(q, k, causal=False),
                                       scale=0.125, xp=np)

    want_out, _ = call()                   # a call from this thread first, then from another
    assert [lib.num_threads for lib in held] == before
    done = threading.Event()

    def watched():
        try:
            return call()
        finally:
            done.set()

    seen = []
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(watched)
        while not done.wait(0.005):
            seen.append([lib.num_threads for lib in held])
        out, _ = future.result()
    assert len(seen) >= 3, f"only {len(seen)} reads while the call ran: make it longer"
    assert [1] * len(held) in seen, f"BLAS threads {before} before, then {seen}"
    assert [lib.num_threads for lib in held] == before
    assert blas_threads(threadpoolctl)           # threadpoolctl still reads them
    assert_bitwise_equal(out, want_out)


def test_numpy_path_overlapping_calls_give_blas_threads_back_once(monkeypatch):
    """Calls from several threads overlap: the hold begins with the first and ends with the
    last, whichever threads they run in, and BLAS's threads are back after them."""
    from polyattn.backends.numpy import forward as numpy_chunked

    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 2)
    held = _without_local_setter(numpy_chunked)
    if not held:
        pytest.skip("NumPy's BLAS has a thread-local setter or one thread: nothing is held")
    before = [lib.num_threads for lib in held]
    rng = np.random.default_rng(308)
    problems = [tuple(rng.standard_normal((1, 4, 300 + 40 * i, 32)) for _ in range(3))
                for i in range(THREADS)]

    def call(i):
        q, k, v = problems[i]
        return numpy_chunked.attention(q, k, v, mask=None, rules=rules_of(q, k, causal=True),
                                       scale=0.2, xp=np)

    want = [call(i) for i in range(THREADS)]
    barrier = threading.Barrier(THREADS)

    def worker(i):
        barrier.wait(timeout=60)
        return [call((i + j) % THREADS) for j in range(3)]

    with ThreadPoolExecutor(THREADS) as pool:
        results = [f.result(timeout=600) for f in [pool.submit(worker, i)
                                                   for i in range(THREADS)]]
    assert [lib.num_threads for lib in held] == before
    assert numpy_chunked._holders == 0
    for i, got in enumerate(results):
        for j, (out, lse) in enumerate(got):
            want_out, want_lse = want[(i + j) % THREADS]
            assert_bitwise_equal(out, want_out, f"thread {i}, call {j}")
            assert_bitwise_equal(lse, want_lse, f"thread {i}, call {j}: lse")


class _CountingBLAS(_FakeBLAS):
    """A fake BLAS without a thread-local setter that records its process-wide setter's calls."""

    def __init__(self):
        self.num_threads = 4
        self.calls = []

    def set_num_threads(self, n):
        self.calls.append(n)
        self.num_threads = n


def test_numpy_path_hold_is_shared_by_overlapping_holders(monkeypatch):
    """The first of overlapping holds sets the count to 1, the last (in another thread) gives
    4 back; with SHARED_BLAS = "leave" nothing is set and items run inline."""
    from polyattn.backends.numpy import forward as numpy_chunked

    blas = _CountingBLAS()
    monkeypatch.setattr(numpy_chunked, "_blas_libs", ((blas, None),))
    assert numpy_chunked.threading_mode() == "pool"
    first = numpy_chunked._shared_blas_held()
    first.__enter__()
    assert blas.calls == [1]
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: numpy_chunked._run_jobs([lambda: None] * 3, 2)).result()
    assert blas.calls == [1]                      # held already: not set again, not given back
    with ThreadPoolExecutor(1) as pool:           # the last holder ends in another thread
        pool.submit(first.__exit__, None, None, None).result()
    assert blas.calls == [1, 4] and blas.num_threads == 4
    assert numpy_chunked._holders == 0
    monkeypatch.setattr(numpy_chunked, "SHARED_BLAS", "leave")
    assert numpy_chunked.threading_mode() == "inline"
    numpy_chunked._run_jobs([lambda: None] * 3, 2)
    assert blas.calls == [1, 4]


@pytest.mark.parametrize("libs", ["holdable", "none"])
def test_numpy_path_shared_blas_setting_is_checked(monkeypatch, libs):
    """An unknown SHARED_BLAS is a ValueError naming it, whatever BLAS is found."""
    from polyattn.backends.numpy import forward as numpy_chunked

    found = ((_CountingBLAS(), None),) if libs == "holdable" else ()
    monkeypatch.setattr(numpy_chunked, "_blas_libs", found)
    monkeypatch.setattr(numpy_chunked, "SHARED_BLAS", "always")
    with pytest.raises(ValueError, match=r"SHARED_BLAS must be 'limit' .* or 'leave' .*"
                                         r"got 'always'"):
        numpy_chunked.threading_mode()


# --- fork: a child gets a pool of its own ------------------------------------------------

_FORKED = """
import multiprocessing, os, sys
import numpy as np
from polyattn import scaled_dot_product_attention as sdpa
from polyattn.backends.numpy import forward as numpy_chunked

numpy_chunked.NUM_THREADS = 2
numpy_chunked.BLOCK_Q = 64                     # several items: the pool runs them
rng = np.random.default_rng(309)
q, k, v = (rng.standard_normal((1, 4, 300, 16)) for _ in range(3))


def call(_=None):
    return sdpa(q, k, v, is_causal=True, implementation="chunked")


def main():
    assert numpy_chunked.threading_mode() == "pool", numpy_chunked.threading_mode()
    want = call()
    assert numpy_chunked._pool is not None     # the parent's pool exists, with its workers
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(call).get(timeout=60)
    assert np.array_equal(got, want), "multiprocessing fork child"
    pid = os.fork()
    if pid == 0:
        try:
            code = 0 if np.array_equal(call(), want) else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "os.fork child"
    print("forked children ok")


if __name__ == "__main__":
    main()
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork on this platform")
def test_numpy_path_runs_in_forked_children(tmp_path):
    """After the parent ran items on the pool, a child started by fork (multiprocessing's
    "fork" context, and os.fork) runs the path too, on a fresh pool: it used to wait forever
    on jobs that no thread of the child would run. A hang fails the test by its timeout."""
    import subprocess
    import sys

    pytest.importorskip("threadpoolctl")
    script = tmp_path / "forked.py"
    script.write_text(_FORKED)
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a forked child hung: {exc}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forked children ok" in done.stdout


def test_numpy_path_fork_handler_resets_the_pool_and_gives_blas_back(monkeypatch):
    """What the child runs after fork: no pool, free locks, no hold, BLAS's count back."""
    from polyattn.backends.numpy import forward as numpy_chunked

    blas = _CountingBLAS()
    monkeypatch.setattr(numpy_chunked, "_blas_libs", ((blas, None),))
    monkeypatch.setattr(numpy_chunked, "_pool", numpy_chunked._pool)
    monkeypatch.setattr(numpy_chunked, "_pool_size", numpy_chunked._pool_size)
    for name in ("_pool_lock", "_blas_lock", "_hold_lock"):    # (the originals come back)
        monkeypatch.setattr(numpy_chunked, name, threading.Lock())
    numpy_chunked._run_jobs([lambda: None] * 2, 2)          # a pool exists
    assert blas.calls == [1, 4]
    hold = numpy_chunked._shared_blas_held()
    hold.__enter__()                                        # a call "in flight" at the fork
    numpy_chunked._pool_lock.acquire()                      # held by another thread
    assert blas.calls == [1, 4, 1]
    numpy_chunked._after_fork_in_child()
    assert numpy_chunked._pool is None and numpy_chunked._pool_size == 0
    assert numpy_chunked._holders == 0 and not numpy_chunked._held
    assert blas.calls == [1, 4, 1, 4]
    assert not numpy_chunked._pool_lock.locked()
    numpy_chunked._run_jobs([lambda: None] * 2, 2)          # a fresh pool works
    assert blas.calls == [1, 4, 1, 4, 1, 4]
