"""Sinusoidal positional encoding (Vaswani et al. 2017).

``PE[pos, 2i] = sin(pos / base^(2i/d_model))`` and
``PE[pos, 2i+1] = cos(pos / base^(2i/d_model))``: each pair of features is a
rotation at its own frequency, from one turn per ``2π`` positions down to one
per ``2π·base``, so nearby positions have similar encodings and the encoding
of ``pos + k`` is a fixed linear function of that of ``pos``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ._compat import Array, Namespace, default_float_dtype, resolve_xp
from ._validation import check_nonnegative_int


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
    if dtype is None:
        dtype = default_float_dtype(xp, device)
    elif not xp.isdtype(dtype, "real floating"):
        raise TypeError(f"`dtype` must be a real floating dtype; got {dtype}")
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
