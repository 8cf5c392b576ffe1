"""Multi-head attention: project, attend per head, concatenate, project back.

Parameters follow ``x @ w`` with weights laid out (in, out)::

    w_q (d_model, H·E)   w_k (kdim, Hkv·E)   w_v (vdim, Hkv·Ev)   w_o (H·Ev, d_model)
    b_q (H·E,)           b_k (Hkv·E,)        b_v (Hkv·Ev,)        b_o (d_model,)

with ``E = d_model // H``. Biases are optional. ``H = num_heads`` query
heads share ``Hkv = num_kv_heads`` key/value heads (grouped-query attention;
``Hkv = 1`` is multi-query attention).
"""


from polyattn.multihead.arguments import ROTARY_OPTIONS
from polyattn.multihead.function import multi_head_attention
from polyattn.multihead.module import MultiHeadAttention
from polyattn.multihead.weights import BIASES, WEIGHTS

__all__ = ["BIASES", "ROTARY_OPTIONS", "WEIGHTS", "MultiHeadAttention", "multi_head_attention"]
