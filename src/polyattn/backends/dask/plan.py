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
ALiBi, key lengths, GQA. There is no backward pass here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

from polyattn._interop import array_library, to_numpy
from polyattn.rules.element import position
from polyattn.rules.lowering import window
from polyattn.rules.merge import merge
from polyattn.rules.visibility import Rules

Array = Any

#: Partial results combined by one merge task (the fan-in of the reduction tree).
SPLIT_EVERY = 8


@dataclass(frozen=True)
class Spec:
    """What every tile task needs besides its blocks: the scale and the call's rules.

    ``rules`` are the call's :class:`Rules` without their arrays (:meth:`of`): key lengths
    and ALiBi slopes come to each task as blocks, and each task moves the rules to its
    tile (:func:`_run`).
    """

    scale: float
    rules: Rules
    #: worker threads of the NumPy fast path inside one task (parallelism is across tasks)
    threads: int = 1

    @classmethod
    def of(cls, rules: Rules, scale: float) -> Spec:
        """The spec of a call with these rules: their arrays left out (they come as blocks)."""
        return cls(scale=float(scale), rules=dataclasses.replace(
            rules, key_lengths=None, alibi=None, lengths_at_hand=None))


@dataclass(frozen=True)
class Plan:
    """Which tiles exist: for each (batch chunk, query chunk), its key chunks."""

    batch_chunks: tuple[tuple[int, ...], ...]
    q_chunks: tuple[int, ...]
    k_chunks: tuple[int, ...]
    tiles: dict[tuple[tuple[int, ...], int], tuple[int, ...]]

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
    (:meth:`Rules.key_range`), and, with ``lengths`` at hand, when it starts before the
    longest key length of the batch chunk (and, where positions follow the key lengths,
    when it lies in the band of positions those lengths give).
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
    for bidx in product(*(range(len(c)) for c in batch_chunks)):
        longest, offsets = None, None
        if lengths is not None:
            block = lengths[tuple(slice(s[i], s[i + 1]) for s, i in zip(batch_starts, bidx,
                                                                        strict=True))]
            longest = int(block.max()) if block.size else 0
            if rules.lengths_shift and block.size:     # p_i = i + L_b - Tq
                offsets = (int(block.min()) - rules.tq, longest - rules.tq)
        for iq in range(len(q_chunks)):
            lo, hi = rules.key_range(int(q_starts[iq]), int(q_starts[iq + 1]), offsets)
            if longest is not None:
                hi = min(hi, longest)
            tiles[bidx, iq] = tuple(ik for ik in range(len(k_chunks))
                                    if k_starts[ik] < hi and k_starts[ik + 1] > lo)
    return Plan(batch_chunks, q_chunks, k_chunks, tiles)


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
    plan = make_plan(q, k, rules, rules.lengths_at_hand)
    spec = Spec.of(rules, scale)
    ev = int(v.shape[-1])
    token = tokenize(q.name, k.name, v.name, None if mask is None else mask.name,
                     None if lengths is None else lengths.name,
                     None if slopes is None else slopes.name, spec)
    part, name_out, name_lse = f"attention-tile-{token}", f"attention-{token}", f"lse-{token}"
    q_starts = np.cumsum((0, *plan.q_chunks))
    k_starts = np.cumsum((0, *plan.k_chunks))
    graph: dict[Any, Any] = {}
    lse_graph: dict[Any, Any] = {}
    for (bidx, iq), kchunks in plan.tiles.items():
        qkey = (q.name, *bidx, 0, iq, 0)
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
                              int(q_starts[iq]), int(k_starts[ik]))
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
    inputs = [x for x in (q, k, v, mask, lengths, slopes) if x is not None]
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
          slopes: Array | None, spec: Spec, q0: int, k0: int) -> tuple[Array, Array]:
    """(out, lse) of queries ``[q0, q0 + Tq_c)`` over keys ``[k0, k0 + Tk_c)``.

    Positions move with the tile: ``p_i - j`` is unchanged when query ``i`` becomes
    ``i - q0`` and key ``j`` becomes ``j - k0`` and the offset grows by ``q0 - k0``; key
    lengths shrink by ``k0``. With bottom-right positions that follow key lengths
    (``p_i = i + L_b - Tq``) each batch row has its own offset, so rows are run one by one.
    """
    xp = _namespace(q)
    tk = k.shape[-2]
    rules = spec.rules
    if not rules.lengths_shift:
        local = None if lengths is None else xp.clip(lengths - k0, 0, tk)
        return _run(q, k, v, mask, spec, position(q0 - k0, rules.offset, 0, 0), local, slopes,
                    xp)
    assert lengths is not None
    nb = q.ndim - 3
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
        o, s = _run(take(q, 3), take(k, 3), take(v, 3), take(mask, 3), spec,
                    position(q0 - k0, -rules.tq, 1, length), local, take(slopes, 1), xp)
        out[(*row, ...)] = o
        lse[(*row, ...)] = s
    return out, lse


def _run(q: Array, k: Array, v: Array, mask: Array | None, spec: Spec, offset: int,
         lengths: Array | None, slopes: Array | None, xp: Any) -> tuple[Array, Array]:
    """One tile with top-left-style rules (a fixed offset) on the fastest local path.

    The call's rules moved to the tile: its own sizes, the position offset ``offset``,
    the tile's key lengths and slopes (every other rule as the call has it).
    """
    tq, tk = q.shape[-2], k.shape[-2]
    rules = dataclasses.replace(spec.rules, tq=tq, tk=tk, offset=offset, key_lengths=lengths,
                                lengths_shift=False, alibi=slopes)
    # a window side that reaches every key of the tile from every query of it is dropped
    rules = dataclasses.replace(rules, window=window(dataclasses.replace(rules, causal=False)))
    if isinstance(q, np.ndarray):
        from polyattn.backends.numpy import forward as numpy_chunked

        return numpy_chunked.attention(q, k, v, mask=mask, rules=rules, scale=spec.scale,
                                       xp=xp, threads=spec.threads, lse_dtype=np.float64)
    from polyattn.backends.array_api import blocked as chunked

    return chunked.attention(q, k, v, mask=mask, rules=rules, scale=spec.scale, xp=xp,
                             lse_dtype=xp.float64)
