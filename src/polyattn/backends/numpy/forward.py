"""Online-softmax attention tuned for NumPy on the CPU.

The algorithm is the one of :mod:`.chunked` (running maximum ``m``, running
sum ``l``, rescaled accumulator ``acc``; Milakov & Gimelshein 2018, Dao et
al. 2022), written against NumPy itself so that the CPU is used well:

- **Work items.** The problem is cut into independent items, one per
  (batch index, key/value head, query block). The ``G = H // Hkv`` query heads
  that share a key/value head are stacked into one item, so a key block read
  into cache serves all of them and the matrix products are taller.
- **Cache-sized tiles.** An item holds a (BLOCK_Q, BLOCK_K) block of scores,
  1 MiB for the default sizes (float32; float64 items have half the rows),
  which stays in the core's L2 cache while it is exponentiated and
  multiplied by the value block. Without a causal mask, an item with fewer
  rows (a short query sequence) takes wider key blocks of the same area, so
  it makes fewer, larger calls.
- **One pass over the scores.** The scale is folded into the queries once
  per item, and the queries carry one more column holding ``-m``: the product
  ``[q | -m] @ [k | 1]ᵀ`` delivers the scores already shifted. They are
  exponentiated in place, summed by a matrix-vector product and multiplied by
  the value block. The running maximum is only recomputed for a block in
  which some row's maximum rose far enough (``RESCALE_LIMIT``) to matter;
  between such blocks the exponentials may exceed 1 but stay far from
  overflow, and the result is exact either way (the shift cancels in
  ``acc / l`` and is added back in ``lse``).
- **The visible area only.** Each item first computes, per query row, the
  keys ``[lo, hi)`` that its batch row's key length, the causal mask and the
  window leave visible (DESIGN §4.1; both bounds grow with the row). Key
  blocks run from the first such key to the last, and each block is computed
  only for the rows that see some of it (:func:`_band_tiles`), so time and
  memory follow the visible band: T·window under a sliding window, not T².
  Only tiles that straddle an edge of the band write a mask, and only its
  triangles; on the cheap path after the exponential (as zeros): NumPy's
  float64 ``exp`` is about 3× slower per element on -inf.
- **Scores in §4.1's order.** Soft-capping ``c·tanh(s/c)`` cannot take the
  shift inside the product, so with it the queries' extra column stays 0 and
  ``m`` is subtracted after the cap. ALiBi's ``-slope_h·|p_i - j|`` (the slope
  of each query head of the item) and a float mask are added to the shifted
  scores. Key lengths and slopes are read as NumPy arrays.
- **Cores busy, one BLAS thread per worker.** NumPy releases the GIL inside
  BLAS and ufunc loops, so a thread pool runs the items concurrently, each
  writing its own slice of the output. The parallelism is across items, so
  each worker must call BLAS on one thread. Where the BLAS library has a
  thread-local setter, found through ``threadpoolctl`` (MKL's
  ``mkl_set_num_threads_local``; for OpenBLAS built on OpenMP, the runtime's
  ``omp_set_num_threads``, which is per thread), each worker sets its own
  count to 1 once, when it starts, and no other thread's BLAS changes.
  OpenBLAS on its own threads (the build in NumPy's wheels) has no such
  setter (its ``openblas_set_num_threads_local`` sets the process-wide
  count). There, by default (:data:`SHARED_BLAS` = ``"limit"``), the path
  holds that library's process-wide count to 1 while any call of the path
  runs on the pool and gives the count back when the last such call ends, so
  another thread's BLAS runs on one thread meanwhile (it would compete with
  the pool for the same cores). The alternative, the items one after another
  in the calling thread with BLAS on its own threads (``SHARED_BLAS =
  "leave"``, which never changes BLAS's thread count), meets at every
  product: on a busy machine it was several times slower than the pool, and
  slower than materialising the scores (``benchmarks/contention.py``).
  Without ``threadpoolctl`` (the ``fast`` extra) no BLAS library is found and
  the items run inline. :func:`threading_mode` tells which applies. The pool
  is shared by all calls and never shut down (a child started by ``fork``
  gets a fresh one: the parent's workers do not exist there); a call runs at
  most :func:`num_threads` items at once. No reduction crosses items, so the
  result does not depend on the number of threads or on the order in which
  items finish.
- **No floating-point warnings.** Non-finite inputs give non-finite results
  (DESIGN §4.2), and hidden scores overflow the cheap path's exponential
  before they are zeroed: every floating-point condition is ignored
  (``np.errstate(all="ignore")``) in the calling thread and in each worker,
  whose error state is not the caller's.
- **Dropout** (§4.1). The keep-mask of each tile is recomputed from the
  weights' flat indices by the Philox counters of :mod:`._dropout`
  (:func:`_dropout_factor`), so nothing is stored and every implementation
  drops the same weights. The running sum ``l`` (and so ``lse``) takes the
  undropped exponentials; only what is multiplied by the values is dropped
  and scaled by ``1 / (1 - p)``.
- **The backward pass** (:func:`backward`) is in :mod:`.numpy_vjp`: the same
  tiles, scores and threads, no reductions across items.
- **Strided inputs.** The matrices of ``q``, ``k`` and ``v`` may have any row
  stride (the (B…, H, T, E) views of (B…, T, H, E) arrays): ``q`` and ``k``
  are only read into per-item buffers, and ``v`` goes to BLAS as it is
  wherever its rows are contiguous. ``out`` follows the memory order of
  ``q``.

Precision: scores, ``m``, ``l`` and ``acc`` are kept in the compute dtype
(float32 or float64; float16 inputs arrive as float32). Folding ``-m`` into
the product adds one term to each dot product, so the shifted scores carry
the rounding error of an (E + 1)-term sum instead of an E-term sum and a
subtraction. ``np.exp`` is used rather than ``np.exp2``: NumPy's float32
``exp2`` falls to a slow path on underflow, which attention hits constantly.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np

from polyattn.rules.dropout import MASK32, philox_numpy, threshold
from polyattn.rules.visibility import Rules

#: Query rows per work item in float32, summed over the G heads of a group
#: (bq = BLOCK_Q // G); half as many in float64, so a block of scores keeps its size.
BLOCK_Q = 1024
#: Keys per block of scores; a (BLOCK_Q, BLOCK_K) float32 block is 1 MiB, half the
#: L2 cache of a core of the x86-64 machines measured (1024 x 256 was the fastest
#: of 128..4096 x 64..512 there, by a few per cent). An item with fewer rows (a short
#: query sequence) takes proportionally more keys per block, up to the same area.
BLOCK_K = 256
#: A key block in which some row's ``Σ exp(score - m)`` exceeds this is redone with a
#: new maximum. Between such blocks every exponential stays below it (e**11 for
#: 2**16), far from overflow in float32 and float64.
RESCALE_LIMIT = 2.0**16
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


def _blas_ready(x: np.ndarray) -> np.ndarray:
    """``x``, or a C-contiguous copy where its trailing matrices cannot go to BLAS as they are.

    NumPy's ``matmul`` hands a matrix to BLAS when its elements are contiguous within a
    row and its row stride is a whole number of elements, at least a row long (the
    leading dimension): the (T, E) matrices of a (B…, T, H, E) array's (B…, H, T, E)
    view qualify, with row stride H·E. Broadcast leading axes are kept.
    """
    item = x.itemsize
    rows, cols = x.shape[-2:]
    row_stride, col_stride = x.strides[-2:]
    if cols <= 1 or col_stride == item:
        if rows <= 1 or (row_stride % item == 0 and row_stride >= cols * item):
            return x
    return np.ascontiguousarray(x)


def _row(a: np.ndarray, b: tuple[int, ...]) -> Any:
    """``a[b]`` for an array whose leading ``len(b)`` axes broadcast against B… (size 1 or full)."""
    return a[tuple(0 if a.shape[d] == 1 else b[d] for d in range(len(b)))]


class _Problem:
    """The arrays, sizes and rules every work item reads, and the per-thread scratch.

    ``rules`` (a :class:`._rules.Rules`) is authoritative where given; otherwise the
    rules are those of ``causal_offset`` alone.
    """

    def __init__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                 causal_offset: int | None, scale: float, rules: Rules | None = None) -> None:
        self.q, self.k, self.v, self.mask = q, k, v, mask
        self.dtype = q.dtype
        self.batch = tuple(q.shape[:-3])
        self.h = q.shape[-3]
        self.qscale = self.dtype.type(scale)
        self.hkv = k.shape[-3]
        self.g = q.shape[-3] // self.hkv
        self.tq, self.tk = q.shape[-2], k.shape[-2]
        self.e, self.ev = q.shape[-1], v.shape[-1]
        self.rules = rules or Rules.from_causal_offset(causal_offset, self.tq, self.tk)
        # how far left and right of its position a query sees (None: unbounded); a reach
        # beyond Tq + Tk + |offset| covers every key from every position, so it is capped there
        reach = self.tq + self.tk + max(abs(off) for off in self.rules.offset_range())
        left, right = self.rules.left_reach(), self.rules.right_reach()
        self.left = None if left is None else min(left, reach)
        self.right = None if right is None else min(right, reach)
        self.banded = self.left is not None or self.right is not None
        self.lengths = (None if self.rules.key_lengths is None
                        else np.asarray(self.rules.key_lengths))     # (B…|1 …), integers
        self.slopes = (None if self.rules.alibi is None
                       else np.asarray(self.rules.alibi, dtype=self.dtype))  # (B…|1 …, H|1)
        self.softcap = None if self.rules.softcap is None else self.dtype.type(self.rules.softcap)
        self.block_k = max(1, int(BLOCK_K))
        rows = max(1, int(BLOCK_Q) * 4 // self.dtype.itemsize)
        self.bq = max(1, rows // self.g)             # query rows per head in an item
        self.block_elems = rows * self.block_k       # entries of a full block of scores
        self.limit = self.dtype.type(RESCALE_LIMIT)
        self.tiny = self.dtype.type(2.0**-60)
        self.ones = np.ones(self.tk, dtype=self.dtype)
        self.keys: dict[tuple[Any, ...], np.ndarray] = {}
        self.pending: dict[tuple[Any, ...], threading.Event] = {}  # set once built
        self.failed: dict[tuple[Any, ...], BaseException] = {}     # builds that raised
        self.scratch = threading.local()             # freed with the call
        self._edges: tuple[np.ndarray, np.ndarray] | None = None

    def key_block(self, rows: int) -> int:
        """Keys per block for an item of ``rows`` query rows per head.

        Where every row sees every key (up to its batch row's key length), an item
        with fewer rows than a full block (short Tq) takes wider key blocks, so its
        block of scores keeps the cache-sized area; under a causal mask or a window,
        narrower blocks waste less outside the visible band.
        """
        if self.banded:
            return self.block_k
        return max(self.block_k, self.block_elems // (self.g * rows))

    def key_ranges(self, b: tuple[int, ...], q0: int, q1: int,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Positions ``p_i`` and visible keys ``[lo_i, hi_i)`` of queries q0:q1 in batch row b.

        Three int64 arrays (q1 - q0,). Key ``j`` is visible to query ``i`` (by key
        length, causal mask and window; ``attn_mask`` aside) iff ``lo_i <= j < hi_i``.
        Both bounds are non-decreasing in ``i``, so the rows that see some key
        (``hi > lo``) are one run, and so are those that see any given key.
        """
        n = self.tk if self.lengths is None else int(_row(self.lengths, b))   # Tk_b
        offset = n - self.tq if self.rules.lengths_shift else self.rules.offset
        pos = np.arange(q0 + offset, q1 + offset, dtype=np.int64)   # p_i
        if self.right is None:
            hi = np.full(q1 - q0, n, dtype=np.int64)
        else:
            hi = np.clip(pos + (self.right + 1), 0, n)
        if self.left is None:
            lo = np.zeros(q1 - q0, dtype=np.int64)
        else:
            lo = np.clip(pos - self.left, 0, n)
        return pos, lo, hi

    def neg_slopes(self, b: tuple[int, ...], hk: int) -> np.ndarray | None:
        """``-slope_h`` (G, 1, 1) of the query heads of item (b, hk); ``None`` without ALiBi."""
        if self.slopes is None:
            return None
        heads = _row(self.slopes, b)                 # (H|1,)
        if heads.shape[-1] != 1:
            heads = heads[hk * self.g:(hk + 1) * self.g]
        return -np.broadcast_to(heads.reshape(-1, 1, 1), (self.g, 1, 1))   # (G, 1, 1)

    def edges(self, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
        """Bool (rows, cols) ``x >= t`` and its complement ``x < t`` (row t, column x).

        Slices of two triangles built once per call: a window's or a causal mask's
        edge moves one key per query row, so its hidden part of a tile is one of them.
        """
        e = self._edges
        if e is None or e[0].shape[0] < rows or e[0].shape[1] < cols:
            n_rows, n_cols = max(rows, self.bq), max(cols, self.block_k)
            upper = np.arange(n_cols)[None, :] >= np.arange(n_rows)[:, None]
            e = self._edges = (upper, ~upper)
        return e[0][:rows, :cols], e[1][:rows, :cols]

    def extended_keys(self, b: tuple[int, ...], hk: int) -> np.ndarray:
        """``[k | 1]`` (Tk, E + 1) of (b, hk), built once per call.

        Inline, the first item that needs them builds them; on the pool, the job of
        :meth:`build_pending` does, queued ahead of every item.
        """
        key = (b, hk)
        ke = self.keys.get(key)
        if ke is None:
            built = self.pending.get(key)
            if built is None:
                ke = self.keys[key] = self.build_keys(b, hk)
            else:                                    # being built by a pool worker
                built.wait()
                ke = self.keys.get(key)
                if ke is None:                       # the build raised: so does the item
                    raise self.failed[key]
        return ke

    def build_pending(self, b: tuple[int, ...], hk: int) -> None:
        """The pool's job for :meth:`extended_keys` (b, hk); wakes the items waiting on it."""
        try:
            self.keys[(b, hk)] = self.build_keys(b, hk)
        except BaseException as e:
            self.failed[(b, hk)] = e
            raise
        finally:
            self.pending[(b, hk)].set()

    def build_keys(self, b: tuple[int, ...], hk: int) -> np.ndarray:
        """The array of :meth:`extended_keys`, built afresh."""
        ke = np.empty((self.tk, self.e + 1), dtype=self.dtype)
        ke[:, :self.e] = self.k[(*b, hk)]
        ke[:, self.e] = 1.0
        return ke

    def buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A scratch array of this thread, reused by the items it runs in this call."""
        size = math.prod(shape)
        buffers = self.scratch.__dict__
        a = buffers.get(name)
        if a is None or a.size < size:
            a = buffers[name] = np.empty(max(size, 1), dtype=self.dtype)
        return a[:size].reshape(shape)

    def mask_block(self, b: tuple[int, ...], hk: int, q0: int, q1: int, k0: int,
                   k1: int) -> np.ndarray | None:
        """The mask for item (b, hk) and block (q0:q1, k0:k1), shaped (G|1, bq|1, bk|1)."""
        m = self.mask
        if m is None:
            return None
        idx = tuple(0 if m.shape[d] == 1 else b[d] for d in range(m.ndim - 3))
        heads = slice(0, 1) if m.shape[-3] == 1 else slice(hk * self.g, (hk + 1) * self.g)
        rows = slice(0, 1) if m.shape[-2] == 1 else slice(q0, q1)
        cols = slice(0, 1) if m.shape[-1] == 1 else slice(k0, k1)
        ix: tuple[Any, ...] = (*idx, heads, rows, cols)
        return m[ix]


class _Item:
    """One work item: batch row ``b``, key/value head ``hk``, queries ``q0:q1``.

    With the positions ``pos`` and visible keys ``[lo, hi)`` of its rows
    (:meth:`_Problem.key_ranges`) and the negated ALiBi slopes of its G heads.
    """

    __slots__ = ("b", "hi", "hk", "lo", "neg_slopes", "pos", "q0", "q1")

    def __init__(self, p: _Problem, b: tuple[int, ...], hk: int, q0: int) -> None:
        self.b, self.hk, self.q0 = b, hk, q0
        self.q1 = min(q0 + p.bq, p.tq)
        self.pos, self.lo, self.hi = p.key_ranges(b, q0, self.q1)
        self.neg_slopes = p.neg_slopes(b, hk)


def _flat(x: np.ndarray) -> np.ndarray:
    """(G, R, F) -> (G·R, F) when that is a view (one BLAS call instead of G)."""
    return x.reshape(-1, x.shape[-1]) if x.flags.c_contiguous else x


def _scores(p: _Problem, it: _Item, qe: np.ndarray, ke: np.ndarray, m: np.ndarray, r0: int,
            r1: int, k0: int, k1: int, s: np.ndarray, *, hide: bool = True,
            tanh: np.ndarray | None = None) -> None:
    """The scores of rows r0:r1 of item ``it`` and keys k0:k1, shifted by ``-m``, into ``s``.

    ``qe`` (G, r1 - r0, E + 1) holds the scaled queries and, without soft-capping,
    the column ``-m``; ``m`` (G, r1 - r0); ``s`` (G, r1 - r0, k1 - k0). In §4.1's
    order: ``[q·scale | -m] @ [k | 1]ᵀ`` (with soft-capping the product has a 0
    column, the cap applies, then ``m`` is subtracted), ALiBi's ``-slope·|p - j|``,
    the float mask. Hidden entries (boolean mask, key lengths, causal, window) are
    -inf, or left as they are with ``hide=False`` (for :func:`_hide` to zero after
    the exponential). With soft-capping, ``tanh`` (shaped as ``s``), where given,
    receives ``tanh(scale·q·k / c)`` (for the cap's derivative).
    """
    if qe.flags.c_contiguous:
        np.matmul(_flat(qe), ke[k0:k1].T, out=_flat(s))  # (G·r, bk)
    else:
        np.matmul(qe, ke[k0:k1].T, out=s)                # (G, r, bk), one product per head
    if p.softcap is not None:                            # c·tanh(s / c) - m
        np.divide(s, p.softcap, out=s)
        np.tanh(s, out=s)
        if tanh is not None:
            np.copyto(tanh, s)
        np.multiply(s, p.softcap, out=s)
        np.subtract(s, m[..., None], out=s)
    if it.neg_slopes is not None:                        # - slope_h·|p_i - j|
        dist = p.buffer("dist", (r1 - r0, k1 - k0))
        np.subtract(it.pos[r0:r1, None].astype(p.dtype), np.arange(k0, k1, dtype=p.dtype),
                    out=dist)
        np.abs(dist, out=dist)
        bias = p.buffer("bias", s.shape)
        np.multiply(it.neg_slopes, dist, out=bias)       # (G, r, bk)
        s += bias
    mb = p.mask_block(it.b, it.hk, it.q0 + r0, it.q0 + r1, k0, k1)
    if mb is not None and mb.dtype != np.bool_:
        s += mb
    if hide:
        _hide(p, it, s, r0, r1, k0, k1, -np.inf)


def _hide(p: _Problem, it: _Item, s: np.ndarray, r0: int, r1: int, k0: int, k1: int,
          value: float) -> None:
    """Set the entries of ``s`` hidden by a boolean mask, a causal mask or a window to ``value``.

    The cheap path exponentiates first and then writes 0 here: NumPy's float64
    ``exp`` takes a slow path for -inf (about 3× the time per element), and an
    entry overwritten afterwards cannot leak, whatever the exponential made of it.
    Key lengths need nothing here: no tile reaches past them (:func:`_band_tiles`).
    """
    mb = p.mask_block(it.b, it.hk, it.q0 + r0, it.q0 + r1, k0, k1)
    if mb is not None and mb.dtype == np.bool_:
        np.copyto(s, value, where=~mb)
    if not p.banded:
        return
    w = k1 - k0
    # rows whose visible keys end inside the block: a leading run of the tile's rows, row
    # r0 + t seeing columns c < hi[r0] - k0 + t (the edge moves one key per row)
    rh = min(r1, int(np.searchsorted(it.hi, k1, side="left")))
    if rh > r0:
        c = int(it.hi[r0]) - k0
        right, _ = p.edges(rh - r0, w - c)
        np.copyto(s[:, :rh - r0, c:], value, where=right)
    # rows whose visible keys start inside the block: a trailing run, row rl + t seeing
    # columns c >= lo[rl] - k0 + t; the first lo[rl] - k0 columns are hidden from all of them
    rl = max(r0, int(np.searchsorted(it.lo, k0, side="right")))
    if r1 > rl:
        d = int(it.lo[rl]) - k0
        n = r1 - rl
        s[:, rl - r0:, :d] = value
        _, left = p.edges(n, n - 1)
        np.copyto(s[:, rl - r0:, d:d + n - 1], value, where=left)


def _dropout_keep(p: _Problem, it: _Item, r0: int, r1: int, k0: int, k1: int) -> np.ndarray:
    """Bool (G, r1 - r0, k1 - k0): the weights of rows r0:r1 of ``it`` and keys k0:k1 kept.

    Weight (b, h, i, j) has the flat index ``n = ((b·H + h)·Tq + i)·Tk + j`` in
    (B…, H, Tq, Tk), with ``b`` the flat index of the batch row and ``h = hk·G + g``;
    it is kept iff the first Philox word of the counter ``(n mod 2³², n div 2³², 0, 0)``
    is at least ``threshold(dropout_p)`` (:mod:`._dropout`).
    """
    u = np.uint64
    b = int(np.ravel_multi_index(it.b, p.batch)) if p.batch else 0
    heads = np.arange(it.hk * p.g, (it.hk + 1) * p.g, dtype=u)[:, None, None]  # (G, 1, 1)
    rows = np.arange(it.q0 + r0, it.q0 + r1, dtype=u)[:, None]                 # (r, 1)
    n: np.ndarray = ((u(b * p.h) + heads) * u(p.tq) + rows) * u(p.tk) + np.arange(k0, k1, dtype=u)
    x0 = philox_numpy(n & u(MASK32), n >> u(32), 0, 0, p.rules.dropout_seed)[0]  # (G, r, bk)
    return x0 >= u(threshold(p.rules.dropout_p))


def _dropout_factor(p: _Problem, it: _Item, r0: int, r1: int, k0: int, k1: int,
                    z: np.ndarray) -> np.ndarray:
    """``keep / (1 - p)`` of a tile (:func:`_dropout_keep`) written into ``z`` (G, r, bk)."""
    z.fill(0.0)
    np.copyto(z, p.dtype.type(p.rules.dropout_scale), where=_dropout_keep(p, it, r0, r1, k0, k1))
    return z


def _band_tiles(lo: np.ndarray, hi: np.ndarray, bk: int, start: int = 0,
                stop: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """The (r0, r1, k0, k1) rectangles of scores that rows with visible keys [lo, hi) need.

    Keys come in blocks of ``bk`` from the first key any row sees to the last (within
    ``[start, stop)`` where given); each block covers only the rows that see some of
    it (a run, as both bounds grow with the row). Rows that see no key at all are in
    no rectangle.
    """
    seen = np.flatnonzero(hi > lo)
    if seen.size == 0:
        return
    k_start, k_stop = max(start, int(lo[seen[0]])), int(hi[seen[-1]])
    if stop is not None:
        k_stop = min(k_stop, stop)
    for k0 in range(k_start, k_stop, bk):
        k1 = min(k0 + bk, k_stop)
        r0 = int(np.searchsorted(hi, k0, side="right"))   # first row with hi > k0
        r1 = int(np.searchsorted(lo, k1, side="left"))    # first row with lo >= k1
        if r0 < r1:
            yield r0, r1, k0, k1


def _tiles(p: _Problem, q0: int, q1: int, bk: int, b: tuple[int, ...] = (),
           ) -> Iterator[tuple[int, int, int, int]]:
    """The (r0, r1, k0, k1) rectangles of scores that rows q0:q1 of batch row ``b`` need.

    Rows are relative to q0; keys come in blocks of ``bk``. Under a causal mask
    (row q0 + r sees keys j <= q0 + r + offset) the blocks stop at the last key
    the item's last row sees, and each block starts at the first row that sees
    any of it; a window also drops the rows that see only keys after the block,
    and the blocks before the first key any row sees; key lengths end the blocks
    at the batch row's last key. ``b`` is needed only with key lengths.
    """
    _, lo, hi = p.key_ranges(b, q0, q1)
    return _band_tiles(lo, hi, bk)


def _attend_item(p: _Problem, b: tuple[int, ...], hk: int, q0: int, out: np.ndarray,
                 lse: np.ndarray) -> None:
    """:func:`_online_softmax` with no floating-point condition warned about or raised.

    A cheap-path block whose exponentials overflow is detected by its row sum and
    redone, exponentials underflow all the time, and non-finite inputs give non-finite
    results (DESIGN §4.2): the values say what happened, whatever the caller's
    ``np.errstate`` (a pool worker has its own).
    """
    with np.errstate(all="ignore"):
        _online_softmax(p, b, hk, q0, out, lse)


def _online_softmax(p: _Problem, b: tuple[int, ...], hk: int, q0: int, out: np.ndarray,
                    lse: np.ndarray) -> None:
    """Online softmax of one work item; writes its slice of ``out`` and ``lse``.

    Per row: ``m`` (a shift at most ``log(RESCALE_LIMIT)`` below the running
    maximum), ``l = Σ exp(s - m)`` and ``acc = Σ exp(s - m) v``, with ``s`` the
    scores of §4.1. Each key block takes the cheap path (exponentiate
    the already shifted scores, sum, multiply by ``v``) and is redone exactly
    (new maximum, rescaled ``l`` and ``acc``) only when a row's block sum is
    above ``RESCALE_LIMIT``, or below ``2**-60`` for a row that has no mass yet
    (underflow, or a row fully masked so far). The scores are computed only in
    the rectangles of :func:`_band_tiles`, which follow the visible band. With
    dropout, ``acc`` takes ``exp(s - m)·keep / (1 - p)`` and ``l`` the undropped sum.
    """
    it = _Item(p, b, hk, q0)
    g, e, ev = p.g, p.e, p.ev
    bq = it.q1 - q0
    bk = p.key_block(bq)
    heads = slice(hk * g, (hk + 1) * g)
    ix: tuple[Any, ...] = (*b, heads, slice(q0, it.q1))
    out_slice = out[ix]                              # (G, bq, Ev)
    lse_slice = lse[ix]                              # (G, bq)

    # --- queries of the G heads, scaled once, extended by the column -m (0 with softcap)
    qe = p.buffer("q", (g, bq, e + 1))
    np.multiply(p.q[ix], p.qscale, out=qe[..., :e])
    qe[..., e] = 0.0
    m = p.buffer("m", (g, bq))
    l = p.buffer("l", (g, bq))
    acc = p.buffer("acc", (g, bq, ev))
    m.fill(0.0)
    l.fill(0.0)
    acc.fill(0.0)
    dropout = p.rules.dropout

    tiles = list(_band_tiles(it.lo, it.hi, bk))
    if tiles:                                        # (none where no row sees a key)
        ke = p.extended_keys(b, hk)                  # (Tk, E + 1)
        vb = p.v[(*b, hk)]                           # (Tk, Ev)
    for r0, r1, k0, k1 in tiles:
        rows = slice(r0, r1)
        r = r1 - r0
        s = p.buffer("s", (g, r, k1 - k0))
        l_blk = p.buffer("l_blk", (g, r))
        pv = p.buffer("pv", (g, r, ev))
        qr, mr, lr, accr = qe[:, rows], m[:, rows], l[:, rows], acc[:, rows]
        _scores(p, it, qr, ke, mr, r0, r1, k0, k1, s, hide=False)
        # --- cheap path: p = exp(s - m) in place, hidden entries then set to 0;
        # l_blk = p·1, a matrix-vector product
        np.exp(s, out=s)
        _hide(p, it, s, r0, r1, k0, k1, 0.0)
        np.matmul(s, p.ones[:k1 - k0], out=l_blk)
        # two reductions settle the usual case; the row-wise test only runs when they
        # do not (a large or tiny sum somewhere, or a NaN)
        fine = l_blk.max() <= p.limit and l_blk.min() >= p.tiny
        if fine or not (need := (l_blk > p.limit) | ((lr == 0) & (l_blk < p.tiny))).any():
            if dropout:
                s *= _dropout_factor(p, it, r0, r1, k0, k1, p.buffer("z", s.shape))
            np.matmul(_flat(s), vb[k0:k1], out=_flat(pv))  # (G·r, Ev)
            accr += pv
            lr += l_blk
            continue
        # --- exact path: d = how far each row's shift moves
        _scores(p, it, qr, ke, mr, r0, r1, k0, k1, s)
        d = p.buffer("d", (g, r))
        alpha = p.buffer("alpha", (g, r))
        np.max(s, axis=-1, out=d)
        has_mass = lr > 0
        np.maximum(d, 0.0, out=d, where=has_mass)     # rows with mass never lower m
        np.copyto(d, 0.0, where=np.isneginf(d))       # still fully masked: keep m
        # rows that did not need it keep their shift, so each row's bits depend on its
        # own scores only (not on whether another row of the block was redone)
        np.copyto(d, 0.0, where=~need)
        np.subtract(s, d[..., None], out=s)
        np.exp(s, out=s)
        np.matmul(s, p.ones[:k1 - k0], out=l_blk)
        if dropout:
            s *= _dropout_factor(p, it, r0, r1, k0, k1, p.buffer("z", s.shape))
        np.matmul(_flat(s), vb[k0:k1], out=_flat(pv))
        # --- rescale what was accumulated by exp(-d) (d >= 0 wherever there is mass)
        alpha.fill(0.0)
        np.negative(d, out=alpha, where=has_mass)
        np.exp(alpha, out=alpha, where=has_mass)
        accr *= alpha[..., None]
        accr += pv
        lr *= alpha
        lr += l_blk
        mr += d
        if p.softcap is None:
            np.negative(mr, out=qr[..., e])

    # --- normalise: out = acc / l, lse = m + log l; l == 0 (fully masked, including rows
    # that see no key): 0, -inf. A NaN in l, from a NaN input, propagates to out and lse.
    empty = None if l.all() else l == 0               # (NaN is truthy, and not 0)
    if empty is not None:
        l[empty] = 1.0
    np.divide(acc, l[..., None], out=out_slice)
    np.log(l, out=l)
    np.add(m, l, out=lse_slice, dtype=lse_slice.dtype)
    if empty is not None:
        out_slice[empty] = 0.0
        lse_slice[empty] = -np.inf
    # a query row holding NaN or inf is NaN whatever its scores became: every score -inf
    # (inf times keys all negative there: not a fully masked row) or finite (soft-capping
    # saturates); NaN never disappears (DESIGN §4.2), as on the other paths
    lost = ~np.isfinite(p.q[ix]).all(axis=-1)
    if lost.any():
        out_slice[lost] = np.nan
        lse_slice[lost] = np.nan


def _output(q: np.ndarray, ev: int) -> np.ndarray:
    """An empty ``out`` (B…, H, Tq, Ev) whose memory order follows ``q``'s (any (B…, H, T, E)).

    Where ``q`` is the (B…, H, Tq, E) view of a (B…, Tq, H, E) array (its head
    axis has the smaller stride), ``out`` is the same view of a C-contiguous
    (B…, Tq, H, Ev) array, so the caller's permutation back gives a contiguous array.
    """
    h, tq = q.shape[-3:-1]
    if h > 1 and tq > 1 and abs(q.strides[-3]) < abs(q.strides[-2]):
        bthe = np.empty((*q.shape[:-3], tq, h, ev), dtype=q.dtype)  # (B…, Tq, H, Ev)
        return np.swapaxes(bthe, -3, -2)                              # (B…, H, Tq, Ev)
    return np.empty((*q.shape[:-1], ev), dtype=q.dtype)               # (B…, H, Tq, Ev)


def attention(q: Any, k: Any, v: Any, /, *, mask: Any, causal_offset: int | None,
              scale: float, xp: Any, rules: Rules | None = None,
              threads: int | None = None, lse_dtype: Any = None) -> tuple[Any, Any]:
    """Blocked, multi-threaded attention on NumPy arrays; see :mod:`polyattn.backends`.

    ``xp`` is accepted for the common signature; the arrays must be NumPy arrays. They
    may be strided views (no copy is made of ``q`` or ``k``, nor of ``v`` where its rows
    are contiguous), and ``out`` follows the memory order of ``q`` (:func:`_output`).
    ``rules`` (windows, key lengths, soft-capping, ALiBi) replaces ``causal_offset``
    where given; its key lengths and slopes are read as NumPy arrays. ``threads``
    caps the worker threads of this call (default :func:`num_threads`; 1 runs inline);
    ``lse_dtype`` (e.g. float64 for float32 inputs) is the dtype of ``lse`` = ``m + log l``,
    summed in it, so that partial results with large scores merge exactly enough.

    Examples
    --------
    A causal sliding window of 2 keys to the left on a (B, H, T, E) problem:

    >>> import numpy as np
    >>> from polyattn.backends.numpy import forward as numpy_chunked
    >>> from polyattn.rules.visibility import Rules
    >>> q = k = v = np.ones((1, 2, 6, 4))
    >>> rules = Rules(tq=6, tk=6, causal=True, window=(2, 0))
    >>> out, lse = numpy_chunked.attention(q, k, v, mask=None, causal_offset=0, scale=0.5,
    ...                                    xp=np, rules=rules)
    >>> out.shape, np.exp(lse[0, 0] - 0.5 * 4).round(6).tolist()   # keys seen per row
    ((1, 2, 6, 4), [1.0, 2.0, 3.0, 3.0, 3.0, 3.0])
    """
    q, k = np.asarray(q), np.asarray(k)   # read into per-item buffers only: any strides
    v = _blas_ready(np.asarray(v))        # a BLAS operand as it is
    with np.errstate(all="ignore"):       # e.g. a scale beyond float32 becomes inf, silently
        problem = _Problem(q, k, v, None if mask is None else np.asarray(mask), causal_offset,
                           scale, rules)
    out = _output(q, problem.ev)                  # (B…, H, Tq, Ev)
    lse = np.empty(q.shape[:-1], dtype=lse_dtype or q.dtype)   # (B…, H, Tq)
    items = [(b, hk, q0) for b in np.ndindex(*q.shape[:-3]) for hk in range(problem.hkv)
             for q0 in range(0, problem.tq, problem.bq)]
    if not items:
        return out, lse
    # later query blocks see more keys under a causal mask: start them first
    items.sort(key=lambda item: -item[2])
    # Threads over items only where each worker's BLAS runs on one thread without
    # changing any other thread's: a pool on top of BLAS's own threads oversubscribes
    # the cores.
    n = min(num_threads() if threads is None else max(1, int(threads)), len(items))
    if n == 1 or threading_mode() != "pool":  # inline; BLAS keeps its own threads
        for b, hk, q0 in items:
            _attend_item(problem, b, hk, q0, out, lse)
        return out, lse
    # the extended keys are built by the pool too, queued ahead of the items (so an item
    # waits only on a build that has started)
    keys = list(dict.fromkeys((b, hk) for b, hk, _ in items))
    for key in keys:
        problem.pending[key] = threading.Event()
    jobs: list[Callable[[], Any]] = [partial(problem.build_pending, b, hk) for b, hk in keys]
    jobs += [partial(_attend_item, problem, b, hk, q0, out, lse) for b, hk, q0 in items]
    _run_jobs(jobs, n)
    return out, lse


def backward(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any, /, *, mask: Any,
             causal_offset: int | None, scale: float, xp: Any, rules: Rules | None = None,
             grad_lse: Any = None) -> tuple[Any, Any, Any]:
    """The gradients (dq, dk, dv) of :func:`attention`; see :func:`.numpy_vjp.backward`."""
    from polyattn.backends.numpy import backward as numpy_vjp  # it imports this module

    return numpy_vjp.backward(q, k, v, out, lse, grad_out, mask=mask,
                              causal_offset=causal_offset, scale=scale, xp=xp, rules=rules,
                              grad_lse=grad_lse)
