"""The compiled functions of :mod:`.numba_cpu` (this module imports Numba: import it only
where Numba is installed; :mod:`.numba_cpu` does so on first use).

They are module-level functions, not closures, so that Numba's on-disk cache finds them
again in the next process.
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from numba import njit, prange
from numba.core import cgutils
from numba.extending import intrinsic

from polyattn.backends.numba_cpu.tiles import (
    TILE_ROWS,
    TILE_VECTORS,
    VECTOR_BYTES,
    exp_columns,
    exp_sum,
    half_1,
    half_4,
    half_rows,
    next_item,
    softmax_step,
    tile_1,
    tile_2,
    tile_4,
    tile_8,
    tile_rows,
    transpose,
)
from polyattn.backends.numba_cpu.user_rules import EMPTY, FASTMATH, PARTIAL, user_type
from polyattn.rules import element
from polyattn.rules.lowering import lower

# --- the score rules (docs/semantics.rst), one (query, key) pair at a time: the scalar
# functions of polyattn.rules.element, inlined into the loops below

keys_in_reach = lower(element.keys_in_reach, "cpu")

# --- the exponential, the dropout counters

fastmath = FASTMATH
# the exponential keeps its evaluation order: reassociating (t - k·ln2_hi) - k·ln2_lo
# into t - k·ln2 would lose the range reduction's extra bits
exact = {"contract", "nsz", "arcp"}

@njit(nogil=True, fastmath=exact, cache=True)
def exp32(x: Any, shift: Any) -> None:
    """``x[j] = e^(x[j] - shift)``, float32, in place (``x`` contiguous)."""
    exp_sum(x.ctypes.data, x.shape[0], shift)

@njit(nogil=True, fastmath=exact, cache=True)
def exp64(x: Any, shift: Any) -> None:
    """``x[j] = e^(x[j] - shift)``, float64, in place (``x`` contiguous)."""
    exp_sum(x.ctypes.data, x.shape[0], shift)

@njit(nogil=True, cache=True, inline="always")
def philox_x0(n: Any, key0: Any, key1: Any) -> Any:
    """The first output word of Philox4x32-10 (:mod:`polyattn.rules.dropout`) for the counter
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


# --- the rules users write: compiled functions over a panel of scores (.user_rules),
# called through pointers; the no-op ones stand in where a call has no such rule

@intrinsic
def as_pointer(typingctx: Any, address: Any, like: Any) -> Any:
    """The address ``address`` as a pointer to elements of the array ``like``'s dtype."""
    pointer = numba.types.CPointer(like.dtype)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, like), codegen


@intrinsic
def call_at(typingctx: Any, address: Any, args: Any) -> Any:
    """Call the Numba-compiled function at machine address ``address`` (an int64) with the
    tuple ``args``, by Numba's own calling convention (no return value; an exception it
    raises is raised here). The parallel kernels call their work items' functions so,
    rather than by name: Numba would link a named callee's code into the kernel's module
    and into each of the three modules of its parallel loop, and optimise and compile it
    anew in each (most of the first call's compile time); through its address it is
    compiled once, on its own. The caller must pass exactly the argument types the
    function was compiled for (:func:`item_signature`)."""
    if address != numba.types.int64 or not isinstance(args, numba.types.BaseTuple):
        return None
    dtype = getattr(args.types[0], "dtype", None) if len(args.types) else None
    if dtype not in (numba.types.float32, numba.types.float64) or tuple(args.types) not in (
            item_signature("forward", dtype), item_signature("backward", dtype)):
        raise numba.core.errors.TypingError(
            f"call_at: arguments {args} match no work item's compiled signature")

    def codegen(context: Any, builder: Any, sig: Any, llargs: Any) -> Any:
        argtys = tuple(sig.args[1].types)
        values = cgutils.unpack_tuple(builder, llargs[1], len(argtys))
        fnty = context.call_conv.get_function_type(numba.types.none, argtys)
        callee = builder.inttoptr(llargs[0], fnty.as_pointer())
        status, _ = context.call_conv.call_function(builder, callee, numba.types.none,
                                                    argtys, values)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return numba.types.none(address, args), codegen


# --- products in register tiles, and what every kernel does to one panel of scores -------
#
# The scores of a block of n keys against a panel of W query rows (W = TILE_VECTORS
# vectors) are held transposed, keys × W (one column per query row), so that every step
# across query rows is a SIMD vector operation. Integer parameters (``iparams``):
# 0 causal, 1/2 how far left/right of its position a row sees (UNBOUNDED: every key), 3 the mask
# (0 none, 1 float, 2 boolean), 4 ALiBi, 5 soft-capping, 6 keys per block, 7 dropout,
# 8 its threshold, 9/10 its key words, 11 query heads, 12 query rows per item, 13 segment
# ids, 14 scores keep a derivative (soft-capping or a score_mod), 15 a score_mod, 16 a
# mask_mod, 17/18 its block mask's tile (rows, keys), 19 query rows per entry of its key
# ranges. ``user``: .user_rules.lower.
# Float parameters (``fparams``): scale, softcap, 0, 1, -inf, the dropout keep scale.

@njit(nogil=True, cache=True, inline="always")
def tile_product(a: int, a_row: int, a_col: int, rows: int, b: int, ldb: int, c: int,
                 ldc: int, depth: int, alpha: Any, accumulate: bool, size: int) -> None:
    """``C[rows × W] = alpha · A · B (+ C)``, W = TILE_VECTORS vectors, in tiles of
    TILE_ROWS rows and the rest in tiles of 8, 4, 2, 1 rows (addresses and strides as in
    :mod:`.tiles`)."""
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


@njit(nogil=True, cache=True, inline="always")
def half_product(a: int, a_row: int, a_col: int, rows: int, b: int, ldb: int, c: int,
                 ldc: int, depth: int, alpha: Any, accumulate: bool, size: int) -> None:
    """:func:`tile_product` on the second of the W / 2-lane halves of ``B`` and ``C``
    only (one vector wide), in tiles of TILE_ROWS, 4 and 1 rows (fewer shapes than
    :func:`tile_product`: each one is compiled code, and these run on few rows)."""
    half = VECTOR_BYTES
    b, c = b + half, c + half
    r = 0
    while r + TILE_ROWS <= rows:
        half_rows(a + r * a_row * size, a_row, a_col, b, ldb, c + r * ldc * size, ldc, depth,
                  alpha, accumulate)
        r += TILE_ROWS
    while r + 4 <= rows:
        half_4(a + r * a_row * size, a_row, a_col, b, ldb, c + r * ldc * size, ldc, depth,
               alpha, accumulate)
        r += 4
    while r < rows:
        half_1(a + r * a_row * size, a_row, a_col, b, ldb, c + r * ldc * size, ldc, depth,
               alpha, accumulate)
        r += 1


@njit(nogil=True, cache=True, inline="always")
def first_half_reach(lo: int, first: Any, last: Any) -> int:
    """One past the last key that a column of the panel's first half (its first vector)
    sees, at least ``lo``: the keys from there on are for the second half alone (the
    diagonal of a causal panel, for one)."""
    reach = lo
    for c in range(first.shape[0] // TILE_VECTORS):
        if first[c] < last[c]:
            reach = max(reach, last[c])
    return reach


@njit(nogil=True, cache=True, inline="always")
def wide_product(a: int, a_row: int, a_col: int, rows: int, b: int, ldb: int, c: int,
                 ldc: int, depth: int, cols: int, alpha: Any, size: int) -> None:
    """``C[rows × cols] += alpha · A · B`` for ``cols`` a multiple of W, W columns at a
    time."""
    width = VECTOR_BYTES // size * TILE_VECTORS
    for c0 in range(0, cols, width):
        tile_product(a, a_row, a_col, rows, b + c0 * size, ldb, c + c0 * size, ldc, depth,
                     alpha, True, size)


@njit(nogil=True, cache=True, inline="always")
def panel_keys(c0: int, rows: int, bq: int, q0: int, hk: int, g_heads: int, offset: int,
               k0: int, n: int, iparams: Any, lse: Any, b: int, seen_only: bool,
               heads: Any, qrow: Any, first: Any, last: Any,
               segments: Any, user: Any) -> tuple[int, int]:
    """For each column ``c`` of the panel of query rows ``[c0, c0 + W)`` of an item (row
    ``r`` is query ``q0 + r mod bq`` of its ``r div bq``-th head): its head, its query, and
    the keys ``[first, last)`` of the block ``[k0, k0 + n)`` its row may see (causal,
    window, its segment's keys ``segments[b, i]`` with sorted segment ids, the keys a
    block mask leaves to its row or query block; none for padding columns, nor, with
    ``seen_only``, for rows whose ``lse`` is ``-inf``). Returns ``(lo, hi)``, the keys
    some column sees (``lo >= hi``: none)."""
    ranges = user[7]
    rb = b if ranges.shape[0] > 1 else 0
    left, right = iparams[1], iparams[2]
    ninf = lse.dtype.type(-np.inf)
    lo, hi = n, 0
    for c in range(first.shape[0]):
        r = c0 + c
        first[c], last[c] = 0, 0
        if r >= rows:
            heads[c], qrow[c] = 0, 0                     # read by the user's rules, hidden
            continue
        g = r // bq
        i = q0 + r - g * bq
        h = hk * g_heads + g
        heads[c], qrow[c] = h, i
        if seen_only and lse[b, h, i] == ninf:
            continue
        # the keys of [k0, k0 + n) row i sees (n stops at the batch row's key length)
        j_lo, j_hi = keys_in_reach(i + offset, i + offset, left, right, 0, k0 + n)
        if iparams[13]:
            j_lo, j_hi = max(j_lo, segments[b, i, 0]), min(j_hi, segments[b, i, 1])
        if iparams[16]:
            rh = h if ranges.shape[1] > 1 else 0
            qb = min(i // iparams[19], ranges.shape[2] - 1)
            j_lo, j_hi = max(j_lo, ranges[rb, rh, qb, 0]), min(j_hi, ranges[rb, rh, qb, 1])
        j0 = min(n, max(0, j_lo - k0))
        j1 = max(j0, j_hi - k0)
        if j0 < j1:
            first[c], last[c] = j0, j1
            lo, hi = min(lo, j0), max(hi, j1)
    return lo, hi


@njit(nogil=True, fastmath=fastmath, cache=True, inline="always")
def transform_panel(st: Any, lo: int, hi: int, first: Any, last: Any, heads: Any,
                    qrow: Any, k0: int, offset: int, b: int, mb: int, mask: Any,
                    slopes: Any, fparams: Any, iparams: Any, tt: Any,
                    keep_tanh: bool, user: Any, scratch: Any) -> None:
    """The transform of docs/semantics.rst on the scores ``st[lo:hi]``: soft-capping, ALiBi
    and a ``score_mod`` as one compiled score rule on the whole panel (:func:`user_scores`,
    its derivative kept in ``tt`` for the backward pass); then column by column on the
    keys each column sees, the mask (a boolean one replacing hidden scores by -inf, so
    that a NaN or inf score of a hidden key cannot reach the result), -inf on the keys
    it does not see; a ``mask_mod`` (:func:`user_mask`)."""
    ninf = fparams[4]
    has_mask, has_score, has_user_mask = iparams[3], iparams[15], iparams[16]
    transform = has_mask or has_score or has_user_mask
    whole = True
    for c in range(first.shape[0]):
        if first[c] > lo or last[c] < hi:
            whole = False
    if whole and not transform:
        return
    if has_score:                        # the whole panel; what a column does not see is
        user_scores(st, lo, hi, heads, qrow, k0, b, tt, keep_tanh, fparams, user)  # hidden
    for c in range(first.shape[0]):
        j0, j1 = hide_outside(st, c, lo, hi, first, last, ninf)
        if has_mask and j0 < j1:
            mask_column(st, c, j0, j1, k0, heads[c], qrow[c], mb, mask, has_mask, ninf)
    if has_user_mask:
        user_mask(st, lo, hi, first, last, heads, qrow, k0, b, iparams, user, ninf, scratch)


@njit(nogil=True, cache=True, inline="always")
def hide_outside(st: Any, c: int, lo: int, hi: int, first: Any, last: Any,
                 ninf: Any) -> tuple[int, int]:
    """-inf on the keys of ``[lo, hi)`` outside column ``c``'s ``[first[c], last[c])``;
    returns that range (empty: ``(lo, lo)``)."""
    j0, j1 = first[c], last[c]
    if j0 >= j1:
        j0, j1 = lo, lo
    for j in range(lo, j0):
        st[j, c] = ninf
    for j in range(j1, hi):
        st[j, c] = ninf
    return j0, j1


@njit(nogil=True, fastmath=fastmath, cache=True, inline="always")
def mask_column(st: Any, c: int, j0: int, j1: int, k0: int, h: int, i: int, mb: int,
                mask: Any, kind: int, ninf: Any) -> None:
    """``attn_mask`` on keys ``[j0, j1)`` of column ``c``: added (``kind`` 1), or -inf where a
    boolean one (``kind`` 2, held as 0 / -inf) hides the key."""
    mrow = mask[mb, h if mask.shape[1] > 1 else 0, i if mask.shape[2] > 1 else 0]
    per_key = mrow.shape[0] > 1
    for j in range(j0, j1):
        mval = mrow[k0 + j] if per_key else mrow[0]
        if kind == 2:
            if mval == ninf:
                st[j, c] = ninf
        else:
            st[j, c] += mval


@njit(nogil=True, cache=True, inline="always")
def user_buffers(user: Any) -> tuple[Any, Any, Any]:
    """Pointers to the ``mod_args`` buffers of :func:`.user_rules.lower`."""
    return (as_pointer(user[3].ctypes.data, user[3]), as_pointer(user[4].ctypes.data, user[4]),
            as_pointer(user[5].ctypes.data, user[5]))


@njit(nogil=True, fastmath=fastmath, cache=True, inline="always")
def user_scores(st: Any, lo: int, hi: int, heads: Any, qrow: Any, k0: int, b: int, tt: Any,
                keep: bool, fparams: Any, user: Any) -> None:
    """The score rule on the whole panel ``st[lo:hi]`` (every column: the compiled loop
    runs across columns in SIMD vectors; the caller hides what a column does not see),
    its derivative into ``tt`` where ``keep``."""
    ld, size = st.shape[1], st.itemsize
    at = as_pointer(st.ctypes.data + lo * ld * size, st)
    qs, hs = as_pointer(qrow.ctypes.data, qrow), as_pointer(heads.ctypes.data, heads)
    fb, ib, meta = user_buffers(user)
    if keep:
        for j in range(lo, hi):
            for c in range(ld):
                tt[j, c] = fparams[3]
        d_at = as_pointer(tt.ctypes.data + lo * ld * size, tt)
        user[1](at, ld, hi - lo, ld, k0 + lo, qs, hs, b, d_at, fb, ib, meta)
    else:
        user[0](at, ld, hi - lo, ld, k0 + lo, qs, hs, b, fb, ib, meta)


@njit(nogil=True, cache=True, inline="always")
def user_mask(st: Any, lo: int, hi: int, first: Any, last: Any, heads: Any, qrow: Any,
              k0: int, b: int, iparams: Any, user: Any, ninf: Any, scratch: Any) -> None:
    """The ``mask_mod`` on the panel ``st[lo:hi]``, tile by tile of its block mask: per
    column, -inf on an empty tile, the compiled mask on a partial one (for the columns
    whose tile is partial, together), nothing on a full one, nor on any tile of a row
    whose keys ``[first, last)`` the block mask knows to be every one visible."""
    kinds, ranges = user[6], user[7]
    rows, keys, per = iparams[17], iparams[18], iparams[19]
    kb_ = b if kinds.shape[0] > 1 else 0
    rb = b if ranges.shape[0] > 1 else 0
    ld, size = st.shape[1], st.itemsize
    on, solid = scratch[0], scratch[1]      # (2, ld) int64, the caller's
    every = True
    for c in range(ld):
        rh = heads[c] if ranges.shape[1] > 1 else 0
        solid[c] = ranges[rb, rh, min(qrow[c] // per, ranges.shape[2] - 1), 2] != 0
        on[c] = 0
        every = every and (solid[c] != 0 or first[c] >= last[c])
    if every:
        return
    qs, hs = as_pointer(qrow.ctypes.data, qrow), as_pointer(heads.ctypes.data, heads)
    flags = as_pointer(on.ctypes.data, on)
    fb, ib, meta = user_buffers(user)
    j = lo
    while j < hi:
        tile = (k0 + j) // keys
        end = min(hi, (tile + 1) * keys - k0)
        kt = min(tile, kinds.shape[3] - 1)
        partial = False
        for c in range(ld):
            on[c] = 0
            j0, j1 = max(j, first[c]), min(end, last[c])
            if j0 >= j1 or solid[c] != 0:
                continue
            kh = heads[c] if kinds.shape[1] > 1 else 0
            kind = kinds[kb_, kh, min(qrow[c] // rows, kinds.shape[2] - 1), kt]
            if kind == EMPTY:
                for jj in range(j0, j1):
                    st[jj, c] = ninf
            elif kind == PARTIAL:
                on[c] = 1
                partial = True
        if partial:
            at = as_pointer(st.ctypes.data + j * ld * size, st)
            user[2](at, ld, end - j, ld, k0 + j, qs, hs, b, flags, fb, ib, meta)
        j = end


@njit(nogil=True, cache=True, inline="always")
def kept(b: int, h: int, i: int, key: int, iparams: Any, tq: int, tk: int, keep: Any,
         zero: Any) -> Any:
    """Dropout's factor for the weight of query ``i`` of head ``h`` on ``key``: ``keep``
    (1 / (1 - p)) where Philox's word for its flat index in (B…, H, Tq, Tk) reaches the
    threshold, else 0 (docs/semantics.rst, "Dropout"; the counters of
    :mod:`polyattn.rules.dropout`)."""
    n = np.uint64(((b * iparams[11] + h) * tq + i) * tk + key)
    x0 = philox_x0(n, np.uint64(iparams[9]), np.uint64(iparams[10]))
    return keep if x0 >= np.uint64(iparams[8]) else zero


@njit(nogil=True, cache=True, inline="always")
def block_rows(x: Any, xb: int, hk: int, k0: int, n: int, copy: Any) -> tuple[int, int]:
    """(address, row stride) of rows ``[k0, k0 + n)`` of ``x[xb, hk]``: in place where its
    features are contiguous and its rows evenly spaced, else copied into ``copy``."""
    size = x.itemsize
    if x.strides[3] == size and x.strides[2] % size == 0:
        return x[xb, hk, k0:].ctypes.data, x.strides[2] // size
    for j in range(n):
        for f in range(x.shape[3]):
            copy[j, f] = x[xb, hk, k0 + j, f]
    return copy.ctypes.data, x.shape[3]


@njit(nogil=True, cache=True, inline="always")
def transpose_rows(x: Any, xb: int, hk: int, k0: int, n: int, copy: Any, xt: Any) -> None:
    """``xt[f, j]`` = feature ``f`` of row ``k0 + j`` of ``x[xb, hk]``, ``j < n``: the rows
    of a block as the left operand of a product (:func:`tile_product` reads a column of
    its left operand as one contiguous run; read in place, a block of rows would need
    one pointer per row of a tile, more than the CPU has registers, and spill)."""
    ptr, ld = block_rows(x, xb, hk, k0, n, copy)
    transpose(ptr, ld, xt.ctypes.data, xt.shape[1], n, x.shape[3], xt.dtype.type(0))


@njit(nogil=True, cache=True, inline="always")
def one_head(x: Any, c0: int, width: int, rows: int, bq: int) -> bool:
    """Whether the item rows ``[c0, c0 + width)`` are consecutive rows of one head
    (every one an item row) and ``x``'s features are contiguous: a panel that
    :func:`transpose` lays out whole."""
    size = x.itemsize
    return (c0 + width <= rows and (c0 + width - 1) // bq == c0 // bq
            and x.strides[3] == size and x.strides[2] % size == 0)


@njit(nogil=True, cache=True, inline="always")
def pack_columns(x: Any, xb: int, hk: int, g_heads: int, q0: int, bq: int, rows: int,
                 dst: Any) -> None:
    """``dst[p, f, c]`` = feature ``f`` of item row ``p·W + c`` of ``x`` (row ``r``:
    query ``q0 + r mod bq`` of head ``hk·G + r div bq``); 0 past the last row."""
    panels, feats, width = dst.shape
    size = x.itemsize
    for p in range(panels):
        c0 = p * width
        g = c0 // bq
        if one_head(x, c0, width, rows, bq):
            src = x[xb, hk * g_heads + g, q0 + c0 - g * bq:]
            transpose(src.ctypes.data, x.strides[2] // size, dst[p].ctypes.data, width,
                      width, feats, dst.dtype.type(0))
            continue
        for c in range(width):
            r = c0 + c
            if r >= rows:
                for f in range(feats):
                    dst[p, f, c] = 0
                continue
            gr = r // bq
            xrow = x[xb, hk * g_heads + gr, q0 + r - gr * bq]
            for f in range(feats):
                dst[p, f, c] = xrow[f]


@njit(nogil=True, cache=True, inline="always")
def unpack_columns(src: Any, scale: Any, b: int, hk: int, g_heads: int, q0: int,
                   bq: int, rows: int, out: Any) -> None:
    """The reverse of :func:`pack_columns`, each column times its ``scale`` (``src`` is
    scaled in place): feature ``f`` of item row ``p·W + c`` of ``out[b]`` =
    ``src[p, f, c]·scale[p·W + c]``, for the item's rows."""
    panels, feats, width = src.shape
    size = out.itemsize
    for p in range(panels):
        c0 = p * width
        sp = src[p]
        for f in range(feats):
            for c in range(width):
                sp[f, c] *= scale[c0 + c]
        g = c0 // bq
        if one_head(out, c0, width, rows, bq):
            dst = out[b, hk * g_heads + g, q0 + c0 - g * bq:]
            transpose(sp.ctypes.data, width, dst.ctypes.data, out.strides[2] // size, feats,
                      width, sp.dtype.type(0))
            continue
        for c in range(min(width, rows - c0)):
            r = c0 + c
            gr = r // bq
            orow = out[b, hk * g_heads + gr, q0 + r - gr * bq]
            for f in range(feats):
                orow[f] = sp[f, c]


@njit(nogil=True, cache=True, inline="always")
def finite_columns(xt: Any, rows: int) -> Any:
    """Per item row ``r`` of the panels ``xt`` (:func:`pack_columns`), whether its every
    feature is finite: no feature has every exponent bit set (inf and NaN do). Integer
    operations along the panels' rows, which vectorise and which ``fastmath`` cannot
    fold away."""
    ok = np.empty(xt.shape[0] * xt.shape[2], np.bool_)
    if xt.itemsize == 4:
        exponent_bits(xt.view(np.uint32), np.uint32(0x7F800000), ok)
    else:
        exponent_bits(xt.view(np.uint64), np.uint64(0x7FF0000000000000), ok)
    return ok


@njit(nogil=True, cache=True, inline="always")
def exponent_bits(bits: Any, exponent: Any, ok: Any) -> None:
    """``ok[p·W + c]``: no ``bits[p, f, c] & exponent`` equals ``exponent``."""
    panels, feats, width = bits.shape
    top = np.empty(width, bits.dtype)
    for p in range(panels):
        top[:] = 0
        for f in range(feats):
            for c in range(width):
                top[c] = max(top[c], bits[p, f, c] & exponent)
        for c in range(width):
            ok[p * width + c] = top[c] != exponent


# --- the forward pass ----------------------------------------------------------------------

@njit(nogil=True, fastmath=fastmath, cache=True)
def attend_item(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
                mmap: Any, lengths: Any, offsets: Any, slopes: Any, segments: Any, user: Any,
                items: Any, fparams: Any, iparams: Any, out: Any, lse: Any, t: int) -> None:
    """Work item ``items[t]``: the G heads of key/value head ``hk`` of batch row ``b``,
    query rows ``[q0, q1)``, keys ``[k_lo, k_hi)``, in panels of W query rows; per block of
    keys and panel, ``Sᵀ = scale·K·Qᵀ`` for the keys the panel sees, their transform, the
    online softmax column by column (:func:`softmax_step`), dropout, and ``Oᵀ += Vᵀ·Pᵀ``.

    A row whose query holds a NaN or an inf gives NaN (out and lse), whatever the scores
    made of it: inf times keys all negative makes every score -inf (it would read as
    fully masked: 0, lse -inf), and soft-capping saturates an infinite score to a finite
    one; NaN never disappears (docs/semantics.rst, "Non-finite inputs"), as on the other
    paths."""
    b, hk, q0, q1, k_lo, k_hi = items[t, 0], items[t, 1], items[t, 2], items[t, 3], \
        items[t, 4], items[t, 5]
    e, ev = q.shape[3], v.shape[3]
    g_heads = q.shape[1] // k.shape[1]
    bq = q1 - q0
    rows = g_heads * bq
    dt = q.dtype
    scale, zero, one, ninf, keep = fparams[0], fparams[2], fparams[3], fparams[4], \
        fparams[5]
    block_k, has_dropout = iparams[6], iparams[7]
    tq, tk = q.shape[2], k.shape[2]
    offset = offsets[b]
    size = q.itemsize
    width = VECTOR_BYTES // size * TILE_VECTORS
    panels = (rows + width - 1) // width

    qt = np.empty((panels, e, width), dtype=dt)             # Qᵀ per panel
    pack_columns(q, qmap[b], hk, g_heads, q0, bq, rows, qt)
    m = np.full(panels * width, ninf, dtype=dt)             # running maximum
    l = np.zeros(panels * width, dtype=dt)                  # running sum
    acc = np.empty((panels, ev, width), dtype=dt)           # Oᵀ per panel, once begun
    begun = np.zeros(panels, np.bool_)
    st = np.empty((block_k, width), dtype=dt)
    heads, qrow = np.empty(width, np.int64), np.empty(width, np.int64)
    first, last = np.empty(width, np.int64), np.empty(width, np.int64)
    scratch = np.empty((2, width), np.int64)                # for user_mask
    kt, kblk = np.empty((e, block_k), dtype=dt), np.empty((block_k, e), dtype=dt)
    vblk = np.empty((block_k, ev), dtype=dt)
    hi_key = min(k_hi, lengths[b])
    for k0 in range(k_lo, hi_key, block_k):
        n = min(k0 + block_k, hi_key) - k0
        transpose_rows(k, kmap[b], hk, k0, n, kblk, kt)
        v_ptr, ldv = block_rows(v, vmap[b], hk, k0, n, vblk)
        for p in range(panels):
            c0 = p * width
            lo, hi = panel_keys(c0, rows, bq, q0, hk, g_heads, offset, k0, n, iparams, lse,
                                b, False, heads, qrow, first, last, segments, user)
            if lo >= hi:
                continue                         # no row of the panel sees these keys
            s_lo = st.ctypes.data + lo * width * size
            # keys [mid, hi): the second half of the panel's columns alone sees them (the
            # first half's scores there are hidden by transform_panel)
            mid = first_half_reach(lo, first, last)
            if mid == lo:
                mid = hi
            tile_product(kt.ctypes.data + lo * size, 1, block_k, mid - lo, qt[p].ctypes.data,
                         width, s_lo, width, e, scale, False, size)
            if mid < hi:
                half_product(kt.ctypes.data + mid * size, 1, block_k, hi - mid,
                             qt[p].ctypes.data, width, st.ctypes.data + mid * width * size,
                             width, e, scale, False, size)
            transform_panel(st, lo, hi, first, last, heads, qrow, k0, offset, b, mmap[b],
                            mask, slopes, fparams, iparams, st, False, user, scratch)
            # a panel's first block of keys writes its Oᵀ rather than rescale and add
            softmax_step(s_lo, hi - lo, width, m[c0:].ctypes.data, l[c0:].ctypes.data,
                         acc[p].ctypes.data, ev if begun[p] else 0, width, zero)
            if has_dropout:
                for c in range(width):
                    for j in range(first[c], last[c]):
                        st[j, c] *= kept(b, heads[c], qrow[c], k0 + j, iparams, tq, tk,
                                         keep, zero)
            tile_product(v_ptr + lo * ldv * size, 1, ldv, ev, s_lo, width,
                         acc[p].ctypes.data, width, mid - lo, one, begun[p], size)
            if mid < hi:
                half_product(v_ptr + mid * ldv * size, 1, ldv, ev,
                             st.ctypes.data + mid * width * size, width, acc[p].ctypes.data,
                             width, hi - mid, one, True, size)
            begun[p] = True
    nan = lse.dtype.type(np.nan)
    finite = finite_columns(qt, rows)
    inv = np.empty(panels * width, dtype=dt)
    for r in range(panels * width):
        inv[r] = one / l[r] if finite[r] and l[r] != zero else zero
    for p in range(panels):
        if not begun[p]:
            acc[p] = zero                           # no row of the panel saw a key
    unpack_columns(acc, inv, b, hk, g_heads, q0, bq, rows, out)
    for g in range(g_heads):
        h = hk * g_heads + g
        for i in range(q0, q1):
            r = g * bq + i - q0
            if not finite[r]:
                out[b, h, i, :] = nan
                lse[b, h, i] = nan
            elif l[r] == zero:
                out[b, h, i, :] = zero              # 0·V is NaN where V holds inf or NaN
                lse[b, h, i] = ninf
            else:
                lse[b, h, i] = m[r] + np.log(l[r])


# compiled for the signatures of :func:`signature` by ``numba_cpu.kernels``
@njit(parallel=True, nogil=True, fastmath=fastmath, cache=True)
def forward(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
            mmap: Any, lengths: Any, offsets: Any, slopes: Any, segments: Any, user: Any,
            items: Any, fparams: Any, iparams: Any, out: Any, lse: Any, counter: Any) -> None:
    """The work items, each attended by whichever thread takes it first: ``counter[1]``
    loops (one per thread), each taking the next item from ``counter[0]`` (zero on
    entry) until none is left, so that items of unequal cost balance under any
    threading layer (:func:`.threads.counter`); ``counter[2]``: the address of
    :func:`attend_item` compiled for :func:`item_signature` (:func:`call_at`)."""
    n = items.shape[0]
    for _ in prange(min(counter[1], n)):
        t = next_item(counter)
        while t < n:
            call_at(counter[2], (q, k, v, qmap, kmap, vmap, mask, mmap, lengths, offsets,
                                 slopes, segments, user, items, fparams, iparams, out, lse, t))
            t = next_item(counter)


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
                  arr(dt, 2), arr(t.int64, 3), user_type(dt), arr(t.int64, 2), arr(dt, 1),
                  i1,
                  arr(dt, 4, False),
                  arr(dt, 3, False), arr(t.int64, 1, False))



def item_signature(kind: str, dt: Any) -> tuple[Any, ...]:
    """The argument types of the ``kind`` kernel's work-item function (:func:`attend_item`
    for ``"forward"``, :func:`grad_key_item` for ``"backward"``) in dtype ``dt`` (a NumPy
    or Numba float type): the kernel's own arguments, its counter replaced by the item's
    index."""
    return _item_signature(kind, str(dt) if isinstance(dt, numba.types.Type)
                           else np.dtype(dt).name)


@functools.cache
def _item_signature(kind: str, name: str) -> tuple[Any, ...]:
    kernel = signature(name) if kind == "forward" else backward_signature(name)
    return (*kernel.args[:-1], numba.types.int64)

# --- the backward pass (FlashAttention-2: scores recomputed from q, k and the saved lse) ---

#: Panels of W query rows the dK/dV kernel takes at once: its products ``Pdᵀ·dO`` and
#: ``dSᵀ·Q`` run over KEY_PANELS·W rows (the depth of their register tiles).
KEY_PANELS = 4

@njit(nogil=True, fastmath=fastmath, cache=True, inline="always")
def dropout_panel(st: Any, dpt: Any, pd: Any, lo: int, hi: int, first: Any, last: Any,
                  heads: Any, qrow: Any, k0: int, b: int, tq: int, tk: int, fparams: Any,
                  iparams: Any, weights: bool) -> None:
    """Dropout's factors on ``dpt = dO·Vᵀ`` (transposed, keys ``[lo, hi)``) and, with
    ``weights``, the dropped weights ``P·factor`` into ``pd``."""
    zero, keep = fparams[2], fparams[5]
    for c in range(first.shape[0]):
        if weights:
            for j in range(lo, hi):
                pd[j, c] = st[j, c]
        for j in range(first[c], last[c]):
            f = kept(b, heads[c], qrow[c], k0 + j, iparams, tq, tk, keep, zero)
            dpt[j, c] *= f
            if weights:
                pd[j, c] *= f


@njit(nogil=True, fastmath=fastmath, cache=True, inline="always")
def score_gradient(st: Any, dpt: Any, tt: Any, lo: int, hi: int, first: Any, last: Any,
                   dcol: Any, fparams: Any, iparams: Any) -> None:
    """``dS = P ∘ (dP - D)`` into ``st`` (which holds ``P``) for keys ``[lo, hi)``, then
    the chain rule of soft-capping and a ``score_mod`` (``tt`` holds each score's
    derivative from :func:`transform_panel`)."""
    for j in range(lo, hi):
        for c in range(first.shape[0]):
            st[j, c] = st[j, c] * (dpt[j, c] - dcol[c])
    if iparams[14]:
        for c in range(first.shape[0]):
            for j in range(first[c], last[c]):
                st[j, c] *= tt[j, c]


@njit(nogil=True, cache=True, inline="always")
def pack_rows(q: Any, qb: int, go: Any, b: int, hk: int, g_heads: int, c0: int, tq: int,
              rows: int, qt: Any, qp: Any, dot: Any, dop: Any) -> None:
    """The W item rows ``[c0, c0 + W)`` of a backward panel (row ``r``: query ``r mod tq``
    of head ``hk·G + r div tq``; 0 past the last row) as columns, ``qt[f, c]`` and
    ``dot[f, c]``, and as rows, ``qp[c, f]`` and ``dop[c, f]`` (their padding features
    are left as they are): rows of one head with contiguous features by whole SIMD
    blocks (:func:`transpose`), others element by element."""
    width = qt.shape[1]
    e, ev = qt.shape[0], dot.shape[0]
    size = q.itemsize
    zero = qt.dtype.type(0)
    if one_head(q, c0, width, rows, tq) and one_head(go, c0, width, rows, tq):
        g = c0 // tq
        h, i0 = hk * g_heads + g, c0 - g * tq
        transpose(q[qb, h, i0:].ctypes.data, q.strides[2] // size, qt.ctypes.data, width,
                  width, e, zero)
        transpose(go[b, h, i0:].ctypes.data, go.strides[2] // size, dot.ctypes.data, width,
                  width, ev, zero)
        transpose(qt.ctypes.data, width, qp.ctypes.data, qp.shape[1], e, width, zero)
        transpose(dot.ctypes.data, width, dop.ctypes.data, dop.shape[1], ev, width, zero)
        return
    for c in range(width):
        r = c0 + c
        if r < rows:
            g = r // tq
            qrow_, gorow = q[qb, hk * g_heads + g, r - g * tq], go[b, hk * g_heads + g, r - g * tq]
            for f in range(e):
                qt[f, c] = qp[c, f] = qrow_[f]
            for f in range(ev):
                dot[f, c] = dop[c, f] = gorow[f]
        else:
            for f in range(e):
                qt[f, c] = qp[c, f] = zero
            for f in range(ev):
                dot[f, c] = dop[c, f] = zero


@njit(nogil=True, fastmath=fastmath, cache=True)
def grad_key_item(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any,
                  mmap: Any, lengths: Any, offsets: Any, slopes: Any, segments: Any, user: Any,
                  go: Any, lse: Any, dd: Any, items: Any, fparams: Any, iparams: Any,
                  dq: Any, dk: Any, dv: Any, t: int) -> None:
    """Work item ``items[t]``: gradients for the blocks of keys ``k0 = start, start + step,
    …`` (below the batch row's length) of head ``hk``, batch row ``b``: for each block, over
    every query row of the G heads of its group in panels of KEY_PANELS × W rows, ``Sᵀ`` and
    ``P`` recomputed from the saved ``lse``, ``dPᵀ = V·dOᵀ`` and ``dS`` per W rows; then
    ``dV += Pdᵀ·dO`` and ``dK += scale·dSᵀ·Q`` over the whole panel (products KEY_PANELS·W
    deep), written to the block's rows of ``dk`` and ``dv``; and ``dQ += scale·dS·K`` for
    the panel's rows, added to ``dq[part]`` (the item's own part: no other item adds to it
    while this one runs)."""
    b, hk, start, step, part = items[t, 0], items[t, 1], items[t, 2], items[t, 3], \
        items[t, 4]
    e, ev = q.shape[3], v.shape[3]
    g_heads = q.shape[1] // k.shape[1]
    dt = q.dtype
    scale, zero, one, ninf = fparams[0], fparams[2], fparams[3], fparams[4]
    block_k = iparams[6]
    tq, tk = q.shape[2], k.shape[2]
    offset = offsets[b]
    size = q.itemsize
    width = VECTOR_BYTES // size * TILE_VECTORS
    wide = KEY_PANELS * width
    rows = g_heads * tq
    e_pad = (e + width - 1) // width * width
    ev_pad = (ev + width - 1) // width * width
    kblk, vblk = np.empty((block_k, e), dtype=dt), np.empty((block_k, ev), dtype=dt)
    kt, vt = np.empty((e, block_k), dtype=dt), np.empty((ev, block_k), dtype=dt)
    kp = np.zeros((block_k, e_pad), dtype=dt)               # K's rows, padded with zeros
    dka, dva = np.empty((block_k, e_pad), dtype=dt), np.empty((block_k, ev_pad), dtype=dt)
    dqa = np.empty((wide, e_pad), dtype=dt)                  # a panel's dQ from one block
    # one panel of query rows: Qᵀ and dOᵀ per W rows (features × W), Q and dO (rows ×
    # features, padded with zeros)
    qt = np.empty((KEY_PANELS, e, width), dtype=dt)
    dot = np.empty((KEY_PANELS, ev, width), dtype=dt)
    qp, dop = np.zeros((wide, e_pad), dtype=dt), np.zeros((wide, ev_pad), dtype=dt)
    shift, dcol = np.empty(wide, dtype=dt), np.empty(wide, dtype=dt)
    st, dpt = np.empty((block_k, wide), dtype=dt), np.empty((block_k, wide), dtype=dt)
    pd = np.empty((block_k if iparams[7] else 0, wide), dtype=dt)
    tt = np.empty((block_k if iparams[14] else 0, wide), dtype=dt)
    heads, qrow = np.empty(wide, np.int64), np.empty(wide, np.int64)
    first, last = np.empty(wide, np.int64), np.empty(wide, np.int64)
    scratch = np.empty((2, wide), np.int64)                 # for user_mask
    ld_k, ld_v = kt.shape[1], vt.shape[1]
    for k0 in range(start, min(tk, lengths[b]), step):
        n = min(k0 + block_k, tk, lengths[b]) - k0
        transpose_rows(k, kmap[b], hk, k0, n, kblk, kt)
        transpose_rows(v, vmap[b], hk, k0, n, vblk, vt)
        krows = k[kmap[b], hk]
        for j in range(n):
            for f in range(e):
                kp[j, f] = krows[k0 + j, f]
        dka[:n] = zero
        dva[:n] = zero
        for c0 in range(0, rows, wide):
            lo, hi = panel_keys(c0, rows, tq, 0, hk, g_heads, offset, k0, n, iparams, lse,
                                b, True, heads, qrow, first, last, segments, user)
            if lo >= hi:
                continue
            for c in range(wide):
                if c0 + c < rows:
                    h, i = heads[c], qrow[c]
                    shift[c] = lse[b, h, i] if lse[b, h, i] != ninf else zero
                    dcol[c] = dd[b, h, i]
                else:
                    shift[c], dcol[c] = zero, zero
            for sub in range(KEY_PANELS):
                pack_rows(q, qmap[b], go, b, hk, g_heads, c0 + sub * width, tq, rows,
                          qt[sub], qp[sub * width:], dot[sub], dop[sub * width:])
            s_lo = st.ctypes.data + lo * wide * size
            d_lo = dpt.ctypes.data + lo * wide * size
            for sub in range(KEY_PANELS):
                tile_product(kt.ctypes.data + lo * size, 1, ld_k, hi - lo,
                             qt[sub].ctypes.data, width, s_lo + sub * width * size, wide, e,
                             scale, False, size)
            transform_panel(st, lo, hi, first, last, heads, qrow, k0, offset, b, mmap[b],
                            mask, slopes, fparams, iparams, tt, True, user, scratch)
            for sub in range(KEY_PANELS):
                exp_columns(s_lo + sub * width * size, hi - lo, wide,
                            shift.ctypes.data + sub * width * size, zero)
                tile_product(vt.ctypes.data + lo * size, 1, ld_v, hi - lo,
                             dot[sub].ctypes.data, width, d_lo + sub * width * size, wide, ev,
                             one, False, size)
            weights = st                                 # P, or with dropout P·factor
            if iparams[7]:
                dropout_panel(st, dpt, pd, lo, hi, first, last, heads, qrow, k0, b, tq, tk,
                              fparams, iparams, True)
                weights = pd
            wide_product(weights.ctypes.data + lo * wide * size, wide, 1, hi - lo,
                         dop.ctypes.data, ev_pad, dva.ctypes.data + lo * ev_pad * size,
                         ev_pad, wide, ev_pad, one, size)
            score_gradient(st, dpt, tt, lo, hi, first, last, dcol, fparams, iparams)
            wide_product(s_lo, wide, 1, hi - lo, qp.ctypes.data, e_pad,
                         dka.ctypes.data + lo * e_pad * size, e_pad, wide, e_pad, scale, size)
            # dQ of the panel's rows: dS (keys × rows) read down its columns times K's rows,
            # added to dq's rows in place where they are the panel's (one head, contiguous
            # features, no padding), else through dqa
            g = c0 // tq
            if (e == e_pad and c0 + wide <= rows and (c0 + wide - 1) // tq == g
                    and dq.strides[4] == size and dq.strides[3] == e * size):
                wide_product(s_lo, 1, wide, wide, kp.ctypes.data + lo * e_pad * size, e_pad,
                             dq[part, b, hk * g_heads + g, c0 - g * tq:].ctypes.data, e,
                             hi - lo, e_pad, scale, size)
                continue
            dqa[:] = zero
            wide_product(s_lo, 1, wide, wide, kp.ctypes.data + lo * e_pad * size, e_pad,
                         dqa.ctypes.data, e_pad, hi - lo, e_pad, scale, size)
            for c in range(min(wide, rows - c0)):
                dqrow = dq[part, b, heads[c], qrow[c]]
                for f in range(e):
                    dqrow[f] += dqa[c, f]
        for j in range(n):
            dkrow, dvrow = dk[b, hk, k0 + j], dv[b, hk, k0 + j]
            for f in range(e):
                dkrow[f] = dka[j, f]
            for f in range(ev):
                dvrow[f] = dva[j, f]


@njit(parallel=True, nogil=True, fastmath=fastmath, cache=True)
def backward(q: Any, k: Any, v: Any, qmap: Any, kmap: Any, vmap: Any, mask: Any, mmap: Any,
             lengths: Any, offsets: Any, slopes: Any, segments: Any, user: Any, go: Any,
             lse: Any, dd: Any, items: Any, fparams: Any, iparams: Any, dq: Any, dk: Any,
             dv: Any, counter: Any) -> None:
    """dQ, dK and dV over the key items (:func:`grad_key_item`: each writes its own rows
    of dK and dV, and adds to its own part of dQ), handed out as by :func:`forward`
    (``counter[2]``: the address of :func:`grad_key_item` compiled for
    :func:`item_signature`)."""
    n = items.shape[0]
    for _ in prange(min(counter[1], n)):
        t = next_item(counter)
        while t < n:
            call_at(counter[2], (q, k, v, qmap, kmap, vmap, mask, mmap, lengths, offsets,
                                 slopes, segments, user, go, lse, dd, items, fparams, iparams,
                                 dq, dk, dv, t))
            t = next_item(counter)


def backward_signature(dt: Any) -> Any:
    """The backward kernel's signature per dtype (any layout, read-only inputs)."""
    t = numba.types
    dt = numba.from_dtype(np.dtype(dt))

    def arr(dtype: Any, ndim: int, readonly: bool = True) -> Any:
        return t.Array(dtype, ndim, "A", readonly=readonly)

    i1, i2 = arr(t.int64, 1), arr(t.int64, 2)
    return t.void(arr(dt, 4), arr(dt, 4), arr(dt, 4), i1, i1, i1, arr(dt, 4), i1, i1, i1,
                  arr(dt, 2), arr(t.int64, 3), user_type(dt), arr(dt, 4), arr(dt, 3),
                  arr(dt, 3), i2,
                  arr(dt, 1), i1,
                  arr(dt, 5, False), arr(dt, 4, False), arr(dt, 4, False),
                  arr(t.int64, 1, False))
