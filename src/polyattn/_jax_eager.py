"""Calls on JAX arrays, each pass run as one compiled computation.

Outside ``jax.jit``, JAX runs each operation on its own and compiles it for every new
shape it meets: an Array-API implementation is some fifty operations, so a call on a new
shape spent seconds compiling them one by one, and every later call dispatched them one
by one (``jax.grad`` and ``jax.vmap`` without ``jax.jit`` too). Here the implementation's
pass is traced once into one ``jax.jit`` computation
over the call's arrays (:class:`._jax_bridge.Call` takes them out) and kept under a key
made of everything else the call is: its shapes, rules, scale and dtypes, the
implementation's settings (block sizes), the user's ``score_mod`` and ``mask_mod`` by
:func:`.rules.tracing.fingerprint` (their code and the numbers and functions they read),
a block mask by its tiles. A later call with the same key and arrays of the same shapes
and dtypes runs the compiled computation. Key lengths and an int dropout seed are
operands like the arrays, so that a decoding loop or a training loop with a new seed at
every step compiles once.

Calls run operation by operation as before (:func:`stays_eager`) where a key would change
from one call to the next in a loop (sorted segment ids whose values narrow the keys
read, one packing per batch; a dropout seed that no JAX array holds), where a
``score_mod`` or ``mask_mod`` reads an array or an object from its closure or globals
(what it reads may change between calls, and a compiled computation would keep the first
value), and where the call holds anything else that cannot be compared. The traced
computation is the Array-API code that ``jax.jit`` around the caller's function traces:
its results and errors are those of that route (a rule must trace: ``float()`` of a
``mod_args`` array, which the operations one by one allow, raises).
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from polyattn._interop import library_name
from polyattn._jax_bridge import Call
from polyattn._problem import Problem
from polyattn.blockmask import BlockMask
from polyattn.rules.tracing import fingerprint
from polyattn.rules.user import UserRules

Array = Any
#: How many compiled passes are kept (the least recently used go first).
CAPACITY = 256

_COMPILED: OrderedDict[Any, Callable[..., Any]] = OrderedDict()
_LOCK = threading.Lock()


class Unkeyed(Exception):
    """The call's template holds a value that cannot be part of a key."""


def _key(x: Any) -> Any:
    """A hashable value equal for equal templates (floats by their bits, NumPy arrays by
    their bytes, modules and types by identity, a block mask by its tiles);
    :class:`Unkeyed` where there is none."""
    if x is None or isinstance(x, (bool, int, str, bytes)):
        return (type(x), x)
    if isinstance(x, float):
        return (float, x.hex())
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_key(i) for i in x))
    if isinstance(x, np.ndarray):
        return (np.ndarray, x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, np.generic):
        return (type(x), _key(x.item()))
    if isinstance(x, BlockMask):        # the implementations read its tiles only
        return (BlockMask, _key(x.kinds), x.block, x.tq, x.tk, _key(x.rows))
    if isinstance(x, UserRules):        # the rules by what they trace to (mod_args: operands)
        keys = tuple(None if fn is None else fingerprint(fn)
                     for fn in (x.score_mod, x.mask_mod))
        if any(k is None and fn is not None
               for k, fn in zip(keys, (x.score_mod, x.mask_mod), strict=True)):
            raise Unkeyed("a score_mod or mask_mod that reads an array or an object: it may "
                          "change between calls")
        return (UserRules, keys)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x), tuple(_key(getattr(x, f.name)) for f in dataclasses.fields(x)))
    if isinstance(x, (types.ModuleType, type, np.dtype)):
        return ("object", x)
    raise Unkeyed(f"the call holds a value of type {type(x).__name__}")


def stays_eager(problem: Problem) -> str | None:
    """Why ``problem`` (JAX arrays) does not run compiled here, in words; ``None``: it does.
    Not here: rules whose host-side values change from call to call (sorted segment ids at
    hand, a dropout seed no JAX array holds). Traced arrays (``jax.grad``, ``jax.vmap``,
    ``jax.jit`` around the call) run compiled too: JAX differentiates and maps the
    computation, and under ``jax.jit`` it is part of the caller's."""
    if library_name(problem.xp) != "jax":
        return "not JAX arrays"
    rules = problem.rules
    if rules.dropout and isinstance(rules.dropout_seed, int) and _seed(
            rules.dropout_seed) is None:
        return ("a dropout seed of 2**32 or more with JAX's 64-bit types off: no JAX array "
                "holds it")
    if rules.segment_keys is not None:
        return "sorted segment ids at hand narrow the keys read, which depend on their values"
    return None


def _seed(seed: int) -> Any:
    """A dropout seed as a 0-d JAX array whose key words are those of the int (uint64, or
    uint32 without 64-bit types); ``None`` where it does not fit."""
    import jax
    import jax.numpy as jnp

    wide = bool(jax.config.jax_enable_x64)
    if not 0 <= seed < 2 ** (64 if wide else 32):
        return None
    return jnp.asarray(seed, dtype=jnp.uint64 if wide else jnp.uint32)


def _template(backend: Any, problem: Problem) -> tuple[Any, Call, list[Array]] | str:
    """The key, the call and its operands; or why the call has none."""
    why = stays_eager(problem)
    if why is not None:
        return why
    # the key lengths' values at hand serve plans made before anything runs (Dask's): the
    # Array-API implementations mask by the array, so a decoding loop compiles once
    # and an int dropout seed becomes an operand, so that a new seed at every training step
    # reuses the computation
    rules = problem.rules
    seed = (_seed(rules.dropout_seed) if rules.dropout and isinstance(rules.dropout_seed, int)
            else rules.dropout_seed)
    problem = dataclasses.replace(
        problem, rules=dataclasses.replace(rules, lengths_at_hand=None, dropout_seed=seed))
    call, operands = Call.of(problem, backend, None)
    try:
        settings: tuple[Any, ...] = getattr(backend, "settings", tuple)()
        key = (backend.NAME, type(backend).__qualname__, _key(settings), call.present,
               call.tables, _key(call.problem))
    except Unkeyed as exc:
        return f"{exc}, which cannot be compared from one call to the next"
    return key, call, operands


def describe(backend: Any, problem: Problem) -> str:
    """How the call runs, for ``explain()``."""
    found = _template(backend, problem)
    if isinstance(found, str):
        if found.startswith("traced"):
            return found
        return f"operation by operation: {found}"
    return "one jax.jit computation per pass, compiled once for calls like this one"


def _compiled(key: Any, build: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is not None:
            _COMPILED.move_to_end(key)
            return fn
    fn = build()
    with _LOCK:
        fn = _COMPILED.setdefault(key, fn)
        while len(_COMPILED) > CAPACITY:
            _COMPILED.popitem(last=False)
    return fn


def passes(backend: Any, problem: Problem) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """``backend``'s forward and backward passes on ``problem``'s JAX arrays, each one
    ``jax.jit`` computation; ``None`` where the call has no key (it then runs eagerly)."""
    import jax

    found = _template(backend, problem)
    if isinstance(found, str):
        return None
    key, call, operands = found
    rest = operands[3:]

    def build_forward() -> Callable[..., Any]:
        def forward(*arrays: Array) -> tuple[Array, Array]:
            out, lse = backend.forward(call.rebuild(list(arrays)))
            return out, lse
        return jax.jit(forward)

    def build_backward() -> Callable[..., Any]:
        def backward(arrays: list[Array], out: Array, lse: Array, grad_out: Array,
                     grad_lse: Array | None) -> tuple[Array, Array, Array]:
            dq, dk, dv = backend.backward(call.rebuild(arrays), out, lse, grad_out, grad_lse)
            return dq, dk, dv
        return jax.jit(backward)

    def forward(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        out, lse = _compiled((*key, "forward"), build_forward)(q, k, v, *rest)
        return out, lse

    def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array,
                 grad_lse: Array | None) -> tuple[Array, Array, Array]:
        fn = _compiled((*key, "backward"), build_backward)
        dq, dk, dv = fn([q, k, v, *rest], out, lse, grad_out, grad_lse)
        return dq, dk, dv

    return forward, backward
