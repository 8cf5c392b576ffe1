"""The rules the NumPy path applies element by element inside a tile of scores.

Rules users write (docs/rules.rst): a ``score_mod`` changes the scores of a tile, a
``mask_mod`` hides some of them; both are called through :mod:`polyattn.rules.user`, as
the Array-API paths call them, once per tile (or per run of block-mask tiles) on index
arrays that broadcast to it: ``b`` (1, 1, 1), ``h`` (G, 1, 1) (the query heads of the
work item), ``q_idx`` (rows, 1) and ``kv_idx`` (1, keys), with ``mod_args`` as
:class:`~polyattn.rules.user.Table` objects over NumPy (``array_api_compat.numpy``).

A ``mask_mod`` comes with its block mask (:class:`polyattn.BlockMask`, ``rules.blocks``),
which :class:`TileRules` reads per (batch row, key/value head): each query block's keys
from its first non-empty key block to the end of its last (:meth:`TileRules.key_ranges`),
which narrow the rows' visible keys in :mod:`.plan`, and whether a query block has a
non-empty tile among some keys (:meth:`TileRules.sees`), so that the path computes no
rows of a key block where all their block-mask tiles are empty; and inside a tile
(:meth:`TileRules.hide`), per block-mask tile it touches, nothing where the tile is full,
every score hidden where it is empty, and the ``mask_mod`` evaluated only where it is
partial. Without a block mask (its values were
not at hand) the ``mask_mod`` is evaluated on every tile.

Segment ids that are not sorted (so not key ranges, :mod:`.plan`) hide the keys of other
segments by comparing the ids of a tile's rows and keys (:func:`hide_other_segments`).
"""

from __future__ import annotations

from typing import Any

import array_api_compat.numpy as np_xp
import numpy as np

from polyattn.rules import user as _user
from polyattn.rules.visibility import Rules

#: Kinds of a tile of a block mask (those of :mod:`polyattn.blockmask`).
EMPTY, PARTIAL, FULL = 0, 1, 2


class TileRules:
    """A call's ``score_mod``, ``mask_mod`` and block mask, as the NumPy path's tiles apply them.

    ``batch`` (B…), ``g`` (query heads per key/value head) and ``tk`` are the call's.
    The block mask's kinds and key ranges of each (batch row, key/value head) are found
    once per call, by the first work item that needs them.
    """

    def __init__(self, rules: Rules, batch: tuple[int, ...], g: int, tk: int) -> None:
        assert rules.user is not None
        self.user = rules.user
        self.scores = rules.user.score_mod is not None
        self.masks = rules.user.mask_mod is not None
        self.blocks = rules.blocks if self.masks else None
        self.batch, self.g, self.tk = batch, g, tk
        self._kinds: dict[tuple[Any, ...], np.ndarray] = {}
        self._ranges: dict[tuple[Any, ...], tuple[np.ndarray, ...]] = {}
        self._gapless: dict[tuple[Any, ...], bool] = {}

    def indices(self, b: tuple[int, ...], hk: int, heads: range, q0: int, q1: int, k0: int,
                k1: int) -> tuple[np.ndarray, ...]:
        """``(b, h, q_idx, kv_idx)`` for query heads ``hk·G + heads``, rows q0:q1, keys k0:k1."""
        flat = int(np.ravel_multi_index(b, self.batch)) if self.batch else 0
        first = hk * self.g
        return (np.full((1, 1, 1), flat, dtype=np.int64),
                np.arange(first + heads.start, first + heads.stop, dtype=np.int64
                          ).reshape(-1, 1, 1),
                np.arange(q0, q1, dtype=np.int64)[:, None],
                np.arange(k0, k1, dtype=np.int64)[None, :])

    def score(self, s: np.ndarray, b: tuple[int, ...], hk: int, q0: int, q1: int, k0: int,
              k1: int, *, grad: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """``score_mod`` of the tile ``s`` (G, q1 - q0, k1 - k0) and, with ``grad``, its
        derivative with respect to the score (both shaped as ``s``, possibly read-only)."""
        idx = self.indices(b, hk, range(s.shape[0]), q0, q1, k0, k1)
        if grad:
            return _user.score_and_grad_at(self.user, s, idx, np_xp, None)
        return _user.score_at(self.user, s, idx, np_xp), None

    def kinds(self, b: tuple[int, ...], hk: int) -> np.ndarray:
        """The block mask's kinds (G|1, nq, nk) of the query heads of (b, hk)."""
        key = (b, hk)
        found = self._kinds.get(key)
        if found is None:
            assert self.blocks is not None
            k = np.asarray(self.blocks.kinds)                   # (B…|1 …, H|1, nq, nk)
            lead = k.ndim - 3                                   # right-aligned to B…
            at = b[len(b) - lead:] if lead else ()
            k = k[tuple(0 if k.shape[d] == 1 else at[d] for d in range(lead))]
            if k.shape[0] > 1:
                k = k[hk * self.g:(hk + 1) * self.g]
            found = self._kinds[key] = k
        return found

    def key_ranges(self, b: tuple[int, ...], hk: int, q0: int, q1: int,
                   ) -> tuple[np.ndarray, np.ndarray] | None:
        """Keys ``[lo, hi)`` (int64, (q1 - q0,) each) outside which the block mask leaves
        nothing to rows q0:q1 of any query head of (b, hk): from the first key of each
        row's query block's first non-empty key block to the end of its last (0, 0 where
        all are empty). ``None`` without a block mask."""
        if self.blocks is None:
            return None
        first, last, _ = self._seen(b, hk)
        block = np.arange(q0, q1) // self.blocks.block[0]
        return first[block], last[block]

    def gapless(self, b: tuple[int, ...], hk: int) -> bool:
        """Whether each query block's non-empty key blocks of (b, hk) are one run (causal,
        windows, sorted documents, prefix-LM): :meth:`key_ranges` then says all that
        :meth:`sees` would."""
        self._seen(b, hk)
        return self._gapless[(b, hk)]

    def sees(self, b: tuple[int, ...], hk: int, q0: int, q1: int, k0: int, k1: int,
             ) -> np.ndarray:
        """Bool (q1 - q0,): whether the query block of each of rows q0:q1 has a non-empty
        block-mask tile among those keys k0:k1 touch, for some query head of (b, hk)."""
        assert self.blocks is not None
        _, _, count = self._seen(b, hk)
        bq, bk = self.blocks.block
        block = np.arange(q0, q1) // bq
        return count[block, (k1 - 1) // bk + 1] > count[block, k0 // bk]

    def _seen(self, b: tuple[int, ...], hk: int) -> tuple[np.ndarray, ...]:
        """Per query block of (b, hk) (any of its query heads): the first key of its first
        non-empty key block, the end of its last (0, 0 where every one is empty), and the
        number of non-empty key blocks before each key block (nq, nk + 1)."""
        key = (b, hk)
        found = self._ranges.get(key)
        if found is None:
            assert self.blocks is not None
            bk = self.blocks.block[1]
            seen = (self.kinds(b, hk) != EMPTY).any(axis=0)     # (nq, nk)
            nk = seen.shape[-1]
            some = seen.any(axis=-1)
            first = np.where(some, seen.argmax(axis=-1) * bk, 0).astype(np.int64)
            last = np.where(some, np.minimum((nk - seen[:, ::-1].argmax(axis=-1)) * bk,
                                             self.tk), 0).astype(np.int64)
            count = np.zeros((seen.shape[0], nk + 1), dtype=np.int64)
            np.cumsum(seen, axis=-1, out=count[:, 1:])
            span = -(-last // bk) - first // bk                 # key blocks first..last
            self._gapless[key] = bool((count[:, -1] == span).all())
            found = self._ranges[key] = (first, last, count)
        return found

    def hide(self, s: np.ndarray, b: tuple[int, ...], hk: int, q0: int, q1: int, k0: int,
             k1: int, value: float) -> None:
        """Set the scores of ``s`` (G, q1 - q0, k1 - k0) that the ``mask_mod`` hides to
        ``value``: per block-mask tile, none of a full one, all of an empty one, and where
        the ``mask_mod`` is False on a partial one (evaluated there only)."""
        if self.blocks is None:
            idx = self.indices(b, hk, range(s.shape[0]), q0, q1, k0, k1)
            np.copyto(s, value, where=np.logical_not(_user.visible_at(self.user, idx, np_xp, None)))
            return
        kinds = self.kinds(b, hk)
        bq, bk = self.blocks.block
        qb0, qb1 = q0 // bq, (q1 - 1) // bq + 1
        kb0, kb1 = k0 // bk, (k1 - 1) // bk + 1
        sub = kinds[:, qb0:qb1, kb0:kb1]                        # (G|1, query, key blocks)
        for n in np.flatnonzero((sub != FULL).any(axis=(0, 2))).tolist():
            row = sub[:, n]                                     # (G|1, key blocks)
            r0, r1 = max(q0, (qb0 + n) * bq) - q0, min(q1, (qb0 + n + 1) * bq) - q0
            if row.shape[0] == 1 or (row == row[:1]).all():     # the same for every head
                self._hide_row(s, b, hk, range(s.shape[0]), row[0].tolist(), r0, r1, q0,
                               k0, k1, kb0, value)
                continue
            for g in range(row.shape[0]):
                self._hide_row(s[g:g + 1], b, hk, range(g, g + 1), row[g].tolist(), r0, r1,
                               q0, k0, k1, kb0, value)

    def _hide_row(self, s: np.ndarray, b: tuple[int, ...], hk: int, heads: range,
                  kinds: list[int], r0: int, r1: int, q0: int, k0: int, k1: int, kb0: int,
                  value: float) -> None:
        """:meth:`hide` on rows r0:r1 of ``s`` (one query block), heads ``heads``, whose key
        blocks ``kb0, kb0 + 1, …`` have ``kinds``: runs of empty blocks hidden, runs of
        partial ones given to the ``mask_mod`` together."""
        assert self.blocks is not None
        bk = self.blocks.block[1]
        start = 0
        while start < len(kinds):
            kind, end = kinds[start], start + 1
            while end < len(kinds) and kinds[end] == kind:
                end += 1
            c0, c1 = max(k0, (kb0 + start) * bk) - k0, min(k1, (kb0 + end) * bk) - k0
            if kind == EMPTY:
                s[:, r0:r1, c0:c1] = value
            elif kind == PARTIAL:
                idx = self.indices(b, hk, heads, q0 + r0, q0 + r1, k0 + c0, k0 + c1)
                seen = _user.visible_at(self.user, idx, np_xp, None)
                np.copyto(s[:, r0:r1, c0:c1], value, where=np.logical_not(seen))
            start = end


def hide_other_segments(ids: tuple[np.ndarray, np.ndarray], s: np.ndarray, b: tuple[int, ...],
                        q0: int, q1: int, k0: int, k1: int, value: float) -> None:
    """Set the scores of ``s`` (G, q1 - q0, k1 - k0) whose query and key segment ids differ
    to ``value``; ``ids`` are the call's (query ids (B…|1, Tq), key ids (B…|1, Tk))."""
    q_ids, k_ids = (x[tuple(0 if x.shape[d] == 1 else b[d] for d in range(len(b)))]
                    for x in ids)
    np.copyto(s, value, where=q_ids[q0:q1, None] != k_ids[None, k0:k1])
