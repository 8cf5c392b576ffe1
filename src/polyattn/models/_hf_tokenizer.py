"""A transformers checkpoint's tokenizer (``tokenizer.json``, through the ``tokenizers``
library) and its special token ids.

The ids come from ``generation_config.json`` first (what transformers'
``generate`` stops at), then ``config.json``, then ``tokenizer_config.json``
(whose tokens are named by their text). A checkpoint without
``tokenizer.json`` still loads: its tokenizer knows the special ids, and
its text methods raise, saying that generation from token ids works.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polyattn.models._token_ids import check_token_id, check_token_ids


def _read_json(file: Path) -> dict[str, Any]:
    """A JSON object from ``file``; ``{}`` when the file is absent."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    """An id or a list of ids as a list (``None``: empty)."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


class CheckpointTokenizer:
    """Text to token ids and back, as the checkpoint's ``tokenizer.json`` says.

    Attributes
    ----------
    bos_id, eos_id, pad_id : int or None
        The beginning-of-sequence, (first) end-of-sequence and padding ids.
    eos_ids : tuple of int
        Every id that ends a sequence (Llama 3 and gpt-oss have several).
    vocab_size : int or None
        Tokens the tokenizer knows (``None`` without ``tokenizer.json``).
    """

    def __init__(self, tokenizer: Any, *, bos_id: int | None, eos_ids: Sequence[int],
                 pad_id: int | None, missing: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._missing = missing
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self.pad_id = pad_id
        self.vocab_size = None if tokenizer is None else tokenizer.get_vocab_size()

    def __repr__(self) -> str:
        what = "no text tokenizer" if self._tokenizer is None else f"{self.vocab_size} tokens"
        return f"CheckpointTokenizer({what}, eos {list(self.eos_ids)})"

    def _require(self) -> Any:
        if self._tokenizer is None:
            raise FileNotFoundError(self._missing)
        return self._tokenizer

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``; with ``add_special_tokens`` (default, as transformers'
        tokenizers) the tokens the checkpoint's template adds, e.g. Gemma's ``<bos>``.

        Raises
        ------
        TypeError
            ``text`` is not a str.
        FileNotFoundError
            The checkpoint has no ``tokenizer.json`` (or ``tokenizers`` is not
            installed); the message says so.
        """
        tok = self._require()
        if not isinstance(text, str):
            raise TypeError(f"`text` must be a str; got {type(text).__name__}")
        return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of token ids (special tokens included unless ``skip_special_tokens``).

        Raises
        ------
        TypeError
            An id is not an integer (the message gives its index).
        ValueError
            An id lies outside ``[0, vocab_size)``.
        """
        tok = self._require()
        checked = check_token_ids(ids, self.vocab_size or 0)
        return str(tok.decode(checked, skip_special_tokens=skip_special_tokens))

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (``<bos>``, ``<|im_end|>``, …): one of
        ``tokenizer.json``'s added tokens marked ``special``.

        Raises
        ------
        TypeError, ValueError
            ``token_id`` is not an integer, or lies outside the vocabulary.
        """
        tok = self._require()
        i = check_token_id(token_id, self.vocab_size or 0)
        added = tok.get_added_tokens_decoder().get(i)
        return bool(added is not None and added.special)


def load_tokenizer(folder: Path, token_ids: Mapping[str, Any]) -> CheckpointTokenizer:
    """The tokenizer of a checkpoint folder, special ids from its JSON files."""
    generation = _read_json(folder / "generation_config.json")
    settings = _read_json(folder / "tokenizer_config.json")
    tokenizer = None
    missing = None
    file = folder / "tokenizer.json"
    if file.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            missing = (f"{file} needs the `tokenizers` package, which is not installed "
                       "(pip install tokenizers); without it, pass token ids to generate()")
        else:
            try:
                tokenizer = Tokenizer.from_file(str(file))
            except Exception as exc:
                raise ValueError(f"{file}: cannot be read by `tokenizers` ({exc})") from None
    else:
        missing = (f"{folder} has no tokenizer.json, so this model cannot turn text into "
                   "tokens or back; pass token ids to generate() and stream()")

    def by_text(key: str) -> list[int]:
        value = settings.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if tokenizer is None or not isinstance(value, str):
            return []
        found = tokenizer.token_to_id(value)
        return [] if found is None else [found]

    def first(key: str) -> list[int]:
        for ids in (_ids(generation.get(key)), _ids(token_ids.get(key)),
                    by_text(key.replace("_token_id", "_token"))):
            if ids:
                return ids
        return []

    bos, eos, pad = first("bos_token_id"), first("eos_token_id"), first("pad_token_id")
    return CheckpointTokenizer(tokenizer, bos_id=bos[0] if bos else None, eos_ids=eos,
                               pad_id=pad[0] if pad else None, missing=missing)
