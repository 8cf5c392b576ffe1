"""The family's lowering of the rules: :class:`~polyattn.rules.visibility.Rules` as the
arrays the kernels of :mod:`.kernels` take.

:func:`lower` is the one place where the rules become numbers for the kernels: the
flags and reaches in ``iparams``, the soft-cap and the dropout scale in ``fparams``,
the key lengths, the position offsets and the ALiBi slopes per batch row. Everything
else in the family passes these arrays on without looking inside them.

The entries of ``iparams`` (int64): 0 causal, 1/2 how far left/right of its position
a query row sees (:data:`~polyattn.rules.lowering.UNBOUNDED`: every key), 3 the mask
(0 none, 1 float, 2 boolean), 4 ALiBi, 5 soft-capping, 6 keys per block, 7 dropout,
8 its threshold, 9/10 its key words, 11 query heads, 12 query rows per work item,
13 segment ids (sorted: each query row sees only its segment's keys ``segments[b, i]``),
14 scores keep their derivative for the backward pass, 15 a score rule after scaling
(soft-capping, ALiBi, a ``score_mod``: one compiled function,
:func:`.user_rules.score_rule`), 16 a ``mask_mod``, 17/18 its block mask's tile (rows,
keys), 19 query rows per entry of its key ranges (1: a range per row); the compiled
functions, their tables (``mod_args``, the soft-cap, the slopes and position offsets)
and the block mask travel as the tuple ``user``
(:func:`.user_rules.lower`).
The entries of ``fparams`` (the compute dtype): the scale, the soft-cap (1 without),
0, 1, -inf, the factor of kept weights under dropout (1 without).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyattn.backends.numba_cpu import user_rules
from polyattn.rules.dropout import key_words, threshold
from polyattn.rules.element import position
from polyattn.rules.lowering import reach
from polyattn.rules.visibility import Rules


@dataclass(frozen=True)
class Lowered:
    """The rules of one call as the kernels take them."""

    #: (20,) int64: flags, reaches, block size, dropout's counters' key, heads, rows, segments,
    #: the block mask's tiles
    iparams: np.ndarray
    #: (6,) compute dtype: scale, soft-cap, constants, dropout's factor
    fparams: np.ndarray
    #: (prod(B…),) int64: the keys of each batch row, clipped to [0, Tk]
    lengths: np.ndarray
    #: (prod(B…),) int64: ``p_i - i`` of each batch row
    offsets: np.ndarray
    #: (prod(B…), H) ALiBi slopes in the compute dtype, or (1, 1) zeros without ALiBi
    slopes: np.ndarray
    #: (prod(B…), Tq, 2) int64: the keys ``[lo, hi)`` of each query's segment (sorted segment
    #: ids, :attr:`~polyattn.rules.visibility.Rules.segment_keys`), or (1, 1, 2) zeros
    segments: np.ndarray
    #: the user's rules as the kernels take them (:func:`.user_rules.lower`)
    user: tuple[Any, ...]


def lower(rules: Rules, *, batch: tuple[int, ...], heads: int, rows: int, dtype: Any,
          scale: float, mask_kind: int, block_k: int) -> Lowered:
    """``rules`` for a call of batch ``batch`` and ``heads`` query heads, work items of
    ``rows`` query rows per head, ``block_k`` keys per block, in the compute ``dtype``;
    ``mask_kind``: 0 no mask, 1 a float mask (added), 2 a boolean one (hides keys).

    >>> low = lower(Rules(4, 6, causal=True, offset=2, window=(3, None), softcap=30.0),
    ...             batch=(2,), heads=4, rows=16, dtype=np.dtype(np.float32), scale=0.5,
    ...             mask_kind=0, block_k=256)
    >>> low.iparams[:8].tolist(), low.fparams[:2].tolist(), low.offsets.tolist()
    ([1, 3, 0, 0, 0, 1, 256, 0], [0.5, 30.0], [2, 2])
    """
    n_batch = math.prod(batch)
    tk = rules.tk
    if rules.key_lengths is None:
        lengths = np.full(n_batch, tk, dtype=np.int64)
    else:
        lengths = np.broadcast_to(np.asarray(rules.key_lengths), batch).reshape(-1)
        lengths = np.clip(lengths.astype(np.int64), 0, tk)
    # p_i = i + offset + shift·Tk_b; keys p_i - left ..= p_i + right (UNBOUNDED: every key)
    offset, shift, left, right = reach(rules, covering=True)
    offsets = position(np.zeros(n_batch, np.int64), offset, shift, lengths)
    if rules.alibi is not None:
        slopes = np.broadcast_to(np.asarray(rules.alibi, dtype=dtype),
                                 (*batch, heads)).reshape(n_batch, heads)
        slopes = np.ascontiguousarray(slopes)
    else:
        slopes = np.zeros((1, 1), dtype=dtype)
    fparams = np.array([scale, rules.softcap or 1.0, 0.0, 1.0, -np.inf,
                        rules.dropout_scale if rules.dropout else 1.0], dtype=dtype)
    if rules.segment_keys is not None:
        bounds = np.stack(rules.segment_keys, axis=-1).astype(np.int64)   # (B…|1, Tq, 2)
        segments = np.ascontiguousarray(
            np.broadcast_to(bounds, (*batch, rules.tq, 2)).reshape(n_batch, rules.tq, 2))
    else:
        segments = np.zeros((1, 1, 2), dtype=np.int64)
    key0, key1 = key_words(int(rules.dropout_seed)) if rules.dropout else (0, 0)
    user, (tile_rows, tile_keys, range_rows) = user_rules.lower(rules, batch, heads, dtype,
                                                                offsets, slopes)
    has_score = user_rules.score_rule(rules) is not None
    has_mask = rules.user is not None and rules.user.mask_mod is not None
    iparams = np.array([
        int(rules.causal), left, right, mask_kind, int(rules.alibi is not None),
        int(rules.softcap is not None), block_k, int(rules.dropout),
        threshold(rules.dropout_p) if rules.dropout else 0, key0, key1, heads, rows,
        int(rules.segment_keys is not None), int(has_score), int(has_score), int(has_mask),
        tile_rows, tile_keys, range_rows,
    ], dtype=np.int64)
    return Lowered(iparams=iparams, fparams=fparams, lengths=lengths, offsets=offsets,
                   slopes=slopes, segments=segments, user=user)
