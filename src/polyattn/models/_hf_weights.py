"""A transformers checkpoint's tensors laid out as :class:`~polyattn.models._decoder.Decoder`
wants them.

transformers stores ``nn.Linear`` weights (out, in); the decoder multiplies
``x @ w`` with ``w`` (in, out), so they are transposed, and the queries',
keys' and values' projections (and the gate's and up's) are put side by
side (norm weights stay as stored: Gemma's ``1 + w`` is the decoder's
``norm_offset``). gpt-oss's experts hold their gate and up features interleaved
(gate in the even columns): they are put into two halves. Every tensor is
checked for its shape, and a tensor the model would not read is an error
rather than silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from polyattn.models._hf_config import CheckpointConfig

#: Where the text model's tensors may sit (transformers 5 and 4, multimodal Gemma 3).
PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
#: Where the logits' matrix may sit.
HEADS = ("lm_head.weight", "language_model.lm_head.weight")


class _Tensors:
    """Look-ups in a checkpoint that check shapes and remember what was read."""

    def __init__(self, tensors: Mapping[str, np.ndarray], folder: Any) -> None:
        self.tensors, self.folder = tensors, folder
        self.read: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str, shape: tuple[int, ...], meaning: str) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"{self.folder}: the tensor `{name}` is missing (expected shape "
                             f"{list(shape)} = {meaning})")
        a = self.tensors[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"{self.folder}: the tensor `{name}` has shape {list(a.shape)}; "
                             f"expected {list(shape)} = {meaning} (config.json)")
        self.read.add(name)
        return a


def _linear(*ws: np.ndarray) -> np.ndarray:
    """torch-style (out, in) matrices side by side, as one (in, Σout) matrix."""
    w = ws[0] if len(ws) == 1 else np.concatenate(ws, axis=0)          # (Σout, in)
    return w.T                                                          # (in, Σout)


def decoder_params(tensors: Mapping[str, np.ndarray], cfg: CheckpointConfig,
                   folder: Any) -> dict[str, Any]:
    """The decoder's parameters as NumPy arrays (views where nothing is computed)."""
    c = cfg.decoder
    get = _Tensors(tensors, folder)
    prefix = next((p for p in PREFIXES if p + "embed_tokens.weight" in tensors), None)
    if prefix is None:
        raise ValueError(f"{folder}: no `model.embed_tokens.weight` (nor under "
                         f"`model.language_model.` or `language_model.model.`): not a "
                         f"checkpoint of a {cfg.arch} causal language model")
    d, e, nh, nkv, f = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, \
        c.intermediate_size
    gemma = cfg.arch in ("gemma2", "gemma3")

    def norm(name: str, size: int = d, what: str = "(hidden_size,)") -> np.ndarray:
        return get(name, (size,), what)

    params: dict[str, Any] = {
        "embed": get(prefix + "embed_tokens.weight", (c.vocab_size, d),
                     "(vocab_size, hidden_size)"),
        "norm": norm(prefix + "norm.weight"),
        "layers": [],
    }
    if cfg.tied:
        params["lm_head"] = None                                        # the embeddings'
    else:
        head = next((h for h in HEADS if h in tensors), HEADS[0])
        params["lm_head"] = get(head, (c.vocab_size, d), "(vocab_size, hidden_size)").T
    q_rows, kv_rows = nh * e, nkv * e
    for i in range(c.num_layers):
        pre = f"{prefix}layers.{i}."
        att = pre + "self_attn."
        layer: dict[str, Any] = {
            "attn_norm": norm(pre + "input_layernorm.weight"),
            "w_qkv": _linear(get(att + "q_proj.weight", (q_rows, d),
                                 "(num_attention_heads · head_dim, hidden_size)"),
                             get(att + "k_proj.weight", (kv_rows, d),
                                 "(num_key_value_heads · head_dim, hidden_size)"),
                             get(att + "v_proj.weight", (kv_rows, d),
                                 "(num_key_value_heads · head_dim, hidden_size)")),
            "w_o": _linear(get(att + "o_proj.weight", (d, q_rows),
                               "(hidden_size, num_attention_heads · head_dim)")),
        }
        if cfg.attention_bias:
            layer["b_qkv"] = np.concatenate([
                get(att + "q_proj.bias", (q_rows,), "(num_attention_heads · head_dim,)"),
                get(att + "k_proj.bias", (kv_rows,), "(num_key_value_heads · head_dim,)"),
                get(att + "v_proj.bias", (kv_rows,), "(num_key_value_heads · head_dim,)")])
            layer["b_o"] = get(att + "o_proj.bias", (d,), "(hidden_size,)")
        if cfg.arch in ("qwen3", "gemma3"):
            qn = norm(att + "q_norm.weight", e, "(head_dim,)")
            kn = norm(att + "k_norm.weight", e, "(head_dim,)")
            layer["qk_norm"] = np.stack([qn] * nh + [kn] * nkv)[:, None, :]  # (H+Hkv, 1, E)
        if cfg.arch == "gpt_oss":
            layer["sinks"] = get(att + "sinks", (nh,), "(num_attention_heads,)")
        if gemma:
            layer["post_attn_norm"] = norm(pre + "post_attention_layernorm.weight")
            layer["ffn_norm"] = norm(pre + "pre_feedforward_layernorm.weight")
            layer["post_ffn_norm"] = norm(pre + "post_feedforward_layernorm.weight")
        else:
            layer["ffn_norm"] = norm(pre + "post_attention_layernorm.weight")
        if cfg.arch == "gpt_oss":
            layer.update(_experts(get, pre + "mlp.", c.num_experts, d, f))
        else:
            mlp = pre + "mlp."
            layer["w_gate_up"] = _linear(
                get(mlp + "gate_proj.weight", (f, d), "(intermediate_size, hidden_size)"),
                get(mlp + "up_proj.weight", (f, d), "(intermediate_size, hidden_size)"))
            layer["w_down"] = _linear(get(mlp + "down_proj.weight", (d, f),
                                          "(hidden_size, intermediate_size)"))
            if cfg.mlp_bias:
                layer["b_gate_up"] = np.concatenate([
                    get(mlp + "gate_proj.bias", (f,), "(intermediate_size,)"),
                    get(mlp + "up_proj.bias", (f,), "(intermediate_size,)")])
                layer["b_down"] = get(mlp + "down_proj.bias", (d,), "(hidden_size,)")
        params["layers"].append(layer)
    _check_all_read(get, prefix, folder)
    return params


def _experts(get: Callable[..., np.ndarray], mlp: str, x: int, d: int, f: int
             ) -> dict[str, np.ndarray]:
    """gpt-oss's router and experts; gate and up (interleaved in the file) split in halves."""
    gate_up = get(mlp + "experts.gate_up_proj", (x, d, 2 * f),
                  "(num_local_experts, hidden_size, 2 · intermediate_size)")
    gate_up_bias = get(mlp + "experts.gate_up_proj_bias", (x, 2 * f),
                       "(num_local_experts, 2 · intermediate_size)")
    return {
        "router": get(mlp + "router.weight", (x, d), "(num_local_experts, hidden_size)").T,
        "b_router": get(mlp + "router.bias", (x,), "(num_local_experts,)"),
        # the file interleaves them: gate in the even features, up in the odd ones
        "w_gate_up": np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], axis=-1),
        "b_gate_up": np.concatenate([gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]],
                                    axis=-1),
        "w_down": get(mlp + "experts.down_proj", (x, f, d),
                      "(num_local_experts, intermediate_size, hidden_size)"),
        "b_down": get(mlp + "experts.down_proj_bias", (x, d), "(num_local_experts, hidden_size)"),
    }


def _check_all_read(get: _Tensors, prefix: str, folder: Any) -> None:
    """Every tensor of the text model was read: one left over means config.json and the
    weights disagree (biases the configuration does not announce, more layers, …)."""
    text = [n for n in get.tensors if (n.startswith(prefix) if prefix else not n.startswith(
        ("vision", "multi_modal")))]
    left = sorted(n for n in text if n not in get.read and n not in HEADS)
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise ValueError(f"{folder}: the tensors {', '.join(f'`{n}`' for n in left[:3])}"
                         f"{more} are not read by the {len(get.read)}-tensor model that "
                         "config.json describes (its `num_hidden_layers`, `attention_bias`, "
                         "`mlp_bias`, `tie_word_embeddings` …)")
