"""The parameters: their names, initialisation, copy into an array library, and the
weights of a ``torch.nn.MultiheadAttention``.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from polyattn._interop import Array, Namespace, default_float_dtype, resolve_xp

WEIGHTS = ("w_q", "w_k", "w_v", "w_o")
BIASES = ("b_q", "b_k", "b_v", "b_o")
#: Optional parameters that are neither: the attention sinks, one logit per query head.
EXTRAS = ("sinks",)


def _xavier_uniform(rng: Any, fan_in: int, fan_out: int) -> Any:
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, size=(fan_in, fan_out))


def _initial_weights(rng: Any, embed_dim: int, kdim: int, vdim: int, kv: int,
                     bias: bool, sinks: int = 0) -> dict[str, Any]:
    """NumPy parameters initialised as ``torch.nn.MultiheadAttention``'s.

    w_q, w_k, w_v Xavier/Glorot uniform, w_o uniform in ±1/sqrt(fan_in), biases
    zero (with ``bias``); ``kv`` is the key/value projections' columns, Hkv·E;
    ``sinks``: that many sink logits (one per query head), zero.
    """
    import numpy as np

    host = {
        "w_q": _xavier_uniform(rng, embed_dim, embed_dim),
        "w_k": _xavier_uniform(rng, kdim, kv),
        "w_v": _xavier_uniform(rng, vdim, kv),
        "w_o": rng.uniform(-1, 1, size=(embed_dim, embed_dim)) / math.sqrt(embed_dim),
    }
    if bias:
        host.update(b_q=np.zeros(embed_dim), b_k=np.zeros(kv), b_v=np.zeros(kv),
                    b_o=np.zeros(embed_dim))
    if sinks:
        host["sinks"] = np.zeros(sinks)
    return host


def _to_namespace(host: dict[str, Any], xp: Namespace, dtype: Any, device: Any) -> dict[str, Array]:
    """Copy NumPy parameters into ``xp`` with ``dtype`` on ``device``."""
    import numpy as np

    xp = resolve_xp(xp)
    if dtype is None:
        dtype = default_float_dtype(xp, device)
    return {k: xp.asarray(np.ascontiguousarray(v), dtype=dtype, device=device)
            for k, v in host.items()}


def _torch_weights(module: Any) -> dict[str, Any]:
    """A ``torch.nn.MultiheadAttention``'s weights as NumPy arrays laid out for ``x @ w``.

    torch's ``y = x Wᵀ + b`` becomes ``y = x @ w + b`` with ``w = Wᵀ``; packed
    (``in_proj_weight``) and separate (``q_proj_weight`` …) projections are
    both read, bfloat16 as float32.
    """
    import numpy as np

    _check_torch_module(module)
    if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
        raise ValueError("MultiheadAttention modules with add_bias_kv or add_zero_attn "
                         "are not supported")

    def host(t: Any) -> Any:
        t = t.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":                # NumPy has no bfloat16
            t = t.float()
        return np.asarray(t.numpy())

    d = int(module.embed_dim)
    if getattr(module, "in_proj_weight", None) is not None:
        w = host(module.in_proj_weight)                          # (3d, d) as (out, in)
        wq, wk, wv = w[:d], w[d:2 * d], w[2 * d:]
    else:
        wq, wk, wv = (host(module.q_proj_weight), host(module.k_proj_weight),
                      host(module.v_proj_weight))
    params = {"w_q": wq.T, "w_k": wk.T, "w_v": wv.T, "w_o": host(module.out_proj.weight).T}
    bias = getattr(module, "in_proj_bias", None) is not None
    if bias:
        b = host(module.in_proj_bias)
        params.update(b_q=b[:d], b_k=b[d:2 * d], b_v=b[2 * d:])
        out_bias = module.out_proj.bias
        params["b_o"] = host(out_bias) if out_bias is not None else np.zeros(d)
    return params


def _check_torch_module(module: object) -> None:
    """``TypeError`` unless ``module`` is a ``torch.nn.MultiheadAttention`` (or a subclass)."""
    torch = sys.modules.get("torch")     # a torch module means torch is imported already
    if torch is not None and isinstance(module, torch.nn.MultiheadAttention):
        return
    kind = type(module)
    name = kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")
    raise TypeError("`module` must be a torch.nn.MultiheadAttention (the module whose "
                    f"weights MultiHeadAttention.from_torch loads); got {name}")
