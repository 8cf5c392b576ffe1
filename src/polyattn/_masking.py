"""The call's segment ids and block masks, checked against its shapes and rules: the
segment each query's keys lie in (where sorted ids are at hand), and the block mask
that serves the call (given, or built for a ``mask_mod``)."""

from __future__ import annotations

import math
import re
from typing import Any

from polyattn._interop import Array, Namespace, concrete_values, library_name
from polyattn._validation import array_like, shape_str
from polyattn.blockmask import BlockMask, rule_expression
from polyattn.blockmask import block_mask as build_block_mask
from polyattn.rules.tracing import fingerprint
from polyattn.rules.user import UserRules


def segment_pair(segment_ids: Any) -> tuple[Any, Any]:
    """``segment_ids`` as (query ids, key ids): one array serves both, a pair gives each."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2 or any(not array_like(x) for x in segment_ids):
            raise TypeError("`segment_ids` must be an integer array (B…, T), or a pair of them "
                            "((B…, Tq), (B…, Tk)) for queries and keys; got a "
                            f"{type(segment_ids).__name__} of {len(segment_ids)} "
                            f"({', '.join(type(x).__name__ for x in segment_ids)})")
        return segment_ids[0], segment_ids[1]
    if not array_like(segment_ids):
        raise TypeError("`segment_ids` must be an integer array (B…, T), or a pair of them "
                        f"((B…, Tq), (B…, Tk)); got {type(segment_ids).__name__}")
    return segment_ids, segment_ids


def call_segments(q_ids: Any, k_ids: Any, pair: bool, batch: tuple[int, ...], tq: int, tk: int,
                  xp: Namespace) -> tuple[tuple[Array, Array] | None, tuple[Any, Any] | None]:
    """Segment ids as (B…|1, Tq) and (B…|1, Tk) integer arrays, checked (``pair``: given as
    a pair); and, where their values are at hand and sorted in every row, the key range of
    each query's segment (:attr:`Rules.segment_keys`)."""
    if q_ids is None:
        return None, None
    import numpy as np

    for which, ids, t, axis in (("queries", q_ids, tq, "Tq"), ("keys", k_ids, tk, "Tk")):
        if not xp.isdtype(ids.dtype, "integral"):
            raise TypeError(f"`segment_ids` must have an integer dtype (one id per position); "
                            f"got {ids.dtype} of shape {shape_str(ids)}")
        lead = tuple(ids.shape[:-1])
        ok = ids.ndim >= 1 and ids.shape[-1] == t and len(lead) <= len(batch) and all(
            s in (1, b) for s, b in zip(reversed(lead), reversed(batch), strict=False))
        if not ok:
            what = (f"the {which}' ids must be (B…, {axis}) = ({', '.join(map(str, batch))}"
                    f"{', ' if batch else ''}{t}) or broadcast to it" if pair else
                    f"one array serves queries and keys, so it must be (B…, T) with "
                    f"T = Tq = Tk; here Tq = {tq} and Tk = {tk}"
                    + (" (pass a pair (query ids, key ids))" if tq != tk else
                       f", B… = {batch}"))
            raise ValueError(f"`segment_ids` has shape {shape_str(ids)}; {what}")
    q_ids, k_ids = (xp.reshape(x, (1,) * (len(batch) - x.ndim + 1) + tuple(x.shape))
                    for x in (q_ids, k_ids))
    if q_ids.dtype != k_ids.dtype:
        common = xp.result_type(q_ids.dtype, k_ids.dtype)
        q_ids, k_ids = xp.astype(q_ids, common), xp.astype(k_ids, common)
    qv, kv = concrete_values(q_ids), concrete_values(k_ids)
    if qv is None or kv is None:
        return (q_ids, k_ids), None
    lead = np.broadcast_shapes(qv.shape[:-1], kv.shape[:-1])
    qv, kv = (np.broadcast_to(qv, (*lead, tq)).reshape(-1, tq),
              np.broadcast_to(kv, (*lead, tk)).reshape(-1, tk))
    def descends(ids: Any) -> bool:          # compared, not subtracted: unsigned ids wrap
        return bool((ids[:, 1:] < ids[:, :-1]).any())

    if qv.shape[0] == 0 or descends(qv) or (pair and descends(kv)):
        return (q_ids, k_ids), None                         # unsorted: masks only, no skipping
    if not pair:                  # one array: each query's segment is the run holding it
        lo, hi = _runs(qv[:, 1:] != qv[:, :-1])
        return (q_ids, k_ids), (lo.reshape(*lead, tq), hi.reshape(*lead, tq))
    lo, hi = (np.stack([np.searchsorted(kr, qr, side=side) for qr, kr in zip(qv, kv, strict=True)
                        ]).reshape(*lead, tq) for side in ("left", "right"))
    return (q_ids, k_ids), (lo, hi)


def _runs(changes: Any) -> tuple[Any, Any]:
    """Per position of rows whose values change where ``changes`` (…, T - 1) is True: the
    first position of its run of equal values and one past the last."""
    import numpy as np

    t = changes.shape[-1] + 1
    at = np.broadcast_to(np.arange(t, dtype=np.int64), (*changes.shape[:-1], t))
    edge = np.ones((*changes.shape[:-1], 1), dtype=bool)
    starts = np.concatenate([edge, changes], axis=-1)
    ends = np.concatenate([changes, edge], axis=-1)
    lo = np.maximum.accumulate(np.where(starts, at, 0), axis=-1)
    hi = np.minimum.accumulate(np.where(ends, at + 1, t)[..., ::-1], axis=-1)[..., ::-1]
    return lo, hi


def _check_block_mask_rule(given: BlockMask, user: UserRules, batch: tuple[int, ...],
                           h: int) -> None:
    """A block mask fits the call's ``mask_mod``: the rule it was built for (the same
    function reading the same values, or a function of the same expression), and with
    batch rows and heads where the function reads ``b`` or ``h`` (``None`` there promised
    that it does not)."""
    mine = given.rule
    fn = user.mask_mod if user.mask_mod is not None else given.mask_mod
    key = fingerprint(fn)
    if key is None or key != given.rule_key:         # not known to be the built-for rule
        theirs = rule_expression(fn, given.mod_args)
        if fn is not given.mask_mod and (mine is None or theirs is None or mine != theirs):
            raise ValueError(f"`block_mask` was built for mask_mod "
                             f"{function_name(given.mask_mod)}, not for this call's "
                             f"{function_name(fn)}; build it with the same "
                             "function (or pass the block mask alone)")
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"`block_mask` was built for mask_mod {function_name(fn)} "
                             "as it was then: a value it reads (a global or a closure "
                             "variable) has changed since, so its tiles no longer fit "
                             "the rule; build the block mask again")
    if mine is None:
        return
    text = mine.split("\n", 1)[1]
    lead, heads = given.kinds.shape[:-3], given.kinds.shape[-3]
    for name, built, wanted, argument in (("b", math.prod(lead) if lead else 1,
                                            math.prod(batch), "batch_shape"),
                                           ("h", heads, h, "num_heads")):
        if built == 1 and wanted > 1 and re.search(rf"\b{name}\b", text):
            raise ValueError(f"`block_mask` was built with {argument}=None, but its mask_mod "
                             f"{function_name(given.mask_mod)} reads `{name}`: its tiles "
                             f"differ between {'batch rows' if name == 'b' else 'heads'}; "
                             f"build it with {argument}=")


def function_name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))


def call_block_mask(given: BlockMask | None, user: UserRules, batch: tuple[int, ...], h: int,
                    tq: int, tk: int, xp: Namespace, device: Any) -> BlockMask | None:
    """The block mask of a call: ``given``, checked against its shapes; else, for a
    ``mask_mod`` whose ``mod_args`` are at hand, one built now (one evaluation per score;
    not on Dask, where building would compute); else ``None`` (the ``mask_mod`` is
    evaluated on every tile)."""
    if given is not None:
        if (given.tq, given.tk) != (tq, tk):
            raise ValueError(f"`block_mask` was built for Tq = {given.tq}, Tk = {given.tk}; "
                             f"this call has Tq = {tq}, Tk = {tk}")
        lead, heads = given.kinds.shape[:-3], given.kinds.shape[-3]
        batch_fits = len(lead) <= len(batch) and all(
            s in (1, b) for s, b in zip(reversed(lead), reversed(batch), strict=False))
        wrong = ([] if batch_fits else [f"batch {lead or None} (this call's B… is {batch})"]
                 ) + ([] if heads in (1, h) else [f"{heads} heads (this call has H = {h})"])
        if wrong:
            raise ValueError(f"`block_mask` was built for {' and '.join(wrong)}; build it "
                             "with this call's batch_shape and num_heads (or None)")
        _check_block_mask_rule(given, user, batch, h)
        return given
    if user.mask_mod is None:
        return None
    if library_name(xp) == "dask" or any(concrete_values(a) is None for a in user.mod_args):
        return None                        # lazy, or traced mod_args: no skipping
    try:
        return build_block_mask(user.mask_mod, batch, h, tq, tk, mod_args=user.mod_args,
                                xp=xp, device=device)
    except ValueError:                      # values not at hand
        return None
