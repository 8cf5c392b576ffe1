"""Numerically stable softmax and log-sum-exp on any Array API namespace.

Both subtract the row maximum before exponentiating, so large logits never
overflow. A row whose entries are all ``-inf`` (a fully masked row) has no
maximum to subtract: it is shifted by 0 instead, which gives a softmax of
zeros and a log-sum-exp of ``-inf`` rather than NaN.
"""

from __future__ import annotations

from polyattn._interop import Array, device_of, namespace_of
from polyattn._validation import check_bool, check_floating
from polyattn.rules.online import NEG_INF, log_of_sum, quiet_floating_point, stable_shift


def _compute_dtype(x: Array, xp):
    """float16 (and other narrow floats) are computed in float32."""
    if x.dtype in (xp.float32, xp.float64):
        return x.dtype
    return xp.float32


def _is_empty(x: Array) -> bool:
    """Whether ``x`` has no elements (its reductions are answered without reducing)."""
    return any(n == 0 for n in x.shape)


def _check_axis(axis: object, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"`axis` must be an integer; got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"`axis` {axis} is out of range for an array with {ndim} dimensions")
    return axis


def softmax(x: Array, /, *, axis: int = -1) -> Array:
    """Softmax along ``axis``: ``exp(x) / sum(exp(x))``, computed stably.

    Parameters
    ----------
    x : array
        Real floating array of any shape (at least one dimension).
    axis : int, optional
        The axis that sums to one. Default: the last.

    Returns
    -------
    array
        Same shape, dtype, namespace and device as ``x``. Slices that are all
        ``-inf`` give zeros (not NaN). float16 inputs are computed in float32.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import softmax
    >>> softmax(np.array([1.0, 2.0, 3.0])).round(4)
    array([0.09  , 0.2447, 0.6652])
    >>> softmax(np.array([-np.inf, -np.inf]))
    array([0., 0.])
    """
    xp = namespace_of({"x": x})
    check_floating("x", x, xp)
    if x.ndim == 0:
        raise ValueError("`x` must have at least one dimension; got a 0-d array")
    axis = _check_axis(axis, x.ndim)
    if _is_empty(x):
        return xp.zeros(tuple(x.shape), dtype=x.dtype, device=device_of(x))
    with quiet_floating_point(x):
        xc = xp.astype(x, _compute_dtype(x, xp))
        m = stable_shift(xp.max(xc, axis=axis, keepdims=True), xp)
        e = xp.exp(xc - m)
        total = xp.sum(e, axis=axis, keepdims=True)
        out = e / xp.where(total == 0, xp.ones_like(total), total)
        return xp.astype(out, x.dtype)


def logsumexp(x: Array, /, *, axis: int = -1, keepdims: bool = False) -> Array:
    """``log(sum(exp(x)))`` along ``axis``, computed stably.

    Parameters
    ----------
    x : array
        Real floating array of any shape (at least one dimension).
    axis : int, optional
        The axis reduced. Default: the last.
    keepdims : bool, optional
        Keep the reduced axis with size 1.

    Returns
    -------
    array
        The reduction, in ``x``'s dtype, namespace and device. Slices that are
        all ``-inf`` (or empty) give ``-inf``; slices holding ``+inf`` (and no NaN)
        give ``+inf``; slices holding a NaN give NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import logsumexp
    >>> float(logsumexp(np.array([1000.0, 1000.0])))  # no overflow
    1000.6931471805599
    >>> float(logsumexp(np.array([-np.inf, -np.inf])))
    -inf
    """
    xp = namespace_of({"x": x})
    check_floating("x", x, xp)
    if x.ndim == 0:
        raise ValueError("`x` must have at least one dimension; got a 0-d array")
    axis = _check_axis(axis, x.ndim)
    check_bool("keepdims", keepdims)
    if _is_empty(x):  # a sum over no terms is 0, its log -inf
        shape = tuple(1 if i == axis % x.ndim else n for i, n in enumerate(x.shape))
        if not keepdims:
            shape = shape[:axis % x.ndim] + shape[axis % x.ndim + 1:]
        return xp.full(shape, NEG_INF, dtype=x.dtype, device=device_of(x))
    with quiet_floating_point(x):
        xc = xp.astype(x, _compute_dtype(x, xp))
        m = stable_shift(xp.max(xc, axis=axis, keepdims=True), xp)
        total = xp.sum(xp.exp(xc - m), axis=axis, keepdims=True)
        out = log_of_sum(total, m, xp)                  # -inf for all -inf, NaN for NaN
        # a +inf entry makes the sum +inf (inf - inf gave NaN above); a NaN keeps it NaN
        has_nan = xp.any(xp.isnan(xc), axis=axis, keepdims=True)
        out = xp.where((m == float("inf")) & ~has_nan, xp.full_like(out, float("inf")), out)
        if not keepdims:
            out = xp.squeeze(out, axis=axis)
        return xp.astype(out, x.dtype)

