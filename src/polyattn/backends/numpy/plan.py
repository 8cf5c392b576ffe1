"""The NumPy path's plan: work items, their visible keys, tiles of the visible band.

A call is cut into independent work items, one per (batch index, key/value
head, query block); the ``G = H // Hkv`` query heads that share a key/value
head are stacked into one item. :class:`_Problem` holds the arrays, sizes and
rules every item reads (and each thread's scratch), :class:`_Item` one item's
positions and visible keys ``[lo, hi)`` per row (docs/semantics.rst),
:func:`_band_tiles` the (rows, keys) rectangles of scores that follow the
visible band, and :func:`_hide_band` the entries of a tile outside it: the
causal mask, the window and key lengths are lowered here (as that band) and
nowhere else in the family, and so are sorted segment ids (each row's keys narrowed
to its segment's, :attr:`~polyattn.rules.visibility.Rules.segment_keys`; a tile's
keys outside them hidden per run of rows in one segment). A block mask narrows each
row's keys to those of its query block's non-empty key blocks
(:meth:`.tile_rules.TileRules.key_ranges`); such bounds need not grow with the row, and
:func:`_band_tiles` then cuts a key block's rows into runs. The rules that change the
scores themselves (soft-capping, ALiBi's bias, a ``score_mod``, dropout) are lowered in
:mod:`.scores`, the ``mask_mod`` and unsorted segment ids in :mod:`.tile_rules`.
:mod:`.forward` and :mod:`.backward` both run on this plan.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from polyattn.backends.numpy.tile_rules import TileRules
from polyattn.rules.element import position
from polyattn.rules.lowering import UNBOUNDED, reach
from polyattn.rules.visibility import Rules

#: Query rows per work item in float32, summed over the G heads of a group
#: (bq = BLOCK_Q // G); half as many in float64, so a block of scores keeps its size.
BLOCK_Q = 1024
#: Keys per block of scores; a (BLOCK_Q, BLOCK_K) float32 block is 1 MiB, half the
#: L2 cache of a core of the x86-64 machines measured (1024 x 256 was the fastest
#: of 128..4096 x 64..512 there, by a few per cent). An item with fewer rows (a short
#: query sequence) takes proportionally more keys per block, up to the same area.
BLOCK_K = 256
#: A key block in which some row's ``Σ exp(score - m)`` exceeds this is redone with a
#: new maximum. Between such blocks every exponential stays below it (e**11 for
#: 2**16), far from overflow in float32 and float64.
RESCALE_LIMIT = 2.0**16


def _blas_ready(x: np.ndarray) -> np.ndarray:
    """``x``, or a C-contiguous copy where its trailing matrices cannot go to BLAS as they are.

    NumPy's ``matmul`` hands a matrix to BLAS when its elements are contiguous within a
    row and its row stride is a whole number of elements, at least a row long (the
    leading dimension): the (T, E) matrices of a (B…, T, H, E) array's (B…, H, T, E)
    view qualify, with row stride H·E. Broadcast leading axes are kept.
    """
    item = x.itemsize
    rows, cols = x.shape[-2:]
    row_stride, col_stride = x.strides[-2:]
    if cols <= 1 or col_stride == item:
        if rows <= 1 or (row_stride % item == 0 and row_stride >= cols * item):
            return x
    return np.ascontiguousarray(x)


def _row(a: np.ndarray, b: tuple[int, ...]) -> Any:
    """``a[b]`` for an array whose leading ``len(b)`` axes broadcast against B… (size 1 or full)."""
    return a[tuple(0 if a.shape[d] == 1 else b[d] for d in range(len(b)))]


class _Problem:
    """The arrays, sizes and rules every work item reads, and the per-thread scratch.

    ``rules`` (a :class:`~polyattn.rules.visibility.Rules`) are the call's rules,
    causality included; their key lengths and slopes are read as NumPy arrays.
    """

    def __init__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                 scale: float, rules: Rules) -> None:
        self.q, self.k, self.v, self.mask = q, k, v, mask
        self.dtype = q.dtype
        self.batch = tuple(q.shape[:-3])
        self.h = q.shape[-3]
        self.qscale = self.dtype.type(scale)
        self.hkv = k.shape[-3]
        self.g = q.shape[-3] // self.hkv
        self.tq, self.tk = q.shape[-2], k.shape[-2]
        self.e, self.ev = q.shape[-1], v.shape[-1]
        self.rules = rules
        # p_i = i + offset + shift·Tk_b; how far left and right of p_i a query sees (None:
        # unbounded, also where a side reaches every key from every position)
        self.offset, self.shift, left, right = reach(self.rules, covering=True)
        self.left = None if left == UNBOUNDED else left
        self.right = None if right == UNBOUNDED else right
        # sorted segment ids: (lo, hi) keys of each query's segment, (B…|1, Tq) each
        self.segments = self.rules.segment_keys
        # unsorted ones: (query ids, key ids), compared in each tile
        self.segment_ids = (None if rules.segments is None or self.segments is not None
                            else (np.asarray(rules.segments[0]), np.asarray(rules.segments[1])))
        # the user's score_mod, mask_mod and block mask (None without them)
        self.user = (None if rules.user is None
                     else TileRules(rules, self.batch, self.g, self.tk))
        self.score_mod = self.user is not None and self.user.scores
        #: whether the shift -m rides in the product [q·scale | -m] @ [k | 1]ᵀ: not where
        #: soft-capping or a score_mod must see the scores themselves
        self.shift_in_product = rules.softcap is None and not self.score_mod
        self.banded = self.left is not None or self.right is not None
        self.lengths = (None if self.rules.key_lengths is None
                        else np.asarray(self.rules.key_lengths))     # (B…|1 …), integers
        self.slopes = (None if self.rules.alibi is None
                       else np.asarray(self.rules.alibi, dtype=self.dtype))  # (B…|1 …, H|1)
        self.block_k = max(1, int(BLOCK_K))
        rows = max(1, int(BLOCK_Q) * 4 // self.dtype.itemsize)
        self.bq = max(1, rows // self.g)             # query rows per head in an item
        self.block_elems = rows * self.block_k       # entries of a full block of scores
        self.limit = self.dtype.type(RESCALE_LIMIT)
        self.tiny = self.dtype.type(2.0**-60)
        self.ones = np.ones(self.tk, dtype=self.dtype)
        self.keys: dict[tuple[Any, ...], np.ndarray] = {}
        self.pending: dict[tuple[Any, ...], threading.Event] = {}  # set once built
        self.failed: dict[tuple[Any, ...], BaseException] = {}     # builds that raised
        self.scratch = threading.local()             # freed with the call
        self._edges: tuple[np.ndarray, np.ndarray] | None = None

    def key_block(self, rows: int) -> int:
        """Keys per block for an item of ``rows`` query rows per head.

        Where every row sees every key (up to its batch row's key length), an item
        with fewer rows than a full block (short Tq) takes wider key blocks, so its
        block of scores keeps the cache-sized area; under a causal mask or a window,
        narrower blocks waste less outside the visible band.
        """
        if self.banded or self.segments is not None or self.narrowed:
            return self.block_k
        return max(self.block_k, self.block_elems // (self.g * rows))

    @property
    def narrowed(self) -> bool:
        """Whether a block mask narrows the rows' keys (:meth:`key_ranges`)."""
        return self.user is not None and self.user.blocks is not None

    def key_ranges(self, b: tuple[int, ...], q0: int, q1: int, hk: int = 0,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Positions ``p_i`` and visible keys ``[lo_i, hi_i)`` of queries q0:q1 in batch row b
        (and key/value head ``hk``, which a block mask may tell apart).

        Three int64 arrays (q1 - q0,). Key ``j`` may be visible to query ``i`` (by key
        length, causal mask, window, segment and block mask; ``attn_mask`` and the
        ``mask_mod`` inside a tile aside) only if ``lo_i <= j < hi_i``. Both bounds are
        non-decreasing in ``i`` (so the rows that see some key are one run, and so are
        those that see any given key) except where a block mask narrows them.
        """
        pos, lo, hi = self.band_ranges(b, q0, q1)
        if self.segments is not None:          # sorted ids: bounds that grow with i too
            first, last = (_row(s, b)[q0:q1] for s in self.segments)
            lo, hi = np.maximum(lo, first), np.minimum(hi, last)
        blocks = None if self.user is None else self.user.key_ranges(b, hk, q0, q1)
        if blocks is not None:
            lo, hi = np.maximum(lo, blocks[0]), np.minimum(hi, blocks[1])
        return pos, lo, hi

    def rows_seeing(self, b: tuple[int, ...], hk: int, q0: int, q1: int,
                    ) -> Callable[[int, int], np.ndarray] | None:
        """With a block mask whose query blocks' non-empty key blocks are not one run each,
        which of rows q0:q1 of (b, hk) have a non-empty tile among keys k0:k1, as a function
        of (k0, k1) for :func:`_band_tiles`; else ``None`` (:meth:`key_ranges` says it all)."""
        if self.user is None or not self.narrowed or self.user.gapless(b, hk):
            return None
        return partial(self.user.sees, b, hk, q0, q1)

    def band_ranges(self, b: tuple[int, ...], q0: int, q1: int,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`key_ranges` without the segments: key lengths, causal mask and window."""
        n = self.tk if self.lengths is None else int(_row(self.lengths, b))   # Tk_b
        pos = position(np.arange(q0, q1, dtype=np.int64), self.offset, self.shift, n)  # p_i
        if self.right is None:
            hi = np.full(q1 - q0, n, dtype=np.int64)
        else:
            hi = np.clip(pos + (self.right + 1), 0, n)
        if self.left is None:
            lo = np.zeros(q1 - q0, dtype=np.int64)
        else:
            lo = np.clip(pos - self.left, 0, n)
        return pos, lo, hi

    def neg_slopes(self, b: tuple[int, ...], hk: int) -> np.ndarray | None:
        """``-slope_h`` (G, 1, 1) of the query heads of item (b, hk); ``None`` without ALiBi."""
        if self.slopes is None:
            return None
        heads = _row(self.slopes, b)                 # (H|1,)
        if heads.shape[-1] != 1:
            heads = heads[hk * self.g:(hk + 1) * self.g]
        return -np.broadcast_to(heads.reshape(-1, 1, 1), (self.g, 1, 1))   # (G, 1, 1)

    def edges(self, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
        """Bool (rows, cols) ``x >= t`` and its complement ``x < t`` (row t, column x).

        Slices of two triangles built once per call: a window's or a causal mask's
        edge moves one key per query row, so its hidden part of a tile is one of them.
        """
        e = self._edges
        if e is None or e[0].shape[0] < rows or e[0].shape[1] < cols:
            n_rows, n_cols = max(rows, self.bq), max(cols, self.block_k)
            upper = np.arange(n_cols)[None, :] >= np.arange(n_rows)[:, None]
            e = self._edges = (upper, ~upper)
        return e[0][:rows, :cols], e[1][:rows, :cols]

    def extended_keys(self, b: tuple[int, ...], hk: int) -> np.ndarray:
        """``[k | 1]`` (Tk, E + 1) of (b, hk), built once per call.

        Inline, the first item that needs them builds them; on the pool, the job of
        :meth:`build_pending` does, queued ahead of every item.
        """
        key = (b, hk)
        ke = self.keys.get(key)
        if ke is None:
            built = self.pending.get(key)
            if built is None:
                ke = self.keys[key] = self.build_keys(b, hk)
            else:                                    # being built by a pool worker
                built.wait()
                ke = self.keys.get(key)
                if ke is None:                       # the build raised: so does the item
                    raise self.failed[key]
        return ke

    def build_pending(self, b: tuple[int, ...], hk: int) -> None:
        """The pool's job for :meth:`extended_keys` (b, hk); wakes the items waiting on it."""
        try:
            self.keys[(b, hk)] = self.build_keys(b, hk)
        except BaseException as e:
            self.failed[(b, hk)] = e
            raise
        finally:
            self.pending[(b, hk)].set()

    def build_keys(self, b: tuple[int, ...], hk: int) -> np.ndarray:
        """The array of :meth:`extended_keys`, built afresh."""
        ke = np.empty((self.tk, self.e + 1), dtype=self.dtype)
        ke[:, :self.e] = self.k[(*b, hk)]
        ke[:, self.e] = 1.0
        return ke

    def buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A scratch array of this thread, reused by the items it runs in this call."""
        size = math.prod(shape)
        buffers = self.scratch.__dict__
        a = buffers.get(name)
        if a is None or a.size < size:
            a = buffers[name] = np.empty(max(size, 1), dtype=self.dtype)
        return a[:size].reshape(shape)

    def mask_block(self, b: tuple[int, ...], hk: int, q0: int, q1: int, k0: int,
                   k1: int) -> np.ndarray | None:
        """The mask for item (b, hk) and block (q0:q1, k0:k1), shaped (G|1, bq|1, bk|1)."""
        m = self.mask
        if m is None:
            return None
        idx = tuple(0 if m.shape[d] == 1 else b[d] for d in range(m.ndim - 3))
        heads = slice(0, 1) if m.shape[-3] == 1 else slice(hk * self.g, (hk + 1) * self.g)
        rows = slice(0, 1) if m.shape[-2] == 1 else slice(q0, q1)
        cols = slice(0, 1) if m.shape[-1] == 1 else slice(k0, k1)
        ix: tuple[Any, ...] = (*idx, heads, rows, cols)
        return m[ix]


class _Item:
    """One work item: batch row ``b``, key/value head ``hk``, queries ``q0:q1``.

    With the positions ``pos`` and visible keys ``[lo, hi)`` of its rows
    (:meth:`_Problem.key_ranges`) and the negated ALiBi slopes of its G heads.
    """

    __slots__ = ("b", "band", "hi", "hk", "lo", "neg_slopes", "pos", "q0", "q1", "sees",
                 "segments")

    def __init__(self, p: _Problem, b: tuple[int, ...], hk: int, q0: int) -> None:
        self.b, self.hk, self.q0 = b, hk, q0
        self.q1 = min(q0 + p.bq, p.tq)
        self.pos, self.lo, self.hi = p.key_ranges(b, q0, self.q1, hk)
        #: the (lo, hi) of the band alone, and of each row's segment, where there are segments
        self.band, self.segments = (self.lo, self.hi), None
        if p.segments is not None or p.narrowed:
            self.band = p.band_ranges(b, q0, self.q1)[1:]
        if p.segments is not None:
            self.segments = tuple(_row(s, b)[q0:self.q1] for s in p.segments)
        self.sees = p.rows_seeing(b, hk, q0, self.q1)
        self.neg_slopes = p.neg_slopes(b, hk)


def _hide_band(p: _Problem, it: _Item, s: np.ndarray, r0: int, r1: int, k0: int, k1: int,
               value: float) -> None:
    """Set the entries of ``s`` (G, r1 - r0, k1 - k0) outside the visible band to ``value``.

    Rows r0:r1 of ``it`` and keys k0:k1, a rectangle of :func:`_band_tiles`: only the
    triangles at the band's edges (the causal mask's or a window's) are written, as
    slices of :meth:`_Problem.edges`. Key lengths need nothing: no tile reaches past them.
    Segments hide, for each run of the tile's rows in one segment, the keys before and
    after that segment's.
    """
    if it.segments is not None:
        _hide_segments(it, s, r0, r1, k0, k1, value)
    if not p.banded:
        return
    band_lo, band_hi = it.band
    w = k1 - k0
    # rows whose visible keys end inside the block: a leading run of the tile's rows, row
    # r0 + t seeing columns c < hi[r0] - k0 + t (the edge moves one key per row)
    rh = min(r1, int(np.searchsorted(band_hi, k1, side="left")))
    if rh > r0:
        c = int(band_hi[r0]) - k0
        right, _ = p.edges(rh - r0, w - c)
        np.copyto(s[:, :rh - r0, c:], value, where=right)
    # rows whose visible keys start inside the block: a trailing run, row rl + t seeing
    # columns c >= lo[rl] - k0 + t; the first lo[rl] - k0 columns are hidden from all of them
    rl = max(r0, int(np.searchsorted(band_lo, k0, side="right")))
    if r1 > rl:
        d = int(band_lo[rl]) - k0
        n = r1 - rl
        s[:, rl - r0:, :d] = value
        _, left = p.edges(n, n - 1)
        np.copyto(s[:, rl - r0:, d:d + n - 1], value, where=left)



def _hide_segments(it: _Item, s: np.ndarray, r0: int, r1: int, k0: int, k1: int,
                   value: float) -> None:
    """Set the keys of ``s`` (G, r1 - r0, k1 - k0) outside each row's segment to ``value``.

    Sorted ids: a segment's rows are a run with one key range, so each run of the tile's
    rows in one segment hides the columns before and after its keys, two slices.
    """
    assert it.segments is not None
    first, last = (x[r0:r1] for x in it.segments)
    if int(first[-1]) <= k0 and int(last[0]) >= k1:
        return                                   # every row's segment holds every key
    change = np.flatnonzero((first[1:] != first[:-1]) | (last[1:] != last[:-1])) + 1
    w = k1 - k0
    for a, b in zip((0, *change.tolist()), (*change.tolist(), r1 - r0), strict=True):
        lo, hi = int(first[a]) - k0, int(last[a]) - k0
        if lo > 0:
            s[:, a:b, :min(lo, w)] = value
        if hi < w:
            s[:, a:b, max(hi, 0):] = value


def _flat(x: np.ndarray) -> np.ndarray:
    """(G, R, F) -> (G·R, F) when that is a view (one BLAS call instead of G)."""
    return x.reshape(-1, x.shape[-1]) if x.flags.c_contiguous else x


def _band_tiles(lo: np.ndarray, hi: np.ndarray, bk: int, start: int = 0,
                stop: int | None = None, sees: Callable[[int, int], np.ndarray] | None = None,
                ) -> Iterator[tuple[int, int, int, int]]:
    """The (r0, r1, k0, k1) rectangles of scores that rows with visible keys [lo, hi) need.

    Keys come in blocks of ``bk`` from the first key any row sees to the last (within
    ``[start, stop)`` where given); each block covers only the rows that see some of
    it: a run where both bounds grow with the row, else each run of such rows (bounds
    that a block mask narrowed, whose ``sees(k0, k1)`` also leaves out the rows whose
    block-mask tiles there are all empty). Rows that see no key at all are in no
    rectangle.
    """
    seen = np.flatnonzero(hi > lo)
    if seen.size == 0:
        return
    k_start, k_stop = max(start, int(lo[seen].min())), int(hi[seen].max())
    if stop is not None:
        k_stop = min(k_stop, stop)
    growing = sees is None and bool((lo[1:] >= lo[:-1]).all() and (hi[1:] >= hi[:-1]).all())
    for k0 in range(k_start, k_stop, bk):
        k1 = min(k0 + bk, k_stop)
        if growing:
            r0 = int(np.searchsorted(hi, k0, side="right"))   # first row with hi > k0
            r1 = int(np.searchsorted(lo, k1, side="left"))    # first row with lo >= k1
            if r0 < r1:
                yield r0, r1, k0, k1
            continue
        rows = (hi > lo) & (lo < k1) & (hi > k0)
        if sees is not None:
            rows &= sees(k0, k1)
        for r0, r1 in _runs(rows):
            yield r0, r1, k0, k1


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """The runs ``[r0, r1)`` of True in the bool vector ``rows``."""
    edges = np.flatnonzero(np.diff(rows.astype(np.int8), prepend=0, append=0))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def _tiles(p: _Problem, q0: int, q1: int, bk: int, b: tuple[int, ...] = (), hk: int = 0,
           ) -> Iterator[tuple[int, int, int, int]]:
    """The (r0, r1, k0, k1) rectangles of scores that rows q0:q1 of batch row ``b`` need.

    Rows are relative to q0; keys come in blocks of ``bk``. Under a causal mask
    (row q0 + r sees keys j <= q0 + r + offset) the blocks stop at the last key
    the item's last row sees, and each block starts at the first row that sees
    any of it; a window also drops the rows that see only keys after the block,
    and the blocks before the first key any row sees; key lengths end the blocks
    at the batch row's last key. ``b`` is needed only with key lengths (and ``hk`` only
    with a block mask that tells heads apart).
    """
    _, lo, hi = p.key_ranges(b, q0, q1, hk)
    return _band_tiles(lo, hi, bk, sees=p.rows_seeing(b, hk, q0, q1))


def _output(q: np.ndarray, ev: int) -> np.ndarray:
    """An empty ``out`` (B…, H, Tq, Ev) whose memory order follows ``q``'s (any (B…, H, T, E)).

    Where ``q`` is the (B…, H, Tq, E) view of a (B…, Tq, H, E) array (its head
    axis has the smaller stride), ``out`` is the same view of a C-contiguous
    (B…, Tq, H, Ev) array, so the caller's permutation back gives a contiguous array.
    """
    h, tq = q.shape[-3:-1]
    if h > 1 and tq > 1 and abs(q.strides[-3]) < abs(q.strides[-2]):
        bthe = np.empty((*q.shape[:-3], tq, h, ev), dtype=q.dtype)  # (B…, Tq, H, Ev)
        return np.swapaxes(bthe, -3, -2)                              # (B…, H, Tq, Ev)
    return np.empty((*q.shape[:-1], ev), dtype=q.dtype)               # (B…, H, Tq, Ev)
