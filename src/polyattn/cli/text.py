"""Words and numbers on the command line: the user error, integers, bytes, safe text."""

from __future__ import annotations

import argparse
import decimal


class CLIError(Exception):
    """A user error: printed as one line on stderr, exit status 2."""


def _plural(n: int, noun: str) -> str:
    """``"1 token"``, ``"2 tokens"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


#: The largest magnitude :func:`integer` accepts (a 64-bit seed fits).
MAX_INTEGER = 2 ** 64 - 1


def _clip(text: str, width: int = 40) -> str:
    """``text`` in quotes, cut in the middle when longer than ``width`` characters."""
    if len(text) > width:
        text = f"{text[:width // 2]}…{text[-width // 4:]}"
    return f"'{shown(text)}'"


def integer(text: str) -> int:
    """An option's integer: ``"32"``, or a whole number in exponent notation (``"1e3"``).

    Raises
    ------
    argparse.ArgumentTypeError
        For anything else (``"1.5"``, ``"nan"``, ``"inf"``, ``""``), and beyond
        ±(2^64 - 1); argparse names the option.
    """
    try:
        value = decimal.Decimal(int(text))
    except ValueError:
        try:
            value = decimal.Decimal(text.strip())
        except decimal.InvalidOperation:
            value = decimal.Decimal("nan")
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected a whole number such as 32; got "
                                         f"{_clip(text)}")
    if value.adjusted() > 20 or abs(value) > MAX_INTEGER:
        raise argparse.ArgumentTypeError(f"{_clip(text)} is too large (at most 2^64 - 1)")
    return int(value)


def check_utf8(text: str, what: str) -> None:
    """Raise :class:`CLIError` naming ``what`` if ``text`` cannot be encoded as UTF-8.

    Bytes of the command line that are not UTF-8 reach Python as lone
    surrogates (U+DC80 to U+DCFF, "surrogateescape"); they are named as the
    bytes they stand for.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        found = (f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF
                 else f"the lone surrogate U+{code:04X}")
        raise CLIError(f"{what} is not valid UTF-8: character {exc.start} is {found}; give "
                       "the text in UTF-8 (is the terminal set to another encoding?)") from None


def shown(text: str) -> str:
    """``text`` safe to print anywhere: bytes that are not UTF-8 shown as ``\\xff``."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def format_bytes(n: int) -> str:
    """A byte count in decimal units, exact bytes beside it.

    Examples
    --------
    >>> format_bytes(4_608_230_400)
    '4.61 GB (4,608,230,400 bytes)'
    >>> format_bytes(512)
    '512 bytes'
    >>> format_bytes(46_080_000_000 * 10 ** 12)
    '46.1 ZB (46,080,000,000,000,000,000,000 bytes)'
    """
    if n < 1000:
        return _plural(n, "byte")
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"):
        value /= 1000.0
        if value < 999.5:           # 999.5 and up round to "1e+03" in three digits
            return f"{value:.3g} {unit} ({n:,} bytes)"
    return f"{float(n):.3g} bytes"   # beyond a thousand YB: no unit is shorter
