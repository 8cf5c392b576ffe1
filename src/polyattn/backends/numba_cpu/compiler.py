"""Compiling the kernels of :mod:`.kernels`, and what Numba's cache holds of them.

:func:`kernels` and :func:`backward_kernel` compile the forward and backward kernels
for their two signatures (float32, float64) on first use, or load them from Numba's
cache on disk; a compile that the cache cannot spare is announced first, in one line
on the logger ``"polyattn.numba_cpu"`` (a child of ``"polyattn"``), naming
``python -m polyattn warmup``. :func:`availability` says whether the kernels can run
at all, :func:`cache_state` where they stand. This module imports Numba only inside
its functions.
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
    if _compiled and _compiled[0].startswith("failed"):
        return False, _compiled[0]
    return True, f"Numba {numba.__version__}"


class KernelUnavailable(RuntimeError):
    """The kernel could not be compiled (the message says why)."""


#: The kernel's functions, defined (not yet compiled) on first use.
_definitions: dict[str, Any] = {}
#: What happened when :func:`kernels` compiled: "compiled", "loaded" (from Numba's cache)
#: or "failed: <why>"; empty before.
_compiled: list[str] = []
#: The compiled backward kernel, once :func:`backward_kernel` compiled it, and what
#: happened then ("compiled" or "loaded").
_backward: list[Any] = []
_backward_state: list[str] = []


def _dispatchers() -> dict[str, Any]:
    """The kernel's Numba functions, defined but not compiled (cheap)."""
    with _lock:
        if not _definitions:
            import numba

            choose_threading_layer(numba)
            from polyattn.backends.numba_cpu import kernels as compiled

            _definitions.update({name: getattr(compiled, name) for name in
                                 ("exp32", "exp64", "attend_item", "forward")})
        return _definitions


def signatures() -> list[Any]:
    """The forward kernel's signatures: float32 and float64."""
    from polyattn.backends.numba_cpu import kernels as compiled

    return [compiled.signature(np.float32), compiled.signature(np.float64)]


def _cached(function: Any, sig: Any) -> tuple[bool | None, str]:
    """(whether Numba's cache on disk holds ``function`` compiled for ``sig``, the cache's
    folder); ``(None, the exception's name)`` where Numba's cache internals cannot say."""
    try:
        cache = function._cache
        index = cache._cache_file._load_index()
        return cache._index_key(sig, function.targetctx.codegen()) in index, cache.cache_path
    except Exception as exc:  # Numba's cache internals differ: unknown rather than a guess
        return None, type(exc).__name__


def _announce_compile(what: str, wanted: list[tuple[Any, Any]]) -> None:
    """One line on :data:`logger` before a compile that Numba's cache cannot spare."""
    found = [_cached(function, sig) for function, sig in wanted]
    if any(hit is False for hit, _ in found):
        where = next(path for hit, path in found if hit is False)
        logger.warning(
            "polyattn: compiling the numba_cpu %s kernel (float32 and float64), which "
            "Numba's cache (%s) does not hold yet: this call waits for it (about 25 s forward "
            "and a minute backward of CPU time, more under load; once per machine); "
            "`python -m polyattn warmup` compiles it ahead", what, where)


def kernels(*, announce: bool = True) -> dict[str, Any]:
    """The compiled functions (compiled, or loaded from Numba's cache, on first use).

    A compile that Numba's cache cannot spare is announced on :data:`logger` first
    (``announce=False``: not, as for ``python -m polyattn warmup``). Raises
    :class:`KernelUnavailable` if compiling fails (and every later call says so).
    """
    found = _dispatchers()
    with _lock:
        if _compiled and _compiled[0].startswith("failed"):
            raise KernelUnavailable(f"the numba_cpu kernel {_compiled[0]}")
        if not _compiled:
            forward = found["forward"]
            if announce:
                _announce_compile("forward", [(forward, sig) for sig in signatures()])
            hits = sum(forward.stats.cache_hits.values())
            try:
                with quiet():
                    for sig in signatures():
                        forward.compile(sig)
                # every call converts to these signatures ("A" layout, read-only inputs)
                # instead of compiling one more specialisation per memory layout
                forward.disable_compile()
            except Exception as exc:  # a compiler error of any kind: report, fall back
                _compiled.append(f"failed to compile: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}")
                raise KernelUnavailable(f"the numba_cpu kernel {_compiled[0]}") from exc
            loaded = sum(forward.stats.cache_hits.values()) - hits
            _compiled.append("loaded" if loaded == len(signatures()) else "compiled")
        return found


def backward_kernel(*, announce: bool = True) -> Any:
    """The compiled backward kernel (compiled, or loaded from the cache, on first use;
    announced as by :func:`kernels`)."""
    kernels(announce=announce)
    from polyattn.backends.numba_cpu import kernels as compiled

    with _lock:
        if not _backward:
            if announce:
                _announce_compile("backward", [(compiled.backward,
                                                compiled.backward_signature(dt))
                                               for dt in (np.float32, np.float64)])
            hits = sum(compiled.backward.stats.cache_hits.values())
            try:
                with quiet():
                    for dt in (np.float32, np.float64):
                        compiled.backward.compile(compiled.backward_signature(dt))
                compiled.backward.disable_compile()
            except Exception as exc:  # a compiler error of any kind: report it
                raise KernelUnavailable(f"the numba_cpu backward kernel failed to compile: "
                                        f"{type(exc).__name__}: {exc}") from exc
            loaded = sum(compiled.backward.stats.cache_hits.values()) - hits
            _backward.append(compiled.backward)
            _backward_state.append("loaded" if loaded == 2 else "compiled")
    return _backward[0]


def cache_state() -> str:
    """Whether the compiled kernel is ready: in this process, in Numba's cache on disk
    (then the first call loads it in well under a second), or not yet compiled."""
    if _compiled:
        if _compiled[0].startswith("failed"):
            return _compiled[0]
        return ("loaded from Numba's cache in this process" if _compiled[0] == "loaded"
                else "compiled in this process")
    return cache_state_on_disk()


def cache_state_on_disk() -> str:
    """Whether Numba's cache on disk holds the compiled kernel for this machine."""
    try:
        from polyattn.backends.numba_cpu import kernels as compiled

        wanted = [(_dispatchers()["forward"], sig) for sig in signatures()]
        wanted += [(compiled.backward, compiled.backward_signature(dt))
                   for dt in (np.float32, np.float64)]
    except Exception as exc:  # Numba's cache internals differ: say so rather than guess
        return f"cache state unknown ({type(exc).__name__})"
    looked = [_cached(function, sig) for function, sig in wanted]
    for hit, why in looked:
        if hit is None:
            return f"cache state unknown ({why})"
    found = [bool(hit) for hit, _ in looked]
    where = looked[-1][1]
    if all(found[:2]) and all(found[2:]):
        return f"compiled kernels (forward and backward) cached in {where}"
    if all(found[:2]):
        return (f"forward kernel cached in {where}; the backward kernel compiles on the first "
                "attention_vjp (about a minute of CPU time for float32 and float64) unless "
                "`python -m polyattn warmup` ran")
    return (f"not cached yet (cache: {where}): the first call compiles it (about 25 s of "
            "CPU time, the backward kernel about a minute more at the first attention_vjp); "
            "`python -m polyattn warmup` compiles it ahead")


def warmup() -> tuple[str, float]:
    """Compile the forward and backward kernels now, or load them from Numba's cache:
    (what happened to them, seconds): ``"loaded"`` or ``"compiled"`` where the same
    happened to both, else what happened to each."""
    import time

    start = time.perf_counter()
    kernels(announce=False)
    backward_kernel(announce=False)
    for dtype in (np.float32, np.float64):
        exp(np.zeros(4, dtype=dtype))
    forward, backward = _compiled[0], _backward_state[0]
    if forward == backward:
        return forward, time.perf_counter() - start
    words = {"loaded": "loaded from Numba's cache", "compiled": "compiled"}
    return (f"forward {words.get(forward, forward)}, backward {words[backward]}",
            time.perf_counter() - start)


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
    kernels()["exp32" if out.dtype == np.float32 else "exp64"](out, out.dtype.type(0.0))
    return out


def _after_fork_in_child() -> None:
    """A fresh lock in a child started by ``fork``: one held by another thread at the fork
    (a compile) would stay held there."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)
