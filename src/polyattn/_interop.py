"""The one place that knows array libraries.

Everything else in polyattn asks this module for an array namespace, a device,
a library's name (:func:`array_library`, :func:`library_name`), a host copy
(:func:`to_numpy`) or whether Numba's CUDA simulator is on
(:func:`simulator_enabled`), so that the way libraries are recognised stays in
one file (docs/architecture.rst). Nothing here imports a GPU library.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
from array_api_compat import is_array_api_obj

__all__ = [
    "array_library",
    "array_namespace",
    "check_same_device",
    "contiguous",
    "default_float_dtype",
    "device_of",
    "is_array",
    "library_name",
    "namespace_of",
    "resolve_xp",
    "screen",
    "simulator_enabled",
    "to_numpy",
]

Array = Any
Namespace = Any


def array_library(x: object) -> str:
    """The top-level module of ``x``'s type: ``"numpy"``, ``"torch"``, ``"cupy"``, ``"jax"``
    (``jaxlib`` arrays too), ``"dask"``, ``"array_api_strict"``, ...

    >>> import numpy as np
    >>> array_library(np.zeros(2)), array_library(np.float32(1))
    ('numpy', 'numpy')
    """
    lib = type(x).__module__.split(".")[0]
    return "jax" if lib == "jaxlib" else lib


def simulator_enabled() -> bool:
    """Whether Numba's CUDA simulator is switched on (``NUMBA_ENABLE_CUDASIM=1``)."""
    import os

    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def to_numpy(x: Array) -> Any:
    """A NumPy copy (or view, where one is free) of an array of any library, on the host.

    CuPy arrays are copied from the GPU, torch tensors detached and copied to the
    CPU (a view for CPU tensors), array-api-strict arrays unwrapped.

    >>> import numpy as np
    >>> to_numpy(np.arange(3))
    array([0, 1, 2])
    """
    import numpy as np

    lib = array_library(x)
    if lib == "cupy":
        return x.get()
    if lib == "torch":
        return x.detach().cpu().numpy()
    if lib == "array_api_strict":
        return np.asarray(x._array)
    return np.asarray(x)


def is_array(x: object) -> bool:
    """Whether ``x`` is an array of a library the Array API helpers know."""
    return bool(is_array_api_obj(x))


def array_namespace(*arrays: Array) -> Namespace:
    """The standard-compatible namespace of ``arrays`` (all from one library)."""
    return array_api_compat.array_namespace(*arrays)


def library_name(xp: Namespace) -> str:
    """A short, user-facing name for a namespace: ``"numpy"``, ``"torch"``, ...

    Read from the module's name (``array_api_compat.torch`` -> ``"torch"``,
    ``jax.numpy`` -> ``"jax"``), which costs nothing and traces cleanly under
    ``torch.compile``.
    """
    name = str(getattr(xp, "__name__", type(xp).__name__))
    return name.removeprefix("array_api_compat.").split(".")[0]


def namespace_of(named: dict[str, Array]) -> Namespace:
    """The common namespace of the named arrays (``None`` values are skipped).

    Raises ``TypeError`` naming the two arguments whose libraries differ.
    """
    first_name, first_xp = None, None
    for name, x in named.items():
        if x is None:
            continue
        screen(name, x)
        torch_xp = _torch_namespace(x)
        if torch_xp is not None:
            xp = torch_xp
        elif not is_array(x):
            raise TypeError(
                f"`{name}` must be an array of a library that follows the Array API "
                f"(NumPy, CuPy, torch, JAX, Dask, array-api-strict); got {type(x).__name__}"
            )
        else:
            xp = array_namespace(x)
        if first_xp is None:
            first_name, first_xp = name, xp
        elif xp is not first_xp:
            raise TypeError(
                f"`{first_name}` is a {library_name(first_xp)} array but `{name}` is a "
                f"{library_name(xp)} array; pass arrays of one library"
            )
    if first_xp is None:
        raise TypeError("no array arguments were given")
    return first_xp


def screen(name: str, x: object) -> None:
    """``TypeError`` for NumPy array subclasses whose meaning polyattn would lose.

    A masked array's mask would be dropped silently, and ``np.matrix`` turns
    ``*`` into a matrix product and keeps two dimensions; neither is an Array
    API array.
    """
    import numpy as np

    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"`{name}` is a NumPy masked array, whose mask polyattn would ignore; pass a "
            f"plain array (`{name}.filled(...)` or `np.asarray({name})`) and, where the "
            "function has one, express the masked positions as a mask argument "
            "(`attn_mask`, `key_padding_mask`)")
    if isinstance(x, np.matrix):
        raise TypeError(f"`{name}` is a np.matrix; pass a plain array: np.asarray({name})")


def _torch_namespace(x: object) -> Any:
    """array_api_compat's torch namespace for a torch tensor (else ``None``), found by type.

    Asked directly so that ``torch.compile`` traces it without stepping into
    array_api_compat's cached type checks (which TorchDynamo warns about).
    """
    if not type(x).__module__.startswith("torch"):
        return None
    import torch

    if not isinstance(x, torch.Tensor):
        return None
    import array_api_compat.torch as xp

    return xp


def device_of(x: Array) -> Any:
    """The device an array lives on (``None`` for a JAX tracer, which has none yet)."""
    if _torch_namespace(x) is not None:
        return x.device
    return array_api_compat.device(x)


def check_same_device(named: dict[str, Array]) -> Any:
    """The common device of the named arrays; ``ValueError`` naming both if they differ.

    Arrays without a device (JAX tracers under ``jax.jit`` or ``jax.grad``,
    whose placement is decided later) agree with every device.
    """
    first_name, first_dev = None, None
    for name, x in named.items():
        if x is None:
            continue
        dev = device_of(x)
        if dev is None:
            continue
        if first_name is None:
            first_name, first_dev = name, dev
        elif dev != first_dev:
            raise ValueError(
                f"`{first_name}` is on device {first_dev!r} but `{name}` is on device "
                f"{dev!r}; move them to one device"
            )
    return first_dev


def contiguous(x: Array) -> Array:
    """``x`` in row-major memory order: a no-op where it is (or where the library has no
    memory order to speak of); a copy of a NumPy array or torch tensor that is not."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        return x if x.is_contiguous() else x.contiguous()
    if mod.startswith("numpy"):
        import numpy as np

        return x if x.flags.c_contiguous else np.ascontiguousarray(x)
    return x


def resolve_xp(xp: Namespace | None) -> Namespace:
    """Turn a user's ``xp`` argument into a standard-compatible namespace.

    ``None`` means NumPy. A library's own module (``numpy``, ``torch``,
    ``cupy``, ``jax.numpy``, ``dask.array``, ``array_api_strict``) and its
    ``array_api_compat`` wrapper are both accepted.
    """
    if xp is None:
        import numpy

        xp = numpy
    asarray = getattr(xp, "asarray", None)
    if asarray is None:
        raise TypeError(f"`xp` must be an array namespace such as numpy or torch; got {xp!r}")
    return array_namespace(asarray(0.0))


def default_float_dtype(xp: Namespace, device: Any = None) -> Any:
    """The namespace's default real floating dtype on ``device``."""
    info = getattr(xp, "__array_namespace_info__", None)
    if info is not None:
        try:
            return info().default_dtypes(device=device)["real floating"]
        except Exception:  # pragma: no cover - old namespaces
            pass
    return xp.asarray(0.0).dtype  # pragma: no cover


def concrete_values(x: Array) -> Any:
    """``x``'s values as a NumPy array where they are at hand, else ``None``.

    At hand: NumPy, torch (CPU and CUDA, outside tracing), CuPy, JAX arrays
    that are not tracers, array-api-strict, Dask arrays whose graph is only
    their chunks' values (``da.from_array`` of a NumPy array). Not at hand:
    JAX tracers (under ``jax.jit``, ``grad``, …), other Dask arrays
    (computing them would run the graph), torch tensors being traced. Used
    for cheap value checks of small integer arguments (``key_lengths``),
    never on the attention inputs.
    """
    import numpy as np

    lib = array_library(x)
    try:
        if lib == "numpy":
            return np.asarray(x)
        if lib == "torch":
            import torch

            if torch.compiler.is_compiling():
                return None
            return x.detach().cpu().numpy()
        if lib == "cupy":
            return x.get()
        if lib == "jax":
            import jax

            if isinstance(x, jax.core.Tracer):
                return None
            return np.asarray(x)
        if lib == "array_api_strict":
            return np.asarray(x._array)
        if lib == "dask":
            return _dask_literal(x)
    except Exception:  # values not at hand: skip the check, never fail on it
        return None
    return None


def _dask_literal(x: Array) -> Any:
    """A Dask array's values when its graph holds nothing but its chunks' values
    (``da.from_array`` or ``da.asarray`` of a NumPy array or an int); ``None`` when
    any task would have to run."""
    import numpy as np
    from dask.array.core import concatenate3

    graph = dict(x.__dask_graph__())
    keys = x.__dask_keys__()

    def value(key: Any) -> Any:
        if isinstance(key, list):
            return [value(k) for k in key]
        v = graph[key]
        v = getattr(v, "value", v)              # a DataNode wraps its literal
        if not isinstance(v, (np.ndarray, np.generic)):
            raise LookupError(key)              # a task: not at hand
        return np.asarray(v)

    if len(graph) != x.npartitions:
        return None
    try:
        blocks = value(keys)
    except LookupError:
        return None
    return np.asarray(concatenate3(blocks) if x.ndim else blocks).reshape(x.shape)
