"""A float32 hyperbolic tangent in arithmetic only, for the kernels' soft-capping and the
``ops.tanh`` of rules users write (this module imports Numba).

The C library's ``tanhf`` is a call per score that the compiler cannot turn into
vector code; soft-capping spent more time in it than in both products of the
attention. :func:`tanh32` is one rational function with no call and no branch:

- ``x`` clamped to ``±9.02`` (``tanh(9.02)`` rounds to 1 in float32), then
  ``x·P(x²) / Q(x²)`` with ``P`` of degree 7 and ``Q`` of degree 3 in ``x²``: a
  least-squares fit of the relative error on [0, 9.02], reweighted towards its largest
  errors (relative error 8e-10 in float64 arithmetic);
- the result clamped to ±1 (float32 rounding of ``P`` and ``Q`` would otherwise pass 1
  by an ulp near the clamp).

Against ``tanh`` in float64 the result is within 6 units in the last place of float32
(the tests measure it; about 5 where it is close to ±1, where ``P`` and ``Q`` are large
and their roundings add up; the two-branch form it replaced, a polynomial below 0.5 and
``1 - 2 / (e^(2|x|) + 1)`` above, was within 3 but cost twice the time, a sixth of a
soft-capped attention's). ``tanh32(±inf) = ±1``, ``tanh32(-0) = -0``, NaN stays NaN.
float64 keeps the C library's ``tanh``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

f32 = np.float32
#: Where the argument is clamped: tanh(9.02) rounds to 1 in float32.
CLAMP = f32(9.02)
#: The numerator's coefficients in x², lowest degree first (times x).
P = tuple(f32(c) for c in (0.999999999205443, 0.1317827767914668, 0.003211279329566052,
                           1.2362859628004963e-05, -2.6039134403775685e-08,
                           9.145684640064662e-11, -2.7305156669958166e-13,
                           4.422242498878971e-16))
#: The denominator's coefficients in x², lowest degree first.
Q = tuple(f32(c) for c in (1.0, 0.46511610181464763, 0.02491666106857587,
                           0.0002706790646756101))


@njit(nogil=True, cache=True, inline="always", fastmath={"contract", "nsz", "arcp"})
def tanh32(x: Any) -> Any:
    """``tanh(x)`` of a float32 (module docstring)."""
    c = min(max(x, -CLAMP), CLAMP)                       # NaN -> a number here; kept below
    z = c * c
    p = P[0] + z * (P[1] + z * (P[2] + z * (P[3] + z * (P[4] + z * (P[5] + z * (
        P[6] + z * P[7]))))))
    q = Q[0] + z * (Q[1] + z * (Q[2] + z * Q[3]))
    t = min(max(c * p / q, f32(-1.0)), f32(1.0))
    return t if x == x else x                            # NaN stays NaN
