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
- **Causal skipping.** Key blocks wholly beyond the causal diagonal are never
  computed, and a block on the diagonal only for the rows that see some of
  it (:func:`_tiles`). The mask writes only its triangle, and on the cheap
  path after the exponential (as zeros): NumPy's float64 ``exp`` is about 3×
  slower per element on -inf.
- **Both cores busy.** NumPy releases the GIL inside BLAS and ufunc loops, so
  a module-level thread pool runs the items concurrently, each writing its
  own slice of the output. BLAS is held to one thread per call meanwhile (the
  parallelism is across items), through ``threadpoolctl`` where it is
  installed. No reduction crosses items, so the result does not depend on the
  number of threads or on the order in which items finish.

Precision: scores, ``m``, ``l`` and ``acc`` are kept in the compute dtype
(float32 or float64; float16 inputs arrive as float32). Folding ``-m`` into
the product adds one term to each dot product, so the shifted scores carry
the rounding error of an (E + 1)-term sum instead of an E-term sum and a
subtraction. ``np.exp`` is used rather than ``np.exp2``: NumPy's float32
``exp2`` falls to a slow path on underflow, which attention hits constantly.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

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
#: Worker threads; ``None`` means one per available CPU, 1 runs everything inline.
NUM_THREADS: int | None = None


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def num_threads() -> int:
    """The number of worker threads a call uses."""
    if NUM_THREADS is not None:
        return max(1, int(NUM_THREADS))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def _executor(n: int) -> ThreadPoolExecutor:
    """The module's thread pool with ``n`` workers (created once, reused)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="polyattn")
            _pool_size = n
        return _pool


# --- BLAS held to one thread per call while the items run in parallel ------------------

_blas_lock = threading.Lock()
_blas_users = 0
_blas_limit: Any = None
_blas_controller: Any = None


def _controller() -> Any:
    global _blas_controller
    if _blas_controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - threadpoolctl is optional
            _blas_controller = False
        else:
            _blas_controller = ThreadpoolController()
    return _blas_controller


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Limit BLAS to one thread per call; nested and concurrent uses share one limit."""
    global _blas_users, _blas_limit
    controller = _controller()
    if not controller:  # pragma: no cover - threadpoolctl is optional
        yield
        return
    with _blas_lock:
        if _blas_users == 0:
            _blas_limit = controller.limit(limits=1, user_api="blas")
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0:
                _blas_limit.restore_original_limits()
                _blas_limit = None


def _blas_ready(x: np.ndarray) -> np.ndarray:
    """``x`` with C-contiguous trailing matrices (broadcast leading axes are kept)."""
    item = x.itemsize
    if x.shape[-1] <= 1 or x.strides[-1] == item:
        if x.shape[-2] <= 1 or x.strides[-2] == x.shape[-1] * item:
            return x
    return np.ascontiguousarray(x)


class _Problem:
    """The arrays and sizes every work item reads, and the per-thread scratch."""

    def __init__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                 causal_offset: int | None, scale: float) -> None:
        self.q, self.k, self.v, self.mask = q, k, v, mask
        self.causal_offset = causal_offset
        self.dtype = q.dtype
        self.qscale = self.dtype.type(scale)
        self.hkv = k.shape[-3]
        self.g = q.shape[-3] // self.hkv
        self.tq, self.tk = q.shape[-2], k.shape[-2]
        self.e, self.ev = q.shape[-1], v.shape[-1]
        self.block_k = max(1, int(BLOCK_K))
        rows = max(1, int(BLOCK_Q) * 4 // self.dtype.itemsize)
        self.bq = max(1, rows // self.g)             # query rows per head in an item
        self.block_elems = rows * self.block_k       # entries of a full block of scores
        self.limit = self.dtype.type(RESCALE_LIMIT)
        self.tiny = self.dtype.type(2.0**-60)
        self.ones = np.ones(self.tk, dtype=self.dtype)
        self.keys: dict[tuple[Any, ...], np.ndarray] = {}
        self.pending: dict[tuple[Any, ...], Future[np.ndarray]] = {}
        self.scratch = threading.local()             # freed with the call
        self._hidden: dict[tuple[int, int, int], np.ndarray] = {}

    def key_block(self, rows: int) -> int:
        """Keys per block for an item of ``rows`` query rows per head.

        Without a causal mask, an item with fewer rows than a full block (short
        Tq) takes wider key blocks, so its block of scores keeps the cache-sized
        area; with one, narrower blocks waste less above the diagonal.
        """
        if self.causal_offset is not None:
            return self.block_k
        return max(self.block_k, self.block_elems // (self.g * rows))

    def extended_keys(self, b: tuple[int, ...], hk: int) -> np.ndarray:
        """``[k | 1]`` (Tk, E + 1) of (b, hk), built once per call."""
        key = (b, hk)
        ke = self.keys.get(key)
        if ke is None:
            pending = self.pending.get(key)
            if pending is not None:                  # being built by a pool thread
                return pending.result()
            ke = self.keys[key] = self.build_keys(b, hk)
        return ke

    def build_keys(self, b: tuple[int, ...], hk: int) -> np.ndarray:
        """The array of :meth:`extended_keys`, built afresh."""
        ke = np.empty((self.tk, self.e + 1), dtype=self.dtype)
        ke[:, :self.e] = self.k[(*b, hk)]
        ke[:, self.e] = 1.0
        return ke

    def hidden(self, rows: int, cols: int, delta: int) -> np.ndarray:
        """Bool (rows, cols): key c hidden from row r when ``c > r + delta`` (cached)."""
        key = (rows, cols, delta)
        h = self._hidden.get(key)
        if h is None:
            h = self._hidden[key] = np.arange(cols)[None, :] > np.arange(rows)[:, None] + delta
        return h

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


def _flat(x: np.ndarray) -> np.ndarray:
    """(G, R, F) -> (G·R, F) when that is a view (one BLAS call instead of G)."""
    return x.reshape(-1, x.shape[-1]) if x.flags.c_contiguous else x


def _scores(p: _Problem, qe: np.ndarray, ke: np.ndarray, b: tuple[int, ...], hk: int,
            q0: int, q1: int, k0: int, k1: int, s: np.ndarray, *, hide: bool = True) -> None:
    """``s = [q·scale | -m] @ [k | 1]ᵀ`` for queries q0:q1 and keys k0:k1, masked.

    ``qe`` (G, q1 - q0, E + 1) and ``s`` (G, q1 - q0, k1 - k0). A float mask is
    added; hidden entries (boolean mask, causal) are -inf, or left as they are
    with ``hide=False`` (for :func:`_hide` to zero after the exponential).
    """
    if qe.flags.c_contiguous:
        np.matmul(_flat(qe), ke[k0:k1].T, out=_flat(s))  # (G·bq, bk)
    else:
        np.matmul(qe, ke[k0:k1].T, out=s)                # (G, bq, bk), one product per head
    mb = p.mask_block(b, hk, q0, q1, k0, k1)
    if mb is not None and mb.dtype != np.bool_:
        s += mb
    if hide:
        _hide(p, s, b, hk, q0, q1, k0, k1, -np.inf)


def _hide(p: _Problem, s: np.ndarray, b: tuple[int, ...], hk: int, q0: int, q1: int,
          k0: int, k1: int, value: float) -> None:
    """Set the entries of ``s`` hidden by a boolean mask or the causal mask to ``value``.

    The cheap path exponentiates first and then writes 0 here: NumPy's float64
    ``exp`` takes a slow path for -inf (about 3× the time per element), and an
    entry overwritten afterwards cannot leak, whatever the exponential made of it.
    """
    mb = p.mask_block(b, hk, q0, q1, k0, k1)
    if mb is not None and mb.dtype == np.bool_:
        np.copyto(s, value, where=~mb)
    if p.causal_offset is not None:
        d = q0 + p.causal_offset - k0            # row r of the tile sees columns c <= r + d
        w = k1 - k0
        if w - 1 > d:                            # some column is hidden from the first row
            # only the triangle is written: columns before c are seen by every row,
            # and rows from n on see every column
            c = max(0, d + 1)
            n = min(q1 - q0, w - 1 - d)
            np.copyto(s[..., :n, c:], value, where=p.hidden(n, w - c, d - c))


def _tiles(p: _Problem, q0: int, q1: int, bk: int) -> Iterator[tuple[int, int, int, int]]:
    """The (r0, r1, k0, k1) rectangles of scores that rows q0:q1 of an item need.

    Rows are relative to q0; keys come in blocks of ``bk``. Under a causal mask
    (row q0 + r sees keys j <= q0 + r + offset) the blocks stop at the last key
    the item's last row sees, and each block starts at the first row that sees
    any of it. Rows that see no key at all are in no rectangle.
    """
    off = p.causal_offset
    k_stop = p.tk if off is None else min(p.tk, q1 + off)
    for k0 in range(0, k_stop, bk):
        r0 = 0 if off is None else max(0, k0 - off - q0)
        yield r0, q1 - q0, k0, min(k0 + bk, k_stop)


def _attend_item(p: _Problem, b: tuple[int, ...], hk: int, q0: int, out: np.ndarray,
                 lse: np.ndarray) -> None:
    """:func:`_online_softmax` with overflow of the cheap path expected, not warned about.

    A cheap-path block whose exponentials overflow is detected by its row sum
    and redone, so the overflow (and an ``inf · 0`` it may cause) is silenced.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        _online_softmax(p, b, hk, q0, out, lse)


def _online_softmax(p: _Problem, b: tuple[int, ...], hk: int, q0: int, out: np.ndarray,
                    lse: np.ndarray) -> None:
    """Online softmax of one work item; writes its slice of ``out`` and ``lse``.

    Per row: ``m`` (a shift at most ``log(RESCALE_LIMIT)`` below the running
    maximum), ``l = Σ exp(s - m)`` and ``acc = Σ exp(s - m) v``, with ``s`` the
    scaled scores. Each key block takes the cheap path (exponentiate
    the already shifted scores, sum, multiply by ``v``) and is redone exactly
    (new maximum, rescaled ``l`` and ``acc``) only when a row's block sum is
    above ``RESCALE_LIMIT``, or below ``2**-60`` for a row that has no mass yet
    (underflow, or a row fully masked so far). Under a causal mask the scores are
    computed in the rectangles of :func:`_tiles`, which follow the diagonal.
    """
    g, e, ev = p.g, p.e, p.ev
    q1 = min(q0 + p.bq, p.tq)
    bq = q1 - q0
    bk = p.key_block(bq)
    heads = slice(hk * g, (hk + 1) * g)
    ix: tuple[Any, ...] = (*b, heads, slice(q0, q1))
    out_slice = out[ix]                              # (G, bq, Ev)
    lse_slice = lse[ix]                              # (G, bq)

    ke = p.extended_keys(b, hk)                       # (Tk, E + 1)
    vb = p.v[(*b, hk)]                                # (Tk, Ev)

    # --- queries of the G heads, scaled once, extended by the column -m
    qe = p.buffer("q", (g, bq, e + 1))
    np.multiply(p.q[ix], p.qscale, out=qe[..., :e])
    qe[..., e] = 0.0
    m = p.buffer("m", (g, bq))
    l = p.buffer("l", (g, bq))
    acc = p.buffer("acc", (g, bq, ev))
    m.fill(0.0)
    l.fill(0.0)
    acc.fill(0.0)

    for r0, r1, k0, k1 in _tiles(p, q0, q1, bk):
        rows = slice(r0, r1)
        r = r1 - r0
        s = p.buffer("s", (g, r, k1 - k0))
        l_blk = p.buffer("l_blk", (g, r))
        pv = p.buffer("pv", (g, r, ev))
        qr, mr, lr, accr = qe[:, rows], m[:, rows], l[:, rows], acc[:, rows]
        _scores(p, qr, ke, b, hk, q0 + r0, q0 + r1, k0, k1, s, hide=False)
        # --- cheap path: p = exp(s - m) in place, hidden entries then set to 0;
        # l_blk = p·1, a matrix-vector product
        np.exp(s, out=s)
        _hide(p, s, b, hk, q0 + r0, q0 + r1, k0, k1, 0.0)
        np.matmul(s, p.ones[:k1 - k0], out=l_blk)
        # two reductions settle the usual case; the row-wise test only runs when they
        # do not (a large or tiny sum somewhere, or a NaN)
        fine = l_blk.max() <= p.limit and l_blk.min() >= p.tiny
        if fine or not (need := (l_blk > p.limit) | ((lr == 0) & (l_blk < p.tiny))).any():
            np.matmul(_flat(s), vb[k0:k1], out=_flat(pv))  # (G·r, Ev)
            accr += pv
            lr += l_blk
            continue
        # --- exact path: d = how far each row's shift moves
        _scores(p, qr, ke, b, hk, q0 + r0, q0 + r1, k0, k1, s)
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
        np.negative(mr, out=qr[..., e])

    # --- normalise: out = acc / l, lse = m + log l; l == 0 (fully masked, including rows
    # that see no key): 0, -inf. A NaN in l, from a NaN input, propagates to out and lse.
    empty = None if l.all() else l == 0               # (NaN is truthy, and not 0)
    if empty is not None:
        l[empty] = 1.0
    np.divide(acc, l[..., None], out=out_slice)
    np.log(l, out=l)
    np.add(m, l, out=lse_slice)
    if empty is not None:
        out_slice[empty] = 0.0
        lse_slice[empty] = -np.inf


def attention(q: Any, k: Any, v: Any, /, *, mask: Any, causal_offset: int | None,
              scale: float, xp: Any) -> tuple[Any, Any]:
    """Blocked, multi-threaded attention on NumPy arrays; see :mod:`polyattn.implementations`.

    ``xp`` is accepted for the common signature; the arrays must be NumPy arrays.
    """
    q, k, v = (_blas_ready(np.asarray(x)) for x in (q, k, v))
    problem = _Problem(q, k, v, None if mask is None else np.asarray(mask), causal_offset, scale)
    out = np.empty((*q.shape[:-1], problem.ev), dtype=q.dtype)  # (B…, H, Tq, Ev)
    lse = np.empty(q.shape[:-1], dtype=q.dtype)                  # (B…, H, Tq)
    items = [(b, hk, q0) for b in np.ndindex(*q.shape[:-3]) for hk in range(problem.hkv)
             for q0 in range(0, problem.tq, problem.bq)]
    if not items:
        return out, lse
    # later query blocks see more keys under a causal mask: start them first
    items.sort(key=lambda item: -item[2])
    # Threads over items only where BLAS can be held to one thread per call:
    # a pool on top of BLAS's own threads oversubscribes the cores.
    n = min(num_threads(), len(items)) if _controller() else 1
    if n == 1:  # inline; BLAS keeps its own threads for the products
        for b, hk, q0 in items:
            _attend_item(problem, b, hk, q0, out, lse)
        return out, lse
    with single_threaded_blas():
        pool = _executor(n)
        # the extended keys are built by the pool too, queued ahead of the items (so no
        # item waits on a build that has not started)
        for b, hk in dict.fromkeys((b, hk) for b, hk, _ in items):
            problem.pending[(b, hk)] = pool.submit(problem.build_keys, b, hk)
        futures = [pool.submit(_attend_item, problem, b, hk, q0, out, lse)
                   for b, hk, q0 in items]
        for f in futures:
            f.result()
    return out, lse
