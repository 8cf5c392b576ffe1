"""One (query, key) pair under the score rules, as scalar code every kernel compiles.

The Array-API paths apply the rules to whole tiles (:mod:`.visibility`); the
CPU and CUDA kernels apply them one score at a time, inside their loops. The
functions here are that scalar form, written once: plain Python on numbers
that Numba compiles into each kernel, forward and backward, through
:func:`polyattn.rules.lowering.lower`. Each kernel keeps its own loops and
memory layout and calls these for the rules.

The rule parameters
-------------------
A kernel takes the rules' run-time parameters as one tuple, ``rules``, built in
one place (:func:`polyattn.rules.lowering.kernel_parameters`, typed for kernel
signatures by :func:`~polyattn.rules.lowering.parameter_types`), and hands it to
the functions below, which alone read it: kernels never name a rule's parameter.
It holds one tuple per rule, by these indices:

* ``rules[MODIFIERS]``: ``(softcap,)`` in the compute type, 0 for none (ALiBi's
  slopes are a table: an array argument, read by :func:`head_slope`);
* ``rules[DROPOUT]``: ``(scale, threshold, key0, key1)``: ``1/(1-p)`` in the
  compute type, then the threshold and the Philox key words as unsigned words
  (threshold 0: no dropout);
* ``rules[REACH]``: ``(offset, shift, left, right)``, int64, the reaches of
  :func:`polyattn.rules.lowering.reach` (an unbounded side a large number).

A new rule's run-time parameter is a new entry there (and in
:func:`~polyattn.rules.lowering.kernel_parameters`) read by code here; the
kernels' signatures and arguments stay as they are.

The first functions work on numbers (:func:`position`, :func:`keys_in_reach`,
:func:`modifiers`, :func:`modify`, ...), for any caller; those taking ``rules``
read the tuple and call them. Integers are positions and key indices (int64 in
the kernels). ``T`` is the compute type's constructor (``numpy.float32`` or
``numpy.float64``) and ``WORD`` that of the unsigned words (``numpy.uint64``),
bound by :func:`~polyattn.rules.lowering.lower`; as plain Python they are
``float`` and ``int``.

Examples
--------
>>> rules = ((2.0,), (1.0, 0, 0, 0), (-4, 1, 2, 0))   # bottom-right (Tq = 4), window 2
>>> row_position(3, rules, 10)             # with key length 10
9
>>> visible(9, 9, rules, 10), visible(6, 9, rules, 10)
(True, False)
>>> round(modify(3.0, 5, 2, 2.0, 0.5, 0.25), 6)     # 2·tanh(3/2) - 0.25·|5 - 2|
1.060297
>>> row_keys(9, rules, 0, 10), block_queries(2, 3, 0, rules, 8)
((7, 10), (2, 6))
>>> drops(rules), drops(((0.0,), (1.25, 2**30, 7, 9), (0, 0, 0, 0)))
(False, True)

Every float is made by ``T`` (``T(1)``, not ``1``): Numba would compute an int64
literal with a float32 in float64.
"""

from __future__ import annotations

import math

T = float
WORD = int

#: Indices of the rule parameter tuple (module docstring), one entry per rule; numba-cuda
#: passes the entries as consecutive kernel parameters, in this order.
MODIFIERS, DROPOUT, REACH = 0, 1, 2


# --------------------------------------------------------------------------- #
# On numbers
# --------------------------------------------------------------------------- #

def position(i, offset, shift, length):  # type: ignore[no-untyped-def]
    """Query row ``i``'s position: ``i + offset``, plus the key length when ``shift`` is 1."""
    return i + offset + shift * length


def key_length(lengths, b):  # type: ignore[no-untyped-def]
    """Batch row ``b``'s key length from a (B,) table, or a (1,) one holding it for all."""
    length = lengths[0]
    if lengths.shape[0] > 1:
        length = lengths[b]
    return length


def head_slope(slopes, b, h):  # type: ignore[no-untyped-def]
    """The ALiBi slope of head ``h`` of batch row ``b`` from a (B|1, H|1) table."""
    sb = b if slopes.shape[0] > 1 else 0
    sh = h if slopes.shape[1] > 1 else 0
    return slopes[sb, sh]


def keys_in_reach(p_first, p_last, left, right, first, end):  # type: ignore[no-untyped-def]
    """Keys ``[lo, hi)`` of ``[first, end)`` that a query at some position in
    ``[p_first, p_last]`` may see, with reaches ``left`` and ``right`` (``lo >= hi``: none)."""
    return max(p_first - left, first), min(p_last + right + 1, end)


def modifiers(softcap, slope, unit):  # type: ignore[no-untyped-def]
    """``(cap, inv_cap, slope)`` for :func:`modify`, in scores scaled by ``unit`` (1, or
    log2(e) for scores kept in base 2): ``softcap <= 0`` means no soft-capping."""
    cap = softcap * unit
    inv_cap = T(0)
    if cap > 0:
        inv_cap = T(1) / cap
    return cap, inv_cap, slope * unit


def mask_steps(masked, mask, mask_batch, b, h):  # type: ignore[no-untyped-def]
    """Where batch row ``b``, head ``h`` reads a mask broadcast to (B, H, Tq, Tk):
    ``(mb, mh, mi_step, mj_step)``, a size-1 axis read at index 0 (``mask_batch`` maps
    the flat batch index to the mask's); zeros where the kernel has no mask (``masked``,
    a compile-time flag)."""
    mb = 0
    mh = 0
    mi_step = 0
    mj_step = 0
    if masked:
        mb = mask_batch[b]
        if mask.shape[1] > 1:
            mh = h
        if mask.shape[2] > 1:
            mi_step = 1
        if mask.shape[3] > 1:
            mj_step = 1
    return mb, mh, mi_step, mj_step


def modify(x, p, j, cap, inv_cap, slope):  # type: ignore[no-untyped-def]
    """The scaled score ``x`` after soft-capping (``cap > 0``; ``inv_cap = 1 / cap``) and ALiBi."""
    if cap > 0:
        x = cap * math.tanh(x * inv_cap)
    return x - slope * T(abs(p - j))


def modify_and_grad(x, p, j, cap, inv_cap, slope):  # type: ignore[no-untyped-def]
    """``(modify(x, p, j, …), modify_grad(x, …))`` with one ``tanh``: what a backward
    pass needs of a score (the derivative multiplies its ``dS``)."""
    t = T(0)
    if cap > 0:
        t = math.tanh(x * inv_cap)
        x = cap * t
    # A select, not a branch's value: the kernels' compiler then computes 1 - t² where
    # dS is (a value from the branch would stay live, in a register, across their loops).
    grad = T(1) - t * t if cap > 0 else T(1)
    return x - slope * T(abs(p - j)), grad


def modify_and_grad_branched(x, p, j, cap, inv_cap, slope):  # type: ignore[no-untyped-def]
    """:func:`modify_and_grad` with the derivative set inside the soft-cap branch: the
    same values for every input, another form for the kernels' compiler. A kernel takes
    the form it compiles into fewer spills (the one-thread-per-row dK/dV kernel takes
    this one: 7200 instead of 7316 bytes of spill stores in float64 at head size 128 on
    sm_80; the other kernels the select)."""
    grad = T(1)
    if cap > 0:
        t = math.tanh(x * inv_cap)
        x = cap * t
        grad = T(1) - t * t
    return x - slope * T(abs(p - j)), grad


def modify_grad(x, cap, inv_cap):  # type: ignore[no-untyped-def]
    """d(modified score) / d(scaled score) at the scaled score ``x`` (ALiBi adds a constant)."""
    if cap > 0:
        t = math.tanh(x * inv_cap)
        return T(1) - t * t
    return T(1)


# --------------------------------------------------------------------------- #
# From the rule parameters
# --------------------------------------------------------------------------- #

def row_position(i, rules, length):  # type: ignore[no-untyped-def]
    """Query row ``i``'s position (:func:`position`) in a batch row of key length ``length``."""
    offset, shift, _, _ = rules[REACH]
    return position(i, offset, shift, length)


def visible(j, p, rules, end):  # type: ignore[no-untyped-def]
    """Whether key ``j`` is visible to a query at position ``p`` (keys ``>= end`` do not exist)."""
    _, _, left, right = rules[REACH]
    # ``&``, not ``and``: three comparisons and no branch (a short-circuit ``and`` returned
    # as a value leaves a branch in the kernels' innermost loops, and costs them registers).
    return (j < end) & (j <= p + right) & (j >= p - left)


def row_keys(p, rules, first, end):  # type: ignore[no-untyped-def]
    """Keys ``[lo, hi)`` of ``[first, end)`` visible to a query at position ``p``: the
    ``j`` of :func:`visible`, as a range (``lo >= hi``: none)."""
    _, _, left, right = rules[REACH]
    return keys_in_reach(p, p, left, right, first, end)


def block_keys(first, last, pos_offset, rules, tk, length):  # type: ignore[no-untyped-def]
    """Keys ``[lo, hi)`` that some query row in ``[first, last]`` may see (``lo >= hi``: none),
    row ``i`` at position ``i + pos_offset``."""
    _, _, left, right = rules[REACH]
    lo = max(0, first + pos_offset - left)
    hi = min(tk, length, last + pos_offset + right + 1)
    return lo, hi


def block_queries(first, last, pos_offset, rules, tq):  # type: ignore[no-untyped-def]
    """Query rows ``[lo, hi)`` that may see some key in ``[first, last]`` (keys that exist;
    ``lo >= hi``: none): :func:`block_keys` the other way round."""
    _, _, left, right = rules[REACH]
    lo = max(0, first - right - pos_offset)
    hi = min(tq, last + left - pos_offset + 1)
    return lo, hi


def head_modifiers(mods, rules, slopes, b, h, unit):  # type: ignore[no-untyped-def]
    """:func:`modifiers` of head ``h`` of batch row ``b`` where the kernel has modifiers
    (``mods``, a compile-time flag), else zeros (nothing to read)."""
    cap = T(0)
    inv_cap = T(0)
    slope = T(0)
    if mods:
        cap, inv_cap, slope = modifiers(rules[MODIFIERS][0], head_slope(slopes, b, h), unit)
    return cap, inv_cap, slope


def drops(rules):  # type: ignore[no-untyped-def]
    """Whether weights are dropped at all (a threshold of 0 keeps every one)."""
    return rules[DROPOUT][1] != WORD(0)


def dropout_key(rules):  # type: ignore[no-untyped-def]
    """The two Philox key words (:func:`polyattn.rules.dropout.key_words`)."""
    return rules[DROPOUT][2], rules[DROPOUT][3]


def kept(word, rules):  # type: ignore[no-untyped-def]
    """Whether a weight whose Philox word (under :func:`dropout_key`) is ``word`` is kept."""
    return word >= rules[DROPOUT][1]


def kept_scale(rules):  # type: ignore[no-untyped-def]
    """The factor of a kept weight, ``1 / (1 - p)``."""
    return rules[DROPOUT][0]
