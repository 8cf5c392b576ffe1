"""What this machine has: installed packages, free memory, a CUDA GPU for CuPy.

The commands call :func:`available_memory` through this module
(``system.available_memory()``), so replacing it here reaches all of them.
"""

from __future__ import annotations

import importlib.util
import os

from polyattn.cli.text import CLIError, _first_line

#: How to install each backend's library.
INSTALL = {
    # a plain `pip install torch` (or polyattn[torch]) fetches a CUDA build of several GB
    "torch": ("pip install torch --index-url https://download.pytorch.org/whl/cpu (the CPU "
              "build; a plain pip install torch, or 'polyattn[torch]', fetches a CUDA build of "
              "several GB)"),
    "jax": "pip install 'polyattn[jax]'",
    "dask": "pip install 'polyattn[dask]'",
    "cupy": "pip install 'polyattn[cuda]'",
    "array_api_strict": "pip install array-api-strict",
    "matplotlib": "pip install 'polyattn[plot]'",
}


def _installed(module: str) -> bool:
    """Whether a top-level module can be found (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_memory() -> int | None:
    """Bytes of memory available for new allocations; ``None`` where that cannot be told.

    Linux's ``MemAvailable`` (``/proc/meminfo``), else the free physical pages
    (``SC_AVPHYS_PAGES``), else all physical memory (``SC_PHYS_PAGES``).
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            count, size = os.sysconf(pages), os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            continue
        if count > 0 and size > 0:
            return count * size
    return None


def cupy_status() -> tuple[bool, str]:
    """Whether CuPy can run (installed, and a CUDA GPU found), and why not.

    Returns
    -------
    usable : bool
    reason : str
        What was found, or what is missing and how to get it.
    """
    if not _installed("cupy"):
        return False, ("CuPy is not installed; with an NVIDIA GPU, install it with "
                       f"{INSTALL['cupy']}")
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError, ImportError of the CUDA libraries, ...
        return False, f"CuPy is installed but cannot run: no usable CUDA GPU ({_first_line(exc)})"
    if count < 1:
        return False, "CuPy is installed but cannot run: no CUDA GPU found"
    return True, f"{count} CUDA GPU{'s' if count > 1 else ''}"


def check_backend(name: str) -> None:
    """Raise :class:`CLIError` naming the fix if array library ``name`` cannot run here."""
    if name == "numpy":
        return
    if name == "cupy":
        usable, why = cupy_status()
        if not usable:
            raise CLIError(f"--backend cupy: {why}")
        return
    if not _installed(name):
        raise CLIError(f"--backend {name}: {name} is not installed; install it with "
                       f"{INSTALL[name]}")
