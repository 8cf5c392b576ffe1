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
"""

from __future__ import annotations

import math

T = float


def position(i, offset, shift, length):  # type: ignore[no-untyped-def]
    """Query row ``i``'s position: ``i + offset``, plus the key length when ``shift`` is 1."""
    return i + offset + shift * length


def visible(j, p, left, right, end):  # type: ignore[no-untyped-def]
    """Whether key ``j`` is visible to a query at position ``p`` (keys ``>= end`` do not exist)."""
    return j < end and j <= p + right and j >= p - left


def block_keys(first, last, pos_offset, left, right, tk, length):  # type: ignore[no-untyped-def]
    """Keys ``[lo, hi)`` that some query row in ``[first, last]`` may see (``lo >= hi``: none)."""
    lo = max(0, first + pos_offset - left)
    hi = min(tk, length, last + pos_offset + right + 1)
    return lo, hi


def modify(x, p, j, cap, inv_cap, slope):  # type: ignore[no-untyped-def]
    """The scaled score ``x`` after soft-capping (``cap > 0``; ``inv_cap = 1 / cap``) and ALiBi."""
    if cap > 0:
        x = cap * math.tanh(x * inv_cap)
    return x - slope * T(abs(p - j))


def modify_grad(x, cap, inv_cap):  # type: ignore[no-untyped-def]
    """d(modified score) / d(scaled score) at the scaled score ``x`` (ALiBi adds a constant)."""
    if cap > 0:
        t = math.tanh(x * inv_cap)
        return 1 - t * t
    return T(1)
