"""Multi-head attention: project, attend per head, concatenate, project back.

Parameters follow ``x @ w`` with weights laid out (in, out)::

    w_q (d_model, H·E)   w_k (kdim, Hkv·E)   w_v (vdim, Hkv·Ev)   w_o (H·Ev, d_model)
    b_q (H·E,)           b_k (Hkv·E,)        b_v (Hkv·Ev,)        b_o (d_model,)

with ``E = d_model // H``. Biases are optional. ``H = num_heads`` query
heads share ``Hkv = num_kv_heads`` key/value heads (grouped-query attention;
``Hkv = 1`` is multi-query attention).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ._compat import (
    Array,
    Namespace,
    check_same_device,
    default_float_dtype,
    namespace_of,
    resolve_xp,
)
from ._validation import (
    IMPLEMENTATIONS,
    broadcast_shapes,
    check_bool,
    check_choice,
    check_floating,
    check_min_ndim,
    check_nonnegative_int,
    shape_str,
)
from .attention import attention_weights, scaled_dot_product_attention

WEIGHTS = ("w_q", "w_k", "w_v", "w_o")
BIASES = ("b_q", "b_k", "b_v", "b_o")


def _check_heads(embed_dim: int, num_heads: object, num_kv_heads: object,
                 source: str = "`embed_dim` ({d})") -> tuple[int, int]:
    """H and Hkv after checking them; ``source`` says where ``embed_dim`` came from."""
    h = check_nonnegative_int("num_heads", num_heads, minimum=1)
    hkv = h if num_kv_heads is None else check_nonnegative_int("num_kv_heads", num_kv_heads,
                                                                minimum=1)
    if embed_dim % h:
        raise ValueError(f"{source.format(d=embed_dim)} must be divisible by "
                         f"`num_heads` ({h})")
    if h % hkv:
        raise ValueError(f"`num_heads` ({h}) must be a multiple of `num_kv_heads` ({hkv})")
    return h, hkv


def _check_params(params: Mapping[str, Array], d_model: int, kdim: int, vdim: int, h: int,
                  hkv: int) -> int:
    """Check every parameter's presence and shape; return Ev (value features per head)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"`params` must be a mapping of arrays; got {type(params).__name__}")
    missing = [name for name in WEIGHTS if name not in params]
    if missing:
        raise ValueError(f"`params` lacks {', '.join(missing)} (needs {', '.join(WEIGHTS)})")
    unknown = sorted(set(params) - set(WEIGHTS) - set(BIASES))
    if unknown:
        raise ValueError(f"`params` has unknown keys {unknown} (known: {WEIGHTS + BIASES})")
    e = d_model // h
    w_v = params["w_v"]
    vcols = w_v.shape[-1] if w_v.ndim == 2 else 0
    if vcols % hkv or vcols == 0:
        raise ValueError(f"params `w_v` has shape {shape_str(w_v)}; expected (vdim={vdim}, "
                         f"num_kv_heads·Ev) with a multiple of {hkv} columns")
    ev = vcols // hkv
    expected = {
        "w_q": (d_model, h * e), "w_k": (kdim, hkv * e), "w_v": (vdim, hkv * ev),
        "w_o": (h * ev, d_model), "b_q": (h * e,), "b_k": (hkv * e,), "b_v": (hkv * ev,),
        "b_o": (d_model,),
    }
    for name, shape in expected.items():
        p = params.get(name)
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(f"params `{name}` has shape {shape_str(p)}; expected {shape} "
                             f"(d_model={d_model}, kdim={kdim}, vdim={vdim}: the features of "
                             f"query, key and value; num_heads={h}, num_kv_heads={hkv})")
    return ev


def _project(x: Array, w: Array, b: Array | None, heads: int, xp: Namespace) -> Array:
    """x (B…, T, in) -> (B…, heads, T, out/heads)."""
    y = xp.matmul(x, w)                                       # (B…, T, heads·F)
    if b is not None:
        y = y + b
    *lead, t, f = y.shape
    y = xp.reshape(y, (*lead, t, heads, f // heads))          # (B…, T, heads, F)
    nd = y.ndim
    return xp.permute_dims(y, (*range(nd - 3), nd - 2, nd - 3, nd - 1))  # (B…, heads, T, F)


def multi_head_attention(
    query: Array, key: Array, value: Array, /, params: Mapping[str, Array], *, num_heads: int,
    num_kv_heads: int | None = None, attn_mask: Array | None = None, is_causal: bool = False,
    causal_alignment: str = "top_left", need_weights: bool = False, implementation: str = "auto",
) -> Array | tuple[Array, Array]:
    """Multi-head attention with explicit parameters (functional form).

    Parameters
    ----------
    query : array (B…, Tq, d_model)
    key : array (B…, Tk, kdim)
    value : array (B…, Tk, vdim)
    params : mapping
        ``w_q``, ``w_k``, ``w_v``, ``w_o`` and optional ``b_q``, ``b_k``,
        ``b_v``, ``b_o``, laid out as in the module docstring (``x @ w``).
    num_heads : int
        Query heads H; ``d_model`` must be divisible by it.
    num_kv_heads : int, optional
        Key/value heads Hkv (default H); H must be a multiple of it.
    attn_mask : array, optional
        Broadcastable to (B…, H, Tq, Tk); bool True = attend, or float added.
        A key-padding mask has shape (B, 1, 1, Tk).
    is_causal, causal_alignment, implementation
        As in :func:`~polyattn.scaled_dot_product_attention`.
    need_weights : bool
        Also return the attention weights averaged over heads (B…, Tq, Tk).

    Returns
    -------
    out : array (B…, Tq, d_model)
    weights : array (B…, Tq, Tk)
        Only with ``need_weights=True``.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import MultiHeadAttention, multi_head_attention
    >>> mha = MultiHeadAttention(16, 4, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 16))  # (B, T, d_model)
    >>> out, w = multi_head_attention(x, x, x, mha.params, num_heads=4, need_weights=True)
    >>> out.shape, w.shape
    ((2, 5, 16), (2, 5, 5))
    """
    arrays = {"query": query, "key": key, "value": value, "attn_mask": attn_mask}
    arrays.update({f"params['{k}']": v for k, v in (params.items()
                                                    if isinstance(params, Mapping) else ())})
    xp = namespace_of(arrays)
    check_same_device(arrays)
    check_bool("need_weights", need_weights)
    check_choice("implementation", implementation, IMPLEMENTATIONS)
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_floating(name, x, xp)
        check_min_ndim(name, x, 2, "(…, T, features)")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"`value` has {value.shape[-2]} positions but `key` has "
                         f"{key.shape[-2]} (key {shape_str(key)}, value {shape_str(value)})")
    named = (("query", query), ("key", key), ("value", value))
    broadcast_shapes(tuple(n for n, _ in named), tuple(tuple(x.shape[:-2]) for _, x in named),
                     "batch dimensions", full=tuple(tuple(x.shape) for _, x in named))
    d_model = int(query.shape[-1])
    h, hkv = _check_heads(d_model, num_heads, num_kv_heads,
                          f"d_model = {{d}} (the features of `query` {shape_str(query)})")
    _check_params(params, d_model, int(key.shape[-1]), int(value.shape[-1]), h, hkv)
    for name in (*WEIGHTS, *BIASES):
        if params.get(name) is not None:
            check_floating(f"params['{name}']", params[name], xp)

    q = _project(query, params["w_q"], params.get("b_q"), h, xp)      # (B…, H, Tq, E)
    k = _project(key, params["w_k"], params.get("b_k"), hkv, xp)      # (B…, Hkv, Tk, E)
    v = _project(value, params["w_v"], params.get("b_v"), hkv, xp)    # (B…, Hkv, Tk, Ev)
    gqa = hkv != h
    if need_weights:
        alpha = attention_weights(q, k, attn_mask=attn_mask, is_causal=is_causal,
                                  causal_alignment=causal_alignment,
                                  enable_gqa=gqa)                     # (B…, H, Tq, Tk)
        if hkv != h:
            vv = _repeat_heads(v, h // hkv, xp)
        else:
            vv = v
        heads = xp.matmul(alpha, xp.astype(vv, alpha.dtype))            # (B…, H, Tq, Ev)
    else:
        heads = scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                             causal_alignment=causal_alignment, enable_gqa=gqa,
                                             implementation=implementation)
    nd = heads.ndim
    heads = xp.permute_dims(heads, (*range(nd - 3), nd - 2, nd - 3, nd - 1))  # (B…, Tq, H, Ev)
    heads = xp.reshape(heads, (*heads.shape[:-2], heads.shape[-2] * heads.shape[-1]))
    out = xp.matmul(heads, params["w_o"])                              # (B…, Tq, d_model)
    if params.get("b_o") is not None:
        out = out + params["b_o"]
    if need_weights:
        return out, xp.mean(alpha, axis=-3)                            # (B…, Tq, Tk)
    return out


def _repeat_heads(x: Array, groups: int, xp: Namespace) -> Array:
    """(B…, Hkv, T, F) -> (B…, Hkv·groups, T, F), each head repeated ``groups`` times."""
    *batch, hkv, t, f = x.shape
    x = xp.broadcast_to(xp.expand_dims(x, axis=-3), (*batch, hkv, groups, t, f))
    return xp.reshape(x, (*batch, hkv * groups, t, f))


def _xavier_uniform(rng: Any, fan_in: int, fan_out: int) -> Any:
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, size=(fan_in, fan_out))


class MultiHeadAttention:
    """Multi-head attention holding its parameters.

    Parameters
    ----------
    embed_dim : int
        d_model, the query features and the output features.
    num_heads : int
        Query heads H (``embed_dim % num_heads == 0``).
    num_kv_heads : int, optional
        Key/value heads (grouped-query attention); default ``num_heads``.
    kdim, vdim : int, optional
        Key and value features (default ``embed_dim``).
    bias : bool
        Whether the four projections have biases.
    xp, dtype, device : optional
        Where the parameters are created (default NumPy, the library's
        default float dtype).
    seed : int, optional
        Seed of the initialisation. Weights w_q, w_k, w_v are Xavier/Glorot
        uniform, w_o is uniform in ±1/sqrt(fan_in) and biases are zero, as in
        ``torch.nn.MultiheadAttention``.

    Attributes
    ----------
    params : dict
        The arrays, laid out as in :func:`multi_head_attention`.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import MultiHeadAttention
    >>> mha = MultiHeadAttention(8, 2, seed=0)
    >>> sorted(mha.params)
    ['b_k', 'b_o', 'b_q', 'b_v', 'w_k', 'w_o', 'w_q', 'w_v']
    >>> x = np.ones((3, 8))                      # (T, d_model)
    >>> mha(x, is_causal=True).shape
    (3, 8)
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 kdim: int | None = None, vdim: int | None = None, bias: bool = True,
                 xp: Namespace = None, dtype: Any = None, device: Any = None,
                 seed: int | None = None) -> None:
        import numpy as np

        embed_dim = check_nonnegative_int("embed_dim", embed_dim, minimum=1)
        self.num_heads, self.num_kv_heads = _check_heads(embed_dim, num_heads, num_kv_heads)
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else check_nonnegative_int("kdim", kdim, minimum=1)
        self.vdim = embed_dim if vdim is None else check_nonnegative_int("vdim", vdim, minimum=1)
        check_bool("bias", bias)
        xp = resolve_xp(xp)
        if dtype is not None and not xp.isdtype(dtype, "real floating"):
            raise TypeError(f"`dtype` must be a real floating dtype; got {dtype}")
        rng = np.random.default_rng(seed)
        e = embed_dim // self.num_heads
        kv = self.num_kv_heads * e
        host = {
            "w_q": _xavier_uniform(rng, embed_dim, embed_dim),
            "w_k": _xavier_uniform(rng, self.kdim, kv),
            "w_v": _xavier_uniform(rng, self.vdim, kv),
            "w_o": rng.uniform(-1, 1, size=(embed_dim, embed_dim)) / math.sqrt(embed_dim),
        }
        if bias:
            host.update(b_q=np.zeros(embed_dim), b_k=np.zeros(kv), b_v=np.zeros(kv),
                        b_o=np.zeros(embed_dim))
        self.params = _to_namespace(host, xp, dtype, device)

    def __call__(self, query: Array, key: Array | None = None, value: Array | None = None,
                 /, **options: Any) -> Array | tuple[Array, Array]:
        """Attend: ``key`` defaults to ``query`` (self-attention), ``value`` to ``key``.

        Keywords are those of :func:`multi_head_attention` (``attn_mask``,
        ``is_causal``, ``causal_alignment``, ``need_weights``,
        ``implementation``).
        """
        key = query if key is None else key
        value = key if value is None else value
        expected = (("query", query, self.embed_dim, "embed_dim"),
                    ("key", key, self.kdim, "kdim"), ("value", value, self.vdim, "vdim"))
        for name, x, size, attr in expected:
            shape = getattr(x, "shape", None)
            if shape is not None and len(shape) >= 1 and shape[-1] != size:
                raise ValueError(f"`{name}` has {shape[-1]} features but this module has "
                                 f"{attr}={size} ({name} {shape_str(x)}, expected "
                                 f"(…, T, {size}))")
        return multi_head_attention(query, key, value, self.params, num_heads=self.num_heads,
                                    num_kv_heads=self.num_kv_heads, **options)

    def __repr__(self) -> str:
        return (f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"bias={'b_q' in self.params})")

    @classmethod
    def from_torch(cls, module: Any, *, xp: Namespace = None, dtype: Any = None,
                   device: Any = None) -> MultiHeadAttention:
        """Load the weights of a ``torch.nn.MultiheadAttention``.

        Packed (``in_proj_weight``) and separate (``q_proj_weight`` …)
        projections are both read; torch's ``y = x Wᵀ + b`` becomes
        ``y = x @ w + b`` with ``w = Wᵀ``. The parameters land in ``xp``
        (default NumPy) with ``dtype`` (default: the module's precision).
        Modules with ``add_bias_kv`` or ``add_zero_attn`` are not supported.
        Dropout is not applied (inference semantics).

        Examples
        --------
        >>> import torch                                     # doctest: +SKIP
        >>> m = torch.nn.MultiheadAttention(8, 2, batch_first=True)  # doctest: +SKIP
        >>> mha = MultiHeadAttention.from_torch(m)           # doctest: +SKIP
        """
        import numpy as np

        if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
            raise ValueError("MultiheadAttention modules with add_bias_kv or add_zero_attn "
                             "are not supported")

        def host(t: Any) -> Any:
            return np.asarray(t.detach().cpu().numpy())

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
        self = cls.__new__(cls)
        self.embed_dim, self.num_heads = d, int(module.num_heads)
        self.num_kv_heads = self.num_heads
        self.kdim, self.vdim = int(module.kdim), int(module.vdim)
        if dtype is None:
            xp_resolved = resolve_xp(xp)
            dtype = xp_resolved.float64 if wq.dtype == np.float64 else xp_resolved.float32
        self.params = _to_namespace(params, xp, dtype, device)
        return self


def _to_namespace(host: dict[str, Any], xp: Namespace, dtype: Any, device: Any) -> dict[str, Array]:
    """Copy NumPy parameters into ``xp`` with ``dtype`` on ``device``."""
    import numpy as np

    xp = resolve_xp(xp)
    if dtype is None:
        dtype = default_float_dtype(xp, device)
    return {k: xp.asarray(np.ascontiguousarray(v), dtype=dtype, device=device)
            for k, v in host.items()}
