"""Rules users write: ``score_mod`` and ``mask_mod`` on tiles of scores.

``score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> score`` changes the scaled score
after soft-capping and ALiBi, before the float ``attn_mask``; ``mask_mod(b, h, q_idx,
kv_idx, *mod_args) -> bool`` hides the keys where it is False, with every other rule
(docs/semantics.rst, "Rules you write"). ``b`` is the flat index over the batch
dimensions B…, ``h`` the query head, ``q_idx`` and ``kv_idx`` the row and key
indices. The Array-API paths call them on a tile (B…, Hkv, G, bq, bk) of scores with
index arrays that broadcast to it; ``mod_args`` reach them as :class:`Table` objects,
indexed by those arrays in the inputs' library (``bias[h]``, ``table[h, q_idx -
kv_idx + 64]``). The derivative of ``score_mod`` with respect to the score, which the
backward passes need, comes from evaluating it on :class:`polyattn.ops.Dual` values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyattn._interop import concrete_values, library_name
from polyattn.ops import _CONTROL_FLOW, Dual
from polyattn.rules.tracing import fingerprint

Array = Any


class Table:
    """A ``mod_args`` array as a rule sees it: indexed by index arrays (or ints) along its
    leading axes, portably (one ``take`` of the flattened array), the result broadcast
    over the indices' shapes followed by the axes left."""

    __slots__ = ("array", "xp")

    def __init__(self, array: Array, xp: Any) -> None:
        self.array, self.xp = array, xp

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> Any:
        return self.array.dtype

    def __getitem__(self, index: Any) -> Array:
        return self.lookup(index)[0]

    def lookup(self, index: Any) -> tuple[Array, Array]:
        """``(self[index], the flat indices it read)``, the latter shaped as the indices
        broadcast together."""
        xp, a = self.xp, self.array
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > a.ndim:
            raise IndexError(f"a mod_args array of shape {self.shape} indexed by "
                             f"{len(index)} indices")
        device = getattr(a, "device", None)
        fix = ("indices are integers: a table is indexed by b, h, q_idx, kv_idx, integers "
               "and integer expressions of them, not by the score or a value computed from it")
        if any(isinstance(i, Dual) for i in index):
            raise TypeError(f"a mod_args array of shape {self.shape} indexed by the score: "
                            f"{fix}")
        parts = [i if hasattr(i, "shape") else xp.asarray(i, device=device) for i in index]
        for i in parts:
            if not xp.isdtype(i.dtype, "integral"):
                raise TypeError(f"a mod_args array of shape {self.shape} indexed by "
                                f"{i.dtype} values: {fix}")
        wide = index_dtype(xp)
        parts = [xp.astype(i, wide) if i.dtype != wide else i for i in parts]
        # a negative index counts from the end of its own axis (as Python's); an index
        # outside its axis is clamped to it, as in the kernels (never another axis's)
        parts = [xp.clip(xp.where(i < 0, i + n, i), 0, max(n - 1, 0))
                 for i, n in zip(parts, a.shape, strict=False)]
        parts = list(xp.broadcast_arrays(*parts)) if len(parts) > 1 else parts
        lead = a.shape[:len(index)]
        rest = tuple(a.shape[len(index):])
        if not parts:                                   # table[()]: the whole (0-d) array
            return a, xp.zeros((), dtype=index_dtype(xp), device=device)
        flat = parts[0]
        for size, i in zip(lead[1:], parts[1:], strict=True):
            flat = flat * size + i
        shape = tuple(flat.shape)
        table = xp.reshape(a, (-1, *rest)) if len(index) > 1 or a.ndim > 1 else a
        got = xp.take(table, xp.reshape(flat, (-1,)), axis=0)
        return xp.reshape(got, (*shape, *rest)), flat

    def __repr__(self) -> str:
        return f"Table(shape={self.shape}, dtype={self.dtype})"


@dataclass(frozen=True)
class UserRules:
    """A call's ``score_mod``, ``mask_mod`` and ``mod_args``."""

    score_mod: Callable[..., Any] | None = None
    mask_mod: Callable[..., Any] | None = None
    mod_args: tuple[Array, ...] = ()


def indices(batch: tuple[int, ...], hkv: int, g: int, q0: int, q1: int, k0: int, k1: int,
            xp: Any, device: Any) -> tuple[Array, Array, Array, Array]:
    """``(b, h, q_idx, kv_idx)`` as integer arrays (:func:`index_dtype`) broadcasting to
    (B…, Hkv, G, bq, bk)."""
    nb = len(batch)
    n = 1
    for s in batch:
        n *= s
    dt = index_dtype(xp)
    b = xp.reshape(xp.arange(n, dtype=dt, device=device), (*batch, 1, 1, 1, 1))
    h = xp.reshape(xp.arange(hkv * g, dtype=dt, device=device),
                   (*([1] * nb), hkv, g, 1, 1))
    q = xp.reshape(xp.arange(q0, q1, dtype=dt, device=device), (q1 - q0, 1))
    kv = xp.reshape(xp.arange(k0, k1, dtype=dt, device=device), (1, k1 - k0))
    return b, h, q, kv


def index_dtype(xp: Any) -> Any:
    """The integer dtype of the indices a rule gets: int64, or int32 for JAX without
    64-bit types (where asking for int64 warns and gives int32 anyway)."""
    if library_name(xp) == "jax":
        import jax

        if not jax.config.jax_enable_x64:
            return xp.int32
    return xp.int64


def _call(fn: Callable[..., Any], what: str, *args: Any) -> Any:
    """``fn(*args)``, its errors saying which rule raised them."""
    try:
        return fn(*args)
    except Exception as exc:
        text = str(exc)
        if "Expected Array or Python scalar" in text and "Dual" in text:
            text = (f"{text} (array-api-strict's arrays refuse an operand that carries a "
                    "derivative: put the score, or a value computed from it or from a "
                    "floating mod_args table, on the left of the operator, as in "
                    "`score * (q_idx - kv_idx)`)")
        elif "unsupported operand" in text and "Dual" in text:
            text = (f"{text} (this operator does not apply to the score or a value computed "
                    "from it: write scores with +, -, *, /, //, %, ** and the functions of "
                    "polyattn.ops)")
        elif any(s in text.lower() for s in ("truth value", "boolean value", "ambiguous",
                                              "concretization", "bool(", "bool is only")):
            text = f"{text} ({_CONTROL_FLOW})"               # `if`, `and`, `max` on a tile
        elif ("Dual" in text or "ufunc" in text or "real number" in text
              or "converted to python scalars" in text.lower()
              or "allowed on arrays with 0 dimensions" in text):
            from polyattn.rules.tracing import ops_hint

            text = (f"{text} (a math or NumPy function on a rule's argument: math's take one "
                    "number, not a tile of scores or indices, and NumPy's cannot carry the "
                    "score's derivative: use the functions of polyattn.ops instead"
                    f"{ops_hint(fn)})")
        elif "positional argument" in text:
            text = (f"{text} (score_mod gets (score, b, h, q_idx, kv_idx, *mod_args) and "
                    "mask_mod (b, h, q_idx, kv_idx, *mod_args): both receive every array of "
                    "mod_args)")
        raise TypeError(f"{what} {_name(fn)} cannot run on tiles of scores: "
                        f"{type(exc).__name__}: {text}") from exc


def probe(user: UserRules, xp: Any, dtype: Any, device: Any) -> None:
    """Call the rules once on a 2 × 2 tile of one batch row and head, on values that carry a
    derivative: errors (Python control flow, an unknown call, a bad index) surface here,
    at the call, naming the function. Rules probed before (the same
    :func:`.tracing.fingerprint`, library, dtype, device and tables) are not probed
    again."""
    key = _probe_key(user, xp, dtype, device)
    if key is not None and key in _PROBED:
        return
    _probe(user, xp, dtype, device)
    if key is not None:
        if len(_PROBED) >= 256:
            _PROBED.discard(next(iter(_PROBED)))
        _PROBED.add(key)


#: Keys (:func:`_probe_key`) of the rules :func:`probe` found working.
_PROBED: set[Any] = set()


def _probe_key(user: UserRules, xp: Any, dtype: Any, device: Any) -> Any:
    fps = tuple(None if fn is None else fingerprint(fn)
                for fn in (user.score_mod, user.mask_mod))
    if any(fp is None and fn is not None
           for fp, fn in zip(fps, (user.score_mod, user.mask_mod), strict=True)):
        return None
    tables = tuple((type(a), tuple(a.shape), str(a.dtype)) for a in user.mod_args)
    return (fps, getattr(xp, "__name__", id(xp)), str(dtype), str(device), tables)


def _probe(user: UserRules, xp: Any, dtype: Any, device: Any) -> None:
    idx = indices((1,), 1, 1, 0, 2, 0, 2, xp, device)
    tables = _tables(user, xp)
    if user.score_mod is not None:
        s = xp.reshape(xp.asarray([0.5, -1.0, 2.0, 0.25], dtype=dtype, device=device),
                       (1, 1, 1, 2, 2))
        traced = _call(user.score_mod, "score_mod", Dual(s, s * 0 + 1), *idx, *tables)
        plain = _check_score(user, _call(user.score_mod, "score_mod", s, *idx, *tables), xp)
        if not isinstance(traced, Dual):
            moved = _check_score(user, _call(user.score_mod, "score_mod", s + 1, *idx,
                                             *tables), xp)
            changed = concrete_values(xp.any(xp.asarray(moved != plain)))
            if changed is not None and bool(changed):
                raise TypeError(f"score_mod {_name(user.score_mod)} loses the score's "
                                "derivative: a NumPy or library function on the score (use "
                                "the functions of polyattn.ops, such as ops.where)")
    if user.mask_mod is not None:
        visible(user, (1,), 1, 1, 0, 2, 0, 2, xp, device)


def _check_score(user: UserRules, out: Any, xp: Any) -> Any:
    """``out``, a ``score_mod``'s result on the probe, if it is scores: a number or a real
    floating or integer array (a condition, ``None`` or anything else is a TypeError)."""
    name = _name(user.score_mod) if user.score_mod is not None else "score_mod"
    ok = (isinstance(out, (int, float)) and not isinstance(out, bool)) or (
        hasattr(out, "dtype") and hasattr(out, "shape")
        and str(out.dtype).split(".")[-1].startswith(("float", "int", "uint", "bfloat")))
    if not ok:
        got = getattr(out, "dtype", None) or type(out).__name__
        raise TypeError(f"score_mod {name} must return scores (a number or a floating "
                        f"array); got {got}")
    return out


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _tables(user: UserRules, xp: Any) -> list[Table]:
    return [Table(a, xp) for a in user.mod_args]


def modified(user: UserRules, s: Array, q0: int, q1: int, k0: int, k1: int, xp: Any,
             device: Any) -> Array:
    """``score_mod`` of a tile ``s`` (B…, Hkv, G, bq, bk), in its dtype and shape."""
    *batch, hkv, g, _, _ = s.shape
    return score_at(user, s, indices(tuple(batch), hkv, g, q0, q1, k0, k1, xp, device), xp)


def modified_grad(user: UserRules, s: Array, q0: int, q1: int, k0: int, k1: int, xp: Any,
                  device: Any) -> Array:
    """d score_mod / d score at the tile ``s``, in its dtype and shape."""
    *batch, hkv, g, _, _ = s.shape
    idx = indices(tuple(batch), hkv, g, q0, q1, k0, k1, xp, device)
    return score_and_grad_at(user, s, idx, xp, device)[1]


def score_at(user: UserRules, s: Array, idx: tuple[Array, ...], xp: Any) -> Array:
    """``score_mod`` of the scores ``s`` at the index arrays ``idx`` = ``(b, h, q_idx,
    kv_idx)``, which broadcast to ``s``: an array of ``s``'s dtype and shape (a read-only
    view where the rule returns something smaller, such as a number)."""
    assert user.score_mod is not None
    out = _call(user.score_mod, "score_mod", s, *idx, *_tables(user, xp))
    return _like(out, s, xp)


def score_and_grad_at(user: UserRules, s: Array, idx: tuple[Array, ...], xp: Any,
                      device: Any) -> tuple[Array, Array]:
    """``score_mod`` of ``s`` at ``idx`` (as :func:`score_at`) and its derivative with
    respect to the score, from one evaluation on values that carry it (:class:`Dual`)."""
    assert user.score_mod is not None
    one = xp.ones(tuple(s.shape), dtype=s.dtype, device=device)
    out = _call(user.score_mod, "score_mod", Dual(s, one), *idx, *_tables(user, xp))
    if not isinstance(out, Dual):              # a score_mod that ignores the score
        return _like(out, s, xp), xp.zeros(tuple(s.shape), dtype=s.dtype, device=device)
    return _like(out.x, s, xp), _like(out.d, s, xp)


class _Seeded(Table):
    """A floating ``mod_args`` array whose ``target``-th load (counted over every table of
    the call, in the order the rule makes them) carries a derivative of 1: the rule's
    result then carries its derivative with respect to the elements that load read."""

    __slots__ = ("log", "number")

    def __init__(self, array: Array, xp: Any, number: int, log: dict[str, Any]) -> None:
        super().__init__(array, xp)
        self.number, self.log = number, log

    def __getitem__(self, index: Any) -> Any:
        value, flat = self.lookup(index)
        log = self.log
        at = log["count"]
        log["count"] += 1
        log["tables"].append(self.number)
        if at == log["target"]:
            if value.ndim != flat.ndim:
                raise TypeError(f"a gradient of mod_args[{self.number}] needs every axis "
                                "of it indexed (one element per score)")
            log["flat"] = flat
            return Dual(value, self.xp.ones_like(value))
        return value


def table_partials(user: UserRules, s: Array, q0: int, q1: int, k0: int, k1: int, xp: Any,
                   device: Any, floating: tuple[int, ...],
                   ) -> list[tuple[int, Array, Array]]:
    """For each load ``score_mod`` makes of a ``mod_args`` array numbered in ``floating``,
    on the tile ``s`` (its scores before ``score_mod``): ``(number, flat indices read,
    d score_mod / d element read)``, both broadcasting to the tile."""
    rule = user.score_mod
    assert rule is not None
    *batch, hkv, g, _, _ = s.shape
    idx = indices(tuple(batch), hkv, g, q0, q1, k0, k1, xp, device)

    def run(target: int) -> tuple[Any, dict[str, Any]]:
        log: dict[str, Any] = {"count": 0, "target": target, "tables": [], "flat": None}
        tables = [_Seeded(a, xp, n, log) if n in floating else Table(a, xp)
                  for n, a in enumerate(user.mod_args)]
        # the score carries a zero derivative, so that `score * table[h]` takes Dual's
        # operator even where the library's arrays refuse other operands
        return _call(rule, "score_mod", Dual(s, s * 0), *idx, *tables), log

    _, census = run(-1)
    found = []
    for target, number in enumerate(census["tables"]):
        out, log = run(target)
        if isinstance(out, Dual) and log["flat"] is not None:   # the load was made
            found.append((number, log["flat"], out.d))
    return found


def visible(user: UserRules, batch: tuple[int, ...], hkv: int, g: int, q0: int, q1: int,
            k0: int, k1: int, xp: Any, device: Any) -> Array:
    """``mask_mod`` of a tile: bool, broadcasting to (B…, Hkv, G, bq, bk)."""
    return visible_at(user, indices(batch, hkv, g, q0, q1, k0, k1, xp, device), xp, device)


def visible_at(user: UserRules, idx: tuple[Array, ...], xp: Any, device: Any) -> Array:
    """``mask_mod`` at the index arrays ``idx`` = ``(b, h, q_idx, kv_idx)``: bool,
    broadcasting with them."""
    assert user.mask_mod is not None
    ok = _call(user.mask_mod, "mask_mod", *idx, *_tables(user, xp))
    if isinstance(ok, bool):                     # every key (True) or none (False)
        ok = xp.asarray(ok, device=device)
    if isinstance(ok, Dual):
        raise TypeError(f"mask_mod {_name(user.mask_mod)} returned scores, not a condition")
    if not hasattr(ok, "dtype") or ok.dtype != xp.bool:
        raise TypeError(f"mask_mod {_name(user.mask_mod)} must return a boolean array "
                        f"(True = visible); got {getattr(ok, 'dtype', type(ok).__name__)}")
    return ok


def _like(x: Any, s: Array, xp: Any) -> Array:
    """``x`` (a number or an array broadcasting to ``s``) as an array of ``s``'s dtype and
    shape."""
    if not hasattr(x, "shape"):
        x = xp.asarray(x, dtype=s.dtype, device=getattr(s, "device", None))
    if x.dtype != s.dtype:
        x = xp.astype(x, s.dtype)
    if tuple(x.shape) != tuple(s.shape):
        x = xp.broadcast_to(x, tuple(s.shape))
    return x
