"""Real models built on polyattn's attention.

The modules here are applications of the public API, not part of it: each
one loads published weights and runs a complete network whose attention
is polyattn's. They import their heavier dependencies (``safetensors``,
``tokenizers``, ``gguf``, the packaged weights) only when a model is loaded,
so ``import polyattn`` stays light.

Modules
-------
minilm
    The all-MiniLM-L6-v2 sentence encoder (a 6-layer BERT), its sentence
    embeddings and the attention demo of ``python -m polyattn demo --model minilm``.
smollm2
    SmolLM2-135M-Instruct, a 30-layer Llama decoder with grouped-query
    attention, rotary positions and a key/value cache: text generation from
    Python and ``python -m polyattn generate``.
"""

