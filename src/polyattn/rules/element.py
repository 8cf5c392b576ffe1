"""One (query, key) pair under the score rules, as scalar code every kernel compiles.

The Array-API paths apply the rules to whole tiles (:mod:`.visibility`); the
CPU and CUDA kernels apply them one score at a time, inside their loops. The
functions here are that scalar form, written once: plain Python on numbers
that Numba compiles into each kernel, forward and backward, through
:func:`polyattn.rules.lowering.lower`. Each kernel keeps its own loops and
memory layout and calls these for the rules.

Integers are positions and key indices (int64 in the kernels); ``left`` and
``right`` are the reaches of :func:`polyattn.rules.lowering.reach`, an
unbounded side given as a large number rather than ``None``. ``T`` is the
compute type's constructor (``numpy.float32`` or ``numpy.float64``), bound
by :func:`~polyattn.rules.lowering.lower`; as plain Python it is ``float``.

Examples
--------
>>> position(3, -4, 1, 10)           # bottom-right with key length 10, Tq = 4
9
>>> visible(9, 9, 2, 0, 10), visible(6, 9, 2, 0, 10)
(True, False)
>>> round(modify(3.0, 5, 2, 2.0, 0.5, 0.25), 6)     # 2·tanh(3/2) - 0.25·|5 - 2|
1.060297
>>> row_keys(9, 2, 0, 0, 10), block_queries(2, 3, 0, 2, 0, 8)
((7, 10), (2, 6))

Every float is made by ``T`` (``T(1)``, not ``1``): Numba would compute an int64
literal with a float32 in float64.
"""

from __future__ import annotations

import math

T = float


def position(i, offset, shift, length):  # type: ignore[no-untyped-def]
    """Query row ``i``'s position: ``i + offset``, plus the key length when ``shift`` is 1."""
    return i + offset + shift * length


def key_length(lengths, b):  # type: ignore[no-untyped-def]
    """Batch row ``b``'s key length from a (B,) table, or a (1,) one holding it for all."""
    length = lengths[0]
    if lengths.shape[0] > 1:
        length = lengths[b]
    return length


def head_slope(slopes, b, h):  # type: ignore[no-untyped-def]
    """The ALiBi slope of head ``h`` of batch row ``b`` from a (B|1, H|1) table."""
    sb = b if slopes.shape[0] > 1 else 0
    sh = h if slopes.shape[1] > 1 else 0
    return slopes[sb, sh]


def visible(j, p, left, right, end):  # type: ignore[no-untyped-def]
    """Whether key ``j`` is visible to a query at position ``p`` (keys ``>= end`` do not exist)."""
    return j < end and j <= p + right and j >= p - left


def row_keys(p, left, right, first, end):  # type: ignore[no-untyped-def]
    """Keys ``[lo, hi)`` of ``[first, end)`` visible to a query at position ``p``: the
    ``j`` of :func:`visible`, as a range (``lo >= hi``: none)."""
    return max(p - left, first), min(p + right + 1, end)


def block_keys(first, last, pos_offset, left, right, tk, length):  # type: ignore[no-untyped-def]
    """Keys ``[lo, hi)`` that some query row in ``[first, last]`` may see (``lo >= hi``: none)."""
    lo = max(0, first + pos_offset - left)
    hi = min(tk, length, last + pos_offset + right + 1)
    return lo, hi


def block_queries(first, last, pos_offset, left, right, tq):  # type: ignore[no-untyped-def]
    """Query rows ``[lo, hi)`` that may see some key in ``[first, last]`` (keys that exist;
    ``lo >= hi``: none): :func:`block_keys` the other way round."""
    lo = max(0, first - right - pos_offset)
    hi = min(tq, last + left - pos_offset + 1)
    return lo, hi


def modifiers(softcap, slope, unit):  # type: ignore[no-untyped-def]
    """``(cap, inv_cap, slope)`` for :func:`modify`, in scores scaled by ``unit`` (1, or
    log2(e) for scores kept in base 2): ``softcap <= 0`` means no soft-capping."""
    cap = softcap * unit
    inv_cap = T(0)
    if cap > 0:
        inv_cap = T(1) / cap
    return cap, inv_cap, slope * unit


def head_modifiers(mods, softcap, slopes, b, h, unit):  # type: ignore[no-untyped-def]
    """:func:`modifiers` of head ``h`` of batch row ``b`` where the kernel has modifiers
    (``mods``, a compile-time flag), else zeros (nothing to read)."""
    cap = T(0)
    inv_cap = T(0)
    slope = T(0)
    if mods:
        cap, inv_cap, slope = modifiers(softcap, head_slope(slopes, b, h), unit)
    return cap, inv_cap, slope


def mask_steps(masked, mask, mask_batch, b, h):  # type: ignore[no-untyped-def]
    """Where batch row ``b``, head ``h`` reads a mask broadcast to (B, H, Tq, Tk):
    ``(mb, mh, mi_step, mj_step)``, a size-1 axis read at index 0 (``mask_batch`` maps
    the flat batch index to the mask's); zeros where the kernel has no mask (``masked``,
    a compile-time flag)."""
    mb = 0
    mh = 0
    mi_step = 0
    mj_step = 0
    if masked:
        mb = mask_batch[b]
        if mask.shape[1] > 1:
            mh = h
        if mask.shape[2] > 1:
            mi_step = 1
        if mask.shape[3] > 1:
            mj_step = 1
    return mb, mh, mi_step, mj_step


def modify(x, p, j, cap, inv_cap, slope):  # type: ignore[no-untyped-def]
    """The scaled score ``x`` after soft-capping (``cap > 0``; ``inv_cap = 1 / cap``) and ALiBi."""
    if cap > 0:
        x = cap * math.tanh(x * inv_cap)
    return x - slope * T(abs(p - j))


def modify_and_grad(x, p, j, cap, inv_cap, slope):  # type: ignore[no-untyped-def]
    """``(modify(x, p, j, …), modify_grad(x, …))`` with one ``tanh``: what a backward
    pass needs of a score (the derivative multiplies its ``dS``)."""
    grad = T(1)
    if cap > 0:
        t = math.tanh(x * inv_cap)
        x = cap * t
        grad = T(1) - t * t
    return x - slope * T(abs(p - j)), grad


def modify_grad(x, cap, inv_cap):  # type: ignore[no-untyped-def]
    """d(modified score) / d(scaled score) at the scaled score ``x`` (ALiBi adds a constant)."""
    if cap > 0:
        t = math.tanh(x * inv_cap)
        return T(1) - t * t
    return T(1)
