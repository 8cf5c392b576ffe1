"""Real models built on polyattn's attention.

The modules here are applications of the public API, not part of it: each
one loads published weights and runs a complete network whose attention
is polyattn's. They import their heavier dependencies (``safetensors``,
``tokenizers``, ``gguf``, the packaged weights) only when a model is loaded,
so ``import polyattn`` stays light.

Functions
---------
from_pretrained
    A decoder from a transformers checkpoint folder (``config.json`` and
    ``*.safetensors``): Llama, Qwen3, Gemma 2 and 3, gpt-oss, on NumPy,
    torch, CuPy or JAX arrays; see :mod:`polyattn.models.pretrained`.

Modules
-------
pretrained
    :func:`from_pretrained` and the model it returns, ``PretrainedLM``.
minilm
    The all-MiniLM-L6-v2 sentence encoder (a 6-layer BERT), its sentence
    embeddings and the attention demo of ``python -m polyattn demo --model minilm``.
smollm2
    SmolLM2-135M-Instruct, a 30-layer Llama decoder with grouped-query
    attention, rotary positions and a key/value cache: text generation from
    Python and ``python -m polyattn generate``.
"""

from polyattn.models.pretrained import from_pretrained

__all__ = ["from_pretrained"]
