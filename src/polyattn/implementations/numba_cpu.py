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
BLOCK_ROWS = 512
#: Keys per block of scores.
BLOCK_K = 256
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


def _intrinsics(numba: Any) -> dict[str, Any]:
    """LLVM-level helpers: reinterpreting integer bits as a float, and calling a C function
    whose address is a run-time argument (so that compiled code stays cacheable)."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def float_from_bits(typingctx: Any, bits: Any) -> Any:
        """The float whose bits are ``bits`` (int32 -> float32, int64 -> float64)."""
        if bits == types.int32:
            sig, llty = types.float32(types.int32), ir.FloatType()
        elif bits == types.int64:
            sig, llty = types.float64(types.int64), ir.DoubleType()
        else:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], llty)

        return sig, codegen

    @intrinsic
    def call_int(typingctx: Any, address: Any, value: Any) -> Any:
        """``int f(int)`` at ``address`` (an int64), called with ``value``."""
        sig = types.int32(types.int64, types.int32)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
            fn = builder.inttoptr(args[0], fnty.as_pointer())
            return builder.call(fn, [args[1]])

        return sig, codegen

    @intrinsic
    def call_gemm(typingctx: Any, address: Any, pointers: Any) -> Any:
        """The BLAS ``?gemm`` at ``address``, called with 13 pointers (Fortran convention,
        every argument by reference), given as a tuple of 64-bit integer addresses."""
        members: list[Any] = list(getattr(pointers, "types", ()))
        if len(members) != 13 or not all(isinstance(x, types.Integer) and
                                         getattr(x, "bitwidth", 0) == 64 for x in members):
            return None
        sig = types.void(types.int64, pointers)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ptr = ir.IntType(8).as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [ptr] * 13)
            fn = builder.inttoptr(args[0], fnty.as_pointer())
            builder.call(fn, [builder.inttoptr(builder.extract_value(args[1], i), ptr)
                              for i in range(13)])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def maxnum(typingctx: Any, a: Any, b: Any) -> Any:
        """IEEE maxNum of two floats of one type: a NaN operand gives the other one (LLVM
        vectorises reductions of it, which it cannot do for ``max`` without assuming no
        NaN)."""
        if a != b or a not in (types.float32, types.float64):
            return None
        sig = a(a, b)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            llty = args[0].type
            name = "llvm.maxnum.f32" if a == types.float32 else "llvm.maxnum.f64"
            fn = cgutils.get_or_insert_function(builder.module,
                                                ir.FunctionType(llty, [llty, llty]), name)
            return builder.call(fn, args)

        return sig, codegen

    return {"float_from_bits": float_from_bits, "call_int": call_int, "call_gemm": call_gemm,
            "maxnum": maxnum}


def _define(numba: Any) -> dict[str, Any]:
    """Compile-on-demand definitions (Numba is imported lazily)."""
    from numba import njit, prange
    from numba.extending import overload

    low = _intrinsics(numba)
    float_from_bits, call_int, call_gemm, maxnum = (low["float_from_bits"], low["call_int"],
                                                    low["call_gemm"], low["maxnum"])
    fastmath = {"contract", "reassoc", "nsz", "arcp"}
    # the exponential keeps its evaluation order: reassociating (t - k·ln2_hi) - k·ln2_lo
    # into t - k·ln2 would lose the range reduction's extra bits
    exact = {"contract", "nsz", "arcp"}

    @njit(nogil=True, fastmath=exact, cache=True, inline="always")
    def exp_f32(v: Any) -> Any:
        """e^v for one float32 (see the module)."""
        lo = np.float32(-87.33654)
        t = max(v, lo)
        k = np.floor(t * np.float32(LOG2E) + np.float32(0.5))
        r = (t - k * np.float32(LN2_HI)) - k * np.float32(LN2_LO)
        p = np.float32(1.0 / 5040)
        p = p * r + np.float32(1.0 / 720)
        p = p * r + np.float32(1.0 / 120)
        p = p * r + np.float32(1.0 / 24)
        p = p * r + np.float32(1.0 / 6)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        # (Numba widens int32 arithmetic to int64: narrow back before reading the bits)
        p = p * float_from_bits(np.int32((np.int32(k) + np.int32(127)) << np.int32(23)))
        return p if v >= lo else (v if v != v else np.float32(0.0))

    @njit(nogil=True, fastmath=exact, cache=True, inline="always")
    def exp_f64(v: Any) -> Any:
        """e^v for one float64 (see the module)."""
        lo = -708.3964185322641
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
        p = p * float_from_bits((np.int64(k) + np.int64(1023)) << np.int64(52))
        return p if v >= lo else (v if v != v else 0.0)

    # (loops below run over views from index 0: with an index that might be negative,
    # Numba's wraparound check on every access keeps LLVM from vectorising)
    @njit(nogil=True, fastmath=exact, cache=True)
    def exp32(x: Any, shift: Any) -> None:
        """``x[j] = e^(x[j] - shift)``, float32, in place."""
        for j in range(x.shape[0]):
            x[j] = exp_f32(x[j] - shift)

    @njit(nogil=True, fastmath=exact, cache=True)
    def exp64(x: Any, shift: Any) -> None:
        """``x[j] = e^(x[j] - shift)``, float64, in place."""
        for j in range(x.shape[0]):
            x[j] = exp_f64(x[j] - shift)

    # one name for both dtypes inside compiled code (Numba's overloads are unannotated)
    def exp_shifted(x, shift):  # type: ignore[no-untyped-def]  # pragma: no cover
        raise NotImplementedError

    @overload(exp_shifted, jit_options={"nogil": True, "fastmath": exact})
    def _exp_shifted(x, shift):  # type: ignore[no-untyped-def]
        if x.dtype == numba.float32:
            return lambda x, shift: exp32(x, shift)
        return lambda x, shift: exp64(x, shift)

    @njit(nogil=True, cache=True)
    def gemm(blas: Any, args: Any, ta: int, tb: int, m: int, n: int, k: int, alpha: Any,
             a: int, lda: int, b: int, ldb: int, beta: Any, c: int, ldc: int) -> None:
        """Column-major ``C = alpha·op(A)·op(B) + beta·C`` through the BLAS at ``blas[0]``;
        ``a``, ``b``, ``c`` are addresses, ``ta``/``tb`` 0 ("N") or 1 ("T"). ``args`` is
        scratch: (2 chars, 6 int32, 2 scalars) for the by-reference arguments."""
        chars, ints, scal = args[0], args[1], args[2]
        ints[0], ints[1], ints[2], ints[3], ints[4], ints[5] = m, n, k, lda, ldb, ldc
        scal[0], scal[1] = alpha, beta
        c0, i0, s0 = chars.ctypes.data, ints.ctypes.data, scal.ctypes.data
        size = scal.itemsize
        call_gemm(blas[0], (c0 + ta, c0 + tb, i0, i0 + 4, i0 + 8, s0, a, i0 + 12, b,
                            i0 + 16, s0 + size, c, i0 + 20))

    @njit(nogil=True, fastmath=fastmath, cache=True)
    def attend_item(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
                    mmap: Any, lengths: Any, offsets: Any, slopes: Any, item: Any,
                    fparams: Any, iparams: Any, blas: Any, out: Any, lse: Any) -> None:
        """One work item: the G heads of key/value head ``hk`` of batch row ``b``, query
        rows ``[q0, q1)``, keys ``[k_lo, k_hi)``."""
        b, hk, q0, q1, k_lo, k_hi = item[0], item[1], item[2], item[3], item[4], item[5]
        e, ev = q.shape[3], v.shape[3]
        g_heads = q.shape[1] // k.shape[1]
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
        size = q.itemsize
        # one BLAS thread for this thread's products (restored at the end): BLAS must not
        # start threads of its own inside the parallel loop
        restore = call_int(blas[1], np.int32(1)) if blas[1] != 0 else np.int32(0)
        args = (np.array([ord("N"), ord("T")], dtype=np.uint8), np.empty(6, dtype=np.int32),
                np.empty(2, dtype=dt))

        qs = np.empty((rows, e), dtype=dt)
        for g in range(g_heads):
            for i in range(bq):
                for f in range(e):
                    qs[g * bq + i, f] = q[qb, hk * g_heads + g, q0 + i, f]
        m = np.full(rows, ninf, dtype=dt)
        l = np.zeros(rows, dtype=dt)
        acc = np.zeros((rows, ev), dtype=dt)
        s = np.empty((rows, block_k), dtype=dt)
        # key and value blocks are read in place when their rows are evenly spaced and
        # their features contiguous; otherwise copied
        k_direct = k.strides[3] == size and k.strides[2] % size == 0 and \
            k.strides[2] >= e * size
        v_direct = v.strides[3] == size and v.strides[2] % size == 0 and \
            v.strides[2] >= ev * size
        kblk = np.empty((0 if k_direct else block_k, e), dtype=dt)
        vblk = np.empty((0 if v_direct else block_k, ev), dtype=dt)
        hi_key = min(k_hi, length)
        for k0 in range(k_lo, hi_key, block_k):
            k1 = min(k0 + block_k, hi_key)
            n = k1 - k0
            if k_direct:
                k_ptr, ldk = k[kb, hk, k0:].ctypes.data, k.strides[2] // size
            else:
                for j in range(n):
                    for f in range(e):
                        kblk[j, f] = k[kb, hk, k0 + j, f]
                k_ptr, ldk = kblk.ctypes.data, e
            if v_direct:
                v_ptr, ldv = v[vb, hk, k0:].ctypes.data, v.strides[2] // size
            else:
                for j in range(n):
                    for f in range(ev):
                        vblk[j, f] = v[vb, hk, k0 + j, f]
                v_ptr, ldv = vblk.ctypes.data, ev
            # s[r, j] = scale · q_r · k_j  (row-major s is column-major sᵀ = K · Qᵀ)
            for r0 in range(0, rows, sub):
                r1 = min(r0 + sub, rows)
                gemm(blas, args, 1, 0, n, r1 - r0, e, scale, k_ptr, ldk,
                     qs[r0:].ctypes.data, e, zero, s[r0:].ctypes.data, block_k)
            for r in range(rows):
                g = r // bq
                i = q0 + r - g * bq
                h = hk * g_heads + g
                pos = i + offset
                row = s[r]
                # the keys this row may see at all (causal, window): [j0, j1)
                j0, j1 = 0, n
                if left >= 0:
                    j0 = min(n, max(0, pos - left - k0))
                if right >= 0:
                    j1 = max(j0, min(n, pos + right + 1 - k0))
                seg = row[j0:j1]
                width = seg.shape[0]
                if has_cap:
                    for j in range(width):
                        seg[j] = softcap * np.tanh(seg[j] / softcap)
                if has_alibi:
                    slope = slopes[b, h]
                    first = pos - (k0 + j0)             # pos - key at j = 0
                    for j in range(width):
                        seg[j] -= slope * abs(first - j)
                if has_mask:
                    mrow = mask[mb, h if mh_full else 0, i if mi_full else 0]
                    if mj_full:
                        mseg = mrow[k0 + j0:k0 + j1]
                        for j in range(width):
                            seg[j] += mseg[j]
                    else:
                        mval = mrow[0]
                        for j in range(width):
                            seg[j] += mval
                # the largest score that is not NaN: a NaN score needs no help to propagate
                # (its weight e^(NaN - m) is NaN, and so are the row's sum and output)
                bmax = ninf
                for j in range(width):
                    bmax = maxnum(bmax, seg[j])
                row[:j0] = zero
                row[j1:n] = zero
                m_old = m[r]
                m_new = max(m_old, bmax)
                shift = m_new if m_new != ninf else zero
                exp_shifted(seg, shift)
                total = zero
                for j in range(width):
                    total += seg[j]
                if m_new != m_old:
                    alpha = zero if m_old == ninf else math.exp(m_old - shift)
                    l[r] *= alpha
                    for f in range(ev):
                        acc[r, f] *= alpha
                    m[r] = m_new
                l[r] += total
            # acc += p · v  (column-major accᵀ += Vᵀ · Pᵀ)
            for r0 in range(0, rows, sub):
                r1 = min(r0 + sub, rows)
                gemm(blas, args, 0, 0, ev, r1 - r0, n, one, v_ptr, ldv,
                     s[r0:].ctypes.data, block_k, one, acc[r0:].ctypes.data, ev)
        if blas[1] != 0:
            call_int(blas[1], restore)
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
                fparams: Any, iparams: Any, blas: Any, out: Any, lse: Any) -> None:
        for t in prange(items.shape[0]):
            attend_item(q, k, v, qmap, kmap, vmap, mask, mmap, lengths, offsets, slopes,
                        items[t], fparams, iparams, blas, out, lse)

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
                  arr(dt, 2), arr(t.int64, 2), arr(dt, 1), i1, i1, arr(dt, 4, False),
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
    out = np.array(x, copy=True, order="C")
    kernels()["exp32" if out.dtype == np.float32 else "exp64"](out, out.dtype.type(0.0))
    return out


# --- BLAS --------------------------------------------------------------------------------

#: Per dtype: (address of ?gemm, address of the BLAS's thread-local thread setter or 0).
_blas: dict[str, np.ndarray] = {}
#: Where the setter came from (for ``explain``): e.g. "openblas_set_num_threads_local".
_blas_threads: list[str] = []


def blas(dtype: np.dtype) -> np.ndarray:
    """The BLAS the kernel calls: SciPy's ``sgemm``/``dgemm`` (the BLAS Numba itself
    uses), and that library's thread-local thread count setter where it has one
    (OpenBLAS ≥ 0.3.27, MKL). With the setter, each work item runs its products on one
    BLAS thread, whatever their size, and puts the thread's previous setting back; without
    it, products are cut into slabs too small for OpenBLAS to thread (``SINGLE_THREAD_GEMM``)."""
    name = "sgemm" if dtype == np.float32 else "dgemm"
    with _lock:
        if name not in _blas:
            import scipy.linalg.cython_blas as cython_blas
            from numba.extending import get_cython_function_address

            gemm = get_cython_function_address("scipy.linalg.cython_blas", name)
            setter = 0
            try:
                library = ctypes.CDLL(cython_blas.__file__)
            except OSError:
                library = None
            for symbol in ("openblas_set_num_threads_local", "mkl_set_num_threads_local"):
                function = getattr(library, symbol, None) if library is not None else None
                if function is not None:
                    setter = ctypes.cast(function, ctypes.c_void_p).value or 0
                    if not _blas_threads:
                        _blas_threads.append(symbol)
                    break
            _blas[name] = np.array([gemm, setter], dtype=np.int64)
        return _blas[name]


def blas_threads() -> str:
    """How BLAS is kept to one thread inside the kernel's parallel loop."""
    if _blas_threads:
        return f"one BLAS thread per work item ({_blas_threads[0]})"
    return ("products cut into slabs OpenBLAS runs on the calling thread (no thread-local "
            "BLAS setting found)")


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
        forward = kernels()["forward"]
        library = blas(dtype)
        sub = rows * g if library[1] else _slab_rows(max(e, ev))
        iparams = np.array([int(rules.causal), left, right, has_mask,
                            int(rules.alibi is not None), int(rules.softcap is not None),
                            BLOCK_K, sub], dtype=np.int64)
        import numba

        with _serialised():
            # items one at a time to whichever thread is free (they are sorted largest
            # first: static chunks would leave one thread with the large ones)
            before = numba.set_parallel_chunksize(1)
            try:
                forward(q4, k4, v4, qmap, kmap, vmap, mask4, mmap, lengths, offsets, slopes,
                        items_arr, fparams, iparams, library, out, lse)
            finally:
                numba.set_parallel_chunksize(before)
            if not _layer:
                _layer.append(str(numba.threading_layer()))
    return out.reshape((*batch, *out_shape[1:])), lse.reshape((*batch, h, tq))
