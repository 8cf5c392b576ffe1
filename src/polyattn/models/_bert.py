"""A BERT encoder in Array API code: GELU, LayerNorm, the layers and mean pooling.

The self-attention of each layer is :func:`polyattn.multi_head_attention`.
Shapes: ``B`` sentences, ``T`` tokens, ``D`` features, ``H`` heads, ``E`` =
D / H features per head.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

import polyattn
from polyattn.models._bert_config import BertConfig

Array = Any
Namespace = Any


# erf(x) for |x| < _ERF_SPLIT by its power series, beyond by a continued fraction
# for erfc; 40 series terms and a depth of 30 give |error| < 2e-15 everywhere.
_ERF_SPLIT = 2.5
_ERF_SERIES_TERMS = 40
_ERFC_FRACTION_DEPTH = 30


def _erf(x: Array, xp: Namespace) -> Array:
    """The error function with standard calls only (the standard has no ``erf``).

    Below the split: ``erf z = 2/√π · exp(-z²) · Σ_n 2ⁿ z^(2n+1) / (1·3···(2n+1))``,
    a series of positive terms (no cancellation). Above it:
    ``erfc z = exp(-z²) / √π · 1 / (z + (1/2)/(z + 1/(z + (3/2)/(z + …))))``.
    Both branches are computed for every element (no value-dependent control
    flow) and chosen with ``where``.
    """
    a = xp.abs(x)
    # power series on the clipped small range
    z = xp.clip(a, max=_ERF_SPLIT)
    z2 = z * z
    term = z
    total = z
    for n in range(1, _ERF_SERIES_TERMS):
        term = term * (2.0 * z2 / (2 * n + 1))
        total = total + term
    small = (2.0 / math.sqrt(math.pi)) * xp.exp(-z2) * total
    # continued fraction for erfc on the clipped large range, evaluated bottom-up
    w = xp.clip(a, min=_ERF_SPLIT)
    f = w
    for k in range(_ERFC_FRACTION_DEPTH, 0, -1):
        f = w + (k / 2.0) / f
    large = 1.0 - xp.exp(-w * w) / (math.sqrt(math.pi) * f)
    r = xp.where(a < _ERF_SPLIT, small, large)
    return xp.where(x < 0, -r, r)


def gelu(x: Array, /) -> Array:
    """The exact GELU, ``x · Φ(x) = x/2 · (1 + erf(x / √2))``.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models.minilm import gelu
    >>> gelu(np.array([-1.0, 0.0, 1.0, 3.0])).round(6)
    array([-0.158655,  0.      ,  0.841345,  2.99595 ])
    """
    xp = array_api_compat.array_namespace(x)
    return 0.5 * x * (1.0 + _erf(x * (1.0 / math.sqrt(2.0)), xp))


def layer_norm(x: Array, weight: Array, bias: Array, /, *, eps: float) -> Array:
    """Normalise the last axis to mean 0 and variance 1, then scale and shift.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models.minilm import layer_norm
    >>> layer_norm(np.array([1.0, 2.0, 3.0]), np.ones(3), np.zeros(3), eps=0.0).round(4)
    array([-1.2247,  0.    ,  1.2247])
    """
    xp = array_api_compat.array_namespace(x, weight, bias)
    mean = xp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    var = xp.mean(centred * centred, axis=-1, keepdims=True)
    return centred / xp.sqrt(var + eps) * weight + bias


def cosine_similarity(a: Array, b: Array, /) -> Array:
    """Cosine similarity of every row of ``a`` (N, D) with every row of ``b`` (M, D) -> (N, M).

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models.minilm import cosine_similarity
    >>> cosine_similarity(np.array([[1.0, 0.0]]), np.array([[1.0, 1.0], [0.0, 2.0]])).round(4)
    array([[0.7071, 0.    ]])
    """
    xp = array_api_compat.array_namespace(a, b)
    a = a / xp.sqrt(xp.sum(a * a, axis=-1, keepdims=True))
    b = b / xp.sqrt(xp.sum(b * b, axis=-1, keepdims=True))
    return a @ xp.matrix_transpose(b)


def _split_heads(x: Array, num_heads: int, xp: Namespace) -> Array:
    b, t, d = x.shape
    x = xp.reshape(x, (b, t, num_heads, d // num_heads))  # (B, T, H, E)
    return xp.permute_dims(x, (0, 2, 1, 3))  # (B, H, T, E)


class BertEncoder:
    """The forward pass of a BERT encoder, on arrays of one Array API namespace.

    ``params`` and ``config`` are those of :class:`polyattn.models.minilm.MiniLM`,
    which adds loading and text.
    """

    def __init__(self, params: dict[str, Any], config: BertConfig, tokenizer: Any = None):
        self.params = params
        self.config = config
        self.tokenizer = tokenizer
        self.xp = array_api_compat.array_namespace(params["word"])
        self.device = array_api_compat.device(params["word"])

    # -- the network -------------------------------------------------------

    def embeddings(self, input_ids: Array, /) -> Array:
        """Word + position + token-type embeddings, normalised: (B, T) -> (B, T, D)."""
        xp, p = self.xp, self.params
        b, t = input_ids.shape
        if t > self.config.max_position_embeddings:
            raise ValueError(
                f"`input_ids` has {t} tokens but the model has only "
                f"{self.config.max_position_embeddings} positions"
            )
        flat = xp.reshape(input_ids, (b * t,))
        words = xp.reshape(xp.take(p["word"], flat, axis=0), (b, t, -1))  # (B, T, D)
        x = words + p["position"][:t, :] + p["token_type"][0, :]  # (B, T, D)
        return layer_norm(x, p["ln_g"], p["ln_b"], eps=self.config.layer_norm_eps)

    def layer(self, index: int, x: Array, keep: Array, /) -> Array:
        """Encoder layer ``index``: attention, add and LayerNorm; GELU MLP, add and LayerNorm."""
        lp = self.params["layers"][index]
        eps = self.config.layer_norm_eps
        b, t = keep.shape
        mask = self.xp.reshape(keep, (b, 1, 1, t))  # (B, 1, 1, Tk): True = attend
        a = polyattn.multi_head_attention(
            x, x, x, lp["attention"], num_heads=self.config.num_heads, attn_mask=mask
        )  # (B, T, D)
        x = layer_norm(x + a, lp["ln1_g"], lp["ln1_b"], eps=eps)
        h = gelu(x @ lp["w_in"] + lp["b_in"])  # (B, T, 4D)
        return layer_norm(x + (h @ lp["w_out"] + lp["b_out"]), lp["ln2_g"], lp["ln2_b"], eps=eps)

    def encode(self, input_ids: Array, keep: Array, /) -> Array:
        """The last hidden state (B, T, D) for token ids (B, T) and padding mask (B, T)."""
        x = self.embeddings(input_ids)
        for i in range(self.config.num_layers):
            x = self.layer(i, x, keep)
        return x

    def pool(self, hidden: Array, keep: Array, /) -> Array:
        """Mean over the real tokens, then L2 normalisation: (B, T, D) -> (B, D)."""
        xp = self.xp
        w = xp.expand_dims(xp.astype(keep, hidden.dtype), axis=-1)  # (B, T, 1)
        summed = xp.sum(hidden * w, axis=1)  # (B, D)
        counts = xp.clip(xp.sum(w, axis=1), min=1e-9)  # (B, 1)
        mean = summed / counts
        norm = xp.sqrt(xp.sum(mean * mean, axis=-1, keepdims=True))
        return mean / xp.clip(norm, min=1e-12)
