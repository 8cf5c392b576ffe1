"""Block masks: which (query block, key block) tiles a ``mask_mod`` leaves empty or full.

:func:`block_mask` evaluates a ``mask_mod`` (docs/rules.rst) once over the whole
(B…, H, Tq, Tk) grid, tile by tile, and keeps one entry per (batch row, head, query
block, key block): empty (no visible key), partial, or full (every key visible). The
blocked implementation never computes an empty tile and does not evaluate the
``mask_mod`` inside a full one, so a user's mask costs what its visible area costs.
Building one costs one evaluation of the ``mask_mod`` per score (in tiles of one
query block, so its memory is O(block · Tk)); built once, it serves every call and
layer with the same shapes.

It also keeps, per query row, the keys ``[lo, hi)`` from its first visible key to its
last, and whether every key between them is visible (:attr:`BlockMask.rows`): a
kernel that works row by row skips the keys outside a row's range, and where the
range is solid (a causal, windowed, document or prefix-LM mask) it needs no
``mask_mod`` evaluation for that row at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyattn._interop import concrete_values
from polyattn._validation import check_mod_args, check_nonnegative_int
from polyattn.rules import scalar, tracing
from polyattn.rules import user as _user

#: The kinds of a tile.
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The tiles of a ``mask_mod`` (:func:`block_mask`): ``kinds``, ``(B…, H|1, nq, nk)``
    (``(H|1, nq, nk)`` when built with ``batch_shape=None``), of :data:`EMPTY`,
    :data:`PARTIAL`, :data:`FULL`, for tiles of ``block`` = (rows, keys); ``rows``,
    ``(B…|1, H|1, Tq, 3)`` int64, per query row ``(lo, hi, solid)``: its first
    visible key and one past its last (``0, 0``: none), and 1 where every key of
    ``[lo, hi)`` is visible, else 0 (``None``: not known, the tiles alone count).
    ``rule`` and ``rule_key``: the ``mask_mod`` when the tiles were built, as its
    expression (:func:`rule_expression`) and its :func:`~polyattn.rules.tracing.fingerprint`
    (``None`` where it cannot be traced): a call checks that its rule is still that one."""

    mask_mod: Callable[..., Any]
    mod_args: tuple[Any, ...]
    kinds: np.ndarray
    block: tuple[int, int]
    tq: int
    tk: int
    rows: np.ndarray | None = None
    rule: str | None = None
    rule_key: Any = None

    def tile(self, q0: int, q1: int, k0: int, k1: int) -> int:
        """The kind of the rectangle ``[q0, q1) × [k0, k1)`` over every batch row and head:
        empty or full only if every block it touches is."""
        bq, bk = self.block
        sub = self.kinds[..., q0 // bq:(q1 - 1) // bq + 1, k0 // bk:(k1 - 1) // bk + 1]
        if not sub.any():
            return EMPTY
        return FULL if (sub == FULL).all() else PARTIAL

    @property
    def counts(self) -> dict[str, int]:
        """How many tiles are empty, partial and full."""
        return {name: int((self.kinds == kind).sum())
                for name, kind in (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}

    def __repr__(self) -> str:
        c = self.counts
        return (f"BlockMask(tiles {tuple(self.kinds.shape)} of {self.block}, {c['empty']} "
                f"empty, {c['partial']} partial, {c['full']} full; "
                f"mask_mod={getattr(self.mask_mod, '__qualname__', self.mask_mod)})")


def block_mask(mask_mod: Callable[..., Any], batch_shape: tuple[int, ...] | None,
               num_heads: int | None, tq: int, tk: int, /, *, mod_args: tuple[Any, ...] = (),
               block: tuple[int, int] = (128, 128), xp: Any = None,
               device: Any = None) -> BlockMask:
    """The empty, partial and full tiles of ``mask_mod`` for queries ``tq`` and keys ``tk``.

    Parameters
    ----------
    mask_mod : function
        ``mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool`` (docs/rules.rst).
    batch_shape : tuple of int, or None
        The batch dimensions B… of the calls it serves; ``None``: the mask does not
        depend on ``b`` (one entry serves every batch row).
    num_heads : int, or None
        Query heads H; ``None``: it does not depend on ``h``.
    tq, tk : int
        Query and key lengths.
    mod_args : tuple of arrays
        As in :func:`polyattn.scaled_dot_product_attention`.
    block : (int, int)
        Query rows and keys per tile.
    xp, device : optional
        Where ``mask_mod`` is evaluated (default NumPy; the library of ``mod_args``).

    Returns
    -------
    BlockMask
        Pass it as ``block_mask=`` with the same ``mask_mod`` (or without one: it
        carries its own). Its ``counts`` say how many tiles are skipped.

    Examples
    --------
    >>> from polyattn import block_mask
    >>> bm = block_mask(lambda b, h, q, kv: q >= kv, None, None, 512, 512, block=(128, 128))
    >>> bm.counts
    {'empty': 6, 'partial': 4, 'full': 6}
    """
    if not callable(mask_mod):
        raise TypeError(f"`mask_mod` must be a function mask_mod(b, h, q_idx, kv_idx, "
                        f"*mod_args); got {type(mask_mod).__name__}")
    mod_args = tuple(check_mod_args(None, mask_mod, mod_args))
    tq, tk = check_nonnegative_int("tq", tq), check_nonnegative_int("tk", tk)
    if (not isinstance(block, tuple) or len(block) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in block)):
        raise ValueError(f"`block` must be (rows, keys), two positive ints; got {block!r}")
    if batch_shape is not None and not isinstance(batch_shape, (tuple, list)):
        raise TypeError("`batch_shape` must be a tuple of ints (the batch dimensions B…) or "
                        f"None; got {type(batch_shape).__name__} {batch_shape!r}"
                        + (f" (write ({batch_shape},))" if isinstance(batch_shape, int) else ""))
    batch = () if batch_shape is None else tuple(
        check_nonnegative_int("batch_shape", n) for n in batch_shape)
    heads = 1 if num_heads is None else check_nonnegative_int("num_heads", num_heads, minimum=1)
    if xp is None:
        import array_api_compat

        arrays = [a for a in mod_args if hasattr(a, "shape")]
        xp = (array_api_compat.array_namespace(*arrays) if arrays
              else array_api_compat.array_namespace(np.zeros(0)))
    bq, bk = block
    nq, nk = -(-tq // bq), -(-tk // bk)
    lead = batch or (1,)
    kinds = np.zeros((math.prod(lead), heads, nq, nk), dtype=np.int8)
    rows = np.zeros((math.prod(lead), heads, tq, 3), dtype=np.int64)
    rules = _user.UserRules(mask_mod=mask_mod, mod_args=tuple(mod_args))
    for iq in range(nq):
        q0, q1 = iq * bq, min((iq + 1) * bq, tq)
        ok = _user.visible(rules, lead, heads, 1, q0, q1, 0, tk, xp, device)
        tile = xp.broadcast_to(ok, (*lead, heads, 1, q1 - q0, tk))
        ok = concrete_values(tile)
        if ok is None and hasattr(tile, "compute") and hasattr(tile, "dask"):
            ok = tile.compute()            # Dask: building a block mask computes the mask
        if ok is None:
            raise ValueError("block_mask needs mask_mod's values at hand (not traced by "
                             "jax.jit, not lazy): build it outside the traced function")
        ok = np.asarray(ok).reshape(-1, heads, q1 - q0, tk)
        pad = nk * bk - tk
        widths = ((0, 0), (0, 0), (0, 0), (0, pad))
        padded_seen = np.pad(ok, widths, constant_values=False)
        padded_every = np.pad(ok, widths, constant_values=True)
        seen = np.asarray(padded_seen.reshape(*ok.shape[:3], nk, bk).any(axis=(2, 4)))
        every = np.asarray(padded_every.reshape(*ok.shape[:3], nk, bk).all(axis=(2, 4)))
        kinds[:, :, iq] = np.where(every, FULL, np.where(seen, PARTIAL, EMPTY))
        rows[:, :, q0:q1] = _row_ranges(ok)
    kinds = kinds.reshape(*lead, heads, nq, nk) if batch else kinds.reshape(heads, nq, nk)
    rows = rows.reshape(*lead, heads, tq, 3) if batch else rows.reshape(heads, tq, 3)
    return BlockMask(mask_mod=mask_mod, mod_args=tuple(mod_args), kinds=kinds, block=block,
                     tq=tq, tk=tk, rows=rows, rule=rule_expression(mask_mod, mod_args),
                     rule_key=tracing.fingerprint(mask_mod))


def rule_expression(fn: Any, mod_args: tuple[Any, ...]) -> str | None:
    """``fn`` (a ``mask_mod``) as the scalar source of one score, traced on stand-ins
    shaped as ``mod_args`` (``None`` where it cannot be traced: nothing to compare)."""
    try:
        stand_ins = tuple(np.broadcast_to(np.zeros((), str(a.dtype).split(".")[-1]),
                                          tuple(a.shape)) for a in mod_args)
        return scalar.source(tracing.trace(fn, "mask_mod", stand_ins), "mask_element")
    except Exception:  # a rule that cannot be traced: nothing to compare, no error
        return None


def _row_ranges(ok: np.ndarray) -> np.ndarray:
    """``(lo, hi, solid)`` per row of ``ok`` (…, rows, Tk): the first visible key, one past
    the last (``0, 0`` where none is), and 1 where every key between them is visible."""
    tk = ok.shape[-1]
    out = np.zeros((*ok.shape[:-1], 3), dtype=np.int64)
    if tk == 0:
        out[..., 2] = 1
        return out
    seen = ok.any(axis=-1)
    lo = np.where(seen, ok.argmax(axis=-1), 0)
    hi = np.where(seen, tk - ok[..., ::-1].argmax(axis=-1), 0)
    out[..., 0], out[..., 1] = lo, hi
    out[..., 2] = np.count_nonzero(ok, axis=-1) == hi - lo
    return out
