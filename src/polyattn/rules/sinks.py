"""Attention sinks: one virtual key per head, with a learned logit and a value of 0.

A sink (gpt-oss; Xiao et al. 2023, "Efficient streaming language models with
attention sinks") takes part in each row's softmax but adds nothing to the
output: with ``s_h`` the sink of head ``h`` and ``S_ij`` the scores,

``p_ij = exp(S_ij - L_i)``, ``L_i = log(Σ_j exp(S_ij) + exp(s_h))``, ``out_i = Σ_j p_ij v_j``.

That is the log-sum-exp merge (:mod:`.merge`) of the attention over the keys with
a part holding only the sink (``out = 0``, ``lse = s_h``), so every implementation
computes the attention over the keys and the sink joins afterwards, here, exactly:
``L = logaddexp(lse, s)`` and ``out · exp(lse - L)``. A row with no visible key
puts all its weight on the sink: ``out = 0``, ``L = s_h``.

The backward passes need nothing new: FlashAttention-2's ``P = exp(S - L)`` and
``D = rowsum(dO ∘ O)`` taken with the joined ``L`` and ``O`` are the gradients of
the attention with the sink (whose value, 0, contributes no ``dP``). The sink's own
gradient is ``ds_h = -Σ_i exp(s_h - L_i) · (D_i - dL_i)`` (:func:`gradient`, ``dL``
the cotangent of the log-sum-exp), summed over the rows of the head.

Examples
--------
>>> import numpy as np
>>> import array_api_compat.numpy as xp
>>> out, lse = np.ones((1, 1, 2, 3)), np.array([[[0.0, -np.inf]]])   # row 1 saw no key
>>> joined, total = join(out, lse, np.array([[0.0]]), xp)
>>> joined[0, 0, :, 0], total[0, 0]               # the sink takes half of row 0, all of row 1
(array([0.5, 0. ]), array([0.69314718, 0.        ]))
"""

from __future__ import annotations

from typing import Any

from polyattn.rules.online import NEG_INF, log_of_sum, safe_divide, stable_shift

Array = Any


def join(out: Array, lse: Array, sinks: Array, xp: Any) -> tuple[Array, Array]:
    """``(out, lse)`` of the attention over the keys, with the sinks joined.

    ``out`` (B…, H, Tq, Ev), ``lse`` (B…, H, Tq), ``sinks`` (B…|1, H|1) in the
    dtype of ``lse``. NaN (in a row or a sink) stays NaN; a sink of ``-inf`` is no
    sink. Made of element-wise operations only, so autodiff (torch, JAX) gives the
    gradients of ``out``, ``lse`` and the sinks through it, fully masked rows
    included (no ``-inf - -inf`` anywhere).
    """
    joined, keys = _joined(lse, sinks, xp)
    return out * xp.astype(keys, out.dtype)[..., None], joined


def share(lse: Array, sinks: Array, xp: Any) -> Array:
    """The keys' share ``exp(lse - L)`` of each row's weight (B…, H, Tq): what the sink
    leaves of weights that summed to 1 (0 for a row with no visible key)."""
    return _joined(lse, sinks, xp)[1]


def _joined(lse: Array, sinks: Array, xp: Any) -> tuple[Array, Array]:
    """``(L, exp(lse - L))`` with the sinks joined."""
    s = sinks[..., None]                                  # (B…|1, H|1, 1)
    m = stable_shift(xp.maximum(lse, s), xp)              # 0 where both are -inf
    keys, sink = xp.exp(lse - m), xp.exp(s - m)
    total = keys + sink
    return log_of_sum(total, m, xp), safe_divide(keys, total, xp)


def gradient(out: Array, lse: Array, sinks: Array, grad_out: Array,
             grad_lse: Array | None, xp: Any) -> Array:
    """``d loss / d sinks`` (B…|1, H|1, the shape of ``sinks``), from the joined ``out``
    and ``lse`` of :func:`join` and the cotangents ``grad_out`` (of ``out``) and
    ``grad_lse`` (of ``lse``; ``None``: 0)."""
    s = sinks[..., None]
    weight = xp.where(lse == NEG_INF, 0.0, xp.exp(s - stable_shift(lse, xp)))
    d = xp.sum(grad_out * out, axis=-1)                   # D_i = rowsum(dO ∘ O)
    if grad_lse is not None:
        d = d - grad_lse
    g = -xp.sum(weight * d, axis=-1)                      # (B…, H)
    extra = g.ndim - sinks.ndim
    if extra:
        g = xp.sum(g, axis=tuple(range(extra)))
    stretched = tuple(i for i, (a, b) in enumerate(zip(g.shape, sinks.shape, strict=True))
                      if b == 1 and a != 1)
    if stretched:
        g = xp.sum(g, axis=stretched, keepdims=True)
    return g
