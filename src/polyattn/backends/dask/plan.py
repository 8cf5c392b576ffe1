"""Attention on Dask arrays, block by block, merged through the log-sum-exp.

The query sequence is split into the query chunks of the Dask array ``q`` and
the keys into the chunks of ``k``. One task computes ``(out, lse)`` for one
(batch chunk, query chunk, key chunk) tile with the fastest local
implementation for its blocks (the NumPy fast path for NumPy blocks, the blocked
Array-API path for others, such as CuPy); a tree of merge tasks
(:data:`SPLIT_EVERY` parts each) combines the tiles of a query chunk exactly,
``lse = log Σ exp(lse_i)``, ``out = Σ exp(lse_i - lse) · out_i``. Tiles that no
query can see (causal, a window, key lengths whose values are at hand) are
never created, so a causal plan has about half the tasks of a full one. The tiles'
lses are float64 whatever the inputs: ``lse = m + log l`` rounded to float32 would
lose ``log l`` next to a large ``m`` (scores of 1e4 give weights off by 1e-4), and
the merge weights ``exp(lse_i - lse)`` would inherit it.

The graph is a Dask ``HighLevelGraph`` over the (rechunked) inputs: nothing is
computed when it is built, no array is captured in a task, and it runs on any
Dask scheduler — threads, processes, or a ``dask.distributed`` cluster, where
each task's working set is a few chunks (a query block, a key and a value
block, the tile's output). Heads and features stay whole in every chunk.

Every keyword of the attention call works except dropout (its mask is counted
over the whole problem, which a tile does not know): masks (Dask or not,
chunked alongside the tiles), both causal alignments, windows, soft-capping,
ALiBi, key lengths, GQA, segment ids (chunked alongside the tiles), and the
user's ``score_mod`` and ``mask_mod``, which each tile calls with the call's
indices (its rows ``q0 + i``, keys ``k0 + j``, the flat batch index over the
call's batch dimensions), their ``mod_args`` reaching every tile whole. Tiles
that a block mask calls empty, and, with sorted segment ids at hand, tiles outside
every query's segment, are never created either. There is no backward pass here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

from polyattn._interop import array_library, to_numpy
from polyattn.rules.element import position
from polyattn.rules.lowering import window
from polyattn.rules.merge import merge
from polyattn.rules.user import UserRules
from polyattn.rules.visibility import Rules

Array = Any

#: Partial results combined by one merge task (the fan-in of the reduction tree).
SPLIT_EVERY = 8


#: Kinds of a tile under a block mask (those of :mod:`polyattn.blockmask`).
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True, eq=False)
class TileKinds:
    """A block mask's kinds reduced over batch rows and heads, as a tile task reads them.

    ``kinds`` (nq, nk): :data:`EMPTY` where the block is empty in every batch row and head,
    :data:`FULL` where it is full in every one, else :data:`PARTIAL`, for blocks of
    ``block`` = (rows, keys). ``q0`` and ``k0`` place a tile's own indices in the call's:
    :meth:`tile` answers for the rectangle ``[q0 + a, q0 + b) x [k0 + c, k0 + d)``.
    """

    kinds: np.ndarray
    block: tuple[int, int]
    q0: int = 0
    k0: int = 0

    @classmethod
    def of(cls, blocks: Any) -> TileKinds:
        """The kinds of a :class:`polyattn.BlockMask`, over every batch row and head."""
        kinds = np.asarray(blocks.kinds)
        kinds = kinds.reshape(-1, *kinds.shape[-2:])
        seen = (kinds != EMPTY).any(axis=0)
        full = (kinds == FULL).all(axis=0)
        reduced = np.where(full, FULL, np.where(seen, PARTIAL, EMPTY)).astype(np.int8)
        return cls(kinds=reduced, block=(int(blocks.block[0]), int(blocks.block[1])))

    def moved(self, q0: int, k0: int) -> TileKinds:
        """The kinds as seen by a tile whose first row is ``q0`` and first key ``k0``."""
        return dataclasses.replace(self, q0=self.q0 + q0, k0=self.k0 + k0)

    def tile(self, q0: int, q1: int, k0: int, k1: int) -> int:
        """The kind of the rectangle ``[q0, q1) x [k0, k1)`` (in the tile's indices):
        empty or full only if every block it touches is."""
        bq, bk = self.block
        q0, q1, k0, k1 = q0 + self.q0, q1 + self.q0, k0 + self.k0, k1 + self.k0
        sub = self.kinds[q0 // bq:(q1 - 1) // bq + 1, k0 // bk:(k1 - 1) // bk + 1]
        if not sub.any():
            return EMPTY
        return FULL if (sub == FULL).all() else PARTIAL


@dataclass(frozen=True)
class Spec:
    """What every tile task needs besides its blocks: the scale and the call's rules.

    ``rules`` are the call's :class:`Rules` without their arrays (:meth:`of`): key lengths,
    ALiBi slopes and segment ids come to each task as blocks, ``mod_args`` whole, a block
    mask as its :class:`TileKinds`; each task moves the rules to its tile (:func:`_run`).
    """

    scale: float
    rules: Rules
    #: worker threads of the NumPy fast path inside one task (parallelism is across tasks)
    threads: int = 1
    #: the call's batch dimensions B…, over which a user rule's ``b`` counts
    batch: tuple[int, ...] = ()

    @classmethod
    def of(cls, rules: Rules, scale: float, batch: tuple[int, ...] = ()) -> Spec:
        """The spec of a call with these rules: their arrays left out (they come as blocks)."""
        user = rules.user
        if user is not None:
            user = dataclasses.replace(user, mod_args=())
        blocks = None if rules.blocks is None else TileKinds.of(rules.blocks)
        return cls(scale=float(scale), batch=tuple(int(n) for n in batch),
                   rules=dataclasses.replace(
                       rules, key_lengths=None, alibi=None, lengths_at_hand=None,
                       segments=None, segment_keys=None, user=user, blocks=blocks))


@dataclass(frozen=True)
class Plan:
    """Which tiles exist: for each (batch chunk, query chunk), its key chunks."""

    batch_chunks: tuple[tuple[int, ...], ...]
    q_chunks: tuple[int, ...]
    k_chunks: tuple[int, ...]
    tiles: dict[tuple[tuple[int, ...], int], tuple[int, ...]]
    #: tiles that the block mask calls full (their mask_mod is not evaluated)
    full_tiles: int = 0

    @property
    def tile_tasks(self) -> int:
        return sum(len(ks) for ks in self.tiles.values())

    @property
    def all_tiles(self) -> int:
        return len(self.tiles) * len(self.k_chunks)

    @property
    def merge_tasks(self) -> int:
        return sum(_merge_count(len(ks)) for ks in self.tiles.values())

    def describe(self) -> str:
        """The plan's size in one line, for :func:`polyattn.explain`."""
        nb = math.prod(len(c) for c in self.batch_chunks)
        skipped = self.all_tiles - self.tile_tasks
        return (f"{len(self.q_chunks)} query chunks (up to {max(self.q_chunks)} rows) x "
                f"{len(self.k_chunks)} key chunks (up to {max(self.k_chunks)} keys) x "
                f"{nb} batch chunks: {self.tile_tasks} tile tasks"
                + (f" ({skipped} tiles no query sees are left out)" if skipped else "")
                + (f", {self.full_tiles} of the tile tasks full in the block mask (their "
                   "mask_mod is not evaluated)" if self.full_tiles else "")
                + f", {self.merge_tasks} merge tasks ({SPLIT_EVERY} parts each at most)")


def _merge_count(parts: int) -> int:
    """Merge tasks of a tree reduction of ``parts`` partial results."""
    count = 0
    while parts > 1:
        parts = -(-parts // SPLIT_EVERY)
        count += parts
    return count


def _is_dask(x: Any) -> bool:
    return array_library(x) == "dask"


def unavailable(q: Array, k: Array, v: Array | None, mask: Array | None,
                rules: Rules) -> str | None:
    """Why the plan cannot run this call (``None``: it can)."""
    if not _is_dask(q):
        return f"inputs are {array_library(q)} arrays, not Dask arrays"
    if v is None:
        return "there are no values (attention weights are materialised by the reference path)"
    for name, x in (("query", q), ("key", k), ("value", v), ("attn_mask", mask)):
        if x is not None and any(math.isnan(c) for cs in x.chunks for c in cs):
            return f"`{name}` has chunks of unknown size (call compute_chunk_sizes() first)"
    if rules.dropout:
        return ("dropout's keep-mask is counted over the whole problem, which a tile task "
                "does not see; the Array-API blocked path runs dropout on Dask arrays")
    return None


def make_plan(q: Array, k: Array, rules: Rules, lengths: np.ndarray | None) -> Plan:
    """The tiles of a problem whose query and key chunks are those of ``q`` and ``k``.

    A key chunk is kept for a query chunk when some query of it may see some key of it
    (:meth:`Rules.key_range`, narrowed by sorted segment ids at hand to the segments of
    the batch chunk's rows), when the block mask (``rules.blocks``) does not call the
    tile empty in every batch row and head, and, with ``lengths`` at hand, when it starts
    before the longest key length of the batch chunk (and, where positions follow the
    key lengths, when it lies in the band of positions those lengths give). Only shapes
    and values at hand (NumPy) are read: nothing is computed.
    """
    nb = q.ndim - 3
    batch_chunks = tuple(tuple(int(c) for c in q.chunks[i]) for i in range(nb))
    q_chunks = tuple(int(c) for c in q.chunks[nb + 1])
    k_chunks = tuple(int(c) for c in k.chunks[nb + 1])
    k_starts = np.cumsum((0, *k_chunks))
    q_starts = np.cumsum((0, *q_chunks))
    batch_starts = [np.cumsum((0, *c)) for c in batch_chunks]
    if lengths is not None:
        lengths = np.broadcast_to(lengths, tuple(sum(c) for c in batch_chunks))
    tiles = {}
    full = 0
    for bidx in product(*(range(len(c)) for c in batch_chunks)):
        rows = tuple(slice(s[i], s[i + 1]) for s, i in zip(batch_starts, bidx, strict=True))
        longest, offsets = None, None
        if lengths is not None:
            block = lengths[rows]
            longest = int(block.max()) if block.size else 0
            if rules.lengths_shift and block.size:     # p_i = i + L_b - Tq
                offsets = (int(block.min()) - rules.tq, longest - rules.tq)
        chunk_rules = _segments_of_rows(rules, rows)
        for iq in range(len(q_chunks)):
            q0, q1 = int(q_starts[iq]), int(q_starts[iq + 1])
            lo, hi = chunk_rules.key_range(q0, q1, offsets)
            if longest is not None:
                hi = min(hi, longest)
            kept = []
            for ik in range(len(k_chunks)):
                k0, k1 = int(k_starts[ik]), int(k_starts[ik + 1])
                if not (k0 < hi and k1 > lo):
                    continue
                kind = PARTIAL if rules.blocks is None else rules.blocks.tile(q0, q1, k0, k1)
                if kind == EMPTY:
                    continue
                full += kind == FULL
                kept.append(ik)
            tiles[bidx, iq] = tuple(kept)
    return Plan(batch_chunks, q_chunks, k_chunks, tiles, int(full))


def _segments_of_rows(rules: Rules, rows: tuple[slice, ...]) -> Rules:
    """``rules`` with their segments' key ranges (:attr:`Rules.segment_keys`, at hand) cut
    to the batch rows ``rows`` (of one batch chunk), so that the key range of a query
    chunk is that of these rows' segments."""
    if rules.segment_keys is None:
        return rules
    lo, hi = rules.segment_keys                         # (B…|1, Tq) each
    index = tuple(r if n > 1 else slice(None) for r, n in zip(rows, lo.shape[:-1], strict=True))
    lo, hi = lo[index], hi[index]
    if lo.size == 0:
        return dataclasses.replace(rules, segment_keys=None)
    return dataclasses.replace(rules, segment_keys=(lo, hi))


def rechunked(q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
    """Heads and features whole; k and v share q's batch chunks, v shares k's key chunks."""
    nb = q.ndim - 3
    whole = {nb: -1, nb + 2: -1}
    q = q.rechunk({**whole, **{i: q.chunks[i] for i in range(nb)}})
    batch = {i: q.chunks[i] for i in range(nb)}
    k = k.rechunk({**whole, **batch})
    v = v.rechunk({**whole, **batch, nb + 1: k.chunks[nb + 1]})
    return q, k, v


def _along(x: Array | None, chunks: list[tuple[int, ...] | None]) -> Array | None:
    """``x`` (each axis 1 or full) as a Dask array chunked by ``chunks`` on its full axes
    (``None``: one chunk); axes of size 1 stay one chunk."""
    if x is None:
        return None
    import dask.array as da

    x = x if _is_dask(x) else da.asarray(x)
    target = {i: (-1 if (c is None or x.shape[i] == 1) else c) for i, c in enumerate(chunks)}
    return x.rechunk(target)


def _whole(x: Array) -> Array:
    """A ``mod_args`` array (Dask or not) as a Dask array of one chunk: a tile needs it
    whole (a small table indexed by the rule)."""
    import dask.array as da

    x = x if _is_dask(x) else da.asarray(x)
    return x.rechunk(tuple(-1 for _ in x.shape)) if x.ndim else x


def _block(x: Array | None, index: tuple[int, ...]) -> Any:
    """The key of ``x``'s block at ``index`` (0 on its single-chunk axes), or ``None``."""
    if x is None:
        return None
    index = tuple(i if len(c) > 1 else 0 for i, c in zip(index, x.chunks, strict=True))
    return (x.name, *index)


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None, rules: Rules,
              scale: float, xp: Any) -> tuple[Array, Array]:
    """The blocked plan on Dask arrays; see :mod:`polyattn.backends` for the contract.

    Returns lazy Dask arrays ``out`` (B…, H, Tq, Ev) and ``lse`` (B…, H, Tq), chunked
    like ``q`` along the batch and query axes.
    """
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph

    why = unavailable(q, k, v, mask, rules)
    if why is not None:
        raise ValueError(f"implementation='distributed' cannot run this call: {why}")
    q, k, v = rechunked(q, k, v)
    nb = q.ndim - 3
    batch = [q.chunks[i] for i in range(nb)]
    mask = _along(mask, [*batch, None, q.chunks[nb + 1], k.chunks[nb + 1]])
    lengths = _along(rules.key_lengths, batch)
    slopes = _along(rules.alibi, [*batch, None])
    q_ids = k_ids = None
    if rules.segments is not None:
        q_ids = _along(rules.segments[0], [*batch, q.chunks[nb + 1]])
        k_ids = _along(rules.segments[1], [*batch, k.chunks[nb + 1]])
    tables = [] if rules.user is None else [_whole(a) for a in rules.user.mod_args]
    plan = make_plan(q, k, rules, rules.lengths_at_hand)
    spec = Spec.of(rules, scale, tuple(int(n) for n in q.shape[:nb]))
    ev = int(v.shape[-1])
    blocked = [mask, lengths, slopes, q_ids, k_ids, *tables]
    token = tokenize(q.name, k.name, v.name, *(None if x is None else x.name for x in blocked),
                     spec)
    part, name_out, name_lse = f"attention-tile-{token}", f"attention-{token}", f"lse-{token}"
    q_starts = np.cumsum((0, *plan.q_chunks))
    k_starts = np.cumsum((0, *plan.k_chunks))
    batch_starts = [np.cumsum((0, *c)) for c in plan.batch_chunks]
    table_keys = [(t.name, *([0] * t.ndim)) for t in tables]
    graph: dict[Any, Any] = {}
    lse_graph: dict[Any, Any] = {}
    for (bidx, iq), kchunks in plan.tiles.items():
        qkey = (q.name, *bidx, 0, iq, 0)
        origin = tuple(int(st[i]) for st, i in zip(batch_starts, bidx, strict=True))
        if not kchunks:
            root: Any = (part, *bidx, iq, "empty")
            graph[root] = (_nothing_seen, qkey, ev)
        else:
            level = []
            for ik in kchunks:
                key = (part, *bidx, iq, ik)
                graph[key] = (_tile, qkey, (k.name, *bidx, 0, ik, 0), (v.name, *bidx, 0, ik, 0),
                              _block(mask, (*bidx, 0, iq, ik)), _block(lengths, bidx),
                              _block(slopes, (*bidx, 0)), spec,
                              int(q_starts[iq]), int(k_starts[ik]),
                              _block(q_ids, (*bidx, iq)), _block(k_ids, (*bidx, ik)),
                              list(table_keys), origin)
                level.append(key)
            depth = 0
            while len(level) > 1:     # the merge tree, SPLIT_EVERY parts per task
                depth += 1
                merged = []
                for n in range(0, len(level), SPLIT_EVERY):
                    key = (part, *bidx, iq, "merge", depth, n)
                    graph[key] = (_merge_parts, *level[n:n + SPLIT_EVERY])
                    merged.append(key)
                level = merged
            root = level[0]
        graph[(name_out, *bidx, 0, iq, 0)] = (_first, root)
        lse_graph[(name_lse, *bidx, 0, iq)] = (_second, root)
    inputs = [x for x in (q, k, v, *blocked) if x is not None]
    dtype = q.dtype
    meta = np.empty((0,) * q.ndim, dtype=dtype)
    try:
        meta = da.utils.meta_from_array(q._meta, ndim=q.ndim, dtype=dtype)
    except Exception:  # pragma: no cover - meta of an unusual chunk type
        pass
    hlg = HighLevelGraph.from_collections(name_out, graph, dependencies=inputs)
    out = da.Array(hlg, name_out, (*batch, q.chunks[nb], q.chunks[nb + 1], (ev,)), meta=meta)
    lse_hlg = HighLevelGraph.from_collections(name_lse, lse_graph,
                                              dependencies=[out])  # type: ignore[list-item]
    lse_meta = da.utils.meta_from_array(meta, ndim=q.ndim - 1, dtype=dtype)
    lse = da.Array(lse_hlg, name_lse, (*batch, q.chunks[nb], q.chunks[nb + 1]), meta=lse_meta)
    return out, lse


# --- the tasks (they run on the workers; blocks are NumPy or CuPy arrays) -----------------

def _first(pair: tuple[Array, Array]) -> Array:
    return pair[0]


def _second(pair: tuple[Array, Array]) -> Array:
    """The lse, in the output's dtype (tiles and merges keep it in float64)."""
    out, lse = pair
    return lse if lse.dtype == out.dtype else _namespace(lse).astype(lse, out.dtype)


def _namespace(x: Array) -> Any:
    from array_api_compat import array_namespace

    return array_namespace(x)


def _nothing_seen(q: Array, ev: int) -> tuple[Array, Array]:
    """The result of a query block that sees no key: out 0, lse ``-inf``."""
    xp = _namespace(q)
    out = xp.zeros((*q.shape[:-1], ev), dtype=q.dtype)
    return out, xp.full(tuple(q.shape[:-1]), -math.inf, dtype=xp.float64)


def _merge_parts(*parts: tuple[Array, Array]) -> tuple[Array, Array]:
    """Partial results over disjoint key chunks -> their exact combination."""
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    return merge(outs, lses, _namespace(outs[0]))


def _tile(q: Array, k: Array, v: Array, mask: Array | None, lengths: Array | None,
          slopes: Array | None, spec: Spec, q0: int, k0: int, q_ids: Array | None = None,
          k_ids: Array | None = None, tables: list[Array] | tuple[Array, ...] = (),
          origin: tuple[int, ...] | None = None) -> tuple[Array, Array]:
    """(out, lse) of queries ``[q0, q0 + Tq_c)`` over keys ``[k0, k0 + Tk_c)``.

    Positions move with the tile: ``p_i - j`` is unchanged when query ``i`` becomes
    ``i - q0`` and key ``j`` becomes ``j - k0`` and the offset grows by ``q0 - k0``; key
    lengths shrink by ``k0``. With bottom-right positions that follow key lengths
    (``p_i = i + L_b - Tq``) each batch row has its own offset, so rows are run one by one.
    ``q_ids`` and ``k_ids`` are the tile's segment ids (or ``None``), ``tables`` the
    call's ``mod_args`` whole, and ``origin`` the call's batch indices of the tile's first
    batch row (default: the first of the call), from which a user rule's ``b`` counts.
    """
    xp = _namespace(q)
    tk = k.shape[-2]
    rules = spec.rules
    nb = q.ndim - 3
    origin = (0,) * nb if origin is None else tuple(origin)
    tables = tuple(xp.asarray(t) for t in tables)
    if not rules.lengths_shift:
        local = None if lengths is None else xp.clip(lengths - k0, 0, tk)
        return _run(q, k, v, mask, spec, position(q0 - k0, rules.offset, 0, 0), local, slopes,
                    xp, _Placement(q0, k0, origin, q_ids, k_ids, tables))
    assert lengths is not None
    batch = tuple(q.shape[:nb])
    host = np.broadcast_to(to_numpy(lengths), batch)
    out = xp.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
    lse = xp.empty(tuple(q.shape[:-1]), dtype=xp.float64)
    for b in np.ndindex(*batch):
        length = int(host[b])
        row = tuple(slice(i, i + 1) for i in b)

        def take(x: Array | None, extra: int, row: tuple[slice, ...] = row) -> Array | None:
            if x is None:
                return None
            index = tuple(r if x.shape[i] > 1 else slice(None) for i, r in enumerate(row))
            return x[(*index, *([slice(None)] * extra))]

        local = xp.asarray(np.clip(length - k0, 0, tk), dtype=lengths.dtype)
        local = xp.reshape(local, (1,) * nb)
        place = _Placement(q0, k0, tuple(o + i for o, i in zip(origin, b, strict=True)),
                           take(q_ids, 1), take(k_ids, 1), tables)
        o, s = _run(take(q, 3), take(k, 3), take(v, 3), take(mask, 3), spec,
                    position(q0 - k0, -rules.tq, 1, length), local, take(slopes, 1), xp, place)
        out[(*row, ...)] = o
        lse[(*row, ...)] = s
    return out, lse


@dataclass(frozen=True)
class _Placement:
    """Where a tile's blocks sit in the call: its first row ``q0`` and key ``k0``, the call's
    batch indices ``origin`` of its first batch row; and its blocks of the rules that come
    as arrays besides key lengths and slopes (segment ids, ``mod_args`` whole)."""

    q0: int = 0
    k0: int = 0
    origin: tuple[int, ...] = ()
    q_ids: Array | None = None
    k_ids: Array | None = None
    tables: tuple[Array, ...] = ()


def _run(q: Array, k: Array, v: Array, mask: Array | None, spec: Spec, offset: int,
         lengths: Array | None, slopes: Array | None, xp: Any,
         place: _Placement | None = None) -> tuple[Array, Array]:
    """One tile with top-left-style rules (a fixed offset) on the fastest local path.

    The call's rules moved to the tile: its own sizes, the position offset ``offset``,
    the tile's key lengths, slopes and segment ids, a block mask and the user's rules
    placed at the tile (``place``; every other rule as the call has it). The NumPy fast
    path runs NumPy blocks without user rules (with segment ids sorted in every row of the
    tile, as their key ranges); every other tile runs the Array-API blocked path.
    """
    place = place or _Placement()
    tq, tk = q.shape[-2], k.shape[-2]
    rules = dataclasses.replace(spec.rules, tq=tq, tk=tk, offset=offset, key_lengths=lengths,
                                lengths_shift=False, alibi=slopes)
    # a window side that reaches every key of the tile from every query of it is dropped
    rules = dataclasses.replace(rules, window=window(dataclasses.replace(rules, causal=False)))
    if place.q_ids is not None:
        rules = dataclasses.replace(rules, segments=(place.q_ids, place.k_ids),
                                    segment_keys=_segment_keys(place.q_ids, place.k_ids))
    if rules.user is not None:
        user = rules.user
        rules = dataclasses.replace(rules, user=UserRules(
            score_mod=None if user.score_mod is None else _AtTile(
                user.score_mod, True, place.q0, place.k0, place.origin, spec.batch),
            mask_mod=None if user.mask_mod is None else _AtTile(
                user.mask_mod, False, place.q0, place.k0, place.origin, spec.batch),
            mod_args=place.tables))
    if rules.blocks is not None:
        rules = dataclasses.replace(rules, blocks=rules.blocks.moved(place.q0, place.k0))
    fast = (isinstance(q, np.ndarray) and rules.user is None
            and (rules.segments is None or rules.segment_keys is not None))
    if fast:
        from polyattn.backends.numpy import forward as numpy_chunked

        return numpy_chunked.attention(q, k, v, mask=mask, rules=rules, scale=spec.scale,
                                       xp=xp, threads=spec.threads, lse_dtype=np.float64)
    from polyattn.backends.array_api import blocked as chunked

    return chunked.attention(q, k, v, mask=mask, rules=rules, scale=spec.scale, xp=xp,
                             lse_dtype=xp.float64)


def _segment_keys(q_ids: Array, k_ids: Array) -> tuple[np.ndarray, np.ndarray] | None:
    """The tile's :attr:`Rules.segment_keys`: for NumPy ids sorted in every row of the tile,
    each query's keys ``[lo, hi)`` (of the tile) in its segment, (B…|1, Tq_c) each; else
    ``None`` (the ids then act as a mask)."""
    if not (isinstance(q_ids, np.ndarray) and isinstance(k_ids, np.ndarray)):
        return None
    tq, tk = q_ids.shape[-1], k_ids.shape[-1]
    lead = np.broadcast_shapes(q_ids.shape[:-1], k_ids.shape[:-1])
    qv = np.broadcast_to(q_ids, (*lead, tq)).reshape(-1, tq)
    kv = np.broadcast_to(k_ids, (*lead, tk)).reshape(-1, tk)
    if qv.shape[0] == 0 or (qv[:, 1:] < qv[:, :-1]).any() or (kv[:, 1:] < kv[:, :-1]).any():
        return None
    lo, hi = (np.stack([np.searchsorted(kr, qr, side=side) for qr, kr in zip(qv, kv, strict=True)
                        ]).reshape(*lead, tq) for side in ("left", "right"))
    return lo, hi


@dataclass(frozen=True)
class _AtTile:
    """A user's ``score_mod`` (``scores``) or ``mask_mod`` called on a tile's indices with the
    call's: rows ``q0 + i``, keys ``k0 + j``, and ``b`` the flat index over the call's batch
    dimensions ``batch`` of the tile's batch row (the tile's first is ``origin``)."""

    fn: Callable[..., Any]
    scores: bool
    q0: int
    k0: int
    origin: tuple[int, ...]
    batch: tuple[int, ...]

    def __post_init__(self) -> None:
        # errors name the user's function
        name = getattr(self.fn, "__qualname__", None) or repr(self.fn)
        object.__setattr__(self, "__qualname__", name)

    def __call__(self, *args: Any) -> Any:
        lead = args[:1] if self.scores else ()
        b, h, i, j, *tables = args[len(lead):]
        return self.fn(*lead, self._flat(b), h, i + self.q0, j + self.k0, *tables)

    def _flat(self, b: Array) -> Array:
        """The tile's flat batch index ``b`` (over its own batch rows, the leading axes of
        ``b``'s shape) -> the call's."""
        nb = len(self.batch)
        if nb == 0 or not hasattr(b, "shape"):
            return b
        local = tuple(b.shape[:nb])
        coords, rest = [], b
        for size in reversed(local):
            coords.append(rest % size)
            rest = rest // size
        flat = None
        for c, o, n in zip(reversed(coords), self.origin, self.batch, strict=True):
            flat = c + o if flat is None else flat * n + (c + o)
        return flat
