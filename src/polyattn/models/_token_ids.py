"""Token ids given by a caller, checked: integers inside the vocabulary."""

from __future__ import annotations

import operator
from typing import Any


def _describe(value: Any) -> str:
    """A short account of a value for a message: its type, and its repr unless it is an array."""
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) != ():
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def check_token_id(value: Any, vocab_size: int, *, name: str = "token_id") -> int:
    """``value`` as a token id: an integer (Python, NumPy, or a one-element integer
    array) in ``[0, vocab_size)``.

    Raises
    ------
    TypeError
        ``value`` is not an integer: a float (even ``2.0``), a bool, a str, …
    ValueError
        It lies outside the vocabulary.

    Examples
    --------
    >>> from polyattn.models._token_ids import check_token_id
    >>> check_token_id(3, 10)
    3
    >>> check_token_id(1.5, 10)
    Traceback (most recent call last):
    ...
    TypeError: `token_id` must be an int; got float 1.5
    """
    dtype = getattr(value, "dtype", None)
    if isinstance(value, bool) or (dtype is not None and "bool" in str(dtype)):
        raise TypeError(f"`{name}` must be an int, not a bool; got {_describe(value)}")
    try:
        i = operator.index(value)
    except TypeError:
        raise TypeError(f"`{name}` must be an int; got {_describe(value)}") from None
    if not 0 <= i < vocab_size:
        raise ValueError(f"`{name}` must lie in [0, {vocab_size}) (the vocabulary); got {i}")
    return i


def check_token_ids(values: Any, vocab_size: int, *, name: str = "token_ids") -> list[int]:
    """``values`` (a sequence or 1-D array of integers) as a list of token ids.

    Raises
    ------
    TypeError
        ``values`` is text, not iterable, or holds something that is not an
        integer (the message gives its index).
    ValueError
        An id lies outside ``[0, vocab_size)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models._token_ids import check_token_ids
    >>> check_token_ids(np.array([1, 2]), 10)
    [1, 2]
    >>> check_token_ids([1, 2.0], 10)
    Traceback (most recent call last):
    ...
    TypeError: `token_ids` must hold ints; got float 2.0 at index 1
    """
    if isinstance(values, (str, bytes, bytearray)):
        raise TypeError(f"`{name}` must be token ids (ints), not text; got "
                        f"{_describe(values)}; encode() turns text into token ids")
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"`{name}` must be a sequence of ints; got {_describe(values)}"
                        ) from None
    out = []
    for k, value in enumerate(items):
        try:
            out.append(check_token_id(value, vocab_size, name=name))
        except TypeError:
            raise TypeError(f"`{name}` must hold ints; got {_describe(value)} at index {k}"
                            ) from None
    return out
