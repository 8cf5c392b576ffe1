"""Masks: the causal mask, padding masks, and the normalisation of ``attn_mask``.

Convention (as torch SDPA, JAX and Keras): a boolean mask is **True where a
query may attend** to a key. A floating mask is added to the scaled scores,
so ``-inf`` forbids and finite values bias.
"""

from __future__ import annotations

from typing import Any

from polyattn._interop import Array, Namespace, device_of, library_name, namespace_of, resolve_xp
from polyattn._validation import (
    ALIGNMENTS,
    check_broadcastable_to,
    check_choice,
    check_nonnegative_int,
    floats_text,
    is_supported_float,
    shape_str,
)


def causal_offset(tq: int, tk: int, alignment: str) -> int:
    """The ``d`` of "key j is visible to query i iff j <= i + d"."""
    return 0 if alignment == "top_left" else tk - tq


def causal_mask(tq: int, tk: int, /, *, alignment: str = "top_left", xp: Namespace = None,
                device: Any = None) -> Array:
    """Boolean (tq, tk) causal mask, True where query i may attend to key j.

    Parameters
    ----------
    tq, tk : int
        Numbers of queries and keys.
    alignment : {"top_left", "bottom_right"}
        ``"top_left"``: query i sees keys ``j <= i`` (torch's ``is_causal``).
        ``"bottom_right"``: query i sees keys ``j <= i + (tk - tq)``, so the
        last query sees every key (FlashAttention; KV-cache decoding).
    xp : namespace, optional
        Array library of the result (default NumPy).
    device : optional
        Device of the result.

    Examples
    --------
    >>> from polyattn import causal_mask
    >>> causal_mask(2, 4).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0]])
    >>> causal_mask(2, 4, alignment="bottom_right").astype(int)
    array([[1, 1, 1, 0],
           [1, 1, 1, 1]])
    """
    tq = check_nonnegative_int("tq", tq)
    tk = check_nonnegative_int("tk", tk)
    alignment = check_choice("alignment", alignment, ALIGNMENTS)
    xp = resolve_xp(xp)
    i = xp.arange(tq, device=device)
    j = xp.arange(tk, device=device)
    return j[None, :] <= i[:, None] + causal_offset(tq, tk, alignment)  # (tq, tk)


def padding_mask(lengths: Array, max_length: int, /) -> Array:
    """Boolean (B, 1, 1, max_length) key mask from the valid length of each sequence.

    True for the first ``lengths[b]`` keys of sequence ``b``: pass it as
    ``attn_mask`` to ignore padding at the end of shorter sequences.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.masks import padding_mask
    >>> padding_mask(np.array([2, 3]), 3)[:, 0, 0, :].astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    xp = namespace_of({"lengths": lengths})
    if lengths.ndim != 1 or not xp.isdtype(lengths.dtype, "integral"):
        raise ValueError(
            f"`lengths` must be a 1-d integer array; got shape {shape_str(lengths)} "
            f"and dtype {lengths.dtype}"
        )
    max_length = check_nonnegative_int("max_length", max_length)
    j = xp.arange(max_length, device=device_of(lengths))
    keep = j[None, :] < lengths[:, None]               # (B, Tk)
    return keep[:, None, None, :]                      # (B, 1, 1, Tk)


def normalise_mask(attn_mask: Array | None, target: tuple[int, ...], compute_dtype: Any,
                   xp: Namespace) -> Array | None:
    """Check ``attn_mask`` against (B…, H, Tq, Tk) and bring it to the implementations' form.

    The result has ``len(target)`` dimensions, each 1 or the target size
    (no broadcast copy is made), and is bool or ``compute_dtype``.
    """
    if attn_mask is None:
        return None
    if attn_mask.dtype != xp.bool and not is_supported_float(attn_mask.dtype, xp):
        floating = xp.isdtype(attn_mask.dtype, "real floating")
        raise TypeError(
            f"`attn_mask` must be boolean (True = attend) or real floating (added to the "
            f"scores); got dtype {attn_mask.dtype} ({library_name(xp)} array of shape "
            f"{shape_str(attn_mask)})"
            + (f"; no implementation adds {attn_mask.dtype} at its own precision: cast the "
               f"mask to one of {floats_text(xp)}" if floating else "")
        )
    check_broadcastable_to("attn_mask", attn_mask, target, "the scores' shape (B…, H, Tq, Tk) =")
    missing = len(target) - attn_mask.ndim
    mask = attn_mask
    if missing:
        mask = xp.reshape(mask, (1,) * missing + tuple(mask.shape))
    if mask.dtype != xp.bool and mask.dtype != compute_dtype:
        mask = xp.astype(mask, compute_dtype)
    return mask
