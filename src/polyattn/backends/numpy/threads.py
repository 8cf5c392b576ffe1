"""The NumPy path's worker threads, and BLAS held to one thread inside them.

NumPy releases the GIL inside BLAS and ufunc loops, so a thread pool runs the
work items of :mod:`.forward` and :mod:`.backward` concurrently, each writing
its own slice of the results. The parallelism is across items, so each worker
must call BLAS on one thread. Where the BLAS library has a thread-local
setter, found through ``threadpoolctl`` (MKL's ``mkl_set_num_threads_local``;
for OpenBLAS built on OpenMP, the runtime's ``omp_set_num_threads``, which is
per thread), each worker sets its own count to 1 once, when it starts, and no
other thread's BLAS changes. OpenBLAS on its own threads (the build in NumPy's
wheels) has no such setter (its ``openblas_set_num_threads_local`` sets the
process-wide count). There, by default (:data:`SHARED_BLAS` = ``"limit"``),
the path holds that library's process-wide count to 1 while any call of the
path runs on the pool and gives the count back when the last such call ends.
With ``SHARED_BLAS = "leave"`` the count is never changed and the items run
inline in the calling thread, BLAS on its own threads. Without
``threadpoolctl`` (the ``fast`` extra) no BLAS library is found and the items
run inline. :func:`threading_mode` tells which applies.

The pool is shared by all calls and never shut down; a child started by
``fork`` gets a fresh one, fresh locks and its BLAS threads back
(:func:`_after_fork_in_child`). A call runs at most :func:`num_threads` jobs at
once. The settings :data:`NUM_THREADS` and :data:`SHARED_BLAS` may also be set
as attributes of :mod:`.forward`, which passes them on here.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

#: Items a call runs at once on worker threads (where :func:`threading_mode` is "pool");
#: ``None`` means one per available CPU, 1 runs everything inline. Each call reads it once
#: when it starts, so it may be changed at any time, also while other threads' calls run.
NUM_THREADS: int | None = None
#: Where a BLAS library has several threads and no thread-local setter (NumPy's own
#: OpenBLAS): ``"limit"`` runs the items on the pool and holds that library to one thread,
#: process-wide, while calls of this path run (BLAS's own threads meet at every product and
#: collapsed on a busy machine: ``benchmarks/results/contention-*.md``); ``"leave"`` never
#: changes its thread count and runs the items inline, BLAS on its own threads.
SHARED_BLAS = "limit"


def num_threads() -> int:
    """The number of items a call runs at once (its worker threads), from :data:`NUM_THREADS`."""
    if NUM_THREADS is not None:
        return max(1, int(NUM_THREADS))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


# --- BLAS: one thread in polyattn's own workers, nothing changed elsewhere ---------------

#: OpenBLAS built on OpenMP reads the calling thread's ``omp_get_max_threads()`` from this
#: release on and goes single-threaded when it is 1, without touching the process-wide count.
_OPENBLAS_OPENMP_MIN = (0, 3, 11)

_blas_lock = threading.Lock()
_blas_libs: tuple[tuple[Any, Callable[[int], Any] | None], ...] | None = None


def _version(text: Any) -> tuple[int, ...]:
    """(0, 3, 31) from "0.3.31.188.0"; () when there is no leading number."""
    match = re.match(r"(\d+(?:\.\d+)*)", str(text or ""))
    return tuple(int(x) for x in match.group(1).split(".")) if match else ()


def _thread_local_setter(lib: Any) -> Callable[[int], Any] | None:
    """The setter of the calling thread's BLAS thread count for a threadpoolctl controller.

    ``None`` where the library has none: OpenBLAS on its own threads (its
    ``openblas_set_num_threads_local`` sets the process-wide count), BLIS, FlexiBLAS,
    and OpenMP runtimes whose limit is process-wide (Windows).
    """
    api = getattr(lib, "internal_api", None)
    if api == "mkl":
        for name in ("MKL_Set_Num_Threads_Local", "mkl_set_num_threads_local"):
            setter = getattr(lib.dynlib, name, None)
            if setter is not None:
                return setter
    elif (api == "openblas" and getattr(lib, "threading_layer", None) == "openmp"
          and sys.platform != "win32" and _version(lib.version) >= _OPENBLAS_OPENMP_MIN):
        # resolved through OpenBLAS's own dependencies: the OpenMP runtime it calls
        return getattr(lib.dynlib, "omp_set_num_threads", None)
    return None


def _numpys_own(libs: list[Any]) -> list[Any]:
    """Those of ``libs`` that NumPy's wheel ships (in ``numpy.libs`` or the package folder);
    all of them where none is (a NumPy linked to a BLAS elsewhere: which one is unknown).

    So that another library's BLAS loaded in the process (SciPy's, say) is neither waited
    for nor held to one thread.
    """
    root = os.path.dirname(os.path.realpath(np.__file__))
    folders = (root + os.sep, root + ".libs" + os.sep)
    own = [lib for lib in libs
           if os.path.realpath(getattr(lib, "filepath", "") or "").startswith(folders)]
    return own or libs


def _blas_libraries() -> tuple[tuple[Any, Callable[[int], Any] | None], ...]:
    """NumPy's BLAS libraries (threadpoolctl controllers), each with its thread-local setter.

    Found once per process (:func:`_numpys_own`); empty without ``threadpoolctl``.
    """
    global _blas_libs
    with _blas_lock:
        if _blas_libs is None:
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:  # pragma: no cover - threadpoolctl is optional
                _blas_libs = ()
            else:
                libs = [lib for lib in ThreadpoolController().lib_controllers
                        if lib.user_api == "blas"]
                _blas_libs = tuple((lib, _thread_local_setter(lib))
                                   for lib in _numpys_own(libs))
        return _blas_libs


def _shared_blas_setting() -> str:
    """:data:`SHARED_BLAS`, checked."""
    if SHARED_BLAS not in ("limit", "leave"):
        raise ValueError(f"numpy_chunked.SHARED_BLAS must be 'limit' (hold a BLAS library "
                         f"without a thread-local setter to one thread while calls run on "
                         f"the pool) or 'leave' (never change it; run items inline); got "
                         f"{SHARED_BLAS!r}")
    return SHARED_BLAS


def threading_mode() -> str:
    """How a call runs its items: ``"pool"`` (worker threads) or ``"inline"``.

    ``"pool"`` where each worker can call BLAS with one thread: every BLAS library
    found has a thread-local setter (the workers use it) or runs on one thread
    anyway, or, with :data:`SHARED_BLAS` = ``"limit"`` (the default), the others are
    held to one thread while the pool runs (:func:`_shared_blas_held`). ``"inline"``
    where no BLAS library is found (no ``threadpoolctl``), and with ``"leave"`` where
    a library has several threads and no thread-local setter: the items then run in
    the calling thread, with BLAS on its own threads.
    """
    setting = _shared_blas_setting()
    libs = _blas_libraries()
    if not libs:
        return "inline"
    if all(setter is not None or lib.num_threads == 1 for lib, setter in libs):
        return "pool"
    return "pool" if setting == "limit" else "inline"


# The process-wide hold of the BLAS libraries without a thread-local setter: the number of
# pool runs inside it, and each library's setter and count to give back when the last ends.
_hold_lock = threading.Lock()
_holders = 0
_held: list[tuple[Callable[[int], Any], int]] = []


def _process_wide_setter(lib: Any) -> Callable[[int], Any]:
    """The setter of a BLAS library's process-wide thread count, callable from any thread.

    OpenBLAS's own function: threadpoolctl (3.8 on) lets only the first thread that set an
    OpenBLAS count set it again, and a hold may begin and end in different threads.
    """
    if getattr(lib, "internal_api", None) == "openblas":
        for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
            setter = getattr(lib.dynlib, f"{prefix}openblas_set_num_threads{suffix}", None)
            if setter is not None:
                return setter
    return lib.set_num_threads


@contextmanager
def _shared_blas_held() -> Iterator[None]:
    """BLAS libraries without a thread-local setter on one thread while the block runs.

    Nothing changes with :data:`SHARED_BLAS` = ``"leave"``, or where every library has a
    thread-local setter. Concurrent holders share one hold: the first sets each such
    library's process-wide count to 1 and the last gives the counts it found back, so
    overlapping calls neither see BLAS's threads back early nor leave them at 1.
    """
    global _holders
    libs = [] if SHARED_BLAS == "leave" else [
        lib for lib, setter in _blas_libraries() if setter is None]
    if not libs:
        yield
        return
    with _hold_lock:
        if _holders == 0:
            _held[:] = [(_process_wide_setter(lib), n) for lib in libs
                        if (n := lib.num_threads) != 1]
            for set_threads, _ in _held:
                set_threads(1)
        _holders += 1
    try:
        yield
    finally:
        with _hold_lock:
            _holders -= 1
            if _holders == 0:
                for set_threads, n in _held:
                    set_threads(n)
                _held.clear()


def _limit_worker_blas(setters: tuple[Callable[[int], Any], ...]) -> None:
    """A worker's initializer: BLAS on one thread in this thread, for its whole life."""
    for set_threads in setters:
        set_threads(1)


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _executor(n: int) -> ThreadPoolExecutor:
    """The module's thread pool, with at least ``n`` workers; never shut down.

    A request for more workers than the pool has replaces it by a larger one: the old
    pool keeps serving the calls that hold it, and its threads end once it is idle and
    no longer referenced. Calls limit themselves to their own number of workers
    (:func:`_run_jobs`), so a larger pool than asked for is harmless.
    """
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n:
            setters = tuple(s for _, s in _blas_libraries() if s is not None)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="polyattn",
                                       initializer=_limit_worker_blas, initargs=(setters,))
            _pool_size = n
        return _pool


def _run_jobs(jobs: list[Callable[[], Any]], n: int) -> None:
    """Run ``jobs`` in their order, at most ``n`` at once on the pool, and wait for them all.

    ``n`` workers of the shared pool each take the next job until none is left. After a
    job raises, no further job starts; the first exception is raised here once every
    worker has stopped.
    """
    lock = threading.Lock()
    position = 0
    errors: list[BaseException] = []

    def worker() -> None:
        nonlocal position
        while True:
            with lock:
                if errors or position == len(jobs):
                    return
                job = jobs[position]
                position += 1
            try:
                with np.errstate(all="ignore"):      # a worker's own error state
                    job()
            except BaseException as e:  # re-raised in the calling thread
                with lock:
                    errors.append(e)
                return

    with _shared_blas_held():
        pool = _executor(n)
        for f in [pool.submit(worker) for _ in range(min(n, len(jobs)))]:
            f.result()
    if errors:
        raise errors[0]


def _after_fork_in_child() -> None:
    """A child started by ``fork`` gets a fresh pool, fresh locks and its BLAS threads back.

    The parent's worker threads do not exist in the child: its pool would take jobs that
    no thread runs, and a lock held by another thread at the fork would stay held. A hold
    of BLAS taken by a parent's call (:func:`_shared_blas_held`) ends, as that call does
    not run in the child.
    """
    global _pool, _pool_size, _pool_lock, _blas_lock, _hold_lock, _holders
    _pool, _pool_size = None, 0
    _pool_lock, _blas_lock, _hold_lock = threading.Lock(), threading.Lock(), threading.Lock()
    held = list(_held) if _holders else []
    _holders = 0
    _held.clear()
    for set_threads, n in held:
        try:
            set_threads(n)
        except Exception:  # pragma: no cover - a library that cannot: leave it at 1
            pass


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)
