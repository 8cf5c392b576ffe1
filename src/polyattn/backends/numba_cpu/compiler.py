"""Compiling the kernels of :mod:`.kernels`, and what Numba's cache holds of them.

:func:`kernels` and :func:`backward_kernel` compile the forward and backward kernels
for the dtype a call computes in (float32 or float64; the other one when it is called
too) on first use, or load them from Numba's cache on disk; a compile that the cache
cannot spare is announced first, in one line on the logger ``"polyattn.numba_cpu"`` (a
child of ``"polyattn"``), naming ``python -m polyattn warmup``. :func:`availability`
says whether the kernels can run at all, :func:`cache_state` where they stand. This
module imports Numba only inside its functions.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from polyattn.backends.numba_cpu.threads import choose_threading_layer
from polyattn.backends.numba_cpu.user_rules import quiet

_lock = threading.Lock()
#: Where a compile that nothing cached forces is announced (a child of "polyattn").
logger = logging.getLogger("polyattn.numba_cpu")


def availability() -> tuple[bool, str]:
    """(usable, reason): whether Numba is installed and the kernel has not failed to compile
    in this process."""
    try:
        import numba
    except ImportError as exc:
        return False, f"{exc.name or 'Numba'} is not installed; pip install 'polyattn[numba]'"
    if _failed:
        return False, _failed[0]
    return True, f"Numba {numba.__version__}"


class KernelUnavailable(RuntimeError):
    """The kernel could not be compiled (the message says why)."""


#: The kernel's functions, defined (not yet compiled) on first use.
_definitions: dict[str, Any] = {}
#: ``"failed to compile: <why>"`` once the forward kernel failed to compile (every later
#: call says so); empty before.
_failed: list[str] = []
#: What happened to each kernel for each dtype it was asked for: ("forward" or
#: "backward", "float32" or "float64") -> "compiled" or "loaded" (from Numba's cache).
#: A dtype is compiled on its first call, the other one only when it is called too.
_states: dict[tuple[str, str], str] = {}
#: The kernels' dtypes.
DTYPES = (np.float32, np.float64)


def _dispatchers() -> dict[str, Any]:
    """The kernel's Numba functions, defined but not compiled (cheap)."""
    with _lock:
        if not _definitions:
            import numba

            choose_threading_layer(numba)
            from polyattn.backends.numba_cpu import kernels as compiled

            _definitions.update({name: getattr(compiled, name) for name in
                                 ("exp32", "exp64", "attend_item", "grad_key_item",
                                  "forward", "backward")})
        return _definitions


def signatures() -> list[Any]:
    """The forward kernel's signatures: float32 and float64."""
    from polyattn.backends.numba_cpu import kernels as compiled

    return [compiled.signature(dt) for dt in DTYPES]


def _signature(kind: str, dt: Any) -> Any:
    from polyattn.backends.numba_cpu import kernels as compiled

    return (compiled.signature if kind == "forward" else compiled.backward_signature)(dt)


#: The function each kernel runs per work item (compiled on its own: :func:`.kernels.call_at`).
ITEMS = {"forward": "attend_item", "backward": "grad_key_item"}
#: (kernel, dtype name) -> the machine address of its work-item function in this process.
_addresses: dict[tuple[str, str], int] = {}


def _item_signature(kind: str, dt: Any) -> Any:
    from polyattn.backends.numba_cpu import kernels as compiled

    return compiled.item_signature(kind, dt)


def _wanted(dtype: Any) -> tuple[Any, ...]:
    """The kernel dtypes a call of ``dtype`` needs (``None``: both)."""
    if dtype is None:
        return DTYPES
    return (np.float64,) if np.dtype(dtype) == np.float64 else (np.float32,)


def _cached(function: Any, sig: Any) -> tuple[bool | None, str]:
    """(whether Numba's cache on disk holds ``function`` compiled for ``sig``, the cache's
    folder); ``(None, the exception's name)`` where Numba's cache internals cannot say."""
    try:
        cache = function._cache
        index = cache._cache_file._load_index()
        return cache._index_key(sig, function.targetctx.codegen()) in index, cache.cache_path
    except Exception as exc:  # Numba's cache internals differ: unknown rather than a guess
        return None, type(exc).__name__


#: CPU seconds a compile from an empty cache takes per kernel and dtype, work-item function
#: included, as the announcements say: on a 2-core AMD EPYC Zen 5, idle, float32 forward
#: 6.9 s and backward 9.2 s (11.5 s and 15.3 s while each kernel compiled its item's code
#: into its own modules too); a slower CPU takes longer (a Zen 4 took 1.2x as long).
SECONDS = {"forward": 7, "backward": 9}


def _announce_compile(what: str, dtypes: tuple[Any, ...],
                      wanted: list[tuple[Any, Any]]) -> None:
    """One line on :data:`logger` before a compile that Numba's cache cannot spare."""
    found = [_cached(function, sig) for function, sig in wanted]
    if any(hit is False for hit, _ in found):
        where = next(path for hit, path in found if hit is False)
        names = " and ".join(np.dtype(dt).name for dt in dtypes)
        seconds = SECONDS[what] * len(dtypes)
        logger.warning(
            "polyattn: compiling the numba_cpu %s kernel (%s), which Numba's cache (%s) "
            "does not hold yet: this call waits for it (about %d s of CPU time, more on a "
            "slower or loaded machine; once per machine); `python -m polyattn warmup` "
            "compiles it ahead",
            what, names, where, seconds)


def _compile(kind: str, dtype: Any, announce: bool) -> Any:
    """The ``kind`` kernel compiled (or loaded from the cache) for the dtypes a call of
    ``dtype`` needs; under :data:`_lock`. Between compiles the dispatcher compiles
    nothing at call time: every call converts to its signatures ("A" layout, read-only
    inputs) instead of compiling one more specialisation per memory layout."""
    function = _definitions[kind]
    missing = tuple(dt for dt in _wanted(dtype) if (kind, np.dtype(dt).name) not in _states)
    if announce and missing:
        item = _definitions[ITEMS[kind]]
        _announce_compile(kind, missing, [pair for dt in missing for pair in (
            (item, _item_signature(kind, dt)), (function, _signature(kind, dt)))])
    item = _definitions[ITEMS[kind]]
    for dt in missing:
        hits = sum(sum(f.stats.cache_hits.values()) for f in (item, function))
        misses = sum(sum(f.stats.cache_misses.values()) for f in (item, function))
        sig = _item_signature(kind, dt)
        for compiled, signature in ((item, sig), (function, _signature(kind, dt))):
            compiled.disable_compile(False)
            try:
                with quiet():
                    compiled.compile(signature)
            finally:
                if compiled.overloads:
                    compiled.disable_compile(True)
        result = item.overloads[sig]
        _addresses[(kind, np.dtype(dt).name)] = result.library.get_pointer_to_function(
            result.fndesc.llvm_func_name)
        loaded = (sum(sum(f.stats.cache_hits.values()) for f in (item, function)) > hits and
                  sum(sum(f.stats.cache_misses.values()) for f in (item, function)) == misses)
        _states[(kind, np.dtype(dt).name)] = "loaded" if loaded else "compiled"
    return function


def item_address(kind: str, dtype: Any) -> int:
    """The machine address of the ``kind`` kernel's work-item function for ``dtype``'s
    computation (compiled by :func:`kernels` or :func:`backward_kernel` first): the
    kernel's ``counter[2]`` (:func:`.threads.counter`)."""
    return _addresses[(kind, np.dtype(_wanted(dtype)[0]).name)]


def kernels(dtype: Any = None, *, announce: bool = True) -> dict[str, Any]:
    """The kernel's functions, the forward kernel compiled (or loaded from Numba's cache)
    for ``dtype``'s computation (float32, or float64; ``None``: both) on first use.

    A compile that Numba's cache cannot spare is announced on :data:`logger` first
    (``announce=False``: not, as for ``python -m polyattn warmup``). Raises
    :class:`KernelUnavailable` if compiling fails (and every later call says so).
    """
    found = _dispatchers()
    with _lock:
        if _failed:
            raise KernelUnavailable(f"the numba_cpu kernel {_failed[0]}")
        try:
            _compile("forward", dtype, announce)
        except Exception as exc:  # a compiler error of any kind: report, fall back
            _failed.append(f"failed to compile: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}")
            raise KernelUnavailable(f"the numba_cpu kernel {_failed[0]}") from exc
        return found


def backward_kernel(dtype: Any = None, *, announce: bool = True) -> Any:
    """The backward kernel compiled (or loaded from the cache) for ``dtype``'s computation
    (``None``: both) on first use, announced as by :func:`kernels`."""
    kernels(dtype, announce=announce)
    with _lock:
        try:
            return _compile("backward", dtype, announce)
        except Exception as exc:  # a compiler error of any kind: report it
            raise KernelUnavailable(f"the numba_cpu backward kernel failed to compile: "
                                    f"{type(exc).__name__}: {exc}") from exc


def _state_of(kind: str) -> str | None:
    """"compiled", "loaded" or "compiled and loaded" (one dtype each): what happened to
    the ``kind`` kernel in this process; ``None`` if nothing yet."""
    seen = sorted({state for (k, _), state in _states.items() if k == kind})
    return " and ".join(seen) if seen else None


def _kernel_state(kind: str, dt: Any, in_process: bool) -> tuple[str, str]:
    """(where the ``kind`` kernel for dtype ``dt`` stands, in words; Numba's cache folder
    or why it is unknown)."""
    name = np.dtype(dt).name
    if in_process and (kind, name) in _states:
        return {"compiled": "compiled in this process",
                "loaded": "loaded from Numba's cache in this process"}[_states[(kind, name)]], ""
    try:
        found = _dispatchers()
        pairs = [_cached(found[ITEMS[kind]], _item_signature(kind, dt)),
                 _cached(found[kind], _signature(kind, dt))]
        unknown = [pair for pair in pairs if pair[0] is None]
        hit, where = unknown[0] if unknown else (all(h for h, _ in pairs), pairs[1][1])
    except Exception as exc:  # Numba's cache internals differ: say so rather than guess
        hit, where = None, type(exc).__name__
    if hit is None:
        return f"cache state unknown ({where})", where
    if hit:
        return f"cached in {where}", where
    first = "call" if kind == "forward" else "backward pass"
    return f"to compile at the first {first} (about {SECONDS[kind]} s of CPU time", where


def _names(pairs: list[tuple[str, str]]) -> str:
    """"forward and backward, float32 and float64" where the pairs are all of those, else
    each pair ("forward float32, backward float64")."""
    kinds = sorted({k for k, _ in pairs}, key=("forward", "backward").index)
    dtypes = sorted({d for _, d in pairs})
    if len(pairs) == len(kinds) * len(dtypes):
        return f"{' and '.join(kinds)}, {' and '.join(dtypes)}"
    return ", ".join(f"{k} {d}" for k, d in pairs)


def _states_in_words(dtype: Any, in_process: bool) -> str:
    """The forward and backward kernels of ``dtype``'s computation (``None``: float32 and
    float64), grouped by where they stand."""
    groups: dict[str, list[tuple[str, str]]] = {}
    cache = ""
    for kind in ("forward", "backward"):
        for dt in _wanted(dtype):
            state, where = _kernel_state(kind, dt, in_process)
            groups.setdefault(state, []).append((kind, np.dtype(dt).name))
            if state.startswith("to compile"):
                cache = where
    said = "; ".join(f"{_names(pairs)}: {state}" + (
        "" if not state.startswith("to compile") else " each)" if len(pairs) > 1 else ")")
        for state, pairs in groups.items())
    if cache:
        said += (f" (Numba's cache: {cache}); `python -m polyattn warmup` compiles them "
                 "ahead")
    return said


def cache_state(dtype: Any = None) -> str:
    """Whether the compiled kernels (forward and backward) for ``dtype``'s computation
    (float32 or float64; ``None``: both) are ready: compiled or loaded in this process,
    in Numba's cache on disk (then the first call loads them in well under a second), or
    still to compile, each kernel and dtype in its own words."""
    if _failed:
        return _failed[0]
    return _states_in_words(dtype, True)


def cache_state_on_disk(dtype: Any = None) -> str:
    """Whether Numba's cache on disk holds the compiled kernels for this machine, as
    :func:`cache_state` says it (what this process did aside)."""
    return _states_in_words(dtype, False)


def warmup(dtype: Any = None) -> tuple[str, float]:
    """Compile the forward and backward kernels for ``dtype``'s computation (float32 or
    float64; ``None``: both) now, or load them from Numba's cache: (what happened to
    them, seconds): ``"loaded"`` or ``"compiled"`` where the same happened to both, else
    what happened to each."""
    import time

    start = time.perf_counter()
    kernels(dtype, announce=False)
    backward_kernel(dtype, announce=False)
    for dt in DTYPES if dtype is None else (np.dtype(dtype).type,):
        exp(np.zeros(4, dtype=dt))
    forward, backward = _state_of("forward"), _state_of("backward")
    if forward == backward:
        return str(forward), time.perf_counter() - start
    words = {"loaded": "loaded from Numba's cache", "compiled": "compiled"}
    return (f"forward {words.get(str(forward), forward)}, "
            f"backward {words.get(str(backward), backward)}", time.perf_counter() - start)


def tiles() -> str:
    """The SIMD vectors and register tiles the kernel's products run in on this CPU."""
    from polyattn.backends.numba_cpu import tiles as t

    isa = "AVX-512" if t.VECTOR_BYTES == 64 else "32-byte vectors (AVX2 or narrower)"
    return (f"{isa}: {t.lanes(4)} float32 / {t.lanes(8)} float64 lanes, products in "
            f"{t.TILE_ROWS} x {t.TILE_VECTORS}-vector register tiles (no BLAS)")


#: Below these, e^x is subnormal (or 0) and the kernel returns 0.
EXP_MIN = {np.dtype(np.float32): -87.33654, np.dtype(np.float64): -708.3964185322641}


def exp(x: np.ndarray) -> np.ndarray:
    """The kernel's exponential of a 1-D float32 or float64 array (for tests and checks)."""
    out = np.array(x, copy=True, order="C")
    _dispatchers()["exp32" if out.dtype == np.float32 else "exp64"](out, out.dtype.type(0.0))
    return out


def _after_fork_in_child() -> None:
    """A fresh lock in a child started by ``fork``: one held by another thread at the fork
    (a compile) would stay held there."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)
