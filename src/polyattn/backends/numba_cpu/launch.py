"""A fused CPU kernel compiled with Numba: attention in SIMD register tiles, no BLAS.

The work split of :mod:`.numpy_chunked` (work items of (batch row, key/value
head, query block) holding the G query heads of a group, keys in blocks), with
every step in SIMD vectors across query rows:

- **Transposed panels.** An item's query rows are taken W at a time (two SIMD
  vectors: 32 float32 or 16 float64 rows with AVX-512). For a block of keys the
  kernel computes ``Sᵀ = scale·K·Qᵀ`` (keys × W), so that each query row is a
  column: its running maximum and sum, its exponentials and the rescale of its
  accumulated output are lanes of vector operations (:mod:`.tiles`), and
  ``Oᵀ += Vᵀ·Pᵀ`` follows. The scores' transform (docs/semantics.rst: soft-capping, ALiBi,
  the mask, the visible key range) runs column by column where it applies;
  keys no row of a panel may see are not computed.
- **Register tiles.** Both products are written in LLVM IR (Numba's own loops
  keep arrays in memory, and it turns LLVM's SLP vectoriser off): a tile keeps
  12 rows × 2 vectors of accumulators in registers (6 × 2 without AVX-512)
  while it runs down the shared dimension, one broadcast element of the left
  operand times two vector loads of the right one per step. The left
  operand's columns are contiguous runs: ``Qᵀ`` is laid out once per item and
  each block of keys is transposed once (``Kᵀ``; in the backward pass ``Vᵀ``
  too), both by whole SIMD blocks in registers, since a tile reading rows of
  ``K`` in place would need a pointer per row and spill its accumulators. The
  tile loops are kept rolled (LLVM unrolling them twice spilled too).
- **Exponentials**: Cody–Waite range reduction (``x = n·ln 2 + r``,
  ``|r| ≤ ln 2 / 2``), a polynomial for ``e^r`` (degree 6 in float32, 12 in
  float64) and ``2ⁿ`` (AVX-512's ``scalef``, else built in the exponent bits).
  Arguments below the smallest normal result give 0 (``e^-87.3`` in float32,
  ``e^-708.3`` in float64): such weights are below the rounding of a row whose
  largest weight is 1. ``-inf`` gives 0, NaN stays NaN.
- **Floating-point semantics kept.** ``fastmath`` allows reassociation and
  contraction but not the "no NaN / no inf" assumptions: ``-inf`` marks
  invisible keys as everywhere else in polyattn, and NaN and inf inputs
  propagate as docs/semantics.rst says.
- **Parallel over items** with ``prange``. Work items are independent, each
  writes its own rows of ``out`` and ``lse``: the result does not depend on
  the number of threads.


The family's modules: this one, its entry points (:func:`attention`, :func:`backward`,
and the kernel's state for ``explain`` and the command line); :mod:`.plan`, one call's
arrays and work items; :mod:`.parameters`, the rules lowered to the kernels'
parameters; :mod:`.threads`, the threading layer and the handing out of work items;
:mod:`.compiler`, compiling and Numba's cache; :mod:`.gradients`, the backward pass's
work; :mod:`.kernels` and :mod:`.tiles`, the compiled code.

Numba is imported when the kernel is first used; :func:`availability` says whether it
can run. A call that has to compile the kernel because Numba's cache does not hold it
says so first, in one line on the logger ``"polyattn.numba_cpu"`` (a child of
``"polyattn"``; level WARNING, so it reaches
stderr where logging is not configured;
``logging.getLogger("polyattn").setLevel(logging.ERROR)`` silences it), naming
``python -m polyattn warmup``. The NumPy code around the kernel computes under
``np.errstate(all="ignore")``: non-finite inputs give non-finite results
(docs/semantics.rst, "Non-finite inputs"), never a floating-point warning.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyattn.backends.numba_cpu import compiler, threads
from polyattn.backends.numba_cpu.compiler import (
    KernelUnavailable,
    availability,
    cache_state,
    cache_state_on_disk,
    tiles,
    warmup,
)
from polyattn.backends.numba_cpu.gradients import gradients
from polyattn.backends.numba_cpu.plan import Call
from polyattn.backends.numba_cpu.threads import threading_layer
from polyattn.rules.visibility import Rules

__all__ = ["KernelUnavailable", "attention", "availability", "backward", "cache_state",
           "cache_state_on_disk", "threading_layer", "tiles", "warmup"]


def attention(q: Any, k: Any, v: Any, /, *, mask: Any, rules: Rules, scale: float,
              xp: Any, into: Any = None) -> tuple[Any, Any]:
    """The fused kernel on NumPy arrays; see :mod:`polyattn.backends`.

    Every rule of :class:`Rules` is done here, dropout included. ``into``: ``(out, lse)``
    arrays to write the results into (used where they are C-contiguous and of the
    results' shapes and dtype; the results are then views of them).
    """
    with np.errstate(all="ignore"):        # e.g. a float mask cast to the compute dtype
        call = Call(q, k, v, mask, rules, scale)
    n_batch, h, tq = call.n_batch, call.h, call.tq
    out = _target(into, 0, (*call.batch, h, tq, call.ev), call.dtype,
                  (n_batch, h, tq, call.ev))
    lse = _target(into, 1, (*call.batch, h, tq), call.dtype, (n_batch, h, tq))
    items = call.query_items()
    if items.size:
        threads.run(compiler.kernels(call.dtype)["forward"], *call.common(), items,
                    call.fparams, call.iparams, out, lse,
                    threads.counter(compiler.item_address("forward", call.dtype)))
    return out.reshape((*call.batch, h, tq, call.ev)), lse.reshape((*call.batch, h, tq))


def _target(into: Any, index: int, shape: tuple[int, ...], dtype: np.dtype,
            flat: tuple[int, ...]) -> np.ndarray:
    """``into[index]`` as a ``flat``-shaped view where it can take a result of ``shape``
    and ``dtype`` (C-contiguous, writeable), else a new array."""
    if into is not None:
        a = into[index]
        if (isinstance(a, np.ndarray) and a.shape == shape and a.dtype == dtype
                and a.flags.c_contiguous and a.flags.writeable):
            return a.reshape(flat)
    return np.empty(flat, dtype=dtype)


def backward(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any, /, *, mask: Any,
             rules: Rules, scale: float, xp: Any, grad_lse: Any = None, into: Any = None,
             ) -> tuple[Any, Any, Any]:
    """Gradients (dq, dk, dv) of :func:`attention`, shaped like ``q``, ``k``, ``v``.

    One parallel loop over blocks of keys (:mod:`.gradients`): per block, dK and dV of
    its keys and its share of dQ, the weights recomputed from the scores and the saved
    ``lse``. ``into``: ``(dq, dk, dv)`` arrays to write the gradients into where they
    can take them (as for :func:`attention`).

    Examples
    --------
    >>> import numpy as np
    >>> import polyattn
    >>> from polyattn.backends.numba_cpu import launch
    >>> from polyattn.rules.visibility import Rules
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> kw = dict(mask=None, rules=Rules(5, 5, causal=True), scale=0.5, xp=np)
    >>> out, lse = launch.attention(q, k, v, **kw)
    >>> grads = launch.backward(q, k, v, out, lse, np.ones_like(out), **kw)
    >>> _, pullback = polyattn.attention_vjp(q, k, v, is_causal=True, scale=0.5,
    ...                                      implementation="reference")
    >>> want = pullback(np.ones_like(out))
    >>> all(np.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(grads, want))
    True
    """
    with np.errstate(all="ignore"):        # D = rowsum(dO∘O) of non-finite rows, casts
        return gradients(q, k, v, out, lse, grad_out, mask, rules, scale, grad_lse, into)
