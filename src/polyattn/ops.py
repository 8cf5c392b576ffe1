"""The functions a ``score_mod`` or ``mask_mod`` is written with.

A user rule (``score_mod(score, b, h, q_idx, kv_idx, *mod_args)``,
``mask_mod(b, h, q_idx, kv_idx, *mod_args)``; docs/rules.rst, "Rules you
write") is written once with Python operators, Python numbers, indexing of
``mod_args`` by the index arguments, and these functions. polyattn then calls it
on whole tiles of scores, with broadcast index arrays, in the inputs' array library
(NumPy, CuPy, torch, JAX, Dask, array-api-strict), and on values that carry a
derivative, so that the backward passes of :func:`polyattn.attention_vjp` get
``d score_mod / d score`` without an autodiff library.

Each function takes arrays of any of those libraries, Python numbers, and those
derivative-carrying values. Python control flow on the arguments (``if score >
0:``, ``max(score, 0)``, ``and``/``or`` on arrays) cannot work on tiles: it raises
an error that names the function and says to use :func:`where`.

Examples
--------
>>> import numpy as np
>>> from polyattn import ops
>>> def relu_bias(score, b, h, q_idx, kv_idx):
...     return ops.where(q_idx >= kv_idx, score, ops.minimum(score, 0.0))
>>> relu_bias(np.array([[1.0, -2.0], [3.0, 4.0]]), 0, 0, np.array([[0], [1]]),
...           np.array([[0, 1]]))
array([[ 1., -2.],
       [ 3.,  4.]])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["abs", "cast", "cos", "exp", "log", "logical_and", "logical_not", "logical_or",
           "maximum", "minimum", "sin", "sqrt", "tanh", "where"]

class Dual:
    """A tile of values ``x`` with their derivative ``d`` along one direction (the
    score): what a user rule is evaluated on for the backward passes. Arithmetic and
    :mod:`polyattn.ops` propagate the derivative; comparisons give plain booleans."""

    __slots__ = ("d", "x")
    __array_priority__ = 1000

    def __init__(self, x: Any, d: Any) -> None:
        self.x, self.d = x, d

    # --- arithmetic
    def __add__(self, o: Any) -> Dual:
        ox, od = _parts(o)
        return Dual(self.x + ox, self.d + od if od is not None else self.d)

    __radd__ = __add__

    def __sub__(self, o: Any) -> Dual:
        ox, od = _parts(o)
        return Dual(self.x - ox, self.d - od if od is not None else self.d)

    def __rsub__(self, o: Any) -> Dual:
        return Dual(o - self.x, -self.d)

    def __mul__(self, o: Any) -> Dual:
        ox, od = _parts(o)
        d = self.d * ox if od is None else self.d * ox + self.x * od
        return Dual(self.x * ox, d)

    __rmul__ = __mul__

    def __truediv__(self, o: Any) -> Dual:
        ox, od = _parts(o)
        d = self.d / ox if od is None else (self.d * ox - self.x * od) / (ox * ox)
        return Dual(self.x / ox, d)

    def __rtruediv__(self, o: Any) -> Dual:
        return Dual(o / self.x, -o * self.d / (self.x * self.x))

    # ``%`` and ``//`` as Python's (the remainder takes the divisor's sign; the quotient
    # is floored), in the array library by its operators: ``a % c = a - (a // c) · c``,
    # so its derivative is ``da - (a // c) · dc`` (almost everywhere); ``//`` is flat
    def __mod__(self, o: Any) -> Dual:
        ox, od = _parts(o)
        d = self.d if od is None else self.d - (self.x // ox) * od
        return Dual(self.x % ox, d)

    def __rmod__(self, o: Any) -> Dual:
        return Dual(o % self.x, -(o // self.x) * self.d)

    def __floordiv__(self, o: Any) -> Dual:
        ox, od = _parts(o)
        return Dual(self.x // ox, self.d * 0 if od is None else (self.d + od) * 0)

    def __rfloordiv__(self, o: Any) -> Dual:
        return Dual(o // self.x, self.d * 0)

    def __pow__(self, o: Any) -> Dual:
        if isinstance(o, Dual):
            raise TypeError("a power whose exponent depends on the score: write it with "
                            "ops.exp and ops.log")
        if o == 0:
            return Dual(self.x ** 0, self.d * 0)
        return Dual(self.x ** o, o * self.x ** (o - 1) * self.d)

    def __rpow__(self, o: Any) -> Dual:
        if isinstance(o, bool) or not isinstance(o, (int, float)) or o <= 0:
            raise TypeError("a power of a number by the score needs a positive Python "
                            f"number as its base; got {o!r}")
        return exp(self * math.log(o))

    def __neg__(self) -> Dual:
        return Dual(-self.x, -self.d)

    def __pos__(self) -> Dual:
        return self

    # --- comparisons: plain booleans
    def __lt__(self, o: Any) -> Any:
        return self.x < _parts(o)[0]

    def __le__(self, o: Any) -> Any:
        return self.x <= _parts(o)[0]

    def __gt__(self, o: Any) -> Any:
        return self.x > _parts(o)[0]

    def __ge__(self, o: Any) -> Any:
        return self.x >= _parts(o)[0]

    def __bool__(self) -> bool:
        raise TypeError(_CONTROL_FLOW)

    def __abs__(self) -> Dual:
        return abs(self)                      # ops.abs


#: The message of Python control flow on a tile.
_CONTROL_FLOW = ("Python control flow (if, while, and/or, max/min, bool()) on a rule's "
                 "arguments cannot work: the rule is called on whole tiles of scores; "
                 "write the choice with polyattn.ops.where (and ops.minimum, ops.maximum, "
                 "ops.logical_and, ...)")


def _parts(v: Any) -> tuple[Any, Any]:
    """(value, derivative or None) of a Dual or a plain value."""
    if isinstance(v, Dual):
        return v.x, v.d
    return v, None


def _xp(*values: Any) -> Any:
    """The array namespace of the arrays among ``values`` (NumPy for Python numbers)."""
    arrays = [v for v in values if hasattr(v, "shape") and hasattr(v, "dtype")]
    if all(type(a) is np.ndarray for a in arrays):   # none, or NumPy's only: no look-up
        import array_api_compat.numpy as np_xp

        return np_xp
    from polyattn._interop import namespace_of

    return namespace_of({f"argument {i}": a for i, a in enumerate(arrays)})


def _traced(name: str, *args: Any) -> Any:
    """``ops.<name>(*args)`` recorded by a traced argument (one with ``_rule_op``: a rule
    being compiled into a kernel, :mod:`polyattn.rules.tracing`), else ``None``."""
    for a in args:
        record = getattr(type(a), "_rule_op", None)
        if record is not None:
            return record(name, args)
    return None


def _unary(name: str, x: Any, grad: Any) -> Any:
    """``xp.<name>(x)`` for arrays, ``math.<name>`` for numbers, and the chain rule for a
    :class:`Dual` (``grad(value, result)``: the derivative of the function)."""
    traced = _traced(name, x)
    if traced is not None:
        return traced
    if isinstance(x, Dual):
        y = _unary(name, x.x, None)
        return Dual(y, grad(x.x, y) * x.d)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return getattr(math, "fabs" if name == "abs" else name)(x)
    return getattr(_xp(x), name)(x)


def exp(x: Any) -> Any:
    """``e**x``."""
    return _unary("exp", x, lambda v, y: y)


def log(x: Any) -> Any:
    """The natural logarithm."""
    return _unary("log", x, lambda v, y: 1 / v)


def tanh(x: Any) -> Any:
    """The hyperbolic tangent (soft-capping: ``c * tanh(score / c)``)."""
    return _unary("tanh", x, lambda v, y: 1 - y * y)


def sqrt(x: Any) -> Any:
    """The square root."""
    return _unary("sqrt", x, lambda v, y: 0.5 / y)


def sin(x: Any) -> Any:
    """The sine."""
    return _unary("sin", x, lambda v, y: _unary("cos", v, None))


def cos(x: Any) -> Any:
    """The cosine."""
    return _unary("cos", x, lambda v, y: -_unary("sin", v, None))


def abs(x: Any) -> Any:
    """The absolute value (its derivative at 0 is taken as 0)."""
    def grad(v: Any, y: Any) -> Any:
        if isinstance(v, (int, float)):
            return float((v > 0) - (v < 0))
        return _xp(v).sign(v)

    return _unary("abs", x, grad)


def cast(x: Any, like: Any) -> Any:
    """``x`` (an index expression, say) in the floating dtype of ``like`` (a score, or a
    ``mod_args`` table): libraries that do not mix integer and floating arrays
    (array-api-strict) need it before ``slope * cast(q_idx - kv_idx, slope)``."""
    traced = _traced("cast", x, like)
    if traced is not None:
        return traced
    if isinstance(x, Dual):
        return x
    value = like.x if isinstance(like, Dual) else like
    if not hasattr(x, "shape") or not hasattr(value, "dtype"):
        return float(x) if not hasattr(x, "shape") else x
    return _xp(x).astype(x, value.dtype)


def where(condition: Any, x: Any, y: Any) -> Any:
    """``x`` where ``condition`` holds, else ``y`` (element by element, broadcast)."""
    traced = _traced("where", condition, x, y)
    if traced is not None:
        return traced
    if isinstance(condition, Dual):
        raise TypeError("ops.where's condition must be a comparison (score > 0), not a "
                        "score")
    xd, yd = isinstance(x, Dual), isinstance(y, Dual)
    if xd or yd:
        (xv, xg), (yv, yg) = _parts(x), _parts(y)
        value = where(condition, xv, yv)
        dx = xg if xg is not None else 0.0
        dy = yg if yg is not None else 0.0
        return Dual(value, where(condition, dx, dy))
    if not any(hasattr(v, "shape") for v in (condition, x, y)):
        return x if condition else y
    xp = _xp(condition, x, y)
    like = next((v for v in (x, y) if hasattr(v, "dtype")), None)
    dtype = like.dtype if like is not None else xp.float64
    device = getattr(like if like is not None else condition, "device", None)
    x = x if hasattr(x, "shape") else xp.asarray(x, dtype=dtype, device=device)
    y = y if hasattr(y, "shape") else xp.asarray(y, dtype=dtype, device=device)
    return xp.where(condition, x, y)


def minimum(x: Any, y: Any) -> Any:
    """The smaller of ``x`` and ``y``, element by element (the first where equal)."""
    return where(_parts(y)[0] < _parts(x)[0], y, x)


def maximum(x: Any, y: Any) -> Any:
    """The larger of ``x`` and ``y``, element by element (the first where equal)."""
    return where(_parts(y)[0] > _parts(x)[0], y, x)


def logical_and(x: Any, y: Any) -> Any:
    """Both conditions, element by element."""
    return _logical("logical_and", x, y)


def logical_or(x: Any, y: Any) -> Any:
    """Either condition, element by element."""
    return _logical("logical_or", x, y)


def logical_not(x: Any) -> Any:
    """The opposite condition, element by element."""
    traced = _traced("logical_not", x)
    if traced is not None:
        return traced
    if not hasattr(x, "shape"):
        return not x
    return _xp(x).logical_not(x)


def _logical(name: str, x: Any, y: Any) -> Any:
    traced = _traced(name, x, y)
    if traced is not None:
        return traced
    if isinstance(x, Dual) or isinstance(y, Dual):
        raise TypeError(f"ops.{name} takes conditions (comparisons), not scores")
    if not hasattr(x, "shape") and not hasattr(y, "shape"):
        return (x and y) if name == "logical_and" else (x or y)
    xp = _xp(x, y)
    ref = x if hasattr(x, "shape") else y
    x = x if hasattr(x, "shape") else xp.asarray(bool(x), device=getattr(ref, "device", None))
    y = y if hasattr(y, "shape") else xp.asarray(bool(y), device=getattr(ref, "device", None))
    return getattr(xp, name)(x, y)
