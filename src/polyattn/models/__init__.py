"""Real models built on polyattn's attention.

The modules here are applications of the public API, not part of it: each
one loads published weights and runs a complete network whose attention
layers are :func:`polyattn.multi_head_attention`. They import their heavier
dependencies (``safetensors``, ``tokenizers``, the packaged weights) only
when a model is loaded, so ``import polyattn`` stays light.

Modules
-------
minilm
    The all-MiniLM-L6-v2 sentence encoder (a 6-layer BERT), its sentence
    embeddings and the attention demo of ``python -m polyattn demo --model minilm``.
"""

