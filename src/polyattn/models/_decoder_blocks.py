"""The parts of a Llama-family decoder: RMSNorm, SiLU, GELU, gpt-oss's mixture of experts,
the per-layer key/value cache.

Also the small helpers the decoder's messages and host-side sampling use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import polyattn
from polyattn._interop import array_namespace, device_of

Array = Any
Namespace = Any


def rms_norm(x: Array, weight: Array, /, *, eps: float, offset: float = 0.0,
             scale_in_float32: bool = False) -> Array:
    """Divide the last axis by its root mean square, then scale: Llama's RMSNorm.

    The scale is ``offset + weight`` (Gemma's RMSNorm has ``offset`` 1).
    float16 and bfloat16 inputs are normalised in float32 and cast back (as
    transformers does): before the scale, or after it with
    ``scale_in_float32`` (Gemma, gpt-oss).

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models.smollm2 import rms_norm
    >>> rms_norm(np.array([3.0, 4.0]), np.array([1.0, 2.0]), eps=0.0).round(4)
    array([0.8485, 2.2627])
    >>> rms_norm(np.array([3.0, 4.0]), np.array([0.0, 1.0]), eps=0.0, offset=1.0).round(4)
    array([0.8485, 2.2627])
    """
    xp = array_namespace(x, weight)
    low = x.dtype in (xp.float16, getattr(xp, "bfloat16", xp.float16))
    h = xp.astype(x, xp.float32) if low else x
    inv = 1.0 / xp.sqrt(xp.mean(h * h, axis=-1, keepdims=True) + eps)
    h = h * inv
    if low and scale_in_float32:
        w = xp.astype(weight, xp.float32)
        return xp.astype(h * (w + offset if offset else w), x.dtype)
    w = weight + offset if offset else weight
    return w * (xp.astype(h, x.dtype) if low else h)


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


def gelu_tanh(x: Array, /) -> Array:
    """GELU's tanh approximation, ``x/2 · (1 + tanh(sqrt(2/π) · (x + 0.044715 x³)))``.

    Gemma's ``gelu_pytorch_tanh``.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models._decoder_blocks import gelu_tanh
    >>> gelu_tanh(np.array([-3.0, 0.0, 1.0])).round(4)
    array([-0.0036,  0.    ,  0.8412])
    """
    xp = array_namespace(x)
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))
    return 0.5 * x * (1.0 + xp.tanh(inner))


def _sigmoid(x: Array, /) -> Array:
    """``1 / (1 + exp(-x))`` with no overflow for large ``|x|``."""
    xp = array_namespace(x)
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def mixture_of_experts(h: Array, params: Mapping[str, Array], /, *, top_k: int,
                       alpha: float | None, limit: float | None) -> Array:
    """gpt-oss's feed-forward network: a router's top ``top_k`` experts, each a clamped SwiGLU.

    For each token the router's logits ``h @ router + b_router`` (X,) pick
    the ``top_k`` largest (ties: the lower expert); their softmax weights
    the experts' outputs. Expert ``x``: ``gate, up = split(h @ w_gate_up[x]
    + b_gate_up[x])``; ``gate = min(gate, limit)``,
    ``up = clip(up, -limit, limit)``; ``((up + 1) · gate · sigmoid(alpha ·
    gate)) @ w_down[x] + b_down[x]``. Every expert is computed for every
    token (dense, in plain Array API code) and weighted by 0 where not
    picked.

    Parameters
    ----------
    h : array (N, D)
    params : mapping
        ``"router"`` (D, X), ``"b_router"`` (X,), ``"w_gate_up"`` (X, D, 2F)
        (gate features, then up), ``"b_gate_up"`` (X, 2F), ``"w_down"``
        (X, F, D), ``"b_down"`` (X, D).
    top_k : int
    alpha, limit : float or None
        The SwiGLU's slope and clamp (``None``: plain SwiGLU, no clamp).

    Returns
    -------
    array (N, D)

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models._decoder_blocks import mixture_of_experts
    >>> rng = np.random.default_rng(0)
    >>> n, d, x, f = 3, 4, 2, 5
    >>> params = {"router": rng.standard_normal((d, x)), "b_router": np.zeros(x),
    ...           "w_gate_up": rng.standard_normal((x, d, 2 * f)),
    ...           "b_gate_up": np.zeros((x, 2 * f)), "w_down": rng.standard_normal((x, f, d)),
    ...           "b_down": np.zeros((x, d))}
    >>> mixture_of_experts(rng.standard_normal((n, d)), params, top_k=1, alpha=1.702,
    ...                    limit=7.0).shape
    (3, 4)
    """
    xp = array_namespace(h)
    n = h.shape[0]
    logits = h @ params["router"] + params["b_router"]                  # (N, X)
    num_experts = logits.shape[-1]
    order = xp.argsort(logits, axis=-1, descending=True, stable=True)   # (N, X)
    experts = xp.arange(num_experts, device=device_of(order))           # (X,)
    picked = [experts == order[:, j:j + 1] for j in range(top_k)]       # k × (N, X)
    top = [xp.sum(xp.where(p, logits, 0.0), axis=-1) for p in picked]   # k × (N,)
    m = top[0]                                                          # the largest
    e = [xp.exp(v - m) for v in top]
    total = sum(e[1:], start=e[0])
    weights = sum((xp.where(p, xp.reshape(w / total, (n, 1)), 0.0)
                   for p, w in zip(picked[1:], e[1:], strict=True)),
                  start=xp.where(picked[0], xp.reshape(e[0] / total, (n, 1)), 0.0))  # (N, X)
    gate_up = xp.matmul(h[None, ...], params["w_gate_up"])              # (X, N, 2F)
    gate_up = gate_up + params["b_gate_up"][:, None, :]
    f = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :f], gate_up[..., f:]                       # (X, N, F)
    if limit is not None:
        gate = xp.clip(gate, max=limit)
        up = xp.clip(up, min=-limit, max=limit)
    glu = gate * _sigmoid(gate * (1.0 if alpha is None else alpha))
    out = xp.matmul((up + 1.0) * glu, params["w_down"])                 # (X, N, D)
    out = out + params["b_down"][:, None, :]
    w = xp.permute_dims(weights, (1, 0))[..., None]                     # (X, N, 1)
    return xp.sum(w * out, axis=0)                                      # (N, D)
