"""``info`` and ``warmup``: versions, libraries, kernels, CPUs and BLAS threads."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyattn import __version__
from polyattn.cli.environment import environment_line
from polyattn.cli.system import _installed, cupy_status
from polyattn.cli.text import CLIError, _first_line, _plural

#: Array libraries polyattn supports: (import name, distributions to look for).
LIBRARIES = [
    ("numpy", ("numpy",)),
    ("array_api_compat", ("array-api-compat",)),
    ("array_api_strict", ("array-api-strict",)),
    ("torch", ("torch",)),
    ("jax", ("jax",)),
    ("dask", ("dask",)),
    ("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
    ("numba", ("numba",)),
    ("numba_cuda", ("numba-cuda",)),
]


def _version(distributions: Sequence[str]) -> str | None:
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def simulator_enabled() -> bool:
    """Whether Numba's CUDA simulator is switched on (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def cuda_status() -> tuple[bool, str]:
    """Whether the numba_cuda kernel can run here, and on what.

    On the CUDA simulator the verdict is :func:`polyattn.explain`'s for NumPy
    arrays, so ``info`` and ``explain()`` cannot disagree.

    Returns
    -------
    usable : bool
    reason : str
    """
    if _version(("numba-cuda",)) is None:
        return False, "numba-cuda is not installed (pip install 'polyattn[cuda]')"
    if simulator_enabled():
        from polyattn import explain

        x = np.zeros((1, 1, 1, 1))
        info = explain(x, x, x, implementation="auto")
        if info.kernel_available:
            return True, ("on the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): NumPy arrays, "
                          "on the CPU, slowly, with implementation='numba_cuda'; for testing")
        return False, ("NUMBA_ENABLE_CUDASIM=1, but the simulator cannot run it: "
                       f"{info.kernel_reason}")
    try:
        from numba import cuda

        if cuda.is_available():
            return True, f"GPU: {_device_name(cuda.get_current_device().name)}"
        return False, "no CUDA GPU or driver found"
    except Exception as exc:  # pragma: no cover - driver errors surface as many types
        return False, f"CUDA unavailable: {_first_line(exc)}"


def _device_name(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def _native_libraries() -> list[str]:
    """The installed libraries whose own attention ``implementation="native"`` runs."""
    if not _installed("polyattn.backends.native.fused"):
        return []
    return [label for module, label in (("torch", "torch"), ("jax", "JAX")) if _installed(module)]


def cmd_info(args: argparse.Namespace) -> int:
    """``info``: versions, libraries, the CUDA kernel, implementations."""
    print(f"polyattn {__version__}")
    print(f"python {sys.version.split()[0]} on {sys.platform}")
    print("array libraries:")
    for name, dists in LIBRARIES:
        version = _version(dists)
        note = ""
        if name == "cupy" and version is not None:
            usable, why = cupy_status()
            note = "" if usable else f" ({why})"
        print(f"  {name:<18} {version if version else 'not installed'}{note}")
    cuda_ok, why = cuda_status()
    if cuda_ok and simulator_enabled():
        print(f"CUDA kernel: runs {why}")
    else:
        print(f"CUDA kernel: {'usable' if cuda_ok else 'not usable'} ({why})")
    impls = ["reference", "chunked"]
    native = _native_libraries()
    if native:
        impls.append(f"native ({', '.join(native)})")
    if cuda_ok:
        impls.append("numba_cuda (simulator, NumPy arrays)" if simulator_enabled()
                     else "numba_cuda")
    usable, why = _numba_cpu_availability()
    if usable:
        impls.append("numba_cpu")
    print(f"implementations available: {', '.join(impls)}")
    if usable:
        from polyattn.backends.numba_cpu import launch as numba_cpu

        print(f"numba_cpu kernel: {numba_cpu.cache_state()}")
        print(f"numba_cpu tiles: {numba_cpu.tiles()}")
        from polyattn.backends.numba_cpu import threads

        print(f"numba_cpu threading layer: {threads.layer_in_words()}")
    else:
        print(f"numba_cpu kernel: not usable ({why})")
    print(f"CPUs: {cpu_summary()}")
    for line in blas_lines():
        print(line)
    variables = environment_line()
    if variables:
        print(variables)
    return 0


def cpu_summary() -> str:
    """The machine's CPUs, and how many of them this process may run on."""
    total = os.cpu_count()
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):        # not on macOS or Windows
        usable = None
    text = "unknown" if total is None else str(total)
    if usable is not None and usable != total:
        text += f" ({usable} usable by this process)"
    return text


#: Environment variables that set the thread count of the BLAS and OpenMP libraries.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "BLIS_NUM_THREADS")


def blas_lines() -> list[str]:
    """``info``'s lines on the BLAS (and OpenMP) libraries loaded, and their threads.

    Read with threadpoolctl when it is installed; never raises.
    """
    lines = []
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        lines.append("BLAS: threadpoolctl is not installed, so the BLAS library NumPy uses and "
                     "its threads cannot be shown; install it with pip install 'polyattn[fast]'")
    else:
        try:
            pools = threadpool_info()
        except Exception as exc:  # it inspects the process's shared libraries: be safe
            pools = None
            lines.append(f"BLAS: threadpoolctl could not inspect the libraries "
                         f"({_first_line(exc)})")
        if pools is not None:
            lines.append(f"BLAS and OpenMP libraries (threadpoolctl "
                         f"{_version(('threadpoolctl',))}):" if pools
                         else "BLAS and OpenMP libraries: none loaded (threadpoolctl found none)")
            lines.extend(f"  {_pool_line(pool)}" for pool in pools)
    variables = [f"{name}={os.environ[name]}" for name in THREAD_VARIABLES if name in os.environ]
    if variables:
        lines.append(f"thread variables: {' '.join(variables)}")
    return lines


def _pool_line(pool: dict[str, Any]) -> str:
    """One library of ``threadpoolctl.threadpool_info()``."""
    threads = pool.get("num_threads")
    parts = [f"{pool.get('user_api', '?')}: {pool.get('internal_api', '?')} "
             f"{pool.get('version') or '(version unknown)'}",
             _plural(threads, "thread") if isinstance(threads, int) else "threads unknown"]
    for key in ("threading_layer", "architecture"):
        if pool.get(key):
            parts.append(f"{key.replace('_', ' ')} {pool[key]}")
    if pool.get("filepath"):
        parts.append(str(pool["filepath"]))
    return ", ".join(parts)


def _numba_cpu_availability() -> tuple[bool, str]:
    from polyattn.backends.numba_cpu import launch as numba_cpu

    return numba_cpu.availability()


def cmd_warmup(args: argparse.Namespace) -> int:
    """``warmup``: compile the numba_cpu kernel now (or load it from Numba's cache)."""
    usable, why = _numba_cpu_availability()
    if not usable:
        raise CLIError(f"the numba_cpu kernel cannot be compiled: {why}")
    from polyattn.backends.numba_cpu import launch as numba_cpu

    dtype = args.dtype
    try:
        what, seconds = numba_cpu.warmup(dtype)
    except numba_cpu.KernelUnavailable as exc:
        raise CLIError(str(exc)) from None
    done = {"loaded": "loaded from Numba's cache", "compiled": "compiled"}.get(what, what)
    print(f"numba_cpu kernels {done} in {seconds:.1f} s (forward and backward, "
          f"{dtype or 'float32 and float64'})")
    print(f"numba_cpu kernel: {numba_cpu.cache_state_on_disk()}")
    return 0
