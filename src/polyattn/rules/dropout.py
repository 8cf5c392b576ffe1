"""Dropout by counters: the same keep-mask on every library, implementation and device.

docs/semantics.rst, "Dropout": weight (b…, h, i, j) of a call with ``dropout_p = p`` and
``dropout_seed = s`` is kept iff the Philox4x32-10 block cipher (Salmon et
al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), keyed by ``s``
and applied to that weight's flat index ``n`` in (B…, H, Tq, Tk), gives a
first output word ``x0`` with ``x0 / 2³² >= p``. Kept weights are scaled by
``1 / (1 - p)``. Nothing is stored: any piece of the mask is recomputed from
indices alone, so the blocked paths, the CUDA kernel and the backward pass
all see the same mask.

Words are 32-bit. The counter is ``(n mod 2³², n div 2³², 0, 0)``, the key
``(s mod 2³², (s div 2³²) mod 2³²)``. The comparison is on integers,
``x0 >= ceil(p · 2³²)`` (:func:`threshold`), so no floating-point rounding
can differ between libraries.

The cipher is written here in Array-API calls on int64 words holding 32-bit
values (products split into 16-bit halves so that nothing overflows), or on
uint32 words where int64 is not available (JAX without ``jax_enable_x64``).
:func:`philox_numpy` is the same function on NumPy's uint64, faster; the CUDA
kernel has its own device function. Tests hold all of them to Random123's
known answers and to each other, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

from polyattn._interop import device_of, library_name

Array = Any

#: Philox4x32 multipliers and Weyl key increments (Random123).
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
MASK32 = 0xFFFFFFFF


def threshold(p: float) -> int:
    """``ceil(p · 2³²)``: a weight is kept iff its word ``x0 >= threshold(p)``.

    ``p · 2³²`` is exact in float64 (a power-of-two scaling), so the integer
    is the same wherever it is computed. It is ``2³²`` (nothing kept) only for
    ``p`` within 2⁻³² of 1.

    >>> threshold(0.0), threshold(0.5), threshold(0.1)
    (0, 2147483648, 429496730)
    """
    return math.ceil(float(p) * 2.0**32)


def key_words(seed: int) -> tuple[int, int]:
    """The two 32-bit key words of ``seed`` (an int in [0, 2⁶⁴))."""
    seed = int(seed)
    return seed & MASK32, (seed >> 32) & MASK32


def _key_arrays(seed: Array, xp: Any, narrow: bool) -> tuple[Array, Array]:
    """The key words of a seed given as a 0-d integer array (traced under ``jax.jit``).

    Its value is read modulo 2⁶⁴ (uint32 words: modulo 2³², all a 32-bit type holds);
    a non-negative seed gives the key words of the same int.
    """
    if narrow:
        s = xp.astype(seed, xp.uint32)
        return s, xp.zeros_like(s)
    s = xp.astype(seed, xp.int64)         # a uint64 above 2⁶³ wraps: the bits stay
    return s & MASK32, (s >> 32) & MASK32


def _next_key(k: Any, w: int, xp: Any, narrow: bool) -> Any:
    """``(k + w) mod 2³²``: the key schedule's Weyl step, on an int or a word array."""
    if narrow and not isinstance(k, int):
        return k + _word(w, xp)           # uint32 arithmetic wraps by itself
    return (k + w) & MASK32


def _narrow(xp: Any) -> bool:
    """Whether 32-bit words must be uint32 (JAX without 64-bit types)."""
    if library_name(xp) != "jax":
        return False
    import jax

    return not bool(jax.config.jax_enable_x64)


def _mulhilo_wide(a: Array, b: int) -> tuple[Array, Array]:
    """High and low words of ``a · b`` for int64 ``a`` < 2³² and a 32-bit constant ``b``."""
    p_lo = a * (b & 0xFFFF)                      # < 2⁴⁸
    p_hi = a * (b >> 16)                         # < 2⁴⁸
    lo = (p_lo + ((p_hi & 0xFFFF) << 16)) & MASK32
    hi = (p_hi + (p_lo >> 16)) >> 16
    return hi, lo


def _mulhilo_narrow(a: Array, b: int) -> tuple[Array, Array]:
    """High and low words of ``a · b`` for uint32 ``a`` and a 32-bit constant ``b``."""
    al, ah = a & 0xFFFF, a >> 16
    bl, bh = b & 0xFFFF, b >> 16
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh          # each < 2³²
    mid = (ll >> 16) + (lh & 0xFFFF) + (hl & 0xFFFF)             # < 3·2¹⁶
    lo = (ll & 0xFFFF) | ((mid & 0xFFFF) << 16)
    hi = hh + (lh >> 16) + (hl >> 16) + (mid >> 16)
    return hi, lo


def philox(c0: Array, c1: Array, c2: Array, c3: Array, seed: int | Array, xp: Any,
           ) -> tuple[Array, Array, Array, Array]:
    """Philox4x32-10 of the counters ``(c0, c1, c2, c3)`` under key ``seed``.

    The words are int64 arrays holding values in [0, 2³²) (uint32 arrays on
    JAX without 64-bit types); they broadcast together. Returns the four
    output words in the same form. ``seed`` is an int, or a 0-d integer array
    of ``xp`` (a seed traced by ``jax.jit``).
    """
    narrow = _narrow(xp)
    mulhilo = _mulhilo_narrow if narrow else _mulhilo_wide
    k0, k1 = key_words(seed) if isinstance(seed, int) else _key_arrays(seed, xp, narrow)
    for r in range(ROUNDS):
        if r:
            k0, k1 = _next_key(k0, W0, xp, narrow), _next_key(k1, W1, xp, narrow)
        hi0, lo0 = mulhilo(c0, M0)
        hi1, lo1 = mulhilo(c2, M1)
        # uint32 words: a Python int >= 2³¹ next to them would be read as an int32
        w0, w1 = (_word(k0, xp), _word(k1, xp)) if narrow else (k0, k1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ w0, lo1, hi0 ^ c3 ^ w1, lo0
    return c0, c1, c2, c3


def _word(x: int | Array, xp: Any) -> Array:
    """The 32-bit word ``x`` as a uint32 scalar array (for the narrow path)."""
    return x if not isinstance(x, int) else xp.asarray(x, dtype=xp.uint32)


def philox_numpy(c0: Any, c1: Any, c2: Any, c3: Any, seed: int) -> tuple[Any, ...]:
    """:func:`philox` on NumPy uint64 words (a faster product; the same bits)."""
    import numpy as np

    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    k0, k1 = key_words(seed)
    m0, m1, mask = np.uint64(M0), np.uint64(M1), np.uint64(MASK32)
    shift = np.uint64(32)
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        p0 = c0 * m0
        p1 = c2 * m1
        c0, c1, c2, c3 = ((p1 >> shift) ^ c1 ^ np.uint64(k0), p1 & mask,
                          (p0 >> shift) ^ c3 ^ np.uint64(k1), p0 & mask)
    return c0, c1, c2, c3


def keep(row: Array, col: Array, tk: int, seed: int | Array, p: float, xp: Any) -> Array:
    """Boolean: whether weight ``n = row · tk + col`` survives dropout ``p`` under ``seed``.

    ``row`` is the flat index of a query row in (B…, H, Tq), ``col`` the key
    index; integer arrays that broadcast together (any integer dtype; their
    values below 2⁶³ / Tk). On JAX without 64-bit types the product is formed
    in uint32 words with a carry.
    """
    t = threshold(p)
    if _narrow(xp):
        row, col = xp.astype(row, xp.uint32), xp.astype(col, xp.uint32)
        hi, lo = _mulhilo_narrow(row, tk)
        lo2 = lo + col
        hi = hi + xp.astype(lo2 < lo, xp.uint32)          # carry
        c0, c1 = lo2, hi
        zero = xp.zeros((), dtype=xp.uint32, device=device_of(row))
    else:
        n = xp.astype(row, xp.int64) * tk + xp.astype(col, xp.int64)
        c0, c1 = n & MASK32, n >> 32
        zero = xp.zeros((), dtype=xp.int64, device=device_of(n))
    if t >= 2**32:
        return xp.zeros(xp.broadcast_arrays(c0, c1)[0].shape, dtype=xp.bool,
                        device=device_of(c0))
    x0, _, _, _ = philox(c0, c1, zero, zero, seed, xp)
    return x0 >= (_word(t, xp) if _narrow(xp) else t)


def keep_grouped(batch: tuple[int, ...], hkv: int, g: int, tq: int, tk: int, q0: int, q1: int,
                 k0: int, k1: int, seed: int | Array, p: float, xp: Any, device: Any,
                 ) -> Array:
    """The keep-mask of one tile in the grouped layout (B…, Hkv, G, q1 - q0, k1 - k0).

    Query head ``h = hk · G + g``; the flat row index is ``((b·H + h)·Tq + i)``
    with ``b`` the flat index of the batch row in B….
    """
    n_batch = math.prod(batch)
    b = xp.reshape(xp.arange(n_batch, dtype=xp.int64 if not _narrow(xp) else xp.uint32,
                             device=device), (*batch, 1, 1, 1, 1))
    itype = b.dtype
    h = xp.reshape(xp.arange(hkv * g, dtype=itype, device=device), (hkv, g, 1, 1))
    i = xp.reshape(xp.arange(q0, q1, dtype=itype, device=device), (q1 - q0, 1))
    j = xp.arange(k0, k1, dtype=itype, device=device)
    row = (b * (hkv * g) + h) * tq + i                      # (B…, Hkv, G, bq, 1)
    return keep(row, j, tk, seed, p, xp)
