"""Byte-level BPE's alphabet and the pieces SmolLM2's tokenizer cuts text into.

GPT-2's byte-to-unicode map (:func:`bytes_to_unicode`) spells any bytes
with printable characters. Before merging, text is cut into pieces: every
number character (Unicode category N) alone, then GPT-2's pattern
``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``
on the text between (:func:`pretokenize`, :func:`split_gpt2`: a scanner, so no
``regex`` package is needed). :mod:`polyattn.models._bpe` merges the pieces.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache

#: Unicode's White_Space characters: what ``\s`` matches in the tokenizer's pattern.
WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
    "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_CONTRACTIONS_2 = frozenset("stmd")
_CONTRACTIONS_3 = frozenset(("re", "ve", "ll"))


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters.

    Bytes that are printable Latin-1 characters (``!`` … ``~``, ``¡`` … ``¬``,
    ``®`` … ``ÿ``) stand for themselves; the other 68 get the code points
    256, 257, … in order.

    Examples
    --------
    >>> from polyattn.models._pretokenize import bytes_to_unicode
    >>> m = bytes_to_unicode()
    >>> m[ord("a")], m[ord(" ")], m[ord("\\n")]
    ('a', 'Ġ', 'Ċ')
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _kind(c: str) -> str:
    """``"L"`` letter, ``"N"`` number, ``"S"`` whitespace, ``"O"`` anything else."""
    if c in WHITESPACE:
        return "S"
    cat = unicodedata.category(c)[0]
    return cat if cat in ("L", "N") else "O"


def split_gpt2(text: str) -> list[str]:
    """Split ``text`` by GPT-2's pre-tokenizer pattern (see the module docstring).

    Examples
    --------
    >>> from polyattn.models._pretokenize import split_gpt2
    >>> split_gpt2("I'll see  you\\n\\nthere!")   # a newline before a word stays apart
    ['I', "'ll", ' see', ' ', ' you', '\\n', '\\n', 'there', '!']
    """
    pieces = []
    n = len(text)
    kinds = [_kind(c) for c in text]
    i = 0
    while i < n:
        c = text[i]
        if c == "'" and i + 1 < n:
            if text[i + 1] in _CONTRACTIONS_2:
                pieces.append(text[i:i + 2])
                i += 2
                continue
            if text[i + 1:i + 3] in _CONTRACTIONS_3:
                pieces.append(text[i:i + 3])
                i += 3
                continue
        kind = kinds[i]
        start = i
        if c == " " and i + 1 < n and kinds[i + 1] != "S":
            kind = kinds[i + 1]      # ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
            i += 1
        if kind != "S":
            while i < n and kinds[i] == kind:
                i += 1
            pieces.append(text[start:i])
            continue
        while i < n and kinds[i] == "S":
            i += 1
        if i < n and i - start > 1:  # `\s+(?!\S)`: leave the last space to the next word
            i -= 1
        pieces.append(text[start:i])
    return pieces


def pretokenize(text: str) -> list[str]:
    """Numbers digit by digit, then GPT-2's pattern on the text between them.

    Examples
    --------
    >>> from polyattn.models._pretokenize import pretokenize
    >>> pretokenize("In 2024, x42")
    ['In', ' ', '2', '0', '2', '4', ',', ' x', '4', '2']
    """
    pieces: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if unicodedata.category(c)[0] == "N":
            if start < i:
                pieces.extend(split_gpt2(text[start:i]))
            pieces.append(c)
            start = i + 1
    if start < len(text):
        pieces.extend(split_gpt2(text[start:]))
    return pieces
