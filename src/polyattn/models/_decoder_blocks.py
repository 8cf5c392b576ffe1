"""The parts of a Llama-style decoder: RMSNorm, SiLU, the per-layer key/value cache.

Also the small helpers the decoder's messages and host-side sampling use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import polyattn
from polyattn._interop import array_namespace

Array = Any
Namespace = Any


def rms_norm(x: Array, weight: Array, /, *, eps: float) -> Array:
    """Divide the last axis by its root mean square, then scale: Llama's RMSNorm.

    float16 and bfloat16 inputs are normalised in float32 and cast back (as
    transformers does).

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models.smollm2 import rms_norm
    >>> rms_norm(np.array([3.0, 4.0]), np.array([1.0, 2.0]), eps=0.0).round(4)
    array([0.8485, 2.2627])
    """
    xp = array_namespace(x, weight)
    low = x.dtype in (xp.float16, getattr(xp, "bfloat16", xp.float16))
    h = xp.astype(x, xp.float32) if low else x
    inv = 1.0 / xp.sqrt(xp.mean(h * h, axis=-1, keepdims=True) + eps)
    h = h * inv
    return weight * (xp.astype(h, x.dtype) if low else h)


def silu(x: Array, /) -> Array:
    """``x · sigmoid(x)``, with no overflow for large ``|x|``.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models.smollm2 import silu
    >>> silu(np.array([-1000.0, -1.0, 0.0, 2.0])).round(4)
    array([-0.    , -0.2689,  0.    ,  1.7616])
    """
    xp = array_namespace(x)
    e = xp.exp(-xp.abs(x))                  # in (0, 1]: never overflows
    sigmoid = xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return x * sigmoid


def _to_numpy(x: Array) -> np.ndarray:
    """A NumPy copy of ``x`` from any library (for host-side sampling and printing)."""
    lib = type(x).__module__.split(".")[0]
    if lib == "cupy":
        return x.get()
    if lib == "torch":
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _size_text(nbytes: int) -> str:
    """``nbytes`` for a message: ``"4.6 GB"``, ``"37.7 MB"``, ``"512 bytes"``."""
    if nbytes >= 1e21:
        return f"{nbytes:.2e} bytes"
    for unit, scale in (("EB", 1e18), ("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6),
                        ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _plural(n: int, word: str) -> str:
    """``"1 token"``, ``"2 tokens"``."""
    return f"{n} {word}{'s' if n != 1 else ''}"


def _index_dtype(xp: Namespace, device: Any) -> Any:
    """The library's default integer dtype (int64; int32 for JAX without x64)."""
    return xp.__array_namespace_info__().default_dtypes(device=device)["integral"]


class Cache:
    """The keys and values of past tokens: one :class:`polyattn.KVCache` per layer.

    Create it with :meth:`SmolLM2.new_cache`; :meth:`SmolLM2.__call__`
    appends to it. Its ``layers`` list is updated in place on every library
    (on JAX, whose arrays are immutable, each entry is replaced by the new
    cache that :meth:`polyattn.KVCache.update` returns).

    Attributes
    ----------
    layers : list of KVCache
        Keys (B, Hkv, C, E) and values (B, Hkv, C, E) of each layer.

    Notes
    -----
    Nothing is promised about one cache used from several threads at once:
    every call of the model that is given it writes to it. Give each thread
    (each conversation) a cache of its own.
    """

    def __init__(self, layers: Sequence[polyattn.KVCache]) -> None:
        self.layers = list(layers)

    @property
    def lengths(self) -> Array:
        """Tokens held per row, integer (B,)."""
        return self.layers[0].lengths

    @property
    def capacity(self) -> int:
        """Tokens a row can hold."""
        return self.layers[0].capacity

    def __repr__(self) -> str:
        return f"Cache({len(self.layers)} layers of {self.layers[0]!r})"
