"""The compiled functions of :mod:`.numba_cpu` (this module imports Numba: import it only
where Numba is installed; :mod:`.numba_cpu` does so on first use).

They are module-level functions, not closures, so that Numba's on-disk cache finds them
again in the next process.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic, overload

from ._numba_cpu_tiles import (
    TILE_ROWS,
    TILE_VECTORS,
    VECTOR_BYTES,
    exp_sum,
    softmax_step,
    tile_1,
    tile_2,
    tile_4,
    tile_8,
    tile_rows,
)

# --- LLVM-level helper: calling a C function whose address is a run-time argument (so
# that compiled code stays cacheable)

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

# --- the exponential, the dropout counters, the BLAS call, the kernel

fastmath = {"contract", "reassoc", "nsz", "arcp"}
# the exponential keeps its evaluation order: reassociating (t - k·ln2_hi) - k·ln2_lo
# into t - k·ln2 would lose the range reduction's extra bits
exact = {"contract", "nsz", "arcp"}

# (loops below run over views from index 0: with an index that might be negative,
# Numba's wraparound check on every access keeps LLVM from vectorising)
@njit(nogil=True, fastmath=fastmath, cache=True, inline="always")
def apply_mask(seg: Any, mrow: Any, key0: int, hide: bool, ninf: Any) -> None:
    """The mask's row ``mrow`` (one entry, or one per key) on the scores ``seg`` of keys
    ``key0, key0 + 1, …``: added (a float mask), or, for a boolean mask (``hide``; its
    False entries arrive as -inf), the hidden scores replaced by -inf, so that a NaN or
    inf score of a key the mask hides cannot reach the result (as in the other paths)."""
    width = seg.shape[0]
    per_key = mrow.shape[0] > 1
    mseg = mrow[key0:key0 + width] if per_key else mrow[:1]
    if hide:
        if per_key:
            for j in range(width):
                seg[j] = ninf if mseg[j] == ninf else seg[j]
        elif mseg[0] == ninf:
            seg[:] = ninf
    elif per_key:
        for j in range(width):
            seg[j] += mseg[j]
    else:
        mval = mseg[0]
        for j in range(width):
            seg[j] += mval


@njit(nogil=True, fastmath=exact, cache=True)
def exp32(x: Any, shift: Any) -> None:
    """``x[j] = e^(x[j] - shift)``, float32, in place (``x`` contiguous)."""
    exp_sum(x.ctypes.data, x.shape[0], shift)

@njit(nogil=True, fastmath=exact, cache=True)
def exp64(x: Any, shift: Any) -> None:
    """``x[j] = e^(x[j] - shift)``, float64, in place (``x`` contiguous)."""
    exp_sum(x.ctypes.data, x.shape[0], shift)

# one name for both dtypes inside compiled code (Numba's overloads are unannotated)
def exp_shifted(x, shift):  # type: ignore[no-untyped-def]  # pragma: no cover
    raise NotImplementedError

@overload(exp_shifted, jit_options={"nogil": True, "fastmath": exact})
def _exp_shifted(x, shift):  # type: ignore[no-untyped-def]
    if x.dtype == numba.float32:
        return lambda x, shift: exp32(x, shift)
    return lambda x, shift: exp64(x, shift)

@njit(nogil=True, cache=True, inline="always")
def philox_x0(n: Any, key0: Any, key1: Any) -> Any:
    """The first output word of Philox4x32-10 (``_dropout``) for the counter
    ``(n mod 2³², n div 2³², 0, 0)`` under the key words ``(key0, key1)``; uint64 words
    holding 32-bit values (every operand uint64: Numba would make uint64 ⊕ int64 a float)."""
    mask, shift = np.uint64(0xFFFFFFFF), np.uint64(32)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    c0, c1, c2, c3 = n & mask, n >> shift, np.uint64(0), np.uint64(0)
    k0, k1 = key0, key1
    for r in range(10):
        if r:
            k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
        p0, p1 = c0 * m0, c2 * m1
        c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ k0, p1 & mask, (p0 >> shift) ^ c3 ^ k1, p0 & mask
    return c0


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

@njit(nogil=True, cache=True, inline="always")
def tile_product(a: int, a_row: int, a_col: int, rows: int, b: int, ldb: int, c: int,
                 ldc: int, depth: int, alpha: Any, accumulate: bool, size: int) -> None:
    """``C[rows × W] = alpha · A · B (+ C)``, W = TILE_VECTORS vectors, in tiles of
    TILE_ROWS rows and the rest in tiles of 8, 4, 2, 1 rows (addresses and strides as in
    :mod:`._numba_cpu_tiles`)."""
    r = 0
    while r + TILE_ROWS <= rows:
        tile_rows(a + r * a_row * size, a_row, a_col, b, ldb, c + r * ldc * size, ldc, depth,
                  alpha, accumulate)
        r += TILE_ROWS
    if TILE_ROWS > 8 and r + 8 <= rows:
        tile_8(a + r * a_row * size, a_row, a_col, b, ldb, c + r * ldc * size, ldc, depth,
               alpha, accumulate)
        r += 8
    if r + 4 <= rows:
        tile_4(a + r * a_row * size, a_row, a_col, b, ldb, c + r * ldc * size, ldc, depth,
               alpha, accumulate)
        r += 4
    if r + 2 <= rows:
        tile_2(a + r * a_row * size, a_row, a_col, b, ldb, c + r * ldc * size, ldc, depth,
               alpha, accumulate)
        r += 2
    if r < rows:
        tile_1(a + r * a_row * size, a_row, a_col, b, ldb, c + r * ldc * size, ldc, depth,
               alpha, accumulate)


@njit(nogil=True, fastmath=fastmath, cache=True)
def attend_item(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
                mmap: Any, lengths: Any, offsets: Any, slopes: Any, item: Any, fparams: Any,
                iparams: Any, out: Any, lse: Any) -> None:
    """:func:`attend_item` with every step in SIMD vectors across query rows: the item's
    query rows in panels of W = TILE_VECTORS vectors (one column per row); per block of
    keys and panel, the transposed scores ``Sᵀ = K·Qᵀ`` (keys × W), their online softmax
    column by column, and ``Oᵀ += Vᵀ·Pᵀ``, the products in register tiles
    (:mod:`._numba_cpu_tiles`) reading K and V in place."""
    b, hk, q0, q1, k_lo, k_hi = item[0], item[1], item[2], item[3], item[4], item[5]
    e, ev = q.shape[3], v.shape[3]
    g_heads = q.shape[1] // k.shape[1]
    bq = q1 - q0
    rows = g_heads * bq
    dt = q.dtype
    scale, softcap, zero, ninf = fparams[0], fparams[1], fparams[2], fparams[4]
    left, right = iparams[1], iparams[2]
    has_mask, has_alibi, has_cap = iparams[3], iparams[4], iparams[5]
    has_dropout = iparams[8]
    cut, key0, key1 = np.uint64(iparams[9]), np.uint64(iparams[10]), np.uint64(iparams[11])
    block_k = iparams[15]
    keep_scale = fparams[5]
    length = lengths[b]
    offset = offsets[b]
    qb, kb, vb = qmap[b], kmap[b], vmap[b]
    mb = mmap[b]
    mh_full, mi_full = mask.shape[1] > 1, mask.shape[2] > 1
    size = q.itemsize
    width = VECTOR_BYTES // size * TILE_VECTORS            # query rows per panel
    panels = (rows + width - 1) // width
    cols = panels * width
    transform = has_cap or has_alibi or has_mask

    # Qᵀ (features × query rows, zero columns pad the last panel); per panel: the
    # running maximum and sum and Oᵀ; the scores of one block and panel
    qt = np.empty((panels, e, width), dtype=dt)
    for r in range(rows, cols):
        for f in range(e):
            qt[panels - 1, f, r - (panels - 1) * width] = zero
    for g in range(g_heads):
        qh = q[qb, hk * g_heads + g]
        for i in range(bq):
            r = g * bq + i
            for f in range(e):
                qt[r // width, f, r % width] = qh[q0 + i, f]
    m = np.full(cols, ninf, dtype=dt)
    l = np.zeros(cols, dtype=dt)
    acc = np.zeros((panels, ev, width), dtype=dt)
    st = np.empty((block_k, width), dtype=dt)
    # per column of a panel: its head, query row and position; the keys it may see
    heads = np.empty(width, dtype=np.int64)
    qrow = np.empty(width, dtype=np.int64)
    first = np.empty(width, dtype=np.int64)
    last = np.empty(width, dtype=np.int64)
    # key and value rows read in place when their features are contiguous and the rows
    # evenly spaced; otherwise copied
    k_direct = k.strides[3] == size and k.strides[2] % size == 0
    v_direct = v.strides[3] == size and v.strides[2] % size == 0
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
        for p in range(panels):
            c0 = p * width
            # per column: the keys [j0, j1) of the block its row may see (causal, window);
            # the panel's keys [lo, hi) cover them all, keys outside are not computed
            lo, hi = n, 0
            for c in range(width):
                r = c0 + c
                first[c], last[c] = 0, 0             # padding: sees nothing
                if r >= rows:
                    continue
                g = r // bq
                i = q0 + r - g * bq
                heads[c], qrow[c] = hk * g_heads + g, i
                pos = i + offset
                j0, j1 = 0, n
                if left >= 0:
                    j0 = min(n, max(0, pos - left - k0))
                if right >= 0:
                    j1 = max(j0, min(n, pos + right + 1 - k0))
                if j0 < j1:
                    first[c], last[c] = j0, j1
                    lo, hi = min(lo, j0), max(hi, j1)
            if lo >= hi:
                continue                             # no row of the panel sees these keys
            width_k = hi - lo
            s_lo = st.ctypes.data + lo * width * size
            # Sᵀ[j, c] = scale · k_j · q_c for the keys [lo, hi)
            if iparams[16] != 3 and iparams[16] != 4:
                tile_product(k_ptr + lo * ldk * size, ldk, 1, width_k, qt[p].ctypes.data,
                             width, s_lo, width, e, scale, False, size)
            whole = True        # every column sees every key of [lo, hi) untransformed
            for c in range(width):
                if first[c] > lo or last[c] < hi:
                    whole = False
            if transform or not whole:
                for c in range(width):
                    j0, j1 = first[c], last[c]
                    if j0 >= j1:
                        j0, j1 = lo, lo
                    for j in range(lo, j0):
                        st[j, c] = ninf
                    for j in range(j1, hi):
                        st[j, c] = ninf
                    if j0 >= j1 or not transform:
                        continue
                    h, i = heads[c], qrow[c]
                    if has_cap:
                        for j in range(j0, j1):
                            st[j, c] = softcap * np.tanh(st[j, c] / softcap)
                    if has_alibi:
                        slope = slopes[b, h]
                        pos = i + offset
                        for j in range(j0, j1):
                            st[j, c] -= slope * abs(pos - (k0 + j))
                    if has_mask:
                        mrow = mask[mb, h if mh_full else 0, i if mi_full else 0]
                        per_key = mrow.shape[0] > 1
                        for j in range(j0, j1):
                            mval = mrow[k0 + j] if per_key else mrow[0]
                            if has_mask == 2:
                                if mval == ninf:
                                    st[j, c] = ninf
                            else:
                                st[j, c] += mval
            if iparams[16] != 1 and iparams[16] != 4:
                softmax_step(s_lo, width_k, width, m[c0:].ctypes.data, l[c0:].ctypes.data,
                         acc[p].ctypes.data, ev, width, zero)
            if has_dropout:
                for c in range(width):
                    j0, j1 = first[c], last[c]
                    if j0 >= j1:
                        continue
                    # the weights' flat indices in (B…, H, Tq, Tk): n = row · Tk + key
                    n0 = np.uint64(((b * q.shape[1] + heads[c]) * q.shape[2] + qrow[c]) *
                                   k.shape[2] + k0 + j0)
                    for j in range(j0, j1):
                        x0 = philox_x0(n0 + np.uint64(j - j0), key0, key1)
                        st[j, c] = st[j, c] * keep_scale if x0 >= cut else zero
            # Oᵀ += Vᵀ · Pᵀ
            if iparams[16] != 2 and iparams[16] != 4:
                tile_product(v_ptr + lo * ldv * size, 1, ldv, ev, s_lo, width,
                             acc[p].ctypes.data, width, width_k, fparams[3], True, size)
    for r in range(rows):
        g = r // bq
        i = q0 + r - g * bq
        h = hk * g_heads + g
        p, c = r // width, r % width
        orow = out[b, h, i]
        if l[r] == zero:
            orow[:] = zero
            lse[b, h, i] = ninf
        else:
            inv = fparams[3] / l[r]
            ap = acc[p]
            for f in range(ev):
                orow[f] = ap[f, c] * inv
            lse[b, h, i] = m[r] + np.log(l[r])

# compiled for the signatures of :func:`signature` by ``numba_cpu.kernels``
@njit(parallel=True, nogil=True, fastmath=fastmath, cache=True)
def forward(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
            mmap: Any, lengths: Any, offsets: Any, slopes: Any, items: Any,
            fparams: Any, iparams: Any, out: Any, lse: Any) -> None:
    for t in prange(items.shape[0]):
        attend_item(q, k, v, qmap, kmap, vmap, mask, mmap, lengths, offsets, slopes, items[t],
                    fparams, iparams, out, lse)


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
                  arr(dt, 2), arr(t.int64, 2), arr(dt, 1), i1, arr(dt, 4, False),
                  arr(dt, 3, False))


# --- the backward pass (FlashAttention-2: scores recomputed from q, k and the saved lse) ---

@njit(nogil=True, cache=True)
def mm(blas: Any, args: Any, limit: int, m: int, n: int, k: int, alpha: Any, a: int,
       lda: int, ta: int, b: int, ldb: int, tb: int, beta: Any, c: int, ldc: int) -> None:
    """Row-major ``C[m×n] = alpha·op(A)·op(B) + beta·C`` (``op(X)`` is ``X``, or ``Xᵀ`` when
    ``t`` is 1; addresses and row strides in elements). Above ``limit`` multiply-adds
    (0: no limit) the product is cut, so that OpenBLAS runs each piece on the calling
    thread: along ``m``, or along ``k`` when that leaves larger pieces and the call
    accumulates (``beta == 1``)."""
    size = args[2].itemsize
    along_m = m if limit == 0 else max(1, limit // max(1, n * k))
    along_k = k if limit == 0 else max(1, limit // max(1, m * n))
    if along_k > along_m and along_k < k and beta == 1:
        for k0 in range(0, k, along_k):
            depth = min(along_k, k - k0)
            a0 = a + (k0 if ta == 0 else k0 * lda) * size
            b0 = b + (k0 * ldb if tb == 0 else k0) * size
            gemm(blas, args, tb, ta, n, m, depth, alpha, b0, ldb, a0, lda, beta, c, ldc)
        return
    for m0 in range(0, m, along_m):
        rows = min(along_m, m - m0)
        a0 = a + (m0 * lda if ta == 0 else m0) * size
        # row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ
        gemm(blas, args, tb, ta, n, rows, k, alpha, b, ldb, a0, lda, beta,
             c + m0 * ldc * size, ldc)


@njit(nogil=True, fastmath=fastmath, cache=True, inline="always")
def gradient_row(srow: Any, dprow: Any, pdrow: Any, trow: Any, n: int, k0: int, pos: int,
                 b: int, h: int, i: int, lse_i: Any, d_i: Any, mask: Any, mb: int,
                 slopes: Any, fparams: Any, iparams: Any, tq: int, tk: int) -> bool:
    """One query row against keys ``[k0, k0 + n)``: ``srow`` holds its scaled scores and
    leaves with ``dS``, ``pdrow`` gets the (dropped) weights, ``dprow`` holds ``dO·vⱼ``.
    Returns whether the row sees any of these keys."""
    softcap, zero, ninf, keep_scale = fparams[1], fparams[2], fparams[4], fparams[5]
    left, right = iparams[1], iparams[2]
    has_mask, has_alibi, has_cap, has_dropout = iparams[3], iparams[4], iparams[5], \
        iparams[8]
    j0, j1 = 0, n
    if left >= 0:
        j0 = min(n, max(0, pos - left - k0))
    if right >= 0:
        j1 = max(j0, min(n, pos + right + 1 - k0))
    if j0 >= j1 or lse_i == ninf:
        srow[:n] = zero
        pdrow[:n] = zero
        return False
    srow[:j0] = zero
    srow[j1:n] = zero
    pdrow[:j0] = zero
    pdrow[j1:n] = zero
    seg, dseg, pseg, tseg = srow[j0:j1], dprow[j0:j1], pdrow[j0:j1], trow[j0:j1]
    width = j1 - j0
    if has_cap:
        for j in range(width):
            t = np.tanh(seg[j] / softcap)
            tseg[j] = t
            seg[j] = softcap * t
    if has_alibi:
        slope = slopes[b, h]
        first = pos - (k0 + j0)
        for j in range(width):
            seg[j] -= slope * abs(first - j)
    if has_mask:
        apply_mask(seg, mask[mb, h if mask.shape[1] > 1 else 0, i if mask.shape[2] > 1 else 0],
                   k0 + j0, has_mask == 2, ninf)
    exp_shifted(seg, lse_i)                     # the weights P, before dropout
    if has_dropout:
        cut, key0, key1 = np.uint64(iparams[9]), np.uint64(iparams[10]), \
            np.uint64(iparams[11])
        # the weights' flat indices in (B…, H, Tq, Tk), H = iparams[12]
        n0 = np.uint64(((b * iparams[12] + h) * tq + i) * tk + k0 + j0)
        for j in range(width):
            f = keep_scale if philox_x0(n0 + np.uint64(j), key0, key1) >= cut else zero
            pseg[j] = seg[j] * f
            dseg[j] *= f
    else:
        for j in range(width):
            pseg[j] = seg[j]
    for j in range(width):
        seg[j] = seg[j] * (dseg[j] - d_i)
    if has_cap:
        one = fparams[3]
        for j in range(width):
            seg[j] *= one - tseg[j] * tseg[j]
    return True


@njit(nogil=True, fastmath=fastmath, cache=True)
def _gather_rows(src: Any, sb: int, hk: int, g_heads: int, q0: int, q1: int,
                 dst: Any) -> None:
    """Rows ``[q0, q1)`` of the G query heads of group ``hk`` of ``src[sb]`` into ``dst``
    (head-major: row ``g·(q1 - q0) + i``)."""
    bq = q1 - q0
    for g in range(g_heads):
        for i in range(bq):
            for f in range(src.shape[3]):
                dst[g * bq + i, f] = src[sb, hk * g_heads + g, q0 + i, f]


@njit(nogil=True, fastmath=fastmath, cache=True)
def _gather_keys(src: Any, sb: int, hk: int, k0: int, k1: int, dst: Any) -> None:
    for j in range(k1 - k0):
        for f in range(src.shape[3]):
            dst[j, f] = src[sb, hk, k0 + j, f]


@njit(nogil=True, fastmath=fastmath, cache=True)
def grad_query_item(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
                    mmap: Any, lengths: Any, offsets: Any, slopes: Any, go: Any, lse: Any,
                    dd: Any, item: Any, fparams: Any, iparams: Any, blas: Any,
                    dq: Any) -> None:
    """dQ of one work item (as in the forward pass): ``dQ = scale · dS · K`` over the
    item's key blocks."""
    b, hk, q0, q1, k_lo, k_hi = item[0], item[1], item[2], item[3], item[4], item[5]
    e, ev = q.shape[3], v.shape[3]
    g_heads = q.shape[1] // k.shape[1]
    bq = q1 - q0
    rows = g_heads * bq
    dt = q.dtype
    scale, zero, one = fparams[0], fparams[2], fparams[3]
    block_k, limit = iparams[6], iparams[14]
    tq, tk = q.shape[2], k.shape[2]
    offset = offsets[b]
    args = (np.array([ord("N"), ord("T")], dtype=np.uint8), np.empty(6, dtype=np.int32),
            np.empty(2, dtype=dt))
    qs = np.empty((rows, e), dtype=dt)
    dos = np.empty((rows, ev), dtype=dt)
    _gather_rows(q, qmap[b], hk, g_heads, q0, q1, qs)
    _gather_rows(go, b, hk, g_heads, q0, q1, dos)
    acc = np.zeros((rows, e), dtype=dt)
    s = np.empty((rows, block_k), dtype=dt)
    dp = np.empty((rows, block_k), dtype=dt)
    pd = np.empty((rows, block_k), dtype=dt)
    tc = np.empty((rows, block_k), dtype=dt)
    kblk = np.empty((block_k, e), dtype=dt)
    vblk = np.empty((block_k, ev), dtype=dt)
    hi_key = min(k_hi, lengths[b])
    for k0 in range(k_lo, hi_key, block_k):
        k1 = min(k0 + block_k, hi_key)
        n = k1 - k0
        _gather_keys(k, kmap[b], hk, k0, k1, kblk)
        _gather_keys(v, vmap[b], hk, k0, k1, vblk)
        mm(blas, args, limit, rows, n, e, scale, qs.ctypes.data, e, 0, kblk.ctypes.data, e,
           1, zero, s.ctypes.data, block_k)
        mm(blas, args, limit, rows, n, ev, one, dos.ctypes.data, ev, 0, vblk.ctypes.data, ev,
           1, zero, dp.ctypes.data, block_k)
        for r in range(rows):
            g = r // bq
            i = q0 + r - g * bq
            h = hk * g_heads + g
            gradient_row(s[r], dp[r], pd[r], tc[r], n, k0, i + offset, b, h, i,
                         lse[b, h, i], dd[b, h, i], mask, mmap[b], slopes, fparams, iparams,
                         tq, tk)
        mm(blas, args, limit, rows, e, n, scale, s.ctypes.data, block_k, 0,
           kblk.ctypes.data, e, 0, one, acc.ctypes.data, e)
    for r in range(rows):
        g = r // bq
        for f in range(e):
            dq[b, hk * g_heads + g, q0 + r - g * bq, f] = acc[r, f]


@njit(nogil=True, fastmath=fastmath, cache=True)
def grad_key_item(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
                  mmap: Any, lengths: Any, offsets: Any, slopes: Any, go: Any, lse: Any,
                  dd: Any, item: Any, fparams: Any, iparams: Any, blas: Any, dk: Any,
                  dv: Any) -> None:
    """dK and dV of keys ``[k0, k1)`` of head ``hk``, batch row ``b``: ``dV = Pdᵀ·dO`` and
    ``dK = scale · dSᵀ·Q`` summed over the query blocks (and the G heads of the group)."""
    b, hk, k0, k1, q_lo, q_hi = item[0], item[1], item[2], item[3], item[4], item[5]
    e, ev = q.shape[3], v.shape[3]
    g_heads = q.shape[1] // k.shape[1]
    dt = q.dtype
    scale, zero, one = fparams[0], fparams[2], fparams[3]
    left, right = iparams[1], iparams[2]
    block_k, limit, block_q = iparams[6], iparams[14], iparams[13]
    tq, tk = q.shape[2], k.shape[2]
    offset = offsets[b]
    k1 = min(k1, lengths[b])
    n = k1 - k0
    dka = np.zeros((max(n, 0), e), dtype=dt)
    dva = np.zeros((max(n, 0), ev), dtype=dt)
    if n > 0:
        args = (np.array([ord("N"), ord("T")], dtype=np.uint8), np.empty(6, dtype=np.int32),
                np.empty(2, dtype=dt))
        rows_max = g_heads * block_q
        kblk = np.empty((n, e), dtype=dt)
        vblk = np.empty((n, ev), dtype=dt)
        _gather_keys(k, kmap[b], hk, k0, k1, kblk)
        _gather_keys(v, vmap[b], hk, k0, k1, vblk)
        qs = np.empty((rows_max, e), dtype=dt)
        dos = np.empty((rows_max, ev), dtype=dt)
        s = np.empty((rows_max, block_k), dtype=dt)
        dp = np.empty((rows_max, block_k), dtype=dt)
        pd = np.empty((rows_max, block_k), dtype=dt)
        tc = np.empty((rows_max, block_k), dtype=dt)
        for q0 in range(q_lo, q_hi, block_q):
            q1 = min(q0 + block_q, q_hi)
            bq = q1 - q0
            # skip blocks whose rows see none of these keys (causal, window)
            seen = False
            for i in range(q0, q1):
                pos = i + offset
                lo = 0 if left < 0 else pos - left
                hi = k1 if right < 0 else pos + right + 1
                if max(lo, k0) < min(hi, k1):
                    seen = True
                    break
            if not seen:
                continue
            rows = g_heads * bq
            _gather_rows(q, qmap[b], hk, g_heads, q0, q1, qs)
            _gather_rows(go, b, hk, g_heads, q0, q1, dos)
            mm(blas, args, limit, rows, n, e, scale, qs.ctypes.data, e, 0, kblk.ctypes.data,
               e, 1, zero, s.ctypes.data, block_k)
            mm(blas, args, limit, rows, n, ev, one, dos.ctypes.data, ev, 0, vblk.ctypes.data,
               ev, 1, zero, dp.ctypes.data, block_k)
            for r in range(rows):
                g = r // bq
                i = q0 + r - g * bq
                h = hk * g_heads + g
                gradient_row(s[r], dp[r], pd[r], tc[r], n, k0, i + offset, b, h, i,
                             lse[b, h, i], dd[b, h, i], mask, mmap[b], slopes, fparams,
                             iparams, tq, tk)
            mm(blas, args, limit, n, ev, rows, one, pd.ctypes.data, block_k, 1,
               dos.ctypes.data, ev, 0, one, dva.ctypes.data, ev)
            mm(blas, args, limit, n, e, rows, scale, s.ctypes.data, block_k, 1,
               qs.ctypes.data, e, 0, one, dka.ctypes.data, e)
    for j in range(max(n, 0)):
        for f in range(e):
            dk[b, hk, k0 + j, f] = dka[j, f]
        for f in range(ev):
            dv[b, hk, k0 + j, f] = dva[j, f]


@njit(parallel=True, nogil=True, fastmath=fastmath, cache=True)
def backward(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any, mmap: Any,
             lengths: Any, offsets: Any, slopes: Any, go: Any, lse: Any, dd: Any,
             q_items: Any, k_items: Any, fparams: Any, iparams: Any, blas: Any, dq: Any,
             dk: Any, dv: Any) -> None:
    """dQ over the query items, then dK and dV over the key items (each its own rows)."""
    for t in prange(q_items.shape[0]):
        grad_query_item(q, k, v, qmap, kmap, vmap, mask, mmap, lengths, offsets, slopes, go,
                        lse, dd, q_items[t], fparams, iparams, blas, dq)
    for t in prange(k_items.shape[0]):
        grad_key_item(q, k, v, qmap, kmap, vmap, mask, mmap, lengths, offsets, slopes, go,
                      lse, dd, k_items[t], fparams, iparams, blas, dk, dv)


def backward_signature(dt: Any) -> Any:
    """The backward kernel's signature per dtype (any layout, read-only inputs)."""
    t = numba.types
    dt = numba.from_dtype(np.dtype(dt))

    def arr(dtype: Any, ndim: int, readonly: bool = True) -> Any:
        return t.Array(dtype, ndim, "A", readonly=readonly)

    i1, i2 = arr(t.int64, 1), arr(t.int64, 2)
    return t.void(arr(dt, 4), arr(dt, 4), arr(dt, 4), i1, i1, i1, arr(dt, 4), i1, i1, i1,
                  arr(dt, 2), arr(dt, 4), arr(dt, 3), arr(dt, 3), i2, i2, arr(dt, 1), i1,
                  i1, arr(dt, 4, False), arr(dt, 4, False), arr(dt, 4, False))
