"""Array libraries by name: the namespace and device a model's weights are placed on."""

from __future__ import annotations

import importlib
from typing import Any

import array_api_compat

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

