""":func:`multi_head_attention`, the functional form: project, attend per head, project back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyattn._interop import Array, check_same_device, namespace_of
from polyattn._validation import (
    IMPLEMENTATIONS,
    broadcast_shapes,
    check_bool,
    check_choice,
    check_floating,
    check_min_ndim,
    shape_str,
)
from polyattn.attention import attention_weights, scaled_dot_product_attention
from polyattn.cache import KVCache
from polyattn.multihead.arguments import (
    _check_cache,
    _check_heads,
    _check_params,
    _positions,
    _ragged_lengths,
    _rotary_options,
)
from polyattn.multihead.heads import (
    _combine_masks,
    _padding_to_attn_mask,
    _project,
    _repeat_heads,
    _swap,
)
from polyattn.multihead.weights import BIASES, EXTRAS, WEIGHTS
from polyattn.rotary import apply_rotary_embedding
from polyattn.rules.online import quiet_floating_point


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
    segment_ids: Array | tuple[Array, Array] | None = None,
    score_mod: Any = None, mask_mod: Any = None, mod_args: tuple[Array, ...] = (),
    block_mask: Any = None,
) -> Array | tuple[Array, ...]:
    """Multi-head attention with explicit parameters (functional form).

    Parameters
    ----------
    query : array (B…, Tq, d_model)
    key : array (B…, Tk, kdim)
    value : array (B…, Tk, vdim)
    params : mapping
        ``w_q``, ``w_k``, ``w_v``, ``w_o`` and optional ``b_q``, ``b_k``,
        ``b_v``, ``b_o``, laid out as in the module docstring (``x @ w``);
        optional ``sinks`` (H,): attention sinks, one learned logit per query
        head (gpt-oss; ``sinks`` of
        :func:`~polyattn.scaled_dot_product_attention`), differentiable
        like the other parameters where the library differentiates.
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
    is_causal, implementation, window, softcap, alibi_slopes, dropout_p, dropout_seed, \
segment_ids, score_mod, mask_mod, mod_args, block_mask
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
        for name in (*WEIGHTS, *BIASES, *EXTRAS):
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
            key_lengths=key_lengths, dropout_p=dropout_p, dropout_seed=dropout_seed,
            sinks=params.get("sinks"), segment_ids=segment_ids, score_mod=score_mod,
            mask_mod=mask_mod, mod_args=mod_args, block_mask=block_mask)
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
