"""The checks of multi-head attention's arguments, and the positions they imply."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyattn._interop import Array, Namespace, concrete_values, device_of
from polyattn._validation import check_nonnegative_int, shape_str
from polyattn.cache import KVCache
from polyattn.multihead.weights import BIASES, EXTRAS, WEIGHTS

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
    unknown = sorted(set(params) - set(WEIGHTS) - set(BIASES) - set(EXTRAS))
    if unknown:
        raise ValueError(f"`params` has unknown keys {unknown} "
                         f"(known: {WEIGHTS + BIASES + EXTRAS})")
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
        "b_o": (d_model,), "sinks": (h,),
    }
    for name, shape in expected.items():
        p = params.get(name)
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(f"params `{name}` has shape {shape_str(p)}; expected {shape} "
                             f"(d_model={d_model}, kdim={kdim}, vdim={vdim}: the features of "
                             f"query, key and value; num_heads={h}, num_kv_heads={hkv})")
    return ev


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
