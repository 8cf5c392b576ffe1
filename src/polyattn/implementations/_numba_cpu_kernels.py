"""The compiled functions of :mod:`.numba_cpu` (this module imports Numba: import it only
where Numba is installed; :mod:`.numba_cpu` does so on first use).

They are module-level functions, not closures, so that Numba's on-disk cache finds them
again in the next process.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

LN2_HI = 0.693145751953125              # ln 2 to 16 bits: n·LN2_HI is exact for |n| < 2¹¹
LN2_LO = 1.4286068203094172321e-06      # ln 2 - LN2_HI
LOG2E = 1.4426950408889634

# --- LLVM-level helpers: reinterpreting integer bits as a float, IEEE maxNum, and calling a
# C function whose address is a run-time argument (so that compiled code stays cacheable)

def _float_from_bits(typingctx: Any, bits: Any) -> Any:
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


float_from_bits: Any = intrinsic(_float_from_bits)

def _call_gemm(typingctx: Any, address: Any, pointers: Any) -> Any:
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


call_gemm: Any = intrinsic(_call_gemm)

def _maxnum(typingctx: Any, a: Any, b: Any) -> Any:
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


maxnum: Any = intrinsic(_maxnum)


# --- the exponential, the BLAS call, the kernel

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
    # start threads of its own inside the parallel loop
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

# compiled for the signatures of :func:`signature` by ``numba_cpu.kernels``
@njit(parallel=True, nogil=True, fastmath=fastmath, cache=True)
def forward(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
            mmap: Any, lengths: Any, offsets: Any, slopes: Any, items: Any,
            fparams: Any, iparams: Any, blas: Any, out: Any, lse: Any) -> None:
    for t in prange(items.shape[0]):
        attend_item(q, k, v, qmap, kmap, vmap, mask, mmap, lengths, offsets, slopes,
                    items[t], fparams, iparams, blas, out, lse)


def signature(dt: Any) -> Any:
    """The kernel's one signature per dtype: every array of any layout ("A"), so that
    strided views (the (B, T, H, E) layout, broadcast masks) need no new compilation."""
    t = numba.types
    dt = numba.from_dtype(np.dtype(dt))

    def arr(dtype: Any, ndim: int, readonly: bool = True) -> Any:
        # inputs read-only (broadcast views are), so that any array matches
        return t.Array(dtype, ndim, "A", readonly=readonly)

    i1 = arr(t.int64, 1)
    return t.void(arr(dt, 4), arr(dt, 4), arr(dt, 4), i1, i1, i1, arr(dt, 4), i1, i1, i1,
                  arr(dt, 2), arr(t.int64, 2), arr(dt, 1), i1, i1, arr(dt, 4, False),
                  arr(dt, 3, False))
