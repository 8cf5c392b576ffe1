"""The scores of one tile of the NumPy path, in the order of docs/semantics.rst.

:func:`_scores` computes ``[q·scale | -m] @ [k | 1]ᵀ`` for a (rows, keys)
rectangle of a work item and applies soft-capping, ALiBi and a float mask in
place; :func:`_hide` sets the entries a boolean mask, a causal mask or a window
hides; :func:`_dropout_factor` gives dropout's ``keep / (1 - p)`` from the
Philox counters of :mod:`polyattn.rules.dropout`. Used by :mod:`.forward` and
:mod:`.backward` alike.
"""

from __future__ import annotations

import numpy as np

from polyattn.backends.numpy.plan import _flat, _Item, _Problem
from polyattn.rules.dropout import MASK32, philox_numpy, threshold


def _scores(p: _Problem, it: _Item, qe: np.ndarray, ke: np.ndarray, m: np.ndarray, r0: int,
            r1: int, k0: int, k1: int, s: np.ndarray, *, hide: bool = True,
            tanh: np.ndarray | None = None) -> None:
    """The scores of rows r0:r1 of item ``it`` and keys k0:k1, shifted by ``-m``, into ``s``.

    ``qe`` (G, r1 - r0, E + 1) holds the scaled queries and, without soft-capping,
    the column ``-m``; ``m`` (G, r1 - r0); ``s`` (G, r1 - r0, k1 - k0). In the
    order of docs/semantics.rst: ``[q·scale | -m] @ [k | 1]ᵀ`` (with soft-capping the
    product has a 0 column, the cap applies, then ``m`` is subtracted), ALiBi's ``-slope·|p - j|``,
    the float mask. Hidden entries (boolean mask, key lengths, causal, window) are
    -inf, or left as they are with ``hide=False`` (for :func:`_hide` to zero after
    the exponential). With soft-capping, ``tanh`` (shaped as ``s``), where given,
    receives ``tanh(scale·q·k / c)`` (for the cap's derivative).
    """
    if qe.flags.c_contiguous:
        np.matmul(_flat(qe), ke[k0:k1].T, out=_flat(s))  # (G·r, bk)
    else:
        np.matmul(qe, ke[k0:k1].T, out=s)                # (G, r, bk), one product per head
    if p.softcap is not None:                            # c·tanh(s / c) - m
        np.divide(s, p.softcap, out=s)
        np.tanh(s, out=s)
        if tanh is not None:
            np.copyto(tanh, s)
        np.multiply(s, p.softcap, out=s)
        np.subtract(s, m[..., None], out=s)
    if it.neg_slopes is not None:                        # - slope_h·|p_i - j|
        dist = p.buffer("dist", (r1 - r0, k1 - k0))
        np.subtract(it.pos[r0:r1, None].astype(p.dtype), np.arange(k0, k1, dtype=p.dtype),
                    out=dist)
        np.abs(dist, out=dist)
        bias = p.buffer("bias", s.shape)
        np.multiply(it.neg_slopes, dist, out=bias)       # (G, r, bk)
        s += bias
    mb = p.mask_block(it.b, it.hk, it.q0 + r0, it.q0 + r1, k0, k1)
    if mb is not None and mb.dtype != np.bool_:
        s += mb
    if hide:
        _hide(p, it, s, r0, r1, k0, k1, -np.inf)


def _hide(p: _Problem, it: _Item, s: np.ndarray, r0: int, r1: int, k0: int, k1: int,
          value: float) -> None:
    """Set the entries of ``s`` hidden by a boolean mask, a causal mask or a window to ``value``.

    The cheap path exponentiates first and then writes 0 here: NumPy's float64
    ``exp`` takes a slow path for -inf (about 3× the time per element), and an
    entry overwritten afterwards cannot leak, whatever the exponential made of it.
    Key lengths need nothing here: no tile reaches past them (:func:`_band_tiles`).
    """
    mb = p.mask_block(it.b, it.hk, it.q0 + r0, it.q0 + r1, k0, k1)
    if mb is not None and mb.dtype == np.bool_:
        np.copyto(s, value, where=~mb)
    if not p.banded:
        return
    w = k1 - k0
    # rows whose visible keys end inside the block: a leading run of the tile's rows, row
    # r0 + t seeing columns c < hi[r0] - k0 + t (the edge moves one key per row)
    rh = min(r1, int(np.searchsorted(it.hi, k1, side="left")))
    if rh > r0:
        c = int(it.hi[r0]) - k0
        right, _ = p.edges(rh - r0, w - c)
        np.copyto(s[:, :rh - r0, c:], value, where=right)
    # rows whose visible keys start inside the block: a trailing run, row rl + t seeing
    # columns c >= lo[rl] - k0 + t; the first lo[rl] - k0 columns are hidden from all of them
    rl = max(r0, int(np.searchsorted(it.lo, k0, side="right")))
    if r1 > rl:
        d = int(it.lo[rl]) - k0
        n = r1 - rl
        s[:, rl - r0:, :d] = value
        _, left = p.edges(n, n - 1)
        np.copyto(s[:, rl - r0:, d:d + n - 1], value, where=left)


def _dropout_keep(p: _Problem, it: _Item, r0: int, r1: int, k0: int, k1: int) -> np.ndarray:
    """Bool (G, r1 - r0, k1 - k0): the weights of rows r0:r1 of ``it`` and keys k0:k1 kept.

    Weight (b, h, i, j) has the flat index ``n = ((b·H + h)·Tq + i)·Tk + j`` in
    (B…, H, Tq, Tk), with ``b`` the flat index of the batch row and ``h = hk·G + g``;
    it is kept iff the first Philox word of the counter ``(n mod 2³², n div 2³², 0, 0)``
    is at least ``threshold(dropout_p)`` (:mod:`polyattn.rules.dropout`).
    """
    u = np.uint64
    b = int(np.ravel_multi_index(it.b, p.batch)) if p.batch else 0
    heads = np.arange(it.hk * p.g, (it.hk + 1) * p.g, dtype=u)[:, None, None]  # (G, 1, 1)
    rows = np.arange(it.q0 + r0, it.q0 + r1, dtype=u)[:, None]                 # (r, 1)
    n: np.ndarray = ((u(b * p.h) + heads) * u(p.tq) + rows) * u(p.tk) + np.arange(k0, k1, dtype=u)
    x0 = philox_numpy(n & u(MASK32), n >> u(32), 0, 0, p.rules.dropout_seed)[0]  # (G, r, bk)
    return x0 >= u(threshold(p.rules.dropout_p))


def _dropout_factor(p: _Problem, it: _Item, r0: int, r1: int, k0: int, k1: int,
                    z: np.ndarray) -> np.ndarray:
    """``keep / (1 - p)`` of a tile (:func:`_dropout_keep`) written into ``z`` (G, r, bk)."""
    z.fill(0.0)
    np.copyto(z, p.dtype.type(p.rules.dropout_scale), where=_dropout_keep(p, it, r0, r1, k0, k1))
    return z
