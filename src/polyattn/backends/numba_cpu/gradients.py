"""The backward pass's work (:func:`.launch.backward` is its entry point).

FlashAttention-2's backward pass in two parallel loops of one kernel: dQ per query
item, dK and dV per block of keys (summed over the G query heads of a group), the
weights recomputed from the scores and the saved ``lse``, ``D = rowsum(dO∘O)`` (less
``grad_lse``), the products in register tiles as in the forward pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyattn.backends.numba_cpu import compiler, threads
from polyattn.backends.numba_cpu.plan import Call
from polyattn.rules.visibility import Rules


def gradients(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any, mask: Any,
              rules: Rules, scale: float, grad_lse: Any) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) shaped like ``q``, ``k``, ``v`` (the caller sets ``np.errstate``)."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    call = Call(q, k, v, mask, rules, scale)
    n_batch, h, hkv, tq, tk = call.n_batch, call.h, call.hkv, call.tq, call.tk
    dt = call.dtype
    go = np.ascontiguousarray(np.broadcast_to(np.asarray(grad_out, dtype=dt),
                                              (*call.batch, h, tq, call.ev))
                              ).reshape(n_batch, h, tq, call.ev)
    o = np.broadcast_to(np.asarray(out, dtype=dt), (*call.batch, h, tq, call.ev)
                        ).reshape(n_batch, h, tq, call.ev)
    lse3 = np.ascontiguousarray(np.broadcast_to(np.asarray(lse, dtype=dt),
                                                (*call.batch, h, tq))).reshape(n_batch, h, tq)
    dd = np.einsum("bhie,bhie->bhi", go, o)                # D = rowsum(dO ∘ O)
    if grad_lse is not None:
        dd -= np.broadcast_to(np.asarray(grad_lse, dtype=dt),
                              (*call.batch, h, tq)).reshape(n_batch, h, tq)
    dq = np.zeros((n_batch, h, tq, call.e), dtype=dt)
    dk = np.zeros((n_batch, hkv, tk, call.e), dtype=dt)
    dv = np.zeros((n_batch, hkv, tk, call.ev), dtype=dt)
    q_items, k_items = call.query_items(), call.key_items()
    if q_items.size or k_items.size:
        threads.run(compiler.backward_kernel(), *call.common(), go, lse3, dd, q_items,
                    k_items, call.fparams, call.iparams, dq, dk, dv)
    return (_unbroadcast(dq.reshape((*call.batch, h, tq, call.e)), q.shape),
            _unbroadcast(dk.reshape((*call.batch, hkv, tk, call.e)), k.shape),
            _unbroadcast(dv.reshape((*call.batch, hkv, tk, call.ev)), v.shape))


def _unbroadcast(full: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``full`` summed over the batch axes where the input had size 1."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, full.shape, strict=True))
                 if n == 1 and m != 1)
    return full.sum(axis=axes, keepdims=True) if axes else full
