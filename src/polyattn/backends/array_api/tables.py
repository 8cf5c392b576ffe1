"""Gradients of the floating ``mod_args`` arrays a ``score_mod`` reads (a learned bias
table, learned ALiBi slopes), in Array-API calls, for :func:`polyattn.attention_vjp`.

Whichever implementation gave the gradients of query, key and value, one pass over the
tiles of the scores that some query sees recomputes ``P = exp(s - lse)`` and
``dS = P ∘ (dO Vᵀ ∘ Z - D)`` (the gradient of the loss with respect to the scores
``score_mod`` returns) as the blocked backward pass does, and adds, for each element
``t`` of a table, ``Σ dS · ∂score_mod/∂t`` over the scores that read it
(:func:`polyattn.rules.user.table_partials`): a scatter-add of the tile into the table's
gradient, by the library's ``bincount`` where it has one. Its cost is about one more
forward pass, per load of a table that the rule makes.
"""

from __future__ import annotations

import math
from typing import Any

from polyattn._interop import device_of, library_name
from polyattn.backends.array_api.blocked import (
    BLOCK_K,
    BLOCK_Q,
    EMPTY,
    FULL,
    _key_blocks,
    _mask_block,
    _tile_kind,
)
from polyattn.backends.array_api.reference import dropout_factor
from polyattn.rules.online import NEG_INF, group_heads
from polyattn.rules.user import table_partials
from polyattn.rules.visibility import (
    Rules,
    alibi_bias,
    drop_padding,
    score_transform,
)

Array = Any


def floating(rules: Rules, xp: Any) -> tuple[int, ...]:
    """The positions in ``mod_args`` of the floating arrays (those with a gradient)."""
    if rules.user is None or rules.user.score_mod is None:
        return ()
    return tuple(n for n, a in enumerate(rules.user.mod_args)
                 if xp.isdtype(a.dtype, "real floating"))


def gradients(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array, /, *,
              mask: Array | None, rules: Rules, scale: float, xp: Any,
              grad_lse: Array | None = None) -> list[Array]:
    """The gradient of each floating ``mod_args`` array (in order), shaped like it, in
    the compute dtype; tiles of :data:`BLOCK_Q` × :data:`BLOCK_K`."""
    assert rules.user is not None
    numbers = floating(rules, xp)
    tables = [rules.user.mod_args[n] for n in numbers]
    grads = {n: xp.zeros((math.prod(t.shape),), dtype=q.dtype, device=device_of(q))
             for n, t in zip(numbers, tables, strict=True)}
    hkv, tq, tk = k.shape[-3], q.shape[-2], k.shape[-2]
    dev = device_of(q)
    qg = group_heads(q, hkv, xp)                                  # (B…, Hkv, G, Tq, E)
    *batch, _, g, _, _ = qg.shape
    kg = xp.expand_dims(drop_padding(k, rules, xp), axis=-3)      # (B…, Hkv, 1, Tk, E)
    vg = xp.expand_dims(drop_padding(v, rules, xp), axis=-3)
    maskg = None if mask is None else group_heads(mask, hkv, xp)
    dog = group_heads(grad_out, hkv, xp)                          # (B…, Hkv, G, Tq, Ev)
    d = xp.sum(dog * group_heads(out, hkv, xp), axis=-1, keepdims=True)
    if grad_lse is not None:
        d = d - group_heads(xp.expand_dims(grad_lse, axis=-1), hkv, xp)
    lseg = group_heads(xp.expand_dims(lse, axis=-1), hkv, xp)     # (B…, Hkv, G, Tq, 1)
    seen = lseg != NEG_INF
    lseg = xp.where(seen, lseg, 0.0)
    for q0 in range(0, tq, BLOCK_Q):
        q1 = min(q0 + BLOCK_Q, tq)
        for kb in _key_blocks(rules, q0, q1, BLOCK_K):
            k0, k1 = kb * BLOCK_K, min((kb + 1) * BLOCK_K, tk)
            kind = _tile_kind(rules, q0, q1, k0, k1)
            if kind == EMPTY:
                continue
            raw = xp.matmul(qg[..., q0:q1, :], xp.matrix_transpose(kg[..., k0:k1, :])) * scale
            s = score_transform(raw, rules, _mask_block(maskg, q0, q1, k0, k1), q0, q1, k0,
                                k1, xp, kind != FULL)
            p = xp.where(seen[..., q0:q1, :], xp.exp(s - lseg[..., q0:q1, :]), 0.0)
            dp = xp.matmul(dog[..., q0:q1, :], xp.matrix_transpose(vg[..., k0:k1, :]))
            z = dropout_factor(rules, tuple(batch), hkv, g, q0, q1, k0, k1, p.dtype, xp, dev)
            if z is not None:
                dp = dp * z
            ds = p * (dp - d[..., q0:q1, :])                      # d loss / d score_mod's
            before = _before_score_mod(raw, rules, q0, q1, k0, k1, xp)
            for number, flat, partial in table_partials(rules.user, before, q0, q1, k0, k1,
                                                        xp, dev, numbers):
                w = ds * partial
                # a NaN partial where nothing flows (dS = 0 on hidden keys) adds nothing
                w = xp.where(ds == 0, xp.zeros_like(w), w)
                grads[number] = grads[number] + _scatter_add(
                    xp, grads[number].shape[0], xp.broadcast_to(flat, tuple(w.shape)), w)
    return [xp.reshape(grads[n], tuple(t.shape)) for n, t in zip(numbers, tables, strict=True)]


def _before_score_mod(raw: Array, rules: Rules, q0: int, q1: int, k0: int, k1: int,
                      xp: Any) -> Array:
    """The scores ``score_mod`` receives: scaled, soft-capped, ALiBi added."""
    s = raw
    if rules.softcap is not None:
        s = xp.tanh(s / rules.softcap) * rules.softcap
    if rules.alibi is not None:
        s = s + alibi_bias(rules, q0, q1, k0, k1, s.shape[-4], xp, s.dtype, device_of(s))
    return s


def _scatter_add(xp: Any, size: int, index: Array, weights: Array) -> Array:
    """``out[i] = Σ weights[index == i]``, ``out`` of ``size`` in ``weights``' dtype."""
    flat_i = xp.reshape(index, (-1,))
    flat_w = xp.reshape(weights, (-1,))
    library = library_name(xp)
    if library == "numpy":
        import numpy as np

        got = np.bincount(np.asarray(flat_i), weights=np.asarray(flat_w), minlength=size)
        return xp.asarray(got.astype(flat_w.dtype, copy=False))
    if library == "torch":
        import torch

        return torch.bincount(flat_i, weights=flat_w, minlength=size).to(flat_w.dtype)
    if library == "cupy":
        import cupy

        return cupy.bincount(flat_i, weights=flat_w, minlength=size).astype(flat_w.dtype)
    if library == "jax":
        import jax.numpy as jnp

        return jnp.bincount(flat_i, weights=flat_w, length=size).astype(flat_w.dtype)
    # any other library: one comparison per element and table entry
    hit = xp.expand_dims(flat_i, axis=-1) == xp.arange(size, device=device_of(flat_i))
    return xp.sum(xp.where(hit, xp.expand_dims(flat_w, axis=-1), 0.0), axis=0)
