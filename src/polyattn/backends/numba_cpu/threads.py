"""The threads the kernels run on: Numba's threading layer, chosen before the first
compile, and :func:`run`, which hands a kernel's work items out one at a time.

TBB is preferred (safe with concurrent callers and across ``fork``), then OpenMP;
Numba's own "workqueue" layer is used only where neither loads, and calls are then
made one at a time. This module imports Numba only inside its functions.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

#: The Numba threading layer in use once a kernel has run (for ``explain``).
_layer: list[str] = []
#: Held by a call where the threading layer is not safe for concurrent callers.
_call_lock = threading.Lock()


def _preload_tbb() -> None:
    """Make the TBB library of the ``tbb`` wheel loadable by Numba (it sits in the
    environment's ``lib`` folder, which the dynamic loader does not search)."""
    for path in sorted(glob.glob(os.path.join(sys.prefix, "lib", "libtbb.so.1[2-9]*"))):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


def choose_threading_layer(numba: Any) -> None:
    """Prefer a threading layer that is safe with concurrent callers: TBB (also fork-safe),
    else OpenMP; Numba's own "workqueue" is used only when neither loads, and then calls
    are serialised (:func:`_serialised`). ``NUMBA_THREADING_LAYER`` set by the user wins
    (``tbb`` included: its library is made loadable first), and so does the order of
    ``NUMBA_THREADING_LAYER_PRIORITY``."""
    _preload_tbb()
    if os.environ.get("NUMBA_THREADING_LAYER") or os.environ.get(
            "NUMBA_THREADING_LAYER_PRIORITY"):
        return
    safe = []
    for layer, module in (("tbb", "tbbpool"), ("omp", "omppool")):
        try:
            __import__(f"numba.np.ufunc.{module}")
            safe.append(layer)
        except ImportError:
            continue
    numba.config.THREADING_LAYER_PRIORITY = [*safe, *(
        x for x in ("tbb", "omp", "workqueue") if x not in safe)]
    numba.config.THREADING_LAYER = "threadsafe" if safe else "workqueue"


def threading_layer() -> str:
    """The Numba threading layer the kernel runs on ("" before its first call)."""
    return _layer[0] if _layer else ""


def _layer_and_how() -> tuple[str, str]:
    """(the threading layer the kernel runs on or will take at its first call, how that is
    known: "in use", "asked" (NUMBA_THREADING_LAYER) or "first call")."""
    import numba

    try:
        return numba.threading_layer(), "in use"
    except ValueError:                   # no parallel code has run yet
        pass
    asked = os.environ.get("NUMBA_THREADING_LAYER", "").strip().lower()
    if asked in LAYERS:
        return asked, "asked"
    if asked and asked != "default":
        return asked, "selector"
    return _first_layer(), "first call"


#: Numba's threading layers and their modules.
LAYERS = {"tbb": "tbbpool", "omp": "omppool", "workqueue": "workqueue"}


@functools.cache
def _first_layer() -> str:
    """The layer :func:`choose_threading_layer` will get: TBB, else OpenMP, else the work
    queue (in the order of ``NUMBA_THREADING_LAYER_PRIORITY`` where that is set)."""
    _preload_tbb()
    order = os.environ.get("NUMBA_THREADING_LAYER_PRIORITY", "").split() or [
        "tbb", "omp", "workqueue"]
    for layer in order:
        try:
            __import__(f"numba.np.ufunc.{LAYERS[layer]}")
        except (ImportError, KeyError):
            continue
        return layer
    return "workqueue"


def layer_in_words() -> str:
    """The threading layer the kernel runs on, or the one its first call will take (for
    ``polyattn info``): Numba's layer, once any parallel code of the process started it."""
    layer, how = _layer_and_how()
    if how == "selector":
        if layer not in ("safe", "threadsafe", "forksafe"):
            return (f"NUMBA_THREADING_LAYER={layer!r} is unknown to Numba (tbb, omp, "
                    "workqueue, default, safe, threadsafe, forksafe): the kernel cannot run")
        return f"the first that loads of Numba's {layer!r} layers, at the first call"
    return {"in use": f"{layer} (in use in this process)",
            "asked": f"{layer} at the first call (NUMBA_THREADING_LAYER)",
            "first call": f"{layer} at the first call" + (
                " (NUMBA_THREADING_LAYER_PRIORITY)"
                if os.environ.get("NUMBA_THREADING_LAYER_PRIORITY") else
                " (neither TBB nor OpenMP loads: calls run one at a time)"
                if layer == "workqueue" else "")}[how]


def beside_spinning_torch() -> bool:
    """Whether the kernel's threads share the cores with torch's OpenMP threads while
    those keep spinning after each torch operation (OpenMP's default wait policy): where
    torch runs on OpenMP, the kernel does not (TBB, the work queue), and
    ``OMP_WAIT_POLICY`` is not ``PASSIVE``."""
    if os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        return False
    return _torch_on_openmp() and _layer_and_how()[0] != "omp"


@functools.cache
def _torch_on_openmp() -> bool:
    import torch

    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextmanager
def _serialised() -> Iterator[None]:
    """Calls one at a time where the threading layer is not safe for concurrent callers."""
    with _call_lock if threading_layer() in ("", "workqueue") else nullcontext():
        yield


def run(kernel: Any, *args: Any) -> None:
    """``kernel(*args)`` with items handed out one at a time to whichever thread is free
    (static chunks of items sorted largest first would leave one thread with the large
    ones), serialised where the threading layer needs it."""
    import numba

    from polyattn.backends.numba_cpu.user_rules import quiet_calls

    quiet_calls()                         # the kernels take the rules as functions
    call = _entry(kernel, args)
    with _serialised():
        before = numba.set_parallel_chunksize(1)
        try:
            call(*args)
        finally:
            numba.set_parallel_chunksize(before)
        if not _layer:
            _layer.append(str(numba.threading_layer()))


def counter(item: int) -> Any:
    """A kernel's last argument: ``[0, threads, item]``, the index of the next work item
    (the threads take items by incrementing it, atomically), how many loops take them (one
    per Numba thread), and the machine address of the kernel's work-item function
    (:func:`.compiler.item_address`). The kernel balances its items itself, whatever the
    threading layer's own scheduling (TBB's is dynamic, OpenMP's static)."""
    import numba
    import numpy as np

    if not item:
        raise ValueError("counter: the work-item function's address is required")
    return np.array([0, numba.get_num_threads(), item], dtype=np.int64)


#: Per compiled kernel and dtype of its first argument: its entry point and what each
#: argument must be (:func:`_expected`).
_entries: dict[tuple[int, str], tuple[Any, Any]] = {}


def _entry(kernel: Any, args: tuple[Any, ...]) -> Any:
    """The compiled function of ``kernel`` (a Numba dispatcher of fixed signatures) for
    ``args``, to be called without the dispatcher, which types every argument again on
    every call: a tenth of a millisecond or more, most of it on the tuple of the user's
    compiled rules. Each array's dtype and dimensions are checked against the signature
    first; where they do not match (never, from this package's own calls), the
    dispatcher itself is returned, to convert or to refuse."""
    key = (id(kernel), args[0].dtype.str)
    found = _entries.get(key)
    if found is None:
        from numba.np.numpy_support import as_dtype

        for sig, compiled in list(kernel.overloads.items()):
            if as_dtype(sig[0].dtype) == args[0].dtype:
                found = _entries[key] = (compiled.entry_point, [_expected(t) for t in sig])
                break
        else:
            return kernel
    entry, expected = found
    return entry if _matches(args, expected) else kernel


def _expected(t: Any) -> Any:
    """What an argument of Numba type ``t`` must be: ``(dtype, ndim)`` for an array, a
    list of these for a tuple, ``None`` for anything else (unchecked)."""
    from numba.core import types
    from numba.np.numpy_support import as_dtype

    if isinstance(t, types.Array):
        return (as_dtype(t.dtype), t.ndim)
    if isinstance(t, types.BaseTuple):
        return [_expected(x) for x in t.types]
    return None


def _matches(value: Any, expected: Any) -> bool:
    """Whether ``value`` is what :func:`_expected` describes."""
    import numpy as np

    if expected is None:
        return True
    if isinstance(expected, list):
        return (isinstance(value, tuple) and len(value) == len(expected)
                and all(_matches(v, e) for v, e in zip(value, expected, strict=True)))
    return (isinstance(value, np.ndarray) and value.dtype == expected[0]
            and value.ndim == expected[1])


def _after_fork_in_child() -> None:
    """A fresh lock in a child started by ``fork``: one held by another thread at the fork
    (a serialised call) would stay held there."""
    global _call_lock
    _call_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)
