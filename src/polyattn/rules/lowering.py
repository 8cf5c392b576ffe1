"""The rules as kernel parameters, and the score element compiled for a target.

:func:`reach` turns :class:`~.visibility.Rules` into the four integers of
visibility (the position offset, the key-length shift flag, and the left and
right reach). :func:`kernel_parameters` is the one place that turns the rules
into what a kernel takes at run time: one tuple of per-rule tuples, read only by
the functions of :mod:`.element` (its indices ``MODIFIERS``, ``DROPOUT``,
``REACH``), whose Numba type :func:`parameter_types` gives for the kernels'
signatures; :func:`modifies` says whether a kernel needs its score-modifier
code. :func:`lower` compiles a function of :mod:`.element` for the CPU
(``numba.njit``) or the GPU (a CUDA device function) with its compute type bound.
Numba is imported only when something is lowered or typed.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from polyattn.rules import dropout as _dropout
from polyattn.rules import element
from polyattn.rules.visibility import Rules

#: An unbounded window side as a reach: farther than any key (positions are int64).
UNBOUNDED = 2**40


def reach(rules: Rules, unbounded: int = UNBOUNDED, *, covering: bool = False,
          ) -> tuple[int, int, int, int]:
    """``(offset, shift, left, right)``: ``p_i = i + offset + shift · key_lengths[b]``, and
    key ``j`` is visible iff ``p_i - left <= j <= p_i + right`` (and ``j < key_lengths[b]``).

    An unbounded side is ``unbounded``; every value is clamped to ``[-unbounded, unbounded]``.
    With ``covering``, a side that reaches every key from every query position (of
    :meth:`Rules.offset_range`) is unbounded too: a window wider than the problem is no
    window, and the paths that treat a window's edges specially skip that work.

    >>> reach(Rules(4, 6, causal=True, offset=2, window=(3, None)))
    (2, 0, 3, 0)
    >>> reach(Rules(4, 6, window=(3, 5)), covering=True) == (0, 0, UNBOUNDED, UNBOUNDED)
    True
    """
    offset, shift = (-rules.tq, 1) if rules.lengths_shift else (rules.offset, 0)
    left, right = rules.left_reach(), rules.right_reach()
    if covering:
        lo_off, hi_off = rules.offset_range()
        if left is not None and left >= rules.tq - 1 + hi_off:   # p_i - left <= 0 for all i
            left = None
        if right is not None and right >= rules.tk - 1 - lo_off:  # p_i + right >= Tk - 1
            right = None

    def bounded(x: int | None) -> int:
        return unbounded if x is None else max(-unbounded, min(int(x), unbounded))

    return bounded(offset), shift, bounded(left), bounded(right)


def window(rules: Rules) -> tuple[int | None, int | None] | None:
    """``rules``' reaches as a window of :class:`Rules` (``None``: an unbounded side, or no
    window at all), each side that covers the whole problem dropped (:func:`reach`)."""
    _, _, left, right = reach(rules, covering=True)
    sides = tuple(None if x == UNBOUNDED else x for x in (left, right))
    return None if sides == (None, None) else (sides[0], sides[1])


def kernel_parameters(rules: Rules, dtype: str) -> tuple[tuple[Any, ...], ...]:
    """The rules' run-time parameters as a kernel takes them: one tuple holding a tuple
    per rule at the indices of :mod:`.element` (``MODIFIERS``, ``DROPOUT``, ``REACH``;
    see its docstring), read there only. Integers are int64, floats in ``dtype``
    (``"float32"`` or ``"float64"``), dropout's threshold and key words uint64, so that
    every call gives the one type of :func:`parameter_types`.

    A rule with a run-time parameter adds its entry here and its reader in
    :mod:`.element`; kernels pass the tuple on whole.

    >>> (softcap,), dropout, offset_shift_reaches = kernel_parameters(
    ...     Rules(4, 6, causal=True, offset=2, softcap=30.0, dropout_p=0.5), "float32")
    >>> float(softcap), [int(x) for x in dropout], [int(x) for x in offset_shift_reaches]
    (30.0, [2, 2147483648, 0, 0], [2, 0, 1099511627776, 0])
    """
    import numpy as np

    t = np.dtype(dtype).type
    word = np.uint64
    if rules.dropout:
        key0, key1 = _dropout.key_words(rules.dropout_seed)
        dropout = (t(rules.dropout_scale), word(_dropout.threshold(rules.dropout_p)),
                   word(key0), word(key1))
    else:
        dropout = (t(1.0), word(0), word(0), word(0))
    parts = {
        element.MODIFIERS: (t(0.0 if rules.softcap is None else rules.softcap),),
        element.DROPOUT: dropout,
        element.REACH: tuple(np.int64(x) for x in reach(rules)),
    }
    return tuple(parts[index] for index in range(len(parts)))


@functools.cache
def parameter_types(dtype: str) -> Any:
    """The Numba type of :func:`kernel_parameters` in ``dtype``: a kernel signature's
    entry for the rules (numba-cuda passes a tuple argument as its elements)."""
    import numba

    return numba.typeof(kernel_parameters(Rules(1, 1), dtype))


def modifies(rules: Rules) -> bool:
    """Whether scores are modified after scaling (soft-capping or ALiBi): kernels compile
    :func:`.element.modify` into their loops only for such calls."""
    return rules.softcap is not None or rules.alibi is not None


def lower(function: Callable[..., Any], target: str, compute_type: Any = float) -> Any:
    """``function`` of :mod:`.element` compiled for ``target`` ("cpu" or "cuda") with ``T``
    bound to ``compute_type`` and ``WORD`` to ``numpy.uint64`` (once per combination),
    inlined into the kernels that call it."""
    return _lower(function, target, compute_type)


@functools.cache
def _lower(function: Callable[..., Any], target: str, compute_type: Any) -> Any:
    """``function`` of :mod:`.element` compiled for ``target`` ("cpu" or "cuda") with ``T``
    bound to ``compute_type``, inlined into the kernels that call it."""
    import numpy as np

    names = {**function.__globals__, "T": compute_type, "WORD": np.uint64}
    for name in function.__code__.co_names:   # the element's functions it calls, lowered too
        called = function.__globals__.get(name)
        if isinstance(called, types.FunctionType) and called.__module__ == function.__module__:
            names[name] = _lower(called, target, compute_type)
    bound = types.FunctionType(function.__code__, names, function.__name__,
                               function.__defaults__, function.__closure__)
    if target == "cuda":
        from numba import cuda

        return cuda.jit(device=True, inline=True)(bound)
    if target == "cpu":
        import numba

        return numba.njit(inline="always", nogil=True)(bound)
    raise ValueError(f"target must be 'cpu' or 'cuda', got {target!r}")
