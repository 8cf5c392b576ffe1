"""The family's lowering of the rules users write (``score_mod``, ``mask_mod``,
``mod_args``, ``block_mask``): compiled functions the kernels call through pointers.

A rule is traced once (:mod:`polyattn.rules.tracing`) and its source compiled by Numba
as C-callable functions over a panel of scores, keys by query rows, whose inner loop
runs across the rows in SIMD vectors (``score``, ``score_grad``, ``mask``), about 0.1 s
each, kept per process by their source and
dtype: a rule written again, or called with other arrays, reuses them. The kernels take
them as first-class function arguments, so they are compiled once for every rule (and
kept in Numba's cache on disk like the rest). :func:`lower` builds the tuple the
kernels take (:func:`user_type` types it): the three functions (no-ops where the call
has no such rule), the ``mod_args`` buffers, and the block mask's tile kinds and key
ranges: per query row ``(lo, hi, solid)`` from its ``rows`` (a solid row takes no
``mask_mod``), else per query block from its tiles (one tile of every key, partial,
where no block mask was built).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from polyattn import ops
from polyattn.rules import scalar, tracing

_lock = threading.Lock()
#: Tile kinds (polyattn.blockmask): a tile no key of is visible, some are, every one is.
EMPTY, PARTIAL, FULL = 0, 1, 2
#: A block mask's tile side where there is none: one tile over every query and key.
WHOLE = 2**40
#: The kernels' floating-point flags (those of :mod:`.kernels` too): reassociation and
#: contraction, never the "no NaN / no inf" assumptions.
FASTMATH = {"contract", "reassoc", "nsz", "arcp"}


#: What Numba says whenever it types a tuple holding a first-class function (the kernels'
#: ``user`` argument): at every call, not only when compiling.
_EXPERIMENTAL = "First-class function type feature is experimental"


def quiet_calls() -> None:
    """Keep Numba's word that first-class functions are experimental from reaching the
    caller of a kernel: one filter for that message, put (back) in place before each call
    (a process-wide filter rather than a context, which concurrent callers would undo)."""
    for action, message, *_ in warnings.filters:
        if action == "ignore" and message is not None and message.pattern == _EXPERIMENTAL:
            return
    warnings.filterwarnings("ignore", message=_EXPERIMENTAL)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Within it, Numba's word that first-class functions are experimental is not shown
    (the kernels take the compiled rules as such)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EXPERIMENTAL)
        yield


def signatures(dtype: Any) -> dict[str, Any]:
    """The Numba signatures of the compiled rule functions in ``dtype`` (a NumPy or Numba
    float32 or float64; :data:`polyattn.rules.scalar.HEADS`)."""
    return _signatures(str(dtype))


@functools.cache
def _signatures(name: str) -> dict[str, Any]:
    from numba import types as nt

    t = nt.float32 if name == "float32" else nt.float64
    p, i = nt.CPointer, nt.int64
    panel = (p(t), i, i, i, i, p(i), p(i), i)            # s, ld, n, w, key0, qs, hs, b
    buffers = (p(t), p(i), p(i))
    return {"score": nt.void(*panel, *buffers), "score_grad": nt.void(*panel, p(t), *buffers),
            "mask": nt.void(*panel, p(i), *buffers)}


def user_type(dtype: Any) -> Any:
    """The Numba type of the tuple :func:`lower` gives (a kernel signature's entry)."""
    return _user_type(str(dtype))


@functools.cache
def _user_type(name: str) -> Any:
    from numba import types as nt

    t = nt.float32 if name == "float32" else nt.float64
    sigs = signatures(name)

    def arr(dt: Any, ndim: int) -> Any:
        return nt.Array(dt, ndim, "A", readonly=True)

    with quiet():
        return nt.Tuple((nt.FunctionType(sigs["score"]), nt.FunctionType(sigs["score_grad"]),
                         nt.FunctionType(sigs["mask"]), arr(t, 1), arr(nt.int64, 1),
                         arr(nt.int64, 1), arr(nt.int8, 4), arr(nt.int64, 4)))


@functools.cache
def _compiled(text: str, form: str, dtype_name: str) -> Any:
    """The source ``text`` of form ``form`` compiled as a C-callable function in ``dtype``."""
    import numba

    t = np.dtype(dtype_name).type
    clamp = numba.njit(inline="always")(
        types.FunctionType(scalar.clamp.__code__, {"min": min, "max": max}, "clamp"))
    from polyattn.backends.numba_cpu.tanh import tanh32

    names: dict[str, Any] = {"T": t, "math": math, "np": np, "clamp": clamp,
                             "tanh": tanh32 if t is np.float32 else math.tanh}
    exec(compile(text, f"<polyattn rule {form}>", "exec"), names)
    return numba.cfunc(signatures(dtype_name)[form], fastmath=FASTMATH,
                       error_model="numpy")(names[form])


def _noop_panel(s: Any, ld: Any, n: Any, w: Any, key0: Any, qs: Any, hs: Any, b: Any,
                fb: Any, ib: Any, meta: Any) -> None:
    return


def _noop_panel_with(s: Any, ld: Any, n: Any, w: Any, key0: Any, qs: Any, hs: Any, b: Any,
                     extra: Any, fb: Any, ib: Any, meta: Any) -> None:
    return


@functools.cache
def noop(name: str) -> tuple[Any, Any, Any]:
    """The no-op ``(score, score_grad, mask)`` in dtype ``name``: what the kernels take
    where a call has no such rule (never called then)."""
    import numba

    sigs = signatures(name)
    return (numba.cfunc(sigs["score"], cache=True)(_noop_panel),
            numba.cfunc(sigs["score_grad"], cache=True)(_noop_panel_with),
            numba.cfunc(sigs["mask"], cache=True)(_noop_panel_with))


def score_rule(rules: Any) -> Callable[..., Any] | None:
    """The call's score rules after scaling as one ``score_mod``: soft-capping, ALiBi
    (docs/semantics.rst's order) and the user's ``score_mod``, reading the user's
    ``mod_args`` then the tables of :func:`builtin_tables`; ``None`` where there are
    none. The kernels compile the built-in rules through it too."""
    softcap, alibi = rules.softcap is not None, rules.alibi is not None
    user = rules.user.score_mod if rules.user is not None else None
    if not (softcap or alibi or user is not None):
        return None
    n_user = 0 if rules.user is None else len(rules.user.mod_args)

    def score(s: Any, b: Any, h: Any, q: Any, kv: Any, *args: Any) -> Any:
        extra = list(args[n_user:])
        if softcap:
            cap = extra.pop(0)[0]
            s = cap * ops.tanh(s / cap)
        if alibi:
            slopes, offsets = extra.pop(0), extra.pop(0)
            s = s - slopes[b, h] * ops.cast(ops.abs(q + offsets[b] - kv), s)
        if user is not None:
            s = user(s, b, h, q, kv, *args[:n_user])
        return s

    return score


def builtin_tables(rules: Any, dtype: Any, offsets: np.ndarray,
                   slopes: np.ndarray) -> tuple[np.ndarray, ...]:
    """The arrays :func:`score_rule` reads for the built-in rules: the soft-cap (1,),
    then ALiBi's slopes (B|1, H|1) and each batch row's position offset (B,)."""
    tables: list[np.ndarray] = []
    if rules.softcap is not None:
        tables.append(np.array([rules.softcap], dtype=dtype))
    if rules.alibi is not None:
        tables += [np.asarray(slopes, dtype=dtype), np.asarray(offsets, dtype=np.int64)]
    return tuple(tables)


def functions(rules: Any, dtype: Any, arrays: tuple[np.ndarray, ...],
              width: int) -> tuple[Any, Any, Any]:
    """``(score, score_grad, mask)`` compiled for the call's rules (:func:`score_rule`,
    the user's ``mask_mod``; the kernels' no-op ones where there is no such rule), for
    buffers of ``arrays`` (the user's ``mod_args``, then :func:`builtin_tables`) with
    ``width`` entries of ``meta`` per array."""
    name = np.dtype(dtype).name
    score, grad, mask = noop(name)
    rule = score_rule(rules)
    user = rules.user
    with _lock:
        if rule is not None:
            score, grad = _rule_functions(rule, "score_mod", arrays, width, name)
        if user is not None and user.mask_mod is not None:
            (mask,) = _rule_functions(user.mask_mod, "mask_mod", arrays[:len(user.mod_args)],
                                      width, name)
    return score, grad, mask


#: Compiled functions by the rule's :func:`.tracing.fingerprint` and the tables' shapes
#: and dtypes: a rule seen before is neither traced nor written out again.
_FUNCTIONS: dict[Any, tuple[Any, ...]] = {}
_FUNCTIONS_KEPT = 256


def _rule_functions(fn: Callable[..., Any], what: str, arrays: tuple[np.ndarray, ...],
                    width: int, name: str) -> tuple[Any, ...]:
    """``(score, score_grad)`` for a ``score_mod``, ``(mask,)`` for a ``mask_mod``."""
    forms = ("score", "score_grad") if what == "score_mod" else ("mask",)
    fp = tracing.fingerprint(fn)
    key = None if fp is None else (fp, what, tuple((a.shape, a.dtype.str) for a in arrays),
                                   width, name)
    if key is not None and key in _FUNCTIONS:
        return _FUNCTIONS[key]
    traced = tracing.trace(fn, what, arrays)
    got = tuple(_compiled(scalar.source(traced, form, width), form, name) for form in forms)
    if key is not None:
        if len(_FUNCTIONS) >= _FUNCTIONS_KEPT:
            _FUNCTIONS.pop(next(iter(_FUNCTIONS)))
        _FUNCTIONS[key] = got
    return got


def _arrays(mod_args: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(a) for a in mod_args)


class _Spec:
    """A ``mod_args`` array's shape and NumPy dtype: what tracing a rule reads of it (its
    values may not be at hand: a JAX array traced by ``jax.jit`` or ``jax.grad``)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.shape, self.dtype = shape, dtype


def _specs(mod_args: tuple[Any, ...]) -> tuple[_Spec, ...] | str:
    """The :class:`_Spec` of each array, or why one has no NumPy dtype."""
    specs = []
    for n, a in enumerate(mod_args):
        try:
            dtype = np.dtype(a.dtype)
        except TypeError:
            try:                                    # torch's dtypes: "torch.float32"
                dtype = np.dtype(str(a.dtype).rsplit(".", 1)[-1])
            except TypeError:
                return (f"it holds mod_args in NumPy dtypes, and mod_args[{n}] is "
                        f"{a.dtype}")
        specs.append(_Spec(tuple(int(d) for d in a.shape), dtype))
    return tuple(specs)


def check(rules: Any) -> str | None:
    """Why the call's user rules cannot be compiled (``None``: they can): the first
    tracing error, naming the function. Tracing reads the shapes and dtypes of
    ``mod_args``, not their values."""
    user = rules.user
    if user is None:
        return None
    arrays = _specs(user.mod_args)
    if isinstance(arrays, str):
        return arrays
    for fn, what in ((user.score_mod, "score_mod"), (user.mask_mod, "mask_mod")):
        if fn is None:
            continue
        fp = tracing.fingerprint(fn)
        key = None if fp is None else (fp, what, tuple((a.shape, a.dtype.str) for a in arrays))
        if key is not None and key in _CHECKED:
            continue                      # traced before, as the same rule on such tables
        try:
            tracing.trace(fn, what, arrays)
        except TypeError as exc:
            return str(exc)
        if key is not None:
            if len(_CHECKED) >= _FUNCTIONS_KEPT:
                _CHECKED.discard(next(iter(_CHECKED)))
            _CHECKED.add(key)
    return None


#: The rules :func:`check` traced without error (keys as for :data:`_FUNCTIONS`).
_CHECKED: set[Any] = set()


def lower(rules: Any, batch: tuple[int, ...], heads: int, dtype: Any, offsets: np.ndarray,
          slopes: np.ndarray) -> tuple[tuple[Any, ...], tuple[int, int, int]]:
    """The tuple of :func:`user_type` for a call (its built-in score rules read each batch
    row's position ``offsets`` and the ALiBi ``slopes`` as lowered by
    :func:`.parameters.lower`), and the block mask's tile (rows, keys) and the query rows
    per entry of its key ranges (1 where the block mask knows each row's keys)."""
    user = rules.user
    arrays = (() if user is None else _arrays(user.mod_args)) + builtin_tables(
        rules, dtype, offsets, slopes)
    width = 1 + 2 * max([a.ndim for a in arrays], default=0)
    score, grad, mask = functions(rules, dtype, arrays, width)
    fb, ib, meta = scalar.pack(arrays, dtype, width)
    blocks = rules.blocks
    if blocks is None or user is None or user.mask_mod is None:
        kinds = np.full((1, 1, 1, 1), PARTIAL, dtype=np.int8)
        ranges = np.array([0, WHOLE, 0], dtype=np.int64).reshape(1, 1, 1, 3)
        return (score, grad, mask, fb, ib, meta, kinds, ranges), (WHOLE, WHOLE, WHOLE)
    kinds = _per_batch_row(np.asarray(blocks.kinds, dtype=np.int8), batch)
    bq, bk = blocks.block
    if blocks.rows is not None:
        ranges = _per_batch_row(np.asarray(blocks.rows, dtype=np.int64), batch)
        return (score, grad, mask, fb, ib, meta, kinds, ranges), (bq, bk, 1)
    seen = kinds != EMPTY                                       # (B|1, H|1, nq, nk)
    nk = kinds.shape[-1]
    any_seen = seen.any(axis=-1)
    first = np.where(any_seen, seen.argmax(axis=-1), 0) * bk
    last = np.where(any_seen, (nk - seen[..., ::-1].argmax(axis=-1)) * bk, 0)
    ranges = np.stack([first, last, np.zeros_like(first)], axis=-1).astype(np.int64)
    return (score, grad, mask, fb, ib, meta, kinds, np.ascontiguousarray(ranges)), (bq, bk, bq)


def _per_batch_row(x: np.ndarray, batch: tuple[int, ...]) -> np.ndarray:
    """A block mask's array ``(B…|1, H|1, n, m)`` as ``(prod(B…)|1, H|1, n, m)``, C-contiguous."""
    lead = x.shape[:-3]
    if lead:
        x = np.broadcast_to(x, (*batch, *x.shape[-3:])).reshape(math.prod(batch),
                                                                 *x.shape[-3:])
    else:
        x = x.reshape(1, *x.shape)
    return np.ascontiguousarray(x)
