"""Positional encodings: sinusoidal (Vaswani et al. 2017) and ALiBi slopes (Press et al. 2022).

``PE[pos, 2i] = sin(pos / base^(2i/d_model))`` and
``PE[pos, 2i+1] = cos(pos / base^(2i/d_model))``: each pair of features is a
rotation at its own frequency, from one turn per ``2π`` positions down to one
per ``2π·base``, so nearby positions have similar encodings and the encoding
of ``pos + k`` is a fixed linear function of that of ``pos``.

ALiBi adds no encoding to the tokens: head ``h`` subtracts
``slope_h · |p_i - j|`` from its scores, and :func:`alibi_slopes` gives the
paper's slopes for
:func:`~polyattn.scaled_dot_product_attention`'s ``alibi_slopes``. The
rotary embedding is in :mod:`polyattn.rotary`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from polyattn._interop import Array, Namespace, default_float_dtype, resolve_xp
from polyattn._validation import check_float_dtype, check_nonnegative_int


def sinusoidal_positional_encoding(num_positions: int, d_model: int, /, *, base: float = 10000.0,
                                   offset: int = 0, xp: Namespace = None, dtype: Any = None,
                                   device: Any = None) -> Array:
    """The (num_positions, d_model) sinusoidal positional encoding.

    Parameters
    ----------
    num_positions : int
        Number of positions (rows), at least 0.
    d_model : int
        Number of features, at least 1. An odd ``d_model`` ends with a sine.
    base : float
        The wavelength base (10000 in the original Transformer).
    offset : int
        First position: row ``r`` encodes position ``offset + r`` (for
        continuing a sequence, e.g. with a KV cache).
    xp : namespace, optional
        Array library of the result (default NumPy).
    dtype : optional
        Real floating dtype of the result (default: the library's default).
        The angles are computed in float64 where the library has it.
    device : optional
        Device of the result.

    Examples
    --------
    >>> from polyattn import sinusoidal_positional_encoding
    >>> pe = sinusoidal_positional_encoding(3, 4)
    >>> pe.shape
    (3, 4)
    >>> pe[0]  # position 0: sin(0) = 0, cos(0) = 1
    array([0., 1., 0., 1.])
    >>> pe[1].round(4)
    array([0.8415, 0.5403, 0.01  , 1.    ])
    """
    n = check_nonnegative_int("num_positions", num_positions)
    d = check_nonnegative_int("d_model", d_model, minimum=1)
    offset = check_nonnegative_int("offset", offset)
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"`base` must be a real number; got {base!r}")
    if not 0 < base < math.inf:
        raise ValueError(f"`base` must be a positive finite number; got {base!r}")
    xp = resolve_xp(xp)
    dtype = _float_dtype(xp, dtype, device)
    work = _working_dtype(xp, dtype, device)
    half = (d + 1) // 2
    pos = xp.arange(offset, offset + n, dtype=work, device=device)          # (n,)
    two_i = xp.arange(0, 2 * half, 2, dtype=work, device=device)           # (half,)
    inv_freq = xp.exp(two_i * (-math.log(float(base)) / d))                 # base^(-2i/d)
    angles = pos[:, None] * inv_freq[None, :]                               # (n, half)
    pe = xp.stack([xp.sin(angles), xp.cos(angles)], axis=-1)                # (n, half, 2)
    pe = xp.reshape(pe, (n, 2 * half))[:, :d]                               # (n, d)
    return xp.astype(pe, dtype)


def _working_dtype(xp: Namespace, dtype: Any, device: Any) -> Any:
    """float64 where the library offers it on ``device``, else float32 (or ``dtype``)."""
    try:
        available = xp.__array_namespace_info__().dtypes(device=device, kind="real floating")
    except Exception:  # pragma: no cover - namespaces without the inspection API
        available = {}
    if "float64" in available:
        return xp.float64
    return dtype if dtype == xp.float64 else xp.float32  # pragma: no cover


def alibi_slopes(num_heads: int, /, *, xp: Namespace = None, dtype: Any = None,
                 device: Any = None) -> Array:
    """The ALiBi paper's head slopes, (num_heads,).

    For ``n`` heads, ``n`` a power of two, the slopes are the geometric
    sequence ``2^(-8/n), 2^(-16/n), …, 2^(-8)``. For other ``n`` the paper's
    rule (its reference ``get_slopes``): the slopes of ``n'``, the largest
    power of two below ``n``, followed by the first ``n - n'`` of every
    other slope of ``2n'``. Pass the result as ``alibi_slopes`` to
    :func:`~polyattn.scaled_dot_product_attention` or
    :func:`~polyattn.multi_head_attention`, which subtract
    ``slope_h · |p_i - j|`` from the scores of head ``h``.

    Parameters
    ----------
    num_heads : int
        Number of query heads, at least 1.
    xp : namespace, optional
        Array library of the result (default NumPy).
    dtype : optional
        Real floating dtype (default: the library's default).
    device : optional
        Device of the result.

    Examples
    --------
    >>> from polyattn import alibi_slopes
    >>> alibi_slopes(8)  # 1/2, 1/4, ..., 1/256
    array([0.5       , 0.25      , 0.125     , 0.0625    , 0.03125   ,
           0.015625  , 0.0078125 , 0.00390625])
    >>> alibi_slopes(6).round(4)  # the 4 of n' = 4 heads, then 2 of the 8-head ones
    array([0.25  , 0.0625, 0.0156, 0.0039, 0.5   , 0.125 ])
    """
    n = check_nonnegative_int("num_heads", num_heads, minimum=1)
    xp = resolve_xp(xp)
    dtype = _float_dtype(xp, dtype, device)
    return xp.asarray(_alibi_slope_values(n), dtype=dtype, device=device)


def _alibi_slope_values(n: int) -> list[float]:
    """The slopes as Python floats (powers of two computed exactly where they are exact)."""
    def powers_of_two(m: int) -> list[float]:                # m a power of two
        return [2.0 ** (-8.0 * (i + 1) / m) for i in range(m)]

    below = 1 << (n.bit_length() - 1)                         # largest power of two <= n
    if below == n:
        return powers_of_two(n)
    return powers_of_two(below) + powers_of_two(2 * below)[0::2][: n - below]


def _float_dtype(xp: Namespace, dtype: Any, device: Any) -> Any:
    """``dtype`` checked to be one of the floating dtypes polyattn computes with, or the
    library's default floating dtype."""
    if dtype is None:
        return default_float_dtype(xp, device)
    return check_float_dtype("dtype", dtype, xp)
