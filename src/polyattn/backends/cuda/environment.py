"""What the CUDA kernels need from their surroundings: numba-cuda, a GPU, CUDA arrays.

:func:`availability` says whether a call can run and why (``explain()``
prints it); :func:`_cuda` binds ``numba.cuda`` on first use (ImportError
naming the package without it); :class:`_Device` moves arrays between the
input library and Numba and picks the stream and the GPU. With
``NUMBA_ENABLE_CUDASIM=1`` (:func:`polyattn._interop.simulator_enabled`)
NumPy arrays run on Numba's CPU simulator. :func:`kernel_choice` reads
``POLYATTN_CUDA_KERNEL``. Nothing here imports Numba before it is used.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyattn._interop import array_library, simulator_enabled

Array = Any

#: The compute dtypes of the exact kernels, and the mask kinds of every kernel.
DTYPES = ("float32", "float64")
MASK_KINDS = ("none", "bool", "float")
#: Compile-time head sizes (the query row, the accumulators); the largest is the limit.
HEAD_DIM_BUCKETS = (8, 16, 32, 64, 128, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

#: ``POLYATTN_CUDA_KERNEL``: which exact kernel runs float32/float64 calls.
KERNEL_VARIABLE = "POLYATTN_CUDA_KERNEL"
KERNEL_CHOICES = ("rows", "tiled")


def _numba_cuda_installed() -> bool:
    return importlib.util.find_spec("numba_cuda") is not None


# ``numba.cuda``, bound on first use. The kernel modules bind it as a module
# global of their own: the CUDA simulator swaps module globals that refer to it.
cuda: Any = None


def _cuda() -> Any:
    """The ``numba.cuda`` module; ImportError naming the package when it is missing."""
    global cuda
    if cuda is None:
        if not _numba_cuda_installed():
            raise ImportError(
                "the numba_cuda implementation needs the numba-cuda package "
                "(pip install 'numba-cuda[cu13]' or 'numba-cuda[cu12]')"
            )
        from numba import cuda as numba_cuda_module

        cuda = numba_cuda_module
    return cuda


def _is_cuda_array(x: Array) -> bool:
    if array_library(x) == "torch":
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def availability(xp: Any = None, arrays: Sequence[Array] = ()) -> tuple[bool, str]:
    """Whether the kernels can run on ``arrays``, and why (for ``explain``).

    Examples
    --------
    >>> usable, reason = availability()
    >>> isinstance(usable, bool) and isinstance(reason, str)
    True
    """
    if not _numba_cuda_installed():
        return False, "numba-cuda is not installed (pip install 'numba-cuda[cu13]')"
    libraries = sorted({array_library(a) for a in arrays})
    too_large = [a.shape[-1] for a in arrays if a.ndim >= 1 and a.shape[-1] > MAX_HEAD_DIM]
    if simulator_enabled():
        if too_large:
            return False, (f"head size {too_large[0]} exceeds the kernel's maximum "
                           f"{MAX_HEAD_DIM}")
        if all(lib == "numpy" for lib in libraries):
            return True, ("the Numba CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1): "
                          "the kernel runs on the CPU, slowly; for testing")
        return False, (f"the Numba CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1), "
                       f"so {', '.join(libraries)} CUDA arrays cannot be used")
    not_cuda = [type(a).__name__ for a in arrays if not _is_cuda_array(a)]
    if not_cuda:
        return False, (f"inputs are not CUDA arrays ({', '.join(sorted(set(not_cuda)))}); "
                       "the kernel needs arrays with __cuda_array_interface__")
    try:
        if not _cuda().is_available():
            return False, "no CUDA GPU or driver found by Numba"
    except Exception as exc:  # driver errors surface as many types
        return False, f"CUDA could not be initialised: {exc}"
    if too_large:
        return False, f"head size {too_large[0]} exceeds the kernel's maximum {MAX_HEAD_DIM}"
    return True, "CUDA arrays, a CUDA GPU and numba-cuda"


def kernel_choice() -> str:
    """``POLYATTN_CUDA_KERNEL``: ``"tiled"`` (the register-tiled kernel, the default) or
    ``"rows"`` (one thread per query row, for every shape); ValueError naming the
    variable otherwise. Decoding shapes take the one-thread-per-row kernel either way.

    Examples
    --------
    >>> kernel_choice() in KERNEL_CHOICES
    True
    """
    value = os.environ.get(KERNEL_VARIABLE, "tiled").strip().lower() or "tiled"
    if value not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_VARIABLE}={os.environ[KERNEL_VARIABLE]!r}: expected one "
                         f"of {', '.join(KERNEL_CHOICES)}")
    return value


class _Device:
    """Moves arrays between the input library and Numba, and picks stream and GPU."""

    def __init__(self, like: Array) -> None:
        self.cuda = _cuda()
        self.lib = array_library(like)
        self.like = like
        self.simulated = self.lib == "numpy"
        if self.simulated and not simulator_enabled():
            raise TypeError(
                "implementation='numba_cuda' needs CUDA arrays (CuPy arrays or torch CUDA "
                f"tensors); got {type(like).__module__}.{type(like).__name__} on the CPU. "
                "Use implementation='reference' or 'chunked' for CPU arrays, or set "
                "NUMBA_ENABLE_CUDASIM=1 to run the kernel on the Numba CUDA simulator"
            )
        if not self.simulated and simulator_enabled():
            raise RuntimeError(
                "the Numba CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1): it runs "
                f"the kernel on NumPy arrays only, not on {self.lib} CUDA arrays"
            )
        if not self.simulated and not _is_cuda_array(like):
            raise TypeError(
                "implementation='numba_cuda' needs CUDA arrays exposing "
                f"__cuda_array_interface__; got {type(like).__name__}"
            )

    def device_id(self) -> int | None:
        if self.lib == "cupy":
            return int(self.like.device.id)
        if self.lib == "torch":
            index = self.like.device.index
            if index is None:
                import torch

                index = torch.cuda.current_device()
            return int(index)
        return None

    def stream(self) -> Any:
        """Numba's view of the input library's current stream."""
        cuda = self.cuda
        ptr = 0
        if self.lib == "cupy":
            import cupy

            ptr = cupy.cuda.get_current_stream().ptr
        elif self.lib == "torch":
            import torch

            ptr = torch.cuda.current_stream(self.like.device).cuda_stream
        return cuda.external_stream(ptr) if ptr else cuda.default_stream()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Array:
        """An uninitialised output array of the input library on the input device."""
        if self.lib == "cupy":
            import cupy

            with self.like.device:
                return cupy.empty(shape, dtype=dtype)
        if self.lib == "torch":
            import torch

            return torch.empty(shape, dtype=dtype, device=self.like.device)
        if self.simulated:
            return np.empty(shape, dtype=dtype)
        return self.cuda.device_array(shape, dtype=np.dtype(str(dtype)))

    def from_numpy(self, a: np.ndarray) -> Array:
        """A small host table as an array of the input library on the input device."""
        if self.lib == "cupy":
            import cupy

            with self.like.device:
                return cupy.asarray(a)
        if self.lib == "torch":
            import torch

            return torch.as_tensor(a, device=self.like.device)
        if self.simulated:
            return a
        return self.cuda.to_device(a)

    def view(self, x: Array) -> Any:
        """A Numba device array over ``x`` without copying (simulator: a contiguous copy)."""
        if self.simulated:
            return self.cuda.to_device(np.ascontiguousarray(x))
        if self.lib == "torch":
            x = x.detach()
        return self.cuda.as_cuda_array(x, sync=False)
