"""One call's plan: the arrays the kernels read, and the work items they are split into.

:class:`Call` holds query, key, value and the mask without their broadcast batch axes
(with the map from each batch row to its row of each), the rules lowered by
:func:`.parameters.lower`, and the work items of the forward pass, the largest first
(the backward pass's are :func:`.gradients.key_items`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyattn.backends.numba_cpu.parameters import lower
from polyattn.rules.visibility import Rules

#: Query rows per work item, summed over the G heads of a group (float32; half in float64).
BLOCK_ROWS = 512
#: Keys per block: the scores of one block against one panel of query rows (256 × 32
#: float32, 256 × 16 float64) are 32 KiB, within the L1 cache.
BLOCK_K = 256


def _own(x: np.ndarray, batch: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (B…|1, A, T, F), each batch axis 1 or full, as (B_own, A, T, F) without its
    broadcast batch axes, and the map from each flat index of the problem's batch B… to
    its row of that array."""
    nb = len(batch)
    own_index = tuple(slice(0, 1) if s == 0 and n > 1 else slice(None)
                      for s, n in zip(x.strides[:nb], x.shape[:nb], strict=True))
    own = x[own_index]
    own_batch = own.shape[:nb]
    flat = own.reshape((math.prod(own_batch), *x.shape[nb:]))        # a copy only if needed
    if not batch:
        return flat, np.zeros(1, dtype=np.int64)
    grids = np.indices(batch).reshape(nb, -1)
    idx = tuple(np.where(np.asarray(own_batch)[:, None] == 1, 0, grids))
    return flat, np.ravel_multi_index(idx, own_batch).astype(np.int64)


class Call:
    """What the kernels take for one call: the arrays without their broadcast batch axes,
    the per-batch maps, the lowered rules (lengths, offsets, slopes, parameters) and the
    work items."""

    def __init__(self, q: Any, k: Any, v: Any, mask: Any, rules: Rules,
                 scale: float) -> None:
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        self.rules = rules
        nb = q.ndim - 3
        self.batch = batch = tuple(q.shape[:nb])
        self.n_batch = n_batch = math.prod(batch)
        self.dtype = dtype = q.dtype
        self.tq, self.tk, self.h, self.hkv = q.shape[-2], k.shape[-2], q.shape[-3], k.shape[-3]
        self.e, self.ev = q.shape[-1], v.shape[-1]
        self.q4, self.qmap = _own(q, batch)
        self.k4, self.kmap = _own(k, batch)
        self.v4, self.vmap = _own(v, batch)
        #: 0: no mask; 1: a float mask (added); 2: a boolean one (hides keys)
        mask_kind = 0
        if mask is None:
            self.mask4, self.mmap = np.zeros((1, 1, 1, 1), dtype=dtype), np.zeros(n_batch,
                                                                                  np.int64)
        else:
            mask = np.asarray(mask)
            mask_kind = 2 if mask.dtype == np.bool_ else 1
            if mask.dtype == np.bool_:
                mask = np.where(mask, dtype.type(0.0), dtype.type(-np.inf))
            self.mask4, self.mmap = _own(mask.astype(dtype, copy=False), batch)
        #: query rows per head in a work item
        self.rows = max(1, (BLOCK_ROWS * 4 // dtype.itemsize) // (self.h // self.hkv))
        self.block_k = BLOCK_K
        low = lower(rules, batch=batch, heads=self.h, rows=self.rows, dtype=dtype,
                    scale=scale, mask_kind=mask_kind, block_k=BLOCK_K)
        self.lengths, self.offsets, self.slopes = low.lengths, low.offsets, low.slopes
        self.segments = low.segments
        self.user = low.user
        self.tile = (int(low.iparams[17]), int(low.iparams[18]))
        #: query rows per entry of the block mask's key ranges
        self.range_rows = int(low.iparams[19])
        self.fparams, self.iparams = low.fparams, low.iparams

    def query_items(self) -> np.ndarray:
        """(b, hk, q0, q1, k_lo, k_hi) per item, the largest first."""
        q0 = np.arange(0, self.tq, self.rows, dtype=np.int64)
        q1 = np.minimum(q0 + self.rows, self.tq)
        lo, hi = self._reach_keys(q0, q1)                         # (B, nq) each
        k_lo, k_hi = self._blocks_keys(q0)                        # (B|1, Hkv|1, nq) each
        shape = (self.n_batch, len(q0), self.hkv)
        item_lo = np.maximum(lo[:, :, None], np.swapaxes(k_lo, 1, 2))
        item_hi = np.maximum(item_lo, np.minimum(hi[:, :, None], np.swapaxes(k_hi, 1, 2)))
        grid = np.indices(shape)
        items = np.stack([grid[0], grid[2], q0[grid[1]], q1[grid[1]],
                          np.broadcast_to(item_lo, shape), np.broadcast_to(item_hi, shape)],
                         axis=-1)
        return _largest_first(items.reshape(-1, 6))

    def _reach_keys(self, q0: np.ndarray, q1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The keys ``[lo, hi)`` each batch row's query blocks ``[q0, q1)`` may see by the
        built-in rules (reach, key lengths, segments): (B, nq) each."""
        lo = np.empty((self.n_batch, len(q0)), dtype=np.int64)
        hi = np.empty_like(lo)
        by_offset: dict[int, tuple[list[int], list[int]]] = {}
        for b in range(self.n_batch):
            off = int(self.offsets[b])
            if off not in by_offset:
                reach = [self.rules.key_range(int(a), int(z), (off, off))
                         for a, z in zip(q0, q1, strict=True)]
                by_offset[off] = ([r[0] for r in reach], [r[1] for r in reach])
            lo[b], hi[b] = by_offset[off]
        hi = np.minimum(hi, self.lengths[:, None])
        if self.rules.segment_keys is not None:                # each row's segments
            lo = np.maximum(lo, self.segments[:, q0, 0])
            hi = np.minimum(hi, self.segments[:, q1 - 1, 1])
        return lo, hi

    def _blocks_keys(self, q0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The keys ``[lo, hi)`` a ``mask_mod``'s block mask leaves to the query blocks
        starting at ``q0`` of the heads of each key/value head: (B|1, Hkv|1, nq) each
        (every key without one; ``0, 0`` where it leaves none)."""
        if not self.iparams[16]:
            whole = np.array([[[0, self.tk]]], dtype=np.int64)
            return (np.broadcast_to(whole[..., :1], (1, 1, len(q0))),
                    np.broadcast_to(whole[..., 1:], (1, 1, len(q0))))
        ranges = self.user[7]                                   # (B|1, H|1, nr, 3)
        rows = np.minimum(np.arange(self.tq) // self.range_rows, ranges.shape[2] - 1)
        per_row = ranges[:, :, rows] if ranges.shape[2] != self.tq else ranges
        seen = per_row[..., 0] < per_row[..., 1]                # (B|1, H|1, Tq)
        far = np.iinfo(np.int64).max
        first = np.where(seen, per_row[..., 0], far)
        last = np.where(seen, per_row[..., 1], 0)
        if ranges.shape[1] > 1:                                 # the G heads of a group
            g = self.h // self.hkv
            first = first.reshape(first.shape[0], self.hkv, g, -1).min(axis=2)
            last = last.reshape(last.shape[0], self.hkv, g, -1).max(axis=2)
        first = np.minimum.reduceat(first, q0, axis=-1)
        last = np.maximum.reduceat(last, q0, axis=-1)
        none = first == far
        return np.where(none, 0, first), np.where(none, 0, last)

    def common(self) -> tuple[Any, ...]:
        """The arguments every kernel takes first: the arrays, maps, lengths, offsets,
        slopes, segments, the user's rules."""
        return (self.q4, self.k4, self.v4, self.qmap, self.kmap, self.vmap, self.mask4,
                self.mmap, self.lengths, self.offsets, self.slopes, self.segments, self.user)


def _largest_first(items: Sequence[tuple[int, ...]] | np.ndarray) -> np.ndarray:
    """Work items as an (n, 6) array, the largest (query rows × keys) first."""
    arr = np.asarray(items, dtype=np.int64).reshape(-1, 6)
    return arr[np.argsort(-(arr[:, 3] - arr[:, 2]) * (arr[:, 5] - arr[:, 4]), kind="stable")]
