"""Fused attention on CUDA GPUs (``"numba_cuda"``): the entry points, and which kernel runs.

The family's kernels, each in its own module, none aware of the others:

* :mod:`.tensor_core`: ``mma.sync`` on tensor cores (FlashAttention-2 work
  split), for float16 and bfloat16 calls and float32 with
  ``POLYATTN_CUDA_FLOAT32=3xtf32``, wherever it takes them (its ``unsupported``);
* :mod:`.tiled`: register-tiled FFMA, the default for other float32 and
  float64 calls (``POLYATTN_CUDA_KERNEL=rows`` leaves them to the next one);
* :mod:`.rows`: one thread per query row, with key lanes and split-K for
  decoding shapes (``Tq <= DECODE_MAX_TQ``), and for calls that ask for its
  tile sizes or launch plan.

:func:`attention` picks among them (its ``arithmetic`` argument and
:func:`kernel_choice`); ``explain()`` names the arithmetic and the kernel.
:func:`backward` gives ``(dq, dk, dv)`` from the forward's ``out`` and ``lse``
in two more kernels: those of :mod:`.tiled_backward` (register patches, a dQ
pass over query tiles, a dK/dV pass over key tiles) where the forward is
register-tiled, else those of :mod:`.rows_backward` (one thread per query row
for ``dq``, one per key for ``dk`` and ``dv``). Both sum ``dk`` and ``dv``
over the query heads of a group without atomics and recompute every score and
dropout decision with the forward's rules (:mod:`polyattn.rules.element`).

Arrays: any array exposing ``__cuda_array_interface__`` (CuPy arrays, torch
CUDA tensors) is used in place, strides included; outputs are allocated by the
input library and returned as its arrays, the kernels run on its current
stream (:mod:`.inputs`, :mod:`.launch`). With ``NUMBA_ENABLE_CUDASIM=1`` NumPy arrays run on
Numba's CPU simulator (slow; for testing the kernels' logic). Head sizes go up
to ``MAX_HEAD_DIM`` (256; the ``chunked`` implementation has no limit). The
one-thread-per-row backward (decoding shapes, ``POLYATTN_CUDA_KERNEL=rows``) is
the simple version: at head size 64 (float32, sm_90) it uses 255 registers and
spills, and its dK/dV kernel rereads Q and dO once per key tile.
"""

from __future__ import annotations

from typing import Any

from polyattn.backends.cuda import rows, rows_backward, tensor_core, tiled, tiled_backward
from polyattn.backends.cuda.environment import (
    DTYPES,
    HEAD_DIM_BUCKETS,
    KERNEL_CHOICES,
    KERNEL_VARIABLE,
    MASK_KINDS,
    MAX_HEAD_DIM,
    availability,
    kernel_choice,
)
from polyattn.backends.cuda.inputs import (
    head_bucket,
    row_loads,
    vector_loads_fit,
    vector_loads_problem,
)
from polyattn.backends.cuda.launch import DECODE_MAX_TQ, launch_plan, launch_tiles
from polyattn.rules.online import non_finite_rows
from polyattn.rules.visibility import Rules

__all__ = [
    "DECODE_MAX_TQ", "DTYPES", "HEAD_DIM_BUCKETS", "KERNEL_CHOICES", "KERNEL_VARIABLE",
    "MASK_KINDS", "MAX_HEAD_DIM", "attention", "availability", "backward",
    "head_bucket", "kernel_choice", "launch_plan", "launch_tiles",
    "row_loads", "vector_loads_fit", "vector_loads_problem",
]

Array = Any


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None, rules: Rules,
              scale: float, xp: Any, block_q: int | None = None, block_k: int | None = None,
              decode: bool | None = None, num_splits: int | None = None,
              arithmetic: str | None = None) -> tuple[Array, Array]:
    """Fused attention on a CUDA GPU: ``(out, lse)`` in one kernel launch (two with
    split keys).

    See the module docstring for the kernels and :mod:`polyattn.backends` for the
    shared contract; ``rules`` (causality, windows, key lengths, soft-capping, ALiBi,
    per-row positions, dropout) are applied inside the kernels. ``block_q`` and ``block_k``
    override the one-thread-per-row kernel's tile sizes (threads per block, key rows
    per tile), ``decode`` and ``num_splits`` its launch plan
    (:func:`.launch.launch_plan`); they exist for tests and tuning (and keep that
    kernel). ``arithmetic`` (``"f16"``, ``"bf16"``, ``"3xtf32"``) runs the
    tensor-core kernel on float32 inputs where it can take the call
    (:func:`.tensor_core.unsupported`), else the exact kernels.

    Raises
    ------
    ValueError
        A head size above ``MAX_HEAD_DIM`` or a mask that does not broadcast.
    TypeError
        CPU arrays without the simulator, or a dtype other than float32/float64.
    ImportError
        numba-cuda is not installed.
    """
    out, lse = _attention(q, k, v, mask=mask, rules=rules, scale=scale, xp=xp,
                          block_q=block_q, block_k=block_k, decode=decode,
                          num_splits=num_splits, arithmetic=arithmetic)
    # a query row holding NaN or inf is NaN whatever the kernels made of its scores (all
    # -inf: reported as fully masked; soft-capped: finite); NaN never disappears
    bad = non_finite_rows(q, xp)                                       # (B…, H, Tq, 1)
    return out + bad, lse + bad[..., 0]


def _attention(q: Array, k: Array, v: Array, /, *, mask: Array | None, rules: Rules,
               scale: float, xp: Any, block_q: int | None, block_k: int | None, decode: bool | None,
               num_splits: int | None, arithmetic: str | None) -> tuple[Array, Array]:
    """:func:`attention` but for non-finite query rows: the kernel that takes the call."""
    tq, e = q.shape[-2:]
    ev = v.shape[-1]
    common = {"mask": mask, "rules": rules, "scale": scale, "xp": xp}
    if arithmetic is not None and tensor_core.unsupported(arithmetic, tq, e, ev) is None:
        return tensor_core.attention(q, k, v, arithmetic=arithmetic, **common)
    if _tiled_forward(block_q, block_k, decode, num_splits, tq):
        return tiled.attention(q, k, v, **common)
    return rows.attention(q, k, v, block_q=block_q, block_k=block_k, decode=decode,
                          num_splits=num_splits, **common)


def _tiled_forward(block_q: int | None, block_k: int | None, decode: bool | None,
                   num_splits: int | None, tq: int) -> bool:
    """Whether the register-tiled kernel takes an exact call (and so its backward)."""
    untuned = block_q is None and block_k is None and decode is None and num_splits is None
    return untuned and kernel_choice() == "tiled" and tiled.unsupported(tq) is None


def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array, /, *,
             mask: Array | None, rules: Rules, scale: float, xp: Any,
             grad_lse: Array | None = None, block_q: int | None = None,
             block_k: int | None = None) -> tuple[Array, Array, Array]:
    """Gradients ``(dq, dk, dv)`` of :func:`attention` on a CUDA GPU, in two kernel
    launches: the register-tiled kernels of :mod:`.tiled_backward` where the forward
    runs the register-tiled kernel (:func:`kernel_choice`, not for decoding shapes),
    else those of :mod:`.rows_backward` (``block_q`` and ``block_k`` set their tile
    sizes and keep them)."""
    common = {"mask": mask, "rules": rules, "scale": scale, "xp": xp, "grad_lse": grad_lse}
    if _tiled_forward(block_q, block_k, None, None, q.shape[-2]):
        return tiled_backward.backward(q, k, v, out, lse, grad_out, **common)
    return rows_backward.backward(q, k, v, out, lse, grad_out, block_q=block_q,
                                  block_k=block_k, **common)
