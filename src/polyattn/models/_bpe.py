"""Byte-level BPE (GPT-2 style): the SmolLM2 tokenizer, in pure Python or ``tokenizers``.

A text is cut into pieces in three steps, then each piece is encoded on its
own:

1. the control tokens (``<|im_start|>``, ``<|endoftext|>``, …) written in the
   text are taken out whole;
2. every number character (Unicode category N) becomes a piece of its own
   (SmolLM2 spells numbers digit by digit);
3. the rest is split by GPT-2's pattern
   ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``
   (by a scanner, so no ``regex`` package is needed).

Each piece's UTF-8 bytes are spelled with GPT-2's byte-to-unicode map (the
printable bytes stand for themselves, the others for code points from 256
on, so a space is ``Ġ`` and a newline ``Ċ``), and adjacent symbols are
merged, lowest merge rank first, until no listed merge applies. Decoding
maps each token's characters back to bytes and reads them as UTF-8.

A byte whose character is not in the vocabulary is left out before merging,
so its neighbours may merge across it, as transformers does with the same
file (the ``tokenizers`` library, for a BPE model without an unknown token);
llama.cpp leaves such bytes out too, but only after merging. SmolLM2's
vocabulary lacks 21 bytes: 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xc0, 0xc1,
0xf1, 0xf2 and 0xf5 … 0xff (no UTF-8 text holds 0xc0, 0xc1 or 0xf5 … 0xff;
0xf1 and 0xf2 lead the code points U+40000 … U+BFFFF, whose other three
bytes stay). Such text does not round-trip;
:attr:`BPETokenizer.missing_bytes` lists the bytes.

Encoding runs the ``tokenizers`` library (what transformers runs) where it
is installed, given the same rules, and the pure-Python code of this module
otherwise (the ``models`` extra installs only ``gguf``). They agree except
on characters newer than Python's Unicode tables (``unicodedata``; Python
3.11 has Unicode 14), which the Python code splits as unassigned ones: the
tests compare the two, and ``tokenizers`` with transformers, on a sample of
every kind of code point and on random text. transformers itself, loading
the GGUF file, does not know llama.cpp's ``smollm`` pre-tokenizer and keeps
GPT-2's split, so it gives other ids for a number character such as ``½``
after a space; everything else is the same.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Sequence
from typing import Any

from polyattn.models._pretokenize import WHITESPACE, bytes_to_unicode, pretokenize, split_gpt2
from polyattn.models._token_ids import check_token_id, check_token_ids

__all__ = [
    "CONTROL",
    "ENGINES",
    "WHITESPACE",
    "BPETokenizer",
    "bytes_to_unicode",
    "check_token_id",
    "check_token_ids",
    "pretokenize",
    "split_gpt2",
]

#: ``token_type`` of the control tokens in a GGUF vocabulary.
CONTROL = 3
#: What :meth:`BPETokenizer.encode` may run.
ENGINES = ("auto", "tokenizers", "python")


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
    engine : {"auto", "tokenizers", "python"}
        What :meth:`encode` runs: the ``tokenizers`` library (what
        transformers runs; its Unicode tables are its own) or the pure-Python
        code of this module (Python's Unicode tables, ``unicodedata``).
        Default ``"auto"``: ``tokenizers`` where it is installed. The two
        give the same ids except on characters that Python's Unicode
        version does not know yet (Python 3.11 has Unicode 14), which the
        Python engine splits as unassigned ones.

    Raises
    ------
    ValueError
        A merge is not two tokens of the vocabulary whose concatenation is
        one too; ``engine`` is not one of the three.
    ModuleNotFoundError
        ``engine="tokenizers"`` without the ``tokenizers`` package.

    Notes
    -----
    Nothing is promised about one tokenizer used from several threads at
    once (the Python engine keeps a memo of the pieces it has encoded).

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
                 eos_id: int | None = None, pad_id: int | None = None,
                 engine: str = "auto") -> None:
        if engine not in ENGINES:
            raise ValueError(f"`engine` must be one of {', '.join(map(repr, ENGINES))}; got "
                             f"{engine!r}")
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            a, _, b = merge.partition(" ")
            if not (a in self.ids and b in self.ids and a + b in self.ids):
                raise ValueError(
                    f"`merges` entry {rank} must be two tokens of the vocabulary, "
                    f"separated by a space, that make a token of the vocabulary; got "
                    f"{merge!r}")
            self.ranks[(a, b)] = rank
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.special = ([t for t, kind in zip(self.tokens, token_types, strict=True)
                         if kind == CONTROL] if token_types is not None else [])
        self._special = frozenset(self.special)
        longest_first = sorted(filter(None, self.special), key=len, reverse=True)
        self._special_re = (re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
                            if longest_first else None)
        self._byte_char = bytes_to_unicode()
        self._char_byte = {c: b for b, c in self._byte_char.items()}
        #: each byte's character, or None where the vocabulary has no token for it
        self._symbol = [c if c in self.ids else None
                        for c in (self._byte_char[b] for b in range(256))]
        self._cache: dict[str, list[int]] = {}
        self._fast: Any = None
        if engine == "auto":
            engine = "tokenizers" if importlib.util.find_spec("tokenizers") else "python"
        if engine == "tokenizers" and importlib.util.find_spec("tokenizers") is None:
            raise ModuleNotFoundError("engine='tokenizers' needs the `tokenizers` package; "
                                      "install it with `pip install tokenizers`, or use "
                                      "engine='python'", name="tokenizers")
        #: What :meth:`encode` runs: ``"tokenizers"`` or ``"python"``.
        self.engine = engine

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def missing_bytes(self) -> tuple[int, ...]:
        """The byte values with no token in the vocabulary, which :meth:`encode` leaves out.

        Examples
        --------
        >>> from polyattn.models._bpe import BPETokenizer, bytes_to_unicode
        >>> table = bytes_to_unicode()
        >>> BPETokenizer([table[b] for b in range(256) if b != 4], []).missing_bytes
        (4,)
        """
        return tuple(b for b, c in enumerate(self._symbol) if c is None)

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
        """The token ids of ``text`` (no BOS/EOS added).

        Bytes of ``text`` that have no token (:attr:`missing_bytes`) are left
        out, as transformers' and llama.cpp's tokenizers leave them out.
        Runs :attr:`engine`.

        Raises
        ------
        TypeError
            ``text`` is not a str.
        ValueError
            ``text`` holds a lone surrogate (U+D800 … U+DFFF), which has no
            UTF-8 bytes: what ``surrogateescape`` makes of bytes that are
            not UTF-8.
        """
        if not isinstance(text, str):
            raise TypeError(f"`text` must be a str; got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"`text` holds the lone surrogate U+{ord(text[exc.start]):04X} at index "
                f"{exc.start}, which is not a character and has no UTF-8 bytes; decode "
                "the bytes the text came from with errors='replace' (U+FFFD for what is "
                "not UTF-8) rather than 'surrogateescape'") from None
        if self.engine == "tokenizers":
            return self._tokenizers().encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for piece in self.split(text):
            special = self.ids.get(piece) if piece in self._special else None
            ids.extend([special] if special is not None else self._encode_piece(piece))
        return ids

    def _tokenizers(self) -> Any:
        """The same tokenizer in the ``tokenizers`` library, built on first use.

        A BPE model without an unknown token (bytes without a token are left
        out), the control tokens matched whole, every number character apart
        (``Digits(individual_digits=True)``, as in SmolLM2's published
        ``tokenizer.json``), then GPT-2's byte-level split.
        """
        if self._fast is None:
            from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

            merges = sorted(self.ranks, key=self.ranks.__getitem__)
            fast = Tokenizer(models.BPE(vocab=dict(self.ids), merges=merges))
            fast.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
            fast.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                     for t in self.special if t])
            self._fast = fast
        return self._fast

    def _encode_piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        symbols = [c for c in map(self._symbol.__getitem__, piece.encode("utf-8"))
                   if c is not None]
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
        """The bytes token ``token_id`` stands for (a control token: its text in UTF-8).

        Raises
        ------
        TypeError
            ``token_id`` is not an integer.
        ValueError
            ``token_id`` lies outside the vocabulary.
        """
        return self._bytes(check_token_id(token_id, len(self.tokens)))

    def decode(self, token_ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``; bytes that are not valid UTF-8 become U+FFFD.

        Parameters
        ----------
        token_ids : iterable of int
            Python or NumPy integers (a list, a 1-D integer array, …), each in
            ``[0, vocab_size)``.
        skip_special_tokens : bool
            Leave out the control tokens (``<|im_end|>``, ``<|im_start|>``,
            …). Default False: they are written as their text.

        Raises
        ------
        TypeError
            ``token_ids`` is text, or holds something that is not an integer
            (a float, even ``2.0``; a bool; a str).
        ValueError
            An id lies outside the vocabulary.

        Examples
        --------
        >>> from polyattn.models._bpe import BPETokenizer
        >>> tok = BPETokenizer(["H", "i", "<e>"], [], token_types=[1, 1, 3])
        >>> tok.decode([0, 1, 2]), tok.decode([0, 1, 2], skip_special_tokens=True)
        ('Hi<e>', 'Hi')
        """
        ids = check_token_ids(token_ids, len(self.tokens))
        if skip_special_tokens:
            ids = [i for i in ids if self.tokens[i] not in self._special]
        return b"".join(map(self._bytes, ids)).decode("utf-8", errors="replace")

    def _bytes(self, i: int) -> bytes:
        """:meth:`token_bytes` of a checked id."""
        text = self.tokens[i]
        table = self._char_byte
        if all(c in table for c in text):
            return bytes(table[c] for c in text)
        return text.encode("utf-8")
