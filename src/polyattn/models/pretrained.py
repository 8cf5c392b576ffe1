"""Open decoders from a transformers checkpoint, on any Array API library, attention by polyattn.

:func:`from_pretrained` reads a checkpoint folder as transformers'
``save_pretrained`` writes it (and as the Hub serves it): ``config.json``,
the weights in ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``), and where present ``tokenizer.json``,
``generation_config.json`` and ``tokenizer_config.json``. The safetensors
files are read with NumPy alone (bfloat16 included), so neither torch nor
transformers is needed; the tokenizer needs the ``tokenizers`` package.

Architectures (``model_type``) and what their attention is in polyattn's
terms:

``llama``
    Llama 2 and 3 (SmolLM2 too): grouped-query attention, rotary positions
    (plain, ``linear`` or Llama 3.1's ``llama3`` scaling), SwiGLU.
``qwen3``
    Llama's layout with QK-norm: an RMSNorm over each head's queries and
    keys before the rotary embedding; optional sliding layers.
``gemma2``
    Sliding (``window``) and full layers alternating, attention logits
    soft-capped (``softcap``), scale ``query_pre_attn_scalar ** -0.5``,
    RMSNorm ``(1 + w)`` before and after attention and feed-forward, GeGLU
    (tanh GELU), embeddings scaled by ``sqrt(hidden_size)``, final logits
    soft-capped.
``gemma3``, ``gemma3_text``
    Gemma 2's layout, with five sliding layers to one full one, QK-norm,
    and a rotary base of its own for the sliding layers
    (``rope_local_base_freq``; the full layers' may be scaled); no
    attention softcap. Of a multimodal ``gemma3`` checkpoint, its text
    model.
``gpt_oss``
    Learned attention sinks (``sinks``), alternating 128-token banded and
    full layers, YaRN rotary scaling, attention biases, and a mixture of
    experts (top-k router, clamped SwiGLU), computed densely.

Each layer's attention is one call of
:func:`polyattn.scaled_dot_product_attention` with the keywords above, and
the past keys and values of decoding live in :class:`polyattn.KVCache`.
The model's ``config`` (a :class:`DecoderConfig`) says what each layer does:
``config.layers[i].window`` is the ``left`` of ``window=(left, 0)`` (a
transformers ``sliding_window`` of W keeps the W - 1 keys before each
query and the query itself), ``config.layers[i].rope`` names the rotary
embedding in ``config.ropes`` (its frequencies from
:func:`polyattn.rotary_frequencies`).

Rotary angles are computed in float64 for a float64 model (transformers
computes them in float32 whatever the model's dtype), float32 otherwise.
bfloat16 and float16 models normalise in float32, as transformers does.

Shapes: ``B`` sequences, ``T`` tokens, ``V`` tokens in the vocabulary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from polyattn._interop import library_name
from polyattn.models._arrays import _resolve
from polyattn.models._decoder_config import DecoderConfig, LayerSpec, RopeSpec
from polyattn.models._generation import CausalLM
from polyattn.models._hf_config import ARCHITECTURES, CheckpointConfig, read_config
from polyattn.models._hf_tokenizer import CheckpointTokenizer, load_tokenizer
from polyattn.models._hf_weights import decoder_params
from polyattn.models._safetensors import Checkpoint

__all__ = ["ARCHITECTURES", "CheckpointConfig", "CheckpointTokenizer", "DecoderConfig",
           "LayerSpec", "PretrainedLM", "RopeSpec", "from_pretrained"]

#: A checkpoint's ``dtype`` and the dtype it is loaded in by default where the
#: library lacks it (NumPy and CuPy have no bfloat16).
_WIDER = {"bfloat16": "float32"}


class PretrainedLM(CausalLM):
    """A decoder read from a transformers checkpoint; build it with :func:`from_pretrained`.

    Call it on token ids for logits, ``model(token_ids)`` → (B, T, V) (or
    (T, V) for one sequence), optionally with ``cache=model.new_cache(B,
    capacity)`` to decode step by step and ``lengths=`` for right-padded
    rows; :meth:`generate` continues a batch of prompts of different
    lengths, :meth:`stream` one prompt token by token.

    Attributes
    ----------
    config : DecoderConfig
        The network's hyper-parameters, per layer (``config.layers``: each
        layer's sliding window and rotary embedding) and the features
        (``attn_softcap``, ``num_experts``, …).
    checkpoint : CheckpointConfig
        What else ``config.json`` said: the architecture, tied embeddings,
        biases, the stored dtype, the special token ids.
    tokenizer : CheckpointTokenizer
        ``encode``/``decode`` by ``tokenizer.json``, and ``eos_ids``,
        ``bos_id``, ``pad_id``.
    path : Path
        The checkpoint folder.
    params : dict
        The weights, laid out as described in
        :class:`polyattn.models._decoder.Decoder`.
    xp, device, dtype
        Where the weights are.

    Notes
    -----
    A sequence holds at most ``config.context_length`` tokens
    (``max_position_embeddings``). Nothing is promised about one model used
    from several threads at once: a cache is written by every call given it.
    """

    def __init__(self, params: dict[str, Any], config: DecoderConfig,
                 tokenizer: CheckpointTokenizer, *, checkpoint: CheckpointConfig,
                 path: Path) -> None:
        super().__init__(params, config, tokenizer)
        self.checkpoint = checkpoint
        self.path = path

    def __repr__(self) -> str:
        c = self.spec
        return (f"PretrainedLM({c.model_type}, {c.num_layers} layers, "
                f"{c.num_heads}/{c.num_kv_heads} heads, {library_name(self.xp)} {self.dtype}, "
                f"{str(self.path)!r})")


def _read_config(folder: Path) -> tuple[dict[str, Any], Path]:
    file = folder / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: give the folder of a "
                                "transformers checkpoint (as save_pretrained writes it)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    return raw, file


def _dtype_name(cfg: CheckpointConfig, tensors: Checkpoint, embed_name: str) -> str:
    """The checkpoint's own dtype: config.json's, else that of its token embeddings."""
    if cfg.dtype in ("float16", "bfloat16", "float32", "float64"):
        return cfg.dtype
    stored = tensors.dtypes.get(embed_name, "F32")
    return {"BF16": "bfloat16", "F16": "float16", "F64": "float64"}.get(stored, "float32")


def from_pretrained(path: str | os.PathLike[str], /, *, xp: Any = None, dtype: Any = None,
                    device: Any = None) -> PretrainedLM:
    """Read a transformers checkpoint folder into an array library.

    Parameters
    ----------
    path : path-like
        A local folder (nothing is downloaded: fetch a Hub model first, e.g.
        with ``huggingface-cli download``; ``~`` is expanded):
        ``config.json`` and ``*.safetensors`` (or a
        ``model.safetensors.index.json`` and its shards); ``tokenizer.json``,
        ``generation_config.json`` and ``tokenizer_config.json`` where
        present.
    xp : namespace or str, optional
        The array library: a namespace or module (``numpy``, ``torch``,
        ``cupy``, ``jax.numpy``), or its name (``"torch"`` picks CUDA when
        available). Default NumPy. On JAX a float64 model, however its
        dtype is given (or a float64 checkpoint by default), switches on
        64-bit mode (``jax_enable_x64``), as JAX would otherwise give float32.
    dtype : str or dtype, optional
        ``"float32"``, ``"float64"``, ``"float16"`` or ``"bfloat16"`` (where
        the library has it), the library's own dtype (``torch.float64``), or
        a NumPy dtype, taken by its name on any library (``np.float32``).
        Python's ``float`` is refused (its width differs between libraries).
        Default: the checkpoint's dtype (``config.json``'s ``dtype``, else
        its weights'), except that a bfloat16 checkpoint is loaded in float32
        on libraries without bfloat16 (NumPy, CuPy). Weights are cast to it;
        bfloat16 weights are first widened to float32 exactly.
    device : optional
        Where the weights go (e.g. ``"cuda"`` for torch); on JAX a
        ``jax.Device`` or a name (``"cpu"``, ``"gpu"``, ``"gpu:1"``).

    Returns
    -------
    PretrainedLM
        Its ``tokenizer.eos_ids`` are what ``generate`` and ``stream`` stop
        at: ``generation_config.json``'s ``eos_token_id``, else
        ``config.json``'s, else ``tokenizer_config.json``'s ``eos_token``.
        A checkpoint that names none has no end-of-sequence token: as with
        transformers, generation then runs to ``max_new_tokens``.

    Raises
    ------
    FileNotFoundError
        ``path`` is not a folder, or lacks ``config.json`` or safetensors
        files.
    ModuleNotFoundError
        ``xp`` names a library that is not installed (the message says what
        to install).
    ValueError
        An architecture or a configuration field that is not supported,
        a malformed or truncated file, a tensor missing, of the wrong shape
        or left unread; the message names the file, the field or tensor,
        and its value, e.g. ``config.json: `model_type` 'mistral' is not
        supported; supported: gemma2, gemma3, gemma3_text, gpt_oss, llama,
        qwen3``; also ``dtype`` a floating dtype the library lacks
        (``"bfloat16"`` on NumPy), ``device`` a name of no JAX device.
    TypeError
        ``dtype`` is not a real floating dtype (``"int32"``, Python's
        ``float``), or is another library's (``torch.float64`` on NumPy).

    Examples
    --------
    A tiny Llama checkpoint written here, to show the calls (any
    transformers checkpoint folder will do; ``save_pretrained`` writes one):

    >>> import json, pathlib, tempfile
    >>> import numpy as np
    >>> from polyattn.models import from_pretrained
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> config = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
    ...           "intermediate_size": 12, "num_hidden_layers": 1,
    ...           "num_attention_heads": 2, "num_key_value_heads": 1,
    ...           "tie_word_embeddings": True}
    >>> _ = (folder / "config.json").write_text(json.dumps(config))
    >>> shapes = {"embed_tokens": (16, 8), "norm": (8,),
    ...           "layers.0.input_layernorm": (8,),
    ...           "layers.0.post_attention_layernorm": (8,),
    ...           "layers.0.self_attn.q_proj": (8, 8), "layers.0.self_attn.k_proj": (4, 8),
    ...           "layers.0.self_attn.v_proj": (4, 8), "layers.0.self_attn.o_proj": (8, 8),
    ...           "layers.0.mlp.gate_proj": (12, 8), "layers.0.mlp.up_proj": (12, 8),
    ...           "layers.0.mlp.down_proj": (8, 12)}
    >>> rng = np.random.default_rng(0)
    >>> header, data = {}, b""          # safetensors: header length, JSON header, bytes
    >>> for name, shape in shapes.items():
    ...     a = rng.standard_normal(shape).astype(np.float32).tobytes()
    ...     header[f"model.{name}.weight"] = {"dtype": "F32", "shape": list(shape),
    ...                                       "data_offsets": [len(data), len(data) + len(a)]}
    ...     data += a
    >>> head = json.dumps(header).encode()
    >>> _ = (folder / "model.safetensors").write_bytes(
    ...     len(head).to_bytes(8, "little") + head + data)
    >>> model = from_pretrained(folder)
    >>> model.dtype
    dtype('float32')
    >>> model([[1, 2, 3]]).shape                     # logits (B, T, V)
    (1, 3, 16)
    >>> len(model.generate([[1, 2, 3], [4, 5]], 4, stop_at_eos=False)[1])
    4

    A real checkpoint, on torch:

    >>> model = from_pretrained("Qwen3-0.6B", xp="torch")             # doctest: +SKIP
    >>> ids = model.tokenizer.encode("The capital of France is")      # doctest: +SKIP
    >>> model.tokenizer.decode(model.generate(ids, 8))                # doctest: +SKIP
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: give the folder of a transformers "
                                "checkpoint (config.json and *.safetensors)")
    raw, file = _read_config(folder)
    cfg = read_config(raw, file)
    tensors = Checkpoint(folder)
    params_np = decoder_params(tensors, cfg, folder)
    embed_name = next(n for n in tensors if n.endswith("embed_tokens.weight"))
    if dtype is None:
        dtype = _dtype_name(cfg, tensors, embed_name)
        if dtype in _WIDER and not hasattr(_resolve(xp, "float32", device)[0], dtype):
            dtype = _WIDER[dtype]
    xp, dtype, device = _resolve(xp, dtype, device)
    numpy_target = library_name(xp) == "numpy"

    def put(a: np.ndarray) -> Any:
        # other libraries may share a NumPy array's memory: give them a writable copy of the
        # (read-only) memory map, never the map itself
        host = a if numpy_target else np.array(a)
        return xp.asarray(host, dtype=dtype, device=device)

    params: dict[str, Any] = {
        "embed": put(params_np["embed"]),
        "norm": put(params_np["norm"]),
        "layers": [{name: put(w) for name, w in layer.items()}
                   for layer in params_np["layers"]],
    }
    params["lm_head"] = (xp.matrix_transpose(params["embed"]) if params_np["lm_head"] is None
                         else put(params_np["lm_head"]))                # (D, V)
    tokenizer = load_tokenizer(folder, cfg.token_ids)
    return PretrainedLM(params, cfg.decoder, tokenizer, checkpoint=cfg, path=folder)
