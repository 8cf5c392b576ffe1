"""A Llama-architecture decoder in Array API code, with a key/value cache.

Each layer: RMSNorm → grouped-query self-attention → residual, then RMSNorm
→ SwiGLU feed-forward → residual; a final RMSNorm and logits from
``lm_head``. The attention of each layer is
:func:`polyattn.scaled_dot_product_attention` with ``enable_gqa=True``;
positions come from :func:`polyattn.apply_rotary_embedding` (split halves,
``config.rope_base``) and the past keys and values of decoding live in one
:class:`polyattn.KVCache` per layer (:class:`~polyattn.models._decoder_blocks.Cache`).

A batch is **right-padded**: row ``b``'s tokens sit at positions ``0 …
lengths[b] - 1`` and the padding after them is hidden by ``key_lengths``;
with a cache, each row's tokens are appended at that row's own length.

Shapes: ``B`` sequences, ``T`` tokens, ``D`` features, ``H`` query heads,
``Hkv`` key/value heads, ``E`` features per head, ``F`` feed-forward
features, ``V`` tokens in the vocabulary, ``C`` the cache's capacity.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import polyattn
from polyattn._interop import array_namespace, device_of, library_name
from polyattn._validation import check_nonnegative_int
from polyattn.models._bpe import BPETokenizer
from polyattn.models._decoder_blocks import (
    Cache,
    _index_dtype,
    _plural,
    _size_text,
    _to_numpy,
    rms_norm,
    silu,
)
from polyattn.models._gguf_checks import LlamaConfig

Array = Any
Namespace = Any


class Decoder:
    """A Llama-architecture decoder on the arrays of one Array API namespace.

    ``params``, ``config`` and ``tokenizer`` are those described in
    :class:`polyattn.models.smollm2.SmolLM2`; this class holds the network,
    its inputs' checks and its cache; :class:`polyattn.models._generation.CausalLM`
    adds generation.
    """

    def __init__(self, params: dict[str, Any], config: LlamaConfig,
                 tokenizer: BPETokenizer) -> None:
        self.params = params
        self.config = config
        self.tokenizer = tokenizer
        self.xp = array_namespace(params["embed"])
        self.device = device_of(params["embed"])
        self.dtype = params["embed"].dtype
        self._int = _index_dtype(self.xp, self.device)

    def __repr__(self) -> str:
        c = self.config
        return (f"{type(self).__name__}({c.num_layers} layers, "
                f"{c.num_heads}/{c.num_kv_heads} heads, {library_name(self.xp)} {self.dtype})")

    # -- inputs ------------------------------------------------------------

    def _ids(self, token_ids: Any) -> Array:
        """Token ids as an integer array (B, T) of the model's namespace and device.

        Checked: integers, (T,) or (B, T) with T >= 1, every id in [0, V).
        """
        xp = self.xp
        host: np.ndarray | None = None
        if hasattr(token_ids, "shape") and hasattr(token_ids, "dtype") and not isinstance(
                token_ids, np.ndarray):
            ids = token_ids
            lib = library_name(array_namespace(ids))
            if lib != library_name(xp):
                raise TypeError(f"`token_ids` is a {lib} array but the model holds "
                                f"{library_name(xp)} arrays; pass a list, a NumPy array or "
                                f"a {library_name(xp)} array")
        else:
            try:
                host = np.asarray(token_ids)
            except ValueError as exc:
                raise ValueError(
                    "`token_ids` must be rectangular, (T,) or (B, T); got rows of different "
                    "lengths. Right-pad the rows to one length and pass `lengths=` (the real "
                    "tokens per row), or use generate(), which takes prompts of different "
                    "lengths") from exc
            if host.size and not np.issubdtype(host.dtype, np.integer):
                raise TypeError(f"`token_ids` must be integers; got dtype {host.dtype}")
            ids = xp.asarray(host.astype(np.int64), dtype=self._int, device=self.device)
        if not xp.isdtype(ids.dtype, "integral"):
            raise TypeError(f"`token_ids` must be integers; got dtype {ids.dtype}")
        if ids.ndim not in (1, 2) or ids.shape[-1] == 0 or (ids.ndim == 2 and ids.shape[0] == 0):
            raise ValueError(f"`token_ids` must be (T,) or (B, T) with B, T >= 1; got shape "
                             f"{tuple(ids.shape)}")
        self._check_range(host if host is not None else ids)
        return ids if ids.ndim == 2 else xp.reshape(ids, (1, ids.shape[0]))

    def _check_range(self, ids: Array) -> None:
        """Every id in [0, V); on the host, or by two reductions where the values are at hand."""
        xp = np if isinstance(ids, np.ndarray) else self.xp
        try:
            low, high = int(xp.min(ids)), int(xp.max(ids))
        except TypeError:           # traced (inside jax.jit): the values are not at hand
            return
        vocab = self.config.vocab_size
        if low < 0 or high >= vocab:
            raise ValueError(f"`token_ids` must lie in [0, {vocab}) (the vocabulary); got "
                             f"{low if low < 0 else high}")

    def _lengths(self, lengths: Any, b: int, t: int) -> Array | None:
        if lengths is None:
            return None
        host = np.asarray(_to_numpy(lengths) if not isinstance(lengths, (list, tuple, int))
                          else lengths)
        if host.shape not in ((b,), ()) or not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"`lengths` must be integers of shape ({b},), one per row of "
                             f"`token_ids`; got {host!r}")
        if host.min() < 1 or host.max() > t:
            raise ValueError(f"`lengths` must lie in [1, T] = [1, {t}]; got {host.tolist()}")
        return self.xp.asarray(np.broadcast_to(host, (b,)).astype(np.int64), dtype=self._int,
                               device=self.device)

    def cache_nbytes(self, batch_size: int, capacity: int) -> int:
        """Bytes the keys and values of :meth:`new_cache` ``(batch_size, capacity)`` take.

        Every layer holds keys and values of ``batch_size · Hkv · capacity ·
        E`` numbers in the model's dtype (a few bytes more hold the lengths).
        Nothing is allocated, and the context is not checked, so the size of
        a cache that would be refused can be told.

        Raises
        ------
        TypeError
            ``batch_size`` or ``capacity`` is not an integer.
        ValueError
            Either is below 1.

        Examples
        --------
        >>> from polyattn.models import smollm2
        >>> model = smollm2.load()                                  # doctest: +SKIP
        >>> model.cache_nbytes(1, 8192)                             # doctest: +SKIP
        377487360
        """
        b = check_nonnegative_int("batch_size", batch_size, minimum=1)
        n = check_nonnegative_int("capacity", capacity, minimum=1)
        c = self.config
        itemsize = self.xp.finfo(self.dtype).bits // 8
        return c.num_layers * 2 * b * c.num_kv_heads * n * c.head_dim * itemsize

    def _too_long(self, what: str, tokens: int, fix: str, *, rows: int | None = None
                  ) -> ValueError:
        """The error for ``tokens`` per row beyond the context; with ``rows``, the memory
        a cache of that many rows would take."""
        ctx = self.config.context_length
        memory = "" if rows is None else (
            f"; a cache for them would take {_size_text(self.cache_nbytes(rows, tokens))} "
            f"({_plural(rows, 'row')}, {self.dtype})")
        return ValueError(f"{what} {tokens} tokens, more than the model's context of {ctx} "
                          f"tokens{memory}; {fix}")

    def new_cache(self, batch_size: int, capacity: int) -> Cache:
        """An empty cache for ``batch_size`` sequences of up to ``capacity`` tokens each.

        Raises
        ------
        TypeError
            ``batch_size`` or ``capacity`` is not an integer.
        ValueError
            Either is below 1, or ``capacity`` is more than the model's
            context (``config.context_length``); the message gives the memory
            the cache would take.
        """
        b = check_nonnegative_int("batch_size", batch_size, minimum=1)
        n = check_nonnegative_int("capacity", capacity, minimum=1)
        ctx = self.config.context_length
        if n > ctx:
            raise self._too_long("`capacity` asks for", n, f"ask for at most {ctx}", rows=b)
        c = self.config
        try:
            return Cache([polyattn.KVCache((b,), c.num_kv_heads, n, c.head_dim,
                                           xp=self.xp, dtype=self.dtype, device=self.device)
                          for _ in range(c.num_layers)])
        except MemoryError as exc:
            raise MemoryError(
                f"a cache of `batch_size` {b} x `capacity` {n} tokens needs "
                f"{_size_text(self.cache_nbytes(b, n))} and could not be allocated; ask for fewer "
                f"rows or tokens ({exc})") from None

    # -- the network -------------------------------------------------------

    def __call__(self, token_ids: Any, cache: Cache | None = None, *,
                 lengths: Any = None) -> Array:
        """Next-token logits for every position of ``token_ids``.

        Parameters
        ----------
        token_ids : integer array or nested list, (T,) or (B, T)
            The tokens; rows of a batch right-padded to one length (any
            token id will do as padding).
        cache : Cache, optional
            Past tokens (from :meth:`new_cache`). Row ``b``'s tokens take the
            positions ``cache.lengths[b] …`` and are appended to it, so
            calling the model on a prompt and then on one token at a time
            gives the logits of calling it once on the whole sequence.
            Without a cache the tokens start at position 0.
        lengths : integer (B,), optional
            Real tokens per row (the rest is padding, which no token attends
            to and which is not stored in the cache). Default: all T.

        Returns
        -------
        array (B, T, V) or (T, V)
            Logits in the model's dtype; those at padding positions mean
            nothing.

        Raises
        ------
        ValueError
            ``T`` is more than the model's context (``config.context_length``)
            without a cache, or the cache has room for more than the context
            (one made with :meth:`new_cache` never has).
        """
        ids = self._ids(token_ids)
        hidden = self._hidden(ids, cache, lengths)
        logits = hidden @ self.params["lm_head"]                        # (B, T, V)
        ndim = token_ids.ndim if hasattr(token_ids, "ndim") else np.ndim(token_ids)
        if ndim == 1:
            return logits[0, ...]                                       # (T, V)
        return logits

    def hidden_states(self, token_ids: Any, cache: Cache | None = None, *,
                      lengths: Any = None) -> Array:
        """The final normalised hidden states (B, T, D); see :meth:`__call__`."""
        return self._hidden(self._ids(token_ids), cache, lengths)

    def _hidden(self, ids: Array, cache: Cache | None, lengths: Any) -> Array:
        """:meth:`hidden_states` of checked ids (B, T)."""
        xp, c = self.xp, self.config
        b, t = ids.shape
        self._check_context(t, cache)
        key_lengths = self._lengths(lengths, b, t)
        flat = xp.reshape(ids, (b * t,))
        x = xp.take(self.params["embed"], flat, axis=0)                 # (B·T, D)
        steps = xp.arange(t, dtype=self._int, device=self.device)       # (T,)
        mask = None
        if cache is None:
            positions = xp.reshape(steps, (1, 1, t))                    # (1, 1, T)
        else:
            if cache.lengths.shape != (b,):
                raise ValueError(f"`cache` holds {cache.lengths.shape[0]} rows but "
                                 f"`token_ids` has {b}")
            start = xp.reshape(cache.lengths, (b, 1)) + steps           # (B, T)
            positions = xp.reshape(start, (b, 1, t))                    # (B, 1, T)
            if key_lengths is not None:
                # ragged rows: row b's token i is at start[b] + i, key j visible iff j <= it
                slots = xp.arange(cache.capacity, dtype=self._int, device=self.device)
                mask = slots <= xp.reshape(start, (b, 1, t, 1))         # (B, 1, T, C)
        for i in range(c.num_layers):
            x = self._layer(i, x, b, t, positions, cache, key_lengths, mask)
        x = rms_norm(x, self.params["norm"], eps=c.rms_norm_eps)
        return xp.reshape(x, (b, t, c.hidden_size))                     # (B, T, D)

    def _check_context(self, t: int, cache: Cache | None) -> None:
        """``T`` tokens per row fit the context (without a cache), or the cache does."""
        ctx = self.config.context_length
        if cache is None and t > ctx:
            raise self._too_long("`token_ids` has", t,
                                 f"pass at most {ctx} tokens per row (e.g. the last {ctx})")
        if cache is not None and cache.capacity > ctx:
            raise self._too_long("`cache` has room for", cache.capacity,
                                 "make it with new_cache(), which keeps to the context")

    def _project_qkv(self, i: int, h: Array, b: int, t: int, positions: Array
                     ) -> tuple[Array, Array, Array]:
        """Queries (B, H, T, E), keys and values (B, Hkv, T, E), RoPE applied."""
        xp, c = self.xp, self.config
        e, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        qkv = h @ self.params["layers"][i]["w_qkv"]                     # (B·T, (H+2Hkv)·E)
        qkv = xp.reshape(qkv, (b, t, nh + 2 * nkv, e))                  # (B, T, H+2Hkv, E)
        qkv = xp.permute_dims(qkv, (0, 2, 1, 3))                        # (B, H+2Hkv, T, E)
        # queries and keys rotated in one call: the same positions for every head
        qk = polyattn.apply_rotary_embedding(qkv[:, :nh + nkv, ...], positions,
                                             base=c.rope_base)          # (B, H+Hkv, T, E)
        q = qk[:, :nh, ...]                                             # (B, H, T, E)
        k = qk[:, nh:, ...]                                             # (B, Hkv, T, E)
        v = qkv[:, nh + nkv:, ...]                                      # (B, Hkv, T, E)
        return q, k, v

    def _layer(self, i: int, x: Array, b: int, t: int, positions: Array,
               cache: Cache | None, key_lengths: Array | None, mask: Array | None) -> Array:
        """Decoder layer ``i`` on the residual stream x (B·T, D)."""
        xp, c = self.xp, self.config
        lp = self.params["layers"][i]
        h = rms_norm(x, lp["attn_norm"], eps=c.rms_norm_eps)
        q, k, v = self._project_qkv(i, h, b, t, positions)
        if cache is None:
            out = polyattn.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True, key_lengths=key_lengths)
        else:
            kv = cache.layers[i].update(k, v, lengths=key_lengths)
            cache.layers[i] = kv
            if mask is None:        # every row appended all T: they are its last T keys
                out = polyattn.scaled_dot_product_attention(
                    q, kv.keys, kv.values, is_causal=True, causal_alignment="bottom_right",
                    enable_gqa=True, key_lengths=kv.lengths)
            else:
                out = polyattn.scaled_dot_product_attention(
                    q, kv.keys, kv.values, attn_mask=mask, enable_gqa=True,
                    key_lengths=kv.lengths)                             # (B, H, T, E)
        out = xp.permute_dims(out, (0, 2, 1, 3))                        # (B, T, H, E)
        out = xp.reshape(out, (b * t, c.num_heads * c.head_dim))        # (B·T, H·E)
        x = x + out @ lp["w_o"]
        h = rms_norm(x, lp["ffn_norm"], eps=c.rms_norm_eps)
        gate_up = h @ lp["w_gate_up"]                                   # (B·T, 2F)
        f = c.intermediate_size
        return x + (silu(gate_up[:, :f]) * gate_up[:, f:]) @ lp["w_down"]

    def attention_weights(self, token_ids: Any) -> list[Array]:
        """Every layer's attention weights over one sequence: a list of (H, T, T).

        Row ``i`` of head ``h`` is how much token ``i`` attends to each of
        the tokens ``0 … i`` (causal: the rest are 0).
        """
        xp, c = self.xp, self.config
        ids = self._ids(token_ids)
        if ids.shape[0] != 1:
            raise ValueError(f"`token_ids` must be one sequence, (T,) or (1, T); got shape "
                             f"{tuple(ids.shape)}")
        t = ids.shape[1]
        self._check_context(t, None)
        x = xp.take(self.params["embed"], xp.reshape(ids, (t,)), axis=0)  # (T, D)
        positions = xp.arange(t, dtype=self._int, device=self.device)    # (T,)
        maps = []
        for i in range(c.num_layers):
            h = rms_norm(x, self.params["layers"][i]["attn_norm"], eps=c.rms_norm_eps)
            q, k, _ = self._project_qkv(i, h, 1, t, positions)
            alpha = polyattn.attention_weights(q, k, is_causal=True, enable_gqa=True)
            maps.append(alpha[0, ...])                                  # (H, T, T)
            x = self._layer(i, x, 1, t, xp.reshape(positions, (1, 1, t)), None, None, None)
        return maps
