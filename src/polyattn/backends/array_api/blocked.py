"""Online-softmax attention over key blocks, in pure Array-API calls.

The score matrix is never materialised whole. Queries are cut into blocks
of ``BLOCK_Q`` rows, processed independently; for each query block the keys
are streamed in blocks of ``BLOCK_K``, keeping three running quantities per
query row (Milakov & Gimelshein 2018; Dao et al. 2022):

``m``
    the largest score seen so far,
``l``
    the sum of ``exp(score - m)`` seen so far,
``acc``
    the sum of ``exp(score - m) · v`` seen so far.

When a new block raises the maximum from ``m`` to ``m_new``, the old ``l``
and ``acc`` are rescaled by ``exp(m - m_new)``; at the end ``out = acc / l``
and ``lse = m + log(l)``. Memory is O(B·H·BLOCK_Q·BLOCK_K) for the scores
plus the inputs and output. Key blocks that no query of a block can see
(causal, sliding window) are skipped, so the work follows the visible area;
only blocks that straddle an edge of it build a visibility mask.

Block loops depend only on shapes, never on values, so the code traces
under ``jax.jit`` and stays lazy on Dask.
"""

from __future__ import annotations

from typing import Any

from polyattn._interop import device_of
from polyattn.backends.array_api.reference import dropout_factor
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

#: Query rows per block (each query block is an independent problem).
BLOCK_Q = 512
#: Keys per block streamed through the online softmax.
BLOCK_K = 512


def _mask_block(mask: Array | None, q0: int, q1: int, k0: int, k1: int) -> Array | None:
    """The part of a broadcastable mask that covers queries q0:q1 and keys k0:k1."""
    if mask is None:
        return None
    rows = slice(q0, q1) if mask.shape[-2] != 1 else slice(None)
    cols = slice(k0, k1) if mask.shape[-1] != 1 else slice(None)
    return mask[..., rows, cols]


def _attend_query_block(qg: Array, kg: Array, vg: Array, mask: Array | None, q0: int,
                        rules: Rules, block_k: int, xp: Any, lse_dtype: Any = None,
                        ) -> tuple[Array, Array]:
    """Online softmax of one query block over all key blocks.

    ``qg`` (B…, Hkv, G, bq, E) already scaled, ``kg``/``vg`` (B…, Hkv, 1, Tk, ·),
    ``mask`` grouped (B…, Hkv|1, G|1, Tq|1, Tk|1). Returns out and lse for the block,
    the lse in ``lse_dtype`` (default: the inputs' dtype).
    """
    bq = qg.shape[-2]
    q1 = q0 + bq
    dev = device_of(qg)
    m = l = acc = None
    lo, hi = rules.key_range(q0, q1)  # keys outside [lo, hi) are invisible to this block
    for k0 in range(lo, hi, block_k):
        k1 = min(k0 + block_k, hi)
        kind = _tile_kind(rules, q0, q1, k0, k1)
        if kind == EMPTY:
            continue                      # the block mask: no query of it sees these keys
        # --- scores of this (query block, key block) pair
        s = xp.matmul(qg, xp.matrix_transpose(kg[..., k0:k1, :]))  # (B…, Hkv, G, bq, bk)
        s = score_transform(s, rules, _mask_block(mask, q0, q1, k0, k1), q0, q1, k0, k1, xp,
                            kind != FULL)
        # --- update the running maximum and rescale what was accumulated
        block_max = xp.max(s, axis=-1, keepdims=True)
        m_new = block_max if m is None else xp.maximum(m, block_max)
        shift = stable_shift(m_new, xp)
        p = xp.exp(s - shift)                                     # (B…, Hkv, G, bq, bk)
        z = dropout_factor(rules, tuple(qg.shape[:-4]), qg.shape[-4], qg.shape[-3], q0, q1,
                           k0, k1, p.dtype, xp, dev)
        pv = xp.matmul(p if z is None else p * z, vg[..., k0:k1, :])  # (B…, Hkv, G, bq, Ev)
        if m is None:
            l, acc = xp.sum(p, axis=-1, keepdims=True), pv
        else:
            alpha = xp.exp(stable_shift(m, xp) - shift)
            alpha = xp.where(m == NEG_INF, 0.0, alpha)
            l = l * alpha + xp.sum(p, axis=-1, keepdims=True)
            acc = acc * alpha + pv
        m = m_new
    if m is None:  # causal or window rules exclude every key of this block
        shape = (*qg.shape[:-1], vg.shape[-1])
        zeros = xp.zeros(shape, dtype=qg.dtype, device=dev)
        return zeros, xp.full(qg.shape[:-1], NEG_INF, dtype=lse_dtype or qg.dtype, device=dev)
    # --- normalise: out = acc / l, lse = m + log(l)
    out = safe_divide(acc, l, xp)
    m = stable_shift(m, xp)
    if lse_dtype is not None and lse_dtype != m.dtype:
        l, m = xp.astype(l, lse_dtype), xp.astype(m, lse_dtype)
    lse = log_of_sum(l, m, xp)[..., 0]
    return out, lse


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None, rules: Rules,
              scale: float, xp: Any, block_q: int | None = None, block_k: int | None = None,
              lse_dtype: Any = None) -> tuple[Array, Array]:
    """Blocked online-softmax attention; see :mod:`polyattn.backends`.

    ``block_q`` and ``block_k`` override the module's block sizes; ``lse_dtype``
    (e.g. float64 for float32 inputs) keeps the lse's ``m + log l`` exact enough to
    merge partial results whose scores are large.
    """
    block_q = block_q or BLOCK_Q
    block_k = block_k or BLOCK_K
    hkv, tq = k.shape[-3], q.shape[-2]
    qg = group_heads(q * scale, hkv, xp)          # (B…, Hkv, G, Tq, E)
    kg = xp.expand_dims(drop_padding(k, rules, xp), axis=-3)   # (B…, Hkv, 1, Tk, E)
    vg = xp.expand_dims(drop_padding(v, rules, xp), axis=-3)   # (B…, Hkv, 1, Tk, Ev)
    maskg = None if mask is None else group_heads(mask, hkv, xp)
    outs, lses = [], []
    for q0 in range(0, tq, block_q):
        q1 = min(q0 + block_q, tq)
        o, s = _attend_query_block(qg[..., q0:q1, :], kg, vg, maskg, q0, rules, block_k, xp,
                                   lse_dtype)
        outs.append(o)
        lses.append(s)
    out = outs[0] if len(outs) == 1 else xp.concat(outs, axis=-2)
    lse = lses[0] if len(lses) == 1 else xp.concat(lses, axis=-1)
    lse = xp.expand_dims(lse, axis=-1)
    bad = non_finite_rows(q, xp)                  # a NaN or inf query row stays NaN
    return ungroup_heads(out, xp) + bad, ungroup_heads(lse, xp)[..., 0] + bad[..., 0]


#: Kinds of a tile under a block mask (:data:`polyattn.blockmask.EMPTY`, ...).
EMPTY, PARTIAL, FULL = 0, 1, 2


def _tile_kind(rules: Rules, q0: int, q1: int, k0: int, k1: int) -> int:
    """The block mask's kind of a tile (partial without one)."""
    return PARTIAL if rules.blocks is None else int(rules.blocks.tile(q0, q1, k0, k1))


def _key_blocks(rules: Rules, q0: int, q1: int, block_k: int) -> range:
    """Indices of the key blocks (of the fixed grid ``block_k``) that queries q0:q1 may see."""
    lo, hi = rules.key_range(q0, q1)
    return range(lo // block_k, -(-hi // block_k)) if hi > lo else range(0)


def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array, /, *,
             mask: Array | None, rules: Rules, scale: float, xp: Any,
             grad_lse: Array | None = None, block_q: int | None = None,
             block_k: int | None = None) -> tuple[Array, Array, Array]:
    """Gradients of :func:`attention`, block by block (FlashAttention-2's backward pass).

    The scores of each (query block, key block) pair that some query can see
    are recomputed from ``q``, ``k`` and the saved ``lse``; with
    ``P = exp(s - lse)``, ``D = rowsum(dO ∘ O) - dlse`` and the dropout factor
    ``Z``: ``dV += (P∘Z)ᵀ dO``, ``dS = P ∘ ((dO Vᵀ)∘Z - D)`` (times the
    soft-cap's derivative), ``dQ += scale·dS K``, ``dK += scale·dSᵀ Q``.
    Memory is O(B·H·block_q·block_k) besides the gradients. Returns (dq, dk, dv)
    shaped like (q, k, v); key/value gradients are summed over the query heads
    that share a key/value head.
    """
    block_q = block_q or BLOCK_Q
    block_k = block_k or BLOCK_K
    hkv, tq, tk = k.shape[-3], q.shape[-2], k.shape[-2]
    e, ev = q.shape[-1], v.shape[-1]
    dev = device_of(q)
    qg = group_heads(q, hkv, xp)                                  # (B…, Hkv, G, Tq, E)
    *batch, _, g, _, _ = qg.shape
    kg = xp.expand_dims(drop_padding(k, rules, xp), axis=-3)      # (B…, Hkv, 1, Tk, E)
    vg = xp.expand_dims(drop_padding(v, rules, xp), axis=-3)      # (B…, Hkv, 1, Tk, Ev)
    maskg = None if mask is None else group_heads(mask, hkv, xp)
    dog = group_heads(grad_out, hkv, xp)                          # (B…, Hkv, G, Tq, Ev)
    d = xp.sum(dog * group_heads(out, hkv, xp), axis=-1, keepdims=True)   # (…, Tq, 1)
    if grad_lse is not None:
        d = d - group_heads(xp.expand_dims(grad_lse, axis=-1), hkv, xp)
    lseg = group_heads(xp.expand_dims(lse, axis=-1), hkv, xp)     # (B…, Hkv, G, Tq, 1)
    seen = lseg != NEG_INF
    lseg = xp.where(seen, lseg, 0.0)
    n_kb = -(-tk // block_k)
    dk: list[Array | None] = [None] * n_kb                        # per key block, over G
    dv: list[Array | None] = [None] * n_kb
    dqs = []
    for q0 in range(0, tq, block_q):
        q1 = min(q0 + block_q, tq)
        qb, dob = qg[..., q0:q1, :], dog[..., q0:q1, :]
        db, lb, sb = d[..., q0:q1, :], lseg[..., q0:q1, :], seen[..., q0:q1, :]
        dq = None
        for kb in _key_blocks(rules, q0, q1, block_k):
            k0, k1 = kb * block_k, min((kb + 1) * block_k, tk)
            kind = _tile_kind(rules, q0, q1, k0, k1)
            if kind == EMPTY:
                continue
            kt, vt = kg[..., k0:k1, :], vg[..., k0:k1, :]
            raw = xp.matmul(qb, xp.matrix_transpose(kt)) * scale  # (B…, Hkv, G, bq, bk)
            s = score_transform(raw, rules, _mask_block(maskg, q0, q1, k0, k1), q0, q1, k0,
                                k1, xp, kind != FULL)
            p = xp.where(sb, xp.exp(s - lb), 0.0)                 # P, before dropout
            dp = xp.matmul(dob, xp.matrix_transpose(vt))          # dO Vᵀ
            z = dropout_factor(rules, tuple(batch), hkv, g, q0, q1, k0, k1, p.dtype, xp, dev)
            pz = p if z is None else p * z
            if z is not None:
                dp = dp * z
            ds = p * (dp - db)
            grad = score_transform_grad(raw, rules, xp, q0, q1, k0, k1)   # chain rule
            if grad is not None:
                ds = ds * grad
            dv_blk = xp.sum(xp.matmul(xp.matrix_transpose(pz), dob), axis=-3)
            dk_blk = xp.sum(xp.matmul(xp.matrix_transpose(ds), qb), axis=-3)
            dv[kb] = dv_blk if dv[kb] is None else dv[kb] + dv_blk
            dk[kb] = dk_blk if dk[kb] is None else dk[kb] + dk_blk
            dq_blk = xp.matmul(ds, kt)                            # (B…, Hkv, G, bq, E)
            dq = dq_blk if dq is None else dq + dq_blk
        if dq is None:
            dq = xp.zeros((*qb.shape[:-1], e), dtype=q.dtype, device=dev)
        dqs.append(dq)

    def blocks(parts: list[Array | None], f: int) -> Array:
        shape = (*batch, hkv)
        filled = [xp.zeros((*shape, min((i + 1) * block_k, tk) - i * block_k, f),
                           dtype=q.dtype, device=dev) if x is None else x
                  for i, x in enumerate(parts)]
        return filled[0] if len(filled) == 1 else xp.concat(filled, axis=-2)

    dq_all = dqs[0] if len(dqs) == 1 else xp.concat(dqs, axis=-2)
    # keys past key_lengths do not exist: 0, not 0·NaN from a query row holding NaN
    return (ungroup_heads(dq_all, xp) * scale, drop_padding(blocks(dk, e) * scale, rules, xp),
            drop_padding(blocks(dv, ev), rules, xp))
