"""What a decoder is made of, layer by layer: the description :class:`Decoder` runs.

One :class:`DecoderConfig` covers the decoders of the Llama family that
polyattn runs (Llama and SmolLM2, Qwen3, Gemma 2 and 3, gpt-oss): the sizes,
then what differs between them, each a field with the Llama value as its
default — the attention's scale and logit softcap, an embedding scale, the
feed-forward network's activation or mixture of experts, a final logit
softcap — and one :class:`LayerSpec` per layer: its sliding window and which
rotary frequencies it uses. Which optional weights a layer has (biases,
QK-norm, learned sinks, the norms after attention and feed-forward) is told
by the parameters themselves (see :class:`~polyattn.models._decoder.Decoder`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Feed-forward activations: SiLU (SwiGLU: Llama, Qwen3) and GELU's tanh
#: approximation (GeGLU: Gemma's ``gelu_pytorch_tanh``).
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding of a kind of layer.

    ``inv_freq`` ``None`` means plain RoPE of base ``base``; otherwise the
    frequencies (float64 values, one per rotated pair) of a scaled RoPE
    (:func:`polyattn.rotary_frequencies`) and the factor that multiplies the
    rotated features.
    """

    base: float = 10000.0
    inv_freq: tuple[float, ...] | None = None
    attention_factor: float = 1.0


@dataclass(frozen=True)
class LayerSpec:
    """One layer: how far back it attends, and its rotary embedding.

    ``window`` is the ``left`` of polyattn's ``window=(left, 0)``: query at
    position ``p`` sees keys ``p - left … p``; ``None`` for full (causal)
    attention. A transformers ``sliding_window`` of ``W`` is ``left = W - 1``
    (its mask keeps ``q - k < W``). ``rope`` names an entry of
    :attr:`DecoderConfig.ropes`.
    """

    window: int | None = None
    rope: str = "default"


@dataclass(frozen=True)
class DecoderConfig:
    """The hyper-parameters of a decoder of the Llama family.

    The first ten fields are those of a Llama (and of
    :class:`~polyattn.models._gguf_checks.LlamaConfig`, from which
    :meth:`from_llama` makes one); the rest default to Llama's behaviour.

    Attributes
    ----------
    attn_scale : float or None
        The scale of the attention scores; ``None``: ``1/sqrt(head_dim)``.
        Gemma: ``query_pre_attn_scalar ** -0.5``.
    attn_softcap, final_softcap : float or None
        ``c · tanh(s / c)`` on the attention scores (Gemma 2) and on the
        logits (Gemma 2 and 3).
    embed_scale : float or None
        Multiplies the token embeddings, in the model's dtype (Gemma:
        ``sqrt(hidden_size)``).
    norm_offset : float
        Every RMSNorm scales by ``norm_offset + w`` (Gemma: 1).
    norm_scale_in_float32 : bool
        float16 and bfloat16 models scale the float32 normalised features
        before casting them back (Gemma, gpt-oss), rather than after (Llama).
    activation : {"silu", "gelu_tanh"}
        The gated feed-forward network's activation.
    num_experts, experts_per_token : int
        A mixture of experts instead of one feed-forward network when
        ``num_experts > 0`` (gpt-oss): each token's router picks its top
        ``experts_per_token``, weighted by the softmax of their logits.
    swiglu_alpha, swiglu_limit : float or None
        gpt-oss's clamped SwiGLU: ``gate = min(gate, limit)``,
        ``up = clip(up, -limit, limit)``,
        ``(up + 1) · gate · sigmoid(alpha · gate)``.
    layers : tuple of LayerSpec
        One per layer; empty means every layer full attention with the
        ``"default"`` rotary embedding.
    ropes : mapping of str to RopeSpec
        The rotary embeddings the layers name; a missing ``"default"`` is
        plain RoPE of base ``rope_base``.
    model_type : str
        The architecture's name (transformers' ``model_type``).
    """

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
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float | None = None
    norm_offset: float = 0.0
    norm_scale_in_float32: bool = False
    activation: str = "silu"
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    layers: tuple[LayerSpec, ...] = ()
    ropes: Mapping[str, RopeSpec] = field(default_factory=dict)
    model_type: str = "llama"

    def layer(self, i: int) -> LayerSpec:
        """Layer ``i``'s :class:`LayerSpec`."""
        return self.layers[i] if self.layers else LayerSpec()

    def rope(self, name: str) -> RopeSpec:
        """The :class:`RopeSpec` called ``name``."""
        if name in self.ropes:
            return self.ropes[name]
        return RopeSpec(base=self.rope_base)

    @classmethod
    def from_llama(cls, config: Any) -> DecoderConfig:
        """The description of a plain Llama from any object with Llama's ten fields."""
        if isinstance(config, DecoderConfig):
            return config
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, num_layers=config.num_layers,
                   num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, rope_base=config.rope_base,
                   rms_norm_eps=config.rms_norm_eps, context_length=config.context_length)
