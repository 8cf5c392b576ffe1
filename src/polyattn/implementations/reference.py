"""The reference implementation: the formula as written, scores materialised.

``softmax(Q Kᵀ · scale + mask) V`` (with the soft-capping, ALiBi and
visibility rules of :mod:`._rules`) with the whole (B…, H, Tq, Tk) score
matrix in memory. It is the clearest code and the fastest choice while the
scores are small; :mod:`.chunked` takes over when they are not.
"""

from __future__ import annotations

from typing import Any

from ._common import (
    group_heads,
    log_of_sum,
    safe_divide,
    stable_shift,
    ungroup_heads,
)
from ._rules import Rules, drop_padding, score_transform

Array = Any


def _masked_scores(q: Array, k: Array, mask: Array | None, rules: Rules, scale: float,
                   xp: Any) -> Array:
    """The scores that enter the softmax, in the grouped layout (B…, Hkv, G, Tq, Tk)."""
    hkv, tq, tk = k.shape[-3], q.shape[-2], k.shape[-2]
    qg = group_heads(q, hkv, xp)                     # (B…, Hkv, G, Tq, E)
    kg = xp.expand_dims(k, axis=-3)                  # (B…, Hkv, 1, Tk, E)
    s = xp.matmul(qg, xp.matrix_transpose(kg)) * scale  # (B…, Hkv, G, Tq, Tk)
    maskg = None if mask is None else group_heads(mask, hkv, xp)
    return score_transform(s, rules, maskg, 0, tq, 0, tk, xp)


def _normalised(s: Array, xp: Any) -> tuple[Array, Array]:
    """Row-wise softmax of ``s`` and its log-sum-exp (fully masked rows: 0, -inf)."""
    m = stable_shift(xp.max(s, axis=-1, keepdims=True), xp)
    p = xp.exp(s - m)
    l = xp.sum(p, axis=-1, keepdims=True)
    weights = safe_divide(p, l, xp)
    lse = log_of_sum(l, m, xp)[..., 0]
    return weights, lse


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None,
              causal_offset: int | None, scale: float, xp: Any,
              rules: Rules | None = None) -> tuple[Array, Array]:
    """Attention by the formula; see :mod:`polyattn.implementations` for the contract."""
    rules = rules or Rules.from_causal_offset(causal_offset, q.shape[-2], k.shape[-2])
    k, v = drop_padding(k, rules, xp), drop_padding(v, rules, xp)
    s = _masked_scores(q, k, mask, rules, scale, xp)
    weights, lse = _normalised(s, xp)                # (B…, Hkv, G, Tq, Tk)
    vg = xp.expand_dims(v, axis=-3)                  # (B…, Hkv, 1, Tk, Ev)
    out = xp.matmul(weights, vg)                     # (B…, Hkv, G, Tq, Ev)
    lse = xp.expand_dims(lse, axis=-1)               # (B…, Hkv, G, Tq, 1)
    return ungroup_heads(out, xp), ungroup_heads(lse, xp)[..., 0]


def weights(q: Array, k: Array, /, *, mask: Array | None, causal_offset: int | None,
            scale: float, xp: Any, rules: Rules | None = None) -> Array:
    """The attention weights α (B…, H, Tq, Tk); rows sum to 1, fully masked rows to 0."""
    rules = rules or Rules.from_causal_offset(causal_offset, q.shape[-2], k.shape[-2])
    s = _masked_scores(q, drop_padding(k, rules, xp), mask, rules, scale, xp)
    alpha, _ = _normalised(s, xp)
    return ungroup_heads(alpha, xp)
