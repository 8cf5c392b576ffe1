"""The hyper-parameters of a BERT encoder, read from a ``config.json`` and checked.

Also the helpers that make messages about untrusted files: a path printable
anywhere (:func:`_printable`), a short ``repr`` of a value read
(:func:`_brief`), an error on one line (:func:`_one_line`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
