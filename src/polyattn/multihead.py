"""Multi-head attention: project, attend per head, concatenate, project back.

Parameters follow ``x @ w`` with weights laid out (in, out)::

    w_q (d_model, H·E)   w_k (kdim, Hkv·E)   w_v (vdim, Hkv·Ev)   w_o (H·Ev, d_model)
    b_q (H·E,)           b_k (Hkv·E,)        b_v (Hkv·Ev,)        b_o (d_model,)

with ``E = d_model // H``. Biases are optional. ``H = num_heads`` query
heads share ``Hkv = num_kv_heads`` key/value heads (grouped-query attention;
``Hkv = 1`` is multi-query attention).
"""

from __future__ import annotations

import copy
import math
import numbers
import sys
from collections.abc import Mapping
from typing import Any

from polyattn._interop import (
    Array,
    Namespace,
    check_same_device,
    concrete_values,
    default_float_dtype,
    device_of,
    is_array,
    library_name,
    namespace_of,
    resolve_xp,
)
from polyattn._validation import (
    IMPLEMENTATIONS,
    broadcast_shapes,
    check_bool,
    check_choice,
    check_float_dtype,
    check_floating,
    check_min_ndim,
    check_nonnegative_int,
    floats_text,
    is_supported_float,
    shape_str,
)
from polyattn.attention import attention_weights, scaled_dot_product_attention
from polyattn.cache import KVCache
from polyattn.rotary import apply_rotary_embedding
from polyattn.rules.online import quiet_floating_point

WEIGHTS = ("w_q", "w_k", "w_v", "w_o")
BIASES = ("b_q", "b_k", "b_v", "b_o")
#: The options of :func:`~polyattn.apply_rotary_embedding` that ``rotary`` may set.
ROTARY_OPTIONS = ("base", "interleaved", "rotary_dim")


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
    """x (B…, T, in) -> (B…, T, heads, out/heads): the "BTHE" layout, no transpose."""
    y = xp.matmul(x, w)                                       # (B…, T, heads·F)
    if b is not None:
        y = y + b
    *lead, t, f = y.shape
    return xp.reshape(y, (*lead, t, heads, f // heads))        # (B…, T, heads, F)


def _padding_to_attn_mask(key_padding_mask: Array, key: Array, xp: Namespace) -> Array:
    """torch's ``key_padding_mask`` (B…, Tk), True = ignore, as an attend mask (B…, 1, 1, Tk)."""
    kpm = key_padding_mask
    tk = int(key.shape[-2])
    if kpm.ndim < 1 or kpm.shape[-1] != tk:
        raise ValueError(f"`key_padding_mask` must be (B…, Tk) with Tk = {tk} keys; got shape "
                         f"{shape_str(kpm)} (key {shape_str(key)})")
    if kpm.dtype == xp.bool:
        kpm = xp.logical_not(kpm)                              # True = attend
    elif not is_supported_float(kpm.dtype, xp):
        raise TypeError(f"`key_padding_mask` must be boolean (True = ignore the key, as in "
                        f"torch) or real floating ({floats_text(xp)}; added to the scores); "
                        f"got dtype {kpm.dtype}")
    return xp.reshape(kpm, (*kpm.shape[:-1], 1, 1, tk))        # (B…, 1, 1, Tk)


def _combine_masks(attn_mask: Array | None, padding: Array | None, xp: Namespace) -> Array | None:
    """Both masks at once: booleans are and-ed; with a float mask, hidden keys add -inf."""
    if padding is None or attn_mask is None:
        return attn_mask if padding is None else padding
    if attn_mask.dtype == xp.bool and padding.dtype == xp.bool:
        return xp.logical_and(attn_mask, padding)
    if attn_mask.dtype == xp.bool:
        attn_mask, padding = padding, attn_mask
    if padding.dtype == xp.bool:                               # attn_mask is floating here
        return xp.where(padding, attn_mask, -math.inf)
    return attn_mask + padding


def multi_head_attention(
    query: Array, key: Array, value: Array, /, params: Mapping[str, Array], *, num_heads: int,
    num_kv_heads: int | None = None, attn_mask: Array | None = None,
    key_padding_mask: Array | None = None, is_causal: bool = False,
    causal_alignment: str | None = None, need_weights: bool = False,
    average_attn_weights: bool = True, implementation: str = "auto",
    window: tuple[int | None, int | None] | None = None, softcap: float | None = None,
    alibi_slopes: Array | None = None, key_lengths: Array | int | None = None,
    rotary: Mapping[str, Any] | None = None, positions: Array | None = None,
    cache: KVCache | None = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
) -> Array | tuple[Array, ...]:
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
        Broadcastable to (B…, H, Tq, Tk); bool **True = attend** (as
        :func:`~polyattn.scaled_dot_product_attention`), or float added.
        ``torch.nn.MultiheadAttention``'s boolean ``attn_mask`` means the
        opposite (True = ignore): pass its logical negation.
    key_padding_mask : array (B…, Tk), optional
        Keys to ignore, **as torch's** ``key_padding_mask``: bool True = ignore
        the key (padding), or float added to the scores. Combined with
        ``attn_mask`` when both are given.
    is_causal, implementation, window, softcap, alibi_slopes, dropout_p, dropout_seed
        As in :func:`~polyattn.scaled_dot_product_attention`, applied to the
        projected heads (``alibi_slopes`` has one slope per query head; the
        dropout mask is drawn over the (B…, H, Tq, Tk) weights of the heads).
    causal_alignment : {"top_left", "bottom_right"}, optional
        As in :func:`~polyattn.scaled_dot_product_attention`. Default
        ``"top_left"``, and ``"bottom_right"`` with a ``cache`` (the new
        queries are the last tokens of each row).
    key_lengths : integer array (B…,) or int, optional
        How many of this call's keys exist in each batch row (the first
        ones; keys after them are padding). With a ``cache``: how many of
        the new tokens each row appends (:meth:`KVCache.update`'s
        ``lengths``; a ragged, right-padded batch of prompts); attention then
        runs over the cache's lengths, and with the default
        ``"bottom_right"`` alignment and ``is_causal=True`` each row's real
        queries sit right after that row's past (the positions the rotary
        embedding uses), whether the cache was empty or not.
    need_weights : bool
        Also return the attention weights.
    average_attn_weights : bool
        With ``need_weights``: the weights averaged over heads (B…, Tq, Tk)
        (default), or per head (B…, H, Tq, Tk) with False, as torch.
    rotary : mapping, optional
        Apply the rotary position embedding (RoPE) to the projected queries
        and keys, before they are cached: a mapping of
        :func:`~polyattn.apply_rotary_embedding`'s options ``base``,
        ``interleaved``, ``rotary_dim`` (``{}`` for the defaults; e.g.
        ``{"base": 100000.0}``). Needs self-attention shapes (Tq == Tk): the
        key of token ``t`` is rotated by the position of query ``t``.
    positions : integer array (B…, Tq) or (Tq,), optional
        The tokens' positions for ``rotary``. Default: ``0 … Tq-1``, or with
        a ``cache`` ``cache.lengths[b] + 0 … Tq-1`` (the cache's lengths
        before this call's tokens are appended: right after each row's
        past).
    cache : KVCache, optional
        Keys and values of earlier calls, (B…, Hkv, capacity, E) with B…
        the batch dimensions of ``key`` and ``value``. This call's projected
        (and rotated) keys and values are appended (:meth:`KVCache.update`),
        and the queries attend over the whole cache with
        ``key_lengths=cache.lengths``: causal decoding is
        ``is_causal=True`` with the default ``"bottom_right"`` alignment.
        ``key_padding_mask`` cannot be combined with it (pass
        ``key_lengths``); an ``attn_mask`` broadcasts to
        (B…, H, Tq, capacity).

    Returns
    -------
    out : array (B…, Tq, d_model)
    weights : array (B…, Tq, Tk) or (B…, H, Tq, Tk)
        Only with ``need_weights=True`` (Tk is the capacity with a cache).
    cache : KVCache
        Only with ``cache``: the updated cache, last in the tuple:
        ``(out, cache)``, or ``(out, weights, cache)`` with ``need_weights``.
        It is the cache passed in, updated in place, on NumPy, CuPy, torch
        and array-api-strict, and a new one on JAX and Dask.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import MultiHeadAttention, multi_head_attention
    >>> mha = MultiHeadAttention(16, 4, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 16))  # (B, T, d_model)
    >>> out, w = multi_head_attention(x, x, x, mha.params, num_heads=4, need_weights=True)
    >>> out.shape, w.shape
    ((2, 5, 16), (2, 5, 5))

    Padding as torch writes it (True = ignore), weights per head:

    >>> pad = np.array([[False] * 5, [False, False, False, True, True]])   # (B, Tk)
    >>> out, w = multi_head_attention(x, x, x, mha.params, num_heads=4, key_padding_mask=pad,
    ...                               need_weights=True, average_attn_weights=False)
    >>> w.shape, float(w[1, :, :, 3:].max())
    ((2, 4, 5, 5), 0.0)

    Decoding with rotary embeddings and a cache: the prompt, then one token
    at a time (the output of each step equals that of a causal call over the
    whole sequence):

    >>> from polyattn import KVCache
    >>> cache = KVCache((2,), 4, 32, 4)                      # B, Hkv, capacity, E
    >>> out, cache = multi_head_attention(x, x, x, mha.params, num_heads=4, is_causal=True,
    ...                                   rotary={"base": 10000.0}, cache=cache)
    >>> token = x[:, -1:]                                       # (B, 1, d_model)
    >>> out, cache = multi_head_attention(token, token, token, mha.params, num_heads=4,
    ...                                   is_causal=True, rotary={}, cache=cache)
    >>> out.shape, cache.lengths
    ((2, 1, 16), array([6, 6]))
    """
    with quiet_floating_point(query):     # non-finite inputs: the values say so, no warning
        arrays = {"query": query, "key": key, "value": value, "attn_mask": attn_mask,
                  "key_padding_mask": key_padding_mask, "alibi_slopes": alibi_slopes,
                  "positions": positions}
        arrays.update({f"params['{k}']": v for k, v in (params.items()
                                                        if isinstance(params, Mapping) else ())})
        xp = namespace_of(arrays)
        check_same_device(arrays)
        check_bool("need_weights", need_weights)
        check_bool("average_attn_weights", average_attn_weights)
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

        if cache is not None:
            _check_cache(cache, key, value, hkv, d_model // h)
            if key_padding_mask is not None:
                raise ValueError("`key_padding_mask` cannot be combined with `cache` (its keys "
                                 "are the cache's); pass `key_lengths`, the number of real new "
                                 "tokens per row")
        if causal_alignment is None:
            causal_alignment = "top_left" if cache is None else "bottom_right"
        if key_padding_mask is not None:
            padding = _padding_to_attn_mask(key_padding_mask, key, xp)
            attn_mask = _combine_masks(attn_mask, padding, xp)

        q = _project(query, params["w_q"], params.get("b_q"), h, xp)      # (B…, Tq, H, E)
        k = _project(key, params["w_k"], params.get("b_k"), hkv, xp)      # (B…, Tk, Hkv, E)
        v = _project(value, params["w_v"], params.get("b_v"), hkv, xp)    # (B…, Tk, Hkv, Ev)
        if rotary is not None:
            options = _rotary_options(rotary)
            p = _positions(positions, query, key, cache, xp)             # (B…, Tq) or (Tq,)
            p = xp.expand_dims(p, axis=-1)                                # (…, Tq, 1): all heads
            q = apply_rotary_embedding(q, p, **options)
            k = apply_rotary_embedding(k, p, **options)
        elif positions is not None:
            raise ValueError("`positions` are the positions of the rotary embedding; pass "
                             "`rotary` (e.g. rotary={} for its defaults) or leave them out")
        attend: dict[str, Any] = dict(
            attn_mask=attn_mask, is_causal=is_causal, causal_alignment=causal_alignment,
            enable_gqa=hkv != h, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
            key_lengths=key_lengths, dropout_p=dropout_p, dropout_seed=dropout_seed)
        layout = "BTHE"
        if cache is not None:
            ragged = None
            if key_lengths is not None and causal_alignment == "bottom_right":
                # checked before the cache is written to
                ragged = _ragged_lengths(cache.lengths, int(q.shape[-3]), cache, is_causal,
                                         window, alibi_slopes, xp)
            cache = cache.update(_swap(k, xp), _swap(v, xp), lengths=key_lengths)
            q, k, v = _swap(q, xp), cache.keys, cache.values             # (B…, H|Hkv, T, E)
            attend["key_lengths"] = cache.lengths if ragged is None else ragged
            layout = "BHTE"
        if need_weights:
            alpha = attention_weights(q, k, layout=layout, **attend)     # (B…, H, Tq, Tk)
            vh = v if layout == "BHTE" else _swap(v, xp)                  # (B…, Hkv, Tk, Ev)
            if hkv != h:
                vh = _repeat_heads(vh, h // hkv, xp)
            heads = _swap(xp.matmul(alpha, xp.astype(vh, alpha.dtype)), xp)   # (B…, Tq, H, Ev)
        else:
            heads = scaled_dot_product_attention(q, k, v, implementation=implementation,
                                                 layout=layout, **attend)
            if layout == "BHTE":
                heads = _swap(heads, xp)                                  # (B…, Tq, H, Ev)
        heads = xp.reshape(heads, (*heads.shape[:-2], heads.shape[-2] * heads.shape[-1]))
        out = xp.matmul(heads, params["w_o"])                              # (B…, Tq, d_model)
        if params.get("b_o") is not None:
            out = out + params["b_o"]
        result: tuple[Array, ...] = (out,)
        if need_weights:
            result += (xp.mean(alpha, axis=-3) if average_attn_weights else alpha,)
        if cache is not None:
            result += (cache,)
        return result[0] if len(result) == 1 else result


def _ragged_lengths(before: Array, tq: int, cache: KVCache, is_causal: bool, window: Any,
                    alibi_slopes: Any, xp: Any) -> Array | None:
    """Key lengths that put a ragged append's queries at ``before[b] + i``.

    Row ``b`` appended only ``key_lengths[b] <= Tq`` of its ``Tq`` tokens, which
    sit at positions ``before[b] + i`` (where the rotary embedding put them).
    Bottom-right alignment places query ``i`` at ``L - Tq + i`` for key length
    ``L``, so attention runs with ``L = before + Tq``: under a causal mask a
    real query ``i < key_lengths[b]`` sees keys up to ``before[b] + i``, all of
    them stored, and the slots after the row's new length stay out of its
    sight (only the padding queries, whose outputs are padding, reach them).
    ``None``: without a causal mask positions matter to nothing here, and the
    cache's own lengths apply.
    """
    if not is_causal:
        if window is not None or alibi_slopes is not None:
            raise ValueError(
                "a ragged append (`key_lengths` with a `cache`) without is_causal=True cannot "
                "place its queries for `window` or `alibi_slopes`: bottom-right positions "
                "would follow each row's new length, not where its tokens are; append the "
                "rows separately, or pass is_causal=True")
        return None
    lengths = before + tq                                             # a new array
    values = concrete_values(lengths)
    if values is not None and values.size and int(values.max()) > cache.capacity:
        raise ValueError(
            f"a ragged append of Tq = {tq} tokens into a `cache` of capacity "
            f"{cache.capacity} needs room for all {tq} in every row (its queries are "
            f"placed as if every row appended them); rows hold up to "
            f"{int(values.max()) - tq} tokens; allocate a larger cache")
    return xp.clip(lengths, max=cache.capacity) if values is None else lengths


def _check_cache(cache: object, key: Array, value: Array, hkv: int, e: int) -> None:
    """``TypeError``/``ValueError`` unless ``cache`` takes this call's projected keys and values."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"`cache` must be a polyattn.KVCache; got {type(cache).__name__}")
    batch = tuple(key.shape[:-2])
    if (cache.batch_shape, cache.num_kv_heads, cache.head_dim) != (batch, hkv, e) or \
            tuple(value.shape[:-2]) != batch:
        raise ValueError(
            f"`cache` holds batch dimensions {cache.batch_shape}, {cache.num_kv_heads} "
            f"key/value heads of {cache.head_dim} features, but this call has batch "
            f"dimensions {batch} (key {shape_str(key)}, value {shape_str(value)}), "
            f"num_kv_heads={hkv} and head_dim={e}; create it as "
            f"KVCache({batch}, {hkv}, capacity, {e})")


def _rotary_options(rotary: object) -> dict[str, Any]:
    """``rotary`` checked to be a mapping of :func:`apply_rotary_embedding`'s options."""
    if not isinstance(rotary, Mapping):
        raise TypeError(f"`rotary` must be a mapping of the rotary embedding's options "
                        f"{ROTARY_OPTIONS} (e.g. {{'base': 10000.0}}, or {{}} for the "
                        f"defaults); got {type(rotary).__name__}")
    unknown = sorted(set(rotary) - set(ROTARY_OPTIONS))
    if unknown:
        raise ValueError(f"`rotary` has unknown options {unknown} (known: {ROTARY_OPTIONS})")
    return dict(rotary)


def _positions(positions: Array | None, query: Array, key: Array, cache: KVCache | None,
               xp: Namespace) -> Array:
    """The tokens' positions for the rotary embedding: (B…, Tq) or (Tq,)."""
    tq, tk = int(query.shape[-2]), int(key.shape[-2])
    if tq != tk:
        raise ValueError(f"`rotary` rotates each key by the position of the query of the "
                         f"same token, so it needs as many keys as queries; got Tq = {tq}, "
                         f"Tk = {tk} (query {shape_str(query)}, key {shape_str(key)})")
    if positions is None:
        if cache is None:
            return xp.arange(tq, device=device_of(query))                     # (Tq,)
        lengths = cache.lengths
        i = xp.arange(tq, dtype=lengths.dtype, device=device_of(lengths))    # (Tq,)
        return xp.expand_dims(lengths, axis=-1) + i                           # (B…, Tq)
    target = (*query.shape[:-2], tq)
    fits = positions.ndim <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(positions.shape), reversed(target), strict=False))
    if not fits:
        raise ValueError(f"`positions` must broadcast to (B…, Tq) = {tuple(target)} (one "
                         f"position per query token); got shape {shape_str(positions)}")
    return positions


def _swap(x: Array, xp: Namespace) -> Array:
    """(…, A, B, F) -> (…, B, A, F): between (B…, T, H, F) and (B…, H, T, F)."""
    nd = x.ndim
    return xp.permute_dims(x, (*range(nd - 3), nd - 2, nd - 3, nd - 1))


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
    batch_first : bool
        True (default): inputs are (B…, T, features). False: they are
        (T, B, features), as a ``torch.nn.MultiheadAttention`` built with
        ``batch_first=False`` (torch's default) takes them; the output
        follows the input, the weights stay (B, Tq, Tk) (as torch).
    xp, dtype, device : optional
        Where the parameters are created: default NumPy, **float32** (as
        torch's modules; pass ``dtype`` for float64). A float64 input with
        float32 parameters computes in float64 (the standard's promotion),
        never downcast.
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
                 batch_first: bool = True, xp: Namespace = None, dtype: Any = None,
                 device: Any = None, seed: int | None = None) -> None:
        import numpy as np

        embed_dim = check_nonnegative_int("embed_dim", embed_dim, minimum=1)
        self.num_heads, self.num_kv_heads = _check_heads(embed_dim, num_heads, num_kv_heads)
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else check_nonnegative_int("kdim", kdim, minimum=1)
        self.vdim = embed_dim if vdim is None else check_nonnegative_int("vdim", vdim, minimum=1)
        check_bool("bias", bias)
        self.batch_first = check_bool("batch_first", batch_first)
        xp = resolve_xp(xp)
        dtype = xp.float32 if dtype is None else check_float_dtype("dtype", dtype, xp)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise TypeError(f"`seed` must be an int or None; got {type(seed).__name__} {seed!r}")
        if seed is not None and seed < 0:
            raise ValueError(f"`seed` must be a non-negative int or None; got {seed}")
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
                 /, **options: Any) -> Array | tuple[Array, ...]:
        """Attend: ``key`` defaults to ``query`` (self-attention), ``value`` to ``key``.

        Keywords are those of :func:`multi_head_attention` (``attn_mask``,
        ``key_padding_mask``, ``is_causal``, ``causal_alignment``,
        ``need_weights``, ``average_attn_weights``, ``implementation``,
        ``window``, ``softcap``, ``alibi_slopes``, ``key_lengths``,
        ``rotary``, ``positions``, ``cache``, ``dropout_p``, ``dropout_seed``),
        and so is the result.
        With ``batch_first=False``, 3-D inputs are (T, B, features) and so is
        the output.
        """
        key = query if key is None else key
        value = key if value is None else value
        self._check_library(query)
        if not self.batch_first:
            return self._call_time_first(query, key, value, options)
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

    def _check_library(self, query: Array) -> None:
        """``TypeError`` with the fix when the inputs' library is not the parameters'."""
        if not is_array(query):
            return
        ours = namespace_of({"params['w_q']": self.params["w_q"]})
        theirs = namespace_of({"query": query})
        if ours is not theirs:
            raise TypeError(
                f"`query` is a {library_name(theirs)} array but this module's parameters are "
                f"{library_name(ours)} arrays; create or load them in that library, e.g. "
                f"MultiHeadAttention(..., xp={_module_path(library_name(theirs))}) or "
                f"MultiHeadAttention.from_torch(module, xp=torch)")

    def _call_time_first(self, query: Array, key: Array, value: Array,
                         options: dict[str, Any]) -> Array | tuple[Array, ...]:
        """``batch_first=False``: (T, B, F) inputs viewed as (B, T, F), the output back."""
        named = (("query", query), ("key", key), ("value", value))
        ndims = {getattr(x, "ndim", None) for _, x in named}
        if ndims == {2}:                                   # unbatched (T, F): nothing to swap
            return MultiHeadAttention.__call__(_batch_first_view(self), query, key, value,
                                               **options)
        if ndims != {3}:
            shapes = ", ".join(f"{n} {shape_str(x)}" for n, x in named)
            raise ValueError(f"with batch_first=False the inputs must all be (T, B, features) "
                             f"or all (T, features); got {shapes}")
        xp = namespace_of(dict(named))
        swapped = [xp.permute_dims(x, (1, 0, 2)) for _, x in named]   # (B, T, F)
        result = MultiHeadAttention.__call__(_batch_first_view(self), *swapped, **options)
        if isinstance(result, tuple):
            out, *rest = result                                       # weights, cache: as given
            return (xp.permute_dims(out, (1, 0, 2)), *rest)           # (Tq, B, d_model), …
        return xp.permute_dims(result, (1, 0, 2))                      # (Tq, B, d_model)

    def __repr__(self) -> str:
        return (f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"bias={'b_q' in self.params}, batch_first={self.batch_first})")

    @classmethod
    def from_torch(cls, module: Any, *, xp: Namespace = None, dtype: Any = None,
                   device: Any = None) -> MultiHeadAttention:
        """Load the weights of a ``torch.nn.MultiheadAttention``.

        Packed (``in_proj_weight``) and separate (``q_proj_weight`` …)
        projections are both read; torch's ``y = x Wᵀ + b`` becomes
        ``y = x @ w + b`` with ``w = Wᵀ``. The parameters land in ``xp``
        (default NumPy) with ``dtype`` (default: the module's precision).
        ``module.batch_first`` is kept: a module built with
        ``batch_first=False`` (torch's default) takes (T, B, E) inputs here
        too. Modules with ``add_bias_kv`` or ``add_zero_attn`` are not
        supported. Dropout is not applied (inference semantics). The
        parameters are new arrays: with ``xp=torch`` they are tensors that do
        not require grad; call ``p.requires_grad_()`` on each of
        ``mha.params.values()`` to train them. torch's
        boolean masks mean True = ignore: pass ``key_padding_mask`` as it is
        (same meaning here) and ``attn_mask`` negated.

        Examples
        --------
        >>> import torch                                     # doctest: +SKIP
        >>> m = torch.nn.MultiheadAttention(8, 2, batch_first=True)  # doctest: +SKIP
        >>> mha = MultiHeadAttention.from_torch(m)           # doctest: +SKIP
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
        self = cls.__new__(cls)
        self.embed_dim, self.num_heads = d, int(module.num_heads)
        self.num_kv_heads = self.num_heads
        self.kdim, self.vdim = int(module.kdim), int(module.vdim)
        self.batch_first = bool(getattr(module, "batch_first", False))
        xp_resolved = resolve_xp(xp)
        if dtype is None:
            dtype = xp_resolved.float64 if wq.dtype == np.float64 else xp_resolved.float32
        else:
            check_float_dtype("dtype", dtype, xp_resolved)
        self.params = _to_namespace(params, xp, dtype, device)
        return self


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


def _batch_first_view(module: MultiHeadAttention) -> MultiHeadAttention:
    """The same parameters, called with batch-first inputs."""
    view = copy.copy(module)
    view.batch_first = True
    return view


def _to_namespace(host: dict[str, Any], xp: Namespace, dtype: Any, device: Any) -> dict[str, Array]:
    """Copy NumPy parameters into ``xp`` with ``dtype`` on ``device``."""
    import numpy as np

    xp = resolve_xp(xp)
    if dtype is None:
        dtype = default_float_dtype(xp, device)
    return {k: xp.asarray(np.ascontiguousarray(v), dtype=dtype, device=device)
            for k, v in host.items()}


def _module_path(library: str) -> str:
    """The module a user passes as ``xp`` for a library (``dask`` -> ``dask.array``)."""
    return {"jax": "jax.numpy", "dask": "dask.array"}.get(library, library)
