"""A fused CPU kernel compiled with Numba: the online softmax in one pass per tile.

The algorithm of :mod:`.numpy_chunked` (work items of (batch row, key/value
head, query block) holding the G query heads of a group; per key block the
scores ``Q Kᵀ`` and the product ``P V`` through ``np.dot``, i.e. BLAS), with
everything between the two products fused into one loop per row, compiled:
the scores' transform (§4.1: soft-capping, ALiBi, the float mask, visibility),
the block maximum, the rescale of what was accumulated, and the exponentials.

- **Exponentials** by :func:`exp_into`: Cody–Waite range reduction
  (``x = n·ln 2 + r``, ``|r| ≤ ln 2 / 2``), a polynomial for ``e^r`` (degree 7
  in float32, 13 in float64) and ``2ⁿ`` built in the exponent bits, in loops
  LLVM vectorises. Arguments below the smallest normal result give 0
  (``e^-87.3`` in float32, ``e^-708.3`` in float64): such weights are below
  the rounding of a row whose largest weight is 1. ``-inf`` gives 0, NaN
  stays NaN.
- **Floating-point semantics kept.** ``fastmath`` allows reassociation and
  contraction (so reductions vectorise) but not the "no NaN / no inf"
  assumptions: ``-inf`` marks invisible keys as everywhere else in polyattn,
  and NaN and inf inputs propagate as DESIGN §4 says.
- **Parallel over items** with ``prange``. Work items are independent, each
  writes its own rows of ``out`` and ``lse``: the result does not depend on
  the number of threads.

This module imports Numba when it is first used; :func:`availability` says
whether it can run.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from ._rules import Rules

Array = Any

#: Query rows per work item, summed over the G heads of a group (float32; half in float64).
BLOCK_ROWS = 256
#: Keys per block of scores.
BLOCK_K = 128
#: OpenBLAS runs a product ``(m, k) @ (k, n)`` on the calling thread alone when
#: ``m·n·k`` is at most this (65536 × its GEMM_MULTITHREAD_THRESHOLD of 4): the kernel's
#: products are cut into slabs that small, so that BLAS starts no threads of its own
#: inside the parallel loop, and nothing about BLAS threads changes for anyone else.
SINGLE_THREAD_GEMM = 65536 * 4


def _slab_rows(width: int) -> int:
    """Rows per product slab for ``BLOCK_K`` keys and ``width`` features."""
    return max(1, SINGLE_THREAD_GEMM // (BLOCK_K * max(1, width)))

_lock = threading.Lock()
_kernels: dict[str, Any] = {}


def availability() -> tuple[bool, str]:
    """(usable, reason): whether Numba is installed so that this kernel can be compiled."""
    try:
        import numba
    except ImportError as exc:
        return False, f"Numba is not installed ({exc}); pip install 'polyattn[fast]'"
    return True, f"Numba {numba.__version__}"


# --- the exponential ---------------------------------------------------------------------

LN2_HI = 0.693145751953125              # ln 2 to 16 bits: n·LN2_HI is exact for |n| < 2¹¹
LN2_LO = 1.4286068203094172321e-06      # ln 2 - LN2_HI
LOG2E = 1.4426950408889634
#: Below these, e^x is subnormal (or 0) and the kernel returns 0.
EXP_MIN = {np.dtype(np.float32): -87.33654, np.dtype(np.float64): -708.3964185322641}


def _define(numba: Any) -> dict[str, Any]:
    """Compile-on-demand definitions (Numba is imported lazily)."""
    from numba import njit, prange
    from numba.extending import overload

    fastmath = {"contract", "reassoc", "nsz", "arcp"}
    # the exponential keeps its evaluation order: reassociating (t - k·ln2_hi) - k·ln2_lo
    # into t - k·ln2 would lose the range reduction's extra bits
    exact = {"contract", "nsz", "arcp"}

    @njit(nogil=True, fastmath=exact, cache=True)
    def exp32(x: Any, out: Any, ebits: Any) -> None:
        """``out[i] = e^x[i]``, float32 (see the module); ``ebits``: float32 scratch, n long."""
        n = x.shape[0]
        eb = ebits[:n].view(np.int32)
        lo, bias, shift = np.float32(-87.33654), np.int32(127), np.int32(23)
        log2e, ln2_hi, ln2_lo = np.float32(LOG2E), np.float32(LN2_HI), np.float32(LN2_LO)
        half, zero = np.float32(0.5), np.float32(0.0)
        for i in range(n):
            v = x[i]
            t = max(v, lo)
            k = np.floor(t * log2e + half)
            r = (t - k * ln2_hi) - k * ln2_lo
            p = np.float32(1.0 / 5040)
            p = p * r + np.float32(1.0 / 720)
            p = p * r + np.float32(1.0 / 120)
            p = p * r + np.float32(1.0 / 24)
            p = p * r + np.float32(1.0 / 6)
            p = p * r + half
            p = p * r + np.float32(1.0)
            p = p * r + np.float32(1.0)
            eb[i] = (np.int32(k) + bias) << shift
            out[i] = p if v >= lo else (v if v != v else zero)
        scale = ebits
        for i in range(n):
            out[i] *= scale[i]

    @njit(nogil=True, fastmath=exact, cache=True)
    def exp64(x: Any, out: Any, ebits: Any) -> None:
        """``out[i] = e^x[i]``, float64 (see the module); ``ebits``: float64 scratch, n long."""
        n = x.shape[0]
        eb = ebits[:n].view(np.int64)
        lo, bias, shift = -708.3964185322641, np.int64(1023), np.int64(52)
        for i in range(n):
            v = x[i]
            t = max(v, lo)
            k = np.floor(t * LOG2E + 0.5)
            r = (t - k * LN2_HI) - k * LN2_LO
            p = 1.0 / 6227020800.0
            p = p * r + 1.0 / 479001600.0
            p = p * r + 1.0 / 39916800.0
            p = p * r + 1.0 / 3628800.0
            p = p * r + 1.0 / 362880.0
            p = p * r + 1.0 / 40320.0
            p = p * r + 1.0 / 5040.0
            p = p * r + 1.0 / 720.0
            p = p * r + 1.0 / 120.0
            p = p * r + 1.0 / 24.0
            p = p * r + 1.0 / 6.0
            p = p * r + 0.5
            p = p * r + 1.0
            p = p * r + 1.0
            eb[i] = (np.int64(k) + bias) << shift
            out[i] = p if v >= lo else (v if v != v else 0.0)
        scale = ebits
        for i in range(n):
            out[i] *= scale[i]

    # one name for both dtypes inside compiled code (Numba's overloads are unannotated)
    def exp_into(x, out, ebits):  # type: ignore[no-untyped-def]  # pragma: no cover
        raise NotImplementedError

    @overload(exp_into, jit_options={"nogil": True, "fastmath": exact})
    def _exp_into(x, out, ebits):  # type: ignore[no-untyped-def]
        if x.dtype == numba.float32:
            return lambda x, out, ebits: exp32(x, out, ebits)
        return lambda x, out, ebits: exp64(x, out, ebits)

    @njit(nogil=True, fastmath=fastmath, cache=True)
    def attend_item(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
                    mmap: Any, lengths: Any, offsets: Any, slopes: Any, item: Any,
                    fparams: Any, iparams: Any, out: Any, lse: Any) -> None:
        """One work item: the G heads of key/value head ``hk`` of batch row ``b``, query
        rows ``[q0, q1)``, keys ``[k_lo, k_hi)``."""
        b, hk, q0, q1, k_lo, k_hi = item[0], item[1], item[2], item[3], item[4], item[5]
        h_all, e, ev = q.shape[1], q.shape[3], v.shape[3]
        g_heads = h_all // k.shape[1]
        bq = q1 - q0
        rows = g_heads * bq
        dt = q.dtype
        # constants of the compute dtype (a bare 0.0 would make float32 maths float64)
        scale, softcap, zero, one, ninf = fparams[0], fparams[1], fparams[2], fparams[3], \
            fparams[4]
        left, right = iparams[1], iparams[2]
        has_mask, has_alibi, has_cap = iparams[3], iparams[4], iparams[5]
        block_k, sub = iparams[6], iparams[7]
        length = lengths[b]
        offset = offsets[b]
        qb, kb, vb = qmap[b], kmap[b], vmap[b]
        mb = mmap[b]
        mh_full, mi_full, mj_full = mask.shape[1] > 1, mask.shape[2] > 1, mask.shape[3] > 1

        qs = np.empty((rows, e), dtype=dt)
        for g in range(g_heads):
            for i in range(bq):
                for f in range(e):
                    qs[g * bq + i, f] = q[qb, hk * g_heads + g, q0 + i, f] * scale
        m = np.full(rows, ninf, dtype=dt)
        l = np.zeros(rows, dtype=dt)
        acc = np.zeros((rows, ev), dtype=dt)
        kblk = np.empty((block_k, e), dtype=dt)
        vblk = np.empty((block_k, ev), dtype=dt)
        expd = np.empty(block_k, dtype=dt)
        ebits = np.empty(block_k, dtype=dt)         # the exponential's scratch
        hi_key = min(k_hi, length)
        for k0 in range(k_lo, hi_key, block_k):
            k1 = min(k0 + block_k, hi_key)
            n = k1 - k0
            for j in range(n):
                for f in range(e):
                    kblk[j, f] = k[kb, hk, k0 + j, f]
                for f in range(ev):
                    vblk[j, f] = v[vb, hk, k0 + j, f]
            # products in slabs of ``sub`` rows: each stays under OpenBLAS's threshold for
            # threading, so it runs on this thread only (no BLAS threads inside prange)
            s = np.empty((rows, n), dtype=dt)                        # (rows, n)
            kt = kblk[:n].T
            for r0 in range(0, rows, sub):
                r1 = min(r0 + sub, rows)
                np.dot(qs[r0:r1], kt, s[r0:r1])
            for r in range(rows):
                g = r // bq
                i = q0 + r - g * bq
                h = hk * g_heads + g
                pos = i + offset
                slope = slopes[b, h] if has_alibi else zero
                mh = h if mh_full else 0
                mi = i if mi_full else 0
                row = s[r]
                bmax = ninf
                for j in range(n):
                    key = k0 + j
                    x = row[j]
                    if has_cap:
                        x = softcap * np.tanh(x / softcap)
                    if has_alibi:
                        x -= slope * abs(pos - key)
                    if has_mask:
                        x += mask[mb, mh, mi, key if mj_full else 0]
                    if (left >= 0 and key < pos - left) or (right >= 0 and key > pos + right):
                        x = ninf
                    row[j] = x
                    bmax = max(bmax, x)
                m_old = m[r]
                m_new = max(m_old, bmax)
                shift = m_new if m_new != ninf else zero
                for j in range(n):
                    row[j] -= shift
                exp_into(row[:n], expd, ebits)
                total = zero
                for j in range(n):
                    row[j] = expd[j]
                    total += expd[j]
                alpha = zero if m_old == ninf else math.exp(m_old - shift)
                l[r] = l[r] * alpha + total
                for f in range(ev):
                    acc[r, f] *= alpha
                m[r] = m_new
            vb_n = vblk[:n]
            for r0 in range(0, rows, sub):
                r1 = min(r0 + sub, rows)
                acc[r0:r1] += np.dot(s[r0:r1], vb_n)
        for r in range(rows):
            g = r // bq
            i = q0 + r - g * bq
            h = hk * g_heads + g
            if l[r] == zero:
                for f in range(ev):
                    out[b, h, i, f] = zero
                lse[b, h, i] = ninf
            else:
                inv = one / l[r]
                for f in range(ev):
                    out[b, h, i, f] = acc[r, f] * inv
                lse[b, h, i] = m[r] + np.log(l[r])

    signatures = [_signature(numba, numba.float32), _signature(numba, numba.float64)]

    @njit(signatures, parallel=True, nogil=True, fastmath=fastmath, cache=True)
    def forward(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
                mmap: Any, lengths: Any, offsets: Any, slopes: Any, items: Any,
                fparams: Any, iparams: Any, out: Any, lse: Any) -> None:
        for t in prange(items.shape[0]):
            attend_item(q, k, v, qmap, kmap, vmap, mask, mmap, lengths, offsets, slopes,
                        items[t], fparams, iparams, out, lse)

    return {"exp32": exp32, "exp64": exp64, "attend_item": attend_item, "forward": forward}


def _signature(numba: Any, dt: Any) -> Any:
    """The kernel's one signature per dtype: every array of any layout ("A"), so that
    strided views (the (B, T, H, E) layout, broadcast masks) need no new compilation."""
    t = numba.types

    def arr(dtype: Any, ndim: int, readonly: bool = True) -> Any:
        # inputs read-only (broadcast views are), so that any array matches
        return t.Array(dtype, ndim, "A", readonly=readonly)

    i1 = arr(t.int64, 1)
    return t.void(arr(dt, 4), arr(dt, 4), arr(dt, 4), i1, i1, i1, arr(dt, 4), i1, i1, i1,
                  arr(dt, 2), arr(t.int64, 2), arr(dt, 1), i1, arr(dt, 4, False),
                  arr(dt, 3, False))


def kernels() -> dict[str, Any]:
    """The compiled functions (compiled, or loaded from Numba's cache, on first use)."""
    with _lock:
        if not _kernels:
            import numba

            _choose_threading_layer(numba)
            _kernels.update(_define(numba))
        return _kernels


# --- threads -----------------------------------------------------------------------------

#: The Numba threading layer in use once the kernel has run (for ``explain``).
_layer: list[str] = []


def _preload_tbb() -> None:
    """Make the TBB library of the ``tbb`` wheel loadable by Numba (it sits in the
    environment's ``lib`` folder, which the dynamic loader does not search)."""
    for path in sorted(glob.glob(os.path.join(sys.prefix, "lib", "libtbb.so.1[2-9]*"))):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


def _choose_threading_layer(numba: Any) -> None:
    """Prefer a threading layer that is safe with concurrent callers: TBB (also fork-safe),
    else OpenMP; Numba's own "workqueue" is used only when neither loads, and then calls
    are serialised (:func:`_serialised`). ``NUMBA_THREADING_LAYER`` set by the user wins."""
    if os.environ.get("NUMBA_THREADING_LAYER"):
        return
    _preload_tbb()
    safe = []
    for layer, module in (("tbb", "tbbpool"), ("omp", "omppool")):
        try:
            __import__(f"numba.np.ufunc.{module}")
            safe.append(layer)
        except ImportError:
            continue
    numba.config.THREADING_LAYER_PRIORITY = [*safe, *(
        x for x in ("tbb", "omp", "workqueue") if x not in safe)]
    numba.config.THREADING_LAYER = "threadsafe" if safe else "workqueue"


def threading_layer() -> str:
    """The Numba threading layer the kernel runs on ("" before its first call)."""
    return _layer[0] if _layer else ""


@contextmanager
def _serialised() -> Iterator[None]:
    """Calls one at a time where the threading layer is not safe for concurrent callers."""
    with _call_lock if threading_layer() in ("", "workqueue") else nullcontext():
        yield


_call_lock = threading.Lock()


def exp(x: np.ndarray) -> np.ndarray:
    """The kernel's exponential of a 1-D float32 or float64 array (for tests and checks)."""
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    ebits = np.empty_like(x)
    kernels()["exp32" if x.dtype == np.float32 else "exp64"](x, out, ebits)
    return out


# --- the call ----------------------------------------------------------------------------

def _own(x: np.ndarray, batch: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (B…|1, A, T, F), each batch axis 1 or full, as (B_own, A, T, F) without its
    broadcast batch axes, and the map from each flat index of the problem's batch B… to
    its row of that array."""
    nb = len(batch)
    own_index = tuple(slice(0, 1) if s == 0 and n > 1 else slice(None)
                      for s, n in zip(x.strides[:nb], x.shape[:nb], strict=True))
    own = x[own_index]
    own_batch = own.shape[:nb]
    flat = own.reshape((math.prod(own_batch), *x.shape[nb:]))        # a copy only if needed
    if not batch:
        return flat, np.zeros(1, dtype=np.int64)
    grids = np.indices(batch).reshape(nb, -1)
    idx = tuple(np.where(np.asarray(own_batch)[:, None] == 1, 0, grids))
    return flat, np.ravel_multi_index(idx, own_batch).astype(np.int64)


def _per_batch(x: np.ndarray | None, batch: tuple[int, ...], fill: int, dtype: Any,
               ) -> np.ndarray:
    """A ``len(B…)``-dimensional integer array (or ``None``: ``fill``) as (prod(B…),)."""
    if x is None:
        return np.full(math.prod(batch), fill, dtype=dtype)
    return np.broadcast_to(np.asarray(x), batch).reshape(-1).astype(dtype)


def attention(q: Any, k: Any, v: Any, /, *, mask: Any, causal_offset: int | None,
              scale: float, xp: Any, rules: Rules | None = None) -> tuple[Any, Any]:
    """The fused kernel on NumPy arrays; see :mod:`polyattn.implementations`.

    Dropout is not done here (``ValueError``); every other rule of :class:`Rules` is.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    tq, tk = q.shape[-2], k.shape[-2]
    rules = rules or Rules.from_causal_offset(causal_offset, tq, tk)
    if rules.dropout:
        raise ValueError("implementation='numba_cpu' does not do dropout")
    nb = q.ndim - 3
    batch = tuple(q.shape[:nb])
    n_batch = math.prod(batch)
    dtype = q.dtype
    q4, qmap = _own(q, batch)
    k4, kmap = _own(k, batch)
    v4, vmap = _own(v, batch)
    if mask is None:
        mask4, mmap, has_mask = np.zeros((1, 1, 1, 1), dtype=dtype), np.zeros(n_batch,
                                                                              np.int64), 0
    else:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            mask = np.where(mask, dtype.type(0.0), dtype.type(-np.inf))
        mask4, mmap = _own(mask.astype(dtype, copy=False), batch)
        has_mask = 1
    lengths = _per_batch(rules.key_lengths, batch, tk, np.int64)
    lengths = np.clip(lengths, 0, tk)
    if rules.lengths_shift:
        offsets = lengths - tq
    else:
        offsets = np.full(n_batch, rules.offset, dtype=np.int64)
    h = q.shape[-3]
    if rules.alibi is not None:
        slopes = np.broadcast_to(np.asarray(rules.alibi, dtype=dtype),
                                 (*batch, h)).reshape(n_batch, h)
        slopes = np.ascontiguousarray(slopes)
    else:
        slopes = np.zeros((1, 1), dtype=dtype)
    left, right = rules.left_reach(), rules.right_reach()
    reach = tq + tk + max(abs(o) for o in rules.offset_range())
    left = -1 if left is None else min(left, reach)
    right = -1 if right is None else min(right, reach)
    hkv = k.shape[-3]
    g = h // hkv
    rows = max(1, (BLOCK_ROWS * 4 // dtype.itemsize) // g)
    items = []
    for b in range(n_batch):
        lo_off = hi_off = int(offsets[b])
        for q0 in range(0, tq, rows):
            q1 = min(q0 + rows, tq)
            lo, hi = rules.key_range(q0, q1, (lo_off, hi_off))
            hi = min(hi, int(lengths[b]))
            for hk in range(hkv):
                items.append((b, hk, q0, q1, lo, max(lo, hi)))
    e, ev = q.shape[-1], v.shape[-1]
    out_shape = (n_batch, h, tq, ev)
    out = np.empty(out_shape, dtype=dtype)
    lse = np.empty((n_batch, h, tq), dtype=dtype)
    if items:
        items_arr = np.asarray(items, dtype=np.int64)
        items_arr = items_arr[np.argsort(-(items_arr[:, 5] - items_arr[:, 4]), kind="stable")]
        fparams = np.array([scale, rules.softcap or 1.0, 0.0, 1.0, -np.inf], dtype=dtype)
        iparams = np.array([int(rules.causal), left, right, has_mask,
                            int(rules.alibi is not None), int(rules.softcap is not None),
                            BLOCK_K, _slab_rows(max(e, ev))], dtype=np.int64)
        forward = kernels()["forward"]
        with _serialised():
            forward(q4, k4, v4, qmap, kmap, vmap, mask4, mmap, lengths, offsets, slopes,
                    items_arr, fparams, iparams, out, lse)
            if not _layer:
                import numba

                _layer.append(str(numba.threading_layer()))
    return out.reshape((*batch, *out_shape[1:])), lse.reshape((*batch, h, tq))
