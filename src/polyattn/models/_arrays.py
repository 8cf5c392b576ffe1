"""Array libraries by name: the namespace and device a model's weights are placed on."""

from __future__ import annotations

import importlib
from typing import Any

import array_api_compat

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


def _resolve(xp: Any, dtype: Any, device: Any) -> tuple[Namespace, Any, Any]:
    """The namespace, dtype and device a model is loaded into."""
    if isinstance(xp, str):
        name = xp.replace("-", "_").lower()
        if name not in ("numpy", "torch", "cupy", "jax"):
            raise ValueError(f"`xp` must be a namespace or one of 'numpy', 'torch', 'cupy', "
                             f"'jax'; got {xp!r}")
        xp, default_device = get_backend(name, dtype="float64" if dtype in (
            "float64",) else "float32")
        device = default_device if device is None else device
    else:
        xp = resolve_xp(xp)
    if isinstance(dtype, str):
        if dtype not in DTYPES or not hasattr(xp, dtype):
            have = [d for d in DTYPES if hasattr(xp, d)]
            raise ValueError(f"`dtype` must be one of {', '.join(have)} for "
                             f"{library_name(xp)}; got {dtype!r}")
        dtype = getattr(xp, dtype)
    elif not xp.isdtype(dtype, "real floating"):
        raise TypeError(f"`dtype` must be a real floating dtype; got {dtype!r}")
    return xp, dtype, device
