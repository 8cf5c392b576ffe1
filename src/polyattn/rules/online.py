"""Small numerical helpers shared by the Array-API implementations."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from polyattn._interop import array_library

Array = Any
NEG_INF = -math.inf

#: Libraries whose arithmetic runs through NumPy, which warns on floating-point exceptions.
NUMPY_BACKED = ("numpy", "array_api_strict", "dask")


def quiet_floating_point(x: object) -> contextlib.AbstractContextManager[Any]:
    """``np.errstate(all="ignore")`` where ``x`` is an array of a library that computes
    through NumPy (NumPy, array-api-strict, Dask); a context that does nothing elsewhere.

    No floating-point warning escapes a call (docs/semantics.rst): NaN and inf in the
    results say what happened. Decided from the type's module, so ``torch.compile``
    traces straight through (``np.errstate`` would break its graph). NumPy's
    error state belongs to one thread: code run on worker threads sets its own.
    """
    if array_library(x) in NUMPY_BACKED:
        import numpy as np

        return np.errstate(all="ignore")
    return contextlib.nullcontext()


def non_finite_rows(q: Array, xp: Any) -> Array:
    """(…, T, 1): 0 where row ``q[…, t, :]`` is finite, NaN where it holds a NaN or an inf.

    Added to a result row it keeps a non-finite query from disappearing
    (docs/semantics.rst, "Non-finite inputs"), whatever the implementation did with
    it: a fused kernel that reports such a row as fully masked (0), or a row whose
    scores all became ``-inf``.
    It adds exactly 0 elsewhere, so results and gradients (``0·grad``) are
    unchanged. ``0·q`` before the sum, so that large finite rows cannot overflow.
    """
    return xp.sum(q * 0.0, axis=-1, keepdims=True)


def stable_shift(m: Array, xp: Any) -> Array:
    """The row maximum, with ``-inf`` (an all ``-inf`` row) replaced by 0.

    Shifting a fully masked row by 0 instead of ``-inf`` turns its
    ``exp(-inf - (-inf)) = NaN`` into ``exp(-inf) = 0``.
    """
    return xp.where(m == NEG_INF, 0.0, m)


def log_of_sum(total: Array, m: Array, xp: Any) -> Array:
    """``m + log(total)``, and ``-inf`` where ``total`` is 0 (without a warning).

    A NaN ``total`` (from a NaN input) gives NaN.
    """
    empty = total == 0
    return xp.where(empty, NEG_INF, m + xp.log(xp.where(empty, 1.0, total)))


def safe_divide(num: Array, den: Array, xp: Any) -> Array:
    """``num / den`` with 0 where ``den`` is 0 (fully masked rows give 0; NaN stays NaN)."""
    empty = den == 0
    return xp.where(empty, 0.0, num / xp.where(empty, 1.0, den))


def group_heads(x: Array, hkv: int, xp: Any) -> Array:
    """Split the head axis (-3) into (Hkv, G): (B…, H, T, F) -> (B…, Hkv, G, T, F).

    A head axis of size 1 (a mask broadcast over heads) becomes (1, 1).
    """
    *batch, h, t, f = x.shape
    if h == 1:
        return xp.reshape(x, (*batch, 1, 1, t, f))
    return xp.reshape(x, (*batch, hkv, h // hkv, t, f))  # (B…, Hkv, G, T, F)


def ungroup_heads(x: Array, xp: Any) -> Array:
    """Merge (Hkv, G) back into one head axis: (B…, Hkv, G, T, F) -> (B…, H, T, F)."""
    *batch, hkv, g, t, f = x.shape
    return xp.reshape(x, (*batch, hkv * g, t, f))  # (B…, H, T, F)
