"""The reference implementation: the formula as written, scores materialised.

``softmax(Q Kᵀ · scale + mask) V`` (with the soft-capping, ALiBi and
visibility rules of :mod:`polyattn.rules.visibility`) with the whole (B…, H, Tq, Tk) score
matrix in memory. It is the clearest code and the fastest choice while the
scores are small; :mod:`.blocked` takes over when they are not.
"""

from __future__ import annotations

from typing import Any

from polyattn._interop import device_of
from polyattn.rules.dropout import keep_grouped
from polyattn.rules.online import (
    NEG_INF,
    group_heads,
    log_of_sum,
    non_finite_rows,
    safe_divide,
    stable_shift,
    ungroup_heads,
)
from polyattn.rules.visibility import (
    Rules,
    drop_padding,
    score_transform,
    score_transform_grad,
)

Array = Any


def _masked_scores(q: Array, k: Array, mask: Array | None, rules: Rules, scale: float,
                   xp: Any) -> Array:
    """The scores that enter the softmax, in the grouped layout (B…, Hkv, G, Tq, Tk)."""
    return _scores(q, k, mask, rules, scale, xp)[1]


def _scores(q: Array, k: Array, mask: Array | None, rules: Rules, scale: float,
            xp: Any) -> tuple[Array, Array]:
    """``scale·q·k`` and the scores that enter the softmax, grouped (B…, Hkv, G, Tq, Tk)."""
    hkv, tq, tk = k.shape[-3], q.shape[-2], k.shape[-2]
    qg = group_heads(q, hkv, xp)                     # (B…, Hkv, G, Tq, E)
    kg = xp.expand_dims(k, axis=-3)                  # (B…, Hkv, 1, Tk, E)
    raw = xp.matmul(qg, xp.matrix_transpose(kg)) * scale  # (B…, Hkv, G, Tq, Tk)
    maskg = None if mask is None else group_heads(mask, hkv, xp)
    return raw, score_transform(raw, rules, maskg, 0, tq, 0, tk, xp)


def dropout_factor(rules: Rules, batch: tuple[int, ...], hkv: int, g: int, q0: int, q1: int,
                   k0: int, k1: int, dtype: Any, xp: Any, device: Any) -> Array | None:
    """``keep / (1 - p)`` of a tile, grouped (B…, Hkv, G, bq, bk); ``None`` without dropout."""
    if not rules.dropout:
        return None
    kept = keep_grouped(batch, hkv, g, rules.tq, rules.tk, q0, q1, k0, k1,
                        rules.dropout_seed, rules.dropout_p, xp, device)
    return xp.where(kept, xp.asarray(rules.dropout_scale, dtype=dtype, device=device),
                    xp.asarray(0.0, dtype=dtype, device=device))


def _normalised(s: Array, xp: Any) -> tuple[Array, Array]:
    """Row-wise softmax of ``s`` and its log-sum-exp (fully masked rows: 0, -inf)."""
    m = stable_shift(xp.max(s, axis=-1, keepdims=True), xp)
    p = xp.exp(s - m)
    l = xp.sum(p, axis=-1, keepdims=True)
    weights = safe_divide(p, l, xp)
    lse = log_of_sum(l, m, xp)[..., 0]
    return weights, lse


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None, rules: Rules,
              scale: float, xp: Any) -> tuple[Array, Array]:
    """Attention by the formula; see :mod:`polyattn.backends` for the contract."""
    k, v = drop_padding(k, rules, xp), drop_padding(v, rules, xp)
    s = _masked_scores(q, k, mask, rules, scale, xp)
    weights, lse = _normalised(s, xp)                # (B…, Hkv, G, Tq, Tk)
    weights = _dropped(weights, rules, xp)
    vg = xp.expand_dims(v, axis=-3)                  # (B…, Hkv, 1, Tk, Ev)
    out = xp.matmul(weights, vg)                     # (B…, Hkv, G, Tq, Ev)
    lse = xp.expand_dims(lse, axis=-1)               # (B…, Hkv, G, Tq, 1)
    bad = non_finite_rows(q, xp)                     # a NaN or inf query row stays NaN
    return ungroup_heads(out, xp) + bad, ungroup_heads(lse, xp)[..., 0] + bad[..., 0]


def weights(q: Array, k: Array, /, *, mask: Array | None, rules: Rules, scale: float,
            xp: Any) -> Array:
    """The attention weights α (B…, H, Tq, Tk); rows sum to 1, fully masked rows to 0."""
    return weights_and_lse(q, k, mask=mask, rules=rules, scale=scale, xp=xp)[0]


def weights_and_lse(q: Array, k: Array, /, *, mask: Array | None, rules: Rules,
                    scale: float, xp: Any) -> tuple[Array, Array]:
    """:func:`weights` and the log-sum-exp (B…, H, Tq) of each row's scores."""
    s = _masked_scores(q, drop_padding(k, rules, xp), mask, rules, scale, xp)
    alpha, lse = _normalised(s, xp)
    bad = non_finite_rows(q, xp)
    return (ungroup_heads(_dropped(alpha, rules, xp), xp) + bad,
            ungroup_heads(xp.expand_dims(lse, axis=-1), xp)[..., 0] + bad[..., 0])


def _dropped(weights: Array, rules: Rules, xp: Any) -> Array:
    """Grouped weights (B…, Hkv, G, Tq, Tk) after dropout (unchanged without it)."""
    *batch, hkv, g, tq, tk = weights.shape
    z = dropout_factor(rules, tuple(batch), hkv, g, 0, tq, 0, tk, weights.dtype, xp,
                       device_of(weights))
    return weights if z is None else weights * z


def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array, /, *,
             mask: Array | None, rules: Rules, scale: float, xp: Any,
             grad_lse: Array | None = None) -> tuple[Array, Array, Array]:
    """Gradients of :func:`attention` by the formula, scores materialised.

    With ``P = exp(s - lse)`` (the softmax before dropout), ``Z`` the dropout
    factor (``keep / (1 - p)``, or 1), ``D = rowsum(dO ∘ O)``:
    ``dV = (P∘Z)ᵀ dO``, ``dS = P ∘ ((dO Vᵀ)∘Z - D + dlse)``, the soft-cap's
    derivative ``1 - tanh²`` applied to ``dS``, then ``dQ = scale·dS K`` and
    ``dK = scale·dSᵀ Q``; ``dK`` and ``dV`` are summed over the query heads that
    share a key/value head. Returns (dq, dk, dv) shaped like (q, k, v).
    """
    hkv = k.shape[-3]
    k, v = drop_padding(k, rules, xp), drop_padding(v, rules, xp)
    raw, s = _scores(q, k, mask, rules, scale, xp)   # (B…, Hkv, G, Tq, Tk)
    *batch, _, g, tq, tk = s.shape
    lseg = group_heads(xp.expand_dims(lse, axis=-1), hkv, xp)      # (B…, Hkv, G, Tq, 1)
    seen = lseg != NEG_INF
    p = xp.where(seen, xp.exp(s - xp.where(seen, lseg, 0.0)), 0.0)  # P, before dropout
    dog = group_heads(grad_out, hkv, xp)                            # (B…, Hkv, G, Tq, Ev)
    d = xp.sum(dog * group_heads(out, hkv, xp), axis=-1, keepdims=True)  # D (…, Tq, 1)
    if grad_lse is not None:
        d = d - group_heads(xp.expand_dims(grad_lse, axis=-1), hkv, xp)
    vg = xp.expand_dims(v, axis=-3)                                 # (B…, Hkv, 1, Tk, Ev)
    dp = xp.matmul(dog, xp.matrix_transpose(vg))                    # dO Vᵀ (…, Tq, Tk)
    z = dropout_factor(rules, tuple(batch), hkv, g, 0, tq, 0, tk, s.dtype, xp, device_of(s))
    pz = p if z is None else p * z
    if z is not None:
        dp = dp * z
    dv = xp.sum(xp.matmul(xp.matrix_transpose(pz), dog), axis=-3)   # (B…, Hkv, Tk, Ev)
    ds = p * (dp - d)
    grad = score_transform_grad(raw, rules, xp, 0, tq, 0, tk)    # soft-cap's, score_mod's
    if grad is not None:
        ds = ds * grad
    kg = xp.expand_dims(k, axis=-3)                                 # (B…, Hkv, 1, Tk, E)
    dq = ungroup_heads(xp.matmul(ds, kg) * scale, xp)               # (B…, H, Tq, E)
    qg = group_heads(q, hkv, xp)
    dk = xp.sum(xp.matmul(xp.matrix_transpose(ds), qg), axis=-3) * scale  # (B…, Hkv, Tk, E)
    # keys past key_lengths do not exist: their gradients are 0, not 0·NaN from a query
    # row holding NaN (as the padding's own zeroing gives under autodiff)
    return dq, drop_padding(dk, rules, xp), drop_padding(dv, rules, xp)
