"""The tasks of the Dask plan (:mod:`.plan`): they run on the workers, on blocks that are
NumPy or CuPy arrays.

A tile task (:func:`tile`) computes ``(out, lse)`` of one (batch chunk, query chunk, key
chunk) tile: the call's rules moved to the tile (positions, key lengths, segment ids, a
block mask, a user's rules called with the call's indices), run on the fastest local
path. Merge tasks combine the tiles of a query chunk exactly (:func:`merge_parts`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyattn._interop import to_numpy
from polyattn.rules.element import position
from polyattn.rules.lowering import window
from polyattn.rules.merge import merge
from polyattn.rules.user import UserRules
from polyattn.rules.visibility import Rules

Array = Any

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
    mask as its :class:`TileKinds`; each task moves the rules to its tile (:func:`tile`).
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


def first(pair: tuple[Array, Array]) -> Array:
    return pair[0]


def second(pair: tuple[Array, Array]) -> Array:
    """The lse, in the output's dtype (tiles and merges keep it in float64)."""
    out, lse = pair
    return lse if lse.dtype == out.dtype else _namespace(lse).astype(lse, out.dtype)


def _namespace(x: Array) -> Any:
    from array_api_compat import array_namespace

    return array_namespace(x)


def nothing_seen(q: Array, ev: int) -> tuple[Array, Array]:
    """The result of a query block that sees no key: out 0, lse ``-inf``."""
    xp = _namespace(q)
    out = xp.zeros((*q.shape[:-1], ev), dtype=q.dtype)
    return out, xp.full(tuple(q.shape[:-1]), -math.inf, dtype=xp.float64)


def merge_parts(*parts: tuple[Array, Array]) -> tuple[Array, Array]:
    """Partial results over disjoint key chunks -> their exact combination."""
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    return merge(outs, lses, _namespace(outs[0]))


def tile(q: Array, k: Array, v: Array, mask: Array | None, lengths: Array | None,
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
