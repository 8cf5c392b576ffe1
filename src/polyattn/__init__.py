"""polyattn: Transformer attention for any array library.

Scaled dot-product attention, multi-head attention and positional encodings,
written once against the Python Array API standard. NumPy arrays run on the
CPU, CuPy arrays on an NVIDIA GPU; torch, JAX, Dask and array-api-strict
arrays work too. See ``python -m polyattn info``.
"""

from polyattn import ops
from polyattn.attention import attention_weights, explain, scaled_dot_product_attention
from polyattn.blockmask import BlockMask, block_mask
from polyattn.cache import KVCache
from polyattn.masks import causal_mask
from polyattn.merge import merge_attention
from polyattn.multihead import MultiHeadAttention, multi_head_attention
from polyattn.positional import alibi_slopes, sinusoidal_positional_encoding
from polyattn.rotary import apply_rotary_embedding, rotary_frequencies
from polyattn.softmax import logsumexp, softmax
from polyattn.vjp import attention_vjp

__version__ = "0.1.0"

__all__ = [
    "BlockMask",
    "KVCache",
    "MultiHeadAttention",
    "__version__",
    "alibi_slopes",
    "apply_rotary_embedding",
    "attention_vjp",
    "attention_weights",
    "block_mask",
    "causal_mask",
    "explain",
    "logsumexp",
    "merge_attention",
    "multi_head_attention",
    "ops",
    "rotary_frequencies",
    "scaled_dot_product_attention",
    "sinusoidal_positional_encoding",
    "softmax",
]
