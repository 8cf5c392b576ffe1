"""The rules users write (``score_mod``, ``mask_mod``, ``mod_args``) in the CUDA kernels.

A call's rules are traced once (:mod:`polyattn.rules.tracing`) and written as the
one-score functions ``score_element(x, b, h, q, kv, fb, ib, meta) -> (score,
derivative)`` and ``mask_element(b, h, q, kv, fb, ib, meta) -> visible``; the pair
of their source texts (:func:`user_key`, ``None`` for a rule the call does not have)
is a compile-time specialisation of the kernels that take them, which compile the
texts as inlined device functions (:func:`device_functions`). ``mod_args`` travel
as three flat buffers (:func:`polyattn.rules.scalar.pack`): the floating arrays in
the compute dtype, the integer ones as int64, and each array's offset and (size,
stride) per axis, contiguous (:func:`buffer_types`). Kernels without user rules
take 1-element placeholders.
"""

from __future__ import annotations

import functools
import hashlib
import math
import types
from typing import Any

import numpy as np

from polyattn._interop import to_numpy
from polyattn.rules import scalar, tracing

#: The specialisation key: (score_element source or None, mask_element source or None).
UserKey = tuple[str | None, str | None]


def user_key(rules: Any, dtype: str) -> tuple[UserKey | None, tuple[np.ndarray, ...]]:
    """``(key, (fb, ib, meta))`` of a call: the sources of its ``score_mod`` and
    ``mask_mod`` as one-score functions (``None`` where it has neither) and the
    ``mod_args`` buffers in ``dtype`` (placeholders without user rules)."""
    user = getattr(rules, "user", None)
    if user is None or (user.score_mod is None and user.mask_mod is None):
        return None, placeholders(dtype)
    arrays = tuple(np.asarray(to_numpy(a)) for a in user.mod_args)
    width = 1 + 2 * max([a.ndim for a in arrays], default=0)
    score = mask = None
    if user.score_mod is not None:
        traced = tracing.trace(user.score_mod, "score_mod", arrays)
        score = scalar.source(traced, "score_element", width)
    if user.mask_mod is not None:
        traced = tracing.trace(user.mask_mod, "mask_mod", arrays)
        mask = scalar.source(traced, "mask_element", width)
    return (score, mask), scalar.pack(arrays, np.dtype(dtype), width)


def placeholders(dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 1-element ``(fb, ib, meta)`` kernels without user rules take (never read)."""
    return (np.zeros(1, dtype=dtype), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))


def buffer_types(dtype: str) -> tuple[Any, Any, Any]:
    """The Numba types of ``(fb, ib, meta)`` in a kernel signature: contiguous 1-d
    arrays (:func:`polyattn.rules.scalar.pack` and :func:`placeholders` make them so).

    Contiguous, not any layout: an element's address is then the base plus a constant
    times its index, and the ``meta`` entries a rule reads are immediate offsets from
    one base register. With strides taken at run time each entry's address was held
    in a register pair across the kernel: the register-tiled forward and dQ kernels
    with a rule spilled 16-44 bytes (float32, head size 64), loads and stores of
    local memory in the forward's innermost loops among them; contiguous, none."""
    from numba import types as nt

    return (nt.Array(getattr(nt, dtype), 1, "C"), nt.Array(nt.int64, 1, "C"),
            nt.Array(nt.int64, 1, "C"))


def suffix(user: UserKey | None) -> str:
    """A kernel-name suffix that tells user-rule specialisations apart."""
    if user is None:
        return ""
    digest = hashlib.sha1(repr(user).encode()).hexdigest()[:10]
    return f"_user{digest}"


def _no_score(x: Any, b: Any, h: Any, q: Any, kv: Any, fb: Any, ib: Any, meta: Any) -> Any:
    return x, x


def _no_mask(b: Any, h: Any, q: Any, kv: Any, fb: Any, ib: Any, meta: Any) -> bool:
    return True


@functools.cache
def device_functions(user: UserKey | None, dtype: str) -> tuple[Any, Any]:
    """``(score_element, mask_element)`` of ``user`` compiled as inlined CUDA device
    functions computing in ``dtype`` (placeholders, never called, for a rule the call
    does not have)."""
    from polyattn.backends.cuda.environment import _cuda

    cuda = _cuda()
    device = functools.partial(cuda.jit, device=True, inline=True)
    t = np.dtype(dtype).type
    clamp = device(types.FunctionType(scalar.clamp.__code__, {"min": min, "max": max},
                                      "clamp"))
    names: dict[str, Any] = {"T": t, "math": math, "clamp": clamp, "tanh": math.tanh}
    score, mask = (None, None) if user is None else user
    out = []
    for text, form, placeholder in ((score, "score_element", _no_score),
                                    (mask, "mask_element", _no_mask)):
        if text is None:
            out.append(device(placeholder))
            continue
        scope = dict(names)
        exec(compile(text, f"<polyattn rule {form}>", "exec"), scope)
        out.append(device(scope[form]))
    return out[0], out[1]


def sample_key(dtype: str) -> UserKey:
    """A user-rule specialisation for compilation checks: a soft-capped score with a
    per-head bias from a table and a causal ``mask_mod`` reading a table of lengths."""
    from polyattn import ops

    def score_mod(s: Any, b: Any, h: Any, q: Any, kv: Any, bias: Any, lengths: Any) -> Any:
        return 20.0 * ops.tanh(s / 20.0) + bias[h, q - kv]

    def mask_mod(b: Any, h: Any, q: Any, kv: Any, bias: Any, lengths: Any) -> Any:
        return ops.logical_and(q >= kv, kv < lengths[b])

    arrays = (np.zeros((2, 8), dtype=dtype), np.zeros(2, dtype=np.int64))
    width = 1 + 2 * 2
    return (scalar.source(tracing.trace(score_mod, "score_mod", arrays), "score_element", width),
            scalar.source(tracing.trace(mask_mod, "mask_mod", arrays), "mask_element", width))
