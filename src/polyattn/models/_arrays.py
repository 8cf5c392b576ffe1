"""Array libraries by name: the namespace and device a model's weights are placed on."""

from __future__ import annotations

import importlib
from typing import Any

import array_api_compat
import numpy as np

from polyattn._interop import library_name, resolve_xp

Namespace = Any

BACKENDS = ("numpy", "torch", "cupy", "jax", "array_api_strict")


def get_backend(name: str, *, dtype: str = "float32") -> tuple[Namespace, Any]:
    """An Array API namespace and device for a library's name.

    Parameters
    ----------
    name : {"numpy", "torch", "cupy", "jax", "array_api_strict"}
        The array library. ``"torch"`` uses CUDA when it is available.
    dtype : {"float32", "float64"}
        The dtype that will be used; JAX needs 64-bit mode switched on for
        ``"float64"``.

    Returns
    -------
    xp, device
        The standard-compatible namespace and the device to create arrays on
        (``None`` for the library's default).
    """
    name = name.replace("-", "_").lower()
    if name not in BACKENDS:
        raise ValueError(f"`backend` must be one of {', '.join(BACKENDS)}; got {name!r}")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"`dtype` must be 'float32' or 'float64'; got {dtype!r}")
    if name == "jax":
        jax = importlib.import_module("jax")
        if dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        module = importlib.import_module("jax.numpy")
    else:
        module = importlib.import_module(name)
    xp = array_api_compat.array_namespace(module.asarray(0.0))
    device = None
    if name == "torch" and module.cuda.is_available():
        device = module.device("cuda")
    return xp, device


#: dtypes a decoder can be loaded in (bfloat16 where the library has it).
DTYPES = ("float16", "bfloat16", "float32", "float64")
#: What to install for a library given by name that is not installed.
_INSTALL = {"torch": "pip install torch", "jax": "pip install 'polyattn[jax]'",
            "cupy": "pip install 'polyattn[cuda]' (CuPy; it needs an NVIDIA GPU)"}


def _dtype_name(dtype: Any, lib: str) -> str:
    """The name of a ``dtype`` given as a str, the library's own dtype or a NumPy dtype.

    A NumPy dtype (``np.float32``, ``np.dtype("float64")``) names one dtype
    unambiguously and is taken by its name on every library; a dtype of
    another library (``torch.float64`` for a NumPy model) and Python's
    ``float`` (float64 to NumPy, float32 to torch) are refused.
    """
    if isinstance(dtype, str):
        return dtype
    if dtype is float:
        raise TypeError("`dtype` must be a real floating dtype; got Python's float, whose "
                        "width differs between libraries: give 'float32' or 'float64'")
    module = type(dtype).__module__.split(".")[0]
    if module == "torch":
        if lib != "torch":
            raise TypeError(f"`dtype` must be a real floating dtype of {lib} (or a NumPy dtype, "
                            f"or its name); got {dtype!r}, a torch dtype")
        return str(dtype).removeprefix("torch.")
    try:
        return str(np.dtype(dtype).name)         # NumPy's (JAX and CuPy use them too)
    except TypeError:
        raise TypeError(f"`dtype` must be a real floating dtype of {lib} (or a NumPy dtype, or "
                        f"its name); got {dtype!r}") from None


def _jax_device(device: str) -> Any:
    """The JAX device named ``device``: a platform (``"cpu"``, ``"gpu"``, ``"cuda"``,
    ``"tpu"``), its first device, or ``"cpu:1"``, the second."""
    import jax

    platform, _, index = device.lower().partition(":")
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    k = int(index) if index.isdigit() else 0 if not index else -1
    if not devices or not 0 <= k < len(devices):
        have = ", ".join(f"{d.platform}:{d.id}" for d in jax.devices())
        raise ValueError(f"`device` {device!r} is not a JAX device here; JAX has {have}")
    return devices[k]


def _resolve(xp: Any, dtype: Any, device: Any) -> tuple[Namespace, Any, Any]:
    """The namespace, dtype and device a model is loaded into.

    ``dtype`` is a str, a dtype of the library or a NumPy dtype; a str that
    is not a real floating dtype (``"int32"``) is a TypeError, a floating
    one the library lacks (``"bfloat16"`` on NumPy) a ValueError. On JAX,
    float64 switches on 64-bit mode (``jax_enable_x64``) however it is
    given, and a device may be named by a str (``"cpu"``, ``"gpu:0"``).
    """
    if isinstance(xp, str):
        name = xp.replace("-", "_").lower()
        if name not in ("numpy", "torch", "cupy", "jax"):
            raise ValueError(f"`xp` must be a namespace or one of 'numpy', 'torch', 'cupy', "
                             f"'jax'; got {xp!r}")
        try:
            xp, default_device = get_backend(name)
        except ImportError as exc:
            raise ModuleNotFoundError(f"`xp` {name!r} needs {name}, which cannot be imported "
                                      f"({exc}); install it with {_INSTALL[name]}") from None
        device = default_device if device is None else device
    else:
        xp = resolve_xp(xp)
    lib = library_name(xp)
    name = _dtype_name(dtype, lib)
    have = [d for d in DTYPES if hasattr(xp, d)]
    if name not in DTYPES:
        raise TypeError(f"`dtype` must be a real floating dtype: one of {', '.join(have)} for "
                        f"{lib}; got {dtype!r}")
    if name not in have:
        raise ValueError(f"`dtype` must be one of {', '.join(have)} for {lib}; got {dtype!r}")
    if lib == "jax":
        import jax

        if name == "float64":
            jax.config.update("jax_enable_x64", True)
        if isinstance(device, str):
            device = _jax_device(device)
    return xp, getattr(xp, name), device
