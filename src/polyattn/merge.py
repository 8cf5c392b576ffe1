"""Merging attention computed over disjoint sets of keys.

If the keys of a problem are split into parts and attention is computed on
each part with ``return_lse=True``, the parts combine into the exact result:

``lse = log Σ_i exp(lse_i)`` and ``out = Σ_i exp(lse_i - lse) · out_i``.

This is what lets a long key sequence be processed piece by piece, on
several devices, or spread over a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

from polyattn._interop import Array, check_same_device, namespace_of
from polyattn._problem import swap_heads_and_time
from polyattn._validation import LAYOUTS, check_choice, check_floating, check_min_ndim, shape_str
from polyattn.rules.merge import merge
from polyattn.rules.online import quiet_floating_point

__all__ = ["merge_attention"]


def _check(outs: Sequence[Array], lses: Sequence[Array]) -> None:
    """Validate the parts: counts, namespaces, devices, dtypes and shapes."""
    if isinstance(outs, (str, bytes)) or not isinstance(outs, Sequence):
        raise TypeError(f"`outs` must be a sequence of arrays; got {type(outs).__name__}")
    if isinstance(lses, (str, bytes)) or not isinstance(lses, Sequence):
        raise TypeError(f"`lses` must be a sequence of arrays; got {type(lses).__name__}")
    if len(outs) == 0:
        raise ValueError("`outs` must hold at least one part; got an empty sequence")
    if len(outs) != len(lses):
        raise ValueError(f"`outs` has {len(outs)} parts but `lses` has {len(lses)}; "
                         "give one lse per output")
    named = {f"outs[{i}]": o for i, o in enumerate(outs)}
    named.update({f"lses[{i}]": s for i, s in enumerate(lses)})
    xp = namespace_of(named)
    check_same_device(named)
    for name, x in named.items():
        check_floating(name, x, xp)
    first = outs[0]
    if first.ndim < 1:
        raise ValueError(f"`outs[0]` must have shape (B…, H, Tq, Ev); got {shape_str(first)}")
    for i, (o, s) in enumerate(zip(outs, lses, strict=True)):
        if tuple(o.shape) != tuple(first.shape):
            raise ValueError(
                f"`outs[{i}]` has shape {shape_str(o)} but `outs[0]` has {shape_str(first)}; "
                "every part must have the same shape (B…, H, Tq, Ev)")
        if tuple(s.shape) != tuple(first.shape[:-1]):
            raise ValueError(
                f"`lses[{i}]` has shape {shape_str(s)} but the outputs have shape "
                f"{shape_str(first)}; each lse must be (B…, H, Tq), the output's shape "
                f"without its last axis, i.e. {tuple(first.shape[:-1])}")


def merge_attention(outs: Sequence[Array], lses: Sequence[Array], /, *,
                    layout: str = "BHTE") -> tuple[Array, Array]:
    """Combine attention over disjoint key sets into the result over all keys.

    Parameters
    ----------
    outs : sequence of arrays (B…, H, Tq, Ev)
        Attention outputs, each computed over one part of the keys (as from
        :func:`scaled_dot_product_attention` with ``return_lse=True``). All
        of one namespace and device, with equal shapes.
    lses : sequence of arrays (B…, H, Tq)
        The matching log-sum-exps; ``-inf`` where a row saw no key of its part.
    layout : {"BHTE", "BTHE"}
        The layout the outputs were computed in: with ``"BTHE"`` they are
        (B…, Tq, H, Ev) and so is the merged output; the lses are (B…, H, Tq)
        in both layouts, as :func:`scaled_dot_product_attention` returns them.

    Returns
    -------
    out : array (B…, H, Tq, Ev)
        ``Σ_i exp(lse_i - lse) · out_i``, dtype of the outputs (promoted).
        Rows that saw no key in any part are 0.
    lse : array (B…, H, Tq)
        ``log Σ_i exp(lse_i)``, dtype of the lses (promoted); ``-inf`` for rows
        that saw no key in any part. Never NaN unless an input is.

    Notes
    -----
    The weights ``exp(lse_i - lse)`` are computed in the lses' dtype (with
    float16 outputs and float32 lses: in float32) and the sum is taken in
    the promoted dtype of outputs and weights, then cast to the outputs'
    dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import merge_attention, scaled_dot_product_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 5, 8))       # (H, Tq, E)
    >>> k = rng.standard_normal((2, 12, 8))      # (H, Tk, E)
    >>> v = rng.standard_normal((2, 12, 4))      # (H, Tk, Ev)
    >>> a = scaled_dot_product_attention(q, k[:, :7], v[:, :7], return_lse=True)
    >>> b = scaled_dot_product_attention(q, k[:, 7:], v[:, 7:], return_lse=True)
    >>> out, lse = merge_attention([a[0], b[0]], [a[1], b[1]])
    >>> full, full_lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, full)) and bool(np.allclose(lse, full_lse))
    True
    """
    layout = check_choice("layout", layout, LAYOUTS)
    parts = isinstance(outs, Sequence) and not isinstance(outs, (str, bytes)) and len(outs) > 0
    with quiet_floating_point(outs[0] if parts else None):
        if layout == "BTHE" and parts:
            xp = namespace_of({f"outs[{i}]": o for i, o in enumerate(outs)})
            for i, o in enumerate(outs):
                check_min_ndim(f"outs[{i}]", o, 3, "(B…, Tq, H, Ev) with layout='BTHE'")
            out, lse = merge_attention([swap_heads_and_time(o, xp) for o in outs], lses)
            return swap_heads_and_time(out, xp), lse
        _check(outs, lses)
        return merge(outs, lses, namespace_of({"outs[0]": outs[0]}))
