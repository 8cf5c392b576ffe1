"""Positions and visibility: causal, windows, key lengths, soft-capping and ALiBi.

docs/semantics.rst ("Positions, windows, soft-capping, ALiBi and key lengths") in
code. Query row ``i`` has position ``p_i = i + offset``, or
``p_i = i + key_lengths[b] - Tq`` when the alignment is bottom-right and
``key_lengths`` is given. Key ``j`` is visible to query ``i`` iff
``j < key_lengths[b]``; and ``j <= p_i`` with causal; and
``p_i - left <= j <= p_i + right`` with a window; and, with segment ids
(packed sequences), iff query ``i`` and key ``j`` are in the same segment. Scores,
in this order:
``s = scale·q·k`` → ``softcap·tanh(s/softcap)`` → ``- slope_h·|p_i - j|`` →
float mask added → invisible keys set to ``-inf``.

:class:`Rules` is what every implementation receives besides the mask; the
functions below build the pieces of one (query block, key block) tile in
Array-API calls, in the grouped layout (B…, Hkv, G, bq, bk) of the reference
and chunked paths. :meth:`Rules.key_range` gives, from shapes alone, the
keys that any query of a block can see, so that blocks outside it are skipped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from polyattn._interop import device_of
from polyattn.rules import user
from polyattn.rules.user import UserRules

Array = Any
NEG_INF = -math.inf


#: Every score rule :class:`Rules` can hold, by name: a backend lists those it lowers in
#: its ``RULES``, and is never chosen for a call using one it does not (a new rule is
#: refused everywhere until a family lowers it, rather than silently left out).
RULE_NAMES = ("causal", "window", "key_lengths", "softcap", "alibi", "dropout", "segment_ids",
              "score_mod", "mask_mod")


@dataclass(frozen=True)
class Rules:
    """Everything that decides a score besides ``q·k``, ``scale`` and ``attn_mask``.

    ``offset``: ``p_i = i + offset`` (0 top-left, ``Tk - Tq`` bottom-right).
    ``key_lengths``: integer, ``len(B…)`` dimensions broadcastable to B…, or
    ``None``. ``lengths_shift``: positions follow ``key_lengths`` (bottom-right
    alignment with key lengths): ``p_i = i + key_lengths[b] - Tq``.
    ``window``: ``(left, right)``, each an int or ``None`` (unbounded).
    ``alibi``: slopes with ``len(B…) + 1`` dimensions, broadcastable to
    (B…, H), in the compute dtype. ``dropout_p``, ``dropout_seed``: weights are
    dropped after the softmax by the counters of :mod:`.dropout`. ``segments``:
    ``(query ids, key ids)``, integer, ``len(B…) + 1`` dimensions, (B…|1, Tq) and
    (B…|1, Tk): key ``j`` is visible to query ``i`` only where the ids are equal.
    """

    tq: int
    tk: int
    causal: bool = False
    offset: int = 0
    key_lengths: Array | None = None
    lengths_shift: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi: Array | None = None
    #: Dropout (docs/semantics.rst): probability in [0, 1) and the Philox key; 0 is no dropout.
    dropout_p: float = 0.0
    dropout_seed: Any = 0          # an int, or a 0-d integer array traced by jax.jit
    #: ``key_lengths`` as a NumPy array where its values were at hand when the call was
    #: checked (for plans built before anything runs, such as the Dask one), else ``None``.
    lengths_at_hand: Any = None
    segments: tuple[Array, Array] | None = None
    #: Where the segment ids were at hand and sorted in every row: NumPy ``(lo, hi)``, each
    #: (B…|1, Tq), the keys ``[lo, hi)`` of the segment of each query of each batch row,
    #: which narrow :meth:`key_range`; else ``None``.
    segment_keys: tuple[Any, Any] | None = None
    #: The user's ``score_mod``, ``mask_mod`` and ``mod_args`` (:mod:`.user`), or ``None``.
    user: UserRules | None = None
    #: The tiles ``mask_mod`` leaves empty or full (:class:`polyattn.BlockMask`), or ``None``.
    blocks: Any = None

    @classmethod
    def from_causal_offset(cls, causal_offset: int | None, tq: int, tk: int) -> Rules:
        """The 0.1 rules: causal with ``j <= i + causal_offset``, or nothing."""
        if causal_offset is None:
            return cls(tq, tk)
        return cls(tq, tk, causal=True, offset=causal_offset)

    @property
    def causal_offset(self) -> int | None:
        """``j <= i + causal_offset`` (the 0.1 form, exact when :attr:`simple`), or ``None``."""
        return self.offset if self.causal else None

    @property
    def simple(self) -> bool:
        """Only (static) causal, as in 0.1: no window, lengths, softcap, ALiBi or dropout."""
        return self.in_use() <= {"causal"}

    def in_use(self) -> frozenset[str]:
        """The names (of :data:`RULE_NAMES`) of the rules this call uses: a backend runs it
        only if it lowers each of them (its ``RULES``).

        >>> sorted(Rules(4, 4, causal=True, softcap=30.0).in_use())
        ['causal', 'softcap']
        """
        used = {"causal": self.causal, "window": self.window is not None,
                "key_lengths": self.key_lengths is not None,
                "softcap": self.softcap is not None, "alibi": self.alibi is not None,
                "dropout": self.dropout, "segment_ids": self.segments is not None,
                "score_mod": self.user is not None and self.user.score_mod is not None,
                "mask_mod": self.user is not None and self.user.mask_mod is not None}
        assert tuple(used) == RULE_NAMES, "a rule of Rules is missing from RULE_NAMES"
        return frozenset(name for name, on in used.items() if on)

    @property
    def dropout(self) -> bool:
        """Whether weights are dropped (``dropout_p > 0``)."""
        return self.dropout_p > 0

    @property
    def dropout_scale(self) -> float:
        """``1 / (1 - dropout_p)``, the factor of kept weights."""
        return 1.0 / (1.0 - self.dropout_p)

    @property
    def restricts(self) -> bool:
        """Whether some keys may be invisible for reasons other than ``attn_mask``."""
        return (self.causal or self.window is not None or self.key_lengths is not None
                or self.segments is not None or self.masks_by_function)

    @property
    def masks_by_function(self) -> bool:
        """Whether a user's ``mask_mod`` hides keys."""
        return self.user is not None and self.user.mask_mod is not None

    def offset_range(self) -> tuple[int, int]:
        """Smallest and largest position offset ``p_i - i`` over the batch (from shapes)."""
        if self.lengths_shift:
            return -self.tq, self.tk - self.tq
        return self.offset, self.offset

    def right_reach(self) -> int | None:
        """How far right of ``p_i`` a key may be (``None``: unbounded)."""
        right = None if self.window is None else self.window[1]
        if self.causal:
            return 0 if right is None else min(right, 0)
        return right

    def left_reach(self) -> int | None:
        """How far left of ``p_i`` a key may be (``None``: unbounded)."""
        return None if self.window is None else self.window[0]

    def key_range(self, q0: int, q1: int, offsets: tuple[int, int] | None = None,
                  ) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that some query in ``[q0, q1)`` may see, in some batch row.

        Decided from shapes alone (key lengths only narrow it further), so
        loops over key blocks stay value-independent, except for segment ids at
        hand (:attr:`segment_keys`), whose segments narrow it: packed documents cost
        the sum of their squared lengths. ``offsets``: the smallest and largest
        ``p_i - i`` where they are known more closely than :meth:`offset_range`
        (from key lengths at hand).
        """
        lo_off, hi_off = offsets or self.offset_range()
        hi = self.tk
        right = self.right_reach()
        if right is not None:
            hi = min(hi, max(0, q1 - 1 + hi_off + right + 1))
        lo = 0
        left = self.left_reach()
        if left is not None:
            lo = max(0, min(self.tk, q0 + lo_off - left))
        if self.segment_keys is not None and q1 > q0:
            first, last = self.segment_keys       # sorted ids: the block's first and last
            lo = max(lo, int(first[..., q0].min()))  # queries hold its smallest and largest
            hi = min(hi, int(last[..., q1 - 1].max()))
        return lo, max(lo, hi)

    def block_unrestricted(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether every key of ``[k0, k1)`` is visible to every query of ``[q0, q1)``."""
        if self.key_lengths is not None or self.segments is not None or self.masks_by_function:
            return False
        lo_off, hi_off = self.offset_range()
        right = self.right_reach()
        if right is not None and k1 - 1 > q0 + lo_off + right:
            return False
        left = self.left_reach()
        return left is None or k0 >= q1 - 1 + hi_off - left


def _batch_column(x: Array, extra: int, xp: Any) -> Array:
    """(B…,) -> (B…, 1, …, 1) with ``extra`` trailing unit axes."""
    return xp.reshape(x, (*x.shape, *([1] * extra)))


def positions(rules: Rules, q0: int, q1: int, xp: Any, device: Any) -> Array:
    """``p_i`` for queries ``[q0, q1)``: (bq, 1), or (B…, 1, 1, bq, 1) when it varies by row."""
    i = xp.arange(q0, q1, device=device)
    if rules.lengths_shift:
        lengths = _batch_column(rules.key_lengths, 4, xp)        # (B…, 1, 1, 1, 1)
        return xp.astype(i, lengths.dtype)[:, None] + lengths - rules.tq
    return (i + rules.offset)[:, None]                             # (bq, 1)


def visible(rules: Rules, q0: int, q1: int, k0: int, k1: int, xp: Any,
            device: Any, tile: tuple[int, ...] | None = None,
            mask_mod: bool = True) -> Array | None:
    """Bool (bq, bk) or (B…, 1|Hkv, 1|G, bq, bk): key ``j`` visible to query ``i``; ``None``:
    all. ``tile``: the shape (B…, Hkv, G, bq, bk) of the scores, which a ``mask_mod``
    needs (its batch and head indices)."""
    if not mask_mod and rules.user is not None and rules.user.mask_mod is not None:
        # a full tile: the rest of the rules
        rules = dataclasses.replace(rules, user=dataclasses.replace(rules.user, mask_mod=None))
    if not rules.restricts or rules.block_unrestricted(q0, q1, k0, k1):
        return None
    j = xp.arange(k0, k1, device=device)[None, :]                 # (1, bk)
    p = positions(rules, q0, q1, xp, device)
    if rules.key_lengths is not None:
        j = xp.astype(j, rules.key_lengths.dtype)
    ok = None

    def both(a: Array | None, b: Array) -> Array:
        return b if a is None else xp.logical_and(a, b)

    right, left = rules.right_reach(), rules.left_reach()
    if right is not None:
        ok = both(ok, j <= p + right)
    if left is not None:
        ok = both(ok, j >= p - left)
    if rules.key_lengths is not None:
        ok = both(ok, j < _batch_column(rules.key_lengths, 4, xp))
    if rules.segments is not None:
        ok = both(ok, same_segment(rules, q0, q1, k0, k1, xp))
    if rules.masks_by_function:
        assert rules.user is not None and tile is not None, "mask_mod needs the tile's shape"
        *batch, hkv, g, _, _ = tile
        ok = both(ok, user.visible(rules.user, tuple(batch), hkv, g, q0, q1, k0, k1, xp,
                                   device))
    return ok


def same_segment(rules: Rules, q0: int, q1: int, k0: int, k1: int, xp: Any) -> Array:
    """Bool (B…|1, 1, 1, bq, bk): query ``i`` and key ``j`` share a segment id."""
    assert rules.segments is not None
    q_ids, k_ids = rules.segments                                  # (B…|1, Tq), (B…|1, Tk)
    qi = xp.reshape(q_ids[..., q0:q1], (*q_ids.shape[:-1], 1, 1, q1 - q0, 1))
    kj = xp.reshape(k_ids[..., k0:k1], (*k_ids.shape[:-1], 1, 1, 1, k1 - k0))
    return qi == kj


def drop_padding(x: Array, rules: Rules | None, xp: Any) -> Array:
    """Keys or values (B…, Hkv, Tk, F) with every position ``j >= key_lengths[b]`` set to 0.

    Those keys do not exist: a preallocated cache may hold anything there, NaN
    and inf included. Their scores are removed, but ``0 · NaN`` in the products
    ``q·k`` and ``p·v`` would not be, so the padding is zeroed first.
    """
    if rules is None or rules.key_lengths is None:
        return x
    lengths = _batch_column(rules.key_lengths, 3, xp)              # (B…, 1, 1, 1)
    j = xp.astype(xp.arange(x.shape[-2], device=device_of(x)), lengths.dtype)
    keep = j[:, None] < lengths                                     # (B…, 1, Tk, 1)
    return xp.where(keep, x, 0.0)


def alibi_bias(rules: Rules, q0: int, q1: int, k0: int, k1: int, hkv: int, xp: Any,
               dtype: Any, device: Any) -> Array:
    """``-slope_h · |p_i - j|`` in the grouped layout (B…, Hkv, G, bq, bk)."""
    slopes = rules.alibi
    assert slopes is not None
    *batch, h = slopes.shape
    if h == 1:
        slopes = xp.reshape(slopes, (*batch, 1, 1, 1, 1))
    else:
        slopes = xp.reshape(slopes, (*batch, hkv, h // hkv, 1, 1))   # (B…, Hkv, G, 1, 1)
    p = positions(rules, q0, q1, xp, device)
    j = xp.arange(k0, k1, device=device)[None, :]
    distance = xp.abs(xp.astype(p, dtype) - xp.astype(j, dtype))   # (…, bq, bk)
    return -slopes * distance


def score_transform(s: Array, rules: Rules, mask: Array | None, q0: int, q1: int, k0: int,
                    k1: int, xp: Any, mask_mod: bool = True) -> Array:
    """Scaled scores of a tile -> the scores that enter the softmax (in the order of
    docs/semantics.rst).

    ``s`` (B…, Hkv, G, bq, bk) are ``scale·q·k``; ``mask`` the matching block of
    the grouped ``attn_mask`` (or ``None``). ``mask_mod=False``: a tile its block mask
    calls full, where the user's ``mask_mod`` is not evaluated.
    """
    device = device_of(s)
    if rules.softcap is not None:
        c = rules.softcap
        s = xp.tanh(s / c) * c
    if rules.alibi is not None:
        s = s + alibi_bias(rules, q0, q1, k0, k1, s.shape[-4], xp, s.dtype, device)
    if rules.user is not None and rules.user.score_mod is not None:
        s = user.modified(rules.user, s, q0, q1, k0, k1, xp, device)
    if mask is not None:
        s = xp.where(mask, s, NEG_INF) if mask.dtype == xp.bool else s + mask
    ok = visible(rules, q0, q1, k0, k1, xp, device, tuple(s.shape), mask_mod)
    if ok is not None:
        s = xp.where(ok, s, NEG_INF)
    return s


def score_transform_grad(raw: Array, rules: Rules, xp: Any, q0: int = 0, q1: int = 0,
                         k0: int = 0, k1: int = 0) -> Array | None:
    """d(score that enters the softmax) / d(scaled score) at the scaled scores ``raw`` of
    the tile (queries ``[q0, q1)``, keys ``[k0, k1)``): soft-capping's
    ``1 - tanh²(raw / softcap)`` times ``score_mod``'s derivative (:mod:`.user`);
    ``None`` where it is 1 (ALiBi and masks add constants)."""
    grad = None
    s = raw
    if rules.softcap is not None:
        t = xp.tanh(raw / rules.softcap)
        grad = 1.0 - t * t
        s = t * rules.softcap
    if rules.user is not None and rules.user.score_mod is not None:
        device = device_of(raw)
        if rules.alibi is not None:
            s = s + alibi_bias(rules, q0, q1, k0, k1, s.shape[-4], xp, s.dtype, device)
        mod = user.modified_grad(rules.user, s, q0, q1, k0, k1, xp, device)
        grad = mod if grad is None else grad * mod
    return grad


def fold_into_mask(rules: Rules, mask: Array | None, hkv: int, xp: Any, dtype: Any,
                   device: Any) -> Array | None:
    """``attn_mask`` (B…, H, Tq, Tk)-broadcastable with ALiBi and visibility folded in.

    For libraries that take one dense mask: the ALiBi bias is added (a boolean
    mask becomes a float one), invisible keys become ``False``/``-inf``.
    Soft-capping cannot be folded (it is not additive).
    """
    tq, tk = rules.tq, rules.tk
    if rules.alibi is not None:
        bias = alibi_bias(rules, 0, tq, 0, tk, hkv, xp, dtype, device)   # (B…, Hkv, G, Tq, Tk)
        *batch, a, g, _, _ = bias.shape
        bias = xp.reshape(bias, (*batch, a * g, tq, tk))                  # (B…, H, Tq, Tk)
        if mask is None:
            mask = bias
        elif mask.dtype == xp.bool:
            mask = xp.where(mask, bias, NEG_INF)
        else:
            mask = mask + bias
    ok = visible(rules, 0, tq, 0, tk, xp, device)
    if ok is not None:
        if ok.ndim > 2:
            ok = ok[..., 0, :, :]                                           # (B…, 1, Tq, Tk)
        if mask is None:
            mask = ok
        elif mask.dtype == xp.bool:
            mask = xp.logical_and(mask, ok)
        else:
            mask = xp.where(ok, mask, NEG_INF)
    return mask
