"""The backward pass's work (:func:`.launch.backward` is its entry point).

One parallel loop over blocks of keys: for each block, dK and dV of its rows (summed
over the G query heads of a group) and its share of dQ, the weights recomputed from the
scores and the saved ``lse``, ``D = rowsum(dO∘O)`` (less ``grad_lse``), the products in
register tiles as in the forward pass. Five products per score (``S``, ``dP``, ``dV``,
``dK``, ``dQ``), where FlashAttention-2's two loops (dQ per query block, dK and dV per
key block) recompute ``S`` and ``dP`` in each: seven.

A work item is every ``parts``-th block of keys of one (batch row, key/value head),
from its own first one (:func:`key_items`): its blocks run one after another and add
their share of dQ to the item's own part, so that no two threads add to the same rows
and the sum does not depend on the number of threads or on which thread ran what. With
one part (as many (batch row, head) pairs as the threads need) dQ is that part; with
more, the parts are summed in order after the loop (each a dQ's worth of memory,
bounded by :data:`PART_BYTES`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyattn.backends.numba_cpu import compiler, threads
from polyattn.backends.numba_cpu.plan import Call
from polyattn.rules.visibility import Rules


def gradients(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any, mask: Any,
              rules: Rules, scale: float, grad_lse: Any, into: Any = None
              ) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) shaped like ``q``, ``k``, ``v`` (the caller sets ``np.errstate``);
    written into ``into``'s arrays where they can take them (C-contiguous, of those
    shapes and the compute dtype, and no batch axis to sum)."""
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
    # a row that sees no key (lse -inf) has zero gradients, whatever its cotangents are
    # (a NaN in its D would otherwise reach every key of its panel through dS)
    dd[lse3 == -np.inf] = 0
    dk = _zeros(into, 1, k.shape, (*call.batch, hkv, tk, call.e), dt)
    dv = _zeros(into, 2, v.shape, (*call.batch, hkv, tk, call.ev), dt)
    parts = part_count(n_batch * hkv, -(-tk // call.block_k),
                       n_batch * h * tq * call.e * dt.itemsize)
    dq_full = (*call.batch, h, tq, call.e)
    if parts == 1:
        dq_parts = _zeros(into, 0, q.shape, dq_full, dt)[None]
    else:
        dq_parts = np.zeros((parts, n_batch, h, tq, call.e), dtype=dt)
    dk = dk.reshape(n_batch, hkv, tk, call.e)
    dv = dv.reshape(n_batch, hkv, tk, call.ev)
    dq_parts = dq_parts.reshape(parts, n_batch, h, tq, call.e)
    items = key_items(call.lengths, hkv, call.block_k, parts)
    if items.size:
        threads.run(compiler.backward_kernel(dt), *call.common(), go, lse3, dd, items,
                    call.fparams, call.iparams, dq_parts, dk, dv,
                    threads.counter(compiler.item_address("backward", dt)))
    dq = dq_parts[0]
    if parts > 1:                                  # in order: the same sum every time
        target = _usable(into, 0, q.shape, dq_full, dt)
        if target is not None:
            dq = np.add(dq, dq_parts[1], out=target.reshape(dq.shape))
        else:
            dq += dq_parts[1]
        for part in dq_parts[2:]:
            dq += part
    return (_unbroadcast(dq.reshape((*call.batch, h, tq, call.e)), q.shape),
            _unbroadcast(dk.reshape((*call.batch, hkv, tk, call.e)), k.shape),
            _unbroadcast(dv.reshape((*call.batch, hkv, tk, call.ev)), v.shape))


def _usable(into: Any, index: int, shape: tuple[int, ...], full: tuple[int, ...],
            dtype: np.dtype) -> np.ndarray | None:
    """``into[index]`` where it can take a gradient of shape ``full``: C-contiguous,
    writeable, of ``dtype``, and ``shape`` (the input's) is ``full`` (no broadcast batch
    axis to sum)."""
    if into is None or tuple(shape) != full:
        return None
    a = into[index]
    if (isinstance(a, np.ndarray) and a.shape == full and a.dtype == dtype
            and a.flags.c_contiguous and a.flags.writeable):
        return a
    return None


def _zeros(into: Any, index: int, shape: tuple[int, ...], full: tuple[int, ...],
           dtype: np.dtype) -> np.ndarray:
    """Zeros of shape ``full``: ``into[index]`` zeroed where :func:`_usable`, else new."""
    a = _usable(into, index, shape, full, dtype)
    if a is None:
        return np.zeros(full, dtype=dtype)
    a.fill(0)
    return a


def _unbroadcast(full: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``full`` summed over the batch axes where the input had size 1."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, full.shape, strict=True))
                 if n == 1 and m != 1)
    return full.sum(axis=axes, keepdims=True) if axes else full


#: The most memory the parts of dQ beyond the first may take (each is a dQ's worth).
PART_BYTES = 32 * 2**20
#: Work items the backward pass aims for: (batch row, key/value head) pairs, each split
#: into parts where there are fewer. A constant, not the number of threads: the parts,
#: and so the rounding of dQ's sum, must not depend on the machine's threads.
ITEMS = 16


def part_count(heads: int, blocks: int, dq_bytes: int) -> int:
    """How many parts dQ is summed from: enough for :data:`ITEMS` work items over the
    ``heads`` (batch row, key/value head) pairs, no more than the ``blocks`` of keys, and
    the parts beyond the first within :data:`PART_BYTES`."""
    wanted = -(-ITEMS // max(heads, 1))
    affordable = 1 + PART_BYTES // max(dq_bytes, 1)
    return int(max(1, min(wanted, blocks, affordable)))


def key_items(lengths: np.ndarray, hkv: int, block_k: int, parts: int) -> np.ndarray:
    """(b, hk, first key, step, part, 0) per work item: part ``p`` of (batch row ``b``,
    head ``hk``) takes the blocks of keys ``p·block_k + i·parts·block_k`` below the
    batch row's length; the batch rows with the most keys first."""
    items = [(b, hk, p * block_k, parts * block_k, p, 0)
             for b in np.argsort(-np.asarray(lengths), kind="stable")
             for hk in range(hkv) for p in range(parts) if p * block_k < lengths[b]]
    return np.asarray(items, dtype=np.int64).reshape(-1, 6)
