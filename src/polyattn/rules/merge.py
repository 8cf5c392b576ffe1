"""The log-sum-exp merge of attention over disjoint key sets (arithmetic only).

``lse = log Σ_i exp(lse_i)`` and ``out = Σ_i exp(lse_i - lse) · out_i``: the
exact result over the union of the keys. The public
:func:`polyattn.merge_attention` validates its arguments and calls
:func:`merge`; the distributed plan merges partial results with it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyattn.rules.online import log_of_sum, safe_divide, stable_shift

Array = Any


def merge(outs: Sequence[Array], lses: Sequence[Array], xp: Any) -> tuple[Array, Array]:
    """(out, lse) over all parts; outs (B…, H, Tq, Ev), lses (B…, H, Tq), at least one part.

    Rows that saw no key in any part are 0 with lse ``-inf``; a part whose rows
    saw no key contributes 0 even if its out is not finite; a NaN lse propagates.
    The weights are computed in the lses' dtype, the sum in the promoted dtype of
    outputs and weights, cast back to the outputs' dtype.
    """
    out_dtype = xp.result_type(*outs)
    lse_dtype = xp.result_type(*lses)
    # --- lse = m + log Σ exp(lse_i - m), with m the largest part (0 where all are -inf)
    stacked = xp.stack([xp.astype(s, lse_dtype) for s in lses], axis=0)  # (P, B…, H, Tq)
    m = stable_shift(xp.max(stacked, axis=0), xp)                         # (B…, H, Tq)
    w = xp.exp(stacked - m)                                               # (P, B…, H, Tq)
    total = xp.sum(w, axis=0)
    lse = log_of_sum(total, m, xp)
    # --- weights exp(lse_i - lse) = w_i / Σ w; 0 for rows with no key anywhere
    scale = safe_divide(w, total, xp)                                    # (P, B…, H, Tq)
    acc_dtype = xp.result_type(out_dtype, lse_dtype)
    out = None
    for i, o in enumerate(outs):
        part = xp.astype(o, acc_dtype) * xp.astype(scale[i, ...], acc_dtype)[..., None]
        # a part whose rows saw no key (weight 0) contributes 0, even if its out is not finite
        # (a NaN weight, from a NaN input, propagates)
        part = xp.where(scale[i, ...][..., None] != 0, part, 0.0)
        out = part if out is None else out + part
    assert out is not None
    if out.dtype != out_dtype:
        out = xp.astype(out, out_dtype)
    return out, lse
