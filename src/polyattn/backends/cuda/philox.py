"""The dropout cipher as device code: Philox4x32-10's first word for a weight's index.

Every CUDA kernel, forward and backward, decides a weight's dropout with
:func:`philox_function`, the cipher of :mod:`polyattn.rules.dropout` on the
counter ``(n mod 2³², n div 2³², 0, 0)`` of the weight's flat index ``n``
(docs/semantics.rst), so that the backward recomputes the forward's decisions.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from polyattn._interop import simulator_enabled
from polyattn.backends.cuda.environment import _cuda
from polyattn.rules import dropout as _dropout


@functools.cache
def philox_function() -> Any:
    """The device function ``keep_word(n, key)``: the first output word x0 of
    Philox4x32-10 for the counter ``(n mod 2³², n div 2³², 0, 0)``.

    ``n`` is a weight's flat index in (B, H, Tq, Tk) (int64), ``key`` the two words
    of :func:`polyattn.rules.dropout.key_words` (uint64 holding 32 bits), as
    :func:`polyattn.rules.element.dropout_key` reads them from the rules' tuple.
    Words are uint64 holding 32-bit values: a 32 × 32-bit product fits, and its high
    and low words are a shift and a mask. A weight is kept iff the word is at least
    :func:`polyattn.rules.dropout.threshold` of ``p`` (:func:`polyattn.rules.element.kept`).
    """
    _cuda()
    u64 = np.uint64
    m0, m1, w0, w1 = u64(_dropout.M0), u64(_dropout.M1), u64(_dropout.W0), u64(_dropout.W1)
    mask32, shift32, zero = u64(_dropout.MASK32), u64(32), u64(0)
    rounds = _dropout.ROUNDS

    def keep_word(n, key):
        """x0 of Philox4x32-10((n mod 2³², n div 2³², 0, 0); key)."""
        counter = u64(n)
        c0 = counter & mask32
        c1 = counter >> shift32
        c2 = zero
        c3 = zero
        k0, k1 = key
        for _ in range(rounds):
            p0 = c0 * m0
            p1 = c2 * m1
            c0, c1, c2, c3 = ((p1 >> shift32) ^ c1 ^ k0, p1 & mask32,
                              (p0 >> shift32) ^ c3 ^ k1, p0 & mask32)
            k0 = (k0 + w0) & mask32
            k1 = (k1 + w1) & mask32
        return c0

    if simulator_enabled():
        return keep_word  # the simulator runs device code as Python
    from numba.cuda.extending import intrinsic

    # An intrinsic compiled into each calling kernel for the kernel's target: a
    # ``cuda.jit(device=True)`` function would ask a GPU for its architecture,
    # so kernels calling it could not be compiled to PTX without one.
    @intrinsic
    def keep_word_intrinsic(typingctx: Any, n: Any, key: Any) -> Any:
        from numba import types

        signature = types.uint64(n, key)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return context.compile_internal(builder, keep_word, sig, args)

        return signature, codegen

    return keep_word_intrinsic
