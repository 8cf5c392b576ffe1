"""Byte-level BPE (GPT-2 style) in pure Python: the SmolLM2 tokenizer.

A text is cut into pieces in three steps, then each piece is encoded on its
own:

1. the control tokens (``<|im_start|>``, ``<|endoftext|>``, …) written in the
   text are taken out whole;
2. every number character (Unicode category N) becomes a piece of its own
   (SmolLM2 spells numbers digit by digit);
3. the rest is split by GPT-2's pattern
   ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``
   (a scanner here, so no ``regex`` package is needed).

Each piece's UTF-8 bytes are spelled with GPT-2's byte-to-unicode map (the
printable bytes stand for themselves, the others for code points from 256
on, so a space is ``Ġ`` and a newline ``Ċ``), and adjacent symbols are
merged, lowest merge rank first, until no listed merge applies. Decoding
maps each token's characters back to bytes and reads them as UTF-8.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from functools import lru_cache

#: Unicode's White_Space characters: what ``\s`` matches in the tokenizer's pattern.
WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
    "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_CONTRACTIONS_2 = frozenset("stmd")
_CONTRACTIONS_3 = frozenset(("re", "ve", "ll"))
#: ``token_type`` of the control tokens in a GGUF vocabulary.
CONTROL = 3


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters.

    Bytes that are printable Latin-1 characters (``!`` … ``~``, ``¡`` … ``¬``,
    ``®`` … ``ÿ``) stand for themselves; the other 68 get the code points
    256, 257, … in order.

    Examples
    --------
    >>> from polyattn.models._bpe import bytes_to_unicode
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
    >>> from polyattn.models._bpe import split_gpt2
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
    >>> from polyattn.models._bpe import pretokenize
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


class BPETokenizer:
    """A byte-level BPE tokenizer from a vocabulary and a ranked list of merges.

    Parameters
    ----------
    tokens : sequence of str
        The vocabulary, spelled with :func:`bytes_to_unicode`; token ``i``
        has id ``i``.
    merges : sequence of str
        ``"a b"`` strings, best (applied first) first.
    token_types : sequence of int, optional
        GGUF token types; those equal to 3 (control) are matched whole in
        the text, before any splitting.
    bos_id, eos_id, pad_id : int, optional
        The special ids (not added by :meth:`encode`; a chat template writes
        them as text).

    Examples
    --------
    >>> from polyattn.models._bpe import BPETokenizer
    >>> tok = BPETokenizer(["a", "b", "Ġ", "ab", "Ġab", "<s>"], ["a b", "Ġ ab"],
    ...                    token_types=[1, 1, 1, 1, 1, 3])
    >>> tok.encode("ab ab<s>")
    [3, 4, 5]
    >>> tok.decode([3, 4, 5])
    'ab ab<s>'
    """

    def __init__(self, tokens: Sequence[str], merges: Iterable[str], *,
                 token_types: Sequence[int] | None = None, bos_id: int | None = None,
                 eos_id: int | None = None, pad_id: int | None = None) -> None:
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            a, _, b = merge.partition(" ")
            self.ranks[(a, b)] = rank
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.special = ([t for t, kind in zip(self.tokens, token_types, strict=True)
                         if kind == CONTROL] if token_types is not None else [])
        self._special = frozenset(self.special)
        longest_first = sorted(self.special, key=len, reverse=True)
        self._special_re = (re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
                            if longest_first else None)
        self._byte_char = bytes_to_unicode()
        self._char_byte = {c: b for b, c in self._byte_char.items()}
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def split(self, text: str) -> list[str]:
        """The pieces ``text`` is cut into before BPE: control tokens whole, then
        :func:`pretokenize` between them."""
        if not isinstance(text, str):
            raise TypeError(f"`text` must be a str; got {type(text).__name__}")
        chunks = self._special_re.split(text) if self._special_re is not None else [text]
        pieces: list[str] = []
        for k, chunk in enumerate(chunks):
            if k % 2:                      # a control token, matched whole
                pieces.append(chunk)
            elif chunk:
                pieces.extend(pretokenize(chunk))
        return pieces

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no BOS/EOS added)."""
        ids: list[int] = []
        for piece in self.split(text):
            special = self.ids.get(piece) if piece in self._special else None
            ids.extend([special] if special is not None else self._encode_piece(piece))
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        symbols = [self._byte_char[b] for b in piece.encode("utf-8")]
        while len(symbols) > 1:
            best, at = None, -1
            for j in range(len(symbols) - 1):
                rank = self.ranks.get((symbols[j], symbols[j + 1]))
                if rank is not None and (best is None or rank < best):
                    best, at = rank, j
            if best is None:
                break
            first, second = symbols[at], symbols[at + 1]
            out = symbols[:at]             # every occurrence of the best pair, left to right
            j = at
            while j < len(symbols):
                if j + 1 < len(symbols) and symbols[j] == first and symbols[j + 1] == second:
                    out.append(first + second)
                    j += 2
                else:
                    out.append(symbols[j])
                    j += 1
            symbols = out
        ids = [self.ids[s] for s in symbols]
        if len(self._cache) < 100_000:
            self._cache[piece] = ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a control token: its text in UTF-8)."""
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id must be in 0..{len(self.tokens) - 1}; got {token_id}")
        text = self.tokens[token_id]
        table = self._char_byte
        if all(c in table for c in text):
            return bytes(table[c] for c in text)
        return text.encode("utf-8")

    def decode(self, token_ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``; bytes that are not valid UTF-8 become U+FFFD.

        Parameters
        ----------
        token_ids : iterable of int
        skip_special_tokens : bool
            Leave out the control tokens (``<|im_end|>``, ``<|im_start|>``,
            …). Default False: they are written as their text.

        Examples
        --------
        >>> from polyattn.models._bpe import BPETokenizer
        >>> tok = BPETokenizer(["H", "i", "<e>"], [], token_types=[1, 1, 3])
        >>> tok.decode([0, 1, 2]), tok.decode([0, 1, 2], skip_special_tokens=True)
        ('Hi<e>', 'Hi')
        """
        ids = [int(i) for i in token_ids]
        if skip_special_tokens:
            ids = [i for i in ids if not (0 <= i < len(self.tokens)
                                          and self.tokens[i] in self._special)]
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
