"""Whether a parsed GGUF file makes a Llama model: hyper-parameters, tokenizer, tensor shapes.

Each check fails with one ``ValueError`` that names the file and the key or
tensor: ``cannot load <file> as a Llama model: …``.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from polyattn.models._bpe import BPETokenizer
from polyattn.models._gguf_format import TensorInfo, show

#: The pre-tokenizer the BPE tokenizer reproduces (llama.cpp's name for it); a file
#: without ``tokenizer.ggml.pre`` is read with it too.
PRE_TOKENIZER = "smollm"


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
        fail = model_error(path)
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


# --------------------------------------------------------------------------
# The checks on hyper-parameters and the tokenizer
# --------------------------------------------------------------------------


def model_error(path: str | os.PathLike[str]) -> Callable[[str], ValueError]:
    """A maker of the error for a file that parses but does not describe a usable model."""
    return lambda what: ValueError(f"cannot load {path} as a Llama model: {what}")


def _given(meta: dict[str, Any], key: str) -> str:
    """``meta[key]`` for a message, shortened; or that it is missing."""
    return show(meta[key]) if key in meta else "nothing (the key is missing)"


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
        raise fail(f"`{key}` must be an integer >= {minimum}; got {show(value)}")
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
                   f"got {show(value)}")
    return float(value)


def _token_id(meta: dict[str, Any], key: str, vocab: int,
              fail: Callable[[str], ValueError]) -> int | None:
    if key not in meta:
        return None
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise fail(f"`{key}` must be a token id in [0, {vocab}); got {show(value)}")
    return value


def bpe_tokenizer(meta: dict[str, Any], path: str | os.PathLike[str]) -> BPETokenizer:
    """The byte-level BPE tokenizer of the metadata, its arrays checked first."""
    fail = model_error(path)
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
                   f"one per token; got {show(types)}"
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


def check_tensors(tensors: dict[str, TensorInfo], c: LlamaConfig,
                   path: str | os.PathLike[str]) -> None:
    """Every tensor the model needs is there, with the shape the hyper-parameters imply."""
    fail = model_error(path)
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
