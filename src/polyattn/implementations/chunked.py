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

from .._compat import device_of
from ._common import (
    NEG_INF,
    group_heads,
    log_of_sum,
    safe_divide,
    stable_shift,
    ungroup_heads,
)
from ._rules import Rules, drop_padding, score_transform

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
                        rules: Rules, block_k: int, xp: Any,
                        ) -> tuple[Array, Array]:
    """Online softmax of one query block over all key blocks.

    ``qg`` (B…, Hkv, G, bq, E) already scaled, ``kg``/``vg`` (B…, Hkv, 1, Tk, ·),
    ``mask`` grouped (B…, Hkv|1, G|1, Tq|1, Tk|1). Returns out and lse for the block.
    """
    bq = qg.shape[-2]
    q1 = q0 + bq
    dev = device_of(qg)
    m = l = acc = None
    lo, hi = rules.key_range(q0, q1)  # keys outside [lo, hi) are invisible to this block
    for k0 in range(lo, hi, block_k):
        k1 = min(k0 + block_k, hi)
        # --- scores of this (query block, key block) pair
        s = xp.matmul(qg, xp.matrix_transpose(kg[..., k0:k1, :]))  # (B…, Hkv, G, bq, bk)
        s = score_transform(s, rules, _mask_block(mask, q0, q1, k0, k1), q0, q1, k0, k1, xp)
        # --- update the running maximum and rescale what was accumulated
        block_max = xp.max(s, axis=-1, keepdims=True)
        m_new = block_max if m is None else xp.maximum(m, block_max)
        shift = stable_shift(m_new, xp)
        p = xp.exp(s - shift)                                     # (B…, Hkv, G, bq, bk)
        pv = xp.matmul(p, vg[..., k0:k1, :])                      # (B…, Hkv, G, bq, Ev)
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
        return zeros, xp.full(qg.shape[:-1], NEG_INF, dtype=qg.dtype, device=dev)
    # --- normalise: out = acc / l, lse = m + log(l)
    out = safe_divide(acc, l, xp)
    lse = log_of_sum(l, stable_shift(m, xp), xp)[..., 0]
    return out, lse


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None,
              causal_offset: int | None, scale: float, xp: Any, rules: Rules | None = None,
              block_q: int | None = None, block_k: int | None = None,
              ) -> tuple[Array, Array]:
    """Blocked online-softmax attention; see :mod:`polyattn.implementations`.

    ``block_q`` and ``block_k`` override the module's block sizes.
    """
    rules = rules or Rules.from_causal_offset(causal_offset, q.shape[-2], k.shape[-2])
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
        o, s = _attend_query_block(qg[..., q0:q1, :], kg, vg, maskg, q0, rules, block_k, xp)
        outs.append(o)
        lses.append(s)
    out = outs[0] if len(outs) == 1 else xp.concat(outs, axis=-2)
    lse = lses[0] if len(lses) == 1 else xp.concat(lses, axis=-1)
    lse = xp.expand_dims(lse, axis=-1)
    return ungroup_heads(out, xp), ungroup_heads(lse, xp)[..., 0]
