"""A decoder of the Llama family in Array API code, with a key/value cache.

Each layer: RMSNorm → grouped-query self-attention → residual, then RMSNorm
→ gated feed-forward network → residual; a final RMSNorm and logits from
``lm_head``. What differs between Llama, SmolLM2, Qwen3, Gemma 2 and 3 and
gpt-oss is described by a :class:`~polyattn.models._decoder_config.DecoderConfig`
(the attention's scale and softcap, each layer's sliding window and rotary
frequencies, the activation or the mixture of experts, the embedding scale
and the final softcap) and by which optional weights the parameters hold
(see :class:`Decoder`).

The attention of each layer is :func:`polyattn.scaled_dot_product_attention`
with ``enable_gqa=True``, and ``window``, ``softcap``, ``scale`` and
``sinks`` where the layer has them; positions come from
:func:`polyattn.apply_rotary_embedding` (split halves; the frequencies of
:func:`polyattn.rotary_frequencies` for scaled RoPE) and the past keys and
values of decoding live in one :class:`polyattn.KVCache` per layer
(:class:`~polyattn.models._decoder_blocks.Cache`).

A batch is **right-padded**: row ``b``'s tokens sit at positions ``0 …
lengths[b] - 1`` and the padding after them is hidden by ``key_lengths``;
with a cache, each row's tokens are appended at that row's own length.

Shapes: ``B`` sequences, ``T`` tokens, ``D`` features, ``H`` query heads,
``Hkv`` key/value heads, ``E`` features per head, ``F`` feed-forward
features, ``X`` experts, ``V`` tokens in the vocabulary, ``C`` the cache's
capacity.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import polyattn
from polyattn._interop import array_namespace, device_of, library_name
from polyattn._validation import check_nonnegative_int
from polyattn.models._decoder_blocks import (
    Cache,
    _index_dtype,
    _plural,
    _size_text,
    _to_numpy,
    gelu_tanh,
    mixture_of_experts,
    rms_norm,
    silu,
)
from polyattn.models._decoder_config import DecoderConfig
from polyattn.models._gguf_checks import LlamaConfig

Array = Any
Namespace = Any


class Decoder:
    """A decoder of the Llama family on the arrays of one Array API namespace.

    This class holds the network, its inputs' checks and its cache;
    :class:`polyattn.models._generation.CausalLM` adds generation.

    Parameters
    ----------
    params : dict
        Arrays of one namespace, device and dtype. Matrices are laid out
        (in, out): ``y = x @ w``. ``"embed"`` (V, D), ``"norm"`` (D,),
        ``"lm_head"`` (D, V) and ``"layers"``, one dict per layer with
        ``"attn_norm"`` (D,), ``"w_qkv"`` (D, (H + 2·Hkv)·E) (queries, keys,
        values side by side), ``"w_o"`` (H·E, D), ``"ffn_norm"`` (D,),
        ``"w_gate_up"`` (D, 2·F) (gate, then up) and ``"w_down"`` (F, D).
        Optional, where the model has them: ``"b_qkv"`` ((H + 2·Hkv)·E,),
        ``"b_o"`` (D,), ``"b_gate_up"`` (2·F,), ``"b_down"`` (D,) biases;
        ``"qk_norm"`` (H + Hkv, 1, E), the RMSNorm weights of each query
        head's and key head's features (QK-norm); ``"sinks"`` (H,), learned
        sink logits; ``"post_attn_norm"`` and ``"post_ffn_norm"`` (D,), the
        norms of the attention's and the feed-forward network's outputs
        (Gemma, whose norms scale by ``1 + w``: ``config.norm_offset``). A mixture
        of experts has instead ``"router"`` (D, X), ``"b_router"`` (X,),
        ``"w_gate_up"`` (X, D, 2·F), ``"b_gate_up"`` (X, 2·F), ``"w_down"``
        (X, F, D) and ``"b_down"`` (X, D).
    config : LlamaConfig or DecoderConfig
        The hyper-parameters; a ``LlamaConfig`` (from a GGUF file) is a
        plain Llama. :attr:`spec` holds the ``DecoderConfig`` either way.
    tokenizer
        An object with ``encode``, ``decode``, ``eos_id``, ``bos_id`` and
        ``pad_id`` (the BPE tokenizer of a GGUF file, or a transformers
        checkpoint's ``tokenizer.json``).
    """

    def __init__(self, params: dict[str, Any], config: LlamaConfig | DecoderConfig,
                 tokenizer: Any) -> None:
        self.params = params
        self.config = config
        self.spec = DecoderConfig.from_llama(config)
        self.tokenizer = tokenizer
        self.xp = array_namespace(params["embed"])
        self.device = device_of(params["embed"])
        self.dtype = params["embed"].dtype
        self._int = _index_dtype(self.xp, self.device)
        self._ropes = self._rotary_tables()

    def _rotary_tables(self) -> dict[str, tuple[Array | None, float, float]]:
        """Each rotary embedding the layers use: its frequencies as an array (float64 for a
        float64 model, else float32, as the angles are computed), or ``None`` and the base."""
        xp, c = self.xp, self.spec
        work = xp.float64 if self.dtype == xp.float64 else xp.float32
        tables: dict[str, tuple[Array | None, float, float]] = {}
        for name in {c.layer(i).rope for i in range(c.num_layers)}:
            rope = c.rope(name)
            inv_freq = (None if rope.inv_freq is None else
                        xp.asarray(list(rope.inv_freq), dtype=work, device=self.device))
            tables[name] = (inv_freq, rope.base, rope.attention_factor)
        return tables

    def __repr__(self) -> str:
        c = self.config
        return (f"{type(self).__name__}({c.num_layers} layers, "
                f"{c.num_heads}/{c.num_kv_heads} heads, {library_name(self.xp)} {self.dtype})")

    # -- inputs ------------------------------------------------------------

    def _ids(self, token_ids: Any, lengths: Any = None) -> Array:
        """Token ids as an integer array (B, T) of the model's namespace, device and index
        dtype.

        Checked: integers, (T,) or (B, T) with T >= 1, every id in [0, V); with
        ``lengths``, only each row's first ``lengths[b]`` ids are checked, and the
        padding after them is replaced by 0 (in a new array: the caller's is not
        touched) so that any value will do. An array of the model's library stays on
        its device (an integer dtype other than the model's index dtype, e.g. uint8,
        is converted); lists and arrays of other libraries are read on the host.
        """
        xp = self.xp
        if self._same_library(token_ids):
            ids = token_ids
            if not xp.isdtype(ids.dtype, "integral"):
                raise TypeError(f"`token_ids` must be integers; got dtype {ids.dtype}")
            self._check_shape(ids.shape)
            if ids.dtype != self._int:
                ids = xp.astype(ids, self._int)
            if ids.ndim == 1:
                ids = xp.reshape(ids, (1, ids.shape[0]))
            host_lengths = self._host_lengths(lengths, *ids.shape)
            if host_lengths is not None:
                valid = xp.asarray(np.arange(ids.shape[1]) < host_lengths[:, None],
                                   device=self.device)                  # (B, T)
                ids = xp.where(valid, ids, xp.zeros_like(ids))
            self._check_range(ids)
            return ids
        try:
            host = np.asarray(token_ids if isinstance(token_ids, (list, tuple, np.ndarray))
                              or not hasattr(token_ids, "shape") else _to_numpy(token_ids))
        except ValueError as exc:
            raise ValueError(
                "`token_ids` must be rectangular, (T,) or (B, T); got rows of different "
                "lengths. Right-pad the rows to one length and pass `lengths=` (the real "
                "tokens per row), or use generate(), which takes prompts of different "
                "lengths") from exc
        if host.size and not np.issubdtype(host.dtype, np.integer):
            raise TypeError(f"`token_ids` must be integers; got dtype {host.dtype}")
        self._check_shape(host.shape)
        host = host.reshape(-1, host.shape[-1])
        host_lengths = self._host_lengths(lengths, *host.shape)
        if host_lengths is not None:
            host = np.where(np.arange(host.shape[1]) < host_lengths[:, None], host, 0)
        self._check_range(host)
        return xp.asarray(host.astype(np.int64), dtype=self._int, device=self.device)

    def _same_library(self, token_ids: Any) -> bool:
        """Whether ``token_ids`` is an array of the model's own library (not NumPy's)."""
        if isinstance(token_ids, np.ndarray) or not (
                hasattr(token_ids, "shape") and hasattr(token_ids, "dtype")):
            return False
        try:
            return library_name(array_namespace(token_ids)) == library_name(self.xp)
        except TypeError:
            return False

    @staticmethod
    def _check_shape(shape: tuple[int, ...]) -> None:
        if len(shape) not in (1, 2) or shape[-1] == 0 or (len(shape) == 2 and shape[0] == 0):
            raise ValueError(f"`token_ids` must be (T,) or (B, T) with B, T >= 1; got shape "
                             f"{tuple(shape)}")

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

    @staticmethod
    def _host_lengths(lengths: Any, b: int, t: int) -> np.ndarray | None:
        """``lengths`` checked, as NumPy int64 (B,); ``None`` for none."""
        if lengths is None:
            return None
        host = np.asarray(_to_numpy(lengths) if not isinstance(lengths, (list, tuple, int))
                          else lengths)
        if host.shape not in ((b,), ()) or not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"`lengths` must be integers of shape ({b},), one per row of "
                             f"`token_ids`; got {host!r}")
        if host.min() < 1 or host.max() > t:
            raise ValueError(f"`lengths` must lie in [1, T] = [1, {t}]; got {host.tolist()}")
        return np.broadcast_to(host, (b,)).astype(np.int64)

    def _lengths(self, lengths: Any, b: int, t: int) -> Array | None:
        host = self._host_lengths(lengths, b, t)
        if host is None:
            return None
        return self.xp.asarray(host, dtype=self._int, device=self.device)

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
            The tokens, of any array library (read on the host unless of the
            model's own) and integer dtype; rows of a batch right-padded to
            one length (with ``lengths``, any integer will do as padding, -1
            too: only each row's first ``lengths[b]`` ids are checked).
        cache : Cache, optional
            Past tokens (from :meth:`new_cache`). Row ``b``'s tokens take the
            positions ``cache.lengths[b] …`` and are appended to it, so
            calling the model on a prompt and then on one token at a time
            gives the logits of calling it once on the whole sequence. The
            cache is updated in place on every library (on JAX, whose arrays
            are immutable, each entry of ``cache.layers`` is replaced).
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
        TypeError
            ``token_ids`` are not integers.
        ValueError
            An id (of the first ``lengths[b]`` of each row) lies outside
            ``[0, V)``; ``T`` is more than the model's context
            (``config.context_length``) without a cache, or the cache has
            room for more than the context (one made with :meth:`new_cache`
            never has).
        """
        ids = self._ids(token_ids, lengths)
        logits = self.logits(self._hidden(ids, cache, lengths))         # (B, T, V)
        ndim = token_ids.ndim if hasattr(token_ids, "ndim") else np.ndim(token_ids)
        if ndim == 1:
            return logits[0, ...]                                       # (T, V)
        return logits

    def hidden_states(self, token_ids: Any, cache: Cache | None = None, *,
                      lengths: Any = None) -> Array:
        """The final normalised hidden states (B, T, D); see :meth:`__call__`."""
        return self._hidden(self._ids(token_ids, lengths), cache, lengths)

    def logits(self, hidden: Array, /) -> Array:
        """Logits (…, V) of final hidden states (…, D): ``lm_head``, then the final softcap
        where the model has one (Gemma)."""
        xp = self.xp
        logits = hidden @ self.params["lm_head"]                        # (…, V)
        cap = self.spec.final_softcap
        if cap is not None:
            logits = xp.tanh(logits / cap) * cap
        return logits

    def _norm(self, x: Array, weight: Array) -> Array:
        """The model's RMSNorm of ``x`` with ``weight`` (Gemma's scales by ``1 + weight``)."""
        c = self.spec
        return rms_norm(x, weight, eps=c.rms_norm_eps, offset=c.norm_offset,
                        scale_in_float32=c.norm_scale_in_float32)

    def _embed(self, flat_ids: Array) -> Array:
        """Token embeddings (N, D), scaled in the model's dtype where the model says so."""
        xp = self.xp
        x = xp.take(self.params["embed"], flat_ids, axis=0)             # (N, D)
        if self.spec.embed_scale is not None:
            x = x * xp.asarray(self.spec.embed_scale, dtype=x.dtype, device=self.device)
        return x

    def _hidden(self, ids: Array, cache: Cache | None, lengths: Any) -> Array:
        """:meth:`hidden_states` of checked ids (B, T)."""
        xp, c = self.xp, self.spec
        b, t = ids.shape
        self._check_context(t, cache)
        key_lengths = self._lengths(lengths, b, t)
        x = self._embed(xp.reshape(ids, (b * t,)))                      # (B·T, D)
        steps = xp.arange(t, dtype=self._int, device=self.device)       # (T,)
        masks: _Masks | None = None
        if cache is None:
            positions = xp.reshape(steps, (1, 1, t))                    # (1, 1, T)
        else:
            if cache.lengths.shape != (b,):
                raise ValueError(f"`cache` holds {cache.lengths.shape[0]} rows but "
                                 f"`token_ids` has {b}")
            start = xp.reshape(cache.lengths, (b, 1)) + steps           # (B, T)
            positions = xp.reshape(start, (b, 1, t))                    # (B, 1, T)
            if key_lengths is not None:
                # ragged rows: row b's token i is at start[b] + i; the masks say which
                # slots of the cache each sees
                masks = _Masks(xp, xp.reshape(start, (b, 1, t, 1)),
                               xp.arange(cache.capacity, dtype=self._int, device=self.device))
        for i in range(c.num_layers):
            x = self._layer(i, x, b, t, positions, cache, key_lengths, masks)
        x = self._norm(x, self.params["norm"])
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
        """Queries (B, H, T, E), keys and values (B, Hkv, T, E); QK-norm and RoPE applied."""
        xp, c = self.xp, self.spec
        lp = self.params["layers"][i]
        e, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        qkv = h @ lp["w_qkv"]                                           # (B·T, (H+2Hkv)·E)
        if "b_qkv" in lp:
            qkv = qkv + lp["b_qkv"]
        qkv = xp.reshape(qkv, (b, t, nh + 2 * nkv, e))                  # (B, T, H+2Hkv, E)
        qkv = xp.permute_dims(qkv, (0, 2, 1, 3))                        # (B, H+2Hkv, T, E)
        qk = qkv[:, :nh + nkv, ...]                                     # (B, H+Hkv, T, E)
        if "qk_norm" in lp:
            # Qwen3, Gemma 3: each head's query and key normalised over its E features
            # (the weights (H+Hkv, 1, E): the query heads' rows, then the key heads')
            qk = self._norm(qk, lp["qk_norm"])
        # queries and keys rotated in one call: the same positions for every head
        inv_freq, base, factor = self._ropes[c.layer(i).rope]
        if inv_freq is None:
            qk = polyattn.apply_rotary_embedding(qk, positions, base=base)
        else:
            qk = polyattn.apply_rotary_embedding(qk, positions, inv_freq=inv_freq,
                                                 attention_factor=factor)
        q = qk[:, :nh, ...]                                             # (B, H, T, E)
        k = qk[:, nh:, ...]                                             # (B, Hkv, T, E)
        v = qkv[:, nh + nkv:, ...]                                      # (B, Hkv, T, E)
        return q, k, v

    def _attention_options(self, i: int) -> dict[str, Any]:
        """The keywords of layer ``i``'s attention besides the masks: GQA, scale, softcap,
        sinks."""
        c = self.spec
        lp = self.params["layers"][i]
        options: dict[str, Any] = {"enable_gqa": True}
        if c.attn_scale is not None:
            options["scale"] = c.attn_scale
        if c.attn_softcap is not None:
            options["softcap"] = c.attn_softcap
        if "sinks" in lp:
            options["sinks"] = lp["sinks"]
        return options

    def _attend(self, i: int, q: Array, k: Array, v: Array, cache: Cache | None,
                key_lengths: Array | None, masks: _Masks | None) -> Array:
        """Layer ``i``'s attention (B, H, T, E), the new keys and values appended to the cache."""
        options = self._attention_options(i)
        left = self.spec.layer(i).window
        window = None if left is None else (left, 0)
        if cache is None:
            return polyattn.scaled_dot_product_attention(
                q, k, v, is_causal=True, window=window, key_lengths=key_lengths, **options)
        kv = cache.layers[i].update(k, v, lengths=key_lengths)
        cache.layers[i] = kv
        if masks is None:           # every row appended all T: they are its last T keys
            return polyattn.scaled_dot_product_attention(
                q, kv.keys, kv.values, is_causal=True, causal_alignment="bottom_right",
                window=window, key_lengths=kv.lengths, **options)
        return polyattn.scaled_dot_product_attention(
            q, kv.keys, kv.values, attn_mask=masks.visible(left), key_lengths=kv.lengths,
            **options)                                                  # (B, H, T, E)

    def _layer(self, i: int, x: Array, b: int, t: int, positions: Array,
               cache: Cache | None, key_lengths: Array | None, masks: _Masks | None) -> Array:
        """Decoder layer ``i`` on the residual stream x (B·T, D)."""
        xp, c = self.xp, self.spec
        lp = self.params["layers"][i]
        h = self._norm(x, lp["attn_norm"])
        q, k, v = self._project_qkv(i, h, b, t, positions)
        out = self._attend(i, q, k, v, cache, key_lengths, masks)       # (B, H, T, E)
        out = xp.permute_dims(out, (0, 2, 1, 3))                        # (B, T, H, E)
        out = xp.reshape(out, (b * t, c.num_heads * c.head_dim))        # (B·T, H·E)
        out = out @ lp["w_o"]                                           # (B·T, D)
        if "b_o" in lp:
            out = out + lp["b_o"]
        if "post_attn_norm" in lp:                                      # Gemma
            out = self._norm(out, lp["post_attn_norm"])
        x = x + out
        h = self._norm(x, lp["ffn_norm"])
        h = self._feed_forward(lp, h)
        if "post_ffn_norm" in lp:                                       # Gemma
            h = self._norm(h, lp["post_ffn_norm"])
        return x + h

    def _feed_forward(self, lp: dict[str, Any], h: Array) -> Array:
        """The gated feed-forward network (B·T, D) -> (B·T, D), or the mixture of experts."""
        c = self.spec
        if c.num_experts:
            return mixture_of_experts(h, lp, top_k=c.experts_per_token,
                                      alpha=c.swiglu_alpha, limit=c.swiglu_limit)
        gate_up = h @ lp["w_gate_up"]                                   # (B·T, 2F)
        if "b_gate_up" in lp:
            gate_up = gate_up + lp["b_gate_up"]
        f = c.intermediate_size
        act = silu if c.activation == "silu" else gelu_tanh
        out = (act(gate_up[:, :f]) * gate_up[:, f:]) @ lp["w_down"]     # (B·T, D)
        if "b_down" in lp:
            out = out + lp["b_down"]
        return out

    def attention_weights(self, token_ids: Any) -> list[Array]:
        """Every layer's attention weights over one sequence: a list of (H, T, T).

        Row ``i`` of head ``h`` is how much token ``i`` attends to each of
        the tokens ``0 … i`` (causal: the rest are 0; a sliding layer's
        window leaves out the older ones too, and a model with learned
        sinks gives rows that sum to less than 1).
        """
        xp, c = self.xp, self.spec
        ids = self._ids(token_ids)
        if ids.shape[0] != 1:
            raise ValueError(f"`token_ids` must be one sequence, (T,) or (1, T); got shape "
                             f"{tuple(ids.shape)}")
        t = ids.shape[1]
        self._check_context(t, None)
        x = self._embed(xp.reshape(ids, (t,)))                          # (T, D)
        positions = xp.arange(t, dtype=self._int, device=self.device)    # (T,)
        maps = []
        for i in range(c.num_layers):
            h = self._norm(x, self.params["layers"][i]["attn_norm"])
            q, k, _ = self._project_qkv(i, h, 1, t, positions)
            left = c.layer(i).window
            alpha = polyattn.attention_weights(
                q, k, is_causal=True, window=None if left is None else (left, 0),
                **self._attention_options(i))
            maps.append(alpha[0, ...])                                  # (H, T, T)
            x = self._layer(i, x, 1, t, xp.reshape(positions, (1, 1, t)), None, None, None)
        return maps


class _Masks:
    """The boolean masks (B, 1, T, C) of a ragged batch decoded with a cache, one per
    window, made when a layer first asks: row ``b``'s token at position ``p`` sees the
    slots ``p - left … p``."""

    def __init__(self, xp: Namespace, positions: Array, slots: Array) -> None:
        self.xp, self.positions, self.slots = xp, positions, slots      # (B, 1, T, 1), (C,)
        self._made: dict[int | None, Array] = {}

    def visible(self, left: int | None) -> Array:
        if left not in self._made:
            mask = self.slots <= self.positions                         # (B, 1, T, C)
            if left is not None:
                mask = self.xp.logical_and(mask, self.slots >= self.positions - left)
            self._made[left] = mask
        return self._made[left]
