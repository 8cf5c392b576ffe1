"""Segment ids and block masks in the CUDA kernels: the tables they read, and how.

Both hide keys by ranges the kernels narrow their loops to, so that packed
documents cost the sum of their squared lengths and a ``mask_mod`` costs its
visible area:

* **segment ids** (``segment_ids``), sorted in every row and at hand (the
  values of CuPy arrays and torch CUDA tensors are copied to the host once per
  call, as :func:`polyattn._interop.concrete_values` does): each query row
  sees exactly the keys ``[lo, hi)`` of its segment, and each key is seen by
  exactly the query rows ``[lo, hi)`` of its segment. :func:`tables` writes
  both as one int64 table ``segments`` (S, Tq + Tk, 2): row ``i < Tq`` holds
  query ``i``'s keys, row ``Tq + j`` key ``j``'s queries (S = 1 when every
  batch row has the same ids). A block of the forward and dQ kernels visits
  the keys from its first row's ``lo`` to its last row's ``hi`` (sorted ids:
  the union of its rows' ranges), a block of the dK/dV kernels the queries of
  its keys alike, and every score is tested against its row's range. Unsorted
  ids, or ids whose values are not at hand (traced), are refused
  (:func:`refusal`), and ``"auto"`` runs them elsewhere.
* **block masks** (:class:`polyattn.BlockMask`, built for the call's
  ``mask_mod``): the kernels read its int8 kinds (B|1, H|1, nq, nk), blocks of
  ``(bq, bk)`` rows and keys. A kernel block narrows its loop to the key blocks
  (dK/dV: query blocks) that are not empty for some block its rows (keys)
  touch (:func:`blocks_keys`, :func:`blocks_queries`), and per tile of its
  loop asks :func:`tile_kind`, whatever its own tile sizes: a tile that touches
  only empty blocks is skipped (never loaded, never scored), one that touches
  only full blocks is scored without calling the ``mask_mod``, any other
  evaluates it on every score. Forward and backward passes skip the same tiles.

Kernels compiled without them (:func:`mask_key` is ``None``) take never-read
placeholders and carry none of this code. Kernels never import their facade;
nothing here imports Numba before :func:`device_functions` is called (the
device functions are plain Python, which runs on NumPy arrays too).

Examples
--------
>>> from polyattn.rules.visibility import Rules
>>> ids = np.array([[0, 0, 1, 1, 1]])                 # two documents
>>> key, (segments, kinds, bq, bk) = tables(Rules(5, 5, segments=(ids, ids)), (1,))
>>> key, segments[0, :5].tolist()                    # each query's keys
((True, False), [[0, 2], [0, 2], [2, 5], [2, 5], [2, 5]])
>>> kinds = np.array([[[[2, 0, 1], [0, 2, 2]]]], dtype=np.int8)   # 2 × 3 blocks of 4 × 4
>>> [int(tile_kind(kinds, 0, 0, *tile, 4, 4))        # rows first, last; keys first, last
...  for tile in ((0, 3, 0, 3), (4, 7, 4, 11), (0, 3, 4, 7), (0, 7, 0, 11))]
[2, 2, 0, 1]
>>> blocks_keys(kinds, 0, 0, 0, 3, 4, 4, 0, 12)      # rows 0-3: the third key block too
(0, 12)
>>> blocks_queries(kinds, 0, 0, 0, 4, 7, 4, 4, 0, 8)  # keys 4-7: rows 4-7 only
(4, 8)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from polyattn._interop import concrete_values

#: The kinds of a block (:mod:`polyattn.blockmask`'s).
EMPTY, PARTIAL, FULL = 0, 1, 2

#: The specialisation key: (segment ids, block mask) the kernel reads.
MaskKey = tuple[bool, bool]


def mask_key(rules: Any) -> MaskKey | None:
    """What a call's kernels read: ``(segments, blocks)``, or ``None`` for neither."""
    segments = getattr(rules, "segments", None) is not None
    user = getattr(rules, "user", None)
    blocks = (getattr(rules, "blocks", None) is not None and user is not None
              and user.mask_mod is not None)
    return (segments, blocks) if segments or blocks else None


def refusal(rules: Any) -> str | None:
    """Why the kernels cannot take a call's segment ids (``None``: they can, or it has
    none): they lower ids sorted in every row, from their values."""
    segments = getattr(rules, "segments", None)
    if segments is None or rules.segment_keys is not None:
        return None
    if any(concrete_values(ids) is None for ids in segments):
        return ("it lowers segment ids as key ranges from their values, and these are "
                "not at hand (traced)")
    return ("it lowers segment ids sorted in every row (packed sequences) as key ranges, "
            "and these are not sorted")


def placeholders() -> tuple[np.ndarray, np.ndarray, np.int64, np.int64]:
    """``(segments, kinds, bq, bk)`` of kernels that read neither (never read)."""
    return (np.zeros((1, 1, 2), dtype=np.int64), np.full((1, 1, 1, 1), FULL, dtype=np.int8),
            np.int64(1), np.int64(1))


def tables(rules: Any, batch: tuple[int, ...]) -> tuple[MaskKey | None, tuple[Any, ...]]:
    """``(key, (segments, kinds, bq, bk))`` of a call: :func:`mask_key` and the host
    tables of the module docstring (placeholders for what it does not use)."""
    key = mask_key(rules)
    segments, kinds, bq, bk = placeholders()
    if key is not None and key[0]:
        segments = _segment_table(rules, batch)
    if key is not None and key[1]:
        kinds = _leading_batch(np.asarray(rules.blocks.kinds, dtype=np.int8), 3, batch)
        bq, bk = (np.int64(n) for n in rules.blocks.block)
    return key, (segments, kinds, bq, bk)


def describe(rules: Any) -> str | None:
    """What the kernels make of a call's segment ids and block mask, for ``explain()``
    (``None``: it has neither)."""
    key = mask_key(rules)
    if key is None:
        return None
    parts = []
    if key[0]:
        parts.append("segment ids as each row's key range (key tiles outside the segments "
                     "of a block's rows never loaded)")
    if key[1]:
        c = rules.blocks.counts
        parts.append("a kernel tile touching only empty blocks of the block mask skipped, "
                     "one touching only full ones scored without the mask_mod (of its "
                     f"{tuple(rules.blocks.block)} blocks {c['empty']} are empty, "
                     f"{c['partial']} partial, {c['full']} full)")
    return "; ".join(parts)


def _leading_batch(x: np.ndarray, trailing: int, batch: tuple[int, ...]) -> np.ndarray:
    """``x`` (B…|1, …) with ``trailing`` axes after the batch ones, as (B|1, …): one
    entry when it is the same for every batch row, else one per flat batch index."""
    lead, rest = x.shape[:x.ndim - trailing], x.shape[x.ndim - trailing:]
    if math.prod(lead) <= 1:
        return np.ascontiguousarray(x.reshape(1, *rest))
    full = np.broadcast_to(x.reshape((1,) * (len(batch) - len(lead)) + x.shape),
                           (*batch, *rest))
    return np.ascontiguousarray(full.reshape(math.prod(batch), *rest))


def _segment_table(rules: Any, batch: tuple[int, ...]) -> np.ndarray:
    """(S, Tq + Tk, 2) int64: the keys of each query's segment, then the queries of each
    key's segment (ids sorted in every row: :func:`refusal` is ``None``)."""
    q_ids, k_ids = (np.asarray(concrete_values(ids)) for ids in rules.segments)
    tq, tk = q_ids.shape[-1], k_ids.shape[-1]
    lead = np.broadcast_shapes(q_ids.shape[:-1], k_ids.shape[:-1])
    qv = np.broadcast_to(q_ids, (*lead, tq)).reshape(-1, tq)
    kv = np.broadcast_to(k_ids, (*lead, tk)).reshape(-1, tk)
    rows = []
    for qr, kr in zip(qv, kv, strict=True):
        keys = [np.searchsorted(kr, qr, side=side) for side in ("left", "right")]
        queries = [np.searchsorted(qr, kr, side=side) for side in ("left", "right")]
        rows.append(np.concatenate([np.stack(keys, axis=-1), np.stack(queries, axis=-1)]))
    table = np.stack(rows).astype(np.int64).reshape(*lead, tq + tk, 2)
    return _leading_batch(table, 2, batch)


def table_types() -> tuple[Any, ...]:
    """The Numba types of ``(segments, kinds, bq, bk)`` in a kernel signature."""
    from numba import types as nt

    return (nt.Array(nt.int64, 3, "A"), nt.Array(nt.int8, 4, "A"), nt.int64, nt.int64)


def suffix(masks: MaskKey | None) -> str:
    """A kernel-name suffix that tells the specialisations apart."""
    if masks is None:
        return ""
    return ("_segments" if masks[0] else "") + ("_blocks" if masks[1] else "")


# --------------------------------------------------------------------------- #
# Device functions (compiled by :func:`device_functions`)
# --------------------------------------------------------------------------- #

def segment_of(segments, b, n):  # type: ignore[no-untyped-def]
    """Row ``n`` of batch row ``b``'s segment table: ``(lo, hi)``."""
    sb = b if segments.shape[0] > 1 else 0
    return segments[sb, n, 0], segments[sb, n, 1]


def segment_span(segments, b, first, last, lo, hi):  # type: ignore[no-untyped-def]
    """``[lo, hi)`` narrowed to what rows ``first`` … ``last`` of the segment table
    see (sorted ids: from the first one's ``lo`` to the last one's ``hi``)."""
    sb = b if segments.shape[0] > 1 else 0
    new_lo = max(lo, segments[sb, first, 0])
    return new_lo, max(new_lo, min(hi, segments[sb, last, 1]))


def blocks_keys(kinds, b, h, first, last, bq, bk, lo, hi):  # type: ignore[no-untyped-def]
    """Keys ``[lo, hi)`` narrowed to the key blocks some query block of rows ``first``
    … ``last`` does not find empty (``lo >= hi``: none)."""
    kb = b if kinds.shape[0] > 1 else 0
    kh = h if kinds.shape[1] > 1 else 0
    new_lo = hi
    new_hi = min(lo, hi)
    if lo < hi:
        for qb in range(first // bq, last // bq + 1):
            for c in range(lo // bk, (hi - 1) // bk + 1):
                if kinds[kb, kh, qb, c] != 0:
                    new_lo = min(new_lo, max(lo, c * bk))
                    new_hi = max(new_hi, min(hi, c * bk + bk))
    if new_lo >= new_hi:
        new_lo = hi
        new_hi = hi
    return new_lo, new_hi


def blocks_queries(kinds, b, h_first, h_last, first, last, bq, bk, lo, hi):  # type: ignore[no-untyped-def]
    """Query rows ``[lo, hi)`` narrowed to the query blocks that find some key block of
    keys ``first`` … ``last`` not empty, for some head ``h_first`` … ``h_last``
    (``lo >= hi``: none)."""
    kb = b if kinds.shape[0] > 1 else 0
    if kinds.shape[1] == 1:
        h_first = 0
        h_last = 0
    new_lo = hi
    new_hi = min(lo, hi)
    if lo < hi:
        for kh in range(h_first, h_last + 1):
            for c in range(first // bk, last // bk + 1):
                for qb in range(lo // bq, (hi - 1) // bq + 1):
                    if kinds[kb, kh, qb, c] != 0:
                        new_lo = min(new_lo, max(lo, qb * bq))
                        new_hi = max(new_hi, min(hi, qb * bq + bq))
    if new_lo >= new_hi:
        new_lo = hi
        new_hi = hi
    return new_lo, new_hi


def tile_kind(kinds, b, h, q_first, q_last, k_first, k_last, bq, bk):  # type: ignore[no-untyped-def]
    """The kind of the tile of rows ``q_first`` … ``q_last`` and keys ``k_first`` …
    ``k_last``: 0 empty (every block it touches is), 2 full (likewise), else 1."""
    kb = b if kinds.shape[0] > 1 else 0
    kh = h if kinds.shape[1] > 1 else 0
    seen = 0
    every = 1
    for qb in range(q_first // bq, q_last // bq + 1):
        for c in range(k_first // bk, k_last // bk + 1):
            kind = kinds[kb, kh, qb, c]
            if kind != 0:
                seen = 1
            if kind != 2:
                every = 0
    return seen * (1 + every)


def segment_hides(segments, b, n, x):  # type: ignore[no-untyped-def]
    """Whether ``x`` lies outside the range of row ``n`` of the segment table."""
    sb = b if segments.shape[0] > 1 else 0
    return (x < segments[sb, n, 0]) | (x >= segments[sb, n, 1])


@functools.cache
def device_functions() -> tuple[Any, ...]:
    """``(segment_of, segment_span, blocks_keys, blocks_queries, tile_kind,
    segment_hides)`` as inlined CUDA device functions."""
    from polyattn.backends.cuda.environment import _cuda

    device = _cuda().jit(device=True, inline=True)
    return tuple(device(f) for f in (segment_of, segment_span, blocks_keys, blocks_queries,
                                     tile_kind, segment_hides))
