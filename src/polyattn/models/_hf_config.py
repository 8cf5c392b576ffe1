"""A transformers checkpoint's ``config.json`` as a :class:`DecoderConfig`.

Read as transformers 5 writes it (``rope_parameters``, ``layer_types``) and
as older checkpoints on the Hub have it (``rope_theta`` and
``rope_scaling``; Gemma 3's ``rope_local_base_freq`` and
``sliding_window_pattern``). Fields a configuration leaves out take the
default of transformers' configuration class of the architecture. Anything
that would change the network in a way not implemented here is refused with
one ``ValueError`` naming the file, the field and its value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polyattn
from polyattn.models._decoder_config import DecoderConfig, LayerSpec, RopeSpec

#: ``model_type`` values read, and the architecture each is.
ARCHITECTURES = {"gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
                 "gpt_oss": "gpt_oss", "llama": "llama", "qwen3": "qwen3"}
#: The kinds of layer of ``layer_types``.
LAYER_TYPES = ("full_attention", "sliding_attention")
#: Defaults of transformers' configuration classes, where a field is left out.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "attention_bias": False, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "attention_bias": False, "head_dim": 128},
    "gemma2": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": True, "attention_bias": False, "head_dim": 256,
               "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
               "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
               "tie_word_embeddings": True, "attention_bias": False, "head_dim": 256,
               "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "gpt_oss": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_theta": 150000.0, "tie_word_embeddings": False, "attention_bias": True,
                "head_dim": 64, "sliding_window": 128, "num_experts_per_tok": 4,
                "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 4096}},
}


@dataclass(frozen=True)
class CheckpointConfig:
    """What ``config.json`` says: the network, and the rest the loader needs.

    Attributes
    ----------
    decoder : DecoderConfig
    arch : str
        ``"llama"``, ``"qwen3"``, ``"gemma2"``, ``"gemma3"`` or ``"gpt_oss"``.
    tied : bool
        The logits' matrix is the token embeddings (``tie_word_embeddings``).
    attention_bias, mlp_bias : bool
    dtype : str or None
        The weights' dtype (``dtype``, or ``torch_dtype`` before transformers 5).
    token_ids : dict
        ``bos_token_id``, ``eos_token_id`` (an int or a list), ``pad_token_id``.
    """

    decoder: DecoderConfig
    arch: str
    tied: bool
    attention_bias: bool
    mlp_bias: bool
    dtype: str | None
    token_ids: dict[str, Any]


class _Reader:
    """Typed look-ups in one configuration mapping; errors name the file and the field."""

    def __init__(self, raw: Mapping[str, Any], file: Path, arch: str, where: str = "") -> None:
        self.raw, self.file, self.arch, self.where = raw, file, arch, where

    def fail(self, key: str, what: str) -> ValueError:
        return ValueError(f"{self.file}: `{self.where}{key}` {what}")

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.raw:
            return self.raw[key]
        return DEFAULTS[self.arch].get(key, default)

    def integer(self, key: str, *, minimum: int = 1, required: bool = False) -> Any:
        if required and key not in self.raw:
            raise self.fail(key, f"is missing; it must be an integer >= {minimum}")
        value = self.get(key)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"must be an integer >= {minimum}; got {value!r}")
        return value

    def real(self, key: str, *, positive: bool = True) -> float | None:
        value = self.get(key)
        if value is None:
            return None
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and (value > 0 if positive else value >= 0))
        if not ok:
            raise self.fail(key, f"must be a finite number {'> 0' if positive else '>= 0'}; "
                                 f"got {value!r}")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.get(key, False)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false; got {value!r}")
        return value


def read_config(raw: Mapping[str, Any], file: Path) -> CheckpointConfig:
    """The :class:`CheckpointConfig` of a parsed ``config.json``."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{file}: not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        what = ("has no `model_type`, which names the architecture" if model_type is None
                else f"`model_type` {model_type!r} is not supported")
        raise ValueError(f"{file}: {what}; supported: {', '.join(sorted(ARCHITECTURES))}")
    arch = ARCHITECTURES[model_type]
    where, top = "", raw
    if model_type == "gemma3":                 # the multimodal checkpoint: its text model
        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError(f"{file}: `text_config` must be an object (the language model's "
                             f"configuration) for `model_type` 'gemma3'; got {text!r:.80}")
        raw, where = text, "text_config."
    r = _Reader(raw, file, arch, where)
    quant = r.raw.get("quantization_config") or (
        raw.get("quantization_config") if where else None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        raise r.fail("quantization_config", f"(quant_method {method!r}) is not supported: "
                     "only unquantized weights are read; dequantize the checkpoint first "
                     "(e.g. load it in transformers and save_pretrained it)")
    for key in ("use_bidirectional_attention",):
        if r.flag(key):
            raise r.fail(key, "is true, which is not supported: polyattn's decoder is causal")
    hidden = r.integer("hidden_size", required=True)
    heads = r.integer("num_attention_heads", required=True)
    kv_heads = r.integer("num_key_value_heads") or heads
    if heads % kv_heads:
        raise r.fail("num_key_value_heads", f"({kv_heads}) must divide "
                     f"`num_attention_heads` ({heads})")
    head_dim = r.integer("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise r.fail("head_dim", f"is missing, and `hidden_size` ({hidden}) is not a "
                         f"multiple of `num_attention_heads` ({heads})")
        head_dim = hidden // heads
    if head_dim % 2:
        raise r.fail("head_dim", f"must be even for rotary embeddings; got {head_dim}")
    layers_n = r.integer("num_hidden_layers", required=True)
    partial = r.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise r.fail("partial_rotary_factor", f"{partial!r} is not supported (only 1: every "
                     "feature of a head is rotated)")
    layer_types = _layer_types(r, layers_n)
    window = None
    if "sliding_attention" in layer_types:
        sliding = r.integer("sliding_window")
        if sliding is None:
            raise r.fail("sliding_window", "is missing or null, but `layer_types` has "
                         "sliding_attention layers")
        window = sliding - 1                    # transformers keeps keys with q - k < W
    ropes = _ropes(r, arch, head_dim, r.integer("max_position_embeddings", required=False))
    layers = tuple(LayerSpec(window=window if kind == "sliding_attention" else None,
                             rope=kind if kind in ropes else "default")
                   for kind in layer_types)
    extra: dict[str, Any] = {}
    if arch in ("gemma2", "gemma3"):
        activation = r.get("hidden_activation") or r.get("hidden_act") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise r.fail("hidden_activation", f"{activation!r} is not supported (Gemma's is "
                         "'gelu_pytorch_tanh')")
        extra = {"activation": "gelu_tanh", "norm_offset": 1.0, "norm_scale_in_float32": True,
                 "attn_scale": r.real("query_pre_attn_scalar") ** -0.5,  # type: ignore[operator]
                 "embed_scale": math.sqrt(hidden),
                 "attn_softcap": r.real("attn_logit_softcapping"),
                 "final_softcap": r.real("final_logit_softcapping")}
    elif arch == "gpt_oss":
        experts = r.integer("num_local_experts", required=True)
        top_k = r.integer("num_experts_per_tok")
        if top_k > experts:
            raise r.fail("num_experts_per_tok", f"({top_k}) must be at most "
                         f"`num_local_experts` ({experts})")
        extra = {"num_experts": experts, "experts_per_token": top_k,
                 "norm_scale_in_float32": True,
                 "swiglu_alpha": r.real("swiglu_alpha"),
                 "swiglu_limit": r.real("swiglu_limit")}
    else:
        activation = r.get("hidden_act", "silu")
        if activation != "silu":
            raise r.fail("hidden_act", f"{activation!r} is not supported (only 'silu': SwiGLU)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if arch not in ("gemma2", "gemma3") and r.raw.get(key) is not None:
            raise r.fail(key, f"{r.raw[key]!r} is not supported for `model_type` "
                         f"{model_type!r}")
    mlp_bias = r.flag("mlp_bias")
    if mlp_bias and arch != "llama":
        raise r.fail("mlp_bias", f"is true, which is not supported for `model_type` "
                     f"{model_type!r}")
    decoder = DecoderConfig(
        vocab_size=r.integer("vocab_size", required=True), hidden_size=hidden,
        intermediate_size=r.integer("intermediate_size", required=True),
        num_layers=layers_n, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rope_base=ropes["default"].base, rms_norm_eps=r.real("rms_norm_eps", positive=False)
        or 0.0, context_length=r.integer("max_position_embeddings"), layers=layers,
        ropes=ropes, model_type=model_type, **extra)
    # a multimodal checkpoint may say these at its top level rather than in text_config
    ids = {key: r.raw.get(key, top.get(key)) for key in
           ("bos_token_id", "eos_token_id", "pad_token_id")}
    dtype = r.raw.get("dtype") or r.raw.get("torch_dtype") or top.get("dtype") or top.get(
        "torch_dtype")
    tied_reader = r if "tie_word_embeddings" in r.raw or not where else _Reader(
        top, file, arch)
    return CheckpointConfig(decoder=decoder, arch=arch,
                            tied=tied_reader.flag("tie_word_embeddings"),
                            attention_bias=r.flag("attention_bias"), mlp_bias=mlp_bias,
                            dtype=dtype if isinstance(dtype, str) else None, token_ids=ids)


def _layer_types(r: _Reader, n: int) -> list[str]:
    """Each layer's kind: ``layer_types``, else the architecture's pattern.

    As in transformers, Llama has no sliding layers (it reads no
    ``layer_types``), and Qwen3's slide only with ``use_sliding_window``.
    """
    if r.arch == "llama" or (r.arch == "qwen3" and not r.flag("use_sliding_window")):
        return ["full_attention"] * n
    given = r.raw.get("layer_types")
    if given is not None:
        if not (isinstance(given, list) and len(given) == n):
            raise r.fail("layer_types", f"must list one kind per layer ({n}, "
                         f"`num_hidden_layers`); got {given!r:.200}")
        for kind in given:
            if kind not in LAYER_TYPES:
                raise r.fail("layer_types", f"has {kind!r}, which is not supported; "
                             f"supported: {', '.join(LAYER_TYPES)}")
        return list(given)
    if r.arch in ("gemma2", "gpt_oss"):
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if r.arch == "gemma3":
        pattern = r.integer("sliding_window_pattern") or 6
        return ["sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(n)]
    if r.arch == "qwen3":
        first = r.integer("max_window_layers", minimum=0)
        first = 28 if first is None else first
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def _ropes(r: _Reader, arch: str, head_dim: int, context: int | None) -> dict[str, RopeSpec]:
    """The rotary embeddings by layer kind (``"default"``: every layer's, but Gemma 3's)."""
    params = r.raw.get("rope_parameters")
    if arch == "gemma3":
        per_type: dict[str, Any] = {}
        if isinstance(params, Mapping) and any(k in params for k in LAYER_TYPES):
            per_type = {kind: params.get(kind) or {} for kind in LAYER_TYPES}
        else:
            scaling = params if isinstance(params, Mapping) else r.raw.get("rope_scaling")
            per_type = {"full_attention": dict(scaling or {}),
                        "sliding_attention": {}}
        per_type["full_attention"].setdefault("rope_theta", r.get("rope_theta"))
        per_type["sliding_attention"].setdefault("rope_theta", r.get("rope_local_base_freq"))
        ropes = {kind: _rope(r, f"rope_parameters.{kind}", p, head_dim, context)
                 for kind, p in per_type.items()}
        ropes["default"] = ropes["full_attention"]
        return ropes
    if isinstance(params, Mapping):
        where, p = "rope_parameters", dict(params)
    else:
        scaling = r.get("rope_scaling")
        where, p = "rope_scaling", dict(scaling or {})
    p.setdefault("rope_theta", r.get("rope_theta"))
    return {"default": _rope(r, where, p, head_dim, context)}


def _rope(r: _Reader, where: str, params: Mapping[str, Any], head_dim: int,
          context: int | None) -> RopeSpec:
    """One rotary embedding: plain RoPE by its base, or the scaled frequencies."""
    p = dict(params)
    base = p.pop("rope_theta", None)
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not 0 < base < math.inf:
        raise r.fail(f"{where}.rope_theta", f"must be a positive finite number; got {base!r}")
    kind = p.get("rope_type", p.get("type", "default"))
    if p.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise r.fail(f"{where}.partial_rotary_factor", f"{p['partial_rotary_factor']!r} is "
                     "not supported (only 1)")
    if kind == "default":
        return RopeSpec(base=float(base))
    if kind == "yarn" and p.get("factor") is None and context and p.get(
            "original_max_position_embeddings"):
        p["factor"] = context / p["original_max_position_embeddings"]
    try:
        theta, factor = polyattn.rotary_frequencies(head_dim, base=float(base), scaling=p)
    except (TypeError, ValueError) as exc:
        # rotary_frequencies names its argument `scaling`: name config.json's field instead
        field = where.split(".")[0]
        why = str(exc).replace("`scaling", f"`{field}")
        raise r.fail(where, f"{dict(params)!r:.300} is not supported: {why}") from None
    return RopeSpec(base=float(base), inv_freq=tuple(float(t) for t in theta),
                    attention_factor=factor)
