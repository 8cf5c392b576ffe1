"""The scores of one tile of the NumPy path, in the order of docs/semantics.rst.

:func:`_scores` computes ``[q·scale | -m] @ [k | 1]ᵀ`` for a (rows, keys)
rectangle of a work item and applies soft-capping, ALiBi, a ``score_mod``
(:mod:`.tile_rules`) and a float mask (and, for the backward pass, the derivative of
what it applied); :func:`_shift_column` fills the queries' extra column ``-m`` where
the shift can ride in the product; :func:`_hide` sets the entries a boolean mask hides,
those outside the visible band (:func:`.plan._hide_band`: causal mask, window, sorted
segment ids), those of other segments (unsorted ids) and those a ``mask_mod`` hides;
:func:`_dropout_factor` gives dropout's ``keep / (1 - p)`` from the Philox
counters of :mod:`polyattn.rules.dropout`. Used by :mod:`.forward` and
:mod:`.backward` alike.
"""

from __future__ import annotations

import numpy as np

from polyattn.backends.numpy.plan import _flat, _hide_band, _Item, _Problem
from polyattn.backends.numpy.tile_rules import hide_other_segments
from polyattn.rules.dropout import MASK32, philox_numpy, threshold


def _shift_column(p: _Problem, m: np.ndarray, column: np.ndarray) -> None:
    """Fill ``column`` (the extended queries' last column, shaped as ``m``) with ``-m``.

    The product ``[q·scale | -m] @ [k | 1]ᵀ`` then delivers the scores already shifted.
    Soft-capping ``c·tanh(s/c)`` and a ``score_mod`` cannot take the shift inside the
    product: with them the column is 0 and :func:`_scores` subtracts ``m`` after the cap,
    or from what the ``score_mod`` returns.
    """
    if p.shift_in_product:
        np.negative(m, out=column)
    else:
        column[...] = 0.0


def _scores(p: _Problem, it: _Item, qe: np.ndarray, ke: np.ndarray, m: np.ndarray, r0: int,
            r1: int, k0: int, k1: int, s: np.ndarray, *, hide: bool = True,
            grad: bool = False) -> np.ndarray | None:
    """The scores of rows r0:r1 of item ``it`` and keys k0:k1, shifted by ``-m``, into ``s``.

    ``qe`` (G, r1 - r0, E + 1) holds the scaled queries and the column of
    :func:`_shift_column`; ``m`` (G, r1 - r0); ``s`` (G, r1 - r0, k1 - k0). In the
    order of docs/semantics.rst: ``[q·scale | -m] @ [k | 1]ᵀ`` (with soft-capping the
    product has a 0 column, the cap applies, then ``m`` is subtracted), ALiBi's
    ``-slope·|p - j|``, the ``score_mod`` (with one, the product has a 0 column and ``m``
    is subtracted from what it returns), the float mask. Hidden entries (boolean mask,
    key lengths, causal, window, segments, ``mask_mod``) are -inf, or left as they are
    with ``hide=False`` (for :func:`_hide` to zero after the exponential). With ``grad``,
    returns the derivative of the scores that enter the softmax by the scaled scores
    ``scale·q·k`` (G, r1 - r0, k1 - k0), for the backward pass: soft-capping's
    ``1 - tanh²(scale·q·k / c)`` times the ``score_mod``'s derivative, or ``None`` where
    it is 1 (ALiBi and masks add constants).
    """
    if qe.flags.c_contiguous:
        np.matmul(_flat(qe), ke[k0:k1].T, out=_flat(s))  # (G·r, bk)
    else:
        np.matmul(qe, ke[k0:k1].T, out=s)                # (G, r, bk), one product per head
    derivative = None
    if p.rules.softcap is not None:                      # c·tanh(s / c) - m
        cap = p.dtype.type(p.rules.softcap)
        np.divide(s, cap, out=s)
        np.tanh(s, out=s)
        if grad:                                         # 1 - tanh²
            derivative = p.buffer("grad", s.shape)
            np.multiply(s, s, out=derivative)
            np.subtract(1.0, derivative, out=derivative)
        np.multiply(s, cap, out=s)
        if not p.score_mod:
            np.subtract(s, m[..., None], out=s)
    if it.neg_slopes is not None:                        # - slope_h·|p_i - j|
        dist = p.buffer("dist", (r1 - r0, k1 - k0))
        np.subtract(it.pos[r0:r1, None].astype(p.dtype), np.arange(k0, k1, dtype=p.dtype),
                    out=dist)
        np.abs(dist, out=dist)
        bias = p.buffer("bias", s.shape)
        np.multiply(it.neg_slopes, dist, out=bias)       # (G, r, bk)
        s += bias
    if p.score_mod:                                      # score_mod(s) - m
        assert p.user is not None
        q0 = it.q0
        value, d = p.user.score(s, it.b, it.hk, q0 + r0, q0 + r1, k0, k1, grad=grad)
        if d is not None:
            if derivative is None:
                derivative = d
            else:
                np.multiply(derivative, d, out=derivative)
        np.subtract(value, m[..., None], out=s)
    mb = p.mask_block(it.b, it.hk, it.q0 + r0, it.q0 + r1, k0, k1)
    if mb is not None and mb.dtype != np.bool_:
        s += mb
    if hide:
        _hide(p, it, s, r0, r1, k0, k1, -np.inf)
    return derivative


def _hide(p: _Problem, it: _Item, s: np.ndarray, r0: int, r1: int, k0: int, k1: int,
          value: float) -> None:
    """Set the entries of ``s`` hidden by a boolean mask, a causal mask, a window, segment
    ids or a ``mask_mod`` to ``value``.

    The cheap path exponentiates first and then writes 0 here: NumPy's float64
    ``exp`` takes a slow path for -inf (about 3× the time per element), and an
    entry overwritten afterwards cannot leak, whatever the exponential made of it.
    The causal mask and the window are the visible band's edges (:func:`.plan._hide_band`);
    key lengths need nothing here: no tile reaches past them (:func:`.plan._band_tiles`).
    Unsorted segment ids and a ``mask_mod`` (per tile of its block mask) are
    :mod:`.tile_rules`'.
    """
    mb = p.mask_block(it.b, it.hk, it.q0 + r0, it.q0 + r1, k0, k1)
    if mb is not None and mb.dtype == np.bool_:
        np.copyto(s, value, where=~mb)
    _hide_band(p, it, s, r0, r1, k0, k1, value)
    if p.segment_ids is not None:
        hide_other_segments(p.segment_ids, s, it.b, it.q0 + r0, it.q0 + r1, k0, k1, value)
    if p.user is not None and p.user.masks:
        p.user.hide(s, it.b, it.hk, it.q0 + r0, it.q0 + r1, k0, k1, value)


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
