"""One call's plan: the arrays the kernels read, and the work items they are split into.

:class:`Call` holds query, key, value and the mask without their broadcast batch axes
(with the map from each batch row to its row of each), the rules lowered by
:func:`.parameters.lower`, and the work items of the forward pass and of the two loops
of the backward pass, the largest first.
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
        self.fparams, self.iparams = low.fparams, low.iparams

    def query_items(self) -> np.ndarray:
        """(b, hk, q0, q1, k_lo, k_hi) per item, the largest first."""
        items = []
        for b in range(self.n_batch):
            off = int(self.offsets[b])
            for q0 in range(0, self.tq, self.rows):
                q1 = min(q0 + self.rows, self.tq)
                lo, hi = self.rules.key_range(q0, q1, (off, off))
                hi = min(hi, int(self.lengths[b]))
                if self.rules.segment_keys is not None:        # this row's segments
                    lo = max(lo, int(self.segments[b, q0, 0]))
                    hi = min(hi, int(self.segments[b, q1 - 1, 1]))
                for hk in range(self.hkv):
                    k_lo, k_hi = self._blocks_keys(b, hk, q0, q1)
                    item_lo, item_hi = max(lo, k_lo), min(hi, k_hi)
                    items.append((b, hk, q0, q1, item_lo, max(item_lo, item_hi)))
        return _largest_first(items)

    def _blocks_keys(self, b: int, hk: int, q0: int, q1: int) -> tuple[int, int]:
        """The keys ``[lo, hi)`` a ``mask_mod``'s block mask leaves to query rows ``[q0, q1)``
        of the heads of key/value head ``hk`` (every key without one)."""
        ranges = self.user[7]                                   # (B|1, H|1, nq, 2)
        rows, _ = self.tile
        g = self.h // self.hkv
        heads = slice(hk * g, (hk + 1) * g) if ranges.shape[1] > 1 else slice(0, 1)
        sub = ranges[b if ranges.shape[0] > 1 else 0, heads,
                     min(q0 // rows, ranges.shape[2] - 1):(q1 - 1) // rows + 1]
        seen = sub[..., 0] < sub[..., 1]
        if not seen.any():
            return 0, 0
        return int(sub[..., 0][seen].min()), int(sub[..., 1][seen].max())

    def key_items(self) -> np.ndarray:
        """(b, hk, k0, k1, 0, Tq) per block of keys below each batch row's length."""
        block = self.block_k
        items = [(b, hk, k0, min(k0 + block, self.tk), 0, self.tq)
                 for b in range(self.n_batch) for hk in range(self.hkv)
                 for k0 in range(0, int(self.lengths[b]), block)]
        return _largest_first(items)

    def common(self) -> tuple[Any, ...]:
        """The arguments every kernel takes first: the arrays, maps, lengths, offsets,
        slopes, segments, the user's rules."""
        return (self.q4, self.k4, self.v4, self.qmap, self.kmap, self.vmap, self.mask4,
                self.mmap, self.lengths, self.offsets, self.slopes, self.segments, self.user)


def _largest_first(items: Sequence[tuple[int, ...]]) -> np.ndarray:
    """Work items as an (n, 6) array, the largest (query rows × keys) first."""
    arr = np.asarray(items, dtype=np.int64).reshape(-1, 6)
    return arr[np.argsort(-(arr[:, 3] - arr[:, 2]) * (arr[:, 5] - arr[:, 4]), kind="stable")]
