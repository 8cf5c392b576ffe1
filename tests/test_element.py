"""The scalar score element (:mod:`polyattn.rules.element`): where it offers a kernel two
forms of one function, the two give the same bits for every input, as plain Python and
as Numba compiles them for the CPU in float32 and float64 (the kernels' compiler takes
the same Numba IR)."""

from __future__ import annotations

import importlib.util
import itertools
import math

import numpy as np
import pytest

from polyattn.rules import element

SCORES = [-math.inf, -1e30, -30.0, -1.5, -1e-3, -0.0, 0.0, 1e-3, 0.5, 7.0, 88.0, 1e30,
          math.inf, math.nan]
CAPS = [0.0, -1.0, 2.5, 30.0]
SLOPES = [0.0, 0.25]
POSITIONS = [(0, 0), (9, 2), (2, 9)]

FORMS = [pytest.param(None, id="python"),
         pytest.param(np.float32, id="numba-float32"),
         pytest.param(np.float64, id="numba-float64")]


def _bits(values, t):
    return [np.asarray(t(v)).tobytes() for v in values]


@pytest.mark.parametrize("compute_type", FORMS)
def test_modify_and_grad_forms_agree(compute_type):
    if compute_type is None:
        t, select, branched = float, element.modify_and_grad, element.modify_and_grad_branched
    else:
        if importlib.util.find_spec("numba") is None:
            pytest.skip("Numba is not installed")
        from polyattn.rules.lowering import lower

        t = compute_type
        select, branched = (lower(f, "cpu", t) for f in (element.modify_and_grad,
                                                         element.modify_and_grad_branched))
    checked = 0
    for x, cap, slope, (p, j) in itertools.product(SCORES, CAPS, SLOPES, POSITIONS):
        inv_cap = 1.0 / cap if cap > 0 else 0.0
        args = (t(x), p, j, t(cap), t(inv_cap), t(slope))
        one, other = select(*args), branched(*args)
        assert _bits(one, t) == _bits(other, t), (x, cap, slope, p, j, one, other)
        if cap > 0 and 0.5 <= abs(x) < 1e3:
            assert float(other[1]) < 1.0   # the soft-cap derivative, not the default 1
        checked += 1
    assert checked == len(SCORES) * len(CAPS) * len(SLOPES) * len(POSITIONS)
