"""The heads' layout: projected into heads, swapped, repeated; torch's padding mask.

``_project`` gives the (B…, T, H, F) layout, ``_swap`` turns it into
(B…, H, T, F) and back, ``_repeat_heads`` repeats grouped key/value heads,
and torch's ``key_padding_mask`` becomes an attend mask combined with
``attn_mask``.
"""

from __future__ import annotations

import math

from polyattn._interop import Array, Namespace
from polyattn._validation import floats_text, is_supported_float, shape_str


def _project(x: Array, w: Array, b: Array | None, heads: int, xp: Namespace) -> Array:
    """x (B…, T, in) -> (B…, T, heads, out/heads): the "BTHE" layout, no transpose."""
    y = xp.matmul(x, w)                                       # (B…, T, heads·F)
    if b is not None:
        y = y + b
    *lead, t, f = y.shape
    return xp.reshape(y, (*lead, t, heads, f // heads))        # (B…, T, heads, F)


def _swap(x: Array, xp: Namespace) -> Array:
    """(…, A, B, F) -> (…, B, A, F): between (B…, T, H, F) and (B…, H, T, F)."""
    nd = x.ndim
    return xp.permute_dims(x, (*range(nd - 3), nd - 2, nd - 3, nd - 1))


def _repeat_heads(x: Array, groups: int, xp: Namespace) -> Array:
    """(B…, Hkv, T, F) -> (B…, Hkv·groups, T, F), each head repeated ``groups`` times."""
    *batch, hkv, t, f = x.shape
    x = xp.broadcast_to(xp.expand_dims(x, axis=-3), (*batch, hkv, groups, t, f))
    return xp.reshape(x, (*batch, hkv * groups, t, f))


def _padding_to_attn_mask(key_padding_mask: Array, key: Array, xp: Namespace) -> Array:
    """torch's ``key_padding_mask`` (B…, Tk), True = ignore, as an attend mask (B…, 1, 1, Tk)."""
    kpm = key_padding_mask
    tk = int(key.shape[-2])
    if kpm.ndim < 1 or kpm.shape[-1] != tk:
        raise ValueError(f"`key_padding_mask` must be (B…, Tk) with Tk = {tk} keys; got shape "
                         f"{shape_str(kpm)} (key {shape_str(key)})")
    if kpm.dtype == xp.bool:
        kpm = xp.logical_not(kpm)                              # True = attend
    elif not is_supported_float(kpm.dtype, xp):
        raise TypeError(f"`key_padding_mask` must be boolean (True = ignore the key, as in "
                        f"torch) or real floating ({floats_text(xp)}; added to the scores); "
                        f"got dtype {kpm.dtype}")
    return xp.reshape(kpm, (*kpm.shape[:-1], 1, 1, tk))        # (B…, 1, 1, Tk)


def _combine_masks(attn_mask: Array | None, padding: Array | None, xp: Namespace) -> Array | None:
    """Both masks at once: booleans are and-ed; with a float mask, hidden keys add -inf."""
    if padding is None or attn_mask is None:
        return attn_mask if padding is None else padding
    if attn_mask.dtype == xp.bool and padding.dtype == xp.bool:
        return xp.logical_and(attn_mask, padding)
    if attn_mask.dtype == xp.bool:
        attn_mask, padding = padding, attn_mask
    if padding.dtype == xp.bool:                               # attn_mask is floating here
        return xp.where(padding, attn_mask, -math.inf)
    return attn_mask + padding
