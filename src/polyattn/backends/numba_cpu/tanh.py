"""A float32 hyperbolic tangent in arithmetic only, for the kernels' soft-capping and the
``ops.tanh`` of rules users write (this module imports Numba).

The C library's ``tanhf`` is a call per score that the compiler cannot turn into
vector code; soft-capping spent more time in it than in both products of the
attention. :func:`tanh32` has no call and no branch the compiler keeps:

- ``|x| < 0.5``: ``x + x·z·P(z)``, ``z = x²``, ``P`` of degree 4 (a least-squares
  fit of ``(tanh(x) - x) / x³``, relative error 1.1e-9 in float64 arithmetic);
- otherwise ``1 - 2 / (e^(2|x|) + 1)`` with the sign of ``x``, ``2|x|`` capped at 20
  (``tanh(10)`` rounds to 1 in float32); ``e^y = 2ⁿ·e^r``, ``n = ⌊y·log₂e + ½⌋``,
  ``r = y - n·ln 2`` in two parts (Cody–Waite), ``e^r`` a degree-6 fit (relative
  error 4.4e-9), ``2ⁿ`` made from its exponent bits.

Both are computed and one is kept. Against ``tanh`` in float64 the result is within
3 units in the last place of float32 (the tests measure it); ``tanh32(±inf) = ±1``,
NaN stays NaN. float64 keeps the C library's ``tanh``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit
from numba.core import types
from numba.extending import intrinsic

f32 = np.float32
#: (tanh(x) - x) / x³ as a polynomial in x², lowest degree first.
SMALL = tuple(f32(c) for c in (-0.3333332815644692, 0.13333021666036443,
                               -0.053907000149975313, 0.021339100775526233,
                               -0.006721117289743488))
#: e^r on [-ln2/2, ln2/2], lowest degree first.
EXP = tuple(f32(c) for c in (1.0000000004121603, 1.000000026909376, 0.4999999306417083,
                             0.1666646069302569, 0.04166823472801826,
                             0.008371550482337243, 0.0013824844150851022))
LOG2E = f32(1.4426950408889634)
LN2_HI = f32(0.693145751953125)              # ln 2 in 16 bits: n·LN2_HI is exact
LN2_LO = f32(1.4286068203094173e-06)


@intrinsic
def _power_of_two(typingctx: Any, n: Any) -> Any:
    """2ⁿ as a float32 for an integer ``n`` in [-126, 127]: the bits ``(n + 127) << 23``."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i32 = context.get_value_type(types.int32)
        bits = builder.shl(builder.add(builder.trunc(args[0], i32), i32(127)), i32(23))
        return builder.bitcast(bits, context.get_value_type(types.float32))

    return types.float32(n), codegen


@njit(nogil=True, cache=True, inline="always", fastmath={"contract", "nsz", "arcp"})
def tanh32(x: Any) -> Any:
    """``tanh(x)`` of a float32 (module docstring)."""
    a = abs(x)
    z = a * a
    small = x + x * z * (SMALL[0] + z * (SMALL[1] + z * (SMALL[2] + z * (SMALL[3]
                                                                         + z * SMALL[4]))))
    y = a + a
    y = y if y < f32(20.0) else f32(20.0)                # NaN -> 20 here; kept below
    n = np.int32(y * LOG2E + f32(0.5))                   # y >= 0: truncation is the floor
    nf = f32(n)
    r = (y - nf * LN2_HI) - nf * LN2_LO
    er = EXP[0] + r * (EXP[1] + r * (EXP[2] + r * (EXP[3] + r * (EXP[4] + r * (
        EXP[5] + r * EXP[6])))))
    big = f32(1.0) - f32(2.0) / (er * _power_of_two(n) + f32(1.0))
    big = big if x > f32(0.0) else -big
    t = small if a < f32(0.5) else big                   # small keeps the sign of ±0
    return t if a == a else x                            # NaN stays NaN
