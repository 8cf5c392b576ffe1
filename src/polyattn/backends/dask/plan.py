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
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

from polyattn._interop import array_library
from polyattn.backends.dask import tasks
from polyattn.backends.dask.tasks import EMPTY, FULL, PARTIAL, Spec
from polyattn.rules.visibility import Rules

Array = Any

#: Partial results combined by one merge task (the fan-in of the reduction tree).
SPLIT_EVERY = 8


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
            graph[root] = (tasks.nothing_seen, qkey, ev)
        else:
            level = []
            for ik in kchunks:
                key = (part, *bidx, iq, ik)
                graph[key] = (tasks.tile, qkey,
                              (k.name, *bidx, 0, ik, 0), (v.name, *bidx, 0, ik, 0),
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
                    graph[key] = (tasks.merge_parts, *level[n:n + SPLIT_EVERY])
                    merged.append(key)
                level = merged
            root = level[0]
        graph[(name_out, *bidx, 0, iq, 0)] = (tasks.first, root)
        lse_graph[(name_lse, *bidx, 0, iq)] = (tasks.second, root)
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
